//! Core's lifecycle over the driver kit ([`crate::raw`]): every [`Backend`] is a
//! [`Driver`] through the blanket implementation here, and every run of every driver is
//! the one [`Run`] type, [`CoreRun`].
//!
//! By concern, each step once for every backend:
//! - `create`: the create sequence (guard, create, liveness, set-up, post-create) and
//!   the bring-up a warm shares with it;
//! - `claim`: warm pools: warming a target of a pool's shape and claiming one for a run
//!   (then everything run-specific);
//! - `run`: [`CoreRun`], its exec front half (validation, capabilities, helper or plain
//!   path, marker), files and stop, and [`exec_in`] for a backend's own execs;
//! - `control`: the status and kill of one exec, on either path.
//!
//! Module order (each uses only those before it): `control`, `run`, `create`, `claim`,
//! then this file.

use std::collections::BTreeMap;

use async_trait::async_trait;

use crate::capabilities::Capabilities;
use crate::error::Result;
use crate::helper::{self, ExecHelper};
use crate::progress::CreateOptions;
use crate::raw::{Backend, RunInfo};
use crate::run::{Driver, PoolProtocol, Run};
use crate::spec::RunSpec;
use crate::warm::Warm;

mod claim;
mod control;
mod create;
mod run;

pub(crate) use run::CoreRun;
pub use run::exec_in;

#[async_trait]
impl<B: Backend> Driver for B {
    fn name(&self) -> &str {
        B::NAME
    }

    /// The backend's capabilities, plus what the exec helper adds on every backend (a
    /// per-exec user, streamed stdin) unless the helper is off.
    fn capabilities(&self) -> Capabilities {
        let caps = self.supports();
        if helper::available() && ExecHelper::Auto.effective() != ExecHelper::Off {
            run::with_helper(caps)
        } else {
            caps
        }
    }

    async fn create_with(&self, spec: &RunSpec, options: CreateOptions) -> Result<Box<dyn Run>> {
        create::create(self, spec, options).await
    }

    async fn attach(&self, id: &str) -> Result<Box<dyn Run>> {
        self.attach_target(id).await?;
        Ok(Box::new(CoreRun::attached(
            self.clone(),
            id,
            ExecHelper::Auto.effective(),
        )))
    }

    async fn list(&self, selector: &BTreeMap<String, String>) -> Result<Vec<RunInfo>> {
        self.list_targets(selector).await
    }

    async fn remove(&self, id: &str) -> Result<()> {
        self.remove_target(id).await
    }

    fn pooling(&self) -> Option<&dyn PoolProtocol> {
        self.supports().pool.then_some(self as &dyn PoolProtocol)
    }
}

#[async_trait]
impl<B: Backend> PoolProtocol for B {
    async fn pool_warm(&self, shape: &RunSpec, key: &str) -> Result<Warm> {
        claim::warm(self, shape, key).await
    }

    async fn pool_ready(&self, key: &str) -> Result<Vec<String>> {
        self.pool_ready_targets(key).await
    }

    async fn pool_claim(
        &self,
        warm: Warm,
        spec: &RunSpec,
        options: CreateOptions,
    ) -> Result<Option<Box<dyn Run>>> {
        claim::claim(self, warm, spec, options).await
    }
}
