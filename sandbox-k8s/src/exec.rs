//! Exec over the API's websocket (`v5.channel.k8s.io`, stdin EOF through the CLOSE
//! signal). Kubernetes exec has no env or working directory: a fixed wrapper in argv
//! reads them from stdin as a small shell header, so env values never reach the exec
//! URL (and so audit logs); the rest of stdin is the command's.
//!
//! The wrapper runs the command as its child and, when it exits, writes a trailer with
//! the exit code to stderr (`\0\0sbx-exit:<exec id>:<code>\0`). The driver strips it and
//! reports the code at once: on containerd a background child that keeps stdout open
//! would otherwise hold the exec open until it exits (kubernetes#92057). Output that
//! follows the trailer is still read for [`AFTER_EXIT_BOUND`].

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{AttachParams, AttachedProcess};
use runcell_core::{
    EXEC_ID_ENV, Error, ErrorKind, ExecControl, ExecSpec, ExecStream, ExitStatus, KILL_SCRIPT,
    OutputChunk, Result, Stdin,
};
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

fn is_shell_name(name: &str) -> bool {
    name.chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The header script for one exec: its env, its working directory, then the command.
///
/// `framed_stdin`: for API servers that only speak `v4.channel.k8s.io`, where closing
/// stdin closes the whole connection, stdin is never closed; instead the header gives the
/// command `/dev/null` or exactly the `n` bytes that follow it (`head -c n`).
pub fn header(spec: &ExecSpec, marker: &str, framed_stdin: bool) -> String {
    let mut script = String::new();
    let mut odd_names = Vec::new();
    for (name, value) in spec.env.iter().chain(std::iter::once(&(
        EXEC_ID_ENV.to_string(),
        marker.to_string(),
    ))) {
        if is_shell_name(name) {
            script.push_str(&format!("export {name}={}\n", sh_quote(value)));
        } else {
            odd_names.push(sh_quote(&format!("{name}={value}")));
        }
    }
    if let Some(dir) = &spec.working_dir {
        script.push_str(&format!(
            "cd -- {q} 2>/dev/null || {{ echo \"sandbox: cannot enter the working directory \"{q} >&2; exit 126; }}\n",
            q = sh_quote(dir)
        ));
    }
    let command = if odd_names.is_empty() {
        "\"$@\"".to_string()
    } else {
        format!("env {} \"$@\"", odd_names.join(" "))
    };
    match (&spec.stdin, framed_stdin) {
        (_, false) | (Stdin::Piped, true) => script.push_str(&format!("{command}\n")),
        (Stdin::Null, true) => script.push_str(&format!("{command} </dev/null\n")),
        (Stdin::Bytes(b), true) => script.push_str(&format!("head -c {} | {command}\n", b.len())),
    }
    script.push_str(&format!(
        "rc=$?\nprintf '\\000\\000sbx-exit:{marker}:%d\\000' \"$rc\" >&2\nexit \"$rc\"\n"
    ));
    format!("{}\n{script}", script.len())
}

/// Starts one exec in the pod `name`. `framed_stdin`: see [`header`].
pub async fn start(
    pods: &Api<Pod>,
    name: &str,
    spec: ExecSpec,
    framed_stdin: bool,
) -> Result<ExecStream> {
    spec.validate()?;
    if spec.user.is_some() {
        return Err(Error::unsupported(
            "user",
            "Kubernetes exec cannot switch user",
        ));
    }
    if framed_stdin && matches!(spec.stdin, Stdin::Piped) {
        return Err(Error::unsupported(
            "stdin",
            "streaming stdin needs v5.channel.k8s.io (Kubernetes 1.30+)",
        ));
    }
    let marker = format!("{:016x}", rand::random::<u64>());
    let mut argv: Vec<String> = ["sh", "-c", WRAPPER, "sandbox-exec"]
        .map(String::from)
        .to_vec();
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
    let mut process = pods
        .exec(name, argv, &params)
        .await
        .map_err(|e| exec_error(name, e))?;
    let mut stdin = process
        .stdin()
        .ok_or_else(|| Error::new(ErrorKind::Backend, "k8s: exec without stdin"))?;
    let stdout = process
        .stdout()
        .ok_or_else(|| Error::new(ErrorKind::Backend, "k8s: exec without stdout"))?;
    let stderr = process
        .stderr()
        .ok_or_else(|| Error::new(ErrorKind::Backend, "k8s: exec without stderr"))?;
    let header = header(&spec, &marker, framed_stdin);
    // On v4, stdin must stay open until the exec is over: a task writes the header and
    // the bytes, then holds the writer until the exec's control is dropped.
    let (keep_open, mut keep_open_rx) = tokio::sync::oneshot::channel::<()>();
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
                .with("run", name)
                .with_source(e)
        })?;
        Some(Box::pin(stdin))
    };
    let output = futures::stream::select(
        ReaderStream::with_capacity(stdout, STREAM_BUF).map(|r| r.map(OutputChunk::Stdout)),
        ReaderStream::with_capacity(stderr, STREAM_BUF).map(|r| r.map(OutputChunk::Stderr)),
    )
    .boxed();
    let exit_code = Arc::new(std::sync::Mutex::new(None));
    let output = strip_trailer(output, Trailer::new(&marker), exit_code.clone());
    let status = process.take_status();
    let control = K8sExec {
        pods: pods.clone(),
        pod: name.to_string(),
        marker,
        exit_code,
        framed_stdin,
        _keep_stdin_open: keep_open,
        status: Mutex::new(status.map(|f| Box::pin(f) as StatusFuture)),
        process: Mutex::new(Some(process)),
    };
    Ok(ExecStream::spawn(&spec, output, sink, Box::new(control)))
}

type StatusFuture = std::pin::Pin<
    Box<
        dyn std::future::Future<
                Output = Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Status>,
            > + Send,
    >,
>;

/// Maps a failure to start an exec: a pod that is gone or not running is a lost run.
pub fn exec_error(pod: &str, e: kube::Error) -> Error {
    let lost = match &e {
        kube::Error::Api(status) => status.code == 404 || status.code == 400,
        kube::Error::UpgradeConnection(u) => {
            let text = u.to_string();
            text.contains("404") || text.contains("400") || text.contains("not found")
        }
        _ => false,
    };
    if lost {
        Error::new(ErrorKind::RunLost, "the run's pod is gone or not running")
            .with("run", pod)
            .with_source(e)
    } else {
        crate::error::map("exec", e).with("run", pod)
    }
}

struct K8sExec {
    pods: Api<Pod>,
    pod: String,
    marker: String,
    /// The code from the wrapper's trailer, once seen.
    exit_code: Arc<std::sync::Mutex<Option<i64>>>,
    framed_stdin: bool,
    /// Dropped with the control: releases a v4 stdin kept open.
    _keep_stdin_open: tokio::sync::oneshot::Sender<()>,
    status: Mutex<Option<StatusFuture>>,
    /// Kept alive until the status is read: dropping it aborts the websocket task.
    process: Mutex<Option<AttachedProcess>>,
}

/// How long to wait for the status frame after the output streams closed.
const STATUS_WAIT: Duration = Duration::from_secs(10);

#[async_trait]
impl ExecControl for K8sExec {
    async fn status(&self) -> Result<ExitStatus> {
        let trailer_code = *self.exit_code.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(code) = trailer_code {
            // The command exited; the websocket may stay open for a background child.
            self.process.lock().await.take();
            return Ok(ExitStatus::from_code(code));
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

    async fn kill(&self) -> Result<()> {
        let spec =
            ExecSpec::new(["sh", "-c", KILL_SCRIPT, "sandbox-kill", &self.marker]).working_dir("/");
        let killer = Box::pin(start(&self.pods, &self.pod, spec, self.framed_stdin)).await?;
        self.process.lock().await.take();
        let status = killer.wait().await;
        if status.success() {
            Ok(())
        } else {
            Err(
                Error::new(ErrorKind::Backend, format!("the kill exec {status}"))
                    .with("run", &self.pod),
            )
        }
    }
}

/// How long output is still read after the command exited (its trailer arrived), for
/// what background children or buffered pipes still deliver.
pub const AFTER_EXIT_BOUND: Duration = Duration::from_secs(2);

type Output = futures::stream::BoxStream<'static, std::io::Result<OutputChunk>>;

/// Forwards `output` with the trailer removed from stderr, records its exit code, and ends
/// at most [`AFTER_EXIT_BOUND`] after the trailer.
fn strip_trailer(
    mut output: Output,
    mut trailer: Trailer,
    exit_code: Arc<std::sync::Mutex<Option<i64>>>,
) -> Output {
    let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<OutputChunk>>(4);
    tokio::spawn(async move {
        let mut deadline: Option<tokio::time::Instant> = None;
        loop {
            let next = match deadline {
                None => output.next().await,
                Some(d) => match tokio::time::timeout_at(d, output.next()).await {
                    Ok(n) => n,
                    Err(_) => break,
                },
            };
            let item = match next {
                None => break,
                Some(Ok(OutputChunk::Stderr(b))) => {
                    let (forward, code) = trailer.scan(&b);
                    if let Some(code) = code {
                        *exit_code.lock().unwrap_or_else(|p| p.into_inner()) = Some(code);
                        deadline = Some(tokio::time::Instant::now() + AFTER_EXIT_BOUND);
                    }
                    if forward.is_empty() {
                        continue;
                    }
                    Ok(OutputChunk::Stderr(forward.into()))
                }
                Some(other) => other,
            };
            if tx.send(item).await.is_err() {
                return;
            }
        }
        let rest = trailer.flush();
        if !rest.is_empty() {
            let _ = tx.send(Ok(OutputChunk::Stderr(rest.into()))).await;
        }
    });
    tokio_stream_from(rx)
}

fn tokio_stream_from(mut rx: tokio::sync::mpsc::Receiver<std::io::Result<OutputChunk>>) -> Output {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx)).boxed()
}

/// Finds and removes `\0\0sbx-exit:<marker>:<code>\0` in a byte stream split in chunks.
#[derive(Debug)]
pub struct Trailer {
    prefix: Vec<u8>,
    held: Vec<u8>,
    done: bool,
}

impl Trailer {
    /// A scanner for the trailer of the exec with this marker.
    pub fn new(marker: &str) -> Trailer {
        Trailer {
            prefix: format!("\0\0sbx-exit:{marker}:").into_bytes(),
            held: Vec::new(),
            done: false,
        }
    }

    /// Takes the next chunk; returns the bytes to pass on and the code once complete.
    pub fn scan(&mut self, chunk: &[u8]) -> (Vec<u8>, Option<i64>) {
        if self.done {
            return (chunk.to_vec(), None);
        }
        let mut data = std::mem::take(&mut self.held);
        data.extend_from_slice(chunk);
        if let Some(start) = find(&data, &self.prefix) {
            let digits_at = start + self.prefix.len();
            let Some(end) = data[digits_at..].iter().position(|b| *b == 0) else {
                self.held = data[start..].to_vec();
                return (data[..start].to_vec(), None);
            };
            let code = std::str::from_utf8(&data[digits_at..digits_at + end])
                .ok()
                .and_then(|d| d.parse().ok());
            if code.is_some() {
                self.done = true;
                let mut forward = data[..start].to_vec();
                forward.extend_from_slice(&data[digits_at + end + 1..]);
                return (forward, code);
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
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
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
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Status, StatusCause, StatusDetails};

    use super::*;

    #[test]
    fn header_exports_quoted_env_and_enters_the_directory() {
        let spec = ExecSpec::new(["x"])
            .env("A", "it's $HOME")
            .env("my.var", "1")
            .working_dir("/tmp/a b");
        let h = header(&spec, "m1", false);
        let (len, script) = h.split_once('\n').unwrap();
        assert_eq!(len.parse::<usize>().unwrap(), script.len());
        insta::assert_snapshot!(script);
        let framed = header(&spec.clone().stdin_bytes(&b"12345"[..]), "m1", true);
        assert!(
            framed.contains("head -c 5 | env 'my.var=1' \"$@\"\n"),
            "{framed}"
        );
        assert!(header(&spec, "m1", true).contains("\"$@\" </dev/null\n"));
    }

    #[test]
    fn the_trailer_is_found_across_chunks_and_removed() {
        let whole = b"err1\0\0sbx-exit:m1:137\0late".to_vec();
        for split in 0..whole.len() {
            let mut t = Trailer::new("m1");
            let (mut out, mut code) = t.scan(&whole[..split]);
            let (more, c2) = t.scan(&whole[split..]);
            out.extend(more);
            code = code.or(c2);
            out.extend(t.flush());
            assert_eq!(code, Some(137), "split at {split}");
            assert_eq!(out, b"err1late", "split at {split}");
        }
        let mut t = Trailer::new("m1");
        let (out, code) = t.scan(b"\0\0sbx-exit:other:1\0 and \0\0sbx");
        assert_eq!(code, None);
        let mut all = out;
        all.extend(t.flush());
        assert_eq!(all, b"\0\0sbx-exit:other:1\0 and \0\0sbx");
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
