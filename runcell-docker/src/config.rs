//! The driver's settings and the ways to build it besides [`DockerDriver::connect`]
//! (`client.rs`): [`DockerDriver::from_client`] and the registry's
//! [`DockerDriver::from_config`].

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bollard::Docker;
use runcell_core::{Driver, DriverConfig, Error, ErrorKind, Result};

use crate::{DockerDriver, RegistryCredentials};

/// How the driver reaches the daemon. Built with [`DockerConfig::default`] and its setters.
/// `Debug` never shows a password.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct DockerConfig {
    /// `unix:///path`, `tcp://host:port` or `http://...`; default: `DOCKER_HOST`, else
    /// `CONTAINER_HOST` (Podman's), else the first local socket that exists of Docker's
    /// (`/var/run/docker.sock`), rootful Podman's (`/run/podman/podman.sock`) and rootless
    /// Podman's (`$XDG_RUNTIME_DIR/podman/podman.sock`).
    pub host: Option<String>,
    /// Per-request timeout of the API client (not of exec streams). Default 60 s.
    pub timeout: Option<Duration>,
    /// Registry credentials for pulls, one entry per registry host; they win over
    /// `config.json`.
    pub credentials: Vec<RegistryCredentials>,
    /// The directory of the Docker CLI's `config.json` read for pull credentials;
    /// default `$DOCKER_CONFIG`, else `~/.docker`.
    pub docker_config_dir: Option<PathBuf>,
    /// TLS to a `tcp://` daemon with the client certificate and CA in this directory
    /// (`ca.pem`, `cert.pem`, `key.pem`, as the docker CLI lays them out). Default: as the
    /// docker CLI, TLS when `DOCKER_TLS_VERIFY` is set, from `DOCKER_CERT_PATH` (else
    /// `~/.docker`). Needs the `tls` feature (on by default).
    pub cert_path: Option<PathBuf>,
    /// The private key for an `ssh://[user@]host[:port]` daemon (`ssh -i`); default: the
    /// ssh client's own configuration (`~/.ssh/config`, the agent, default keys). An
    /// `ssh://` daemon is reached as the docker CLI reaches it: the system's `ssh` runs
    /// `docker system dial-stdio` on the remote (never prompting). Needs the `ssh` feature
    /// (on by default).
    pub ssh_key: Option<PathBuf>,
    /// For an `ssh://` host: the `known_hosts` file its host key is checked against
    /// (strictly: an unknown or changed key is refused). Default: the ssh client's own
    /// configuration (`~/.ssh/known_hosts`; never prompted, so an unknown host fails).
    pub ssh_known_hosts: Option<PathBuf>,
}

impl DockerConfig {
    /// Sets the daemon address (`unix:///path`, `tcp://host:port`, `ssh://user@host`).
    pub fn host(mut self, host: impl Into<String>) -> Self {
        self.host = Some(host.into());
        self
    }

    /// Sets the per-request timeout of the API client.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Adds credentials for pulls from `server` (a registry host such as
    /// `registry.example:5000`, or `docker.io`); they win over `config.json`.
    pub fn credentials(
        mut self,
        server: impl Into<String>,
        username: impl Into<String>,
        password: impl Into<String>,
    ) -> Self {
        self.credentials
            .push(RegistryCredentials::new(server, username, password));
        self
    }

    /// Sets the directory of the `config.json` read for pull credentials.
    pub fn docker_config_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.docker_config_dir = Some(dir.into());
        self
    }

    /// Connects with TLS, with `ca.pem`, `cert.pem` and `key.pem` from `dir`.
    pub fn cert_path(mut self, dir: impl Into<PathBuf>) -> Self {
        self.cert_path = Some(dir.into());
        self
    }

    /// Authenticates to an `ssh://` host with this private key.
    pub fn ssh_key(mut self, key: impl Into<PathBuf>) -> Self {
        self.ssh_key = Some(key.into());
        self
    }

    /// Checks an `ssh://` host's key against this `known_hosts` file, strictly.
    pub fn ssh_known_hosts(mut self, file: impl Into<PathBuf>) -> Self {
        self.ssh_known_hosts = Some(file.into());
        self
    }
}

impl DockerDriver {
    /// A driver on an existing bollard client (TLS, ssh, custom timeouts). The caller is
    /// responsible for `negotiate_version()` when the daemon is older than the client.
    pub fn from_client(docker: Docker) -> DockerDriver {
        DockerDriver {
            docker,
            address: "(caller's client)".into(),
            credentials: Vec::new(),
            docker_config_dir: None,
            limits: true,
            podman: false,
        }
    }

    /// The registry constructor: keys `host`, `timeout_secs`, `cert_path` (TLS),
    /// `registry_server` with
    /// `registry_username` and `registry_password` (all three or none), `docker_config`
    /// (the directory of `config.json`).
    pub async fn from_config(mut config: DriverConfig) -> Result<Arc<dyn Driver>> {
        let host = config.take("host");
        let timeout = config
            .take_parsed::<u64>("timeout_secs")?
            .map(Duration::from_secs);
        let server = config.take("registry_server");
        let username = config.take("registry_username");
        let password = config.take("registry_password");
        let credentials = match (server, username, password) {
            (None, None, None) => Vec::new(),
            (Some(s), Some(u), Some(p)) => vec![RegistryCredentials::new(s, u, p)],
            (s, u, p) => {
                let missing: Vec<&str> = [
                    ("registry_server", s.is_none()),
                    ("registry_username", u.is_none()),
                    ("registry_password", p.is_none()),
                ]
                .into_iter()
                .filter_map(|(k, absent)| absent.then_some(k))
                .collect();
                return Err(Error::new(
                    ErrorKind::Config,
                    format!(
                        "docker: registry credentials need registry_server, registry_username and registry_password; missing: {}",
                        missing.join(", ")
                    ),
                ));
            }
        };
        let docker_config_dir = config.take("docker_config").map(PathBuf::from);
        let cert_path = config.take("cert_path").map(PathBuf::from);
        let ssh_key = config.take("ssh_key").map(PathBuf::from);
        let ssh_known_hosts = config.take("ssh_known_hosts").map(PathBuf::from);
        config.finish()?;
        Ok(Arc::new(
            DockerDriver::connect(DockerConfig {
                host,
                timeout,
                credentials,
                docker_config_dir,
                cert_path,
                ssh_key,
                ssh_known_hosts,
            })
            .await?,
        ))
    }
}
