//! Docker driver for `sandbox`: one long-lived container per run, entered by exec for
//! every tool call, through the Docker Engine API (bollard; never the docker CLI).
//!
//! Each container runs `sleep infinity` under docker-init (which reaps orphans); the
//! image's ENTRYPOINT and CMD never run. Stop force-removes the container with its
//! anonymous volumes, with no SIGTERM grace period.
//!
//! Connect directly with [`DockerDriver::connect`], or through the registry as `docker`
//! (config keys: `host`, `timeout_secs`; env `SANDBOX_DOCKER_HOST`, ...).
#![forbid(unsafe_code)]

mod body;
mod error;
mod exec;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bollard::Docker;
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, CreateImageOptionsBuilder, DownloadFromContainerOptionsBuilder,
    ListContainersOptionsBuilder, RemoveContainerOptionsBuilder, UploadToContainerOptionsBuilder,
};
use futures::{StreamExt, TryStreamExt};
use runcell_core::labels::{self, Owner};
use runcell_core::{
    ByteStream, Capabilities, CreateGuard, Driver, DriverConfig, Error, ErrorKind, ExecSpec,
    ExecStream, PullPolicy, Result, Run, RunExt, RunInfo, RunSpec, ca, files,
};

pub use body::{KEEPALIVE, container_body};

runcell_core::register_driver!(
    "docker",
    "Docker Engine API (bollard)",
    DockerDriver::from_config
);

/// How the driver reaches the daemon. Built with [`DockerConfig::default`] and its setters
/// (it will grow: TLS, credentials).
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct DockerConfig {
    /// `unix:///path`, `tcp://host:port` or `http://...`; default: `DOCKER_HOST`, else the
    /// local socket.
    pub host: Option<String>,
    /// Per-request timeout of the API client (not of exec streams). Default 60 s.
    pub timeout: Option<Duration>,
}

/// The Docker driver.
#[derive(Debug, Clone)]
pub struct DockerDriver {
    docker: Docker,
    address: String,
}

impl DockerConfig {
    /// Sets the daemon address (`unix:///path`, `tcp://host:port`).
    pub fn host(mut self, host: impl Into<String>) -> Self {
        self.host = Some(host.into());
        self
    }

    /// Sets the per-request timeout of the API client.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }
}

const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
const DEFAULT_SOCKET: &str = "unix:///var/run/docker.sock";

impl DockerDriver {
    /// Connects to the daemon and negotiates the API version (Debian's dockerd speaks 1.41).
    /// An unreachable daemon is [`ErrorKind::Unavailable`] naming the address tried.
    pub async fn connect(config: DockerConfig) -> Result<DockerDriver> {
        let (address, origin) = match (&config.host, std::env::var("DOCKER_HOST")) {
            (Some(h), _) => (h.clone(), "config"),
            (None, Ok(h)) if !h.is_empty() => (h, "DOCKER_HOST"),
            _ => (DEFAULT_SOCKET.to_string(), "default socket"),
        };
        let unavailable = |e: bollard::errors::Error| {
            Error::new(
                ErrorKind::Unavailable,
                format!("cannot reach the Docker daemon at {address} ({origin})"),
            )
            .with_source(e)
        };
        let docker = Docker::connect_with_host(&address)
            .map_err(unavailable)?
            .with_timeout(config.timeout.unwrap_or(DEFAULT_TIMEOUT));
        let docker = docker.negotiate_version().await.map_err(unavailable)?;
        Ok(DockerDriver { docker, address })
    }

    /// A driver on an existing bollard client (TLS, ssh, custom timeouts). The caller is
    /// responsible for `negotiate_version()` when the daemon is older than the client.
    pub fn from_client(docker: Docker) -> DockerDriver {
        DockerDriver {
            docker,
            address: "(caller's client)".into(),
        }
    }

    /// The registry constructor: keys `host` and `timeout_secs`.
    pub async fn from_config(mut config: DriverConfig) -> Result<Arc<dyn Driver>> {
        let host = config.take("host");
        let timeout = config
            .take_parsed::<u64>("timeout_secs")?
            .map(Duration::from_secs);
        config.finish()?;
        Ok(Arc::new(
            DockerDriver::connect(DockerConfig { host, timeout }).await?,
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

    async fn ensure_image(&self, image: &str, policy: PullPolicy) -> Result<()> {
        let present = match self.docker.inspect_image(image).await {
            Ok(_) => true,
            Err(e) if error::status(&e) == Some(404) => false,
            Err(e) => return Err(error::map("inspect image", e).with("image", image)),
        };
        let pull = match policy {
            PullPolicy::Always => true,
            PullPolicy::IfNotPresent => !present,
            PullPolicy::Never => false,
        };
        if !pull {
            return if present {
                Ok(())
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
        let pulled: std::result::Result<Vec<_>, _> = self
            .docker
            .create_image(Some(options), None, None)
            .try_collect()
            .await;
        match pulled {
            Ok(_) => Ok(()),
            Err(e) if present => {
                tracing::warn!(image, "pull failed, using the local image: {e}");
                Ok(())
            }
            Err(e) => Err(Error::new(
                ErrorKind::NotFound,
                format!("image {image} is not present and could not be pulled"),
            )
            .with("image", image)
            .with_source(e)),
        }
    }

    /// Everything after the container exists; on error the caller removes it.
    async fn set_up(&self, id: &str, spec: &RunSpec) -> Result<()> {
        if let Some(pem) = &spec.ca_bundle {
            self.install_ca(id, spec, &ca::parse_certificates(pem)?)
                .await?;
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
                    Error::new(ErrorKind::StartFailed, "the container did not start")
                        .with("run", id)
                        .with("log", self.log_tail(id).await)
                        .with_source(e)
                },
            );
        }
        let run = DockerRun::new(self.docker.clone(), id.to_string(), self.address.clone());
        self.check_alive(&run).await?;
        runcell_core::run_post_create(&run, spec).await
    }

    /// A run is handed out only when its container runs and answers an exec (with the
    /// run's own user and working directory): an image without `sleep` or `sh`, a `sleep`
    /// that exits, or limits too small to start are a [`ErrorKind::StartFailed`] here, not
    /// a dead run later.
    async fn check_alive(&self, run: &DockerRun) -> Result<()> {
        let probe = run
            .exec(ExecSpec::new(["sh", "-c", ":"]).timeout(Duration::from_secs(30)))
            .await;
        let inspect = self
            .docker
            .inspect_container(
                &run.id,
                None::<bollard::query_parameters::InspectContainerOptions>,
            )
            .await
            .map_err(|e| error::map("inspect container", e).with("run", &run.id))?;
        let state = inspect.state.unwrap_or_default();
        if state.running != Some(true) {
            return Err(Error::new(
                ErrorKind::StartFailed,
                format!(
                    "the keep-alive ({}) exited at once with code {}",
                    KEEPALIVE.join(" "),
                    state.exit_code.unwrap_or(-1)
                ),
            )
            .with("run", &run.id)
            .with("exit_code", state.exit_code.unwrap_or(-1))
            .with("error", state.error.unwrap_or_default())
            .with("log", self.log_tail(&run.id).await));
        }
        match probe {
            Ok(out) if out.status.success() => Ok(()),
            Ok(out) => Err(Error::new(
                ErrorKind::StartFailed,
                format!(
                    "the container runs but `sh -c :` {} (the library needs a POSIX sh in the image)",
                    out.status
                ),
            )
            .with("run", &run.id)
            .with("stderr", out.stderr_str().trim())),
            Err(e) => Err(e),
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
impl Driver for DockerDriver {
    fn name(&self) -> &str {
        "docker"
    }

    fn capabilities(&self) -> Capabilities {
        let mut c = Capabilities::default();
        c.workspace_mount = true;
        c.exec_user = true;
        c.user_names = true;
        c.memory_limit = true;
        c.cpu_limit = true;
        c.pids_limit = true;
        c.network_none = true;
        c.read_only_rootfs = true;
        c.cap_drop = true;
        c.no_new_privileges = true;
        c.ttl = true;
        c.files = true;
        c.stdin_streaming = true;
        c.attach = true;
        c.system_trust_store = true;
        c
    }

    #[tracing::instrument(name = "run.create", level = "debug", skip_all, fields(driver = "docker", image = %spec.image, run = tracing::field::Empty), err(level = "debug"))]
    async fn create(&self, spec: &RunSpec) -> Result<Box<dyn Run>> {
        runcell_core::prepare(spec, &self.capabilities())?;
        self.ensure_image(&spec.image, spec.pull).await?;
        let id = runcell_core::new_run_id();
        tracing::Span::current().record("run", &id);
        let labels = labels::run_labels(&id, &Owner::current(), spec.ttl, &spec.labels);
        let body = container_body(spec, &labels);
        let options = CreateContainerOptionsBuilder::default().name(&id).build();
        // If the caller drops this future from here on, the guard removes the container.
        let guard = {
            let (docker, id) = (self.docker.clone(), id.clone());
            CreateGuard::new(move || {
                let (docker, id) = (docker.clone(), id.clone());
                async move { remove_container(&docker, &id).await }
            })
        };
        if let Err(e) = self.docker.create_container(Some(options), body).await {
            guard.disarm();
            return Err(error::map("create container", e).with("image", &spec.image));
        }
        if let Err(e) = self.set_up(&id, spec).await {
            if let Err(cleanup) = self.remove(&id).await {
                tracing::error!(run = %id, "could not remove the failed run: {cleanup}");
            }
            guard.disarm();
            return Err(e);
        }
        guard.disarm();
        tracing::debug!(run = %id, image = %spec.image, "run started");
        Ok(Box::new(DockerRun::new(
            self.docker.clone(),
            id,
            self.address.clone(),
        )))
    }

    async fn attach(&self, id: &str) -> Result<Box<dyn Run>> {
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
        Ok(Box::new(DockerRun::new(
            self.docker.clone(),
            id.to_string(),
            self.address.clone(),
        )))
    }

    async fn list(&self, selector: &BTreeMap<String, String>) -> Result<Vec<RunInfo>> {
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
            .docker
            .list_containers(Some(options))
            .await
            .map_err(|e| error::map("list containers", e))?;
        Ok(containers
            .into_iter()
            .filter_map(|c| {
                let labels: BTreeMap<String, String> = c.labels?.into_iter().collect();
                Some(RunInfo {
                    id: labels.get(labels::RUN_ID)?.clone(),
                    running: !matches!(
                        c.state.map(|s| s.to_string()).as_deref(),
                        Some("exited" | "dead")
                    ),
                    labels,
                })
            })
            .collect())
    }

    async fn remove(&self, id: &str) -> Result<()> {
        remove_container(&self.docker, id).await
    }
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
    match docker
        .upload_to_container(id, Some(options), bollard::body_try_stream(tar))
        .await
    {
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
    Ok(futures::stream::iter(first.map(Ok)).chain(rest).boxed())
}

/// One run: a container entered by exec.
#[derive(Debug)]
pub struct DockerRun {
    docker: Docker,
    id: String,
    address: String,
}

impl DockerRun {
    fn new(docker: Docker, id: String, address: String) -> DockerRun {
        DockerRun {
            docker,
            id,
            address,
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
}

#[async_trait]
impl Run for DockerRun {
    fn id(&self) -> &str {
        &self.id
    }

    #[tracing::instrument(name = "run", level = "debug", skip_all, fields(run = %self.id))]
    async fn exec_stream(&self, spec: ExecSpec) -> Result<ExecStream> {
        exec::start(&self.docker, &self.id, spec)
            .await
            .map_err(|e| self.locate(e))
    }

    async fn put_archive(&self, dir: &str, tar: ByteStream) -> Result<()> {
        put_archive(&self.docker, &self.id, dir, tar)
            .await
            .map_err(|e| self.locate(e))
    }

    async fn get_archive(&self, path: &str) -> Result<ByteStream> {
        get_archive(&self.docker, &self.id, path)
            .await
            .map_err(|e| self.locate(e))
    }

    #[tracing::instrument(name = "run.stop", level = "debug", skip_all, fields(run = %self.id), err(level = "debug"))]
    async fn stop(&self) -> Result<()> {
        remove_container(&self.docker, &self.id)
            .await
            .map_err(|e| self.locate(e))?;
        tracing::debug!("run stopped");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::split_tag;

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
