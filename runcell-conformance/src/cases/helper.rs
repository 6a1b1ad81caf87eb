//! The two exec paths: through the in-sandbox helper, and one engine exec per command.
//! The whole suite runs on both (`RUNCELL_EXEC_HELPER=required` / `off`); these cases
//! check what differs and what must hold when the helper itself fails.

use std::time::Duration;

use anyhow::{Context as _, bail, ensure};
use runcell_core::{
    DriverExt, EXEC_HELPER_ENV, ErrorKind, ExecHelper, ExecPath, ExecSpec, ExitStatus, OutputChunk,
    RunExt,
};

use super::robustness::{process_lines, wait_gone};
use crate::{Context, no_tar_image, sh_ok, sh_stdout};

/// The path the environment asks for, if it asks.
pub(crate) fn wanted_path() -> Option<ExecPath> {
    match std::env::var(EXEC_HELPER_ENV).as_deref() {
        Ok("required" | "helper") => Some(ExecPath::Helper),
        Ok("off" | "plain") => Some(ExecPath::Plain),
        _ => None,
    }
}

/// A run takes the path its mode asks for and says so; `exec_helper: off` in the spec
/// is the plain path whatever the default, and works the same.
pub async fn exec_path_follows_the_mode(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    if let Some(wanted) = wanted_path() {
        ensure!(
            run.exec_path() == wanted,
            "{EXEC_HELPER_ENV} asks for {wanted:?}, the run reports {:?}",
            run.exec_path()
        );
    }
    ensure!(sh_stdout(&*run, "echo via-default").await? == "via-default");
    run.stop().await?;

    let plain = cx
        .driver
        .start(&cx.spec().exec_helper(ExecHelper::Off))
        .await?;
    ensure!(
        plain.exec_path() == ExecPath::Plain,
        "exec_helper: off reports {:?}",
        plain.exec_path()
    );
    let out = plain
        .exec(ExecSpec::new(["sh", "-c", "echo $0 $FOO", "plain"]).env("FOO", "bar"))
        .await?;
    ensure!(
        out.stdout_str() == "plain bar\n",
        "got {:?}",
        out.stdout_str()
    );
    plain.stop().await?;
    Ok(())
}

/// A signal death is `Signaled(n)`. Through the helper, which reads the real wait status,
/// an explicit `exit 137` is `Exited(137)`; the plain path sees only the engine's exit
/// code and reports both as `Signaled(9)` (as documented on [`ExitStatus::Signaled`]).
pub async fn signals_and_exit_codes_are_told_apart(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    let killed = run
        .exec(ExecSpec::new(["sh", "-c", "kill -9 $$"]))
        .await?
        .status;
    ensure!(killed == ExitStatus::Signaled(9), "kill -9 $$: {killed}");
    let exited = run
        .exec(ExecSpec::new(["sh", "-c", "exit 137"]))
        .await?
        .status;
    let expected = match run.exec_path() {
        ExecPath::Helper => ExitStatus::Exited(137),
        _ => ExitStatus::Signaled(9),
    };
    ensure!(
        exited == expected,
        "exit 137 on the {:?} path: {exited}, expected {expected}",
        run.exec_path()
    );
    run.stop().await?;
    Ok(())
}

/// Files move through the helper without `tar` in the image. On the plain path a driver
/// that needs `tar` for files fails with a typed error instead (never a hang).
pub async fn files_move_without_tar_in_the_image(cx: &Context) -> anyhow::Result<()> {
    let run = cx
        .driver
        .start(&cx.spec_with_image(&no_tar_image()))
        .await?;
    let which = run
        .exec(ExecSpec::new(["sh", "-c", "command -v tar || echo none"]))
        .await?;
    ensure!(
        which.stdout_str().trim() == "none",
        "the no-tar image has tar: {:?}",
        which.stdout_str()
    );
    let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let moved = async {
        sh_ok(
            &*run,
            "mkdir -p /tmp/nt/sub && printf keep > /tmp/nt/sub/keep",
        )
        .await?;
        run.put_file("/tmp/nt/sub/data.bin", &data, 0o640).await?;
        let back = run.get_file("/tmp/nt/sub/data.bin").await?;
        ensure!(back == data, "the file came back different");
        let mode = sh_stdout(&*run, "stat -c %a /tmp/nt/sub/data.bin").await?;
        ensure!(mode == "640", "mode {mode}");
        // A directory is never replaced by a file.
        let err = run
            .put_file("/tmp/nt/sub", b"x", 0o644)
            .await
            .err()
            .context("a file over a directory was accepted")?;
        ensure!(
            err.kind() == ErrorKind::InvalidSpec && err.field() == Some("path"),
            "a file over a directory: {err}"
        );
        ensure!(sh_stdout(&*run, "cat /tmp/nt/sub/keep").await? == "keep");
        let missing = run.get_file("/tmp/nt/none").await.err();
        ensure!(
            missing.as_ref().map(|e| e.kind()) == Some(ErrorKind::NotFound),
            "a missing file: {missing:?}"
        );
        anyhow::Ok(())
    };
    let result = tokio::time::timeout(Duration::from_secs(60), moved)
        .await
        .context("file operations without tar hung")?;
    match (run.exec_path(), result) {
        (_, Ok(())) => {}
        (ExecPath::Helper, Err(e)) => bail!("through the helper: {e:#}"),
        (_, Err(e)) => {
            let typed = e.downcast_ref::<runcell_core::Error>().is_some();
            ensure!(typed, "the plain path failed without a typed error: {e:#}");
        }
    }
    run.stop().await?;
    Ok(())
}

/// When the helper dies (killed from inside the sandbox), the execs in flight end as
/// `TransportLost`, their processes are killed anyway, and the next exec starts a new
/// helper. On the plain path there is no helper to kill; the case checks nothing more.
pub async fn a_dead_helper_loses_execs_and_recovers(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    if run.exec_path() != ExecPath::Helper {
        run.stop().await?;
        return Ok(());
    }
    let mut stream = run
        .exec_stream(ExecSpec::new(["sh", "-c", "echo started; sleep 1501"]))
        .await?;
    ensure!(
        matches!(stream.next_chunk().await, Some(OutputChunk::Stdout(_))),
        "no output before the helper was killed"
    );
    // The killer is itself a child of the helper: it may or may not report.
    let _ = run
        .exec(
            ExecSpec::new([
                "sh",
                "-c",
                "for d in /proc/[0-9]*; do \
                   case \"$(tr '\\0' ' ' < $d/cmdline 2>/dev/null)\" in \
                     /.runcell/helper*) kill -9 ${d#/proc/};; esac; done",
            ])
            .timeout(Duration::from_secs(20)),
        )
        .await;
    let status = tokio::time::timeout(Duration::from_secs(20), stream.wait())
        .await
        .context("the exec did not end when its helper died")?;
    ensure!(
        matches!(status, ExitStatus::TransportLost(_)),
        "an exec whose helper died: {status}"
    );
    wait_gone(&*run, "sleep 1501", Duration::from_secs(10)).await?;
    ensure!(run.exec_path() == ExecPath::Helper);
    ensure!(sh_stdout(&*run, "echo again").await? == "again");
    run.stop().await?;
    Ok(())
}

/// A command that floods its output while nobody reads it still times out, is killed,
/// and leaves nothing behind (on the helper path: no thread, pipe or credit stuck in the
/// helper), however many times it happens.
pub async fn unread_floods_time_out_and_leave_nothing(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    for _ in 0..5 {
        let stream = run
            .exec_stream(ExecSpec::new(["yes", "flood"]).timeout(Duration::from_millis(500)))
            .await?;
        // Nobody reads for a while: the flood fills every buffer on the way.
        tokio::time::sleep(Duration::from_millis(800)).await;
        let status = tokio::time::timeout(Duration::from_secs(20), stream.wait())
            .await
            .context("an unread flood did not end after its timeout")?;
        ensure!(status == ExitStatus::TimedOut, "an unread flood: {status}");
    }
    wait_gone(&*run, "yes flood", Duration::from_secs(10)).await?;
    if run.exec_path() == ExecPath::Helper {
        let threads = sh_stdout(
            &*run,
            "for d in /proc/[0-9]*; do case \"$(tr '\\0' ' ' < $d/cmdline 2>/dev/null)\" in \
               /.runcell/helper*) ls $d/task | wc -l;; esac; done",
        )
        .await?;
        let threads: usize = threads
            .lines()
            .map(|l| l.trim().parse::<usize>().unwrap_or(0))
            .max()
            .unwrap_or(0);
        // Idle: reader, writer, reaper (and one per running exec: the one asking).
        ensure!(
            threads <= 8,
            "the helper holds {threads} threads after the floods ended"
        );
    }
    run.stop().await?;
    Ok(())
}

/// A background process an exec leaves behind outlives the `Run` handle that started it
/// (another handle, attached later, still sees it), as after a plain engine exec: closing
/// a handle (and with it the helper's stream) kills only what is still running as an exec.
pub async fn background_processes_outlive_the_run_handle(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.create(&cx.spec()).await?;
    let id = run.id().to_string();
    let out = run
        .exec(ExecSpec::new([
            "sh",
            "-c",
            "sleep 1777 >/dev/null 2>&1 </dev/null & echo started",
        ]))
        .await?;
    ensure!(
        out.stdout_str() == "started\n",
        "got {:?}",
        out.stdout_str()
    );
    drop(run);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let again = cx.driver.attach(&id).await?;
    let procs = process_lines(&*again).await?;
    let alive = procs.contains("sleep 1777");
    again.stop().await?;
    ensure!(
        alive,
        "the background process died with the handle:\n{procs}"
    );
    Ok(())
}
