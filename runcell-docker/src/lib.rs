//! Docker driver for runcell: one long-lived container per run, entered by exec for
//! every tool call, through the Docker Engine API (bollard; never the docker CLI).
//!
//! Each container runs `sleep infinity` under docker-init (which reaps orphans); the
//! image's ENTRYPOINT and CMD never run. Stop force-removes the container with its
//! anonymous volumes, with no SIGTERM grace period. The driver is a
//! [`runcell_core::raw::Backend`]: everything shared (validation, labels, cleanup,
//! liveness, post-create, timeouts and kills) is runcell-core's.
//!
//! The driver's parts: reaching the daemon and telling what engine it is (`client.rs`),
//! the settings and the registry constructor (`config.rs`), the container's create body
//! (`body.rs`) and its start, listing, removal and diagnosis (`container.rs`), images and
//! pulls (`image.rs`, with the registry credentials of `credentials.rs`), the CA files
//! (`ca.rs`), one raw exec (`exec.rs`), archives in and out (`files.rs`), pooled targets
//! (`pool.rs`), the defusing of a host workspace (`hostdir.rs`), `ssh://` daemons
//! (`ssh.rs`) and the mapping of bollard's errors (`error.rs`).
//!
//! Connect directly with [`DockerDriver::connect`], or through the registry as `docker`
//! (config keys: `host`, `timeout_secs`, `cert_path`, `registry_server` +
//! `registry_username` + `registry_password`, `docker_config`; env
//! `RUNCELL_DOCKER_HOST`, ...). A `tcp://` daemon behind TLS is reached as the docker CLI
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
mod ca;
mod client;
mod config;
mod container;
mod credentials;
mod error;
mod exec;
mod files;
mod hostdir;
mod image;
mod pool;
mod snapshot;
#[cfg(feature = "ssh")]
mod ssh;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use async_trait::async_trait;
use bollard::Docker;
use bollard::query_parameters::{CreateContainerOptionsBuilder, ListContainersOptionsBuilder};
use runcell_core::labels;
use runcell_core::raw::{Backend, Plan, PoolState, RawExec, RawProcess};
use runcell_core::{ByteStream, Capabilities, Error, ErrorKind, Progress, Result, RunInfo};

pub use body::container_body;
pub use config::DockerConfig;
pub use runcell_core::credentials::RegistryCredentials;

runcell_core::register_driver!(
    DockerDriver,
    "Docker Engine API (bollard)",
    DockerDriver::from_config
);

/// The Docker driver.
#[derive(Debug, Clone)]
pub struct DockerDriver {
    docker: Docker,
    address: String,
    credentials: Vec<RegistryCredentials>,
    docker_config_dir: Option<PathBuf>,
    /// Whether the engine enforces resource limits (see `enforces_limits` in `client.rs`).
    limits: bool,
    /// Whether the engine is Podman (its Docker-compatible API), whose rename does not
    /// arbitrate racing pool claims.
    podman: bool,
}

impl DockerDriver {
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
            .snapshots(!self.podman)
            .snapshots_with_helper(self.podman)
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
                && !mounts
                    .iter()
                    .any(|m| m.target.as_deref() == Some(runcell_core::ca::DIR))
            {
                mounts.push(bollard::models::Mount {
                    typ: Some(bollard::models::MountType::VOLUME),
                    target: Some(runcell_core::ca::DIR.to_string()),
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

    async fn snapshot_target(
        &self,
        id: &str,
        labels: &BTreeMap<String, String>,
        run: &dyn runcell_core::raw::RunFiles,
    ) -> Result<runcell_core::Snapshot> {
        let workspace = self.helper_workspace(id, run).await?;
        // In a task of its own: a caller that gives up (a dropped future) cannot stop it
        // between the commit and its removal; what it made for nobody is removed.
        let (this, id, labels) = (self.clone(), id.to_string(), labels.clone());
        let (answer, wait) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let made = this.snapshot_container(&id, &labels, workspace).await;
            if let Err(Ok(snapshot)) = answer.send(made) {
                // Tried a few times: Podman answers 500 ("image not known") to a lookup
                // while another image is being removed.
                for attempt in 1..=5 {
                    match this.remove_snapshot_image(&snapshot.id).await {
                        Ok(()) => break,
                        Err(e) if attempt == 5 => {
                            tracing::warn!(snapshot = %snapshot.id, "removing a snapshot nobody waits for: {e}");
                        }
                        Err(e) => {
                            tracing::debug!(snapshot = %snapshot.id, "removing a snapshot nobody waits for (will retry): {e}");
                            tokio::time::sleep(std::time::Duration::from_secs(attempt)).await;
                        }
                    }
                }
            }
        });
        wait.await.map_err(|_| {
            runcell_core::Error::new(
                runcell_core::ErrorKind::Backend,
                "the snapshot ended without an answer",
            )
        })?
    }

    async fn helper_in_image(&self, plan: &Plan<'_>) -> bool {
        plan.spec.from_snapshot.is_some() && self.image_carries_helper(&plan.spec.image).await
    }

    async fn list_snapshots(&self) -> Result<Vec<runcell_core::Snapshot>> {
        self.list_snapshot_images().await
    }

    async fn remove_snapshot(&self, id: &str) -> Result<()> {
        self.remove_snapshot_image(id).await
    }

    async fn push_snapshot(&self, id: &str, repository: &str) -> Result<String> {
        self.push_snapshot_image(id, repository).await
    }

    async fn pull_snapshot(&self, reference: &str) -> Result<runcell_core::Snapshot> {
        self.pull_snapshot_image(reference).await
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
        let state = inspect.state.unwrap_or_default();
        if state.running != Some(true) {
            return Err(Error::new(
                ErrorKind::RunLost,
                format!(
                    "the run's container is not running ({})",
                    container::why_stopped(&state)
                ),
            )
            .with("run", id));
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
                // state changes (see `pool_name`), and its labels cannot change.
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
        container::remove_container(&self.docker, id)
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
        match exec::start(&self.docker, id, exec).await {
            Err(e) if e.kind() == ErrorKind::RunLost => Err(self.why_lost(id, e).await),
            r => r.map_err(|e| self.locate(e)),
        }
    }

    async fn put_tar(&self, id: &str, dir: &str, tar: ByteStream) -> Result<()> {
        files::put_archive(&self.docker, id, dir, tar)
            .await
            .map_err(|e| self.locate(e))
    }

    async fn get_tar(&self, id: &str, path: &str) -> Result<ByteStream> {
        files::get_archive(&self.docker, id, path)
            .await
            .map_err(|e| self.locate(e))
    }

    fn pool_id(&self, run_id: &str, state: PoolState) -> String {
        self.pool_name(run_id, state)
    }

    async fn pool_mark_ready(&self, run_id: &str) -> Result<()> {
        self.mark_pooled_ready(run_id).await
    }

    async fn pool_claim_target(&self, plan: &Plan<'_>) -> Result<bool> {
        self.claim_pooled(plan).await
    }

    async fn pool_ready_targets(&self, key: &str) -> Result<Vec<String>> {
        self.pooled_ready(key).await
    }

    async fn pool_remove(&self, run_id: &str) -> Result<()> {
        self.remove_pooled(run_id).await
    }

    async fn diagnose(&self, id: &str) -> Vec<(&'static str, String)> {
        self.diagnose_container(id).await
    }
}
