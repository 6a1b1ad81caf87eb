//! Docker driver for runcell: one long-lived container per run, entered by exec for
//! every tool call, through the Docker Engine API (bollard; never the docker CLI).
//!
//! Each container runs `sleep infinity` under docker-init (which reaps orphans); the
//! image's ENTRYPOINT and CMD never run. Stop force-removes the container with its
//! anonymous volumes, with no SIGTERM grace period. The driver is a
//! [`runcell_core::raw::Backend`]: everything shared (validation, labels, cleanup,
//! liveness, post-create, timeouts and kills) is runcell-core's.
//!
//! Connect directly with [`DockerDriver::connect`], or through the registry as `docker`
//! (config keys: `host`, `timeout_secs`, `cert_path`, `registry_server` +
//! `registry_username` + `registry_password`, `docker_config`; env
//! `SANDBOX_DOCKER_HOST`, ...). A `tcp://` daemon behind TLS is reached as the docker CLI
//! does (`DOCKER_HOST`, `DOCKER_TLS_VERIFY`, `DOCKER_CERT_PATH`) or with `cert_path`.
//!
//! Pulls send the credentials of the image's registry: the explicit ones of
//! [`DockerConfig::credentials`], else those of the Docker CLI's `config.json`
//! (`$DOCKER_CONFIG`, else `~/.docker`: `credHelpers`, `auths`, `credsStore`). Secrets
//! never appear in logs, `Debug` output, labels or errors.
//!
//! ```no_run
//! use runcell_core::prelude::*;
//! use runcell_docker::{DockerConfig, DockerDriver};
//!
//! # async fn demo() -> runcell_core::Result<()> {
//! let driver = DockerDriver::connect(DockerConfig::default()).await?;
//! let run = driver.start(&RunSpec::new("busybox:latest").workspace_dir("/srv/runs/42")).await?;
//! let out = run.exec(ExecSpec::new(["ls", "/workspace"])).await?;
//! println!("{}", out.stdout_str());
//! run.stop().await?;
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]

mod body;
mod credentials;
mod error;
mod exec;
mod hostdir;
#[cfg(feature = "ssh")]
mod ssh;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bollard::Docker;
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, CreateImageOptionsBuilder, DownloadFromContainerOptionsBuilder,
    ListContainersOptionsBuilder, RemoveContainerOptionsBuilder, UploadToContainerOptionsBuilder,
};
use futures::{StreamExt, TryStreamExt};
use runcell_core::labels;
use runcell_core::raw::{Backend, Plan, PoolState, RawExec, RawProcess};
use runcell_core::{
    ByteStream, Capabilities, Driver, DriverConfig, Error, ErrorKind, Progress, PullPolicy, Result,
    RunInfo, RunSpec, ca, files,
};

pub use body::container_body;
pub use credentials::RegistryCredentials;
use runcell_core::raw::KEEPALIVE;

runcell_core::register_driver!(
    DockerDriver,
    "Docker Engine API (bollard)",
    DockerDriver::from_config
);

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

/// The Docker driver.
#[derive(Debug, Clone)]
pub struct DockerDriver {
    docker: Docker,
    address: String,
    credentials: Vec<RegistryCredentials>,
    docker_config_dir: Option<PathBuf>,
    /// Whether the engine enforces resource limits (see [`enforces_limits`]).
    limits: bool,
    /// Whether the engine is Podman (its Docker-compatible API), whose rename does not
    /// arbitrate racing pool claims.
    podman: bool,
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

/// The TLS files of a cert directory, each checked to exist (a missing one is
/// [`ErrorKind::Config`] naming it, before any connection).
#[cfg(feature = "tls")]
fn tls_files(dir: &std::path::Path) -> Result<[PathBuf; 3]> {
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

const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
const DEFAULT_SOCKET: &str = "unix:///var/run/docker.sock";
/// The file whose exclusive creation claims a pooled target on Podman, in the CA
/// directory ([`ca::DIR`]), which a pooled target keeps writable whatever its user and
/// root filesystem.
const CLAIM_MARK: &str = ".claimed";
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
    ) -> Result<(Docker, std::sync::Arc<std::sync::Mutex<String>>)> {
        Err(Error::unsupported(
            "host",
            "ssh://: runcell-docker was built without its `ssh` feature",
        ))
    }

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

    /// The bollard client, for what this crate does not cover.
    pub fn client(&self) -> &Docker {
        &self.docker
    }

    /// The daemon address in use.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// What the Docker driver supports.
    pub fn capabilities(&self) -> Capabilities {
        Capabilities::none()
            .workspace_mount(true)
            .exec_user(true)
            .user_names(true)
            .memory_limit(self.limits)
            .cpu_limit(self.limits)
            .pids_limit(self.limits)
            .network_none(true)
            .read_only_rootfs(true)
            .cap_drop(true)
            .no_new_privileges(true)
            .ttl(true)
            .files(true)
            .stdin_streaming(true)
            .attach(true)
            .system_trust_store(true)
            .pool(true)
    }

    /// Creates [`CLAIM_MARK`] in the ready pooled target `id` unless it exists: `true` for
    /// the one claim that created it, `false` for the others and for a target gone.
    async fn mark_claimed(&self, id: &str) -> Result<bool> {
        let script = format!("set -C; : > {}/{CLAIM_MARK}", ca::DIR);
        let mut process = match self.exec_raw(id, RawExec::new(["sh", "-c", &script])).await {
            Ok(process) => process,
            Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::RunLost) => {
                return Ok(false);
            }
            Err(e) => return Err(e),
        };
        drop(process.stdin.take());
        while let Some(chunk) = process.output.next().await {
            chunk.map_err(|e| {
                Error::new(ErrorKind::Backend, "the claim exec broke").with_source(e)
            })?;
        }
        Ok(process.status.status().await?.success())
    }

    /// Waits until the name a claim gave resolves. Podman's rename returns before every
    /// lookup sees the new name: under load a claim's next request by that name was once
    /// answered "no such container" ("is a pod, not a container"), and the claimed run
    /// was lost. Bounded: a name that never resolves is an error.
    async fn await_name(&self, name: &str) -> Result<()> {
        let give_up = std::time::Instant::now() + Duration::from_secs(10);
        let mut pause = Duration::from_millis(10);
        loop {
            match self
                .docker
                .inspect_container(
                    name,
                    None::<bollard::query_parameters::InspectContainerOptions>,
                )
                .await
            {
                Ok(found)
                    if found.name.as_deref().map(|n| n.trim_start_matches('/')) == Some(name) =>
                {
                    return Ok(());
                }
                Ok(_) => {}
                Err(e) if error::status(&e) == Some(404) => {}
                Err(e) => {
                    return Err(self.locate(error::map("inspect container", e).with("run", name)));
                }
            }
            if std::time::Instant::now() + pause > give_up {
                return Err(Error::new(
                    ErrorKind::Backend,
                    "the claimed container's new name did not resolve within 10 s",
                )
                .with("run", name));
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(500));
        }
    }

    /// Names the daemon address in errors that say it could not be reached.
    fn locate(&self, e: Error) -> Error {
        if e.kind() == ErrorKind::Unavailable {
            e.with("address", &self.address)
        } else {
            e
        }
    }

    /// Makes the image present as the pull policy says, and returns the reference the
    /// container is created from: the spec's image, or, for a name the engine could take
    /// for an image ID prefix (`5`, `0a1b`), the ID of the local image that carries that
    /// name, or the name written out in full once pulled — never an image found by prefix.
    async fn ensure_image(&self, plan: &Plan<'_>) -> Result<String> {
        let (image, policy) = (plan.spec.image.as_str(), plan.spec.pull);
        let hex_name = runcell_core::could_be_id_prefix(image);
        let present = match self.docker.inspect_image(image).await {
            // An engine answers a hex name with the image whose ID begins with it when
            // no image has the name: the name counts only if the image carries it.
            Ok(found) if hex_name => {
                let tag = format!("{image}:latest");
                let named = found.repo_tags.iter().flatten().any(|t| {
                    t == &tag || t.strip_suffix(&tag).is_some_and(|host| host.ends_with('/'))
                });
                match found.id {
                    Some(id) if named => Some(id),
                    _ => None,
                }
            }
            Ok(_) => Some(image.to_string()),
            Err(e) if error::status(&e) == Some(404) => None,
            Err(e) => return Err(error::map("inspect image", e).with("image", image)),
        };
        let pulled_as = if hex_name {
            runcell_core::qualified_name(image)
        } else {
            image.to_string()
        };
        let pull = match policy {
            PullPolicy::Always => true,
            PullPolicy::IfNotPresent => present.is_none(),
            PullPolicy::Never => false,
        };
        if !pull {
            return if let Some(present) = present {
                Ok(present)
            } else {
                Err(Error::new(
                    ErrorKind::NotFound,
                    format!("image {image} is not present and the pull policy is never"),
                )
                .with("image", image))
            };
        }
        let (name, tag) = split_tag(image);
        let mut options = CreateImageOptionsBuilder::default().from_image(name);
        if let Some(tag) = tag {
            options = options.tag(tag);
        }
        let options = options.build();
        let registry = credentials::registry_of(image);
        let (explicit, dir) = (self.credentials.clone(), self.docker_config_dir.clone());
        let owned_image = image.to_string();
        // A credential helper is a process: off the async threads.
        let auth = tokio::task::spawn_blocking(move || {
            credentials::for_image(&owned_image, &explicit, dir.as_deref())
        })
        .await
        .map_err(|e| {
            Error::new(ErrorKind::Backend, "docker: credential lookup panicked").with_source(e)
        })?
        .map_err(|e| e.with("image", image))?;
        let with_credentials = auth.is_some();
        plan.report(Progress::Step(format!("pulling {image}")));
        let mut pull_stream = self.docker.create_image(Some(options), None, auth);
        let pulled = loop {
            match pull_stream.next().await {
                None => break Ok(()),
                Some(Err(e)) => break Err(e),
                Some(Ok(info)) => {
                    let detail = info.progress_detail.unwrap_or_default();
                    plan.report(Progress::Pull {
                        image: image.to_string(),
                        layer: info.id.unwrap_or_default(),
                        status: info.status.unwrap_or_default(),
                        current: detail.current.and_then(|c| u64::try_from(c).ok()),
                        total: detail.total.and_then(|t| u64::try_from(t).ok()),
                    });
                }
            }
        };
        match (pulled, present) {
            (Ok(()), _) => Ok(pulled_as),
            (Err(e), Some(present)) => {
                tracing::warn!(image, "pull failed, using the local image: {e}");
                Ok(present)
            }
            (Err(e), None) if refused(&e) => Err(Error::new(
                ErrorKind::NotFound,
                format!(
                    "image {image} is not present and registry {registry} refused the pull ({}): check the registry credentials",
                    if with_credentials {
                        "credentials were sent"
                    } else {
                        "no credentials for it in the driver config or config.json"
                    }
                ),
            )
            .with("image", image)
            .with("registry", &registry)
            .with_source(e)),
            (Err(e), None) => Err(Error::new(
                ErrorKind::NotFound,
                format!("image {image} is not present and could not be pulled"),
            )
            .with("image", image)
            .with("registry", &registry)
            .with_source(e)),
        }
    }

    /// Everything after the container exists: the CA files, then the start. On error
    /// core removes the container.
    async fn set_up(&self, id: &str, plan: &Plan<'_>) -> Result<()> {
        if let Some(pem) = &plan.ca_pem {
            self.install_ca(id, plan.spec, pem).await?;
        }
        if let Err(e) = self
            .docker
            .start_container(id, None::<bollard::query_parameters::StartContainerOptions>)
            .await
        {
            let message = error::message(&e).to_string();
            return Err(
                if message.contains("unable to find user")
                    || message.contains("unable to find group")
                {
                    Error::new(
                        ErrorKind::NotFound,
                        format!("the image has no such user: {message}"),
                    )
                    .with_field("user")
                    .with("run", id)
                } else {
                    let mut err = Error::new(ErrorKind::StartFailed, "the container did not start")
                        .with("run", id);
                    for (k, v) in self.diagnose(id).await {
                        err = err.with(k, v);
                    }
                    err.with_source(e)
                },
            );
        }
        Ok(())
    }

    /// Lists containers, again when a container vanished while the engine listed it:
    /// Podman then fails the whole list ("getting container from store ...: container
    /// not known", status 500) instead of leaving it out, as Docker does. The window is
    /// a removal's (storage gone, record not yet), which lasts long on a loaded rootless
    /// engine: asked again for up to 10 s, 50 ms apart at first, then up to 500 ms.
    async fn list_containers(
        &self,
        options: bollard::query_parameters::ListContainersOptions,
    ) -> std::result::Result<Vec<bollard::models::ContainerSummary>, bollard::errors::Error> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let mut pause = Duration::from_millis(50);
        loop {
            match self.docker.list_containers(Some(options.clone())).await {
                Err(e)
                    if tokio::time::Instant::now() < deadline
                        && error::status(&e) == Some(500)
                        && error::message(&e).contains("container not known") =>
                {
                    tracing::debug!("the engine lost a container while listing: asking again");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(500));
                }
                answer => return answer,
            }
        }
    }

    /// The last lines the container wrote, for errors (empty if none or unreadable).
    async fn log_tail(&self, id: &str) -> String {
        let options = bollard::query_parameters::LogsOptionsBuilder::default()
            .stdout(true)
            .stderr(true)
            .tail("20")
            .build();
        let lines: Vec<_> = self
            .docker
            .logs(id, Some(options))
            .filter_map(|item| async move { item.ok().map(|l| l.to_string()) })
            .collect()
            .await;
        lines.concat().trim().to_string()
    }

    /// Writes the CA files into the created (not yet started) container: the injected
    /// certificates, the full bundle, and, where the image has a system bundle and a
    /// writable root, the system bundle itself plus an `update-ca-certificates` source.
    async fn install_ca(&self, id: &str, spec: &RunSpec, injected: &str) -> Result<()> {
        let mut system = None;
        for path in ca::SYSTEM_BUNDLES {
            if let Some(text) = self.read_regular_file(id, path).await? {
                system = Some((path, text));
                break;
            }
        }
        let bundle = ca::full_bundle(system.as_ref().map_or("", |(_, t)| t), injected);
        if spec.security.read_only_rootfs {
            // Only the volume at /etc/sandbox is writable; the daemon judges an upload by
            // its destination, so upload there (the system store stays as the image has it).
            let tar = files::tar_of_files(&[
                ("ca.pem", injected.as_bytes(), 0o644),
                ("ca-bundle.pem", bundle.as_bytes(), 0o644),
            ])?;
            return put_archive(&self.docker, id, ca::DIR, files::byte_stream(tar)).await;
        }
        let mut files: Vec<(&str, &[u8], u32)> = vec![
            (ca::CA_FILE, injected.as_bytes(), 0o644),
            (ca::BUNDLE_FILE, bundle.as_bytes(), 0o644),
        ];
        if let Some((path, _)) = system {
            files.push((path, bundle.as_bytes(), 0o644));
            files.push((ca::SYSTEM_EXTRA_DIR_FILE, injected.as_bytes(), 0o644));
        }
        put_archive(
            &self.docker,
            id,
            "/",
            files::byte_stream(files::tar_of_files(&files)?),
        )
        .await
    }

    /// A regular file's text from the container, `None` if absent or not a regular file.
    async fn read_regular_file(&self, id: &str, path: &str) -> Result<Option<String>> {
        let tar = match get_archive(&self.docker, id, path).await {
            Ok(t) => t,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        // Not a regular file, or not UTF-8 text: no usable bundle.
        let Ok(file) = files::file_from_tar_stream(tar, path).await else {
            return Ok(None);
        };
        Ok(String::from_utf8(file.read_all(files::FILE_LIMIT, path).await?).ok())
    }
}

#[async_trait]
impl Backend for DockerDriver {
    const NAME: &'static str = "docker";

    fn supports(&self) -> Capabilities {
        self.capabilities()
    }

    async fn create_target(&self, plan: &Plan<'_>) -> Result<()> {
        let spec = plan.spec;
        let image = self.ensure_image(plan).await?;
        plan.report(Progress::Step("creating the container".into()));
        let mut body = container_body(spec, &plan.labels);
        if self.podman {
            body::podman_binds(&mut body);
        }
        body.image = Some(image);
        if plan.pool.is_some() {
            // A pooled container gets its CA files after the claim, through the archive
            // API: a volume keeps that place writable under a read-only root.
            if let Some(mounts) = body.host_config.as_mut().and_then(|h| h.mounts.as_mut())
                && !mounts.iter().any(|m| m.target.as_deref() == Some(ca::DIR))
            {
                mounts.push(bollard::models::Mount {
                    typ: Some(bollard::models::MountType::VOLUME),
                    target: Some(ca::DIR.to_string()),
                    ..Default::default()
                });
            }
        }
        let options = CreateContainerOptionsBuilder::default()
            .name(&plan.id)
            .build();
        let docker = self.docker.clone();
        let image = spec.image.clone();
        plan.uncancelled(async move {
            docker
                .create_container(Some(options), body)
                .await
                .map_err(|e| error::map("create container", e).with("image", &image))
        })
        .await?;
        self.set_up(&plan.id, plan).await
    }

    async fn attach_target(&self, id: &str) -> Result<()> {
        let inspect = self
            .docker
            .inspect_container(
                id,
                None::<bollard::query_parameters::InspectContainerOptions>,
            )
            .await
            .map_err(|e| error::map("inspect container", e).with("run", id))?;
        let managed = inspect
            .config
            .and_then(|c| c.labels)
            .and_then(|l| l.get(labels::MANAGED_BY).cloned());
        if managed.as_deref() != Some(labels::MANAGED_BY_VALUE) {
            return Err(
                Error::new(ErrorKind::NotFound, "no managed run with this id").with("run", id),
            );
        }
        if inspect.state.and_then(|s| s.running) != Some(true) {
            return Err(
                Error::new(ErrorKind::RunLost, "the run's container is not running")
                    .with("run", id),
            );
        }
        Ok(())
    }

    async fn list_targets(&self, selector: &BTreeMap<String, String>) -> Result<Vec<RunInfo>> {
        let mut label_filters = vec![format!(
            "{}={}",
            labels::MANAGED_BY,
            labels::MANAGED_BY_VALUE
        )];
        label_filters.extend(selector.iter().map(|(k, v)| format!("{k}={v}")));
        let options = ListContainersOptionsBuilder::default()
            .all(true)
            .filters(&HashMap::from([("label".to_string(), label_filters)]))
            .build();
        let containers = self
            .list_containers(options)
            .await
            .map_err(|e| error::map("list containers", e))?;
        Ok(containers
            .into_iter()
            .filter_map(|c| {
                let labels: BTreeMap<String, String> = c.labels?.into_iter().collect();
                labels.get(labels::RUN_ID)?;
                // The name, not the run-id label: a pooled container is renamed as its
                // state changes (see `pool_id`), and its labels cannot change.
                let name = c.names?.first()?.trim_start_matches('/').to_string();
                Some(RunInfo {
                    id: name,
                    running: !matches!(
                        c.state.map(|s| s.to_string()).as_deref(),
                        Some("exited" | "dead")
                    ),
                    labels,
                })
            })
            .collect())
    }

    /// Removes the container; then, if it had a host workspace (as the engine recorded
    /// the bind at creation), defuses what the run left there (`hostdir`).
    async fn remove_target(&self, id: &str) -> Result<()> {
        let bind = match self
            .docker
            .inspect_container(
                id,
                None::<bollard::query_parameters::InspectContainerOptions>,
            )
            .await
        {
            Ok(inspect) => hostdir::workspace_bind(&inspect),
            Err(_) => None,
        };
        remove_container(&self.docker, id)
            .await
            .map_err(|e| self.locate(e))?;
        if let Some(dir) = bind {
            let done = tokio::task::spawn_blocking(move || (hostdir::defuse(&dir), dir)).await;
            match done {
                Ok((done, dir)) => {
                    if done.cleared + done.removed > 0 {
                        tracing::info!(run = %id, cleared = done.cleared, removed = done.removed, "the run left setuid/setgid files or device nodes in its host workspace: defused");
                    }
                    for (path, e) in done.failed.iter().take(5) {
                        tracing::warn!(run = %id, workspace = %dir.display(), "could not defuse {}: {e}", path.display());
                    }
                }
                Err(e) => tracing::warn!(run = %id, "defusing the host workspace panicked: {e}"),
            }
        }
        Ok(())
    }

    async fn exec_raw(&self, id: &str, exec: RawExec) -> Result<RawProcess> {
        exec::start(&self.docker, id, exec)
            .await
            .map_err(|e| self.locate(e))
    }

    async fn put_tar(&self, id: &str, dir: &str, tar: ByteStream) -> Result<()> {
        put_archive(&self.docker, id, dir, tar)
            .await
            .map_err(|e| self.locate(e))
    }

    async fn get_tar(&self, id: &str, path: &str) -> Result<ByteStream> {
        get_archive(&self.docker, id, path)
            .await
            .map_err(|e| self.locate(e))
    }

    /// Docker labels cannot change, so a pooled container's state is its name:
    /// `sbxw-<hex>` while warming, `sbxp-<hex>` when ready, the run id `sbx-<hex>` once
    /// claimed. A claim renames `sbxp-<hex>` to `sbx-<hex>`: the daemon resolves the old
    /// name and reserves the new one under the container's lock, so of two claims one
    /// gets "no such container" or "same name", never the container as well.
    fn pool_id(&self, run_id: &str, state: PoolState) -> String {
        let hex = run_id.strip_prefix("sbx-").unwrap_or(run_id);
        match state {
            PoolState::Warming => format!("sbxw-{hex}"),
            PoolState::Ready => format!("sbxp-{hex}"),
            _ => run_id.to_string(),
        }
    }

    async fn pool_mark_ready(&self, run_id: &str) -> Result<()> {
        let (from, to) = (
            self.pool_id(run_id, PoolState::Warming),
            self.pool_id(run_id, PoolState::Ready),
        );
        self.docker
            .rename_container(
                &from,
                bollard::query_parameters::RenameContainerOptions { name: to },
            )
            .await
            .map_err(|e| self.locate(error::map("rename container", e).with("run", run_id)))
    }

    /// On Podman the rename is not trusted alone: its compatibility API resolves the
    /// name, then renames by id, and under load in CI two claims once got one target
    /// (racing renames by hand always had one winner; the cause is not pinned down). So
    /// the target's own filesystem arbitrates first: creating `/etc/sandbox/.claimed` with
    /// `O_EXCL` (the shell's noclobber) succeeds for one claim only, whatever the cause.
    async fn pool_claim_target(&self, plan: &Plan<'_>) -> Result<bool> {
        let from = self.pool_id(&plan.id, PoolState::Ready);
        if self.podman && !self.mark_claimed(&from).await? {
            return Ok(false);
        }
        match self
            .docker
            .rename_container(
                &from,
                bollard::query_parameters::RenameContainerOptions {
                    name: plan.id.clone(),
                },
            )
            .await
        {
            Ok(()) if self.podman => self.await_name(&plan.id).await.map(|()| true),
            Ok(()) => Ok(true),
            // Gone, already renamed by another claim, or its new name taken.
            Err(e) if matches!(error::status(&e), Some(400 | 404 | 409)) => Ok(false),
            Err(e) => {
                Err(self.locate(error::map("claim (rename) container", e).with("run", &plan.id)))
            }
        }
    }

    async fn pool_ready_targets(&self, key: &str) -> Result<Vec<String>> {
        let filters = HashMap::from([
            (
                "label".to_string(),
                vec![
                    format!("{}={}", labels::MANAGED_BY, labels::MANAGED_BY_VALUE),
                    format!("{}={key}", labels::POOL),
                ],
            ),
            // Docker matches the name with its leading slash (and without), Podman only
            // without.
            ("name".to_string(), vec!["^/?sbxp-".to_string()]),
        ]);
        let options = ListContainersOptionsBuilder::default()
            .filters(&filters)
            .build();
        let containers = self
            .list_containers(options)
            .await
            .map_err(|e| self.locate(error::map("list containers", e)))?;
        Ok(containers
            .into_iter()
            .filter_map(|c| {
                let name = c.names?.into_iter().next()?;
                let hex = name.trim_start_matches('/').strip_prefix("sbxp-")?;
                Some(format!("sbx-{hex}"))
            })
            .collect())
    }

    async fn pool_remove(&self, run_id: &str) -> Result<()> {
        for state in [PoolState::Ready, PoolState::Warming] {
            remove_container(&self.docker, &self.pool_id(run_id, state))
                .await
                .map_err(|e| self.locate(e))?;
        }
        Ok(())
    }

    async fn diagnose(&self, id: &str) -> Vec<(&'static str, String)> {
        let mut found = Vec::new();
        if let Ok(inspect) = self
            .docker
            .inspect_container(
                id,
                None::<bollard::query_parameters::InspectContainerOptions>,
            )
            .await
        {
            let state = inspect.state.unwrap_or_default();
            if state.running != Some(true) {
                found.push(("keepalive", KEEPALIVE.join(" ")));
                found.push(("exit_code", state.exit_code.unwrap_or(-1).to_string()));
                if let Some(error) = state.error.filter(|e| !e.is_empty()) {
                    found.push(("error", error));
                }
            }
        }
        let log = self.log_tail(id).await;
        if !log.is_empty() {
            found.push(("log", log));
        }
        found
    }
}

/// Whether a failed pull was the registry refusing access (401/403 or the daemon's
/// wording for them).
fn refused(e: &bollard::errors::Error) -> bool {
    let text = match e {
        bollard::errors::Error::DockerStreamError { error } => error.as_str(),
        _ => error::message(e),
    };
    let text = text.to_ascii_lowercase();
    matches!(error::status(e), Some(401 | 403))
        || [
            "unauthorized",
            "authentication required",
            "no basic auth credentials",
            "access denied",
            "denied: ",
            "pull access denied",
        ]
        .iter()
        .any(|w| text.contains(w))
}

/// Splits `repo[:tag]` for a pull; a reference with neither tag nor digest gets `latest`
/// (the API would otherwise pull every tag). A digest stays in the name.
fn split_tag(image: &str) -> (&str, Option<&str>) {
    if image.contains('@') {
        return (image, None);
    }
    let last = image.rsplit('/').next().unwrap_or(image);
    match last.rsplit_once(':') {
        Some((_, tag)) => (&image[..image.len() - tag.len() - 1], Some(tag)),
        None => (image, Some("latest")),
    }
}

async fn remove_container(docker: &Docker, id: &str) -> Result<()> {
    let options = RemoveContainerOptionsBuilder::default()
        .force(true)
        .v(true)
        .build();
    match docker.remove_container(id, Some(options)).await {
        Ok(()) => Ok(()),
        Err(e) if error::status(&e) == Some(404) => Ok(()),
        // "removal already in progress": another stop got there first.
        Err(e) if error::status(&e) == Some(409) => Ok(()),
        Err(e) => Err(error::map("remove container", e).with("run", id)),
    }
}

async fn put_archive(docker: &Docker, id: &str, dir: &str, tar: ByteStream) -> Result<()> {
    runcell_core::files::validate_dir_path(dir)?;
    // The daemon must never replace a directory with a file or the reverse: without this
    // flag, a file named like an existing directory (`/workspace`) replaces it, content and
    // all (through a bind mount, on the host).
    let options = UploadToContainerOptionsBuilder::default()
        .path(dir)
        .no_overwrite_dir_non_dir("true")
        .build();
    // Core checks the source (a cut one fails inside an entry); the failure is kept to
    // name the entry instead of the engine's generic error.
    let cut: Arc<std::sync::Mutex<Option<String>>> = Arc::default();
    let tar = {
        let cut = cut.clone();
        tar.inspect_err(move |e| {
            cut.lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert_with(|| e.to_string());
        })
        .boxed()
    };
    let uploaded = docker
        .upload_to_container(id, Some(options), bollard::body_try_stream(tar))
        .await;
    if let Some(why) = cut.lock().unwrap_or_else(|p| p.into_inner()).take() {
        return Err(Error::new(
            ErrorKind::Backend,
            format!("the archive to upload failed: {why}"),
        )
        .with_operation("upload archive")
        .with("run", id)
        .with("dir", dir));
    }
    match uploaded {
        Ok(()) => Ok(()),
        // 400 or 500 ("Error processing tar file(exit status 1): cannot overwrite
        // directory ... with non-directory"), depending on the daemon's version.
        Err(e) if error::message(&e).contains("cannot overwrite") => Err(Error::invalid_spec(
            "path",
            format!(
                "would replace a directory with a non-directory (or the reverse) in {dir}: {}",
                error::message(&e)
            ),
        )
        .with("run", id)),
        Err(e) => Err(error::map("upload archive", e)
            .with("run", id)
            .with("dir", dir)),
    }
}

async fn get_archive(docker: &Docker, id: &str, path: &str) -> Result<ByteStream> {
    let options = DownloadFromContainerOptionsBuilder::default()
        .path(path)
        .build();
    let mut chunks = docker.download_from_container(id, Some(options));
    // The daemon's answer (404, 409, ...) comes with the first item: read it here so that
    // it is a typed error, not a broken stream.
    let first = match chunks.next().await {
        None => None,
        Some(Ok(b)) => Some(b),
        Some(Err(e)) => {
            let mapped = error::map("download archive", e)
                .with("run", id)
                .with("path", path);
            return Err(if mapped.kind() == ErrorKind::NotFound {
                mapped.with_field("path")
            } else {
                mapped
            });
        }
    };
    let rest = chunks.map_err(std::io::Error::other);
    // Core checks that the archive ends whole (`files::checked_tar_stream`).
    Ok(futures::stream::iter(first.map(Ok)).chain(rest).boxed())
}

#[cfg(test)]
mod tests {
    use super::{default_host, enforces_limits, split_tag};

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

    #[test]
    fn pulls_name_a_tag() {
        assert_eq!(split_tag("python"), ("python", Some("latest")));
        assert_eq!(split_tag("python:3.12"), ("python", Some("3.12")));
        assert_eq!(
            split_tag("reg:5000/team/img"),
            ("reg:5000/team/img", Some("latest"))
        );
        assert_eq!(
            split_tag("reg:5000/team/img:v1"),
            ("reg:5000/team/img", Some("v1"))
        );
        assert_eq!(split_tag("img@sha256:abc"), ("img@sha256:abc", None));
    }
}
