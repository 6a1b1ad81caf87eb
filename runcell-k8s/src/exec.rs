//! One raw exec over the API's websocket (`v5.channel.k8s.io`, stdin EOF through the
//! CLOSE signal). Kubernetes exec has no env or working directory: a fixed wrapper in argv
//! reads them from stdin as a small shell header, so env values never reach the exec
//! URL (and so audit logs); the rest of stdin is the command's. Core adds the exec marker
//! (in the env it gives), feeds stdin, runs the pump and the kill.
//!
//! The wrapper runs the command as its child and, when it exits, writes a trailer with
//! the exit code to stderr (`\0\0sbx-exit:<nonce>:<code>\0`), after a mark of the same
//! kind on stdout (`\xffsbx-out:<nonce>:<code>\0`). The driver strips both and reports
//! the code at once: on containerd a background child that keeps stdout open would
//! otherwise hold the exec open until it exits (kubernetes#92057).
//!
//! The two channels travel apart (containerd, the kubelet and the API server copy each
//! on its own), so the stderr trailer may arrive while megabytes of the command's stdout
//! are still on their way. The stdout mark says when they all arrived: until it comes, no
//! pause ends the output (a stall of [`AFTER_EXIT_CAP`] with no stdout arriving, or four
//! caps in all, fails the exec as cut, never as a success with part of its output; a
//! stream that ends first is complete only if the exec's status frame comes). Output that follows both is
//! a background child's: it is read while it flows, until [`AFTER_EXIT_BOUND`] passes
//! without any, for at most [`AFTER_EXIT_CAP`]. (A pause bound alone cut 780 KiB off a
//! 256 MiB archive on a loaded machine.) The stdout mark starts with `0xff`, a byte that
//! text never holds: the scanner holds back a chunk's tail only when it could be the
//! mark's start, so a text protocol is never kept waiting.
//!
//! The nonce is a fresh random value per exec that exists only in the header (a literal
//! of the wrapper's script, read from stdin): it is in no environment, argv or URL, so the
//! command cannot print a trailer of its own and forge its status. It is distinct from
//! the exec's `RUNCELL_EXEC_ID`, which the command's processes carry so the kill finds
//! them. The same channel tells the driver that the command never started because the
//! working directory cannot be entered ([`ExitStatus::NotStarted`]).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{AttachParams, AttachedProcess};
use runcell_core::raw::{RawExec, RawProcess, RawStatus};
use runcell_core::{Error, ErrorKind, ExecSpec, ExitStatus, OutputChunk, Result, Stdin};
use tokio::io::AsyncWriteExt;
use tokio::sync::Mutex;
use tokio_util::io::ReaderStream;

use crate::pod::CONTAINER;

/// The only script that appears in the exec URL: read the header's length, evaluate the
/// header (exports, `cd`), then `exec` the command with the remaining stdin.
pub const WRAPPER: &str = r#"IFS= read -r n || exit 125; eval "$(dd bs=1 count="$n" 2>/dev/null)""#;

/// Buffer per stream between the websocket task and our reader.
const STREAM_BUF: usize = 64 * 1024;

/// Quotes a string for POSIX sh.
pub fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// True for a name a POSIX shell can export (the wrapper's shell drops the others).
pub(crate) fn is_shell_name(name: &str) -> bool {
    name.chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// A fresh nonce for one exec's trailer: 128 random bits, hex.
pub fn new_nonce() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// The `printf` of a trailer with this payload (the nonce is a literal of the script).
fn trailer_printf(nonce: &str, payload: &str) -> String {
    format!("printf '\\000\\000sbx-exit:{nonce}:{payload}\\000'")
}

/// The `printf` of the stdout mark with this payload (its arguments and its redirection
/// of stderr to follow: a failed write, on a stdout the command left non-blocking and
/// full, must not print into the command's stderr).
fn mark_printf(nonce: &str, payload: &str) -> String {
    format!("printf '\\377sbx-out:{nonce}:{payload}\\000'")
}

/// The header script for one exec: its env, its working directory, then the command.
///
/// `exec` is the raw exec as core gives it (argv, env, working directory, stdin; user and
/// limits are not read): its env includes `RUNCELL_EXEC_ID`, the exec marker, exported so
/// that the kill finds the command's processes. `nonce` authenticates the trailer and is
/// never exported.
///
/// `run_env` is the run's environment (the container's): a shell drops the entries whose
/// names are not shell identifiers from what it passes on, so those are given again
/// (`env --`), before the exec's own (which win).
///
/// The command runs as `( exec "$@" )`, or through `env -- 'NAME=value'...` when a name
/// is not a shell identifier: either way it is executed, never interpreted by the
/// wrapper's shell (no builtins, no access to the wrapper's variables), and a name that
/// looks like an option (`-i`) is an assignment.
///
/// `framed_stdin`: for API servers that only speak `v4.channel.k8s.io`, where closing
/// stdin closes the whole connection, stdin is never closed; instead the header gives the
/// command `/dev/null` or exactly the `n` bytes that follow it (`head -c n`).
///
/// `marked`: the wrapper writes the stdout mark before each trailer (not for a command
/// whose output says where it ends, [`RawExec::self_delimited`]).
pub fn header(
    exec: &ExecSpec,
    nonce: &str,
    framed_stdin: bool,
    marked: bool,
    run_env: &[(String, String)],
) -> String {
    let mark = |payload: &str| match marked {
        true => format!("{} 2>/dev/null; ", mark_printf(nonce, payload)),
        false => String::new(),
    };
    let mut script = String::new();
    let mut odd_names: Vec<String> = run_env
        .iter()
        .filter(|(name, _)| !is_shell_name(name))
        .map(|(name, value)| sh_quote(&format!("{name}={value}")))
        .collect();
    for (name, value) in &exec.env {
        if is_shell_name(name) {
            script.push_str(&format!("export {name}={}\n", sh_quote(value)));
        } else {
            odd_names.push(sh_quote(&format!("{name}={value}")));
        }
    }
    if let Some(dir) = &exec.working_dir {
        let q = sh_quote(dir);
        script.push_str(&format!(
            "cd -- {q} 2>/dev/null || {{ {mark}if [ -e {q} ]; then {denied}; else {missing}; fi >&2; exit 126; }}\n",
            mark = mark("126"),
            denied = trailer_printf(nonce, WORKDIR_DENIED),
            missing = trailer_printf(nonce, WORKDIR_MISSING),
        ));
    }
    let command = if odd_names.is_empty() {
        "( exec \"$@\" )".to_string()
    } else if exec.argv[0].contains('=') {
        // `env` would take the program for one more assignment.
        format!(
            "env -- {} sh -c 'exec \"$@\"' sh \"$@\"",
            odd_names.join(" ")
        )
    } else {
        format!("env -- {} \"$@\"", odd_names.join(" "))
    };
    match (&exec.stdin, framed_stdin) {
        (_, false) | (Stdin::Piped, true) => script.push_str(&format!("{command}\n")),
        (Stdin::Null, true) => script.push_str(&format!("{command} </dev/null\n")),
        (Stdin::Bytes(b), true) => script.push_str(&format!("head -c {} | {command}\n", b.len())),
    }
    // The mark first: once the trailer was written, so was the mark.
    script.push_str(&format!(
        "rc=$?\n{}{} \"$rc\" >&2\nexit \"$rc\"\n",
        match marked {
            true => format!("{} \"$rc\" 2>/dev/null\n", mark_printf(nonce, "%d")),
            false => String::new(),
        },
        trailer_printf(nonce, "%d")
    ));
    format!("{}\n{script}", script.len())
}

/// Trailer payloads other than an exit code: the working directory does not exist, or
/// exists but cannot be entered.
const WORKDIR_MISSING: &str = "cwd-missing";
const WORKDIR_DENIED: &str = "cwd-denied";

/// Starts one raw exec in the pod `name`. `framed_stdin`: see [`header`]; then stdin
/// (`Stdin::Bytes`) is delivered here and no sink is returned. Otherwise the returned
/// sink is core's to feed and close.
///
/// `run_env`: the run's environment, see [`header`].
pub(crate) async fn start(
    pods: &Api<Pod>,
    name: &str,
    exec: RawExec,
    framed_stdin: bool,
    run_env: &[(String, String)],
) -> Result<RawProcess> {
    // The header reads the exec as a spec: same argv, env, directory and stdin.
    let RawExec {
        argv,
        env,
        working_dir,
        stdin,
        self_delimited,
        ..
    } = exec;
    let spec = ExecSpec {
        argv,
        env,
        working_dir,
        stdin,
        ..Default::default()
    };
    let nonce = new_nonce();
    // The exec marker goes into the wrapper's environment at its start (through `env`), not
    // only as an export of the header: BusyBox's shell runs applets (`exec yes`) in the
    // forked shell without an execve, so the process's /proc environ, where the kill looks
    // for the marker, is the one it started with. The marker is a random id, not a secret.
    let marker = spec
        .env
        .iter()
        .rev()
        .find(|(k, _)| k == runcell_core::EXEC_ID_ENV)
        .map(|(k, v)| format!("{k}={v}"));
    let mut argv: Vec<String> = Vec::new();
    if let Some(marker) = marker {
        argv.extend(["env".to_string(), marker]);
    }
    argv.extend(["sh", "-c", WRAPPER, "sandbox-exec"].map(String::from));
    argv.extend(spec.argv.iter().cloned());
    let params = AttachParams {
        container: Some(CONTAINER.into()),
        stdin: true,
        stdout: true,
        stderr: true,
        tty: false,
        max_stdin_buf_size: Some(STREAM_BUF),
        max_stdout_buf_size: Some(STREAM_BUF),
        max_stderr_buf_size: Some(STREAM_BUF),
    };
    let mut process = pods.exec(name, argv, &params).await.map_err(exec_error)?;
    let mut stdin = process
        .stdin()
        .ok_or_else(|| Error::new(ErrorKind::Backend, "k8s: exec without stdin"))?;
    let stdout = process
        .stdout()
        .ok_or_else(|| Error::new(ErrorKind::Backend, "k8s: exec without stdout"))?;
    let stderr = process
        .stderr()
        .ok_or_else(|| Error::new(ErrorKind::Backend, "k8s: exec without stderr"))?;
    let marked = !self_delimited;
    let header = header(&spec, &nonce, framed_stdin, marked, run_env);
    // On v4, stdin must stay open until the exec is over: a task writes the header and
    // the bytes, then holds the writer until the exec's status is dropped.
    let (keep_open, mut keep_open_rx) = tokio::sync::oneshot::channel::<()>();
    // A piped stdin on v4 (only core's exec helper asks for one there: the capability is
    // off) is handed over raw after the header; its end closes the whole connection,
    // which the helper takes as its end too.
    let framed_stdin = framed_stdin && !matches!(spec.stdin, Stdin::Piped);
    let sink: Option<std::pin::Pin<Box<dyn tokio::io::AsyncWrite + Send>>> = if framed_stdin {
        let bytes = match &spec.stdin {
            Stdin::Bytes(b) => b.clone(),
            _ => bytes::Bytes::new(),
        };
        tokio::spawn(async move {
            let write = async {
                stdin.write_all(header.as_bytes()).await?;
                stdin.write_all(&bytes).await?;
                stdin.flush().await
            };
            tokio::select! {
                r = write => if let Err(e) = r { tracing::debug!("framed stdin: {e}") },
                _ = &mut keep_open_rx => return,
            }
            let _ = keep_open_rx.await;
            drop(stdin);
        });
        None
    } else {
        stdin.write_all(header.as_bytes()).await.map_err(|e| {
            Error::new(ErrorKind::Backend, "k8s: could not send the exec header")
                .with_operation("exec")
                .with_source(e)
        })?;
        Some(Box::pin(stdin))
    };
    let output = futures::stream::select(
        ReaderStream::with_capacity(stdout, STREAM_BUF).map(|r| r.map(OutputChunk::Stdout)),
        ReaderStream::with_capacity(stderr, STREAM_BUF).map(|r| r.map(OutputChunk::Stderr)),
    )
    .boxed();
    let seen = Arc::new(std::sync::Mutex::new(Seen::default()));
    let output = strip_trailer(output, &nonce, marked, seen.clone());
    let status = process.take_status();
    Ok(RawProcess {
        output,
        stdin: sink,
        status: Box::new(K8sStatus {
            working_dir: spec.working_dir,
            seen,
            _keep_stdin_open: keep_open,
            status: Mutex::new(status.map(|f| Box::pin(f) as StatusFuture)),
            process: Mutex::new(Some(process)),
        }),
    })
}

type StatusFuture = std::pin::Pin<
    Box<
        dyn std::future::Future<
                Output = Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Status>,
            > + Send,
    >,
>;

/// Maps a failure to start an exec: a pod that is gone or not running is a lost run. (Core
/// adds the run id.)
fn exec_error(e: kube::Error) -> Error {
    let lost = match &e {
        // A kubelet answers an exec into a container that is no longer running (its
        // keep-alive died) with a 500 "container not found (\"<name>\")".
        kube::Error::Api(status) => {
            status.code == 404
                || status.code == 400
                || (status.code == 500
                    && (status.message.contains("container not found")
                        || status.message.contains("is not running")))
        }
        kube::Error::UpgradeConnection(u) => {
            let text = u.to_string();
            text.contains("404") || text.contains("400") || text.contains("not found")
        }
        _ => false,
    };
    if lost {
        Error::new(ErrorKind::RunLost, "the run's pod is gone or not running")
            .with_operation("exec")
            .with_source(e)
    } else {
        crate::error::map("exec", e)
    }
}

/// The status of one exec: what the wrapper's trailer said, else the status channel.
struct K8sStatus {
    /// The exec's working directory, for the reason of a [`ExitStatus::NotStarted`].
    working_dir: Option<String>,
    /// What the wrapper's trailer said, once seen; whether the output ended unmarked.
    seen: Arc<std::sync::Mutex<Seen>>,
    /// Dropped with the status (when core's pump is done): releases a v4 stdin kept open.
    _keep_stdin_open: tokio::sync::oneshot::Sender<()>,
    status: Mutex<Option<StatusFuture>>,
    /// Kept alive until the status is read: dropping it aborts the websocket task.
    process: Mutex<Option<AttachedProcess>>,
}

/// How long to wait for the status frame after the output streams closed.
const STATUS_WAIT: Duration = Duration::from_secs(10);

#[async_trait]
impl RawStatus for K8sStatus {
    async fn status(&self) -> Result<ExitStatus> {
        let (outcome, unmarked) = {
            let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
            (seen.outcome.clone(), seen.unmarked)
        };
        if let Some(outcome) = outcome {
            if unmarked {
                // The output ended before the command's mark: all of it arrived only if
                // the exec ended, which its status frame says.
                let fut = self.status.lock().await.take();
                let ended = match fut {
                    Some(fut) => {
                        matches!(tokio::time::timeout(STATUS_WAIT, fut).await, Ok(Some(_)))
                    }
                    None => false,
                };
                self.process.lock().await.take();
                return Ok(match ended {
                    true => outcome.status(self.working_dir.as_deref()),
                    false => ExitStatus::TransportLost(
                        "the output ended before the command's end mark, without a status: it may be incomplete".into(),
                    ),
                });
            }
            // The command exited; the websocket may stay open for a background child.
            self.process.lock().await.take();
            return Ok(outcome.status(self.working_dir.as_deref()));
        }
        let Some(fut) = self.status.lock().await.take() else {
            return Ok(ExitStatus::TransportLost(
                "the status was already read".into(),
            ));
        };
        let status = tokio::time::timeout(STATUS_WAIT, fut).await;
        self.process.lock().await.take();
        Ok(match status {
            Err(_) => ExitStatus::TransportLost("no status frame after the streams closed".into()),
            Ok(None) => ExitStatus::TransportLost("the connection closed without a status".into()),
            Ok(Some(s)) => status_to_exit(&s),
        })
    }
}

/// How long output may pause after all of the command's own output arrived (its trailer
/// and its stdout mark) before the exec's output is taken as over (a background child
/// holding the stream open).
pub const AFTER_EXIT_BOUND: Duration = Duration::from_secs(2);
/// How long output is read at most after all of the command's own output arrived (a
/// background child that keeps printing); and how long the command's own output may
/// stall, its trailer in, before the exec fails as cut.
pub const AFTER_EXIT_CAP: Duration = Duration::from_secs(30);

type Output = futures::stream::BoxStream<'static, std::io::Result<OutputChunk>>;

/// Forwards `output` with the trailer removed from stderr and the mark from stdout,
/// records what the trailer said, and ends at most [`AFTER_EXIT_BOUND`] after both.
fn strip_trailer(
    output: Output,
    nonce: &str,
    marked: bool,
    seen: Arc<std::sync::Mutex<Seen>>,
) -> Output {
    let mut mark = Trailer::mark(nonce);
    // Without a mark, the command's output is taken as in with its trailer.
    mark.done = !marked;
    strip_trailer_within(
        output,
        Trailer::new(nonce),
        mark,
        seen,
        AFTER_EXIT_BOUND,
        AFTER_EXIT_CAP,
    )
}

/// How long the start of what could be the stdout mark is held back while the command
/// runs, when no more output follows (a program that waits for an answer after writing
/// it must get it): a lone `0xff` briefly, a longer start (`0xff` then `sbx-…`, which
/// output hardly ends with) longer. A mark split by a pause that long fails the exec,
/// never with the mark's bytes in a successful output.
const MARK_HOLD: Duration = Duration::from_millis(20);
/// See [`MARK_HOLD`].
const MARK_HOLD_LONG: Duration = Duration::from_secs(2);
/// How many [`AFTER_EXIT_CAP`]s the stdout mark is awaited after the trailer at most,
/// however the output flows (a background child that prints while the mark was lost).
const MARK_WAIT: u32 = 4;

/// What the output told of the command's end, for its status.
#[derive(Debug, Default)]
struct Seen {
    /// What the trailer said, once seen.
    outcome: Option<Outcome>,
    /// The output ended after the trailer without the stdout mark (a command that left
    /// stdout non-blocking and full: the wrapper's mark could not be written): complete
    /// only if the exec's status frame comes.
    unmarked: bool,
}

/// [`strip_trailer`] with its bounds: `pause` without output once the trailer and the
/// mark are in; `cap` in all after that, and without output while the mark is still to
/// come after the trailer (the time the reader takes counts for none: a pause is measured
/// from the last chunk handed over). A stream that stalls or ends before the mark, its
/// trailer in, ends with an error: the command's output did not all arrive.
fn strip_trailer_within(
    mut output: Output,
    mut trailer: Trailer,
    mut mark: Trailer,
    seen: Arc<std::sync::Mutex<Seen>>,
    pause: Duration,
    cap: Duration,
) -> Output {
    let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<OutputChunk>>(4);
    tokio::spawn(async move {
        use tokio::time::Instant;
        let mut exited = false;
        // Set once the trailer and the mark are both in: the cap's end.
        let mut until: Option<Instant> = None;
        // The last chunk received or handed over; the last of stdout received, or any
        // handed over (a command's stdout may trail its trailer: only its own progress
        // counts while the mark is awaited).
        let (mut last, mut last_out) = (Instant::now(), Instant::now());
        // When the trailer came: the mark is awaited for at most `MARK_WAIT` caps.
        let mut exited_at = Instant::now();
        // Since when the mark scanner holds back a tail.
        let mut held_since: Option<Instant> = None;
        let cut = loop {
            let deadline = match (exited, until) {
                (false, _) => held_since.map(|t| t + mark.hold()),
                (true, None) => Some((last_out + cap).min(exited_at + cap * MARK_WAIT)),
                (true, Some(until)) => Some((last + pause).min(until)),
            };
            let next = match deadline {
                None => output.next().await,
                Some(d) => match tokio::time::timeout_at(d, output.next()).await {
                    Ok(n) => n,
                    Err(_) if !exited => {
                        held_since = None;
                        let held = mark.release();
                        if tx.send(Ok(OutputChunk::Stdout(held.into()))).await.is_err() {
                            return;
                        }
                        (last, last_out) = (Instant::now(), Instant::now());
                        continue;
                    }
                    Err(_) => break until.is_none().then_some(CUT),
                },
            };
            last = Instant::now();
            if matches!(next, Some(Ok(OutputChunk::Stdout(_)))) {
                last_out = last;
            }
            let item = match next {
                // Ended before the mark: complete only if the exec ended, which its status
                // frame tells (`Seen::unmarked`).
                None => {
                    if exited && !mark.done {
                        seen.lock().unwrap_or_else(|p| p.into_inner()).unmarked = true;
                    }
                    break None;
                }
                Some(Ok(OutputChunk::Stderr(b))) if !trailer.done => {
                    let (forward, found) = trailer.scan(&b);
                    if let Some(found) = found {
                        seen.lock().unwrap_or_else(|p| p.into_inner()).outcome = Some(found);
                        exited = true;
                        (exited_at, last_out) = (last, last);
                    }
                    if exited && mark.done && until.is_none() {
                        until = Some(Instant::now() + cap);
                    }
                    if forward.is_empty() {
                        continue;
                    }
                    Ok(OutputChunk::Stderr(forward.into()))
                }
                Some(Ok(OutputChunk::Stdout(b))) if !mark.done => {
                    let (forward, _) = mark.scan(&b);
                    if mark.broken {
                        break Some(SPLIT);
                    }
                    held_since = match (mark.held.is_empty(), held_since) {
                        (true, _) => None,
                        (false, None) => Some(Instant::now()),
                        (false, since) => since,
                    };
                    if exited && mark.done && until.is_none() {
                        until = Some(Instant::now() + cap);
                    }
                    if forward.is_empty() {
                        continue;
                    }
                    Ok(OutputChunk::Stdout(forward.into()))
                }
                Some(other) => other,
            };
            if tx.send(item).await.is_err() {
                return;
            }
            (last, last_out) = (Instant::now(), Instant::now());
        };
        for (held, chunk) in [
            (
                mark.flush(),
                OutputChunk::Stdout as fn(bytes::Bytes) -> OutputChunk,
            ),
            (trailer.flush(), OutputChunk::Stderr),
        ] {
            if !held.is_empty() && tx.send(Ok(chunk(held.into()))).await.is_err() {
                return;
            }
        }
        if let Some(why) = cut {
            let _ = tx.send(Err(std::io::Error::other(why))).await;
        }
    });
    tokio_stream_from(rx)
}

/// Why an exec's output failed: it stalled before the command's stdout mark.
const CUT: &str = "the command exited but its output stopped arriving before its end";
/// Why an exec's output failed: the start of the mark was passed on as output.
const SPLIT: &str = "the end mark of the command's output came split by a pause and part of it was passed on as output";

fn tokio_stream_from(mut rx: tokio::sync::mpsc::Receiver<std::io::Result<OutputChunk>>) -> Output {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx)).boxed()
}

/// What the wrapper reported in its trailer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The command ran and exited with this code.
    Exited(i64),
    /// The command did not start: the working directory does not exist.
    WorkdirMissing,
    /// The command did not start: the working directory exists but cannot be entered.
    WorkdirDenied,
}

impl Outcome {
    fn parse(payload: &[u8]) -> Option<Outcome> {
        match payload {
            p if p == WORKDIR_MISSING.as_bytes() => Some(Outcome::WorkdirMissing),
            p if p == WORKDIR_DENIED.as_bytes() => Some(Outcome::WorkdirDenied),
            p => std::str::from_utf8(p)
                .ok()
                .and_then(|d| d.parse().ok())
                .map(Outcome::Exited),
        }
    }

    /// The exec's status; `working_dir` names the directory in a not-started reason.
    pub fn status(&self, working_dir: Option<&str>) -> ExitStatus {
        let dir = working_dir.unwrap_or("(the working directory)");
        match self {
            Outcome::Exited(code) => ExitStatus::from_code(*code),
            Outcome::WorkdirMissing => ExitStatus::NotStarted {
                field: "working_dir".into(),
                reason: format!("{dir}: no such directory in the run"),
            },
            Outcome::WorkdirDenied => ExitStatus::NotStarted {
                field: "working_dir".into(),
                reason: format!("{dir}: not a directory, or not accessible to the run's user"),
            },
        }
    }
}

/// Finds and removes `\0\0sbx-exit:<nonce>:<payload>\0` (the trailer, on stderr) or
/// `\xffsbx-out:<nonce>:<payload>\0` (the mark, on stdout) in a byte stream split in
/// chunks.
#[derive(Debug)]
pub struct Trailer {
    prefix: Vec<u8>,
    held: Vec<u8>,
    done: bool,
    /// What [`Trailer::release`] passed on that may still be the start of a match: were
    /// it one, the match is [`Trailer::broken`].
    released: Vec<u8>,
    /// A match whose start was released as output: found, and not removed.
    broken: bool,
}

/// A payload longer than this is not a trailer.
const MAX_PAYLOAD: usize = 32;

impl Trailer {
    /// A scanner for the trailer of the exec with this nonce.
    pub fn new(nonce: &str) -> Trailer {
        Trailer {
            prefix: format!("\0\0sbx-exit:{nonce}:").into_bytes(),
            held: Vec::new(),
            done: false,
            released: Vec::new(),
            broken: false,
        }
    }

    /// A scanner for the stdout mark of the exec with this nonce.
    pub fn mark(nonce: &str) -> Trailer {
        let mut prefix = vec![0xff];
        prefix.extend_from_slice(format!("sbx-out:{nonce}:").as_bytes());
        Trailer {
            prefix,
            held: Vec::new(),
            done: false,
            released: Vec::new(),
            broken: false,
        }
    }

    /// Takes the next chunk; returns the bytes to pass on and the outcome once complete.
    pub fn scan(&mut self, chunk: &[u8]) -> (Vec<u8>, Option<Outcome>) {
        if self.done {
            return (chunk.to_vec(), None);
        }
        if !self.released.is_empty() {
            let mut joined = std::mem::take(&mut self.released);
            joined.extend_from_slice(&chunk[..chunk.len().min(self.prefix.len())]);
            if joined.starts_with(&self.prefix) {
                self.broken = true;
                self.done = true;
                return (chunk.to_vec(), None);
            }
            if self.prefix.starts_with(&joined) {
                // Still the start of a match: the chunk goes on, and so does the watch.
                self.released = joined;
                return (chunk.to_vec(), None);
            }
        }
        let mut data = std::mem::take(&mut self.held);
        data.extend_from_slice(chunk);
        if let Some(start) = find(&data, &self.prefix) {
            let payload_at = start + self.prefix.len();
            let Some(end) = data[payload_at..].iter().position(|b| *b == 0) else {
                if data.len() - payload_at <= MAX_PAYLOAD {
                    self.held = data[start..].to_vec();
                    return (data[..start].to_vec(), None);
                }
                return (data, None);
            };
            if let Some(outcome) = Outcome::parse(&data[payload_at..payload_at + end]) {
                self.done = true;
                let mut forward = data[..start].to_vec();
                forward.extend_from_slice(&data[payload_at + end + 1..]);
                return (forward, Some(outcome));
            }
            // Not a well-formed trailer: pass it on as output.
            return (data, None);
        }
        // Hold back a tail that could be the start of the trailer.
        let keep = (1..self.prefix.len().min(data.len() + 1))
            .rev()
            .find(|&n| data.ends_with(&self.prefix[..n]))
            .unwrap_or(0);
        self.held = data.split_off(data.len() - keep);
        (data, None)
    }

    /// What is still held back, at the end of the stream.
    pub fn flush(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.held)
    }

    /// What is held back, to pass on before the stream ends (no more output came for
    /// [`Trailer::hold`]); should the match go on in the next chunks, it is
    /// [`Trailer::broken`].
    fn release(&mut self) -> Vec<u8> {
        self.released = self.held.clone();
        std::mem::take(&mut self.held)
    }

    /// How long what is held back may stay so while no more output comes.
    fn hold(&self) -> Duration {
        match self.held.len() {
            0 | 1 => MARK_HOLD,
            _ => MARK_HOLD_LONG,
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    memchr::memmem::find(haystack, needle)
}

/// Reads the exit code from the status channel's `Status`: `Success`, or `Failure` with
/// reason `NonZeroExitCode` and the code in `details.causes[reason=ExitCode]`.
pub fn status_to_exit(s: &k8s_openapi::apimachinery::pkg::apis::meta::v1::Status) -> ExitStatus {
    if s.status.as_deref() == Some("Success") {
        return ExitStatus::Exited(0);
    }
    let code = s
        .details
        .as_ref()
        .and_then(|d| d.causes.as_ref())
        .and_then(|causes| {
            causes
                .iter()
                .find(|c| c.reason.as_deref() == Some("ExitCode"))
        })
        .and_then(|c| c.message.as_deref())
        .and_then(|m| m.trim().parse::<i64>().ok());
    match code {
        Some(code) => ExitStatus::from_code(code),
        None => ExitStatus::TransportLost(format!(
            "the exec failed without an exit code: {}",
            s.message.as_deref().unwrap_or("no message")
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a test stream carries: a chunk after a delay.
    enum Sent {
        Out(u64, &'static [u8]),
        Err(u64, &'static [u8]),
    }

    /// `sent`, then a stream that never ends (a background child holds it) or that ends.
    fn stream(sent: Vec<Sent>, ends: bool) -> Output {
        let items = futures::stream::iter(sent).then(|s| async move {
            let (ms, chunk) = match s {
                Sent::Out(ms, b) => (ms, OutputChunk::Stdout(bytes::Bytes::from_static(b))),
                Sent::Err(ms, b) => (ms, OutputChunk::Stderr(bytes::Bytes::from_static(b))),
            };
            tokio::time::sleep(Duration::from_millis(ms)).await;
            Ok(chunk)
        });
        if ends {
            items.boxed()
        } else {
            items.chain(futures::stream::pending()).boxed()
        }
    }

    /// Reads `output` through the stripper (pause 300 ms, cap 3 s), `reader_ms` per chunk:
    /// stdout, stderr, whether it ended with an error, and the time it took.
    async fn read_stripped(output: Output, reader_ms: u64) -> (Vec<u8>, Vec<u8>, bool, Duration) {
        let (out, err, failed, took, _) = read_stripped_seen(output, reader_ms).await;
        (out, err, failed, took)
    }

    /// `output` through the stripper of nonce `n1` (pause 300 ms, cap 3 s).
    fn stripped(output: Output, seen: Arc<std::sync::Mutex<Seen>>) -> Output {
        let (pause, cap) = (Duration::from_millis(300), Duration::from_secs(3));
        let (trailer, mark) = (Trailer::new("n1"), Trailer::mark("n1"));
        strip_trailer_within(output, trailer, mark, seen, pause, cap)
    }

    /// [`read_stripped`], and whether the output ended after the trailer, unmarked.
    async fn read_stripped_seen(
        output: Output,
        reader_ms: u64,
    ) -> (Vec<u8>, Vec<u8>, bool, Duration, bool) {
        let seen = Arc::new(std::sync::Mutex::new(Seen::default()));
        let mut out = stripped(output, seen.clone());
        let (mut stdout, mut stderr, mut failed) = (Vec::new(), Vec::new(), false);
        let started = tokio::time::Instant::now();
        while let Some(chunk) = out.next().await {
            match chunk {
                Ok(OutputChunk::Stdout(b)) => stdout.extend_from_slice(&b),
                Ok(OutputChunk::Stderr(b)) => stderr.extend_from_slice(&b),
                Ok(_) => {}
                Err(_) => failed = true,
            }
            // A slow reader: it may take longer per chunk than the pause.
            tokio::time::sleep(Duration::from_millis(reader_ms)).await;
        }
        let unmarked = seen.lock().unwrap().unmarked;
        (stdout, stderr, failed, started.elapsed(), unmarked)
    }

    const TRAILER: &[u8] = b"\0\0sbx-exit:n1:0\0";
    const MARK: &[u8] = b"\xffsbx-out:n1:0\0";

    /// After the command exited, its own output is read to its stdout mark however long
    /// it takes to come (the trailer travels apart, on stderr); a background child's
    /// output after that while it flows, however slow its reader, and no longer than the
    /// cap; a pause ends it.
    #[tokio::test(start_paused = true)]
    async fn output_after_the_trailer_is_read_while_it_flows() {
        use Sent::{Err as E, Out as O};
        // A command silent for longer than the cap, whose trailer overtakes its mark.
        for sent in [
            vec![E(3500, TRAILER), O(5, MARK)],
            vec![O(0, b"x"), E(3500, TRAILER), O(5, MARK), O(100, b"bg")],
        ] {
            let (out, _, failed, _) = read_stripped(stream(sent, false), 0).await;
            assert!(!failed && out.len() <= 3, "{out:?}");
        }
        // The command's stdout, with a stall five times the pause, after its trailer:
        // all of it arrives.
        let (out, err, failed, _) = read_stripped(
            stream(
                vec![E(0, TRAILER), O(100, b"a"), O(1500, b"b"), O(0, MARK)],
                false,
            ),
            0,
        )
        .await;
        assert_eq!((out, err, failed), (b"ab".to_vec(), vec![], false));
        // Ten chunks 200 ms apart after both, read at 500 ms each: all of them.
        let mut sent = vec![E(0, TRAILER), O(0, MARK)];
        sent.extend((0..10).map(|_| O(200, b"x")));
        let (out, _, failed, _) = read_stripped(stream(sent, false), 500).await;
        assert_eq!((out, failed), (b"xxxxxxxxxx".to_vec(), false));
        // A pause longer than the bound ends it.
        let sent = vec![
            O(0, b"own"),
            O(0, MARK),
            E(0, TRAILER),
            O(100, b"a"),
            O(100, b"b"),
            O(1000, b"late"),
        ];
        let (out, _, failed, took) = read_stripped(stream(sent, false), 0).await;
        assert_eq!((out, failed), (b"ownab".to_vec(), false));
        assert!(took < Duration::from_millis(900), "{took:?}");
        // Nothing after the trailer and the mark (a silent background child holds the
        // stream): the pause ends it.
        let (out, _, failed, took) =
            read_stripped(stream(vec![O(0, MARK), E(0, TRAILER)], false), 0).await;
        assert!(out.is_empty() && !failed && took < Duration::from_millis(900));
        // A stream that never stops ends at the cap.
        let mut sent = vec![E(0, TRAILER), O(0, MARK)];
        sent.extend((0..100).map(|_| O(100, b"y")));
        let (out, _, failed, took) = read_stripped(stream(sent, false), 0).await;
        assert!(
            out.len() < 40 && !failed && took < Duration::from_secs(4),
            "{} {took:?}",
            out.len()
        );
        // The mark split over chunks, and text ending in a lone byte of it around it.
        let sent = vec![
            O(0, b"1\xff"),
            O(0, b"2"),
            O(0, b"\xffsbx-o"),
            O(0, b"ut:n1:0\0"),
            E(0, TRAILER),
        ];
        let (out, _, failed, _) = read_stripped(stream(sent, true), 0).await;
        assert_eq!((out, failed), (b"1\xff2".to_vec(), false));
    }

    /// While the command runs, the start of what could be the mark is held back only
    /// briefly: a program that waits for an answer gets all it wrote.
    #[tokio::test(start_paused = true)]
    async fn a_tail_like_the_marks_start_is_not_held_while_the_command_waits() {
        use Sent::{Err as E, Out as O};
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let mut out = stripped(tokio_stream_from(rx), Arc::default());
        let stdout = |b: &'static [u8]| Ok(OutputChunk::Stdout(bytes::Bytes::from_static(b)));
        tx.send(stdout(b"prompt\xffsbx-o")).await.unwrap();
        let mut got = Vec::new();
        let started = tokio::time::Instant::now();
        while got.len() < b"prompt\xffsbx-o".len() {
            match tokio::time::timeout(Duration::from_secs(5), out.next()).await {
                Ok(Some(Ok(OutputChunk::Stdout(b)))) => got.extend_from_slice(&b),
                other => panic!("{other:?} after {got:?}"),
            }
        }
        assert_eq!(got, b"prompt\xffsbx-o");
        assert!(started.elapsed() <= MARK_HOLD_LONG + Duration::from_millis(100));
        // A lone 0xff goes on after the short hold, stderr chatter or not.
        let mut sent = vec![O(0, b"prompt\xff")];
        sent.extend((0..100).map(|_| E(10, b".")));
        let mut out = stripped(stream(sent, false), Arc::default());
        let started = tokio::time::Instant::now();
        let mut got = Vec::new();
        while got != b"prompt\xff" {
            if let Some(Ok(OutputChunk::Stdout(b))) = out.next().await {
                got.extend_from_slice(&b);
            }
        }
        assert!(started.elapsed() <= MARK_HOLD + Duration::from_millis(20));
        // A mark split by a pause longer than the short hold right after its 0xff: the
        // exec fails (the 0xff went out as output); after a longer start, it is found.
        let split = vec![O(0, b"data\xff"), O(50, b"sbx-out:n1:0\0"), E(0, TRAILER)];
        let (out, _, failed, _) = read_stripped(stream(split, true), 0).await;
        assert!(failed && out.starts_with(b"data\xff"), "{out:?}");
        let split = vec![O(0, b"data\xffsbx-o"), O(50, b"ut:n1:0\0"), E(0, TRAILER)];
        let (out, _, failed, _) = read_stripped(stream(split, true), 0).await;
        assert_eq!((out, failed), (b"data".to_vec(), false));
        // Split in three, the middle alone.
        let split = vec![
            O(0, b"d\xffsb"),
            O(0, b"x-out:"),
            O(0, b"n1:0\0"),
            E(0, TRAILER),
        ];
        let (out, _, failed, _) = read_stripped(stream(split, true), 0).await;
        assert_eq!((out, failed), (b"d".to_vec(), false));
    }

    /// The command's trailer in and its stdout mark never: a stall of the cap fails the
    /// exec, the end of the stream leaves it to the status; its output so far is passed on.
    #[tokio::test(start_paused = true)]
    async fn output_cut_before_the_mark_is_an_error() {
        use Sent::{Err as E, Out as O};
        let (out, _, failed, took) =
            read_stripped(stream(vec![E(0, TRAILER), O(0, b"part")], false), 0).await;
        assert_eq!((out, failed), (b"part".to_vec(), true));
        assert!(took >= Duration::from_secs(3), "{took:?}");
        // No mark, a background child that keeps printing: ended at the overall bound.
        let mut sent = vec![E(0, TRAILER)];
        sent.extend((0..1000).map(|_| E(1000, b".")));
        let (_, _, failed, took) = read_stripped(stream(sent, false), 0).await;
        assert!(
            failed && took <= Duration::from_secs(3 * MARK_WAIT as u64 + 2),
            "{took:?}"
        );
        // Ended before the mark: the status frame decides (see K8sStatus).
        let (out, _, failed, _, unmarked) =
            read_stripped_seen(stream(vec![O(0, b"part\xffsbx"), E(0, TRAILER)], true), 0).await;
        assert_eq!(
            (out, failed, unmarked),
            (b"part\xffsbx".to_vec(), false, true)
        );
        // Before the trailer, no bound: a command may be silent for as long as it runs;
        // a stream that ends without either is not cut (its status frame tells).
        let (out, _, failed, _) = read_stripped(stream(vec![O(4000, b"slow")], true), 0).await;
        assert_eq!((out, failed), (b"slow".to_vec(), false));
    }

    #[test]
    fn an_exec_into_a_container_that_stopped_is_a_lost_run() {
        let api = |code: u16, message: &str| {
            kube::Error::Api(Box::new(
                kube::core::Status::failure(message, "").with_code(code),
            ))
        };
        for (code, message, lost) in [
            (404, "pods \"x\" not found", true),
            (400, "container sandbox is not valid for pod x", true),
            (500, "container not found (\"sandbox\")", true),
            (500, "internal error", false),
            (403, "forbidden", false),
        ] {
            let kind = exec_error(api(code, message)).kind();
            assert_eq!(
                kind == ErrorKind::RunLost,
                lost,
                "{code} {message}: {kind:?}"
            );
        }
    }
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Status, StatusCause, StatusDetails};

    /// The exec as core hands it over: the spec's env, then the exec marker.
    fn marked(spec: &ExecSpec, marker: &str) -> ExecSpec {
        spec.clone().env(runcell_core::EXEC_ID_ENV, marker)
    }

    #[test]
    fn header_exports_quoted_env_and_enters_the_directory() {
        let spec = ExecSpec::new(["x"])
            .env("A", "it's $HOME")
            .env("my.var", "1")
            .working_dir("/tmp/a b");
        let h = header(&marked(&spec, "m1"), "n1", false, true, &[]);
        let (len, script) = h.split_once('\n').unwrap();
        assert_eq!(len.parse::<usize>().unwrap(), script.len());
        insta::assert_snapshot!(script);
        let framed = header(
            &marked(&spec.clone().stdin_bytes(&b"12345"[..]), "m1"),
            "n1",
            true,
            true,
            &[],
        );
        // A command whose output says where it ends gets no mark.
        let unmarked = header(&marked(&spec, "m1"), "n1", false, false, &[]);
        assert!(!unmarked.contains("sbx-out") && unmarked.contains("sbx-exit:n1:%d"));
        assert!(
            framed.contains("head -c 5 | env -- 'my.var=1' \"$@\"\n"),
            "{framed}"
        );
        assert!(
            header(&marked(&ExecSpec::new(["x"]), "m1"), "n1", true, true, &[])
                .contains("( exec \"$@\" ) </dev/null\n")
        );
    }

    #[test]
    fn the_nonce_is_only_in_the_trailer_commands_never_exported() {
        let spec = ExecSpec::new(["x"]).env("A", "1").working_dir("/w");
        let nonce = new_nonce();
        assert_eq!(nonce.len(), 32);
        assert_ne!(nonce, new_nonce());
        let h = header(&marked(&spec, "marker1"), &nonce, false, true, &[]);
        for line in h.lines().filter(|l| l.contains(&nonce)) {
            assert!(
                line.contains(&format!("printf '\\000\\000sbx-exit:{nonce}:"))
                    || line.contains(&format!("printf '\\377sbx-out:{nonce}:")),
                "the nonce outside a trailer printf: {line}"
            );
            assert!(!line.contains("export"), "{line}");
        }
        assert!(h.contains("export RUNCELL_EXEC_ID='marker1'\n"));
    }

    #[test]
    fn the_trailer_is_found_across_chunks_and_removed() {
        let whole = b"err1\0\0sbx-exit:n1:137\0late".to_vec();
        for split in 0..whole.len() {
            let mut t = Trailer::new("n1");
            let (mut out, mut found) = t.scan(&whole[..split]);
            let (more, f2) = t.scan(&whole[split..]);
            out.extend(more);
            found = found.or(f2);
            out.extend(t.flush());
            assert_eq!(found, Some(Outcome::Exited(137)), "split at {split}");
            assert_eq!(out, b"err1late", "split at {split}");
        }
        let mut t = Trailer::new("n1");
        let (out, found) = t.scan(b"\0\0sbx-exit:other:1\0 and \0\0sbx");
        assert_eq!(found, None);
        let mut all = out;
        all.extend(t.flush());
        assert_eq!(all, b"\0\0sbx-exit:other:1\0 and \0\0sbx");
        let (_, found) = Trailer::new("n1").scan(b"\0\0sbx-exit:n1:cwd-missing\0");
        assert_eq!(found, Some(Outcome::WorkdirMissing));
        assert_eq!(
            Outcome::WorkdirDenied.status(Some("/w")),
            ExitStatus::NotStarted {
                field: "working_dir".into(),
                reason: "/w: not a directory, or not accessible to the run's user".into()
            }
        );
    }

    /// A POSIX shell to run the wrapper with on this machine, as the pod would.
    struct Shell {
        name: &'static str,
        program: std::path::PathBuf,
        /// `PATH` for the wrapper (BusyBox: a directory of applet links only).
        path: String,
        _dir: Option<tempfile::TempDir>,
    }

    /// The system `sh` (dash on Debian) with its coreutils, and BusyBox alone when it is
    /// installed (the suite's image is BusyBox).
    fn shells() -> Vec<Shell> {
        let mut shells = vec![Shell {
            name: "sh",
            program: "sh".into(),
            path: std::env::var("PATH").unwrap_or_default(),
            _dir: None,
        }];
        let busybox = std::env::var("PATH")
            .unwrap_or_default()
            .split(':')
            .map(|d| std::path::Path::new(d).join("busybox"))
            .find(|p| p.is_file());
        if let Some(busybox) = busybox {
            let dir = tempfile::tempdir().unwrap();
            for applet in [
                "sh", "env", "dd", "head", "cat", "printf", "sleep", "true", "test", "[",
            ] {
                std::os::unix::fs::symlink(&busybox, dir.path().join(applet)).unwrap();
            }
            shells.push(Shell {
                name: "busybox",
                program: dir.path().join("sh"),
                path: dir.path().display().to_string(),
                _dir: Some(dir),
            });
        } else {
            eprintln!("busybox not installed: the wrapper is tested with sh only");
        }
        shells
    }

    struct Local {
        stdout: Vec<u8>,
        stderr: Vec<u8>,
        outcome: Option<Outcome>,
    }

    impl Local {
        fn status(&self, spec: &ExecSpec) -> ExitStatus {
            self.outcome
                .clone()
                .expect("no trailer")
                .status(spec.working_dir.as_deref())
        }
    }

    /// The run's env in these tests: names a shell drops, and one it keeps.
    const RUN_ENV: &[(&str, &str)] = &[("-u", "run-dash"), ("run.dot", "1"), ("RUNVAR", "r")];

    /// Runs `sh -c WRAPPER sandbox-exec argv...` with the header (and the stdin bytes) on
    /// stdin, strips the trailer from stderr as the driver does.
    fn run_locally(shell: &Shell, spec: &ExecSpec, marker: &str, framed: bool) -> Local {
        use std::io::Write;
        let nonce = new_nonce();
        // The container's env, as the wrapper receives it and the driver knows it.
        let run_env: Vec<(String, String)> = RUN_ENV
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let mut input = header(&marked(spec, marker), &nonce, framed, true, &run_env).into_bytes();
        if let Stdin::Bytes(b) = &spec.stdin {
            input.extend_from_slice(b);
        }
        let mut child = std::process::Command::new(&shell.program)
            .args(["-c", WRAPPER, "sandbox-exec"])
            .args(&spec.argv)
            .env("PATH", &shell.path)
            .envs(RUN_ENV.iter().copied())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        let _ = stdin.write_all(&input);
        drop(stdin);
        let out = child.wait_with_output().unwrap();
        let mut trailer = Trailer::new(&nonce);
        let (mut stderr, outcome) = trailer.scan(&out.stderr);
        stderr.extend(trailer.flush());
        let mut mark = Trailer::mark(&nonce);
        let (mut stdout, marked) = mark.scan(&out.stdout);
        stdout.extend(mark.flush());
        // The mark is the last thing the wrapper writes to stdout, whenever it writes
        // the trailer.
        assert_eq!(marked.is_some(), outcome.is_some(), "{}", shell.name);
        assert!(
            marked.is_none() || out.stdout.ends_with(b"\0"),
            "{}: output after the mark",
            shell.name
        );
        Local {
            stdout,
            stderr,
            outcome,
        }
    }

    #[test]
    fn a_command_cannot_forge_its_exit_status() {
        for shell in shells() {
            for framed in [false, true] {
                // What users reported: the trailer printed with the exec's id.
                let forged = ExecSpec::new([
                    "sh",
                    "-c",
                    r#"printf '\0\0sbx-exit:%s:0\0' "$RUNCELL_EXEC_ID" >&2; exit 3"#,
                ]);
                let out = run_locally(&shell, &forged, "marker1", framed);
                assert_eq!(
                    out.status(&forged),
                    ExitStatus::Exited(3),
                    "{} framed={framed}",
                    shell.name
                );
                assert_eq!(out.stderr, b"\0\0sbx-exit:marker1:0\0", "{}", shell.name);
                // Nothing the command can read holds the nonce: its env, the wrapper's
                // argv and env; and `eval` is a program here, not the wrapper's builtin.
                let nosy = ExecSpec::new([
                    "sh",
                    "-c",
                    "env; tr '\\0' '\\n' </proc/$PPID/cmdline; tr '\\0' '\\n' </proc/$PPID/environ",
                ]);
                let nonce_free = run_locally(&shell, &nosy, "marker1", framed);
                assert!(
                    String::from_utf8_lossy(&nonce_free.stdout).contains("RUNCELL_EXEC_ID=marker1"),
                    "{}",
                    shell.name
                );
                let eval = ExecSpec::new(["eval", "echo leaked; exit 0"]);
                let out = run_locally(&shell, &eval, "marker1", framed);
                assert_eq!(out.status(&eval), ExitStatus::Exited(127), "{}", shell.name);
                assert!(out.stdout.is_empty(), "{}", shell.name);
            }
        }
    }

    #[test]
    fn env_names_that_look_like_options_reach_the_command() {
        let dir = tempfile::tempdir().unwrap();
        let odd_program = dir.path().join("x=y");
        std::fs::write(&odd_program, "#!/bin/sh\necho ran \"$@\"\n").unwrap();
        std::fs::set_permissions(
            &odd_program,
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        for shell in shells() {
            for framed in [false, true] {
                let spec = ExecSpec::new(["env"])
                    .env("-i", "1")
                    .env("--", "2")
                    .env("-", "3")
                    .env("my.var", "it's 4")
                    .env("-u", "5")
                    .env("PLAIN", "6")
                    .env("WITH SPACE", "7");
                let out = run_locally(&shell, &spec, "m", framed);
                assert_eq!(out.status(&spec), ExitStatus::Exited(0), "{}", shell.name);
                let env = String::from_utf8_lossy(&out.stdout);
                // The exec's `-u` wins over the run's; the run's other names get through.
                assert!(!env.lines().any(|l| l == "-u=run-dash"), "{env}");
                for line in [
                    "-i=1",
                    "--=2",
                    "-=3",
                    "my.var=it's 4",
                    "-u=5",
                    "PLAIN=6",
                    "WITH SPACE=7",
                    "RUNCELL_EXEC_ID=m",
                    "run.dot=1",
                    "RUNVAR=r",
                ] {
                    assert!(
                        env.lines().any(|l| l == line),
                        "{} framed={framed}: {line} missing in {env}",
                        shell.name
                    );
                }
                // A program whose name has '=' is still the program, with odd names.
                let spec = ExecSpec::new([odd_program.to_str().unwrap(), "a"]).env("-i", "1");
                let out = run_locally(&shell, &spec, "m", framed);
                assert_eq!(out.stdout, b"ran a\n", "{}", shell.name);
            }
        }
    }

    #[test]
    fn a_working_dir_that_cannot_be_entered_is_not_started() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("file");
        std::fs::write(&file, "").unwrap();
        for shell in shells() {
            for framed in [false, true] {
                let missing = ExecSpec::new(["true"]).working_dir("/no/such/dir");
                let out = run_locally(&shell, &missing, "m", framed);
                assert!(
                    matches!(out.status(&missing), ExitStatus::NotStarted { ref field, ref reason }
                        if field == "working_dir" && reason.contains("/no/such/dir")),
                    "{}: {:?}",
                    shell.name,
                    out.status(&missing)
                );
                let not_dir = ExecSpec::new(["true"]).working_dir(file.to_str().unwrap());
                let out = run_locally(&shell, &not_dir, "m", framed);
                assert!(
                    matches!(out.status(&not_dir), ExitStatus::NotStarted { ref field, .. } if field == "working_dir"),
                    "{}",
                    shell.name
                );
                let fine = ExecSpec::new(["sh", "-c", "pwd"]).working_dir("/");
                let out = run_locally(&shell, &fine, "m", framed);
                assert_eq!(
                    (out.status(&fine), out.stdout),
                    (ExitStatus::Exited(0), b"/\n".to_vec())
                );
            }
        }
    }

    #[test]
    fn missing_and_non_executable_programs_exit_127_and_126_on_stderr() {
        let dir = tempfile::tempdir().unwrap();
        let not_executable = dir.path().join("plain");
        std::fs::write(&not_executable, "echo hi\n").unwrap();
        for shell in shells() {
            for framed in [false, true] {
                for env in [None, Some(("-odd", "1"))] {
                    let with_env = |mut spec: ExecSpec| {
                        if let Some((k, v)) = env {
                            spec = spec.env(k, v);
                        }
                        spec.stdin_bytes(&b"in"[..])
                    };
                    let missing = with_env(ExecSpec::new(["no-such-binary-xyz"]));
                    let out = run_locally(&shell, &missing, "m", framed);
                    assert_eq!(
                        out.status(&missing),
                        ExitStatus::Exited(127),
                        "{}",
                        shell.name
                    );
                    assert!(out.stdout.is_empty(), "{}", shell.name);
                    assert!(!out.stderr.is_empty(), "{}: no message", shell.name);
                    let plain = with_env(ExecSpec::new([not_executable.to_str().unwrap()]));
                    let out = run_locally(&shell, &plain, "m", framed);
                    assert_eq!(
                        out.status(&plain),
                        ExitStatus::Exited(126),
                        "{}",
                        shell.name
                    );
                    assert!(out.stdout.is_empty(), "{}", shell.name);
                    assert!(!out.stderr.is_empty(), "{}: no message", shell.name);
                }
            }
        }
    }

    #[test]
    fn stdin_reaches_the_command_exactly_on_both_paths() {
        for shell in shells() {
            for framed in [false, true] {
                let spec = ExecSpec::new(["cat"]).stdin_bytes(&b"12\n\x0045"[..]);
                let out = run_locally(&shell, &spec, "m", framed);
                assert_eq!(out.stdout, b"12\n\x0045", "{} framed={framed}", shell.name);
                assert_eq!(out.status(&spec), ExitStatus::Exited(0));
            }
        }
    }

    #[test]
    fn status_frames_map_to_exit_statuses() {
        let ok = Status {
            status: Some("Success".into()),
            ..Default::default()
        };
        assert_eq!(status_to_exit(&ok), ExitStatus::Exited(0));
        let failed = |code: &str| Status {
            status: Some("Failure".into()),
            reason: Some("NonZeroExitCode".into()),
            details: Some(StatusDetails {
                causes: Some(vec![StatusCause {
                    reason: Some("ExitCode".into()),
                    message: Some(code.into()),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(status_to_exit(&failed("3")), ExitStatus::Exited(3));
        assert_eq!(status_to_exit(&failed("137")), ExitStatus::Signaled(9));
        let no_code = Status {
            status: Some("Failure".into()),
            message: Some("boom".into()),
            ..Default::default()
        };
        assert!(
            matches!(status_to_exit(&no_code), ExitStatus::TransportLost(m) if m.contains("boom"))
        );
    }
}
