//! Exec: the streaming process handle every driver returns, its exit status, and the
//! pump that drivers use to build it.
//!
//! A driver turns one exec into three things: a stream of output chunks, an optional
//! stdin sink, and an [`ExecControl`] that reads the exit status and kills the process
//! tree. [`ExecStream::spawn`] then runs the same machinery for every driver: bounded
//! channels (backpressure, bounded memory), the timeout (kill, then
//! [`ExitStatus::TimedOut`]), cancellation on drop (kill), and "transport lost" when the
//! connection fails before a status was read.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::{BoxStream, Stream, StreamExt};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::error::{Error, ErrorKind, Result, Shown};
use crate::spec::{ExecSpec, Stdin};

/// Default per-stream cap of buffered output (16 MiB).
pub const DEFAULT_OUTPUT_LIMIT: usize = 16 << 20;

/// The environment variable every exec carries with its own id. Drivers find the
/// processes of one exec (and their descendants, which inherit it) by it when they kill.
pub const EXEC_ID_ENV: &str = "RUNCELL_EXEC_ID";

/// A POSIX shell script (`sh -c KILL_SCRIPT kill <exec id>`) that kills every process
/// of one exec: those whose environment carries `RUNCELL_EXEC_ID=<exec id>`, every member
/// of a process group or session one of them belongs to (runc makes each exec's root a
/// session leader, so this finds children that cleared their environment), and every
/// descendant of any of these through `/proc` parent links (so also those that called
/// `setsid` and cleared their environment while their parent lived). It never signals
/// its own session or process group, or PID 1's. Everything found is stopped (SIGSTOP,
/// so nothing forks meanwhile), found again, then gets TERM and CONT, and KILL after one
/// second; it fails (non-zero) when any of them is still alive a second after that, and
/// the shell fails when it cannot fork (a pids limit reached), so a kill that did not
/// happen is never taken for one; `/proc/<pid>/stat` is read with the shell's own `read`,
/// never a fork, so a process counts as gone only when its stat is. Needs a POSIX `sh`
/// with `tr`, `grep` and `sleep` (BusyBox or coreutils).
///
/// Another exec's processes are never among those found: each engine exec is a session
/// of its own, so none of its processes can join a process group of this exec's, and a
/// process cannot become another's descendant. A pid found is signalled with TERM, CONT
/// and KILL only while it still names the process found (same start time), so a pid
/// freed during the grace second and reused by another exec's process is left alone.
///
/// What can still escape: a process that cleared its environment, left the exec's
/// session (`setsid`) and whose parent had exited before the kill, i.e. a deliberately
/// daemonised process (re-parented to the target's PID 1, nothing in it says which exec
/// it came from; the exec helper's per-exec shepherd does not lose it); and processes of
/// another user when the kill lacks `CAP_KILL`.
pub const KILL_SCRIPT: &str = r#"
id="$1"
me=$$
info() {
  read -r s 2>/dev/null < "/proc/$1/stat" || return 1
  set -- ${s##*) }
  st=$1; pp=$2; pg=$3; sid=$4; start=${20}
}
info $me || exit 3
my_pg=$pg; my_sid=$sid
one_pg=; one_sid=
info 1 && { one_pg=$pg; one_sid=$sid; }
pids=" "
starts=" "
groups=" "
add_group() {
  case "$1" in 0|1|"$my_pg"|"$my_sid"|"$one_pg"|"$one_sid") return;; esac
  case "$groups" in *" $1 "*) ;; *) groups="$groups$1 ";; esac
}
collect() {
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    [ "$p" = "$me" ] && continue
    case "$pids" in *" $p "*) continue;; esac
    if tr '\0' '\n' < "$d/environ" 2>/dev/null | grep -qx "RUNCELL_EXEC_ID=$id"; then
      pids="$pids$p "
      info "$p" && { add_group "$pg"; add_group "$sid"; starts="$starts$p:$start "; }
    fi
  done
  changed=1
  while [ "$changed" = 1 ]; do
    changed=0
    for d in /proc/[0-9]*; do
      p=${d#/proc/}
      [ "$p" = "$me" ] && continue
      case "$pids" in *" $p "*) continue;; esac
      info "$p" || continue
      case "$pids$groups" in *" $pp "*|*" $pg "*|*" $sid "*) pids="$pids$p "; starts="$starts$p:$start "; changed=1;; esac
    done
  done
}
ours() {
  live=
  for p in $pids; do
    info "$p" || continue
    case "$starts" in *" $p:$start "*) live="$live $p";; esac
  done
}
alive() {
  for p in $pids; do
    info "$p" || continue
    [ "$st" != Z ] && case "$starts" in *" $p:$start "*) return 0;; esac
  done
  return 1
}
collect
[ "$pids" = " " ] && exit 0
kill -STOP $pids 2>/dev/null
collect
kill -STOP $pids 2>/dev/null
ours
kill -TERM $live 2>/dev/null
kill -CONT $live 2>/dev/null
for _ in 1 2 3 4 5 6 7 8 9 10; do
  alive || exit 0
  sleep 0.1
done
ours
kill -KILL $live 2>/dev/null
for _ in 1 2 3 4 5 6 7 8 9 10; do
  alive || exit 0
  sleep 0.1
done
echo "runcell-kill: processes outlived SIGKILL:$pids" >&2
exit 4
"#;

/// How an exec ended.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ExitStatus {
    /// The process exited with this code.
    Exited(i32),
    /// The process was killed by this signal. Through the exec helper this is the real
    /// wait status. On the plain path engines report a signal death as exit code `128 + N`,
    /// so there an explicit `exit 137` is reported as `Signaled(9)` too.
    Signaled(i32),
    /// The timeout passed; the process tree was killed.
    TimedOut,
    /// The timeout passed, and the exec's processes could not be killed within
    /// [`KILL_BOUND`] (tried again meanwhile), e.g. because the run's pids limit left no
    /// room for the plain path's kill exec. Its processes may still run; stopping the run
    /// ends them. Never reported as [`ExitStatus::TimedOut`].
    KillFailed(String),
    /// The run's target vanished or stopped while the command ran (removed, killed, its
    /// keep-alive gone): the command started and may have done part of its work; its
    /// processes are gone with the target. Whatever exit code the engine reported for it
    /// (137, 126, ...), it is never the command's. [`crate::RunExt::exec`] turns this into
    /// an [`ErrorKind::RunLost`] error.
    RunLost(String),
    /// The connection failed before the status was known. The process may have run; it
    /// was killed where still reachable. Never a success.
    TransportLost(String),
    /// The command never started because a field of the exec names something the run does
    /// not have: `working_dir` (no such directory) or `user` (no such user); or, with the
    /// field `resources`, because the run is at its limits (processes, memory, open files:
    /// the engine could not start one more). A missing or non-executable program is not
    /// this: it is `Exited(127)` / `Exited(126)` with the reason on stderr, as a shell
    /// reports it. [`crate::RunExt::exec`] turns this into an [`ErrorKind::NotFound`] error
    /// naming the field, or [`ErrorKind::LimitReached`] for `resources`.
    NotStarted {
        /// The exec field at fault: `working_dir` or `user`.
        field: String,
        /// What the engine or the sandbox said.
        reason: String,
    },
}

/// The `limit` of a [`ErrorKind::LimitReached`] error that the run's own limits caused.
pub(crate) const RUN_LIMITS: &str =
    "the run's processes, memory or open files (resources.pids, resources.memory_bytes)";

impl ExitStatus {
    /// The error a buffered exec returns instead of this status: [`ErrorKind::NotFound`]
    /// naming the field for [`ExitStatus::NotStarted`], [`ErrorKind::RunLost`] for
    /// [`ExitStatus::RunLost`].
    pub fn not_started_error(&self) -> Option<Error> {
        match self {
            ExitStatus::NotStarted { field, reason } if field == "resources" => Some(
                Error::new(
                    ErrorKind::LimitReached,
                    format!("the command did not start: {reason}"),
                )
                .with("limit", RUN_LIMITS),
            ),
            ExitStatus::NotStarted { field, reason } => Some(
                Error::new(
                    ErrorKind::NotFound,
                    format!("the command did not start: {reason}"),
                )
                .with_field(field.clone()),
            ),
            ExitStatus::RunLost(why) => Some(Error::new(
                ErrorKind::RunLost,
                format!("the run's target vanished while the command ran: {why}"),
            )),
            _ => None,
        }
    }

    /// Maps an engine's exit code: `128 + N` (N a signal number, 1–64) is a signal death.
    pub fn from_code(code: i64) -> ExitStatus {
        match code {
            129..=192 => ExitStatus::Signaled((code - 128) as i32),
            c => ExitStatus::Exited(c.clamp(i32::MIN as i64, i32::MAX as i64) as i32),
        }
    }

    /// True only for `Exited(0)`.
    pub fn success(&self) -> bool {
        *self == ExitStatus::Exited(0)
    }

    /// The exit code, for [`ExitStatus::Exited`].
    pub fn code(&self) -> Option<i32> {
        match self {
            ExitStatus::Exited(c) => Some(*c),
            _ => None,
        }
    }
}

impl fmt::Display for ExitStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExitStatus::Exited(c) => write!(f, "exited with code {c}"),
            ExitStatus::Signaled(s) => write!(f, "killed by signal {s}"),
            ExitStatus::TimedOut => f.write_str("timed out"),
            ExitStatus::RunLost(why) => write!(f, "the run's target is gone ({})", Shown(why)),
            ExitStatus::KillFailed(why) => write!(
                f,
                "timed out, and its processes could not be killed ({}); they may still run",
                Shown(why)
            ),
            ExitStatus::TransportLost(why) => write!(f, "transport lost: {}", Shown(why)),
            ExitStatus::NotStarted { field, reason } => {
                write!(f, "not started ({}): {}", Shown(field), Shown(reason))
            }
        }
    }
}

/// One piece of output, as it came.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputChunk {
    /// From stdout.
    Stdout(Bytes),
    /// From stderr.
    Stderr(Bytes),
    /// This many output bytes (stdout and stderr together) are missing here: the command
    /// printed them while no stream was attached and the sandbox's buffer for it
    /// ([`crate::ExecSpec::output_buffer`]) overflowed. Only a reattach, or a stream that
    /// resumed after its connection broke, has one.
    Lost(u64),
}

/// What a driver provides for one started exec, besides its output and stdin.
#[async_trait]
pub(crate) trait ExecControl: Send + Sync + 'static {
    /// The exit status, called once the output stream has ended.
    async fn status(&self) -> Result<ExitStatus>;
    /// A detached exec: dropping its stream or losing its connection never kills it.
    fn detached(&self) -> bool {
        false
    }
    /// Kills every process of this exec (TERM, a short grace, then KILL).
    async fn kill(&self) -> Result<()>;
}

/// The write half of a piped stdin. Dropping or [`StdinWriter::close`]-ing it sends EOF.
#[derive(Debug)]
pub struct StdinWriter {
    tx: mpsc::Sender<Bytes>,
}

impl StdinWriter {
    /// Writes bytes; waits while the process does not read (backpressure).
    pub async fn write(&mut self, data: impl Into<Bytes>) -> Result<()> {
        self.tx
            .send(data.into())
            .await
            .map_err(|_| Error::new(ErrorKind::Backend, "stdin is closed: the exec has ended"))
    }

    /// Closes stdin: the process reads EOF.
    pub fn close(self) {}
}

/// A running exec: output chunks as they come, an optional stdin writer, and its status.
///
/// Dropping it before it ended kills the process tree in the sandbox.
pub struct ExecStream {
    output: mpsc::Receiver<OutputChunk>,
    stdin: Option<StdinWriter>,
    status: oneshot::Receiver<ExitStatus>,
    started: Instant,
    /// A terminal exec's resize.
    resizer: Option<Resizer>,
    /// Its id in the run, for a durable exec.
    exec_id: Option<crate::ExecId>,
    /// The output offset of the first chunk.
    start_offset: u64,
    /// A durable exec's [`ExecStream::leave`].
    leaver: Option<Leaver>,
    _cancel_on_drop: DropGuard,
}

/// Lets a durable exec's stream leave it (see [`ExecStream::leave`]).
pub(crate) type Leaver = Box<dyn Fn() + Send + Sync>;

/// Sets the size of a terminal exec's terminal.
pub(crate) type Resizer = Box<dyn Fn(u16, u16) -> Result<()> + Send + Sync>;

impl fmt::Debug for ExecStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecStream").finish_non_exhaustive()
    }
}

/// Chunks buffered between the pump and the reader; with the backend's own buffers this
/// bounds memory however much a command prints.
const OUTPUT_CHANNEL_CHUNKS: usize = 16;

impl ExecStream {
    /// Starts the pump for one exec. Called by drivers right after the exec started.
    ///
    /// `output` yields the demultiplexed chunks until the process's streams close;
    /// `stdin` is the sink feeding the process (shut down for EOF), `None` when the driver
    /// opened no stdin.
    pub(crate) fn spawn(
        spec: &ExecSpec,
        output: BoxStream<'static, std::io::Result<OutputChunk>>,
        stdin: Option<Pin<Box<dyn AsyncWrite + Send>>>,
        control: Box<dyn ExecControl>,
    ) -> ExecStream {
        let started = Instant::now();
        let cancel = CancellationToken::new();
        let (out_tx, out_rx) = mpsc::channel(OUTPUT_CHANNEL_CHUNKS);
        let (status_tx, status_rx) = oneshot::channel();

        let mut writer = None;
        if let Some(sink) = stdin {
            let (source, w) = match &spec.stdin {
                Stdin::Null => (StdinSource::Nothing, None),
                Stdin::Bytes(b) => (StdinSource::Bytes(b.clone()), None),
                Stdin::Piped => {
                    let (tx, rx) = mpsc::channel(4);
                    (StdinSource::Channel(rx), Some(StdinWriter { tx }))
                }
            };
            writer = w;
            tokio::spawn(feed_stdin(sink, source, cancel.clone()));
        }

        // A timeout too long to add to the clock is no deadline at all.
        let deadline = spec
            .timeout
            .and_then(|t| started.checked_add(t))
            .map(tokio::time::Instant::from_std);
        // One span per exec, below the caller's (a driver's run span): the program's name
        // only, never its arguments or env (they may hold secrets).
        let span = tracing::debug_span!(
            "exec",
            program = %spec.argv.first().map(String::as_str).unwrap_or(""),
            status = tracing::field::Empty,
            duration_ms = tracing::field::Empty,
        );
        tokio::spawn(tracing::Instrument::instrument(
            pump(
                output,
                control,
                out_tx,
                status_tx,
                deadline,
                cancel.clone(),
                started,
            ),
            span,
        ));

        ExecStream {
            output: out_rx,
            stdin: writer,
            status: status_rx,
            started,
            resizer: None,
            exec_id: None,
            start_offset: 0,
            leaver: None,
            _cancel_on_drop: cancel.drop_guard(),
        }
    }

    /// Gives a durable exec its id, the offset its output starts at and its leave.
    pub(crate) fn with_id(
        mut self,
        id: crate::ExecId,
        start_offset: u64,
        leaver: Leaver,
    ) -> ExecStream {
        self.exec_id = Some(id);
        self.start_offset = start_offset;
        self.leaver = Some(leaver);
        self
    }

    /// Stops reading a durable exec without ending it (capability `durable_execs`): the
    /// command runs on as if this stream's connection had broken, for its
    /// [`ExecSpec::grace`](crate::ExecSpec::grace) (a detached one until it ends), and
    /// [`crate::Run::reattach`] from this or another process reads it from any offset
    /// still kept. Its timeout is no longer enforced (this process no longer watches it;
    /// the grace bounds it). Stdin gets EOF. An exec that already ended is left as it is.
    /// Without an exec id (the plain path): [`ErrorKind::Unsupported`] naming `leave`,
    /// and the stream is dropped (which kills the command).
    pub fn leave(self) -> Result<()> {
        match &self.leaver {
            Some(leave) => {
                leave();
                Ok(())
            }
            None => Err(Error::unsupported(
                "leave",
                "leaving a command running needs a durable exec (the exec helper)",
            )),
        }
    }

    /// The exec's id in its run, when it has a durable record there (through the exec
    /// helper; capability `durable_execs`): pass it to [`crate::Run::reattach`],
    /// [`crate::Run::kill_exec`] or [`crate::Run::execs`] from this or any process.
    /// `None` on the plain path.
    pub fn exec_id(&self) -> Option<crate::ExecId> {
        self.exec_id
    }

    /// The output offset of this stream's first chunk: 0 for a new exec, where a
    /// [`crate::Run::reattach`] started reading for a reattached one. Each chunk moves it
    /// on by its length ([`OutputChunk::Lost`] by the bytes it stands for): a caller that
    /// counts what it consumed knows where to reattach.
    pub fn start_offset(&self) -> u64 {
        self.start_offset
    }

    /// Gives a terminal exec its resize.
    pub(crate) fn with_resizer(mut self, resizer: Resizer) -> ExecStream {
        self.resizer = Some(resizer);
        self
    }

    /// Sets the size of the terminal of an exec started with [`ExecSpec::tty`]: the
    /// command's foreground process group gets `SIGWINCH` and reads the new size. An
    /// exec without a terminal is [`ErrorKind::InvalidSpec`] naming `tty`; a size of 0 is
    /// [`ErrorKind::InvalidSpec`] naming `tty.rows` or `tty.cols`. An exec that ended
    /// ignores it.
    pub fn resize(&self, rows: u16, cols: u16) -> Result<()> {
        let Some(resize) = &self.resizer else {
            return Err(Error::invalid_spec("tty", "this exec has no terminal"));
        };
        crate::spec::TerminalSize::new(rows, cols).validate()?;
        resize(rows, cols)
    }

    /// The stdin writer, once, when the spec asked for [`Stdin::Piped`].
    pub fn take_stdin(&mut self) -> Option<StdinWriter> {
        self.stdin.take()
    }

    /// The next chunk of output; `None` once both streams ended.
    pub async fn next_chunk(&mut self) -> Option<OutputChunk> {
        self.output.recv().await
    }

    /// Time since the exec started.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Waits for the end, discarding output not yet read, and returns the status.
    pub async fn wait(mut self) -> ExitStatus {
        self.stdin = None;
        while self.output.recv().await.is_some() {}
        self.finish().await
    }

    async fn finish(&mut self) -> ExitStatus {
        match (&mut self.status).await {
            Ok(s) => s,
            Err(_) => ExitStatus::TransportLost("the exec pump stopped without a status".into()),
        }
    }

    /// Reads everything, keeping at most `limit` bytes per stream, and returns the result.
    pub async fn collect(mut self, limit: usize) -> ExecOutput {
        self.stdin = None;
        let mut stdout = Capture::new(limit);
        let mut stderr = Capture::new(limit);
        let mut lost = 0u64;
        while let Some(chunk) = self.output.recv().await {
            match chunk {
                OutputChunk::Stdout(b) => stdout.push(&b),
                OutputChunk::Stderr(b) => stderr.push(&b),
                OutputChunk::Lost(n) => lost = lost.saturating_add(n),
            }
        }
        let status = self.finish().await;
        ExecOutput {
            status,
            stdout: stdout.bytes,
            stderr: stderr.bytes,
            stdout_total: stdout.total,
            stderr_total: stderr.total,
            lost_bytes: lost,
            duration: self.started.elapsed(),
        }
    }
}

impl Stream for ExecStream {
    type Item = OutputChunk;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<OutputChunk>> {
        self.output.poll_recv(cx)
    }
}

/// The result of a buffered exec. A non-zero exit is data here, not an error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    /// How it ended.
    pub status: ExitStatus,
    /// Stdout, at most the output limit (the head when truncated).
    pub stdout: Vec<u8>,
    /// Stderr, at most the output limit (the head when truncated).
    pub stderr: Vec<u8>,
    /// Bytes the process wrote to stdout in all.
    pub stdout_total: u64,
    /// Bytes the process wrote to stderr in all.
    pub stderr_total: u64,
    /// Output bytes missing from `stdout` and `stderr` ([`OutputChunk::Lost`]): 0 unless
    /// the output of a reattached or resumed exec overflowed the sandbox's buffer.
    pub lost_bytes: u64,
    /// Wall time from start to status.
    pub duration: Duration,
}

impl ExecOutput {
    /// True when stdout was cut at the output limit.
    pub fn stdout_truncated(&self) -> bool {
        self.stdout_total > self.stdout.len() as u64
    }

    /// True when stderr was cut at the output limit.
    pub fn stderr_truncated(&self) -> bool {
        self.stderr_total > self.stderr.len() as u64
    }

    /// Stdout as text (lossy).
    pub fn stdout_str(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    /// Stderr as text (lossy).
    pub fn stderr_str(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }
}

struct Capture {
    bytes: Vec<u8>,
    limit: usize,
    total: u64,
}

impl Capture {
    fn new(limit: usize) -> Capture {
        Capture {
            bytes: Vec::new(),
            limit,
            total: 0,
        }
    }

    fn push(&mut self, data: &[u8]) {
        self.total += data.len() as u64;
        let room = self.limit.saturating_sub(self.bytes.len());
        self.bytes.extend_from_slice(&data[..room.min(data.len())]);
    }
}

enum StdinSource {
    Nothing,
    Bytes(Bytes),
    Channel(mpsc::Receiver<Bytes>),
}

async fn feed_stdin(
    mut sink: Pin<Box<dyn AsyncWrite + Send>>,
    source: StdinSource,
    cancel: CancellationToken,
) {
    let feed = async {
        match source {
            StdinSource::Nothing => {}
            StdinSource::Bytes(b) => sink.write_all(&b).await?,
            StdinSource::Channel(mut rx) => {
                while let Some(b) = rx.recv().await {
                    sink.write_all(&b).await?;
                }
            }
        }
        sink.flush().await?;
        sink.shutdown().await
    };
    tokio::select! {
        r = feed => if let Err(e) = r {
            // The process may exit without reading all of stdin: not an error of the exec.
            tracing::debug!("stdin feed ended early: {e}");
        },
        _ = cancel.cancelled() => {}
    }
}

/// Why the pump stopped reading output.
enum End {
    Eof,
    Deadline,
    Cancelled,
    Lost(String),
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

async fn pump(
    mut output: BoxStream<'static, std::io::Result<OutputChunk>>,
    control: Box<dyn ExecControl>,
    out_tx: mpsc::Sender<OutputChunk>,
    status_tx: oneshot::Sender<ExitStatus>,
    deadline: Option<tokio::time::Instant>,
    cancel: CancellationToken,
    started: Instant,
) {
    let mut reader_gone = false;
    let end = loop {
        let next = tokio::select! {
            n = output.next() => n,
            _ = sleep_until(deadline) => break End::Deadline,
            _ = cancel.cancelled() => break End::Cancelled,
        };
        match next {
            None => break End::Eof,
            Some(Err(e)) => break End::Lost(e.to_string()),
            Some(Ok(chunk)) if !reader_gone => {
                tokio::select! {
                    r = out_tx.send(chunk) => reader_gone = r.is_err(),
                    _ = sleep_until(deadline) => break End::Deadline,
                    _ = cancel.cancelled() => break End::Cancelled,
                }
            }
            Some(Ok(_)) => {}
        }
    };
    drop(output);
    let status = match end {
        End::Eof => tokio::select! {
            s = control.status() => {
                let status = s.unwrap_or_else(|e| ExitStatus::TransportLost(e.to_string()));
                if let ExitStatus::TransportLost(why) = status {
                    if control.detached() {
                        ExitStatus::TransportLost(why)
                    } else {
                        // The process may still run: kill it where it is still reachable.
                        lost(why, kill(&*control).await)
                    }
                } else {
                    status
                }
            }
            _ = sleep_until(deadline) => timed_out(kill(&*control).await),
            _ = cancel.cancelled() => {
                if !control.detached() {
                    let _ = kill(&*control).await;
                }
                return;
            }
        },
        End::Deadline => timed_out(kill(&*control).await),
        End::Cancelled if control.detached() => {
            tracing::debug!("the stream of a detached exec was dropped: it runs on");
            return;
        }
        End::Cancelled => {
            tracing::debug!("exec cancelled: killing its processes");
            let _ = kill(&*control).await;
            return;
        }
        End::Lost(why) if control.detached() => {
            ExitStatus::TransportLost(format!("{why}; the detached command may still run"))
        }
        End::Lost(why) => lost(why, kill(&*control).await),
    };
    let span = tracing::Span::current();
    span.record("status", tracing::field::display(&status));
    span.record("duration_ms", started.elapsed().as_millis() as u64);
    tracing::debug!(%status, duration_ms = started.elapsed().as_millis() as u64, "exec ended");
    drop(out_tx);
    let _ = status_tx.send(status);
}

/// How long a kill may take, with its retries, before the exec's status is reported
/// anyway (as [`ExitStatus::KillFailed`] when it never succeeded).
pub const KILL_BOUND: Duration = Duration::from_secs(10);

/// What a kill came to.
enum Killed {
    /// The kill ran and found none of the exec's processes alive afterwards.
    Done,
    /// The run's target is gone (and the exec's processes with it).
    TargetGone(String),
    /// It never worked within [`KILL_BOUND`]: the last reason.
    Failed(String),
}

/// The status of a timed-out exec: killed, gone with its target, or not killed.
fn timed_out(killed: Killed) -> ExitStatus {
    match killed {
        Killed::Done => ExitStatus::TimedOut,
        Killed::TargetGone(why) => ExitStatus::RunLost(why),
        Killed::Failed(why) => ExitStatus::KillFailed(why),
    }
}

/// The status of an exec whose connection broke, saying whether its processes are gone.
fn lost(why: String, killed: Killed) -> ExitStatus {
    match killed {
        Killed::Done => ExitStatus::TransportLost(why),
        Killed::TargetGone(gone) => ExitStatus::RunLost(format!("{why}; {gone}")),
        Killed::Failed(e) => ExitStatus::TransportLost(format!(
            "{why}; its processes could not be killed ({e}) and may still run"
        )),
    }
}

/// Kills the exec's processes, trying again until [`KILL_BOUND`]: a kill exec the run
/// refuses (no process slot left under a pids limit, a busy engine) may work a moment
/// later. A target that is gone ends it at once: nothing of the exec is left to kill.
async fn kill(control: &dyn ExecControl) -> Killed {
    let give_up = tokio::time::Instant::now() + KILL_BOUND;
    let mut pause = Duration::from_millis(100);
    loop {
        let why = match tokio::time::timeout_at(give_up, control.kill()).await {
            Ok(Ok(())) => return Killed::Done,
            Ok(Err(e)) if matches!(e.kind(), ErrorKind::RunLost | ErrorKind::NotFound) => {
                tracing::debug!("the kill found the run's target gone: {e}");
                return Killed::TargetGone(e.to_string());
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("the kill did not end within {KILL_BOUND:?}"),
        };
        if tokio::time::Instant::now() + pause >= give_up {
            tracing::warn!("could not kill the exec's processes: {why}");
            return Killed::Failed(why);
        }
        tracing::debug!("the kill failed ({why}); trying again");
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    struct Fake {
        killed: Arc<AtomicBool>,
        code: i64,
    }

    #[async_trait]
    impl ExecControl for Fake {
        async fn status(&self) -> Result<ExitStatus> {
            Ok(ExitStatus::from_code(self.code))
        }
        async fn kill(&self) -> Result<()> {
            self.killed.store(true, Ordering::SeqCst);
            Ok(())
        }
    }

    fn fake(code: i64) -> (Box<dyn ExecControl>, Arc<AtomicBool>) {
        let killed = Arc::new(AtomicBool::new(false));
        (
            Box::new(Fake {
                killed: killed.clone(),
                code,
            }),
            killed,
        )
    }

    #[test]
    fn the_kill_script_looks_for_the_exec_marker() {
        assert!(KILL_SCRIPT.contains(&format!("grep -qx \"{EXEC_ID_ENV}=$id\"")));
    }

    #[test]
    fn exit_codes_map_to_signals_above_128() {
        assert_eq!(ExitStatus::from_code(0), ExitStatus::Exited(0));
        assert_eq!(ExitStatus::from_code(127), ExitStatus::Exited(127));
        assert_eq!(ExitStatus::from_code(128), ExitStatus::Exited(128));
        assert_eq!(ExitStatus::from_code(137), ExitStatus::Signaled(9));
        assert_eq!(ExitStatus::from_code(255), ExitStatus::Exited(255));
        assert!(!ExitStatus::TransportLost("x".into()).success());
    }

    #[tokio::test]
    async fn collects_and_caps_output() {
        let chunks = vec![
            Ok(OutputChunk::Stdout(Bytes::from_static(b"hello "))),
            Ok(OutputChunk::Stderr(Bytes::from_static(b"err"))),
            Ok(OutputChunk::Stdout(Bytes::from_static(b"world"))),
        ];
        let (control, killed) = fake(3);
        let s = ExecStream::spawn(
            &ExecSpec::new(["x"]),
            futures::stream::iter(chunks).boxed(),
            None,
            control,
        );
        let out = s.collect(8).await;
        assert_eq!(out.status, ExitStatus::Exited(3));
        assert_eq!(out.stdout, b"hello wo");
        assert_eq!(out.stdout_total, 11);
        assert!(out.stdout_truncated());
        assert_eq!(out.stderr, b"err");
        assert!(!out.stderr_truncated());
        assert!(!killed.load(Ordering::SeqCst));
    }

    #[tokio::test(start_paused = true)]
    async fn timeout_kills_and_reports_timed_out() {
        let (control, killed) = fake(0);
        let spec = ExecSpec::new(["x"]).timeout(Duration::from_secs(5));
        let s = ExecStream::spawn(&spec, futures::stream::pending().boxed(), None, control);
        assert_eq!(s.wait().await, ExitStatus::TimedOut);
        assert!(killed.load(Ordering::SeqCst));
    }

    /// A kill that fails `failures` times (usize::MAX: always), then works.
    struct Stubborn {
        tries: Arc<std::sync::atomic::AtomicUsize>,
        failures: usize,
    }

    #[async_trait]
    impl ExecControl for Stubborn {
        async fn status(&self) -> Result<ExitStatus> {
            Ok(ExitStatus::Exited(0))
        }
        async fn kill(&self) -> Result<()> {
            let n = self.tries.fetch_add(1, Ordering::SeqCst);
            if n < self.failures {
                Err(Error::new(ErrorKind::Backend, "no process slot left"))
            } else {
                Ok(())
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_kill_that_fails_is_tried_again_and_never_reported_as_done() {
        for (failures, want_killed) in [(3, true), (usize::MAX, false)] {
            let tries = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let control = Box::new(Stubborn {
                tries: tries.clone(),
                failures,
            });
            let spec = ExecSpec::new(["x"]).timeout(Duration::from_secs(1));
            let started = tokio::time::Instant::now();
            let s = ExecStream::spawn(&spec, futures::stream::pending().boxed(), None, control);
            let status = s.wait().await;
            if want_killed {
                assert_eq!(status, ExitStatus::TimedOut);
                assert_eq!(tries.load(Ordering::SeqCst), 4);
            } else {
                assert!(
                    matches!(&status, ExitStatus::KillFailed(why) if why.contains("no process slot")),
                    "{status:?}"
                );
                assert!(!status.success());
                assert!(tries.load(Ordering::SeqCst) > 3);
                // Bounded: the timeout plus the kill bound.
                assert!(started.elapsed() <= Duration::from_secs(1) + KILL_BOUND);
            }
        }
    }

    #[tokio::test]
    async fn a_broken_stream_is_transport_lost_never_success() {
        let chunks = vec![
            Ok(OutputChunk::Stdout(Bytes::from_static(b"partial"))),
            Err(std::io::Error::other("connection reset")),
        ];
        let (control, killed) = fake(0);
        let s = ExecStream::spawn(
            &ExecSpec::new(["x"]),
            futures::stream::iter(chunks).boxed(),
            None,
            control,
        );
        let out = s.collect(100).await;
        assert!(matches!(out.status, ExitStatus::TransportLost(ref w) if w.contains("reset")));
        assert_eq!(out.stdout, b"partial");
        assert!(killed.load(Ordering::SeqCst));
    }

    #[tokio::test]
    async fn dropping_the_stream_kills() {
        let (control, killed) = fake(0);
        let s = ExecStream::spawn(
            &ExecSpec::new(["x"]),
            futures::stream::pending().boxed(),
            None,
            control,
        );
        drop(s);
        for _ in 0..100 {
            if killed.load(Ordering::SeqCst) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("dropping the stream did not kill the exec");
    }
}
