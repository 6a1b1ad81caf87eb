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
pub(crate) const KILL_WAIT: Duration = Duration::from_secs(15);

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

/// Where a command runs: a run this process attached, or the run's mux.
pub enum Target<'a> {
    Run {
        run: &'a dyn Run,
        capabilities: &'a Capabilities,
    },
    Mux(crate::mux::Client),
}

/// A command started, through either target.
enum Running {
    Lib(runcell_core::ExecStream),
    Mux(crate::mux::MuxExec),
}

impl Running {
    async fn next_chunk(&mut self) -> Option<OutputChunk> {
        match self {
            Running::Lib(e) => e.next_chunk().await,
            Running::Mux(e) => e.next_chunk().await,
        }
    }

    fn resize(&self, rows: u16, cols: u16) {
        match self {
            Running::Lib(e) => {
                let _ = e.resize(rows, cols);
            }
            Running::Mux(e) => e.resize(rows, cols),
        }
    }
}

/// A command's stdin, through either target.
enum Sink {
    Lib(runcell_core::StdinWriter),
    Mux(crate::mux::MuxStdin),
}

impl Sink {
    async fn write(&mut self, data: &[u8]) -> bool {
        match self {
            Sink::Lib(w) => w.write(Bytes::copy_from_slice(data)).await.is_ok(),
            Sink::Mux(w) => w.write(data).await.is_ok(),
        }
    }

    async fn close(self) {
        match self {
            Sink::Lib(w) => w.close(),
            Sink::Mux(w) => w.close().await,
        }
    }
}

/// Runs `spec` in `target`, streaming; returns the exit code to exit with.
pub async fn stream(
    target: Target<'_>,
    mut spec: ExecSpec,
    options: Options,
) -> Result<i32, Failure> {
    let marker = format!("{:016x}", rand_u64());
    if options.interruptible {
        spec.env.push((MARKER_ENV.into(), marker.clone()));
    }
    let stdin_streaming = match &target {
        Target::Run { capabilities, .. } => capabilities.stdin_streaming,
        Target::Mux(client) => client.stdin_streaming(),
    };
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
        if stdin_streaming {
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
    let (mut exec, sink, run) = match target {
        Target::Run { run, .. } => {
            let mut exec = run.exec_stream(spec).await?;
            if let Some(id) = exec.exec_id() {
                tracing::debug!(
                    "exec id {id} (`sandbox logs -f {} {id}` picks it up if this process dies)",
                    run.id()
                );
            }
            let sink = exec.take_stdin().map(Sink::Lib);
            (Running::Lib(exec), sink, Some(run))
        }
        Target::Mux(client) => {
            let marker = options.interruptible.then(|| marker.clone());
            let mut exec = client.start(&spec, marker).await?;
            if let Some(id) = exec.exec_id() {
                tracing::debug!("exec id {id}, through the run's mux");
            }
            let sink = matches!(spec.stdin, Stdin::Piped).then(|| Sink::Mux(exec.take_stdin()));
            (Running::Mux(exec), sink, None)
        }
    };
    if pipe_stdin && let Some(mut writer) = sink {
        tokio::spawn(async move {
            let mut input = tokio::io::stdin();
            let mut buf = vec![0u8; 64 << 10];
            loop {
                match input.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if !writer.write(&buf[..n]).await {
                            break;
                        }
                    }
                }
            }
            writer.close().await;
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
                    exec.resize(rows, cols);
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
        match (exec, run) {
            (Running::Mux(exec), _) => {
                // The mux kills the command's processes and waits until they are gone.
                exec.interrupt().await;
            }
            (Running::Lib(exec), Some(run)) if options.interruptible => {
                // Dropping the stream kills the command's process tree in the run; wait
                // until it is gone so that nothing outlives this process unnoticed.
                drop(exec);
                wait_gone(run, &marker).await;
            }
            (Running::Lib(exec), _) => {
                // `run`: the caller stops the whole run next, which ends every process in
                // it; a kill racing that stop would only fail noisily. Leak the stream
                // (the process exits right after).
                std::mem::forget(exec);
            }
        }
        return Ok(exit);
    }
    let code = match exec {
        Running::Lib(exec) => exit_code(&exec.wait().await, timeout),
        Running::Mux(mut exec) => {
            let exit = exec.exit();
            if let Some(m) = exit.message {
                eprintln!("{}", runcell_core::Shown(m));
            }
            exit.code
        }
    };
    drop(raw_mode);
    Ok(code)
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
    let (code, message) = exit_outcome(status, timeout);
    if let Some(m) = message {
        eprintln!("{m}");
    }
    code
}

/// The exit code for a status, and the line that tells what is not the command's own.
pub fn exit_outcome(status: &ExitStatus, timeout: Option<Duration>) -> (i32, Option<String>) {
    let after = || timeout.map(|t| format!(" after {t:?}")).unwrap_or_default();
    let (code, line) = match status {
        ExitStatus::Exited(c) => return (*c, None),
        ExitStatus::Signaled(n) => return (128 + n, None),
        ExitStatus::TimedOut => (
            code::TIMED_OUT,
            format!(
                "the command timed out{}; its processes were killed",
                after()
            ),
        ),
        ExitStatus::KillFailed(why) => (
            code::NOT_KILLED,
            format!(
                "the command timed out{}, and its processes could not be killed ({why}); they may still run: `sandbox stop` ends them",
                after()
            ),
        ),
        ExitStatus::RunLost(why) => (
            code::RUN_LOST,
            format!("the run is gone ({why}); the command may have run in part"),
        ),
        ExitStatus::TransportLost(why) => (
            code::TRANSPORT_LOST,
            format!("the connection to the backend was lost ({why}); the command may have run"),
        ),
        ExitStatus::NotStarted { field, reason } => (
            code::NOT_STARTED,
            format!("the command did not start ({field}): {reason}"),
        ),
        other => (code::FAILED, format!("the command ended: {other}")),
    };
    // The reasons are the sandbox's or the engine's words: shown escaped.
    (
        code,
        Some(format!("sandbox: {}", runcell_core::Shown(line))),
    )
}

/// Waits (bounded) until no process in the run carries this exec's marker.
pub(crate) async fn wait_gone(run: &dyn Run, marker: &str) {
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
