//! Results that mean exactly what they say: an image named by the caller is that image,
//! never one whose ID happens to begin with the name; a timed-out exec reported as
//! `TimedOut` has no process left, and one whose processes could not be killed says so.

use std::time::{Duration, Instant};

use anyhow::{bail, ensure};
use runcell_core::{DriverExt, ErrorKind, ExecSpec, ExitStatus, PullPolicy, RunExt};

use crate::{Context, sh_stdout};

/// The full ID (`sha256:...`) of the suite's image, when the caller knows it (`cargo xtask
/// test` sets it): the case then also tries the ID's short form and the whole ID.
pub const IMAGE_ID_ENV: &str = "RUNCELL_CONFORMANCE_IMAGE_ID";

/// Engines resolve a hex string that names no image as the prefix of an image ID. Every
/// one-digit hex name (and, when [`IMAGE_ID_ENV`] is set, the suite image's 12-digit short
/// ID) with pull policy `never` is `NotFound`, never a run of some local image; a short
/// `sha256:` prefix and a bare 64-digit ID are invalid specs; the whole ID starts a run.
pub async fn image_names_never_match_an_image_id_prefix(cx: &Context) -> anyhow::Result<()> {
    let id = runcell_core::envvar::var(IMAGE_ID_ENV)
        .filter(|id| id.starts_with("sha256:") && id.len() == 71);
    let mut names: Vec<String> = (0..16).map(|d| format!("{d:x}")).collect();
    if let Some(id) = &id {
        names.push(id["sha256:".len().."sha256:".len() + 12].to_string());
    }
    let attempts = names.iter().map(|name| async move {
        let mut spec = cx.spec();
        spec.image = name.clone();
        spec.pull = PullPolicy::Never;
        (name, cx.driver.create(&spec).await)
    });
    for (name, result) in futures::future::join_all(attempts).await {
        match result {
            Ok(run) => {
                run.stop().await?;
                bail!("image {name:?} started a run: an image was taken by its ID prefix");
            }
            Err(e) => ensure!(
                e.kind() == ErrorKind::NotFound,
                "image {name:?}: expected NotFound, got {e}"
            ),
        }
    }
    for bad in [
        "sha256:0".to_string(),
        format!("sha256:{}", "a".repeat(12)),
        "a".repeat(64),
    ] {
        let mut spec = cx.spec();
        spec.image = bad.clone();
        match cx.driver.create(&spec).await {
            Ok(run) => {
                run.stop().await?;
                bail!("image {bad:?} started a run");
            }
            Err(e) => ensure!(
                e.kind() == ErrorKind::InvalidSpec && e.field() == Some("image"),
                "image {bad:?}: expected an invalid spec naming image, got {e}"
            ),
        }
    }
    if let Some(id) = id {
        let mut spec = cx.spec();
        spec.image = id.clone();
        spec.pull = PullPolicy::Never;
        let run = cx.driver.start(&spec).await?;
        let said = sh_stdout(&*run, "echo by-id").await;
        run.stop().await?;
        ensure!(said? == "by-id", "the run started by its image's whole ID");
    }
    cx.assert_case_clean().await
}

/// A command that fills the run's pids limit with processes and keeps it full times out.
/// `TimedOut` means its processes are gone (a new exec then starts and finds none of
/// them); when they could not be killed, the status is `KillFailed` instead, within the
/// timeout plus the kill bound, and stopping the run ends them.
pub async fn a_timed_out_exec_is_killed_or_says_it_was_not(cx: &Context) -> anyhow::Result<()> {
    if !cx.caps.pids_limit {
        return Ok(());
    }
    let run = cx.driver.start(&cx.spec().pids(64)).await?;
    let timeout = Duration::from_secs(2);
    let bomb = ExecSpec::new([
        "sh",
        "-c",
        // Every slot taken by sleepers (a shell that cannot fork exits: the subshell
        // does, freeing its slot for one more sleeper), then a wait that needs none.
        "( while :; do sleep 1000 & done ) 2>/dev/null; sleep 1000 & exec sleep 1000",
    ])
    .env("RUNCELL_TEST_BOMB", "1")
    .timeout(timeout);
    let started = Instant::now();
    let status = run.exec(bomb).await?.status;
    let took = started.elapsed();
    let bound = timeout + runcell_core::KILL_BOUND + Duration::from_secs(15);
    ensure!(took < bound, "the exec took {took:?}, over {bound:?}");
    the_kill_was_what_it_says(&*run, &status, "RUNCELL_TEST_BOMB=1").await?;
    cx.assert_case_clean().await
}

/// Through the helper, a command that stops its own shepherd (`kill -STOP $PPID`, as the
/// helper's user may) and outlives its timeout is still killed (`TimedOut`, none of its
/// processes left) or said not to be (`KillFailed`): a stopped shepherd never makes a
/// kill look done.
pub async fn a_stopped_shepherd_cannot_hide_a_kill(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    if run.exec_path() != runcell_core::ExecPath::Helper {
        run.stop().await?;
        return cx.assert_case_clean().await;
    }
    let spec = ExecSpec::new(["sh", "-c", "kill -STOP $PPID; sleep 600 & sleep 600"])
        .env("RUNCELL_TEST_STOPPER", "1")
        .timeout(Duration::from_secs(2));
    let started = Instant::now();
    let status = run.exec(spec).await?.status;
    let bound = Duration::from_secs(2) + runcell_core::KILL_BOUND + Duration::from_secs(15);
    ensure!(started.elapsed() < bound, "took {:?}", started.elapsed());
    the_kill_was_what_it_says(&*run, &status, "RUNCELL_TEST_STOPPER=1").await?;
    cx.assert_case_clean().await
}

/// Through the helper, a command that kills its own shepherd (`kill -9 $PPID`, as the
/// helper's user may) after starting a process in the shepherd's session and one in a
/// session of its own: the exec ends killed by SIGKILL (or, had the shepherd died before
/// it answered, as a spawn error), and by then none of its processes is left, and the
/// run's other execs go on. The helper is their subreaper once the shepherd is gone.
pub async fn an_exec_that_kills_its_shepherd_leaves_nothing(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    if run.exec_path() != runcell_core::ExecPath::Helper {
        run.stop().await?;
        return cx.assert_case_clean().await;
    }
    let count = "n=0; for d in /proc/[0-9]*; do if tr '\\0' '\\n' 2>/dev/null < $d/environ \
         | grep -qx RUNCELL_TEST_SHEPHERD_KILLER=1; then n=$((n+1)); fi; done; echo $n";
    for round in 0..3 {
        let spec = ExecSpec::new([
            "sh",
            "-c",
            "setsid sleep 600 & sleep 600 & sleep 0.2; kill -9 $PPID; wait",
        ])
        .env("RUNCELL_TEST_SHEPHERD_KILLER", "1")
        .timeout(Duration::from_secs(60));
        let started = Instant::now();
        match run.exec(spec).await {
            Ok(out) => ensure!(
                out.status == ExitStatus::Signaled(9),
                "round {round}: an exec whose shepherd was killed ended {}",
                out.status
            ),
            Err(e) => ensure!(e.kind() == ErrorKind::Backend, "round {round}: {e}"),
        }
        ensure!(
            started.elapsed() < Duration::from_secs(20),
            "round {round}: took {:?}",
            started.elapsed()
        );
        let left = sh_stdout(&*run, count).await?;
        ensure!(
            left == "0",
            "round {round}: {left} processes of an exec whose shepherd was killed live on"
        );
    }
    run.stop().await?;
    cx.assert_case_clean().await
}

/// After a timed-out exec whose processes carry `marker` (`NAME=value`) in their env:
/// `TimedOut` means none of them is alive (a kill that happened also leaves room for the
/// exec that counts them); `KillFailed` must say why. Stops the run either way.
async fn the_kill_was_what_it_says(
    run: &dyn runcell_core::Run,
    status: &ExitStatus,
    marker: &str,
) -> anyhow::Result<()> {
    match status {
        ExitStatus::TimedOut => {
            let script = format!(
                "n=0; for d in /proc/[0-9]*; do if tr '\\0' '\\n' 2>/dev/null < $d/environ | grep -qx {marker}; then n=$((n+1)); fi; done; echo $n"
            );
            // Killed processes free their slots of a pids limit as they are reaped, a
            // moment after the kill: a check refused for want of a slot is tried again.
            let deadline = Instant::now() + Duration::from_secs(10);
            let left = loop {
                let left = sh_stdout(run, &script).await;
                let refused = left.as_ref().err().is_some_and(|e| {
                    e.downcast_ref::<runcell_core::Error>()
                        .is_some_and(|e| e.kind() == ErrorKind::Unavailable)
                });
                if !refused || Instant::now() > deadline {
                    break left;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            };
            run.stop().await?;
            let left = left?;
            ensure!(
                left == "0",
                "reported TimedOut, but {left} of the command's processes are alive"
            );
        }
        ExitStatus::KillFailed(why) => {
            run.stop().await?;
            ensure!(!why.is_empty(), "KillFailed without a reason");
        }
        other => {
            run.stop().await?;
            bail!("expected TimedOut or KillFailed, got {other}");
        }
    }
    Ok(())
}
