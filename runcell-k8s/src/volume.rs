//! The run's workspace on a PersistentVolumeClaim ([`crate::K8sConfig::workspace_volume`]):
//! an existing claim, checked before anything is created; a claim of the run's own
//! (`<run id>-ws`), created right after the pod and owned by it unless kept, deleted with
//! the run; and, while the pod waits for it, what a claim that cannot bind says.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, PersistentVolumeClaim};
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use runcell_core::raw::Plan;
use runcell_core::{Error, ErrorKind, Progress, Result, labels};

use crate::{K8sDriver, WorkspaceVolume, error, pod};

/// How often a starting run's claim is looked at while it is not bound.
const CLAIM_POLL: Duration = Duration::from_secs(1);

/// The claim a run's workspace is on.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct WorkspaceClaim {
    pub name: String,
    /// The run's own claim ([`WorkspaceVolume::PerRun`]), else the user's.
    pub per_run: bool,
}

impl WorkspaceClaim {
    /// The config key an error about this claim names.
    pub(crate) fn field(&self) -> &'static str {
        if self.per_run {
            "workspace_storage_class"
        } else {
            "workspace_claim"
        }
    }

    /// "the workspace claim X" or "the run's workspace claim X-ws".
    fn what(&self) -> String {
        if self.per_run {
            format!("the run's workspace claim {}", self.name)
        } else {
            format!("the workspace claim {}", self.name)
        }
    }
}

impl K8sDriver {
    /// The claim run `id`'s workspace is on under this driver's config, if any.
    pub(crate) fn workspace_claim(&self, id: &str) -> Option<WorkspaceClaim> {
        match &self.config.workspace_volume {
            WorkspaceVolume::EmptyDir => None,
            WorkspaceVolume::Claim { name } => Some(WorkspaceClaim {
                name: name.clone(),
                per_run: false,
            }),
            WorkspaceVolume::PerRun { .. } => Some(WorkspaceClaim {
                name: pod::workspace_claim_name(id),
                per_run: true,
            }),
        }
    }

    /// Before anything is created: the config is valid and an existing claim exists (and
    /// is not being deleted): [`ErrorKind::NotFound`] naming `workspace_claim` otherwise.
    pub(crate) async fn check_workspace_volume(&self) -> Result<()> {
        self.config.workspace_volume.validate()?;
        let WorkspaceVolume::Claim { name } = &self.config.workspace_volume else {
            return Ok(());
        };
        let claim = self
            .claims()
            .get_opt(name)
            .await
            .map_err(|e| error::map("get the workspace claim", e).with("claim", name))?;
        let problem = match claim {
            None => "does not exist",
            Some(c) if c.metadata.deletion_timestamp.is_some() => "is being deleted",
            Some(_) => return Ok(()),
        };
        Err(Error::new(
            ErrorKind::NotFound,
            format!(
                "the workspace claim {name} {problem} in namespace {}",
                self.namespace
            ),
        )
        .with_field("workspace_claim")
        .with("claim", name))
    }

    /// Right after the pod (uid `pod_uid`): the run's own claim, owned by the pod (a kept
    /// one too, until [`K8sDriver::release_kept_claim`]). A no-op unless the config asks
    /// for one.
    pub(crate) async fn create_workspace_claim(
        &self,
        plan: &Plan<'_>,
        pod_uid: &str,
    ) -> Result<()> {
        let WorkspaceVolume::PerRun {
            storage_class,
            size,
            ..
        } = &self.config.workspace_volume
        else {
            return Ok(());
        };
        let id = plan.id.as_str();
        let claim = pod::workspace_claim(
            id,
            &self.namespace,
            &plan.labels,
            storage_class.as_deref(),
            size,
            Some((id, pod_uid)),
        );
        plan.report(Progress::Step("creating the workspace claim".into()));
        let (claims, run, name) = (self.claims(), id.to_string(), pod::workspace_claim_name(id));
        plan.uncancelled(async move {
            claims
                .create(&PostParams::default(), &claim)
                .await
                .map(|_| ())
                .map_err(|e| {
                    error::map("create workspace claim", e)
                        .with("run", run)
                        .with("claim", name)
                })
        })
        .await
    }

    /// Lets a kept claim go once its run has started: no owner any more (deleting the pod
    /// no longer deletes it) and the label [`pod::WORKSPACE_KEPT_LABEL`]. A no-op unless
    /// the config keeps per-run claims.
    pub(crate) async fn release_kept_claim(&self, id: &str) -> Result<()> {
        if !matches!(
            self.config.workspace_volume,
            WorkspaceVolume::PerRun { keep: true, .. }
        ) {
            return Ok(());
        }
        let name = pod::workspace_claim_name(id);
        let patch = serde_json::json!({
            "metadata": {
                "ownerReferences": null,
                "labels": { (pod::WORKSPACE_KEPT_LABEL): "true" },
            }
        });
        self.claims()
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(|_| ())
            .map_err(|e| {
                error::map("keep workspace claim", e)
                    .with("run", id)
                    .with("claim", name)
            })
    }

    /// Deletes run `id`'s own claim (`<id>-ws`) if there is one, it carries the run's
    /// labels and (unless `even_kept`) is not kept. One that does not exist is fine.
    pub(crate) async fn delete_workspace_claim(&self, id: &str, even_kept: bool) -> Result<()> {
        let name = pod::workspace_claim_name(id);
        let claim = self
            .claims()
            .get_opt(&name)
            .await
            .map_err(|e| error::map("get workspace claim", e).with("run", id))?;
        let Some(claim) = claim else {
            return Ok(());
        };
        let label = |key: &str| {
            claim
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(key))
                .map(String::as_str)
        };
        let ours = label(labels::MANAGED_BY) == Some(labels::MANAGED_BY_VALUE)
            && label(labels::RUN_ID) == Some(id);
        let kept = label(pod::WORKSPACE_KEPT_LABEL) == Some("true");
        if !ours || (kept && !even_kept) || claim.metadata.deletion_timestamp.is_some() {
            return Ok(());
        }
        let delete = DeleteParams {
            // This claim, not one made under its name since.
            preconditions: Some(Preconditions {
                uid: claim.metadata.uid.clone(),
                resource_version: None,
            }),
            ..DeleteParams::background()
        };
        match self.claims().delete(&name, &delete).await {
            Ok(_) => Ok(()),
            Err(e) if matches!(error::code(&e), Some(404 | 409)) => Ok(()),
            Err(e) => Err(error::map("delete workspace claim", e)
                .with("run", id)
                .with("claim", name)),
        }
    }

    /// While the pod waits: the error of a claim that will not bind by itself (gone, being
    /// deleted, lost its volume, or its StorageClass does not exist). Pends for ever once
    /// the claim is bound (the pod's own wait decides then).
    pub(crate) async fn claim_failure(&self, claim: &WorkspaceClaim) -> Error {
        let mut poll = tokio::time::interval(CLAIM_POLL);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            poll.tick().await;
            // An API that does not answer is left to the pod's wait and its deadline.
            let Ok(found) = self.claims().get_opt(&claim.name).await else {
                continue;
            };
            let problem = match &found {
                None => "does not exist",
                Some(c) if c.metadata.deletion_timestamp.is_some() => "is being deleted",
                Some(c) if claim_phase(c) == "Lost" => "lost its volume (phase Lost)",
                Some(_) => "",
            };
            let Some(found) = found.filter(|_| problem.is_empty()) else {
                let message = format!("{} {problem}", claim.what());
                // The user's claim is the config's fault; the run's own was taken away.
                return if claim.per_run {
                    Error::new(ErrorKind::StartFailed, message).with("claim", &claim.name)
                } else {
                    Error::new(ErrorKind::NotFound, message)
                        .with_field(claim.field())
                        .with("claim", &claim.name)
                };
            };
            if claim_phase(&found) == "Bound" {
                return std::future::pending().await;
            }
            let class = claim_class(&found);
            let missing_class = self.claim_events(&found).await.into_iter().find(|e| {
                e.reason.as_deref() == Some("ProvisioningFailed")
                    && e.message.as_deref().is_some_and(|m| {
                        m.contains("storageclass.storage.k8s.io") && m.contains("not found")
                    })
            });
            if let Some(event) = missing_class {
                let class = class.unwrap_or_default();
                return Error::new(
                    ErrorKind::NotFound,
                    format!(
                        "{} cannot be provisioned: its StorageClass {class} does not exist ({})",
                        claim.what(),
                        event.message.as_deref().unwrap_or("").trim()
                    ),
                )
                .with_field(claim.field())
                .with("claim", &claim.name)
                .with("storage_class", class);
            }
        }
    }

    /// For a pod that did not run in time: what its claim says when it is not bound (its
    /// phase, StorageClass and last events), `None` when it is bound.
    pub(crate) async fn unbound_claim(&self, claim: &WorkspaceClaim) -> Option<String> {
        let found = match self.claims().get_opt(&claim.name).await {
            Ok(Some(found)) => found,
            Ok(None) => return Some(format!("{} does not exist", claim.what())),
            Err(e) => return Some(format!("{} could not be read: {e}", claim.what())),
        };
        let phase = claim_phase(&found);
        if phase == "Bound" {
            return None;
        }
        let class = match claim_class(&found) {
            Some(class) => format!("StorageClass {class}"),
            None => "no StorageClass".into(),
        };
        let events: Vec<String> = self
            .claim_events(&found)
            .await
            .iter()
            .rev()
            .take(3)
            .map(|e| {
                format!(
                    "{}: {}",
                    e.reason.as_deref().unwrap_or("?"),
                    e.message.as_deref().unwrap_or("").trim()
                )
            })
            .collect();
        Some(format!(
            "{} ({class}) is not bound (phase {phase}){}",
            claim.what(),
            if events.is_empty() {
                String::new()
            } else {
                format!("; claim events: {}", events.join(" | "))
            }
        ))
    }

    /// The events of this claim (this object, not an earlier one of its name), oldest
    /// first; none when they cannot be read.
    async fn claim_events(&self, claim: &PersistentVolumeClaim) -> Vec<Event> {
        let name = claim.metadata.name.as_deref().unwrap_or("");
        let params = ListParams::default().fields(&format!(
            "involvedObject.kind=PersistentVolumeClaim,involvedObject.name={name}"
        ));
        let events: Api<Event> = Api::namespaced(self.client.clone(), &self.namespace);
        let Ok(list) = events.list(&params).await else {
            return Vec::new();
        };
        list.items
            .into_iter()
            .filter(|e| e.involved_object.uid == claim.metadata.uid)
            .collect()
    }
}

fn claim_phase(claim: &PersistentVolumeClaim) -> &str {
    claim
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("Pending")
}

fn claim_class(claim: &PersistentVolumeClaim) -> Option<&str> {
    claim
        .spec
        .as_ref()
        .and_then(|s| s.storage_class_name.as_deref())
        .filter(|c| !c.is_empty())
}
