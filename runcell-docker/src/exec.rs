//! One raw exec: create → start (hijacked, `Tty=false`) → inspect. Core adds the exec
//! marker, the pump and the kill (Docker has no kill-exec API: core's kill is one more
//! exec).
//!
//! When the engine cannot start the command it writes its own message into the exec's
//! stdout and reports 126 (Docker 20.10) or 127. The message is held back and read: a
//! missing working directory or user is [`ExitStatus::NotStarted`] naming the field, a
//! missing program `Exited(127)` and a non-executable one `Exited(126)`, each with the
//! message on stderr as a shell would put it. No extra exec is started to find out.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bollard::Docker;
use bollard::container::LogOutput;
use bollard::exec::{CreateExecOptions, StartExecOptions, StartExecResults};
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use runcell_core::raw::{RawExec, RawProcess, RawStatus};
use runcell_core::{Error, ErrorKind, ExitStatus, OutputChunk, Result, Stdin};

use crate::error;

/// How long to poll `inspect` for the exit code after the streams closed.
const STATUS_POLL: Duration = Duration::from_secs(5);

/// Starts one raw exec in `container`. Core adds the exec marker, feeds stdin, runs the
/// pump and the kill.
pub async fn start(docker: &Docker, container: &str, exec: RawExec) -> Result<RawProcess> {
    let env: Vec<String> = exec.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let attach_stdin = !matches!(exec.stdin, Stdin::Null);
    let created = docker
        .create_exec(
            container,
            CreateExecOptions {
                attach_stdin: Some(attach_stdin),
                attach_stdout: Some(true),
                attach_stderr: Some(true),
                tty: Some(false),
                env: Some(env),
                cmd: Some(exec.argv),
                user: exec.user,
                working_dir: exec.working_dir,
                ..Default::default()
            },
        )
        .await
        .map_err(|e| exec_error(container, e))?;
    let started = docker
        .start_exec(
            &created.id,
            Some(StartExecOptions {
                detach: false,
                tty: false,
                output_capacity: Some(64 * 1024),
            }),
        )
        .await
        .map_err(|e| exec_error(container, e))?;
    let StartExecResults::Attached { output, input } = started else {
        return Err(Error::new(
            ErrorKind::Backend,
            "docker: exec started detached",
        ));
    };
    let output = output
        .map(|item| match item {
            Ok(LogOutput::StdOut { message }) => Ok(OutputChunk::Stdout(message)),
            Ok(LogOutput::StdErr { message }) => Ok(OutputChunk::Stderr(message)),
            Ok(other) => Err(std::io::Error::other(format!(
                "unexpected unframed output on a non-TTY exec stream ({} bytes): the stream was cut",
                other.into_bytes().len()
            ))),
            Err(e) => Err(std::io::Error::other(e)),
        })
        .boxed();
    let failure = Arc::new(Mutex::new(None));
    let output = hold_engine_message(output, failure.clone());
    Ok(RawProcess {
        output,
        stdin: attach_stdin.then_some(input),
        status: Box::new(DockerStatus {
            docker: docker.clone(),
            container: container.to_string(),
            exec_id: created.id,
            failure,
        }),
    })
}

/// Maps a create/start failure: a container that is gone or not running is a lost run.
fn exec_error(container: &str, e: bollard::errors::Error) -> Error {
    // Podman answers an exec into a stopped container with a 500 "can only create exec
    // sessions on running containers: container state improper" (Docker with a 409).
    let lost = match error::status(&e) {
        Some(404) | Some(409) => true,
        Some(500) => e.to_string().contains("container state improper"),
        _ => false,
    };
    if lost {
        Error::new(
            ErrorKind::RunLost,
            "the run's container is gone or not running",
        )
        .with("run", container)
        .with_source(e)
    } else {
        error::map("exec", e).with("run", container)
    }
}

/// Why the engine could not start the command, read from its message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum StartFailure {
    /// The working directory does not exist or is not a directory.
    WorkingDir(String),
    /// The user or group is unknown in the image.
    User(String),
    /// The program does not exist.
    ProgramNotFound(String),
    /// The run is at a limit (its pids, memory or open files): the kernel refused the
    /// runtime a process, a thread or a descriptor.
    Resources(String),
    /// Anything else the runtime refused (permission denied, exec format error, ...).
    Other(String),
}

const RUNTIME_PREFIXES: [&str; 3] = [
    "OCI runtime exec failed",
    "unable to find user",
    "unable to find group",
];

impl StartFailure {
    /// Reads an engine message; `None` when it is not one.
    pub(crate) fn parse(message: &[u8]) -> Option<StartFailure> {
        let text = String::from_utf8_lossy(message);
        let text = text.trim();
        if !RUNTIME_PREFIXES.iter().any(|p| text.starts_with(p)) {
            return None;
        }
        // What the runtime said, without its wrapping.
        let reason = text
            .trim_start_matches("OCI runtime exec failed: ")
            .trim_start_matches("exec failed: ")
            .trim_start_matches("unable to start container process: ");
        let reason = reason
            .split(": unknown")
            .next()
            .unwrap_or(reason)
            .to_string();
        Some(if reason.starts_with("chdir to cwd") {
            StartFailure::WorkingDir(reason)
        } else if reason.starts_with("unable to find user")
            || reason.starts_with("unable to find group")
        {
            StartFailure::User(reason)
        } else if reason.contains("executable file not found")
            || reason.contains("no such file or directory")
        {
            StartFailure::ProgramNotFound(reason)
        } else if [
            "resource temporarily unavailable",
            "cannot allocate memory",
            "too many open files",
            "failed to create new os thread",
        ]
        .iter()
        .any(|m| reason.to_ascii_lowercase().contains(m))
        {
            StartFailure::Resources(reason)
        } else {
            StartFailure::Other(reason)
        })
    }

    /// The status, given the engine's exit code for the failed start.
    fn status(&self) -> ExitStatus {
        match self {
            StartFailure::WorkingDir(r) => ExitStatus::NotStarted {
                field: "working_dir".into(),
                reason: r.clone(),
            },
            StartFailure::User(r) => ExitStatus::NotStarted {
                field: "user".into(),
                reason: r.clone(),
            },
            StartFailure::Resources(r) => ExitStatus::NotStarted {
                field: "resources".into(),
                reason: r.clone(),
            },
            StartFailure::ProgramNotFound(_) => ExitStatus::Exited(127),
            StartFailure::Other(_) => ExitStatus::Exited(126),
        }
    }

    /// What goes on stderr, for a program that is missing or cannot run.
    fn stderr(&self) -> Option<Bytes> {
        match self {
            StartFailure::ProgramNotFound(r) | StartFailure::Other(r) => {
                Some(Bytes::from(format!("runcell: {r}\n")))
            }
            _ => None,
        }
    }
}

type Output = BoxStream<'static, std::io::Result<OutputChunk>>;

/// Holds back a first stdout chunk that reads like the engine's start failure. If the
/// stream then ends, that was the whole exec: the failure is recorded for the status (and
/// a missing or non-executable program's message goes to stderr). If more output follows,
/// it was the command's own output and is passed on unchanged.
fn hold_engine_message(mut output: Output, failure: Arc<Mutex<Option<StartFailure>>>) -> Output {
    futures::stream::once(async move {
        let first = output.next().await;
        let parsed = match &first {
            Some(Ok(OutputChunk::Stdout(b))) => StartFailure::parse(b),
            _ => None,
        };
        let head: Output = match (first, parsed) {
            (Some(Ok(OutputChunk::Stdout(b))), Some(parsed)) => match output.next().await {
                None => {
                    let stderr = parsed.stderr();
                    *failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(parsed);
                    futures::stream::iter(stderr.map(|e| Ok(OutputChunk::Stderr(e)))).boxed()
                }
                Some(next) => futures::stream::iter([Ok(OutputChunk::Stdout(b)), next]).boxed(),
            },
            (Some(item), _) => futures::stream::iter([item]).boxed(),
            (None, _) => futures::stream::empty().boxed(),
        };
        head.chain(output)
    })
    .flatten()
    .boxed()
}

/// Reads an exec's exit status from the engine.
struct DockerStatus {
    docker: Docker,
    container: String,
    exec_id: String,
    failure: Arc<Mutex<Option<StartFailure>>>,
}

#[async_trait]
impl RawStatus for DockerStatus {
    async fn status(&self) -> Result<ExitStatus> {
        let deadline = tokio::time::Instant::now() + STATUS_POLL;
        loop {
            let inspect = self
                .docker
                .inspect_exec(&self.exec_id)
                .await
                .map_err(|e| error::map("inspect exec", e).with("run", &self.container))?;
            match (inspect.running, inspect.exit_code) {
                (Some(false), Some(code)) => {
                    let failure = self
                        .failure
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .clone();
                    return Ok(match failure {
                        Some(f) if code == 126 || code == 127 => f.status(),
                        _ => ExitStatus::from_code(code),
                    });
                }
                _ if tokio::time::Instant::now() >= deadline => {
                    return Err(Error::new(
                        ErrorKind::Backend,
                        "the exec's streams closed but the engine reports no exit code",
                    )
                    .with("run", &self.container));
                }
                _ => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exec_into_a_stopped_container_is_a_lost_run() {
        let answer =
            |status_code: u16, message: &str| bollard::errors::Error::DockerResponseServerError {
                status_code,
                message: message.to_string(),
            };
        for (code, message, lost) in [
            (404, "No such container: x", true),
            (409, "Container x is not running", true),
            (
                500,
                "can only create exec sessions on running containers: container state improper",
                true,
            ),
            (500, "internal error", false),
            (400, "bad request", false),
        ] {
            let kind = exec_error("x", answer(code, message)).kind();
            assert_eq!(
                kind == ErrorKind::RunLost,
                lost,
                "{code} {message}: {kind:?}"
            );
        }
    }

    #[test]
    fn engine_messages_are_read() {
        let parse = |m: &str| StartFailure::parse(m.as_bytes());
        assert!(matches!(
            parse("OCI runtime exec failed: exec failed: unable to start container process: chdir to cwd (\"/nope\") set in config.json failed: no such file or directory: unknown\r\n"),
            Some(StartFailure::WorkingDir(r)) if r.starts_with("chdir to cwd") && !r.contains("unknown")
        ));
        assert!(matches!(
            parse("unable to find user nobody2: no matching entries in passwd file\n"),
            Some(StartFailure::User(_))
        ));
        assert!(matches!(
            parse("unable to find group g2: no matching entries in group file"),
            Some(StartFailure::User(_))
        ));
        assert!(matches!(
            parse(
                "OCI runtime exec failed: exec failed: unable to start container process: exec: \"nope\": executable file not found in $PATH: unknown"
            ),
            Some(StartFailure::ProgramNotFound(_))
        ));
        assert!(matches!(
            parse(
                "OCI runtime exec failed: exec failed: unable to start container process: exec: \"/nope\": stat /nope: no such file or directory: unknown"
            ),
            Some(StartFailure::ProgramNotFound(_))
        ));
        // A run at its pids limit: the runtime could not start a thread or a process.
        for message in [
            "OCI runtime exec failed: exec failed: unable to start container process: runtime: failed to create new OS thread (have 7 already; errno=11): unknown",
            "OCI runtime exec failed: fork/exec /proc/self/exe: resource temporarily unavailable: unknown",
        ] {
            let full = parse(message).unwrap();
            assert!(
                matches!(full.status(), ExitStatus::NotStarted { ref field, .. } if field == "resources"),
                "{message}"
            );
            let e = full.status().not_started_error().unwrap();
            assert_eq!(e.kind(), ErrorKind::LimitReached);
        }
        let denied = parse("OCI runtime exec failed: exec failed: unable to start container process: exec: \"/etc/passwd\": permission denied: unknown").unwrap();
        assert_eq!(denied.status(), ExitStatus::Exited(126));
        assert_eq!(
            denied.stderr().unwrap(),
            Bytes::from_static(b"runcell: exec: \"/etc/passwd\": permission denied\n")
        );
        assert_eq!(parse("hello"), None);
    }

    #[tokio::test]
    async fn a_lookalike_followed_by_more_output_is_passed_on() {
        let msg = Bytes::from_static(b"unable to find user x: printed by the command\n");
        let items = vec![
            Ok(OutputChunk::Stdout(msg.clone())),
            Ok(OutputChunk::Stdout(Bytes::from_static(b"more"))),
        ];
        let failure = Arc::new(Mutex::new(None));
        let out: Vec<_> =
            hold_engine_message(futures::stream::iter(items).boxed(), failure.clone())
                .map(|r| r.unwrap())
                .collect()
                .await;
        assert_eq!(out.len(), 2);
        assert_eq!(out[0], OutputChunk::Stdout(msg));
        assert!(failure.lock().unwrap().is_none());
    }
}
