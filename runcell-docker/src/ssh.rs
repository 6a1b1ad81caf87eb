//! `ssh://` daemons, reached as the docker CLI reaches them: every connection is the
//! system's ssh client running `docker system dial-stdio` on the remote, the HTTP
//! connection spoken over its stdin and stdout. Nothing is ever prompted for
//! (`BatchMode=yes`): keys come from `ssh_key`, the agent or the user's ssh
//! configuration, and an unknown or changed host key is refused unless the user's
//! configuration says otherwise (`ssh_known_hosts` names the file to check against).
//! No password or key material passes through argv: only paths and names.

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::process::Stdio;
use std::sync::Arc;
use std::task::{Context, Poll};

use bollard::{API_DEFAULT_VERSION, BollardRequest, Docker};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use runcell_core::{Error, ErrorKind, Result};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, ReadBuf};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

/// Where the ssh client's complaints go: the last of them, for connection errors (a
/// watch, so that an error can wait for them to arrive).
pub(crate) type Stderr = tokio::sync::watch::Sender<String>;

/// How much of the ssh client's stderr is kept.
const STDERR_LIMIT: usize = 2048;

/// A bollard client whose connections are ssh processes; and the ssh client's last
/// stderr, to explain a failure to connect.
pub(crate) fn connect(
    address: &str,
    key: Option<&Path>,
    known_hosts: Option<&Path>,
    timeout_secs: u64,
) -> Result<(Docker, Stderr)> {
    let argv = Arc::new(argv(address, key, known_hosts)?);
    let stderr = Stderr::new(String::new());
    let connector = Connector {
        argv,
        stderr: stderr.clone(),
    };
    // An idle connection is an ssh process here and a `dial-stdio` there: not kept long.
    let client = Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(std::time::Duration::from_secs(30))
        .pool_max_idle_per_host(4)
        .build(connector);
    let transport = move |request: BollardRequest| {
        let client = client.clone();
        async move { Ok(client.request(request).await?) }
    };
    // The address only keys the connection pool: every connection is the same command.
    let docker = Docker::connect_with_custom_transport(
        transport,
        Some("http://docker"),
        timeout_secs,
        API_DEFAULT_VERSION,
    )
    .map_err(|e| {
        Error::new(ErrorKind::Config, "docker: cannot set up the ssh transport")
            .with_field("host")
            .with_source(e)
    })?;
    Ok((docker, stderr))
}

/// The ssh client's arguments for `ssh://[user@]host[:port]`, ending with the remote
/// command. A part that could be read as an option, a path or a query is refused.
fn argv(address: &str, key: Option<&Path>, known_hosts: Option<&Path>) -> Result<Vec<String>> {
    let bad = |why: &str| {
        Error::new(
            ErrorKind::Config,
            format!("docker: {why} in the ssh address {address} (ssh://[user@]host[:port])"),
        )
        .with_field("host")
    };
    let rest = address
        .strip_prefix("ssh://")
        .ok_or_else(|| bad("no ssh:// scheme"))?;
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.contains(['/', '?', '#']) {
        return Err(bad("a path or query"));
    }
    let (user, host_port) = match rest.rsplit_once('@') {
        Some((user, hp)) => (Some(user), hp),
        None => (None, rest),
    };
    let (host, port) = match host_port.strip_prefix('[') {
        // [v6] or [v6]:port
        Some(v6) => {
            let (host, after) = v6.split_once(']').ok_or_else(|| bad("an unclosed '['"))?;
            match after {
                "" => (host, None),
                _ => (
                    host,
                    Some(
                        after
                            .strip_prefix(':')
                            .ok_or_else(|| bad("junk after ']'"))?,
                    ),
                ),
            }
        }
        None => match host_port.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (host_port, None),
        },
    };
    // Names as DNS, IP literals and login names spell them: nothing ssh could read as an
    // option or expand (`%h` in a user's ProxyCommand).
    let valid = |s: &str| {
        !s.is_empty()
            && !s.starts_with('-')
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':'))
    };
    if !valid(host) {
        return Err(bad("no valid host"));
    }
    let mut argv: Vec<String> = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=30", "-T"]
        .map(String::from)
        .into();
    if let Some(user) = user {
        if !valid(user) {
            return Err(bad("no valid user"));
        }
        argv.extend(["-l".into(), user.into()]);
    }
    if let Some(port) = port {
        port.parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| bad("no valid port"))?;
        argv.extend(["-p".into(), port.into()]);
    }
    if let Some(key) = key {
        argv.extend(["-i".into(), existing_file(key, "ssh_key")?]);
    }
    if let Some(file) = known_hosts {
        let file = existing_file(file, "ssh_known_hosts")?;
        argv.extend([
            "-o".into(),
            format!("UserKnownHostsFile=\"{file}\""),
            "-o".into(),
            "StrictHostKeyChecking=yes".into(),
        ]);
    }
    argv.extend(
        ["--", host, "docker", "system", "dial-stdio"]
            .into_iter()
            .map(String::from),
    );
    Ok(argv)
}

/// A file that exists, as ssh reads it in an argument or a quoted `-o` value
/// ([`ErrorKind::Config`] naming `field` otherwise).
fn existing_file(path: &Path, field: &str) -> Result<String> {
    let config = |why: String| Error::new(ErrorKind::Config, why).with_field(field);
    if !path.is_file() {
        return Err(config(format!(
            "docker: {field}: no file at {}",
            path.display()
        )));
    }
    path.to_str()
        .filter(|p| !p.contains(['"', '\n', '%']))
        .map(str::to_string)
        .ok_or_else(|| {
            config(format!(
                "docker: {field} must be a UTF-8 path without quotes, newlines or '%'"
            ))
        })
}

/// Makes a connection: starts the ssh client.
#[derive(Clone)]
struct Connector {
    argv: Arc<Vec<String>>,
    stderr: Stderr,
}

impl tower_service::Service<hyper::Uri> for Connector {
    type Response = TokioIo<SshStream>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = std::io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: hyper::Uri) -> Self::Future {
        let (argv, stderr) = (self.argv.clone(), self.stderr.clone());
        Box::pin(async move {
            let mut child = Command::new("ssh")
                .args(argv.iter())
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .kill_on_drop(true)
                .spawn()
                .map_err(|e| {
                    std::io::Error::new(e.kind(), format!("cannot start the ssh client: {e}"))
                })?;
            if let Some(err) = child.stderr.take() {
                // Line by line as it comes, so that a failed connection's reason is there
                // when the error is reported; the last lines, at most STDERR_LIMIT.
                tokio::spawn(async move {
                    let mut lines = tokio::io::BufReader::new(err).lines();
                    while let Ok(Some(line)) = lines.next_line().await {
                        let line = line.trim();
                        if line.is_empty() {
                            continue;
                        }
                        tracing::debug!("ssh: {line}");
                        stderr.send_modify(|said| {
                            if said.len() + line.len() > STDERR_LIMIT {
                                said.clear();
                            }
                            if !said.is_empty() {
                                said.push('\n');
                            }
                            said.push_str(line);
                        });
                    }
                });
            }
            let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
                return Err(std::io::Error::other(
                    "the ssh client has no stdin or stdout",
                ));
            };
            Ok(TokioIo::new(SshStream {
                stdin: Some(stdin),
                stdout,
                _child: child,
            }))
        })
    }
}

/// One connection: the ssh client's stdout to read, its stdin to write; the client is
/// killed when the connection is dropped.
struct SshStream {
    /// Taken (closed) at shutdown: the pipe's end is the remote's end of input (a plain
    /// exec's stdin EOF); tokio's `ChildStdin` does nothing on shutdown.
    stdin: Option<ChildStdin>,
    stdout: ChildStdout,
    _child: Child,
}

impl Connection for SshStream {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

impl AsyncRead for SshStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stdout).poll_read(cx, buf)
    }
}

impl AsyncWrite for SshStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.stdin.as_mut() {
            Some(stdin) => Pin::new(stdin).poll_write(cx, buf),
            None => Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into())),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.stdin.as_mut() {
            Some(stdin) => Pin::new(stdin).poll_flush(cx),
            None => Poll::Ready(Ok(())),
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if let Some(stdin) = self.stdin.as_mut() {
            std::task::ready!(Pin::new(stdin).poll_flush(cx))?;
        }
        self.stdin = None;
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::argv;

    #[test]
    fn addresses_become_ssh_arguments() {
        let tail = ["docker", "system", "dial-stdio"];
        let args = argv("ssh://alice@10.1.2.3:2222", None, None).unwrap();
        assert_eq!(
            args,
            [
                "-o",
                "BatchMode=yes",
                "-o",
                "ConnectTimeout=30",
                "-T",
                "-l",
                "alice",
                "-p",
                "2222",
                "--",
                "10.1.2.3"
            ]
            .iter()
            .chain(&tail)
            .map(|s| s.to_string())
            .collect::<Vec<_>>()
        );
        let args = argv("ssh://[::1]:22/", None, None).unwrap();
        assert!(args.ends_with(&["--", "::1", "docker", "system", "dial-stdio"].map(String::from)));
        assert!(args.windows(2).any(|w| w == ["-p", "22"]));
        let args = argv("ssh://host", None, None).unwrap();
        assert!(!args.contains(&"-l".to_string()) && !args.contains(&"-p".to_string()));
    }

    #[test]
    fn addresses_that_could_inject_options_are_refused() {
        for bad in [
            "ssh://-oProxyCommand=sh",
            "ssh://-x@host",
            "ssh://host:99999",
            "ssh://host:0",
            "ssh://host:port",
            "ssh://host/path",
            "ssh://host?x=1",
            "ssh://",
            "ssh://a b",
            "ssh://[::1",
            "ssh://%h@host",
            "ssh://host%x",
            "ssh://us'er@host",
            "tcp://host",
        ] {
            let e = argv(bad, None, None).expect_err(bad);
            assert_eq!(e.field(), Some("host"), "{bad}: {e}");
        }
        let e = argv("ssh://host", Some("/nonexistent/key".as_ref()), None).unwrap_err();
        assert_eq!(e.field(), Some("ssh_key"));
        let e = argv("ssh://host", None, Some("/nonexistent/kh".as_ref())).unwrap_err();
        assert_eq!(e.field(), Some("ssh_known_hosts"));
    }
}
