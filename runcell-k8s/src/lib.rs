//! Kubernetes driver for runcell: one pod per run whose container only runs
//! `sleep infinity`, every tool call an exec over the API's websocket (kube-rs, never
//! `kubectl`).
//!
//! ```no_run
//! use runcell_core::prelude::*;
//! use runcell_k8s::{K8sConfig, K8sDriver};
//!
//! # async fn demo() -> runcell_core::Result<()> {
//! let driver = K8sDriver::connect(K8sConfig::default().namespace("agents")).await?;
//! let run = driver.start(&RunSpec::new("python:3.12-slim")).await?;
//! let out = run.exec(ExecSpec::new(["python", "-V"]).env("PYTHONUNBUFFERED", "1")).await?;
//! println!("{}", out.stdout_str());
//! run.stop().await?;
//! # Ok(()) }
//! ```
//!
//! Connect directly with [`K8sDriver::connect`], or through the registry as `k8s`
//! (config from `RUNCELL_K8S_*`: `namespace`, `runtime_class`, `node_selector`
//! (`k=v,k=v`), `tolerations` (JSON), `pod_labels`, `pod_annotations`,
//! `image_pull_secrets` (`name,name`), `ready_timeout_secs`, `sync_workspace_on_stop`,
//! `wait_unschedulable`, `exec_v4_compatible`, and the workspace's volume: `workspace_claim` (an existing claim) or a per-run claim
//! with `workspace_size`, `workspace_storage_class`, `workspace_keep`; see
//! [`WorkspaceVolume`]; snapshots: `snapshot_registry` (`host:port/repository`) and
//! `snapshot_registry_plain_http`, see [`SnapshotRegistry`]). The cluster comes from `KUBECONFIG`, `~/.kube/config` or the
//! in-cluster service account.
//!
//! The driver is a [`runcell_core::raw::Backend`]: everything shared (validation,
//! capabilities, labels, cleanup, the liveness check, post-create, timeouts and kills) is
//! runcell-core's. What is here differs from Docker: the pod and its CA Secret
//! (`pod.rs`), readiness by watch (`readiness.rs`), the CA files assembled in the pod
//! (`ca.rs`), the exec wrapper (`exec.rs`) and tar through exec (`files.rs`).
//!
//! # The application picks the Kubernetes version
//!
//! Like every library on [`k8s_openapi`], this crate enables no Kubernetes version
//! feature of it: two libraries picking different ones would break every application
//! that links both. The application (the crate that builds the binary or the tests) must
//! enable exactly one, normally the oldest API server it supports:
//!
//! ```toml
//! [dependencies]
//! runcell-k8s = "0.1"
//! k8s-openapi = { version = "0.29", features = ["v1_36"] }
//! ```
//!
//! Without one, k8s-openapi's build script stops the build ("None of the v1_* features
//! are enabled"). To check or document this crate on its own, set
//! `K8S_OPENAPI_ENABLED_VERSION=1.36` instead. Any version k8s-openapi 0.29 supports
//! works; exec stdin EOF needs API servers 1.30+ at run time, older ones get the v4 path
//! (see [`K8sConfig::exec_v4_compatible`]).
//!
//! # Starting a run
//!
//! `create` succeeds only when the pod runs AND answers an exec (core's liveness check).
//! Otherwise it fails at once with a typed error, and removes the pod, its CA Secret and
//! its own workspace claim (unless kept):
//! an image that cannot be used is [`ErrorKind::NotFound`] (pull problems) or
//! [`ErrorKind::InvalidSpec`] (an invalid reference) naming the field `image` and the
//! container's waiting reason; a keep-alive that exits at once (no `sleep` in the image, a
//! `sleep` without `infinity`) or a pod that does not answer `sh -c :` is
//! [`ErrorKind::StartFailed`] with the exit code and log tail (context `exit_code`,
//! `log`); a working directory that cannot be entered is [`ErrorKind::NotFound`] naming
//! the field `working_dir`. A workspace claim that cannot bind fails it too, naming the
//! claim: an existing claim that is missing is [`ErrorKind::NotFound`] naming
//! `workspace_claim` before anything is created; a StorageClass that does not exist is
//! [`ErrorKind::NotFound`] naming `workspace_storage_class` as soon as the claim's events
//! say so; a claim still unbound at the ready timeout is [`ErrorKind::Timeout`] with the
//! claim's phase and events.
//!
//! # The workspace on a PersistentVolumeClaim
//!
//! [`K8sConfig::workspace_volume`] puts the workspace on an existing claim
//! ([`WorkspaceVolume::Claim`]: what a run writes stays for the next) or on a claim made
//! for the run ([`WorkspaceVolume::PerRun`]: `<run id>-ws`, labelled like the run,
//! created right after the pod with an `ownerReference` to it, so that deleting the pod
//! (stop, remove, reap, or a creator that died) has the garbage collector delete it;
//! stop also deletes it itself). With `keep`, once the run has started, it loses its
//! owner, gets the label [`WORKSPACE_KEPT_LABEL`], and stays after the run until you
//! delete it.
#![forbid(unsafe_code)]

mod ca;
mod client;
mod config;
mod error;
mod exec;
mod files;
mod pod;
mod readiness;
mod snapshot;
mod volume;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod, Secret};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use kube::{Api, Client};
use runcell_core::labels;
use runcell_core::raw::{Backend, Plan, RawExec, RawProcess};
use runcell_core::{
    ByteStream, Bytes, Capabilities, Error, ErrorKind, ExecSpec, Progress, Result, RunInfo,
};

pub use config::{DEFAULT_WORKSPACE_SIZE, K8sConfig, SnapshotRegistry, WorkspaceVolume};
pub use exec::{WRAPPER, header, sh_quote};
pub use pod::{
    CONTAINER, KEEPALIVE, PodTemplate, WORKSPACE_KEPT_LABEL, ca_secret_name, run_objects,
    workspace_claim_name,
};

runcell_core::register_driver!(
    K8sDriver,
    "Kubernetes API (kube-rs, websocket exec)",
    K8sDriver::from_config
);

/// The Kubernetes driver.
#[derive(Clone)]
pub struct K8sDriver {
    client: Client,
    namespace: String,
    config: K8sConfig,
    cluster_url: String,
    /// Stdin is framed in the exec header, never closed (v4 servers, or forced).
    framed_stdin: bool,
    /// What the driver keeps of each run it created or attached, shared by its clones.
    runs: Arc<Mutex<HashMap<String, Arc<RunState>>>>,
    /// The snapshot registry's client ([`K8sConfig::snapshot_registry`]).
    registry: Option<snapshot::Registry>,
}

impl std::fmt::Debug for K8sDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("K8sDriver")
            .field("cluster", &self.cluster_url)
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}

/// What the driver needs of a run besides its id: from the plan at create, from the pod
/// at attach (or when missing).
struct RunState {
    /// The run's env entries whose names are not shell identifiers (`-u`, `my.var`): the
    /// exec wrapper's shell drops them from what it passes on, so each exec gives them
    /// again.
    odd_env: Vec<(String, String)>,
    /// The host directory the workspace was seeded from (synced back on request).
    host_dir: Option<PathBuf>,
    /// The workspace path in the pod.
    workspace: String,
}

impl RunState {
    fn new(env: &[(String, String)], host_dir: Option<PathBuf>, workspace: String) -> RunState {
        RunState {
            odd_env: env
                .iter()
                .filter(|(name, _)| !exec::is_shell_name(name))
                .cloned()
                .collect(),
            host_dir,
            workspace,
        }
    }

    /// Read back from the pod's manifest (see [`run_objects`]).
    fn from_pod(pod: &Pod) -> RunState {
        let container = pod
            .spec
            .iter()
            .flat_map(|s| s.containers.iter())
            .find(|c| c.name == CONTAINER);
        let workspace = container
            .iter()
            .flat_map(|c| c.volume_mounts.iter().flatten())
            .find(|m| m.name == pod::WORKSPACE_VOLUME)
            .map(|m| m.mount_path.clone())
            .or_else(|| {
                // A run from a snapshot: its workspace is in its own filesystem.
                pod.metadata
                    .annotations
                    .as_ref()?
                    .get(snapshot::WORKSPACE_ANNOTATION)
                    .cloned()
            })
            .unwrap_or_else(|| runcell_core::DEFAULT_WORKSPACE_PATH.into());
        let host_dir = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(pod::HOST_DIR_ANNOTATION))
            .filter(|dir| !dir.is_empty())
            .map(PathBuf::from);
        let env: Vec<(String, String)> = container
            .iter()
            .flat_map(|c| c.env.iter().flatten())
            .map(|e| (e.name.clone(), e.value.clone().unwrap_or_default()))
            .collect();
        RunState::new(&env, host_dir, workspace)
    }
}

impl K8sDriver {
    /// The namespace runs are created in.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    fn secrets(&self) -> Api<Secret> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    fn claims(&self) -> Api<PersistentVolumeClaim> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    fn remember(&self, id: &str, state: RunState) -> Arc<RunState> {
        let state = Arc::new(state);
        self.runs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.to_string(), state.clone());
        state
    }

    fn forget(&self, id: &str) {
        self.runs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
    }

    /// Run `id`'s pod, if it is one of ours ([`ErrorKind::NotFound`] otherwise).
    async fn managed_pod(&self, id: &str) -> Result<Pod> {
        self.pods()
            .get_opt(id)
            .await
            .map_err(|e| error::map("get pod", e).with("run", id))?
            .filter(|p| {
                p.metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(labels::MANAGED_BY))
                    .map(String::as_str)
                    == Some(labels::MANAGED_BY_VALUE)
            })
            .ok_or_else(|| {
                Error::new(ErrorKind::NotFound, "no managed run with this id").with("run", id)
            })
    }

    /// The run's state: kept since create or attach, else read from its pod
    /// ([`ErrorKind::RunLost`] when it is gone). Errors do not name the run: core adds it
    /// to those of `exec_raw`.
    async fn run_state(&self, id: &str) -> Result<Arc<RunState>> {
        if let Some(state) = self.runs.lock().unwrap_or_else(|p| p.into_inner()).get(id) {
            return Ok(state.clone());
        }
        let pod = self
            .pods()
            .get_opt(id)
            .await
            .map_err(|e| error::map("get pod", e))?;
        let Some(pod) = pod else {
            return Err(Error::new(ErrorKind::RunLost, "the run's pod is gone"));
        };
        let state = RunState::from_pod(&pod);
        Ok(if pod.metadata.deletion_timestamp.is_none() {
            self.remember(id, state)
        } else {
            Arc::new(state)
        })
    }
}

#[async_trait]
impl Backend for K8sDriver {
    const NAME: &'static str = "k8s";

    fn supports(&self) -> Capabilities {
        Capabilities::none()
            .workspace_seed(true)
            .memory_limit(true)
            .disk_limit(true)
            .cpu_limit(true)
            .read_only_rootfs(true)
            .cap_drop(true)
            .no_new_privileges(true)
            .ttl(true)
            .files(true)
            .stdin_streaming(!self.framed_stdin)
            .attach(true)
            .system_trust_store(true)
            .pool(true)
            .pool_relabel(true)
            .snapshots_with_helper(self.registry.is_some())
    }

    fn snapshot_base(&self) -> bool {
        self.registry.is_some()
    }

    async fn snapshot_target(
        &self,
        id: &str,
        labels: &BTreeMap<String, String>,
        run: &dyn runcell_core::raw::RunFiles,
    ) -> Result<runcell_core::Snapshot> {
        self.snapshot_pod(id, labels, run).await
    }

    async fn list_snapshots(&self) -> Result<Vec<runcell_core::Snapshot>> {
        self.list_registry_snapshots().await
    }

    async fn remove_snapshot(&self, id: &str) -> Result<()> {
        self.remove_registry_snapshot(id).await
    }

    async fn create_target(&self, plan: &Plan<'_>) -> Result<()> {
        let (spec, id) = (plan.spec, plan.id.as_str());
        // A bad name or size, or an existing claim that is not there: before anything is
        // created.
        self.check_workspace_volume().await?;
        if let Some(snapshot) = &spec.from_snapshot {
            self.check_from_snapshot(spec)?;
            self.check_snapshot_image(snapshot, &spec.image).await?;
        }
        let (mut pod, secret) = run_objects(
            spec,
            id,
            &self.namespace,
            &plan.labels,
            plan.ca_pem.as_deref(),
            &self.config.template,
        )?;
        if plan.pool.is_some() {
            pod::add_ca_dir(&mut pod);
        }
        if spec.from_snapshot.is_some() {
            pod::workspace_in_image(&mut pod, &spec.workspace.path);
        } else if let Some(claim) = self.workspace_claim(id) {
            pod::workspace_on_claim(&mut pod, &claim.name);
        }
        self.remember(
            id,
            RunState::new(
                &plan.env,
                spec.workspace.host_dir.clone(),
                spec.workspace.path.clone(),
            ),
        );
        if let Some(secret) = &secret {
            plan.report(Progress::Step("creating the CA secret".into()));
            let (secrets, secret, run) = (self.secrets(), secret.clone(), id.to_string());
            plan.uncancelled(async move {
                secrets
                    .create(&PostParams::default(), &secret)
                    .await
                    .map_err(|e| error::map("create CA secret", e).with("run", run))
            })
            .await?;
        }
        plan.report(Progress::Step("creating the pod".into()));
        let (pods, run, image) = (self.pods(), id.to_string(), spec.image.clone());
        let created = plan
            .uncancelled(async move {
                pods.create(&PostParams::default(), &pod)
                    .await
                    .map_err(|e| {
                        error::map("create pod", e)
                            .with("run", run)
                            .with("image", image)
                    })
            })
            .await?;
        let uid = created.metadata.uid.unwrap_or_default();
        if secret.is_some() {
            // At once, so that the window in which a crash could orphan it is tiny.
            self.adopt_secret(id, &uid).await?;
        }
        // The run's own claim, after the pod (which waits Pending until it binds) and owned
        // by it: nothing can leak in between, whatever becomes of this create.
        self.create_workspace_claim(plan, &uid).await?;
        self.wait_ready(plan).await?;
        // A kept claim is let go once the pod runs (a warm pod's at its claim).
        if plan.pool.is_none() {
            self.release_kept_claim(id).await?;
        }
        Ok(())
    }

    async fn prepare_target(&self, plan: &Plan<'_>) -> Result<()> {
        if plan.ca_pem.is_some() {
            plan.report(Progress::Step("installing the CA bundle".into()));
            self.install_ca(&plan.id).await?;
        }
        if let Some(dir) = &plan.spec.workspace.host_dir {
            plan.report(Progress::Step("copying the workspace into the pod".into()));
            self.seed_workspace(&plan.id, dir, &plan.spec.workspace.path)
                .await?;
        }
        Ok(())
    }

    async fn diagnose(&self, id: &str) -> Vec<(&'static str, String)> {
        self.diagnose_pod(id).await
    }

    async fn attach_target(&self, id: &str) -> Result<()> {
        let pod = self.managed_pod(id).await?;
        if !readiness::is_ready(&pod) {
            let e = Error::new(ErrorKind::RunLost, "the run's pod is not running").with("run", id);
            return Err(match readiness::why_not_running(&pod) {
                Some(why) => e.with_detail(why),
                None => e,
            });
        }
        self.remember(id, RunState::from_pod(&pod));
        Ok(())
    }

    async fn list_targets(&self, selector: &BTreeMap<String, String>) -> Result<Vec<RunInfo>> {
        let mut terms = vec![format!(
            "{}={}",
            labels::MANAGED_BY,
            labels::MANAGED_BY_VALUE
        )];
        terms.extend(selector.iter().map(|(k, v)| format!("{k}={v}")));
        let pods = self
            .pods()
            .list(&ListParams::default().labels(&terms.join(",")))
            .await
            .map_err(|e| error::map("list pods", e))?;
        Ok(pods
            .items
            .into_iter()
            .filter_map(|p| {
                let labels = p.metadata.labels.clone()?;
                let phase = p.status.as_ref().and_then(|s| s.phase.clone());
                Some(RunInfo {
                    id: labels.get(labels::RUN_ID)?.clone(),
                    running: !matches!(phase.as_deref(), Some("Failed" | "Succeeded")),
                    labels,
                })
            })
            .collect())
    }

    async fn remove_target(&self, id: &str) -> Result<()> {
        self.forget(id);
        let now = DeleteParams {
            grace_period_seconds: Some(0),
            ..DeleteParams::background()
        };
        // Whether the run's workspace is a claim of its own: the deleted pod says; when it
        // was gone already (a create cancelled early), this driver's config (a claim left
        // by another config goes by garbage collection; a Role without claims is enough
        // for runs without them).
        let per_run = matches!(self.config.workspace_volume, WorkspaceVolume::PerRun { .. });
        let own_claim = match self.pods().delete(id, &now).await {
            Ok(deleted) => deleted.left().map_or(per_run, |pod| {
                pod::workspace_claim_of(&pod) == Some(workspace_claim_name(id).as_str())
            }),
            Err(e) if error::code(&e) == Some(404) => per_run,
            Err(e) => return Err(error::map("delete pod", e).with("run", id)),
        };
        let secret = match self.secrets().delete(&ca_secret_name(id), &now).await {
            Ok(_) => Ok(()),
            Err(e) if error::code(&e) == Some(404) => Ok(()),
            Err(e) => Err(error::map("delete CA secret", e).with("run", id)),
        };
        // Deleted here too (not only by garbage collection, which may lag), unless kept.
        let claim = match own_claim {
            true => self.delete_workspace_claim(id, false).await,
            false => Ok(()),
        };
        secret.and(claim)
    }

    async fn exec_raw(&self, id: &str, exec: RawExec) -> Result<RawProcess> {
        let state = self.run_state(id).await?;
        match exec::start(&self.pods(), id, exec, self.framed_stdin, &state.odd_env).await {
            Err(e) if e.kind() == ErrorKind::RunLost => Err(self.why_lost(id, e).await),
            r => r,
        }
    }

    async fn put_tar(&self, id: &str, dir: &str, tar: ByteStream) -> Result<()> {
        self.put_tar_by_exec(id, dir, tar).await
    }

    async fn get_tar(&self, id: &str, path: &str) -> Result<ByteStream> {
        self.get_tar_by_exec(id, path).await
    }

    /// Through one exec with `cat`, so the exec helper also goes into images without
    /// `tar` (the helper then moves files itself).
    async fn put_executable(&self, id: &str, path: &str, contents: Bytes) -> Result<()> {
        const SCRIPT: &str = r#"cat > "$1.part" && chmod 755 "$1.part" && mv -f "$1.part" "$1""#;
        let spec = ExecSpec::new(["sh", "-c", SCRIPT, "sh", path])
            .stdin_bytes(contents)
            .timeout(std::time::Duration::from_secs(60));
        let out = runcell_core::exec_in(self, id, spec)
            .await?
            .collect(4096)
            .await;
        if out.status.success() {
            Ok(())
        } else {
            Err(Error::new(
                ErrorKind::Backend,
                format!(
                    "writing {path} failed ({}): {}",
                    out.status,
                    out.stderr_str().trim()
                ),
            ))
        }
    }

    async fn pool_mark_ready(&self, run_id: &str) -> Result<()> {
        let patch = serde_json::json!({
            "metadata": { "labels": { (labels::POOL_STATE): labels::POOL_READY } }
        });
        self.pods()
            .patch(run_id, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(|_| ())
            .map_err(|e| error::map("mark the pooled pod ready", e).with("run", run_id))
    }

    /// One JSON patch whose first operation tests that the pod is still ready: the API
    /// server applies it to the object it holds under its optimistic concurrency (the
    /// resourceVersion it read), so of racing claims exactly one passes the test (the
    /// others get 422), and a status update in between only makes the server apply it
    /// again. It then takes off the pool's labels the run must not carry, sets the run's
    /// and the host-directory annotation; labels and annotations it does not know (an
    /// admission webhook's, the template's) stay. One round trip.
    async fn pool_claim_target(&self, plan: &Plan<'_>) -> Result<bool> {
        let id = plan.id.as_str();
        let token = format!("{:016x}", rand::random::<u64>());
        let patch = pod::claim_patch(
            &plan.stale_labels,
            &plan.labels,
            plan.spec.workspace.host_dir.as_deref(),
            &token,
        )?;
        // A conflict the server could not resolve by applying the patch again (a busy
        // pod) is not a lost claim: try again.
        let mut last = None;
        for _ in 0..8 {
            match self
                .pods()
                .patch(
                    id,
                    &PatchParams::default(),
                    &Patch::<()>::Json(patch.clone()),
                )
                .await
            {
                Ok(_) => {
                    // Read again from the pod when next needed (host directory).
                    self.forget(id);
                    self.release_kept_claim(id).await?;
                    return Ok(true);
                }
                Err(e) if error::code(&e) == Some(404) => {
                    tracing::debug!(run = id, "claim lost: the pod is gone");
                    return Ok(false);
                }
                // The patch did not apply: lost if the pod is no longer ready (the test
                // failed) unless it carries this claim's token (an earlier attempt applied
                // and its answer was lost: the client retries 429/503/504, or this loop
                // after a 409); if it is still ready, the failure was another (try again,
                // then say so), never a reason to give the pod up.
                Err(e) if error::code(&e) == Some(422) => {
                    let pod = self
                        .pods()
                        .get_opt(id)
                        .await
                        .map_err(|e| error::map("get pod", e).with("run", id))?;
                    let meta = |pod: &Option<Pod>, annotation: bool, key: &str| {
                        let map = pod.as_ref().and_then(|p| match annotation {
                            true => p.metadata.annotations.as_ref(),
                            false => p.metadata.labels.as_ref(),
                        });
                        map.and_then(|m| m.get(key)).cloned()
                    };
                    if meta(&pod, true, pod::CLAIM_ANNOTATION).as_deref() == Some(&token) {
                        // An earlier attempt of this claim applied (its answer was lost).
                        tracing::debug!(run = id, "claim won by an earlier attempt: {e}");
                        self.forget(id);
                        return Ok(true);
                    }
                    let ready = pod
                        .as_ref()
                        .is_some_and(|p| p.metadata.deletion_timestamp.is_none())
                        && meta(&pod, false, labels::POOL_STATE).as_deref()
                            == Some(labels::POOL_READY);
                    if !ready {
                        tracing::debug!(
                            run = id,
                            state = ?meta(&pod, false, labels::POOL_STATE),
                            claim = ?meta(&pod, true, pod::CLAIM_ANNOTATION),
                            deleting = pod.as_ref().is_some_and(|p| p.metadata.deletion_timestamp.is_some()),
                            "claim lost: the pod is no longer ready: {e}"
                        );
                        return Ok(false);
                    }
                    tracing::debug!(run = id, "the claim patch failed on a ready pod: {e}");
                    last = Some(e);
                }
                Err(e) if error::code(&e) == Some(409) => {}
                Err(e) => return Err(error::map("claim the pooled pod", e).with("run", id)),
            }
        }
        let e = Error::new(
            ErrorKind::Backend,
            "claiming the pooled pod kept failing while it stayed ready",
        )
        .with("run", id);
        Err(match last {
            Some(source) => e.with_source(source),
            None => e,
        })
    }

    /// Deletes the pod only while it is warming or ready, with the resourceVersion read as
    /// a precondition, so that a claim in between wins and the run keeps its pod.
    async fn pool_remove(&self, run_id: &str) -> Result<()> {
        for _ in 0..8 {
            let Some(pod) = self
                .pods()
                .get_opt(run_id)
                .await
                .map_err(|e| error::map("get pod", e).with("run", run_id))?
            else {
                return Ok(());
            };
            let state = pod
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(labels::POOL_STATE).cloned());
            if !matches!(
                state.as_deref(),
                Some(labels::POOL_READY | labels::POOL_WARMING)
            ) {
                return Ok(());
            }
            let delete = DeleteParams {
                grace_period_seconds: Some(0),
                preconditions: Some(Preconditions {
                    resource_version: pod.metadata.resource_version.clone(),
                    uid: None,
                }),
                ..DeleteParams::background()
            };
            match self.pods().delete(run_id, &delete).await {
                Ok(_) => {
                    self.forget(run_id);
                    // A warm pod's own claim never held a run's work: it goes, kept or not.
                    if pod::workspace_claim_of(&pod) == Some(workspace_claim_name(run_id).as_str())
                    {
                        self.delete_workspace_claim(run_id, true).await?;
                    }
                    return Ok(());
                }
                Err(e) if error::code(&e) == Some(404) => return Ok(()),
                Err(e) if error::code(&e) == Some(409) => continue,
                Err(e) => return Err(error::map("delete pooled pod", e).with("run", run_id)),
            }
        }
        Err(Error::new(
            ErrorKind::Backend,
            "the pooled pod kept changing; not removed",
        )
        .with("run", run_id))
    }

    async fn before_stop(&self, id: &str) -> Result<()> {
        if self.config.sync_workspace_on_stop {
            self.sync_workspace_to_host(id).await?;
        }
        Ok(())
    }
}
