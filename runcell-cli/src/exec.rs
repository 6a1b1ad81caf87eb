//! One command in a run, streamed: output as it comes, stdin forwarded, the exit code
//! passed through.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use bytes::Bytes;
use runcell_core::{Capabilities, ExecSpec, ExitStatus, OutputChunk, Run, RunExt, Stdin};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::errors::{Failure, code};

/// The variable that marks the processes of one `sandbox exec`, to see them gone after
/// an interrupt.
pub const MARKER_ENV: &str = "RUNCELL_CLI_EXEC_ID";

/// The most stdin read up front for a driver that cannot stream it.
const STDIN_UP_FRONT_LIMIT: u64 = 64 << 20;

/// How long an interrupted exec waits for its processes in the run to be gone.
const KILL_WAIT: Duration = Duration::from_secs(15);

pub struct Options {
    /// Forward this process's stdin (when it is not a terminal, or `interactive`).
    pub forward_stdin: bool,
    /// Forward stdin even when it is a terminal (raw mode with `tty`).
    pub interactive: bool,
    /// Run the command on a terminal in the run, sized as this process's.
    pub tty: bool,
    /// Handle SIGINT/SIGTERM here: kill the command's processes in the run, then exit
    /// 130/143. (`run` leaves signals to `stop_runs_on_signal`, which stops the run.)
    pub interruptible: bool,
}

/// Runs `spec` in `run`, streaming; returns the exit code to exit with.
pub async fn stream(
    run: &dyn Run,
    capabilities: &Capabilities,
    mut spec: ExecSpec,
    options: Options,
) -> Result<i32, Failure> {
    let marker = format!("{:016x}", rand_u64());
    if options.interruptible {
        spec.env.push((MARKER_ENV.into(), marker.clone()));
    }
    let stdin = std::io::stdin();
    let mut pipe_stdin = false;
    let mut raw_mode = None;
    let mut window_changes = None;
    if options.tty {
        let (rows, cols) = crate::tty::size().unwrap_or((24, 80));
        spec = spec.tty(rows, cols);
        if std::io::stdout().is_terminal() {
            window_changes = Some(
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::window_change())
                    .map_err(|e| Failure::usage(format!("watching the terminal's size: {e}")))?,
            );
        }
    }
    if options.forward_stdin && options.interactive && stdin.is_terminal() {
        spec.stdin = Stdin::Piped;
        pipe_stdin = true;
        if options.tty {
            // Restored when this function returns, whichever way.
            raw_mode = crate::tty::RawMode::enter()
                .map_err(|e| Failure::usage(format!("setting the terminal to raw mode: {e}")))?;
        }
    } else if options.forward_stdin && !stdin.is_terminal() {
        if capabilities.stdin_streaming {
            spec.stdin = Stdin::Piped;
            pipe_stdin = true;
        } else {
            // Bytes up front work on every driver.
            let mut buf = Vec::new();
            let mut reader = tokio::io::stdin().take(STDIN_UP_FRONT_LIMIT + 1);
            reader
                .read_to_end(&mut buf)
                .await
                .map_err(|e| Failure::usage(format!("reading stdin: {e}")))?;
            if buf.len() as u64 > STDIN_UP_FRONT_LIMIT {
                return Err(Failure::usage(format!(
                    "this driver cannot stream stdin and it is over {} MiB: pass a file with `sandbox cp` instead",
                    STDIN_UP_FRONT_LIMIT >> 20
                )));
            }
            spec.stdin = Stdin::Bytes(Bytes::from(buf));
        }
    }
    let mut signals = if options.interruptible {
        Some(Signals::new()?)
    } else {
        None
    };
    let timeout = spec.timeout;
    let mut exec = run.exec_stream(spec).await?;
    if let Some(id) = exec.exec_id() {
        tracing::debug!(
            "exec id {id} (`sandbox logs -f {} {id}` picks it up if this process dies)",
            run.id()
        );
    }
    if pipe_stdin && let Some(mut writer) = exec.take_stdin() {
        tokio::spawn(async move {
            let mut input = tokio::io::stdin();
            let mut buf = vec![0u8; 64 << 10];
            loop {
                match input.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if writer
                            .write(Bytes::copy_from_slice(&buf[..n]))
                            .await
                            .is_err()
                        {
                            break;
                        }
                    }
                }
            }
            writer.close();
        });
    }
    let mut stdout = tokio::io::stdout();
    let mut stderr = tokio::io::stderr();
    let interrupted = loop {
        let chunk = tokio::select! {
            c = exec.next_chunk() => c,
            code = wait_signal(&mut signals) => break Some(code),
            Some(()) = window_changed(&mut window_changes) => {
                if let Some((rows, cols)) = crate::tty::size() {
                    let _ = exec.resize(rows, cols);
                }
                continue;
            }
        };
        match chunk {
            None => break None,
            Some(OutputChunk::Stdout(b)) => {
                let written = async {
                    stdout.write_all(&b).await?;
                    stdout.flush().await
                };
                if let Err(e) = written.await {
                    if e.kind() == std::io::ErrorKind::BrokenPipe {
                        // Nobody reads our stdout: end the command as a pipe would.
                        break Some(128 + 13);
                    }
                    return Err(Failure::usage(format!("writing stdout: {e}")));
                }
            }
            Some(OutputChunk::Stderr(b)) => {
                let _ = stderr.write_all(&b).await;
                let _ = stderr.flush().await;
            }
            Some(OutputChunk::Lost(n)) => {
                let line = format!("sandbox: {n} bytes of output were lost here\n");
                let _ = stderr.write_all(line.as_bytes()).await;
            }
        }
    };
    if let Some(exit) = interrupted {
        if options.interruptible {
            // Dropping the stream kills the command's process tree in the run; wait
            // until it is gone so that nothing outlives this process unnoticed.
            drop(exec);
            wait_gone(run, &marker).await;
        } else {
            // `run`: the caller stops the whole run next, which ends every process in
            // it; a kill racing that stop would only fail noisily. Leak the stream
            // (the process exits right after).
            std::mem::forget(exec);
        }
        return Ok(exit);
    }
    let status = exec.wait().await;
    drop(raw_mode);
    Ok(exit_code(&status, timeout))
}

/// The next change of this terminal's size; never, without a terminal.
async fn window_changed(changes: &mut Option<tokio::signal::unix::Signal>) -> Option<()> {
    match changes {
        Some(s) => s.recv().await,
        None => std::future::pending().await,
    }
}

/// The exit code for a status, telling on stderr what is not the command's own.
pub fn exit_code(status: &ExitStatus, timeout: Option<Duration>) -> i32 {
    match status {
        ExitStatus::Exited(c) => *c,
        ExitStatus::Signaled(n) => 128 + n,
        ExitStatus::TimedOut => {
            let after = timeout.map(|t| format!(" after {t:?}")).unwrap_or_default();
            eprintln!("sandbox: the command timed out{after}; its processes were killed");
            code::TIMED_OUT
        }
        ExitStatus::KillFailed(why) => {
            let after = timeout.map(|t| format!(" after {t:?}")).unwrap_or_default();
            eprintln!(
                "sandbox: the command timed out{after}, and its processes could not be killed ({why}); they may still run: `sandbox stop` ends them"
            );
            code::NOT_KILLED
        }
        ExitStatus::RunLost(why) => {
            eprintln!("sandbox: the run is gone ({why}); the command may have run in part");
            code::RUN_LOST
        }
        ExitStatus::TransportLost(why) => {
            eprintln!(
                "sandbox: the connection to the backend was lost ({why}); the command may have run"
            );
            code::TRANSPORT_LOST
        }
        ExitStatus::NotStarted { field, reason } => {
            eprintln!("sandbox: the command did not start ({field}): {reason}");
            code::NOT_STARTED
        }
        other => {
            eprintln!("sandbox: the command ended: {other}");
            code::FAILED
        }
    }
}

/// Waits (bounded) until no process in the run carries this exec's marker.
async fn wait_gone(run: &dyn Run, marker: &str) {
    const CHECK: &str = r#"for d in /proc/[0-9]*; do
  if tr '\0' '\n' < "$d/environ" 2>/dev/null | grep -qx "$1"; then exit 1; fi
done
exit 0"#;
    let start = Instant::now();
    let wanted = format!("{MARKER_ENV}={marker}");
    while start.elapsed() < KILL_WAIT {
        let check =
            ExecSpec::new(["sh", "-c", CHECK, "sh", &wanted]).timeout(Duration::from_secs(5));
        match run.exec(check).await {
            Ok(out) if out.status.success() => return,
            Ok(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            Err(e) => {
                tracing::warn!("cannot check that the interrupted command is gone: {e}");
                return;
            }
        }
    }
    eprintln!("sandbox: the interrupted command's processes were still there after {KILL_WAIT:?}");
}

/// SIGINT and SIGTERM, handled here instead of ending the process.
pub struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
}

impl Signals {
    pub fn new() -> Result<Signals, Failure> {
        use tokio::signal::unix::{SignalKind, signal};
        let err = |e: std::io::Error| Failure::usage(format!("cannot handle signals: {e}"));
        Ok(Signals {
            int: signal(SignalKind::interrupt()).map_err(err)?,
            term: signal(SignalKind::terminate()).map_err(err)?,
        })
    }
}

impl Signals {
    /// The next signal, as the exit code it calls for (130 or 143).
    pub async fn recv(&mut self) -> i32 {
        tokio::select! {
            _ = self.int.recv() => 130,
            _ = self.term.recv() => 143,
        }
    }
}

async fn wait_signal(signals: &mut Option<Signals>) -> i32 {
    match signals {
        Some(s) => tokio::select! {
            _ = s.int.recv() => 130,
            _ = s.term.recv() => 143,
        },
        None => std::future::pending().await,
    }
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.write_u32(std::process::id());
    h.finish()
}
