//! Creation, validation, stop, guards, attach.

use std::time::Duration;

use anyhow::{bail, ensure};
use runcell_core::{DriverExt, ErrorKind, ExecSpec, RunExt};

use crate::{Context, sh_stdout};

/// Invalid specs fail with `InvalidSpec` naming the field, and nothing is created.
pub async fn invalid_specs_are_rejected_before_anything_exists(cx: &Context) -> anyhow::Result<()> {
    let base = cx.spec();
    let mut cases = vec![
        ("image", {
            let mut s = base.clone();
            s.image = String::new();
            s
        }),
        ("env[0].name", base.clone().env("A=B", "x")),
        ("env[0].name", base.clone().env("", "x")),
        ("env[0].value", base.clone().env("A", "nul\0")),
        (
            "post_create[0]",
            base.clone().post_create(Vec::<String>::new()),
        ),
        (
            "post_create[0][1]",
            base.clone().post_create(["echo", "a\0b"]),
        ),
        ("working_dir", {
            let mut s = base.clone();
            s.working_dir = Some("relative/dir".into());
            s
        }),
        ("workspace.path", {
            let mut s = base.clone();
            s.workspace.path = "workspace".into();
            s
        }),
        (
            "labels[\"not a key\"]",
            base.clone().label("not a key", "v"),
        ),
        ("ca_bundle", {
            let mut s = base.clone();
            s.ca_bundle =
                Some("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n".into());
            s
        }),
    ];
    if !cx.caps.user_names {
        let mut s = base.clone();
        s.user = Some("nobody".into());
        cases.push(("user", s));
    }
    for (field, spec) in cases {
        match cx.driver.create(&spec).await {
            Ok(run) => {
                run.stop().await?;
                bail!("a spec with a bad {field} was accepted");
            }
            Err(e) => {
                let want = if field == "user" {
                    ErrorKind::Unsupported
                } else {
                    ErrorKind::InvalidSpec
                };
                ensure!(e.kind() == want, "bad {field}: expected {want}, got {e}");
                ensure!(
                    e.field() == Some(field),
                    "bad {field}: the error names {:?}: {e}",
                    e.field()
                );
            }
        }
    }
    let run = cx.driver.start(&cx.spec()).await?;
    for (field, spec) in [
        ("argv", ExecSpec::new(Vec::<String>::new())),
        ("argv[1]", ExecSpec::new(["echo", "a\0"])),
        ("working_dir", ExecSpec::new(["true"]).working_dir("rel")),
        ("env[0].name", ExecSpec::new(["true"]).env("X=Y", "1")),
    ] {
        let e = match run.exec(spec).await {
            Ok(out) => bail!("an exec with a bad {field} ran: {}", out.status),
            Err(e) => e,
        };
        ensure!(
            e.kind() == ErrorKind::InvalidSpec && e.field() == Some(field),
            "bad exec {field}: {e}"
        );
    }
    run.stop().await?;
    Ok(())
}

/// The image's ENTRYPOINT/CMD never run; the run's own process only keeps it alive.
pub async fn entrypoint_never_runs(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mark = sh_stdout(&*run, "test -e /entrypoint-ran && echo ran || echo clean").await?;
    ensure!(mark == "clean", "the image's entrypoint ran");
    let procs = sh_stdout(
        &*run,
        "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done",
    )
    .await?;
    ensure!(
        procs.contains("sleep infinity"),
        "no `sleep infinity` keeps the run alive: {procs}"
    );
    ensure!(
        !procs.contains("entrypoint-ran"),
        "the entrypoint is running: {procs}"
    );
    run.stop().await?;
    Ok(())
}

/// Stop twice is fine, leaves nothing, and later execs fail as run-lost.
pub async fn stop_is_idempotent_and_leaves_nothing(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.create(&cx.spec()).await?;
    ensure!(
        !cx.driver.list(&cx.case_selector()).await?.is_empty(),
        "list does not show the live run"
    );
    run.stop().await?;
    run.stop().await?;
    cx.driver.remove(run.id()).await?;
    cx.assert_case_clean().await?;
    match run.exec(ExecSpec::new(["true"])).await {
        Ok(out) => bail!("exec after stop returned {}", out.status),
        Err(e) => ensure!(
            e.kind() == ErrorKind::RunLost,
            "exec after stop: expected run lost, got {e}"
        ),
    }
    Ok(())
}

/// Dropping the guard removes the run.
pub async fn dropped_guard_cleans_up(cx: &Context) -> anyhow::Result<()> {
    let guard = cx.driver.start(&cx.spec()).await?;
    drop(guard);
    cx.assert_case_clean().await
}

/// A panic while holding the guard still removes the run.
pub async fn guard_cleans_up_on_panic(cx: &Context) -> anyhow::Result<()> {
    let driver = cx.driver.clone();
    let spec = cx.spec();
    let task = tokio::spawn(async move {
        let _guard = driver.start(&spec).await.expect("start");
        panic!(
            "deliberate panic of the conformance suite: the guard must clean up while unwinding"
        );
    });
    ensure!(
        task.await.is_err_and(|e| e.is_panic()),
        "the task did not panic"
    );
    cx.assert_case_clean().await
}

/// Another handle attached by id sees the same target.
pub async fn attach_sees_the_same_run(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    sh_stdout(&*run, "echo attached > marker").await?;
    let again = cx.driver.attach(run.id()).await?;
    ensure!(again.id() == run.id());
    ensure!(sh_stdout(&*again, "cat marker").await? == "attached");
    match cx.driver.attach("sbx-doesnotexist").await {
        Ok(_) => bail!("attached to a run that does not exist"),
        Err(e) => ensure!(
            e.kind() == ErrorKind::NotFound,
            "attach to a missing run: {e}"
        ),
    }
    run.stop().await?;
    Ok(())
}

/// A run id or selector a caller gives is checked before any engine sees it: ids that
/// would be another path, another name or another selector term on some engine (`/`,
/// `..`, `,`, `=`, upper case, spaces, empty, too long) are `InvalidSpec` naming
/// `run_id` or `selector[KEY]`, never a backend error, and a live run is untouched by them.
pub async fn malformed_run_ids_and_selectors_are_refused(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    let id = run.id().to_string();
    let bad_ids = [
        String::new(),
        format!("{id}/.."),
        format!("../{id}"),
        format!("{id},x"),
        format!("{id} "),
        id.to_uppercase(),
        format!("{id}?force=1"),
        "-x".to_string(),
        "a".repeat(64),
    ];
    for bad in &bad_ids {
        match cx.driver.attach(bad).await {
            Ok(_) => bail!("attached to {bad:?}"),
            Err(e) => ensure!(
                e.kind() == ErrorKind::InvalidSpec && e.field() == Some("run_id"),
                "attach({bad:?}): expected InvalidSpec naming run_id, got {e}"
            ),
        }
        match cx.driver.remove(bad).await {
            Ok(()) => bail!("remove({bad:?}) succeeded"),
            Err(e) => ensure!(
                e.kind() == ErrorKind::InvalidSpec && e.field() == Some("run_id"),
                "remove({bad:?}): expected InvalidSpec naming run_id, got {e}"
            ),
        }
    }
    let key = runcell_core::labels::RUN_ID.to_string();
    for value in [format!("{id},x"), format!("{id}!=y"), "a b".to_string()] {
        let selector = std::collections::BTreeMap::from([(key.clone(), value.clone())]);
        match cx.driver.list(&selector).await {
            Ok(found) => bail!("list with {key}={value:?} answered {} runs", found.len()),
            Err(e) => ensure!(
                e.kind() == ErrorKind::InvalidSpec
                    && e.field() == Some(format!("selector[{key}]").as_str()),
                "list with {key}={value:?}: expected InvalidSpec naming the selector, got {e}"
            ),
        }
    }
    ensure!(
        sh_stdout(&*run, "echo alive").await? == "alive",
        "the run did not survive the malformed ids"
    );
    run.stop().await?;
    cx.assert_case_clean().await
}

/// Dropping the future of `create` at any point (cancellation) leaves nothing behind.
pub async fn cancelled_create_leaves_nothing(cx: &Context) -> anyhow::Result<()> {
    let spec = cx.spec().post_create(["sleep", "0.2"]);
    for delay_ms in [5, 50, 150, 300, 600, 1200] {
        if let Ok(run) =
            tokio::time::timeout(Duration::from_millis(delay_ms), cx.driver.create(&spec)).await
        {
            run?.stop().await?;
        }
    }
    // The cleanup of a cancelled create runs in the background, twice, 2 s apart.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let left = cx.driver.list(&cx.case_selector()).await?;
        if left.is_empty() {
            return Ok(());
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "cancelled creates left {:?}",
            left.iter().map(|r| &r.id).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// An image that is not present and may not be pulled fails with `NotFound` naming it,
/// and nothing is left. (Pull policy `Never`: the suite sends nothing to any registry.)
pub async fn missing_image_is_not_found(cx: &Context) -> anyhow::Result<()> {
    let image = "sandbox-test/does-not-exist:never";
    let mut spec = cx.spec();
    spec.image = image.into();
    spec.pull = runcell_core::PullPolicy::Never;
    match cx.driver.create(&spec).await {
        Ok(run) => {
            run.stop().await?;
            bail!("a run started from a missing image");
        }
        Err(e) => {
            ensure!(
                e.kind() == ErrorKind::NotFound,
                "expected not found, got {e}"
            );
            ensure!(
                e.to_string().contains(image),
                "the error does not name the image: {e}"
            );
        }
    }
    cx.assert_case_clean().await
}

/// `create` succeeds only when the target runs and answers an exec: an image without
/// `sleep`, one whose `sleep` exits at once, and (where pids limits exist) a limit too
/// small to start are `StartFailed` (or `NotFound` for an image the backend cannot use)
/// within a bound, saying why, and nothing is left.
pub async fn keepalive_that_cannot_run_fails_create(cx: &Context) -> anyhow::Result<()> {
    let mut cases = vec![
        ("no sleep", cx.spec_with_image(&crate::no_sleep_image())),
        (
            "sleep exits",
            cx.spec_with_image(&crate::sleep_exits_image()),
        ),
    ];
    if cx.caps.pids_limit {
        cases.push(("pids limit 1", cx.spec().pids(1)));
    }
    for (what, spec) in cases {
        let started = std::time::Instant::now();
        let result = tokio::time::timeout(Duration::from_secs(90), cx.driver.create(&spec))
            .await
            .map_err(|_| anyhow::anyhow!("{what}: create hung"))?;
        match result {
            Ok(run) => {
                let status = run.exec(ExecSpec::new(["true"])).await.map(|o| o.status);
                run.stop().await?;
                bail!("{what}: create returned a run (first exec: {status:?})");
            }
            Err(e) => {
                ensure!(
                    e.kind() == ErrorKind::StartFailed,
                    "{what}: expected StartFailed, got {e}"
                );
                // Well before a ready timeout (Kubernetes': 120 s). Unloaded it takes a
                // second or two. An exec into a container that is exiting may hang (the
                // helper's upload did, for its minute-long bound, and CI runs took 81.8 s
                // and over 90 s): every exec of a create is watched, and a target found
                // gone ends it within a second.
                ensure!(
                    started.elapsed() < Duration::from_secs(60),
                    "{what}: took {:?}",
                    started.elapsed()
                );
            }
        }
        cx.assert_case_clean().await?;
    }
    Ok(())
}

/// `create_with` reports its steps to a progress callback, and a detached run carries no
/// owner, so `reap` keeps it although its creator (this process) is irrelevant to it.
pub async fn progress_is_reported_and_detached_runs_have_no_owner(
    cx: &Context,
) -> anyhow::Result<()> {
    use std::sync::{Arc, Mutex};
    let events = Arc::new(Mutex::new(Vec::new()));
    let seen = events.clone();
    let options = runcell_core::CreateOptions::default()
        .progress(move |p| seen.lock().unwrap().push(p.to_string()))
        .detached(true);
    let spec = cx.spec().post_create(["true"]);
    let run = cx.driver.start_with(&spec, options).await?;
    let events = events.lock().unwrap().clone();
    ensure!(
        events.iter().any(|e| e.contains("post-create 1/1")),
        "progress events: {events:?}"
    );
    let info = cx.driver.list(&cx.case_selector()).await?;
    ensure!(info.len() == 1, "{info:?}");
    let labels = &info[0].labels;
    ensure!(
        !labels.contains_key(runcell_core::labels::OWNER_PID),
        "a detached run has an owner: {labels:?}"
    );
    let reaped = runcell_core::reap(&*cx.driver, &cx.case_selector()).await?;
    ensure!(
        reaped.is_empty(),
        "reap removed a live detached run: {reaped:?}"
    );
    run.stop().await?;
    Ok(())
}
