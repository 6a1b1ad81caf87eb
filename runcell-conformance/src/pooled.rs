//! The suite on pooled runs: [`PooledDriver`] wraps a driver with warm-pool support so
//! that every run a case starts comes from a pooled target (created with the spec's shape
//! only, then claimed and set up for the spec), and the whole suite shows that a pooled
//! run behaves like a cold one. The harness uses it with `RUNCELL_CONFORMANCE_POOLED=1`.

use std::collections::BTreeMap;
use std::sync::Arc;

use runcell_core::{
    CreateOptions, Driver, Pool, PoolProtocol, Result, Run, RunInfo, RunSpec, async_trait,
};

/// A driver whose every run is a pooled target claimed at once: warm, then claim.
#[derive(Debug)]
pub struct PooledDriver {
    inner: Arc<dyn Driver>,
}

impl PooledDriver {
    /// Wraps `inner`, which must have [`runcell_core::Capabilities::pool`].
    pub fn new(inner: Arc<dyn Driver>) -> anyhow::Result<PooledDriver> {
        anyhow::ensure!(
            inner.capabilities().pool,
            "driver {} has no warm pools",
            inner.name()
        );
        Ok(PooledDriver { inner })
    }
}

#[async_trait]
impl Driver for PooledDriver {
    fn name(&self) -> &str {
        self.inner.name()
    }

    /// The inner driver's, except that a pooled run's host workspace is copied in, never
    /// mounted live.
    fn capabilities(&self) -> runcell_core::Capabilities {
        let caps = self.inner.capabilities();
        if caps.workspace_mount {
            caps.workspace_mount(false).workspace_seed(true)
        } else {
            caps
        }
    }

    async fn create_with(&self, spec: &RunSpec, options: CreateOptions) -> Result<Box<dyn Run>> {
        let caps = self.inner.capabilities();
        if options.detached && !caps.pool_relabel {
            // Pools refuse these (the owner labels cannot come off): a cold run.
            return self.inner.create_with(spec, options).await;
        }
        Pool::warm_and_claim(&*self.inner, spec, options).await
    }

    async fn attach(&self, id: &str) -> Result<Box<dyn Run>> {
        self.inner.attach(id).await
    }

    async fn list(&self, selector: &BTreeMap<String, String>) -> Result<Vec<RunInfo>> {
        self.inner.list(selector).await
    }

    async fn remove(&self, id: &str) -> Result<()> {
        self.inner.remove(id).await
    }

    fn pooling(&self) -> Option<&dyn PoolProtocol> {
        self.inner.pooling()
    }

    async fn snapshots(&self) -> Result<Vec<runcell_core::Snapshot>> {
        self.inner.snapshots().await
    }

    async fn remove_snapshot(&self, id: &str) -> Result<()> {
        self.inner.remove_snapshot(id).await
    }
}
