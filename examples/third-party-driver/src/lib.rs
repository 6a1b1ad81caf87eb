//! An example third-party driver, in a crate of its own: `audit` wraps another backend
//! (here the Docker driver's) and counts the execs each run makes, logging the program
//! name only (never arguments, which may hold secrets).
//!
//! A driver implements [`Backend`] only: core turns it into a [`runcell_core::Driver`]
//! and runs every shared step (validation, capabilities, labels, cleanup, liveness,
//! post-create, the exec pump, timeouts and the kill) for it.
//!
//! A wrapper forwards every method, the defaulted ones too (set-up, stop and warm-pool
//! hooks): it forwards [`Backend::supports`], so the capabilities it declares are the inner
//! backend's, and a forgotten hook would break what they promise (the suite's pool cases
//! fail for a wrapper that declares pools without forwarding the pool hooks).
//!
//! It registers itself through the registry, so an engine finds it by name:
//! `runcell_core::connect("audit", DriverConfig::from_env("audit"))`, and it passes the
//! shared suite: `SANDBOX_TEST=audit cargo test -p sandbox-driver-audit --test conformance`.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use runcell_core::raw::{Backend, Plan, PoolState, RawExec, RawProcess};
use runcell_core::{ByteStream, Capabilities, Driver, DriverConfig, Result, RunInfo};
use runcell_docker::{DockerConfig, DockerDriver};

runcell_core::register_driver!(
    AuditDriver,
    "Docker, with per-run exec counting",
    AuditDriver::from_config
);

/// The driver: the Docker backend, audited.
#[derive(Debug, Clone)]
pub struct AuditDriver {
    inner: DockerDriver,
    execs: Arc<Mutex<BTreeMap<String, u64>>>,
}

impl AuditDriver {
    /// Wraps `inner`.
    pub fn new(inner: DockerDriver) -> AuditDriver {
        AuditDriver {
            inner,
            execs: Arc::default(),
        }
    }

    /// The registry constructor. Config key: `docker_host` (optional).
    pub async fn from_config(mut config: DriverConfig) -> Result<Arc<dyn Driver>> {
        let host = config.take("docker_host");
        config.finish()?;
        let mut docker_config = DockerConfig::default();
        if let Some(host) = host {
            docker_config = docker_config.host(host);
        }
        let docker = DockerDriver::connect(docker_config).await?;
        Ok(Arc::new(AuditDriver::new(docker)))
    }

    /// Drops the count of `id`, logging it with `what` happened.
    fn forget(&self, id: &str, what: &str) {
        let execs = self
            .execs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        tracing::info!(run = id, execs, "{what}");
    }

    /// How many execs run `id` has started (the library's own included).
    pub fn exec_count(&self, id: &str) -> u64 {
        let execs = self.execs.lock().unwrap_or_else(|p| p.into_inner());
        execs.get(id).copied().unwrap_or(0)
    }
}

#[async_trait]
impl Backend for AuditDriver {
    const NAME: &'static str = "audit";

    fn supports(&self) -> Capabilities {
        self.inner.supports()
    }

    async fn create_target(&self, plan: &Plan<'_>) -> Result<()> {
        self.inner.create_target(plan).await
    }

    async fn attach_target(&self, id: &str) -> Result<()> {
        self.inner.attach_target(id).await
    }

    async fn list_targets(&self, selector: &BTreeMap<String, String>) -> Result<Vec<RunInfo>> {
        self.inner.list_targets(selector).await
    }

    async fn remove_target(&self, id: &str) -> Result<()> {
        self.forget(id, "stop");
        self.inner.remove_target(id).await
    }

    async fn exec_raw(&self, id: &str, exec: RawExec) -> Result<RawProcess> {
        let n = {
            let mut execs = self.execs.lock().unwrap_or_else(|p| p.into_inner());
            let n = execs.entry(id.to_string()).or_default();
            *n += 1;
            *n
        };
        tracing::info!(
            run = id,
            n,
            program = exec.argv.first().map(String::as_str),
            "exec"
        );
        self.inner.exec_raw(id, exec).await
    }

    async fn put_tar(&self, id: &str, dir: &str, tar: ByteStream) -> Result<()> {
        self.inner.put_tar(id, dir, tar).await
    }

    async fn get_tar(&self, id: &str, path: &str) -> Result<ByteStream> {
        self.inner.get_tar(id, path).await
    }

    async fn prepare_target(&self, plan: &Plan<'_>) -> Result<()> {
        self.inner.prepare_target(plan).await
    }

    async fn put_executable(
        &self,
        id: &str,
        path: &str,
        contents: runcell_core::Bytes,
    ) -> Result<()> {
        self.inner.put_executable(id, path, contents).await
    }

    async fn diagnose(&self, id: &str) -> Vec<(&'static str, String)> {
        self.inner.diagnose(id).await
    }

    async fn before_stop(&self, id: &str) -> Result<()> {
        self.inner.before_stop(id).await
    }

    fn pool_id(&self, run_id: &str, state: PoolState) -> String {
        self.inner.pool_id(run_id, state)
    }

    async fn pool_mark_ready(&self, run_id: &str) -> Result<()> {
        self.inner.pool_mark_ready(run_id).await
    }

    async fn pool_ready_targets(&self, key: &str) -> Result<Vec<String>> {
        self.inner.pool_ready_targets(key).await
    }

    async fn pool_claim_target(&self, plan: &Plan<'_>) -> Result<bool> {
        self.inner.pool_claim_target(plan).await
    }

    async fn pool_remove(&self, run_id: &str) -> Result<()> {
        self.forget(run_id, "pool remove");
        self.inner.pool_remove(run_id).await
    }
}
