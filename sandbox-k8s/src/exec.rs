//! Exec over the API's websocket (`v5.channel.k8s.io`, stdin EOF through the CLOSE
//! signal). Kubernetes exec has no env or working directory: a fixed wrapper in argv
//! reads them from stdin as a small shell header, so env values never reach the exec
//! URL (and so audit logs); the rest of stdin is the command's.

use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{AttachParams, AttachedProcess};
use sandbox_core::{
    EXEC_ID_ENV, Error, ErrorKind, ExecControl, ExecSpec, ExecStream, ExitStatus, KILL_SCRIPT,
    OutputChunk, Result,
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
pub fn header(spec: &ExecSpec, marker: &str) -> String {
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
    if odd_names.is_empty() {
        script.push_str("exec \"$@\"\n");
    } else {
        script.push_str(&format!("exec env {} \"$@\"\n", odd_names.join(" ")));
    }
    format!("{}\n{script}", script.len())
}

/// Starts one exec in the pod `name`.
pub async fn start(pods: &Api<Pod>, name: &str, spec: ExecSpec) -> Result<ExecStream> {
    spec.validate()?;
    if spec.user.is_some() {
        return Err(Error::unsupported(
            "user",
            "Kubernetes exec cannot switch user",
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
    stdin
        .write_all(header(&spec, &marker).as_bytes())
        .await
        .map_err(|e| {
            Error::new(ErrorKind::Backend, "k8s: could not send the exec header")
                .with("run", name)
                .with_source(e)
        })?;
    let output = futures::stream::select(
        ReaderStream::with_capacity(stdout, STREAM_BUF).map(|r| r.map(OutputChunk::Stdout)),
        ReaderStream::with_capacity(stderr, STREAM_BUF).map(|r| r.map(OutputChunk::Stderr)),
    )
    .boxed();
    let status = process.take_status();
    let control = K8sExec {
        pods: pods.clone(),
        pod: name.to_string(),
        marker,
        status: Mutex::new(status.map(|f| Box::pin(f) as StatusFuture)),
        process: Mutex::new(Some(process)),
    };
    Ok(ExecStream::spawn(
        &spec,
        output,
        Some(Box::pin(stdin)),
        Box::new(control),
    ))
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
    status: Mutex<Option<StatusFuture>>,
    /// Kept alive until the status is read: dropping it aborts the websocket task.
    process: Mutex<Option<AttachedProcess>>,
}

/// How long to wait for the status frame after the output streams closed.
const STATUS_WAIT: Duration = Duration::from_secs(10);

#[async_trait]
impl ExecControl for K8sExec {
    async fn status(&self) -> Result<ExitStatus> {
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
        let killer = Box::pin(start(&self.pods, &self.pod, spec)).await?;
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
        let h = header(&spec, "m1");
        let (len, script) = h.split_once('\n').unwrap();
        assert_eq!(len.parse::<usize>().unwrap(), script.len());
        insta::assert_snapshot!(script);
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
