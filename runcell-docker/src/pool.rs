//! Pooled targets: a pooled container's state is its name, a claim a rename, which on
//! Podman the target's own filesystem arbitrates first.

use std::collections::HashMap;
use std::time::Duration;

use bollard::query_parameters::ListContainersOptionsBuilder;
use futures::StreamExt;
use runcell_core::labels;
use runcell_core::raw::{Backend, Plan, PoolState, RawExec};
use runcell_core::{Error, ErrorKind, Result, ca};

use crate::{DockerDriver, container, error};

/// The file whose exclusive creation claims a pooled target on Podman, in the CA
/// directory ([`ca::DIR`]), which a pooled target keeps writable whatever its user and
/// root filesystem.
const CLAIM_MARK: &str = ".claimed";

impl DockerDriver {
    /// `Backend::pool_id`: the container's name in each pool state.
    ///
    /// Docker labels cannot change, so a pooled container's state is its name:
    /// `sbxw-<hex>` while warming, `sbxp-<hex>` when ready, the run id `sbx-<hex>` once
    /// claimed. A claim renames `sbxp-<hex>` to `sbx-<hex>`: the daemon resolves the old
    /// name and reserves the new one under the container's lock, so of two claims one
    /// gets "no such container" or "same name", never the container as well.
    pub(crate) fn pool_name(&self, run_id: &str, state: PoolState) -> String {
        let hex = run_id.strip_prefix("sbx-").unwrap_or(run_id);
        match state {
            PoolState::Warming => format!("sbxw-{hex}"),
            PoolState::Ready => format!("sbxp-{hex}"),
            _ => run_id.to_string(),
        }
    }

    /// `Backend::pool_mark_ready`: renames the warming container to its ready name.
    pub(crate) async fn mark_pooled_ready(&self, run_id: &str) -> Result<()> {
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

    /// `Backend::pool_claim_target`: renames the ready container to the run id.
    ///
    /// On Podman the rename is not trusted alone: its compatibility API resolves the
    /// name, then renames by id, and under load in CI two claims once got one target
    /// (racing renames by hand always had one winner; the cause is not pinned down). So
    /// the target's own filesystem arbitrates first: creating `/etc/sandbox/.claimed` with
    /// `O_EXCL` (the shell's noclobber) succeeds for one claim only, whatever the cause.
    pub(crate) async fn claim_pooled(&self, plan: &Plan<'_>) -> Result<bool> {
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

    /// `Backend::pool_ready_targets`: the run ids of the pool's ready containers.
    pub(crate) async fn pooled_ready(&self, key: &str) -> Result<Vec<String>> {
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

    /// `Backend::pool_remove`: removes the pooled container by its ready or warming name.
    pub(crate) async fn remove_pooled(&self, run_id: &str) -> Result<()> {
        for state in [PoolState::Ready, PoolState::Warming] {
            container::remove_container(&self.docker, &self.pool_id(run_id, state))
                .await
                .map_err(|e| self.locate(e))?;
        }
        Ok(())
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
}
