//! Execs on a pseudo-terminal (`ExecSpec::tty`): what the command sees, resize, the
//! terminal's signals, and the kill rules on a terminal exec.

use std::time::Duration;

use anyhow::{Context as _, bail, ensure};
use bytes::Bytes;
use runcell_core::{DriverExt, ErrorKind, ExecSpec, ExecStream, ExitStatus, OutputChunk, RunExt};

use crate::Context;

/// How long a terminal exec may take to print what the case waits for.
const PATIENCE: Duration = Duration::from_secs(30);

/// Reads the stream's output (one stream on a terminal: stdout) into `seen` until it
/// holds `want`, within [`PATIENCE`].
async fn read_until(stream: &mut ExecStream, seen: &mut String, want: &str) -> anyhow::Result<()> {
    let read = async {
        while !seen.contains(want) {
            match stream.next_chunk().await {
                Some(OutputChunk::Stdout(b)) => seen.push_str(&String::from_utf8_lossy(&b)),
                Some(OutputChunk::Stderr(b)) => {
                    bail!(
                        "a terminal exec printed on stderr: {:?}",
                        String::from_utf8_lossy(&b)
                    )
                }
                Some(OutputChunk::Lost(n)) => bail!("{n} output bytes lost"),
                None => bail!("the output ended before {want:?}; it was {seen:?}"),
            }
        }
        Ok(())
    };
    tokio::time::timeout(PATIENCE, read)
        .await
        .with_context(|| format!("no {want:?} within {PATIENCE:?}; the output was {seen:?}"))?
}

/// With `tty`: the command's stdin, stdout and stderr are a terminal of the size asked
/// for, a resize is seen by the command, typed input reaches it (Enter as `\r`), its output
/// is one stream (stdout) and the exit code is its own. Without: `Unsupported` naming
/// `tty`, and the size is checked first (0 rows is `InvalidSpec` naming `tty.rows`).
pub async fn a_terminal_exec_sees_its_terminal_and_resizes(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    match run.exec_stream(ExecSpec::new(["true"]).tty(0, 80)).await {
        Ok(_) => bail!("a terminal of 0 rows was accepted"),
        Err(e) => ensure!(
            e.kind() == ErrorKind::InvalidSpec && e.field() == Some("tty.rows"),
            "a terminal of 0 rows: {e}"
        ),
    }
    let script = "for fd in 0 1 2; do [ -t $fd ] || echo \"fd $fd is no terminal\"; done; \
                  echo \"size $(stty size)\"; read line; echo \"size $(stty size) got:$line\"; exit 7";
    let spec = ExecSpec::new(["sh", "-c", script])
        .tty(24, 80)
        .stdin_piped();
    if !cx.caps.tty {
        match run.exec_stream(spec).await {
            Ok(_) => bail!("the driver does not claim `tty` but started a terminal exec"),
            Err(e) => ensure!(
                e.kind() == ErrorKind::Unsupported && e.field() == Some("tty"),
                "a terminal exec without the capability: {e}"
            ),
        }
        run.stop().await?;
        return Ok(());
    }
    let mut stream = run.exec_stream(spec).await?;
    let mut stdin = stream.take_stdin().context("a piped stdin")?;
    let mut seen = String::new();
    read_until(&mut stream, &mut seen, "size 24 80").await?;
    ensure!(!seen.contains("no terminal"), "{seen:?}");
    stream.resize(50, 132)?;
    match stream.resize(0, 1) {
        Err(e) if e.field() == Some("tty.rows") => {}
        other => bail!("a resize to 0 rows: {other:?}"),
    }
    // The resize frame goes before the typed line on the helper's stream, and the shell
    // reads the size only after the line.
    stdin.write(Bytes::from_static(b"typed words\r")).await?;
    read_until(&mut stream, &mut seen, "size 50 132 got:typed words").await?;
    let status = tokio::time::timeout(PATIENCE, stream.wait())
        .await
        .context("the terminal exec did not end")?;
    ensure!(
        status == ExitStatus::Exited(7),
        "the terminal exec ended {status}"
    );
    run.stop().await?;
    Ok(())
}

/// On a terminal, Ctrl-C (`\x03` typed) interrupts the foreground process group (the
/// command is killed by SIGINT), and a terminal exec's timeout still kills its whole
/// tree (it leads a session of its own on the terminal, under the same shepherd).
pub async fn ctrl_c_interrupts_a_terminal_exec_and_timeouts_still_kill(
    cx: &Context,
) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    let mut stream = run
        .exec_stream(
            ExecSpec::new(["sh", "-c", "echo ready; exec sleep 1000"])
                .tty(24, 80)
                .stdin_piped(),
        )
        .await?;
    let mut stdin = stream.take_stdin().context("a piped stdin")?;
    let mut seen = String::new();
    read_until(&mut stream, &mut seen, "ready").await?;
    stdin.write(Bytes::from_static(b"\x03")).await?;
    let status = tokio::time::timeout(PATIENCE, stream.wait())
        .await
        .context("Ctrl-C did not end the terminal exec")?;
    ensure!(
        status == ExitStatus::Signaled(2),
        "Ctrl-C on the terminal: {status}"
    );

    let out = run
        .exec(
            ExecSpec::new(["sh", "-c", "sleep 1000 & exec sleep 1001"])
                .tty(24, 80)
                .timeout(Duration::from_secs(2)),
        )
        .await?;
    ensure!(
        matches!(out.status, ExitStatus::TimedOut),
        "a terminal exec past its timeout: {}",
        out.status
    );
    let left = crate::sh_stdout(
        &*run,
        "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null | grep -q '^sleep 100[01] ' && echo ${p#/proc/}; done; true",
    )
    .await?;
    ensure!(
        left.is_empty(),
        "the timed-out terminal exec left processes: {left:?}"
    );
    run.stop().await?;
    Ok(())
}
