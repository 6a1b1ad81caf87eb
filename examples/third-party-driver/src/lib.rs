//! An example third-party driver, in a crate of its own: `audit` wraps another driver
//! (here the Docker driver) and counts the execs each run makes, logging the program
//! name only (never arguments, which may hold secrets).
//!
//! It registers itself through the registry, so an engine finds it by name:
//! `runcell_core::connect("audit", DriverConfig::from_env("audit"))`, and it passes the
//! shared suite: `SANDBOX_TEST=audit cargo test -p sandbox-driver-audit --test conformance`.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;

use runcell_core::{
    ByteStream, Capabilities, Driver, DriverConfig, ExecSpec, ExecStream, Result, Run, RunInfo,
    RunSpec,
};
use runcell_docker::{DockerConfig, DockerDriver};

runcell_core::register_driver!(
    "audit",
    "Docker, with per-run exec counting",
    AuditDriver::from_config
);

/// The driver: any inner driver, audited.
#[derive(Debug)]
pub struct AuditDriver {
    inner: Arc<dyn Driver>,
}

impl AuditDriver {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Driver>) -> AuditDriver {
        AuditDriver { inner }
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
        Ok(Arc::new(AuditDriver::new(Arc::new(docker))))
    }
}

#[async_trait]
impl Driver for AuditDriver {
    fn name(&self) -> &str {
        "audit"
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn create(&self, spec: &RunSpec) -> Result<Box<dyn Run>> {
        let inner = self.inner.create(spec).await?;
        Ok(Box::new(AuditRun {
            inner,
            execs: AtomicU64::new(0),
        }))
    }

    async fn attach(&self, id: &str) -> Result<Box<dyn Run>> {
        let inner = self.inner.attach(id).await?;
        Ok(Box::new(AuditRun {
            inner,
            execs: AtomicU64::new(0),
        }))
    }

    async fn list(&self, selector: &BTreeMap<String, String>) -> Result<Vec<RunInfo>> {
        self.inner.list(selector).await
    }

    async fn remove(&self, id: &str) -> Result<()> {
        self.inner.remove(id).await
    }
}

/// A run whose execs are counted.
#[derive(Debug)]
pub struct AuditRun {
    inner: Box<dyn Run>,
    execs: AtomicU64,
}

impl AuditRun {
    /// How many execs this handle started.
    pub fn exec_count(&self) -> u64 {
        self.execs.load(Ordering::Relaxed)
    }
}

#[async_trait]
impl Run for AuditRun {
    fn id(&self) -> &str {
        self.inner.id()
    }

    async fn exec_stream(&self, spec: ExecSpec) -> Result<ExecStream> {
        let n = self.execs.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::info!(
            run = self.id(),
            n,
            program = spec.argv.first().map(String::as_str),
            "exec"
        );
        self.inner.exec_stream(spec).await
    }

    async fn put_archive(&self, dir: &str, tar: ByteStream) -> Result<()> {
        self.inner.put_archive(dir, tar).await
    }

    async fn get_archive(&self, path: &str) -> Result<ByteStream> {
        self.inner.get_archive(path).await
    }

    async fn stop(&self) -> Result<()> {
        tracing::info!(run = self.id(), execs = self.exec_count(), "stop");
        self.inner.stop().await
    }
}
