//! Reaching the daemon: its address (configured, from the environment, or the first
//! local socket of Docker's and Podman's), plain, TLS or ssh, the API version; and what
//! the engine is: Podman or Docker, and whether it enforces resource limits.

use std::time::Duration;

use bollard::Docker;
use runcell_core::{Error, ErrorKind, Result};

#[cfg(feature = "ssh")]
use crate::ssh;
use crate::{DockerConfig, DockerDriver};

const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
const DEFAULT_SOCKET: &str = "unix:///var/run/docker.sock";
/// Rootful Podman's API socket (`systemctl enable --now podman.socket`).
const PODMAN_SOCKET: &str = "/run/podman/podman.sock";

/// The daemon address when the config names none, and where it came from: `DOCKER_HOST`,
/// else Podman's `CONTAINER_HOST`, else the first socket that exists of Docker's, rootful
/// Podman's and rootless Podman's (`$XDG_RUNTIME_DIR/podman/podman.sock`), else Docker's
/// (so that the error names it).
fn default_host(
    env: impl Fn(&str) -> Option<String>,
    exists: impl Fn(&str) -> bool,
) -> (String, &'static str) {
    if let Some(host) = env("DOCKER_HOST") {
        return (host, "DOCKER_HOST");
    }
    if let Some(host) = env("CONTAINER_HOST") {
        return (host, "CONTAINER_HOST");
    }
    let docker = DEFAULT_SOCKET.trim_start_matches("unix://");
    let rootless = env("XDG_RUNTIME_DIR").map(|dir| format!("{dir}/podman/podman.sock"));
    let candidates = [
        (Some(docker.to_string()), "default socket"),
        (Some(PODMAN_SOCKET.to_string()), "Podman's socket"),
        (rootless, "rootless Podman's socket"),
    ];
    for (path, origin) in candidates {
        if let Some(path) = path.filter(|p| exists(p)) {
            return (format!("unix://{path}"), origin);
        }
    }
    (DEFAULT_SOCKET.to_string(), "default socket")
}

/// Whether an engine enforces memory, CPU and pids limits: not when it runs rootless on
/// cgroup v1 (rootless Docker and Podman then accept the limits and ignore them), nor
/// without a cgroup manager (`cgroupfs` off: driver `none`). Such an engine's capabilities
/// say so, and a spec with limits is refused naming the field instead of running
/// unlimited.
/// `podman_rootless`: what Podman's `/info` says in its `Rootless` field (Podman does not
/// list `name=rootless` among its security options, and bollard's `SystemInfo` has no
/// such field; see [`podman_rootless`]).
fn enforces_limits(info: &bollard::models::SystemInfo, podman_rootless: bool) -> bool {
    use bollard::models::{SystemInfoCgroupDriverEnum as Driver, SystemInfoCgroupVersionEnum as V};
    let rootless = podman_rootless
        || info
            .security_options
            .iter()
            .flatten()
            .any(|o| o.split(',').any(|part| part == "name=rootless"));
    let v1 = matches!(info.cgroup_version, Some(V::_1));
    let unmanaged = matches!(info.cgroup_driver, Some(Driver::NONE));
    !(unmanaged || rootless && v1)
}

/// Whether the Podman service on `socket` runs rootless: the `Rootless` field of its
/// `/info`, read with a request of our own (bollard's `SystemInfo` drops the field).
/// False when it cannot be read (then only `name=rootless` counts).
async fn podman_rootless(socket: &str, timeout: Duration) -> bool {
    use http_body_util::BodyExt;
    let read = async {
        let stream = tokio::net::UnixStream::connect(socket).await.ok()?;
        let (mut send, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .ok()?;
        tokio::spawn(conn);
        let request = hyper::Request::get("/info")
            .header(hyper::header::HOST, "podman")
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .ok()?;
        let response = send.send_request(request).await.ok()?;
        let body = response.into_body().collect().await.ok()?.to_bytes();
        let info: serde_json::Value = serde_json::from_slice(&body).ok()?;
        info.get("Rootless")?.as_bool()
    };
    let rootless = tokio::time::timeout(timeout, read).await.ok().flatten();
    tracing::debug!(socket, ?rootless, "Podman's Rootless field");
    rootless.unwrap_or(false)
}

/// The TLS files of a cert directory, each checked to exist (a missing one is
/// [`ErrorKind::Config`] naming it, before any connection).
#[cfg(feature = "tls")]
fn tls_files(dir: &std::path::Path) -> Result<[std::path::PathBuf; 3]> {
    let files = ["key.pem", "cert.pem", "ca.pem"].map(|f| dir.join(f));
    for file in &files {
        if !file.is_file() {
            return Err(Error::new(
                ErrorKind::Config,
                format!("docker: TLS needs {} (cert_path)", file.display()),
            )
            .with_field("cert_path"));
        }
    }
    Ok(files)
}

impl DockerDriver {
    /// Connects to the daemon and negotiates the API version (Debian's dockerd speaks 1.41).
    /// An unreachable daemon is [`ErrorKind::Unavailable`] naming the address tried.
    pub async fn connect(config: DockerConfig) -> Result<DockerDriver> {
        let (address, origin) = match &config.host {
            Some(h) => (h.clone(), "config"),
            None => default_host(
                |name| std::env::var(name).ok().filter(|v| !v.is_empty()),
                |path| std::path::Path::new(path).exists(),
            ),
        };
        let unavailable = |e: bollard::errors::Error| {
            Error::new(
                ErrorKind::Unavailable,
                format!("cannot reach the Docker daemon at {address} ({origin})"),
            )
            .with_source(e)
        };
        let timeout = config.timeout.unwrap_or(DEFAULT_TIMEOUT);
        // DOCKER_TLS_VERIFY and DOCKER_CERT_PATH are read by bollard, as the docker CLI does.
        let ssh = address.starts_with("ssh://");
        for (field, set) in [
            ("ssh_key", config.ssh_key.is_some()),
            ("ssh_known_hosts", config.ssh_known_hosts.is_some()),
        ] {
            if set && !ssh {
                return Err(Error::new(
                    ErrorKind::Config,
                    format!("docker: {field} is for an ssh:// host, not {address}"),
                )
                .with_field(field));
            }
        }
        let mut ssh_stderr = None;
        let docker = match &config.cert_path {
            None if ssh => {
                let (docker, stderr) = Self::connect_ssh(&address, &config, timeout)?;
                ssh_stderr = Some(stderr);
                Ok(docker)
            }
            None => Docker::connect_with_host(&address),
            Some(dir) => Self::connect_tls(&address, dir, timeout)?,
        }
        .map_err(unavailable)?
        .with_timeout(timeout);
        // Why an ssh connection failed is on the ssh client's stderr, which may come a
        // moment after the connection closed: waited for up to a second.
        let ssh_said = |e: bollard::errors::Error| {
            let stderr = ssh_stderr.clone();
            async move {
                let Some(stderr) = stderr else {
                    return unavailable(e);
                };
                let mut said = stderr.subscribe();
                let arrived = said.wait_for(|said| !said.is_empty());
                let _ = tokio::time::timeout(Duration::from_secs(1), arrived).await;
                let said = said.borrow().clone();
                match said {
                    said if said.is_empty() => unavailable(e),
                    said => unavailable(e).with("ssh", said),
                }
            }
        };
        let probe = async {
            let docker = docker.negotiate_version().await?;
            let info = docker.info().await?;
            let version = docker.version().await?;
            Ok::<_, bollard::errors::Error>((docker, info, version))
        };
        let (docker, info, version) = match probe.await {
            Ok(answers) => answers,
            Err(e) => return Err(ssh_said(e).await),
        };
        let podman = version
            .components
            .iter()
            .flatten()
            .any(|c| c.name.contains("Podman"));
        // Asked only where it matters: rootless limits are lost on cgroup v1 alone.
        let v1 = matches!(
            info.cgroup_version,
            Some(bollard::models::SystemInfoCgroupVersionEnum::_1)
        );
        let podman_rootless = match address.strip_prefix("unix://") {
            Some(socket) if podman && v1 => podman_rootless(socket, timeout).await,
            _ => false,
        };
        let limits = enforces_limits(&info, podman_rootless);
        if !limits {
            tracing::info!(%address, "the engine does not enforce resource limits (rootless on cgroup v1): memory, CPU and pids limits are unsupported");
        }
        Ok(DockerDriver {
            docker,
            address,
            credentials: config.credentials,
            docker_config_dir: config.docker_config_dir,
            limits,
            podman,
        })
    }

    #[cfg(feature = "tls")]
    fn connect_tls(
        address: &str,
        dir: &std::path::Path,
        timeout: Duration,
    ) -> Result<std::result::Result<Docker, bollard::errors::Error>> {
        if !(address.starts_with("tcp://") || address.starts_with("https://")) {
            return Err(Error::new(
                ErrorKind::Config,
                format!("docker: cert_path is for a tcp:// or https:// host, not {address}"),
            )
            .with_field("cert_path"));
        }
        let [key, cert, ca] = tls_files(dir)?;
        Ok(Docker::connect_with_ssl(
            address,
            &key,
            &cert,
            &ca,
            timeout.as_secs().max(1),
            bollard::API_DEFAULT_VERSION,
        ))
    }

    #[cfg(not(feature = "tls"))]
    fn connect_tls(
        _: &str,
        _: &std::path::Path,
        _: Duration,
    ) -> Result<std::result::Result<Docker, bollard::errors::Error>> {
        Err(Error::unsupported(
            "cert_path",
            "TLS: runcell-docker was built without its `tls` feature",
        ))
    }

    #[cfg(feature = "ssh")]
    fn connect_ssh(
        address: &str,
        config: &DockerConfig,
        timeout: Duration,
    ) -> Result<(Docker, ssh::Stderr)> {
        ssh::connect(
            address,
            config.ssh_key.as_deref(),
            config.ssh_known_hosts.as_deref(),
            timeout.as_secs().max(1),
        )
    }

    #[cfg(not(feature = "ssh"))]
    fn connect_ssh(
        _: &str,
        _: &DockerConfig,
        _: Duration,
    ) -> Result<(Docker, tokio::sync::watch::Sender<String>)> {
        Err(Error::unsupported(
            "host",
            "ssh://: runcell-docker was built without its `ssh` feature",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::{default_host, enforces_limits};

    /// Limits are declared only where the engine enforces them.
    #[test]
    fn rootless_on_cgroup_v1_has_no_limits() {
        use bollard::models::{
            SystemInfo, SystemInfoCgroupDriverEnum as D, SystemInfoCgroupVersionEnum as V,
        };
        let info = |options: &[&str], v: V, d: D| SystemInfo {
            security_options: Some(options.iter().map(|o| o.to_string()).collect()),
            cgroup_version: Some(v),
            cgroup_driver: Some(d),
            ..SystemInfo::default()
        };
        let seccomp = "name=seccomp,profile=default";
        assert!(enforces_limits(
            &info(&[seccomp], V::_1, D::CGROUPFS),
            false
        ));
        assert!(enforces_limits(
            &info(&[seccomp, "name=rootless"], V::_2, D::SYSTEMD),
            false
        ));
        assert!(!enforces_limits(
            &info(&[seccomp, "name=rootless"], V::_1, D::CGROUPFS),
            false
        ));
        // Rootless Podman says so in its own field only.
        assert!(!enforces_limits(
            &info(&[seccomp], V::_1, D::CGROUPFS),
            true
        ));
        assert!(enforces_limits(&info(&[seccomp], V::_2, D::SYSTEMD), true));
        assert!(!enforces_limits(&info(&[seccomp], V::_2, D::NONE), false));
        assert!(enforces_limits(&SystemInfo::default(), false));
    }

    /// The address without a configured host: the environment first, then the first
    /// socket that exists, Docker's before Podman's.
    #[test]
    fn the_default_host_prefers_docker_then_podman() {
        let host = |env: &[(&str, &str)], sockets: &[&str]| {
            let (address, origin) = default_host(
                |name| {
                    env.iter()
                        .find(|(k, _)| *k == name)
                        .map(|(_, v)| v.to_string())
                },
                |path| sockets.contains(&path),
            );
            (address, origin.to_string())
        };
        let pair = |a: &str, o: &str| (a.to_string(), o.to_string());
        let docker = "/var/run/docker.sock";
        let podman = "/run/podman/podman.sock";
        let rootless = "/run/user/1000/podman/podman.sock";
        let xdg = [("XDG_RUNTIME_DIR", "/run/user/1000")];
        assert_eq!(
            host(
                &[
                    ("DOCKER_HOST", "tcp://h:2376"),
                    ("CONTAINER_HOST", "unix:///x")
                ],
                &[docker]
            ),
            pair("tcp://h:2376", "DOCKER_HOST")
        );
        assert_eq!(
            host(&[("CONTAINER_HOST", "unix:///x")], &[docker]),
            pair("unix:///x", "CONTAINER_HOST")
        );
        assert_eq!(
            host(&xdg, &[docker, podman, rootless]),
            pair("unix:///var/run/docker.sock", "default socket")
        );
        assert_eq!(
            host(&xdg, &[podman, rootless]),
            pair("unix:///run/podman/podman.sock", "Podman's socket")
        );
        assert_eq!(
            host(&xdg, &[rootless]),
            pair(
                "unix:///run/user/1000/podman/podman.sock",
                "rootless Podman's socket"
            )
        );
        assert_eq!(
            host(&[], &[rootless]),
            pair("unix:///var/run/docker.sock", "default socket")
        );
    }
}
