//! An example third-party driver, in a crate of its own: `audit` wraps another backend
//! (here the Docker driver's) and counts the execs each run makes, logging the program
//! name only (never arguments, which may hold secrets).
//!
//! A driver implements [`runcell_core::raw::Backend`] only: core turns it into a
//! [`runcell_core::Driver`] and runs every shared step (validation, capabilities, labels,
//! cleanup, liveness, post-create, the exec pump, timeouts and the kill) for it.
//!
//! A driver that wraps another backend implements [`Layer`] instead: every method it does
//! not write forwards to the inner backend (the defaulted ones too: set-up, stop and the
//! warm-pool hooks), so the capabilities it passes on from the inner backend keep working.
//! This one writes only what adds behaviour: the exec count, and forgetting it when a run
//! or a pooled target is removed.
//!
//! It registers itself through the registry, so an engine finds it by name:
//! `runcell_core::connect("audit", DriverConfig::from_env("audit"))`, and it passes the
//! shared suite: `RUNCELL_TEST=audit cargo test -p sandbox-driver-audit --test conformance`.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use runcell_core::raw::{Backend, Layer, RawExec, RawProcess};
use runcell_core::{Driver, DriverConfig, Result};
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
impl Layer for AuditDriver {
    const NAME: &'static str = "audit";
    type Inner = DockerDriver;

    fn inner(&self) -> &DockerDriver {
        &self.inner
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

    async fn pool_remove(&self, run_id: &str) -> Result<()> {
        self.forget(run_id, "pool remove");
        self.inner.pool_remove(run_id).await
    }
}
