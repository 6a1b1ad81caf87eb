//! Snapshots (capability `snapshots`): a run's filesystem and workspace saved, runs
//! started from them seeing exactly that and nothing of the source run's settings, each
//! on its own; the source untouched; ids that are not a snapshot refused; nothing left.

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use runcell_core::{
    DriverExt, ErrorKind, ExecSpec, Run, RunExt, RunSpec, Snapshot, SnapshotOptions,
};

use crate::{Context, TEST_CA, sh_stdout};

/// A spec from `snapshot` with this case's labels and network.
fn spec_from(cx: &Context, snapshot: &Snapshot) -> RunSpec {
    let mut spec = RunSpec::from_snapshot(snapshot);
    let base = cx.spec();
    spec.labels = base.labels;
    spec.network = base.network;
    spec
}

/// What a run sees of the files the source changed, as one line each.
const LOOK: &str = "cat /usr/local/snap-file; cat snap-ws/file; cat /tmp/tmp-file; \
     test -e /bin/vi && echo vi-present || echo vi-deleted; \
     echo SECRET=${SNAP_SECRET-unset} NEW=${SNAP_NEW-unset}; \
     test -e /etc/sandbox/ca.pem && echo ca-file || echo no-ca-file; \
     grep -c 'BEGIN CERT' /etc/ssl/certs/ca-certificates.crt 2>/dev/null || echo no-bundle; \
     pwd";

/// Change files in the image's directories, the workspace and /tmp, delete a file of the
/// image, snapshot (with a process writing all along), start two runs from it: each sees
/// the changes and the deletion, none of the source run's env or CA, and not the other's
/// later changes nor the source's; the source keeps running untouched; once the runs are
/// stopped the snapshot is removed and no longer listed.
pub async fn a_snapshot_starts_runs_with_its_files_and_nothing_else(
    cx: &Context,
) -> anyhow::Result<()> {
    let mut spec = cx.spec().env("SNAP_SECRET", "source-only");
    spec.ca_bundle = Some(TEST_CA.to_string());
    let source = cx.driver.start(&spec).await?;
    let before = sh_stdout(
        &*source,
        "echo usr-local > /usr/local/snap-file && mkdir -p snap-ws && echo ws > snap-ws/file \
         && echo tmp > /tmp/tmp-file && rm /bin/vi \
         && (grep -c 'BEGIN CERT' /etc/ssl/certs/ca-certificates.crt 2>/dev/null || echo no-bundle)",
    )
    .await?;
    let counter = source
        .exec_stream(ExecSpec::new([
            "sh",
            "-c",
            "i=0; while :; do i=$((i+1)); echo $i > /tmp/count.t; mv /tmp/count.t /tmp/count; sleep 0.05; done",
        ]))
        .await?;
    // The counter is under way (a loaded engine may start it late).
    let deadline = Instant::now() + Duration::from_secs(60);
    while sh_stdout(&*source, "cat /tmp/count 2>/dev/null || echo 0").await? == "0" {
        ensure!(
            Instant::now() < deadline,
            "the counter counted nothing in 60 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let snapshot = source
        .snapshot(SnapshotOptions::default().name("suite"))
        .await
        .context("snapshot")?;
    ensure!(snapshot.source_run == source.id(), "{snapshot:?}");
    ensure!(snapshot.name() == Some("suite"), "{snapshot:?}");
    ensure!(
        snapshot.size_bytes > 0,
        "a snapshot of changes with no size: {snapshot:?}"
    );
    let listed = cx.driver.snapshots().await?;
    ensure!(
        listed.iter().any(|s| s.id == snapshot.id),
        "{} is not listed: {listed:?}",
        snapshot.id
    );
    // The source goes on: its writer still counts, and what it writes now is its own.
    let c1: u64 = sh_stdout(&*source, "cat /tmp/count").await?.parse()?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let c2: u64 = sh_stdout(&*source, "cat /tmp/count").await?.parse()?;
    ensure!(
        c2 > c1,
        "the source's writer stopped at the snapshot ({c1} -> {c2})"
    );
    sh_stdout(&*source, "echo later > /usr/local/source-later").await?;

    let runs = cx
        .driver
        .fork(&spec_from(cx, &snapshot).env("SNAP_NEW", "mine"), 2)
        .await
        .context("fork")?;
    ensure!(runs.len() == 2);
    let bundle_line = if before == "no-bundle" {
        "no-bundle".to_string()
    } else {
        // The image's own count: the source's CA taken back out.
        (before.parse::<u64>()? - 1).to_string()
    };
    let expected = format!(
        "usr-local\nws\ntmp\nvi-deleted\nSECRET=unset NEW=mine\nno-ca-file\n{bundle_line}\n{}",
        snapshot.workspace_path
    );
    for run in &runs {
        let seen = sh_stdout(&**run, LOOK).await?;
        ensure!(
            seen == expected,
            "a run from the snapshot sees\n{seen}\nnot\n{expected}"
        );
        let later = sh_stdout(&**run, "cat /usr/local/source-later 2>/dev/null; true").await?;
        ensure!(
            later.is_empty(),
            "a run from the snapshot sees what the source wrote after it"
        );
    }
    sh_stdout(
        &*runs[0],
        "echo a > /usr/local/only-a && echo a > snap-ws/only-a",
    )
    .await?;
    for run in [&*runs[1], &*source] {
        let seen = sh_stdout(
            run,
            "cat /usr/local/only-a snap-ws/only-a 2>/dev/null; true",
        )
        .await?;
        ensure!(
            seen.is_empty(),
            "one run's change is seen by another: {seen:?}"
        );
    }
    drop(counter);
    for run in runs {
        run.stop().await?;
    }
    source.stop().await?;
    cx.driver.remove_snapshot(&snapshot.id).await?;
    let listed = cx.driver.snapshots().await?;
    ensure!(
        !listed.iter().any(|s| s.id == snapshot.id),
        "{} is still listed after its removal",
        snapshot.id
    );
    // Removing again is success; a run from it now is a typed error, nothing created.
    cx.driver.remove_snapshot(&snapshot.id).await?;
    match cx.driver.create(&spec_from(cx, &snapshot)).await {
        Ok(run) => {
            run.stop().await?;
            bail!("a run started from a removed snapshot");
        }
        Err(e) => ensure!(
            e.kind() == ErrorKind::NotFound && e.field() == Some("from_snapshot"),
            "{e}"
        ),
    }
    Ok(())
}

/// Files written without pause while the snapshot is taken (the run is never frozen).
/// Each file is written whole under a temporary name, then renamed into its numbered
/// place, in order, in the workspace and in the image's filesystem: a run from the
/// snapshot finds files 1..n with no gap in each, each whole, and the source's writer
/// never stopped.
pub async fn a_snapshot_of_files_being_written_has_each_whole(cx: &Context) -> anyhow::Result<()> {
    let source = cx.driver.start(&cx.spec()).await?;
    let writer = source
        .exec_stream(ExecSpec::new([
            "sh",
            "-c",
            "mkdir -p w /usr/local/w; i=0; while :; do i=$((i+1)); \
             head -c 20000 /dev/zero | tr '\\0' x > w/.t; echo >> w/.t; echo $i >> w/.t; mv w/.t w/$i; \
             echo $i > /usr/local/w/.t; mv /usr/local/w/.t /usr/local/w/$i; done",
        ]))
        .await?;
    // The writer is under way (a loaded engine may start it late).
    let deadline = Instant::now() + Duration::from_secs(60);
    while sh_stdout(&*source, "ls w 2>/dev/null | wc -l")
        .await?
        .parse::<u64>()?
        < 3
    {
        ensure!(
            Instant::now() < deadline,
            "the writer wrote nothing in 60 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let snapshot = source.snapshot(SnapshotOptions::default()).await?;
    let at = sh_stdout(&*source, "ls w | sort -n | tail -1").await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = sh_stdout(&*source, "ls w | sort -n | tail -1").await?;
    let number = |t: &str| {
        t.parse::<u64>()
            .with_context(|| format!("not a number: {t:?}"))
    };
    ensure!(
        number(&after)? > number(&at)?,
        "the source's writer stopped ({at} -> {after})"
    );
    drop(writer);
    let run = cx.driver.start(&spec_from(cx, &snapshot)).await?;
    let check = "n=$(ls w | sort -n | tail -1); m=$(ls /usr/local/w | sort -n | tail -1); \
         i=1; while [ $i -le $n ]; do [ \"$(tail -n1 w/$i)\" = $i ] || echo bad-ws-$i; \
         [ $(wc -c < w/$i) -eq $((20000 + ${#i} + 2)) ] || echo short-ws-$i; i=$((i+1)); done; \
         i=1; while [ $i -le $m ]; do [ \"$(cat /usr/local/w/$i)\" = $i ] || echo bad-root-$i; i=$((i+1)); done; \
         echo n=$n m=$m";
    let seen = sh_stdout(&*run, check).await?;
    let last = seen.lines().last().unwrap_or_default().to_string();
    ensure!(seen.lines().count() == 1, "torn or missing files: {seen}");
    let (n, m) = last
        .strip_prefix("n=")
        .and_then(|r| r.split_once(" m="))
        .context(last.clone())?;
    let (n, m) = (
        number(n).with_context(|| seen.clone())?,
        number(m).with_context(|| seen.clone())?,
    );
    ensure!(n > 0 && m > 0, "{last}");
    run.stop().await?;
    source.stop().await?;
    cx.driver.remove_snapshot(&snapshot.id).await?;
    Ok(())
}

/// What is not a snapshot is refused with a typed error naming the field, before anything
/// is created: an id of no snapshot, a snapshot id with an image that is not its image, a
/// malformed id, a host workspace with a snapshot.
pub async fn what_is_not_a_snapshot_is_refused(cx: &Context) -> anyhow::Result<()> {
    let source = cx.driver.start(&cx.spec()).await?;
    let snapshot = source.snapshot(SnapshotOptions::default()).await?;
    let mut nobody = spec_from(cx, &snapshot);
    nobody.from_snapshot = Some(runcell_core::new_snapshot_id());
    let mut other_image = spec_from(cx, &snapshot);
    other_image.image = cx.image.clone();
    let mut malformed = spec_from(cx, &snapshot);
    malformed.from_snapshot = Some("snap-../../x".into());
    let host = tempfile::tempdir()?;
    let with_host = spec_from(cx, &snapshot).workspace_dir(host.path());
    for (what, spec, kind, field) in [
        (
            "an id of no snapshot",
            nobody,
            ErrorKind::NotFound,
            "from_snapshot",
        ),
        (
            "another image",
            other_image,
            ErrorKind::NotFound,
            "from_snapshot",
        ),
        (
            "a malformed id",
            malformed,
            ErrorKind::InvalidSpec,
            "from_snapshot",
        ),
        (
            "a host workspace",
            with_host,
            ErrorKind::InvalidSpec,
            "workspace.host_dir",
        ),
    ] {
        match cx.driver.create(&spec).await {
            Ok(run) => {
                run.stop().await?;
                bail!("{what}: a run was created");
            }
            Err(e) => ensure!(
                e.kind() == kind && e.field() == Some(field),
                "{what}: expected {kind} naming {field}, got {e}"
            ),
        }
    }
    let bad = cx.driver.remove_snapshot("snap-zz").await;
    ensure!(
        bad.as_ref()
            .is_err_and(|e| e.kind() == ErrorKind::InvalidSpec),
        "{bad:?}"
    );
    cx.driver
        .remove_snapshot(&runcell_core::new_snapshot_id())
        .await
        .context("removing a snapshot that does not exist")?;
    let bad_name = source
        .snapshot(SnapshotOptions::default().name("a name"))
        .await;
    ensure!(
        bad_name
            .as_ref()
            .is_err_and(|e| e.kind() == ErrorKind::InvalidSpec),
        "{bad_name:?}"
    );
    source.stop().await?;
    cx.driver.remove_snapshot(&snapshot.id).await?;
    Ok(())
}

/// A driver without snapshots says so: `Unsupported` for a snapshot and for a run from
/// one, before anything is created. One whose snapshots need the exec helper, with the
/// helper off, refuses the snapshot and still starts runs from snapshots: a missing one
/// is `NotFound` naming `from_snapshot`.
pub async fn snapshots_are_unsupported_where_there_are_none(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    let e = run
        .snapshot(SnapshotOptions::default())
        .await
        .err()
        .context("a snapshot on a driver without snapshots")?;
    ensure!(e.kind() == ErrorKind::Unsupported, "{e}");
    run.stop().await?;
    let mut spec = cx.spec();
    spec.from_snapshot = Some(runcell_core::new_snapshot_id());
    spec.pull = runcell_core::PullPolicy::Never;
    let e = cx
        .driver
        .create(&spec)
        .await
        .err()
        .context("a run from a snapshot on a driver without snapshots")?;
    let expected = if cx.driver.capabilities().snapshots_with_helper {
        ErrorKind::NotFound
    } else {
        ErrorKind::Unsupported
    };
    ensure!(
        e.kind() == expected && e.field() == Some("from_snapshot"),
        "{e}"
    );
    Ok(())
}

/// What a run's code may leave, kept as it was: hard links, symbolic links, a fifo, a
/// setuid bit, a 200-byte name, a nested workspace whose parent is private (0700 stays
/// 0700); the library's CA comes out of the system bundle even after the run appended to
/// it. A workspace file named like a layer whiteout is refused (`Unsupported` naming
/// `snapshot`), and a snapshot given up midway leaves nothing.
pub async fn a_snapshot_keeps_odd_files_and_refuses_whiteouts(cx: &Context) -> anyhow::Result<()> {
    let count = "grep -c 'BEGIN CERT' /etc/ssl/certs/ca-certificates.crt 2>/dev/null || echo none";
    let plain = cx.driver.start(&cx.spec()).await?;
    let image_count = sh_stdout(&*plain, count).await?;
    plain.stop().await?;
    let mut spec = cx.spec().workspace_path("/srv/app");
    spec.ca_bundle = Some(TEST_CA.to_string());
    let source = cx.driver.start(&spec).await?;
    let long = "n".repeat(200);
    sh_stdout(
        &*source,
        &format!(
            "chmod 700 /srv && mkdir -p d && echo x > d/f && ln d/f hard && ln -s d/f soft \
             && mkfifo fifo && touch {long} && chmod 4755 d/f \
             && (test ! -f /etc/ssl/certs/ca-certificates.crt || echo '# local' >> /etc/ssl/certs/ca-certificates.crt)"
        ),
    )
    .await?;
    let started = Instant::now();
    let snapshot = source.snapshot(SnapshotOptions::default()).await?;
    let took = started.elapsed();
    let run = cx.driver.start(&spec_from(cx, &snapshot)).await?;
    let seen = sh_stdout(
        &*run,
        &format!(
            "stat -c %a /srv; [ $(stat -c %i d/f) = $(stat -c %i hard) ] && echo linked; \
             readlink soft; test -p fifo && echo fifo; test -e {long} && echo long; \
             stat -c %a d/f; {count}; pwd"
        ),
    )
    .await?;
    let expected = format!("700\nlinked\nd/f\nfifo\nlong\n4755\n{image_count}\n/srv/app");
    ensure!(
        seen == expected,
        "a run from the snapshot sees\n{seen}\nnot\n{expected}"
    );
    run.stop().await?;
    cx.driver.remove_snapshot(&snapshot.id).await?;

    sh_stdout(&*source, "touch .wh.zz").await?;
    match source.snapshot(SnapshotOptions::default()).await {
        Ok(s) => {
            cx.driver.remove_snapshot(&s.id).await?;
            bail!("a workspace file named .wh.zz went into a snapshot");
        }
        Err(e) => ensure!(
            e.kind() == ErrorKind::Unsupported && e.field() == Some("snapshot"),
            "{e}"
        ),
    }
    sh_stdout(&*source, "rm .wh.zz").await?;
    for ms in [30, 200] {
        let given_up = tokio::time::timeout(
            Duration::from_millis(ms),
            source.snapshot(SnapshotOptions::default()),
        )
        .await;
        if let Ok(made) = given_up {
            cx.driver.remove_snapshot(&made?.id).await?;
        }
    }
    // A snapshot given up goes on in the background and removes what it made: once
    // both had the time of a whole one (three times over), none is left.
    tokio::time::sleep(took * 3 + Duration::from_secs(5)).await;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let left: Vec<String> = cx
            .driver
            .snapshots()
            .await?
            .into_iter()
            .filter(|s| s.source_run == source.id())
            .map(|s| s.id)
            .collect();
        if left.is_empty() {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "snapshots given up were left: {left:?}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    source.stop().await?;
    Ok(())
}

/// Whether `run` keeps exec records (`execs()`: detached execs, reattach), which need the
/// exec helper's private directory in the helper's place.
async fn keeps_exec_records(run: &dyn Run) -> anyhow::Result<bool> {
    run.exec(ExecSpec::new(["true"])).await?;
    match run.execs().await {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == ErrorKind::Unsupported => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// A run from a snapshot started as a user other than root has what a fresh run of that
/// user has: exec records (a snapshot's image must not take from a fork what the engine
/// gives a fresh run in the helper's place).
pub async fn a_run_from_a_snapshot_as_another_user_keeps_exec_records(
    cx: &Context,
) -> anyhow::Result<()> {
    let mut as_user = cx.spec();
    as_user.user = Some("1000".into());
    let fresh = cx.driver.start(&as_user).await?;
    let fresh_has = keeps_exec_records(&*fresh).await;
    fresh.stop().await?;
    let source = cx.driver.start(&cx.spec()).await?;
    let snapshot = source.snapshot(SnapshotOptions::default()).await;
    source.stop().await?;
    let snapshot = snapshot?;
    let mut from = spec_from(cx, &snapshot);
    from.user = Some("1000".into());
    let fork_has = match cx.driver.start(&from).await {
        Ok(fork) => {
            let has = keeps_exec_records(&*fork).await;
            fork.stop().await?;
            has
        }
        Err(e) => Err(e.into()),
    };
    cx.driver.remove_snapshot(&snapshot.id).await?;
    let (fresh_has, fork_has) = (fresh_has?, fork_has?);
    ensure!(
        fork_has == fresh_has,
        "a fresh run as user 1000 keeps exec records: {fresh_has}; a run from a snapshot as that user: {fork_has}"
    );
    Ok(())
}
