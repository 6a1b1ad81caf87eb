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
use crate::error::{Error, Result};
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

/// A run id a caller gives (to attach or remove) is one the library could have made: a
/// DNS label (lowercase letters, digits and `-`, at most 63), which every engine takes
/// as a name as it is. Anything else (a `/`, a `,`, an upper-case letter) could reach an
/// engine's URL path or selector syntax as something else: refused before any backend
/// sees it, naming `run_id`.
pub(crate) fn check_run_id(id: &str) -> Result<()> {
    let ok = (1..=63).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !id.starts_with('-')
        && !id.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(Error::invalid_spec(
            "run_id",
            format!(
                "{:?} is not a run id (lowercase letters, digits and '-', at most 63)",
                id.chars().take(80).collect::<String>()
            ),
        ))
    }
}

/// A label selector's keys and values follow the label rules runs are made with
/// ([`crate::labels::validate_key`], [`crate::labels::validate_value`]): a `,` or `=` in a
/// value cannot become another term of an engine's selector. Names `selector[KEY]`.
fn check_selector(selector: &BTreeMap<String, String>) -> Result<()> {
    for (k, v) in selector {
        crate::labels::validate_key(k)
            .and_then(|()| crate::labels::validate_value(v))
            .map_err(|why| {
                Error::invalid_spec(
                    format!("selector[{}]", k.chars().take(80).collect::<String>()),
                    why,
                )
            })?;
    }
    Ok(())
}

#[async_trait]
impl<B: Backend> Driver for B {
    fn name(&self) -> &str {
        B::NAME
    }

    /// The backend's capabilities, plus what the exec helper adds on every backend (a
    /// per-exec user, streamed stdin, terminals, durable execs, snapshots where the backend
    /// needs the helper for them) unless the helper is off.
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
        check_run_id(id)?;
        self.attach_target(id).await?;
        Ok(Box::new(CoreRun::attached(
            self.clone(),
            id,
            ExecHelper::Auto.effective(),
        )))
    }

    async fn list(&self, selector: &BTreeMap<String, String>) -> Result<Vec<RunInfo>> {
        check_selector(selector)?;
        self.list_targets(selector).await
    }

    async fn remove(&self, id: &str) -> Result<()> {
        check_run_id(id)?;
        self.remove_target(id).await
    }

    fn pooling(&self) -> Option<&dyn PoolProtocol> {
        self.supports().pool.then_some(self as &dyn PoolProtocol)
    }

    async fn snapshots(&self) -> Result<Vec<crate::Snapshot>> {
        self.list_snapshots().await
    }

    async fn remove_snapshot(&self, id: &str) -> Result<()> {
        crate::snapshot::check_snapshot_id(id)?;
        Backend::remove_snapshot(self, id).await
    }

    async fn push_snapshot(&self, id: &str, repository: &str) -> Result<String> {
        crate::snapshot::check_snapshot_id(id)?;
        crate::snapshot::check_repository(repository)?;
        Backend::push_snapshot(self, id, repository).await
    }

    async fn pull_snapshot(&self, reference: &str) -> Result<crate::Snapshot> {
        crate::snapshot::check_snapshot_reference(reference)?;
        Backend::pull_snapshot(self, reference).await
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
