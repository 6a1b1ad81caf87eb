//! Execs that outlive their connection (capability `durable_execs`, through the exec
//! helper's per-run daemon): detached commands reached by id from another process,
//! reattach from an offset with every byte once, a stream that resumes by itself when
//! its connection breaks, loss reported exactly, and stop still ending everything.
//!
//! A broken connection is made from inside the run, as an engine or a proxy would cut
//! it: a detached exec kills every relay (the helper process each engine exec runs,
//! `/.runcell/helper` with no argument), so the engine's stream of every connection ends.

use std::time::Duration;

use anyhow::{Context as _, bail, ensure};
use runcell_core::{
    DriverExt, ErrorKind, ExecId, ExecPath, ExecSpec, ExecStream, ExitStatus, OutputChunk, Run,
    RunExt,
};

use crate::{Context, sh_ok, sh_stdout};

/// How long a case waits for output or an end.
const PATIENCE: Duration = Duration::from_secs(60);

/// Kills every relay in the run (every connection's engine exec), from a detached exec so
/// that the kill itself does not depend on the connection it breaks.
const CUT_CONNECTIONS: &str = r#"sleep 0.3; for p in /proc/[0-9]*; do
  [ "$(tr '\0' ' ' < $p/cmdline 2>/dev/null)" = "/.runcell/helper " ] && kill -9 "${p#/proc/}"
done; exit 0"#;

/// A command that prints `lines` numbered lines, `pause` apart, then exits with `code`.
fn counter(lines: u32, pause: &str, code: i32) -> ExecSpec {
    ExecSpec::new([
        "sh",
        "-c",
        &format!(
            "i=0; while [ $i -lt {lines} ]; do echo line$i; i=$((i+1)); sleep {pause}; done; exit {code}"
        ),
    ])
}

/// What [`counter`] prints.
fn counted(lines: u32) -> Vec<u8> {
    (0..lines)
        .flat_map(|i| format!("line{i}\n").into_bytes())
        .collect()
}

/// Reads a stream to its end: its stdout, the bytes reported lost, and its status.
async fn drain(stream: ExecStream) -> anyhow::Result<(Vec<u8>, u64, ExitStatus)> {
    let mut stream = stream;
    let read = async {
        let (mut out, mut lost) = (Vec::new(), 0u64);
        while let Some(chunk) = stream.next_chunk().await {
            match chunk {
                OutputChunk::Stdout(b) => out.extend_from_slice(&b),
                OutputChunk::Stderr(b) => bail!("stderr: {:?}", String::from_utf8_lossy(&b)),
                OutputChunk::Lost(n) => lost += n,
            }
        }
        Ok((out, lost, stream.wait().await))
    };
    tokio::time::timeout(PATIENCE, read)
        .await
        .context("the stream did not end")?
}

/// Reads stdout until at least `n` bytes came.
async fn read_at_least(stream: &mut ExecStream, n: usize) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::new();
    let read = async {
        while out.len() < n {
            match stream.next_chunk().await {
                Some(OutputChunk::Stdout(b)) => out.extend_from_slice(&b),
                Some(other) => bail!("unexpected output {other:?}"),
                None => bail!("the output ended after {} bytes", out.len()),
            }
        }
        Ok(())
    };
    tokio::time::timeout(PATIENCE, read)
        .await
        .context("no output")??;
    Ok(out)
}

/// True when the run's execs go through the helper (so durable execs must work); on the
/// plain path `detach` must be `Unsupported` naming it.
async fn durable_or_refused(cx: &Context, run: &dyn Run) -> anyhow::Result<bool> {
    run.exec(ExecSpec::new(["true"])).await?;
    if cx.caps.durable_execs && run.exec_path() == ExecPath::Helper {
        return Ok(true);
    }
    match run.exec_stream(ExecSpec::new(["true"]).detach()).await {
        Ok(_) => bail!("a detached exec started on a path without durable execs"),
        Err(e) => ensure!(
            e.kind() == ErrorKind::Unsupported && e.field() == Some("detach"),
            "a detached exec without durable execs: {e}"
        ),
    }
    match run.execs().await {
        Ok(_) => bail!("execs() answered without durable execs"),
        Err(e) => ensure!(e.kind() == ErrorKind::Unsupported, "execs(): {e}"),
    }
    Ok(false)
}

/// A detached command keeps running when its stream is dropped; another process (a run
/// attached by id, so a new connection) lists it, reads the rest of its output from the
/// offset the first reader reached (together: every byte once, in order), and gets its
/// exact status; reading again from 0 gives everything again until the record is
/// released, after which the id is `NotFound`. A detached command is killed by id, and
/// the specs that make no sense are refused first.
pub async fn a_detached_exec_outlives_its_stream_and_is_read_elsewhere(
    cx: &Context,
) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    if !durable_or_refused(cx, &*run).await? {
        run.stop().await?;
        return Ok(());
    }
    match run
        .exec_stream(counter(1, "0", 0).detach().timeout(Duration::from_secs(5)))
        .await
    {
        Ok(_) => bail!("a detached exec with a timeout was accepted"),
        Err(e) => ensure!(e.field() == Some("timeout"), "detach + timeout: {e}"),
    }
    let lines = 150;
    let mut stream = run.exec_stream(counter(lines, "0.01", 5).detach()).await?;
    let id = stream.exec_id().context("a detached exec has an id")?;
    ensure!(stream.start_offset() == 0, "a new exec starts at offset 0");
    let head = read_at_least(&mut stream, 40).await?;
    drop(stream);

    // Another process: the same run attached by id (a connection of its own).
    let other = cx.driver.attach(run.id()).await?;
    let listed = other.execs().await?;
    let info = listed
        .iter()
        .find(|e| e.id == id)
        .with_context(|| format!("exec {id} is not listed: {listed:?}"))?;
    ensure!(info.detached, "listed as not detached: {info:?}");
    ensure!(
        info.argv.first().map(String::as_str) == Some("sh"),
        "{info:?}"
    );
    let rest = other.reattach(id, head.len() as u64).await?;
    ensure!(rest.exec_id() == Some(id), "the reattached stream's id");
    ensure!(rest.start_offset() == head.len() as u64, "start offset");
    let (tail, lost, status) = drain(rest).await?;
    ensure!(
        lost == 0,
        "{lost} bytes lost with a buffer that held them all"
    );
    ensure!(status == ExitStatus::Exited(5), "status {status}");
    let mut all = head;
    all.extend_from_slice(&tail);
    ensure!(
        all == counted(lines),
        "the two readers' output together is not the command's: {:?}",
        String::from_utf8_lossy(&all)
    );
    // From 0 again, while the record lives; then released and gone.
    let (again, _, status) = drain(run.reattach(id, 0).await?).await?;
    ensure!(
        again == counted(lines) && status == ExitStatus::Exited(5),
        "second read"
    );
    let ended = other.execs().await?;
    let info = ended
        .iter()
        .find(|e| e.id == id)
        .context("listed after its end")?;
    ensure!(
        info.status == Some(ExitStatus::Exited(5)) && info.output_bytes == all.len() as u64,
        "{info:?}"
    );
    other.release_exec(id).await?;
    match run.reattach(id, 0).await {
        Ok(_) => bail!("a released exec was reattached"),
        Err(e) => ensure!(
            e.kind() == ErrorKind::NotFound && e.field() == Some("exec_id"),
            "a released exec: {e}"
        ),
    }
    let unknown: ExecId = "4294967295".parse()?;
    match other.kill_exec(unknown).await {
        Ok(()) => bail!("an unknown exec was killed"),
        Err(e) => ensure!(e.kind() == ErrorKind::NotFound, "an unknown exec: {e}"),
    }

    // Killed by id from the other process; its status says so.
    let sleeper = run
        .exec_stream(ExecSpec::new(["sleep", "1000"]).detach())
        .await?;
    let sid = sleeper.exec_id().context("an id")?;
    drop(sleeper);
    other.kill_exec(sid).await?;
    let status = tokio::time::timeout(PATIENCE, run.wait_exec(sid))
        .await
        .context("the killed exec did not end")??;
    ensure!(
        matches!(status, ExitStatus::Signaled(_)),
        "a killed detached exec ended {status}"
    );
    run.stop().await?;
    Ok(())
}

/// When the connection breaks under running commands (every relay killed, as an engine
/// restart or a proxy would cut it), the library reconnects by itself: a stream in flight
/// goes on where it was (its output, concatenated, is the command's, its status exact),
/// and the next exec works.
pub async fn a_stream_resumes_when_its_connection_breaks(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    if !durable_or_refused(cx, &*run).await? {
        run.stop().await?;
        return Ok(());
    }
    let lines = 120;
    let mut stream = run.exec_stream(counter(lines, "0.02", 3)).await?;
    let head = read_at_least(&mut stream, 20).await?;
    let cut = run
        .exec_stream(ExecSpec::new(["sh", "-c", CUT_CONNECTIONS]).detach())
        .await?;
    let cut_id = cut.exec_id().context("an id")?;
    drop(cut);
    let (tail, lost, status) = drain(stream).await?;
    ensure!(lost == 0, "{lost} bytes lost over a short break");
    ensure!(
        status == ExitStatus::Exited(3),
        "the resumed exec ended {status}"
    );
    let mut all = head;
    all.extend_from_slice(&tail);
    ensure!(
        all == counted(lines),
        "the resumed output is not the command's: {:?}",
        String::from_utf8_lossy(&all)
    );
    ensure!(
        run.wait_exec(cut_id).await? == ExitStatus::Exited(0),
        "the cutting exec"
    );
    let out = run.exec(ExecSpec::new(["echo", "after"])).await?;
    ensure!(out.stdout == b"after\n", "an exec after the break: {out:?}");
    run.stop().await?;
    Ok(())
}

/// A command with no grace (`grace(0)`) dies with its connection, as before durable
/// execs: a broken connection ends its stream as lost and leaves none of its processes.
pub async fn a_command_without_grace_dies_with_its_connection(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    if !durable_or_refused(cx, &*run).await? {
        run.stop().await?;
        return Ok(());
    }
    let mut stream = run
        .exec_stream(
            ExecSpec::new([
                "sh",
                "-c",
                "sleep 1000 & echo $! > /tmp/nograce.pid; echo up; wait",
            ])
            .grace(Duration::ZERO),
        )
        .await?;
    read_at_least(&mut stream, 3).await?;
    let cut = run
        .exec_stream(ExecSpec::new(["sh", "-c", CUT_CONNECTIONS]).detach())
        .await?;
    drop(cut);
    let status = tokio::time::timeout(PATIENCE, stream.wait())
        .await
        .context("the stream did not end")?;
    ensure!(
        matches!(status, ExitStatus::TransportLost(_)),
        "a command without grace whose connection broke ended {status}"
    );
    let check = "pid=$(cat /tmp/nograce.pid); for i in $(seq 1 50); do \
                 [ -e /proc/$pid ] || exit 0; sleep 0.1; done; echo alive; exit 1";
    let out = run.exec(ExecSpec::new(["sh", "-c", check])).await?;
    ensure!(
        out.status.success(),
        "its background process outlived the broken connection: {out:?}"
    );
    run.stop().await?;
    Ok(())
}

/// Output printed while nobody reads, beyond the exec's buffer, is dropped oldest first
/// and a reattach from 0 reports exactly how many bytes: what follows the
/// `Lost` chunk is exactly the command's last bytes.
pub async fn output_lost_while_detached_is_reported_exactly(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    if !durable_or_refused(cx, &*run).await? {
        run.stop().await?;
        return Ok(());
    }
    let total: usize = 1_000_000;
    let stream = run
        .exec_stream(
            ExecSpec::new([
                "sh",
                "-c",
                &format!("i=0; while :; do echo $i; i=$((i+1)); done | head -c {total}"),
            ])
            .detach()
            .output_buffer(runcell_core::MIN_OUTPUT_BUFFER),
        )
        .await?;
    let id = stream.exec_id().context("an id")?;
    drop(stream);
    let status = tokio::time::timeout(PATIENCE, run.wait_exec(id))
        .await
        .context("the exec did not end")??;
    ensure!(status.success(), "{status}");
    let (kept, lost, status) = drain(run.reattach(id, 0).await?).await?;
    ensure!(status.success(), "{status}");
    ensure!(
        lost as usize + kept.len() == total,
        "lost {lost} + kept {} is not the {total} bytes printed",
        kept.len()
    );
    ensure!(lost > 0, "a 1 MB output fit a 64 KiB buffer");
    ensure!(
        kept.len() as u64 >= runcell_core::MIN_OUTPUT_BUFFER / 2,
        "only {} bytes kept",
        kept.len()
    );
    let full: Vec<u8> = (0..)
        .flat_map(|i: u64| format!("{i}\n").into_bytes())
        .take(total)
        .collect();
    ensure!(
        kept[..] == full[lost as usize..],
        "the bytes after the gap are not the command's last {} bytes",
        kept.len()
    );
    run.release_exec(id).await?;
    run.stop().await?;
    Ok(())
}

/// `stop` ends detached commands with the run (nothing of it is left: the context checks
/// for leftovers), and a run attached by id sees no exec records after its helper's
/// daemon went with the target.
pub async fn stop_ends_detached_commands(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    if !durable_or_refused(cx, &*run).await? {
        run.stop().await?;
        return Ok(());
    }
    let mut ids = Vec::new();
    for _ in 0..3 {
        let s = run
            .exec_stream(ExecSpec::new(["sleep", "1000"]).detach())
            .await?;
        ids.push(s.exec_id().context("an id")?);
    }
    let listed = run.execs().await?;
    for id in &ids {
        let info = listed.iter().find(|e| e.id == *id).context("listed")?;
        ensure!(info.status.is_none() && info.pid > 0, "{info:?}");
    }
    let id = run.id().to_string();
    run.stop().await?;
    match cx.driver.attach(&id).await {
        Ok(r) => match r.execs().await {
            Ok(l) if l.is_empty() => {}
            other => bail!("a stopped run still lists execs: {other:?}"),
        },
        Err(e) => ensure!(
            matches!(e.kind(), ErrorKind::NotFound | ErrorKind::RunLost),
            "attach after stop: {e}"
        ),
    }
    Ok(())
}

/// The run's daemon serves the relays the engine starts and nothing else: the helper
/// started as a relay from an exec of the daemon's own user (directly, or from a process
/// that left its exec's session and parent) gets no greeting, and an exec of another
/// user cannot even list the daemon's directory. The daemon serves on.
pub async fn no_exec_reaches_the_run_s_daemon(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    if !durable_or_refused(cx, &*run).await? {
        run.stop().await?;
        return Ok(());
    }
    let relay = "/.runcell/helper </dev/null 2>/dev/null | wc -c";
    let greeted = sh_stdout(&*run, relay).await?;
    ensure!(
        greeted == "0",
        "the helper started from an exec got {greeted} bytes from the daemon"
    );
    let orphan = format!(
        "(setsid sh -c '{relay} > /tmp/orphan.tmp && mv /tmp/orphan.tmp /tmp/orphan' \
         </dev/null >/dev/null 2>&1 &)"
    );
    sh_ok(&*run, &orphan).await?;
    let mut got = String::new();
    for _ in 0..200 {
        got = sh_stdout(&*run, "cat /tmp/orphan 2>/dev/null || true").await?;
        if !got.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    ensure!(
        got == "0",
        "a process that left its exec got {got:?} bytes from the daemon"
    );
    if cx.caps.exec_user {
        let probe = ExecSpec::new([
            "sh",
            "-c",
            "ls /.runcell/d >/dev/null 2>&1 && echo open || echo private",
        ])
        .user("65534");
        let out = run.exec(probe).await?;
        let seen = String::from_utf8_lossy(&out.stdout).trim().to_string();
        ensure!(
            seen == "private",
            "another user sees the daemon's directory: {seen:?}"
        );
    }
    ensure!(sh_stdout(&*run, "echo alive").await? == "alive");
    run.stop().await?;
    Ok(())
}

/// A stream that leaves its exec (`ExecStream::leave`) lets it run on unattached, as a
/// broken connection would: another process reattaches and reads every byte from 0 and
/// the exact status. On the plain path `leave` is `Unsupported` naming it.
pub async fn a_stream_that_leaves_its_exec_lets_another_read_it(
    cx: &Context,
) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    if !durable_or_refused(cx, &*run).await? {
        let stream = run.exec_stream(counter(3, "0", 0)).await?;
        match stream.leave() {
            Ok(()) => bail!("leave on a path without durable execs"),
            Err(e) => ensure!(
                e.kind() == ErrorKind::Unsupported && e.field() == Some("leave"),
                "leave without durable execs: {e}"
            ),
        }
        run.stop().await?;
        return Ok(());
    }
    let lines = 100;
    let mut stream = run.exec_stream(counter(lines, "0.02", 4)).await?;
    let id = stream.exec_id().context("a durable exec has an id")?;
    read_at_least(&mut stream, 30).await?;
    stream.leave()?;
    let other = cx.driver.attach(run.id()).await?;
    let mut unattached = false;
    for _ in 0..100 {
        let listed = other.execs().await?;
        let info = listed
            .iter()
            .find(|e| e.id == id)
            .with_context(|| format!("exec {id} is not listed after leave: {listed:?}"))?;
        if !info.attached {
            ensure!(info.status.is_none(), "the exec ended when left: {info:?}");
            unattached = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ensure!(unattached, "exec {id} is still attached after leave");
    let (out, lost, status) = drain(other.reattach(id, 0).await?).await?;
    ensure!(lost == 0, "{lost} bytes lost");
    ensure!(out == counted(lines), "the output read after leave differs");
    ensure!(
        status == ExitStatus::Exited(4),
        "status after leave: {status}"
    );
    run.stop().await?;
    Ok(())
}

/// The process that reads a command is SIGKILLed mid-command (a child process of this
/// test, holding the stream): the command runs on for its grace, and this process
/// attaches the run, reattaches from the byte the child had reached and reads the rest:
/// the child's bytes and these together are the command's whole output, and the status
/// is exact.
pub async fn a_killed_reader_process_leaves_the_rest_to_another(
    cx: &Context,
) -> anyhow::Result<()> {
    use crate::harness::{EXEC_CHILD_READS, OwnerMode, RUN_ENV, exec_child_output};
    let run = cx.driver.start(&cx.spec()).await?;
    if !durable_or_refused(cx, &*run).await? {
        run.stop().await?;
        return Ok(());
    }
    let mut child = crate::harness::spawn_child(cx, OwnerMode::ExecReader, &[(RUN_ENV, run.id())])?;
    let stdout = child.stdout.take().context("the child's stdout")?;
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
    let line = tokio::time::timeout(PATIENCE, lines.next_line())
        .await
        .context("the exec child did not report")??
        .context("the exec child ended without reporting")?;
    let (id, read) = match line.strip_prefix("EXEC ").and_then(|l| l.split_once(' ')) {
        Some((id, n)) => (id.parse::<ExecId>()?, n.parse::<u64>()?),
        None => bail!("the exec child printed {line:?}"),
    };
    ensure!(
        read as usize >= EXEC_CHILD_READS,
        "the child read {read} bytes"
    );
    child.kill().await?;
    child.wait().await?;
    let other = cx.driver.attach(run.id()).await?;
    let (rest, lost, status) = drain(other.reattach(id, read).await?).await?;
    ensure!(lost == 0, "{lost} bytes lost");
    let all = exec_child_output();
    let mut whole = all[..read as usize].to_vec();
    whole.extend_from_slice(&rest);
    ensure!(
        whole == all,
        "the killed reader's bytes and the rest are {} bytes, not the command's {}",
        whole.len(),
        all.len()
    );
    ensure!(
        status == ExitStatus::Exited(6),
        "status after the reader died: {status}"
    );
    run.stop().await?;
    Ok(())
}
