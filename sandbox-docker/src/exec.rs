//! One exec: create → start (hijacked, `Tty=false`) → inspect, and the kill that a
//! timeout or cancellation needs (Docker has no kill-exec API).

use std::time::Duration;

use async_trait::async_trait;
use bollard::Docker;
use bollard::container::LogOutput;
use bollard::exec::{CreateExecOptions, StartExecOptions, StartExecResults};
use futures::StreamExt;
use runcell_core::{
    EXEC_ID_ENV, Error, ErrorKind, ExecControl, ExecSpec, ExecStream, ExitStatus, OutputChunk,
    Result, Stdin,
};

use crate::error;

/// How long to poll `inspect` for the exit code after the streams closed.
const STATUS_POLL: Duration = Duration::from_secs(5);

/// Starts one exec in `container`.
pub async fn start(docker: &Docker, container: &str, spec: ExecSpec) -> Result<ExecStream> {
    spec.validate()?;
    let exec_id_marker = format!("{:016x}", rand::random::<u64>());
    let mut env: Vec<String> = spec.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    env.push(format!("{EXEC_ID_ENV}={exec_id_marker}"));
    let attach_stdin = !matches!(spec.stdin, Stdin::Null);
    let created = docker
        .create_exec(
            container,
            CreateExecOptions {
                attach_stdin: Some(attach_stdin),
                attach_stdout: Some(true),
                attach_stderr: Some(true),
                tty: Some(false),
                env: Some(env),
                cmd: Some(spec.argv.clone()),
                user: spec.user.clone(),
                working_dir: spec.working_dir.clone(),
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
    let control = DockerExec {
        docker: docker.clone(),
        container: container.to_string(),
        exec_id: created.id,
        marker: exec_id_marker,
        spec: ExecSpec {
            stdin: Stdin::Null,
            timeout: None,
            ..spec.clone()
        },
    };
    Ok(ExecStream::spawn(
        &spec,
        output,
        attach_stdin.then_some(input),
        Box::new(control),
    ))
}

/// Maps a create/start failure: a container that is gone or not running is a lost run.
fn exec_error(container: &str, e: bollard::errors::Error) -> Error {
    match error::status(&e) {
        Some(404) | Some(409) => Error::new(
            ErrorKind::RunLost,
            "the run's container is gone or not running",
        )
        .with("run", container)
        .with_source(e),
        _ => error::map("exec", e).with("run", container),
    }
}

struct DockerExec {
    docker: Docker,
    container: String,
    exec_id: String,
    marker: String,
    /// The exec's own spec, for the kill and the 126 probe (same user, env, directory).
    spec: ExecSpec,
}

impl DockerExec {
    /// Runs a helper script in the run with this exec's user and environment.
    async fn helper(&self, script: &str, args: &[&str], in_root: bool) -> Result<ExitStatus> {
        let mut argv: Vec<String> = ["sh", "-c", script, "sandbox-helper"]
            .map(String::from)
            .to_vec();
        argv.extend(args.iter().map(|a| a.to_string()));
        let mut spec = ExecSpec {
            argv,
            ..self.spec.clone()
        };
        if in_root {
            spec.working_dir = Some("/".into());
        }
        Ok(Box::pin(start(&self.docker, &self.container, spec))
            .await?
            .wait()
            .await)
    }

    /// Docker before 23 reports 126 both for "not executable" and "not found"; a shell
    /// reports 127 for the latter. Probe whether the program exists to tell them apart.
    async fn refine_126(&self) -> ExitStatus {
        let program = &self.spec.argv[0];
        let probe = r#"command -v -- "$1" >/dev/null 2>&1 || [ -e "$1" ]"#;
        match self.helper(probe, &[program], false).await {
            Ok(ExitStatus::Exited(1)) => ExitStatus::Exited(127),
            _ => ExitStatus::Exited(126),
        }
    }
}

#[async_trait]
impl ExecControl for DockerExec {
    async fn status(&self) -> Result<ExitStatus> {
        let deadline = tokio::time::Instant::now() + STATUS_POLL;
        loop {
            let inspect = self
                .docker
                .inspect_exec(&self.exec_id)
                .await
                .map_err(|e| error::map("inspect exec", e).with("run", &self.container))?;
            match (inspect.running, inspect.exit_code) {
                (Some(false), Some(126)) => return Ok(self.refine_126().await),
                (Some(false), Some(code)) => return Ok(ExitStatus::from_code(code)),
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

    async fn kill(&self) -> Result<()> {
        let status = self
            .helper(runcell_core::KILL_SCRIPT, &[&self.marker], true)
            .await?;
        if status.success() {
            Ok(())
        } else {
            Err(
                Error::new(ErrorKind::Backend, format!("the kill exec {status}"))
                    .with("run", &self.container),
            )
        }
    }
}
