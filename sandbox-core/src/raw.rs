//! The driver kit: what an engine must supply, and nothing else.
//!
//! A driver implements [`Backend`]: create the target of an already validated [`Plan`],
//! start one raw exec ([`RawExec`] in, [`RawProcess`] out), remove, list by label, check
//! a target for attach, move tar streams. Every [`Backend`] is a [`Driver`] through a
//! blanket implementation in which core runs every shared step once, for every driver:
//!
//! - create: spec validation and capability enforcement, the run id and labels (owner,
//!   TTL, managed-by), the create guard (a dropped `create` future or a signal removes what
//!   was made), removal on any error, the liveness check (the target runs and answers an
//!   exec with the run's user and working directory, else [`ErrorKind::StartFailed`] with
//!   what [`Backend::diagnose`] says), the post-create commands;
//! - exec: validation and capability enforcement of every exec option, the exec marker
//!   ([`EXEC_ID_ENV`]), the pump (bounded output, stdin feeding, timeout, cancellation on
//!   drop, transport-loss mapping), and the kill ([`KILL_SCRIPT`] through one more raw
//!   exec, never killed in turn, bounded);
//! - files: path rules; stop: idempotent removal.
//!
//! A driver therefore cannot skip a rule of the contract: it never sees an unchecked spec
//! and never hands a run out itself. See `examples/third-party-driver` for a complete one.

use std::collections::BTreeMap;
use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use futures::stream::BoxStream;
use tokio::io::AsyncWrite;
use tokio_util::task::TaskTracker;

use crate::capabilities::Capabilities;
use crate::error::{Error, ErrorKind, Result};
use crate::exec::{ExecControl, ExecStream, ExitStatus, OutputChunk};
use crate::files::{self, ByteStream};
use crate::guard::CreateGuard;
use crate::helper::{self, ExecHelper, ExecPath, Session};
use crate::labels::{self, Owner};
use crate::pool::Warm;
use crate::progress::{CreateOptions, Progress, ProgressFn};
use crate::run::{Driver, Run, RunExt, RunInfo};
use crate::spec::{ExecSpec, RunSpec, Stdin};

pub use crate::exec::{EXEC_ID_ENV, KILL_SCRIPT};

/// The target's only process: it keeps the target alive and does nothing else (the
/// image's ENTRYPOINT and CMD never run).
pub const KEEPALIVE: [&str; 2] = ["sleep", "infinity"];

/// What a backend creates: a validated, capability-checked spec with its id and labels.
#[non_exhaustive]
pub struct Plan<'a> {
    /// The run id: the container's or pod's name.
    pub id: String,
    /// Every label the target must carry (the caller's and the library's), applied at
    /// creation so that a target can never leak unlabelled.
    pub labels: BTreeMap<String, String>,
    /// The run's environment as the target must have it ([`RunSpec::run_env`]).
    pub env: Vec<(String, String)>,
    /// The CA certificates to install (normalized PEM), when the spec has a bundle.
    pub ca_pem: Option<String>,
    /// The spec, already validated and checked against the capabilities.
    pub spec: &'a RunSpec,
    /// The pool key when the target is created ahead for a warm pool ([`crate::Pool`]):
    /// the spec then holds only the pool's shape (no env, CA, host workspace or
    /// post-create; those come after the claim). Such a target must also offer a writable
    /// [`crate::ca::DIR`], so that the CA files can be written after the claim whatever
    /// the user and under a read-only root. Also set on the plan of a claim.
    pub pool: Option<String>,
    /// On the plan of a claim: the label keys the ready target carries that the run must
    /// not (say, the owner of a detached run, or the pool's TTL when the run has none). A
    /// claim that relabels ([`Capabilities::pool_relabel`]) removes these and sets
    /// `labels`, leaving labels it does not know (an admission webhook's) alone.
    pub stale_labels: Vec<String>,
    /// Where progress goes (the caller's callback, if any).
    progress: Option<ProgressFn>,
    /// The requests run through [`Plan::uncancelled`]: a cancelled create removes the
    /// target again once they settled.
    in_flight: TaskTracker,
}

impl fmt::Debug for Plan<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Plan")
            .field("id", &self.id)
            .field("labels", &self.labels)
            .field("env", &self.env.iter().map(|(k, _)| k).collect::<Vec<_>>())
            .field("ca_pem", &self.ca_pem.is_some())
            .field("spec", &self.spec)
            .field("pool", &self.pool)
            .field("stale_labels", &self.stale_labels)
            .finish_non_exhaustive()
    }
}

impl Plan<'_> {
    /// Reports a step to the caller, if it asked for progress.
    pub fn report(&self, event: Progress) {
        if let Some(f) = &self.progress {
            f(event);
        }
    }

    /// Runs `request` to its end even when the create is cancelled (its future dropped)
    /// meanwhile. Send every request that makes an object (a container, a pod, a secret)
    /// through this: an engine may still make the object after the client hung up, and
    /// a cancelled create removes the target once more after these requests settled, so
    /// that nothing it made can appear after its removal.
    pub async fn uncancelled<T, F>(&self, request: F) -> Result<T>
    where
        F: Future<Output = Result<T>> + Send + 'static,
        T: Send + 'static,
    {
        self.in_flight
            .spawn(request)
            .await
            .map_err(|e| Error::new(ErrorKind::Backend, "a create request failed").with_source(e))?
    }
}

/// One raw exec: what the backend starts in the target, as given.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RawExec {
    /// Program and arguments, never through a shell.
    pub argv: Vec<String>,
    /// Extra environment, including [`EXEC_ID_ENV`] (the exec marker).
    pub env: Vec<(String, String)>,
    /// The working directory; `None`: the run's.
    pub working_dir: Option<String>,
    /// The user; `None`: the run's (only set where the capabilities allow it).
    pub user: Option<String>,
    /// What the command reads: core feeds [`RawProcess::stdin`] with it when the backend
    /// returns a sink; a backend that cannot stream may deliver `Stdin::Bytes` itself.
    pub stdin: Stdin,
}

impl RawExec {
    /// A raw exec of `argv` with nothing else set (for a backend's own tests).
    pub fn new<I, S>(argv: I) -> RawExec
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        RawExec {
            argv: argv.into_iter().map(Into::into).collect(),
            env: Vec::new(),
            working_dir: None,
            user: None,
            stdin: Stdin::Null,
        }
    }
}

/// A started raw exec.
pub struct RawProcess {
    /// stdout and stderr chunks until the process's streams close; an `Err` item means the
    /// connection broke.
    pub output: BoxStream<'static, std::io::Result<OutputChunk>>,
    /// Where core writes stdin (then shuts it down for EOF); `None` when the backend
    /// delivered stdin itself or none was asked for.
    pub stdin: Option<Pin<Box<dyn AsyncWrite + Send>>>,
    /// Reads the exit status once `output` has ended.
    pub status: Box<dyn RawStatus>,
}

impl fmt::Debug for RawProcess {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RawProcess").finish_non_exhaustive()
    }
}

/// The exit status of a raw exec. An error, or a status that never comes, is reported
/// as [`ExitStatus::TransportLost`], never as success.
#[async_trait]
pub trait RawStatus: Send + Sync + 'static {
    /// Called once, after the output stream ended.
    async fn status(&self) -> Result<ExitStatus>;
}

/// Where a pooled target stands ([`Backend::pool_id`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PoolState {
    /// Being created and checked.
    Warming,
    /// Answering, claimable by any process.
    Ready,
    /// Owned by a run.
    Claimed,
}

/// What an engine supplies. Implement this; the [`Driver`] comes with it.
///
/// Cheap to clone (a client handle): each run keeps a clone. Method names differ from
/// [`Driver`]'s so that both traits can be in scope.
#[async_trait]
pub trait Backend: Clone + Send + Sync + fmt::Debug + 'static {
    /// The registry name (`docker`, `k8s`, ...).
    const NAME: &'static str;

    /// What this backend supports; every spec field and exec option outside it is
    /// refused as [`ErrorKind::Unsupported`] before the backend sees it.
    fn supports(&self) -> Capabilities;

    /// Creates the target of `plan` with the keep-alive as its only process, every label
    /// of the plan, and the CA files in place; returns once it runs (or fails). Core
    /// removes the target on any error after this is called, and on cancellation: send
    /// every request that makes an object through [`Plan::uncancelled`], so that an
    /// object the engine makes after the caller gave up is removed too.
    async fn create_target(&self, plan: &Plan<'_>) -> Result<()>;

    /// Checks that `id` is a managed target that runs ([`ErrorKind::NotFound`] /
    /// [`ErrorKind::RunLost`] otherwise).
    async fn attach_target(&self, id: &str) -> Result<()>;

    /// The managed targets whose labels include every pair of `selector`.
    async fn list_targets(&self, selector: &BTreeMap<String, String>) -> Result<Vec<RunInfo>>;

    /// Removes the target and everything created for it, at once; a target that does not
    /// exist is success.
    async fn remove_target(&self, id: &str) -> Result<()>;

    /// Starts one exec in target `id`. A target that is gone is [`ErrorKind::RunLost`].
    async fn exec_raw(&self, id: &str, exec: RawExec) -> Result<RawProcess>;

    /// Extracts a tar stream into the existing directory `dir` of target `id`; never
    /// replaces a directory with a non-directory or the reverse ([`ErrorKind::InvalidSpec`]
    /// naming `path`).
    async fn put_tar(&self, id: &str, dir: &str, tar: ByteStream) -> Result<()>;

    /// A tar stream of `path` in target `id` ([`ErrorKind::NotFound`] if missing).
    async fn get_tar(&self, id: &str, path: &str) -> Result<ByteStream>;

    /// Sets up what needs the running target, after core's liveness check and before the
    /// post-create commands (e.g. CA files assembled by a script, a workspace seeded by
    /// tar). Default: nothing.
    async fn prepare_target(&self, _plan: &Plan<'_>) -> Result<()> {
        Ok(())
    }

    /// Writes one executable file at `path` (its directory exists: [`crate::HELPER_DIR`])
    /// in target `id`: how core places the exec helper. Default: [`Backend::put_tar`] of a
    /// one-file archive. A backend whose `put_tar` needs tools in the image may do it with
    /// fewer (Kubernetes: `cat` through one exec).
    async fn put_executable(&self, id: &str, path: &str, contents: bytes::Bytes) -> Result<()> {
        let (dir, name) = files::split_file_path(path)?;
        let tar = files::tar_of_files(&[(name, &contents, 0o755)])?;
        self.put_tar(id, dir, files::byte_stream(tar)).await
    }

    /// What the backend knows of a target that did not stay up: exit code, log tail.
    async fn diagnose(&self, _id: &str) -> Vec<(&'static str, String)> {
        Vec::new()
    }

    /// Runs before the removal of a stop (e.g. copying a workspace back). Errors are
    /// logged; the stop goes on.
    async fn before_stop(&self, _id: &str) -> Result<()> {
        Ok(())
    }

    /// Warm pools ([`Capabilities::pool`]): the id a pooled target has in `state`, from its
    /// run id. Default: the run id in every state (the state is kept in the
    /// [`labels::POOL_STATE`] label). A backend whose labels cannot change keeps the state
    /// in the name instead (Docker).
    fn pool_id(&self, run_id: &str, state: PoolState) -> String {
        let _ = state;
        run_id.to_string()
    }

    /// Warm pools: makes the warmed target of `run_id` claimable by any process.
    async fn pool_mark_ready(&self, run_id: &str) -> Result<()> {
        let _ = run_id;
        Err(no_pool_hook("pool_mark_ready"))
    }

    /// Warm pools: the run ids of the ready targets of pool `key`. Default: the running
    /// targets labelled with the key and [`labels::POOL_READY`].
    async fn pool_ready_targets(&self, key: &str) -> Result<Vec<String>> {
        let selector = BTreeMap::from([
            (labels::POOL.to_string(), key.to_string()),
            (
                labels::POOL_STATE.to_string(),
                labels::POOL_READY.to_string(),
            ),
        ]);
        Ok(self
            .list_targets(&selector)
            .await?
            .into_iter()
            .filter(|r| r.running)
            .map(|r| r.id)
            .collect())
    }

    /// Warm pools: claims the ready target of `plan.id` atomically (against every other
    /// process): `Ok(true)` when this call won it, its id now `plan.id` and, where the
    /// backend can relabel ([`Capabilities::pool_relabel`]), its labels `plan.labels`;
    /// `Ok(false)` when it was gone or another claim won.
    async fn pool_claim_target(&self, plan: &Plan<'_>) -> Result<bool> {
        let _ = plan;
        Err(no_pool_hook("pool_claim_target"))
    }

    /// Warm pools: removes the pooled target of `run_id` unless a run claimed it (idle
    /// expiry, a dropped pool). Never removes a claimed target.
    async fn pool_remove(&self, run_id: &str) -> Result<()> {
        let _ = run_id;
        Err(no_pool_hook("pool_remove"))
    }
}

/// The error of a pool hook a backend does not implement. It names the hook: a backend
/// that declares [`Capabilities::pool`] without it (say, a wrapper that forwards
/// `supports` but not the hooks) is then found at once.
fn no_pool_hook(hook: &str) -> Error {
    Error::unsupported(
        "pool",
        format!("warm pools: this backend does not implement Backend::{hook}"),
    )
}

/// How long core's liveness check may take.
const LIVENESS_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a kill exec may take before it is abandoned (the script ends within ~1.5 s).
const KILL_EXEC_BOUND: Duration = Duration::from_secs(8);

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
            with_helper(caps)
        } else {
            caps
        }
    }

    async fn create_with(&self, spec: &RunSpec, options: CreateOptions) -> Result<Box<dyn Run>> {
        spec.validate()?;
        self.supports().check(spec)?;
        let ca_pem = spec
            .ca_bundle
            .as_deref()
            .map(crate::ca::parse_certificates)
            .transpose()?;
        let id = crate::run::new_run_id();
        let span =
            tracing::debug_span!("run.create", driver = B::NAME, run = %id, image = %spec.image);
        let plan = Plan {
            labels: labels::run_labels(
                &id,
                (!options.detached).then(Owner::current).as_ref(),
                spec.ttl,
                &spec.labels,
            ),
            progress: options.progress,
            env: spec.run_env(),
            ca_pem,
            id,
            spec,
            pool: None,
            stale_labels: Vec::new(),
            in_flight: TaskTracker::new(),
        };
        tracing::Instrument::instrument(create_run(self, plan), span).await
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

    async fn pool_warm(&self, shape: &RunSpec, key: &str) -> Result<Warm> {
        if !self.supports().pool {
            return Err(Error::unsupported(
                "pool",
                "warm pools are not supported by this driver",
            ));
        }
        shape.validate()?;
        self.supports().check(shape)?;
        let run_id = crate::run::new_run_id();
        let id = self.pool_id(&run_id, PoolState::Warming);
        let span = tracing::debug_span!("pool.warm", driver = B::NAME, run = %run_id, pool = %key);
        let mut labels =
            labels::run_labels(&run_id, Some(&Owner::current()), shape.ttl, &shape.labels);
        labels.insert(labels::POOL.into(), key.into());
        labels.insert(labels::POOL_STATE.into(), labels::POOL_WARMING.into());
        let plan = Plan {
            id: id.clone(),
            labels,
            env: Vec::new(),
            ca_pem: None,
            spec: shape,
            pool: Some(key.to_string()),
            stale_labels: Vec::new(),
            progress: None,
            in_flight: TaskTracker::new(),
        };
        let warm = async {
            // Removes the target in whichever state it got to, unless someone claimed it;
            // after the create, the returned `Warm` carries it.
            let guard = {
                let (backend, run_id) = (self.clone(), run_id.clone());
                CreateGuard::new(&plan.in_flight, move || {
                    let (backend, run_id) = (backend.clone(), run_id.clone());
                    async move { backend.pool_remove(&run_id).await }
                })
            };
            let mode = shape.exec_helper.effective();
            let run = CoreRun::new(self.clone(), &id, mode);
            let ready = async {
                bring_up(self, &plan, &run).await?;
                self.pool_mark_ready(&run_id).await
            }
            .await;
            if let Err(e) = ready {
                if let Err(cleanup) = guard.discard().await {
                    tracing::error!(run = %id, "could not remove the failed pooled target: {cleanup}");
                }
                return Err(e);
            }
            let pooled = guard;
            let session = match &*run.helper.lock().await {
                HelperState::Ready(s) => Some(s.clone()),
                _ => None,
            };
            tracing::debug!(run = %run_id, "pooled target ready");
            let keys = plan.labels.keys().cloned().collect();
            Ok(Warm::new(run_id.clone(), key, keys, session, Some(pooled)))
        };
        tracing::Instrument::instrument(warm, span).await
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
        spec.validate()?;
        self.supports().check(spec)?;
        let ca_pem = spec
            .ca_bundle
            .as_deref()
            .map(crate::ca::parse_certificates)
            .transpose()?;
        let (run_id, key) = (warm.run_id().to_string(), warm.key().to_string());
        let mut run_labels = labels::run_labels(
            &run_id,
            (!options.detached).then(Owner::current).as_ref(),
            spec.ttl,
            &spec.labels,
        );
        run_labels.insert(labels::POOL.into(), key.clone());
        run_labels.insert(labels::POOL_STATE.into(), labels::POOL_CLAIMED.into());
        let stale_labels = warm
            .label_keys()
            .iter()
            .filter(|k| !run_labels.contains_key(*k))
            .cloned()
            .collect();
        let plan = Plan {
            id: run_id.clone(),
            labels: run_labels,
            env: spec.run_env(),
            ca_pem,
            spec,
            pool: Some(key),
            stale_labels,
            progress: options.progress,
            in_flight: TaskTracker::new(),
        };
        let span = tracing::debug_span!("pool.claim", driver = B::NAME, run = %run_id);
        let claim = async {
            let won = match self.pool_claim_target(&plan).await {
                Ok(won) => won,
                Err(e) => {
                    // Unknown whether it is ours: remove it only if still unclaimed.
                    if let Err(cleanup) = warm.discard().await {
                        tracing::warn!(run = %run_id, "could not remove a pooled target: {cleanup}");
                    }
                    return Err(e);
                }
            };
            if !won {
                tracing::debug!(run = %run_id, "claim lost");
                // Removed only if nobody holds it (a claim that lost to nothing, such as a
                // conflict with a status update, must not leave it behind).
                if let Err(e) = warm.discard().await {
                    tracing::warn!(run = %run_id, "could not remove a pooled target: {e}");
                }
                return Ok(None);
            }
            // Ours now: a dropped future or a failure removes it like a failed create.
            let guard = {
                let (backend, id) = (self.clone(), run_id.clone());
                CreateGuard::new(&plan.in_flight, move || {
                    let (backend, id) = (backend.clone(), id.clone());
                    async move { backend.remove_target(&id).await }
                })
            };
            let session = warm.release();
            let run = CoreRun::claimed(self.clone(), &plan, session);
            if let Err(e) = claim_setup(self, &plan, &run).await {
                return Err(remove_failed(self, &run_id, guard, e).await);
            }
            guard.disarm();
            tracing::debug!(run = %run_id, "pooled target claimed");
            Ok(Some(Box::new(run) as Box<dyn Run>))
        };
        tracing::Instrument::instrument(claim, span).await
    }
}

/// After a claim: everything run-specific the pooled target lacks, in the order a cold
/// create applies it (CA files, workspace, working directory, post-create).
async fn claim_setup<B: Backend>(backend: &B, plan: &Plan<'_>, run: &CoreRun<B>) -> Result<()> {
    let (spec, id) = (plan.spec, plan.id.as_str());
    // First, so that a run attached from now on execs as this one does.
    if let Some(Some(overlay)) = run.overlay.get() {
        let json = serde_json::to_vec(overlay).map_err(|e| {
            Error::new(ErrorKind::Backend, "cannot encode the run's settings").with_source(e)
        })?;
        let (dir, name) = files::split_file_path(OVERLAY_FILE)?;
        let tar = files::tar_of_files(&[(name, &json, 0o600)])?;
        if let Err(e) = run.put_archive(dir, files::byte_stream(tar.clone())).await {
            tracing::debug!(run = %id, "writing the run's settings through the engine ({e})");
            backend.put_tar(id, dir, files::byte_stream(tar)).await?;
        }
    }
    if let Some(pem) = &plan.ca_pem {
        plan.report(Progress::Step("installing the CA bundle".into()));
        install_ca(backend, id, spec, pem).await?;
    }
    if let Some(dir) = &spec.workspace.host_dir {
        plan.report(Progress::Step("copying the workspace in".into()));
        backend
            .put_tar(id, &spec.workspace.path, files::tar_dir_stream(dir))
            .await
            .map_err(|e| e.with_field("workspace.host_dir"))?;
    }
    if let Some(dir) = &spec.working_dir
        && *dir != spec.workspace.path
    {
        let tar = files::tar_of_dirs(&[dir])?;
        backend.put_tar(id, "/", files::byte_stream(tar)).await?;
    }
    for (i, argv) in spec.post_create.iter().enumerate() {
        let n = spec.post_create.len();
        plan.report(Progress::Step(format!(
            "post-create {}/{n}: {}",
            i + 1,
            argv[0]
        )));
    }
    crate::run::run_post_create(run, spec).await
}

/// Writes the CA files into a running target through the backend's file transfer: the
/// injected certificates and the full bundle in [`crate::ca::DIR`] (writable on every
/// pooled target), and, where the image has a system bundle and the root is writable,
/// the system bundle and the `update-ca-certificates` source (as far as the backend's
/// user may write them; else the system store stays as the image has it).
async fn install_ca<B: Backend>(backend: &B, id: &str, spec: &RunSpec, pem: &str) -> Result<()> {
    use crate::ca;
    let mut system = None;
    for path in ca::SYSTEM_BUNDLES {
        let Ok(tar) = backend.get_tar(id, path).await else {
            continue;
        };
        let Ok(file) = files::file_from_tar_stream(tar, path).await else {
            continue;
        };
        if let Ok(bytes) = file.read_all(files::FILE_LIMIT, path).await
            && let Ok(text) = String::from_utf8(bytes)
        {
            system = Some((path, text));
            break;
        }
    }
    let bundle = ca::full_bundle(system.as_ref().map_or("", |(_, t)| t), pem);
    let own = files::tar_of_files(&[
        ("ca.pem", pem.as_bytes(), 0o644),
        ("ca-bundle.pem", bundle.as_bytes(), 0o644),
    ])?;
    backend
        .put_tar(id, ca::DIR, files::byte_stream(own))
        .await?;
    if let Some((path, _)) = system
        && !spec.security.read_only_rootfs
    {
        let store = files::tar_of_files(&[
            (path, bundle.as_bytes(), 0o644),
            (ca::SYSTEM_EXTRA_DIR_FILE, pem.as_bytes(), 0o644),
        ])?;
        if let Err(e) = backend.put_tar(id, "/", files::byte_stream(store)).await {
            tracing::debug!(run = %id, "the system trust store stays as the image has it: {e}");
        }
    }
    Ok(())
}

/// The create sequence, once for every backend.
async fn create_run<B: Backend>(backend: &B, plan: Plan<'_>) -> Result<Box<dyn Run>> {
    let id = plan.id.clone();
    // From here on, a dropped future or a signal removes whatever the backend made.
    let guard = {
        let (backend, id) = (backend.clone(), id.clone());
        CreateGuard::new(&plan.in_flight, move || {
            let (backend, id) = (backend.clone(), id.clone());
            async move { backend.remove_target(&id).await }
        })
    };
    let mode = plan.spec.exec_helper.effective();
    let run = CoreRun::new(backend.clone(), &id, mode);
    let result = async {
        bring_up(backend, &plan, &run).await?;
        backend.prepare_target(&plan).await?;
        for (i, argv) in plan.spec.post_create.iter().enumerate() {
            let n = plan.spec.post_create.len();
            plan.report(Progress::Step(format!(
                "post-create {}/{n}: {}",
                i + 1,
                argv[0]
            )));
        }
        crate::run::run_post_create(&run, plan.spec).await
    }
    .await;
    if let Err(e) = result {
        return Err(remove_failed(backend, &id, guard, e).await);
    }
    guard.disarm();
    tracing::debug!(run = %id, "run started");
    Ok(Box::new(run))
}

/// Removes a run whose create (or claim) failed with `e`, then disarms its guard;
/// returns `e`.
async fn remove_failed<B: Backend>(backend: &B, id: &str, guard: CreateGuard, e: Error) -> Error {
    if let Err(cleanup) = backend.remove_target(id).await {
        tracing::error!(run = %id, "could not remove the failed run: {cleanup}");
    }
    guard.disarm();
    e
}

/// Creates the target of `plan` and checks that it answers: through the exec helper
/// (its greeting), else a plain exec. `run`'s helper state is set from what worked.
async fn bring_up<B: Backend>(backend: &B, plan: &Plan<'_>, run: &CoreRun<B>) -> Result<()> {
    let (id, mode) = (plan.id.as_str(), run.mode);
    {
        backend.create_target(plan).await?;
        plan.report(Progress::Step("checking that the sandbox answers".into()));
        // A greeting helper proves the target runs and answers with the run's user and
        // working directory; without one, a plain exec does.
        let helper_error = match mode {
            ExecHelper::Off => None,
            // An upload into a target whose keep-alive is exiting may wait on an engine
            // that never answers (its own bound is a minute): watched like the liveness
            // check below.
            _ => match unless_gone(backend, id, helper::start(backend, id)).await {
                Ok(session) => {
                    *run.helper.lock().await = HelperState::Ready(session);
                    None
                }
                Err(e) => Some(e),
            },
        };
        if let Some(e) = helper_error {
            // The plain path from here on (the liveness check must not start a helper
            // again); its errors say best why a target is unusable.
            *run.helper.lock().await = HelperState::Plain;
            check_alive(run)
                .await
                .map_err(|alive| alive.with("exec_helper", &e))?;
            if mode == ExecHelper::Required {
                return Err(Error::new(
                    ErrorKind::StartFailed,
                    format!("the exec helper could not start: {e}"),
                )
                .with_field("exec_helper")
                .with("run", id));
            }
            helper::log_fallback(id, &e);
        } else if mode == ExecHelper::Off {
            check_alive(run).await?;
        }
        Ok(())
    }
}

/// A run is handed out only when its target runs and answers an exec with the run's own
/// user and working directory.
async fn check_alive<B: Backend>(run: &CoreRun<B>) -> Result<()> {
    let probe = run.exec(ExecSpec::new(["sh", "-c", ":"]).timeout(LIVENESS_TIMEOUT));
    // A keep-alive that exits while the probe starts may leave the probe waiting on an
    // engine that never answers: watched, it stops at once if the target is gone.
    let probe = unless_gone(&run.backend, &run.id, probe).await;
    let failed = |message: String| Error::new(ErrorKind::StartFailed, message).with("run", &run.id);
    match probe {
        Ok(out) if out.status.success() => Ok(()),
        // The exec could not start: the run's working directory or user is missing.
        Err(e) if e.kind() == ErrorKind::NotFound && e.field().is_some() => Err(e),
        Ok(out) => {
            let mut e = failed(format!(
                "the sandbox did not answer an exec (`sh -c :` {}; the library needs a POSIX sh and a keep-alive that stays up)",
                out.status
            ));
            let stderr = out.stderr_str();
            if !stderr.trim().is_empty() {
                e = e.with("stderr", stderr.trim());
            }
            for (k, v) in run.backend.diagnose(&run.id).await {
                e = e.with(k, v);
            }
            Err(e)
        }
        Err(probe_error) => {
            let mut e = failed(format!("the sandbox did not stay up: {probe_error}"));
            for (k, v) in run.backend.diagnose(&run.id).await {
                e = e.with(k, v);
            }
            Err(e)
        }
    }
}

/// `fut`, unless target `id` is found gone first (checked every second): then the
/// check's `RunLost` error. For the steps of a create that exec into a target which may be
/// exiting: such an exec can wait on an engine that never answers.
async fn unless_gone<B: Backend, T>(
    backend: &B,
    id: &str,
    fut: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    let gone = async {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            if let Err(e) = backend.attach_target(id).await
                && e.kind() == ErrorKind::RunLost
            {
                return e;
            }
        }
    };
    tokio::select! {
        done = fut => done,
        lost = gone => Err(lost),
    }
}

/// An exec in target `id` through core (marker, pump, timeout, kill), for a backend's own
/// work inside a target (tar through exec, setup scripts). Dropping the stream kills it,
/// like any exec.
///
/// It takes the plain path (one raw exec per command), never the helper: the helper's own
/// installation may go through it.
pub async fn exec_in<B: Backend>(backend: &B, id: &str, spec: ExecSpec) -> Result<ExecStream> {
    CoreRun::new(backend.clone(), id, ExecHelper::Off)
        .exec_stream(spec)
        .await
}

/// `caps` with what the exec helper does on any backend.
fn with_helper(caps: Capabilities) -> Capabilities {
    caps.exec_user(true).stdin_streaming(true)
}

/// Where a run's helper stands.
#[derive(Debug)]
enum HelperState {
    /// Not started yet (an attached run), or its stream broke: the next exec starts one.
    Untried,
    Ready(Arc<Session>),
    /// It could not start: plain execs for the rest of the run.
    Plain,
}

/// The one [`Run`] of every driver: a backend, a target id and its exec helper.
#[derive(Debug)]
pub(crate) struct CoreRun<B: Backend> {
    backend: B,
    id: String,
    mode: ExecHelper,
    helper: tokio::sync::Mutex<HelperState>,
    /// What a pooled run adds to every exec, since its target was created without it:
    /// known at create and claim, read from the target ([`OVERLAY_FILE`]) by an attached
    /// run's first exec. What is read back only shapes execs inside the target (env,
    /// working directory), never a host path.
    overlay: tokio::sync::OnceCell<Option<Overlay>>,
}

/// Where a claimed pooled target keeps its run's settings, for runs attached later.
const OVERLAY_FILE: &str = "/.runcell/run.json";

/// The run-specific settings of a claimed pooled target, applied per exec.
#[derive(serde::Serialize, serde::Deserialize)]
struct Overlay {
    /// The run's environment ([`RunSpec::run_env`]), before each exec's own.
    env: Vec<(String, String)>,
    /// The run's working directory, when it is not the target's default.
    working_dir: Option<String>,
    /// The host workspace and its path in the target, copied back at stop where cold
    /// runs mount it live. Known only to the process that claimed the run: never written
    /// to the target nor read back from it (code in the sandbox may rewrite the settings
    /// file, and must not choose where the host writes). A run attached later does not
    /// copy back.
    #[serde(skip)]
    sync_back: Option<(std::path::PathBuf, String)>,
}

impl fmt::Debug for Overlay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Overlay")
            .field("env", &self.env.iter().map(|(k, _)| k).collect::<Vec<_>>())
            .field("working_dir", &self.working_dir)
            .field("sync_back", &self.sync_back)
            .finish()
    }
}

impl<B: Backend> CoreRun<B> {
    fn new(backend: B, id: &str, mode: ExecHelper) -> CoreRun<B> {
        let state = match mode {
            ExecHelper::Off => HelperState::Plain,
            _ => HelperState::Untried,
        };
        CoreRun {
            backend,
            id: id.to_string(),
            mode,
            helper: tokio::sync::Mutex::new(state),
            overlay: tokio::sync::OnceCell::new_with(Some(None)),
        }
    }

    /// An attached run: its overlay, if any, is read from the target when first needed.
    fn attached(backend: B, id: &str, mode: ExecHelper) -> CoreRun<B> {
        CoreRun {
            overlay: tokio::sync::OnceCell::new(),
            ..CoreRun::new(backend, id, mode)
        }
    }

    /// The run's overlay (`None` for a run created cold).
    async fn overlay(&self) -> Result<Option<&Overlay>> {
        let overlay = self
            .overlay
            .get_or_try_init(|| async {
                // Through the helper first (no `tar` needed, no extra engine exec), then
                // the engine's own transfer (which reads as root where a non-root helper
                // may not).
                let tar = match self.get_archive(OVERLAY_FILE).await {
                    Ok(tar) => tar,
                    Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
                    Err(e) if e.kind() == ErrorKind::RunLost => return Err(e),
                    Err(_) => match self.backend.get_tar(&self.id, OVERLAY_FILE).await {
                        Ok(tar) => tar,
                        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
                        Err(e) => return Err(e),
                    },
                };
                // A transfer by exec (`tar` on the plain path) reports a missing file
                // only once its stream is read.
                let read = async {
                    let file = files::file_from_tar_stream(tar, OVERLAY_FILE).await?;
                    file.read_all(1 << 20, OVERLAY_FILE).await
                };
                let json = match read.await {
                    Ok(json) => json,
                    Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
                    Err(e) => return Err(e),
                };
                serde_json::from_slice(&json).map(Some).map_err(|e| {
                    Error::new(ErrorKind::Backend, "the run's settings file is unreadable")
                        .with("run", &self.id)
                        .with_source(e)
                })
            })
            .await?;
        Ok(overlay.as_ref())
    }

    /// The run of a claimed pooled target: its helper session (if the pool's process
    /// started one) and the run's settings as an overlay on every exec.
    fn claimed(backend: B, plan: &Plan<'_>, session: Option<Arc<Session>>) -> CoreRun<B> {
        let spec = plan.spec;
        let mode = spec.exec_helper.effective();
        let sync_back = spec
            .workspace
            .host_dir
            .clone()
            .filter(|_| backend.supports().workspace_mount)
            .map(|dir| (dir, spec.workspace.path.clone()));
        let mut run = CoreRun::new(backend, &plan.id, mode);
        if let (Some(session), false) = (session, mode == ExecHelper::Off) {
            run.helper = tokio::sync::Mutex::new(HelperState::Ready(session));
        }
        run.overlay = tokio::sync::OnceCell::new_with(Some(Some(Overlay {
            env: plan.env.clone(),
            working_dir: spec.working_dir.clone(),
            sync_back,
        })));
        run
    }

    /// The live helper session, starting one when there is none (first exec of an
    /// attached run, or after its stream broke); `None`: plain execs.
    async fn session(&self) -> Result<Option<Arc<Session>>> {
        let mut state = self.helper.lock().await;
        match &*state {
            HelperState::Plain => return Ok(None),
            HelperState::Ready(s) if s.dead().is_none() => return Ok(Some(s.clone())),
            HelperState::Ready(s) => {
                tracing::info!(run = %self.id, "the exec helper's stream broke ({}); starting a new one", s.dead().unwrap_or_default());
            }
            HelperState::Untried => {}
        }
        let started = match helper::start(&self.backend, &self.id).await {
            // Every step of a start fails on a target that is gone (an upload's 404, an
            // exec that cannot begin): that is the run lost, not a helper problem.
            Err(e) if e.kind() != ErrorKind::RunLost => {
                match tokio::time::timeout(TARGET_CHECK_BOUND, self.backend.attach_target(&self.id))
                    .await
                {
                    Ok(Err(gone))
                        if matches!(gone.kind(), ErrorKind::RunLost | ErrorKind::NotFound) =>
                    {
                        Err(Error::new(
                            ErrorKind::RunLost,
                            format!("the run's target is gone: {gone}"),
                        )
                        .with_source(e))
                    }
                    _ => Err(e),
                }
            }
            other => other,
        };
        match started {
            Ok(s) => {
                *state = HelperState::Ready(s.clone());
                Ok(Some(s))
            }
            Err(e) if self.mode == ExecHelper::Required || e.kind() == ErrorKind::RunLost => {
                *state = HelperState::Untried;
                Err(e.with("run", &self.id))
            }
            Err(e) => {
                helper::log_fallback(&self.id, &e);
                *state = HelperState::Plain;
                Ok(None)
            }
        }
    }

    /// The helper for `spec`, or `None` for the plain path: a per-exec user needs a
    /// helper running as root; otherwise the backend's own per-exec user, if it has one.
    fn helper_for(
        &self,
        session: Option<Arc<Session>>,
        spec: &ExecSpec,
    ) -> Result<Option<Arc<Session>>> {
        let Some(session) = session else {
            return Ok(None);
        };
        if spec.user.is_some() && session.hello.uid != 0 {
            if self.backend.supports().exec_user {
                return Ok(None);
            }
            return Err(Error::unsupported(
                "user",
                format!(
                    "a per-exec user in this run: its exec helper runs as uid {} and cannot switch users",
                    session.hello.uid
                ),
            ));
        }
        Ok(Some(session))
    }
}

#[async_trait]
impl<B: Backend> Run for CoreRun<B> {
    fn id(&self) -> &str {
        &self.id
    }

    async fn exec_stream(&self, spec: ExecSpec) -> Result<ExecStream> {
        spec.validate()?;
        // Through the helper, the exec's timeout runs from here: waiting on the helper
        // (its start, its answer) counts against it.
        let deadline = spec
            .timeout
            .and_then(|t| tokio::time::Instant::now().checked_add(t));
        let session = match self.mode {
            ExecHelper::Off => None,
            _ => self.helper_for(self.session().await?, &spec)?,
        };
        match &session {
            Some(_) => with_helper(self.backend.supports()).check_exec(&spec)?,
            None => self.backend.supports().check_exec(&spec)?,
        }
        let span = tracing::debug_span!("run", run = %self.id);
        let marker = format!("{:016x}", rand::random::<u64>());
        let overlay = self.overlay().await?;
        let mut env = overlay.map(|o| o.env.clone()).unwrap_or_default();
        env.extend(spec.env.iter().cloned());
        env.push((EXEC_ID_ENV.to_string(), marker.clone()));
        let working_dir = spec
            .working_dir
            .clone()
            .or_else(|| overlay.and_then(|o| o.working_dir.clone()));
        let raw = RawExec {
            argv: spec.argv.clone(),
            env,
            working_dir,
            user: spec.user.clone(),
            stdin: spec.stdin.clone(),
        };
        let plain_control = |status| Control {
            backend: self.backend.clone(),
            id: self.id.clone(),
            marker: marker.clone(),
            user: spec.user.clone(),
            env: spec.env.clone(),
            status,
        };
        if let Some(session) = session {
            let (hid, process) = session
                .spawn(&raw, deadline)
                .await
                .map_err(|e| e.with("run", &self.id))?;
            let mut left = spec.clone();
            left.timeout =
                deadline.map(|d| d.saturating_duration_since(tokio::time::Instant::now()));
            let control = HelperControl {
                session,
                hid,
                fallback: plain_control(process.status),
            };
            return Ok(span.in_scope(|| {
                ExecStream::spawn(&left, process.output, process.stdin, Box::new(control))
            }));
        }
        let process =
            tracing::Instrument::instrument(self.backend.exec_raw(&self.id, raw), span.clone())
                .await
                .map_err(|e| e.with("run", &self.id))?;
        let control = plain_control(process.status);
        Ok(span.in_scope(|| {
            ExecStream::spawn(&spec, process.output, process.stdin, Box::new(control))
        }))
    }

    async fn put_archive(&self, dir: &str, tar: ByteStream) -> Result<()> {
        files::validate_dir_path(dir)?;
        match self.session().await? {
            Some(session) => helper::files::put(&session, dir, tar)
                .await
                .map_err(|e| e.with("run", &self.id)),
            // The engine's extractor takes a source that stops at an entry boundary for a
            // whole (smaller) archive: checked here, for every driver, a cut source fails.
            None => {
                self.backend
                    .put_tar(&self.id, dir, files::checked_tar_stream(tar))
                    .await
            }
        }
    }

    async fn get_archive(&self, path: &str) -> Result<ByteStream> {
        files::validate_dir_path(path)?;
        match self.session().await? {
            Some(session) => helper::files::get(&session, path)
                .await
                .map_err(|e| e.with("run", &self.id)),
            // An engine's archive has no success marker of its own (a daemon that fails to
            // read a file logs it and goes on): checked here, for every driver, a stream
            // that ends before its end-of-archive or inside an entry fails, naming it.
            None => Ok(files::checked_tar_stream(
                self.backend.get_tar(&self.id, path).await?,
            )),
        }
    }

    async fn stop(&self) -> Result<()> {
        let sync_back = match self.overlay().await {
            Ok(overlay) => overlay.and_then(|o| o.sync_back.clone()),
            Err(e) => {
                tracing::warn!(run = %self.id, "reading the run's settings: {e}");
                None
            }
        };
        if let Some((dir, path)) = &sync_back {
            // A pooled run's workspace was copied in where a cold run mounts it: copy it
            // back, so that the host sees what a mount would have shown.
            let copied = async {
                let tar = self.get_archive(path).await?;
                files::unpack_into(tar, dir, 1).await
            };
            if let Err(e) = copied.await {
                tracing::warn!(run = %self.id, "copying the workspace back: {e}");
            }
        }
        if let Err(e) = self.backend.before_stop(&self.id).await
            && e.kind() != ErrorKind::RunLost
        {
            tracing::warn!(run = %self.id, "before stop: {e}");
        }
        // Close the helper's stream first: it kills what it started and exits.
        *self.helper.lock().await = HelperState::Plain;
        self.backend.remove_target(&self.id).await?;
        tracing::debug!(run = %self.id, "run stopped");
        Ok(())
    }

    fn exec_path(&self) -> ExecPath {
        match self.helper.try_lock().as_deref() {
            Ok(HelperState::Plain) => ExecPath::Plain,
            Ok(HelperState::Untried) if self.mode == ExecHelper::Off || !helper::available() => {
                ExecPath::Plain
            }
            _ => ExecPath::Helper,
        }
    }
}

/// Status and kill of one exec through the helper. When the helper is gone (its stream
/// broke, or it was killed), the kill falls back to the plain path's [`KILL_SCRIPT`] by
/// the exec marker, so a dead helper leaves no process behind.
struct HelperControl<B: Backend> {
    session: Arc<Session>,
    hid: u32,
    /// The status (from the helper) and the plain kill.
    fallback: Control<B>,
}

#[async_trait]
impl<B: Backend> ExecControl for HelperControl<B> {
    async fn status(&self) -> Result<ExitStatus> {
        let status = self.fallback.status.status().await;
        self.fallback.unless_lost(status).await
    }

    /// The helper's kill, bounded by [`helper::KILL_ANSWER_TIMEOUT`]; a helper that does
    /// not confirm it in time is retired (the next exec starts a new one). Without a
    /// helper's kill, the engine kills by the exec marker, and continues the old helper
    /// in case it was stopped (it then sees its closed stream and ends what it started).
    async fn kill(&self) -> Result<()> {
        match tokio::time::timeout(helper::KILL_ANSWER_TIMEOUT, self.session.kill(self.hid)).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => {
                tracing::debug!(run = %self.fallback.id, "the helper cannot kill ({e}); killing by the exec marker");
            }
            Err(_) => {
                tracing::warn!(run = %self.fallback.id, "the exec helper did not confirm a kill; replacing it, killing by the exec marker");
                self.session
                    .retire("the helper did not confirm a kill in time");
            }
        }
        let wake = helper::wake(
            &self.fallback.backend,
            &self.fallback.id,
            self.session.hello.pid,
        );
        tokio::join!(self.fallback.kill(), wake).0
    }
}

/// How long the check that a run's target still runs may take, after an exec that did
/// not succeed.
const TARGET_CHECK_BOUND: Duration = Duration::from_secs(10);

impl<B: Backend> Control<B> {
    /// The status, unless the target vanished or stopped under the command: engines then
    /// report an exit code of their own (137 on Docker, 126 on Kubernetes) or none, and
    /// that is never the command's status, but [`ExitStatus::RunLost`]. Checked only when
    /// the exec did not succeed, so a successful exec costs nothing more.
    async fn unless_lost(&self, status: Result<ExitStatus>) -> Result<ExitStatus> {
        if matches!(status, Ok(ExitStatus::Exited(0))) {
            return status;
        }
        // A target being removed kills its processes before the engine marks it stopped:
        // a SIGKILL (or no status) is looked at again for a moment.
        let looks = if matches!(status, Ok(ExitStatus::Signaled(9)) | Err(_)) {
            5
        } else {
            1
        };
        let give_up = tokio::time::Instant::now() + TARGET_CHECK_BOUND;
        for look in 1..=looks {
            match tokio::time::timeout_at(give_up, self.backend.attach_target(&self.id)).await {
                Ok(Err(e)) if matches!(e.kind(), ErrorKind::RunLost | ErrorKind::NotFound) => {
                    return Ok(ExitStatus::RunLost(e.to_string()));
                }
                Ok(Ok(())) if look < looks => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                other => {
                    tracing::debug!(run = %self.id, "after {status:?} the target looks {other:?}");
                    break;
                }
            }
        }
        status
    }
}

/// Status and kill of one exec.
struct Control<B: Backend> {
    backend: B,
    id: String,
    marker: String,
    /// The exec's user and env: the kill runs with them, so it may signal its processes.
    user: Option<String>,
    env: Vec<(String, String)>,
    status: Box<dyn RawStatus>,
}

#[async_trait]
impl<B: Backend> ExecControl for Control<B> {
    async fn status(&self) -> Result<ExitStatus> {
        let status = self.status.status().await;
        self.unless_lost(status).await
    }

    /// One more raw exec of [`KILL_SCRIPT`]: not an [`ExecStream`], so nothing kills it in
    /// turn, and bounded in time.
    async fn kill(&self) -> Result<()> {
        let mut env = self.env.clone();
        env.push((EXEC_ID_ENV.to_string(), format!("{}-kill", self.marker)));
        let raw = RawExec {
            argv: ["sh", "-c", KILL_SCRIPT, "runcell-kill", &self.marker]
                .map(String::from)
                .to_vec(),
            env,
            working_dir: Some("/".into()),
            user: self.user.clone(),
            stdin: Stdin::Null,
        };
        // What the kill says on stderr (which processes outlived it), kept bounded.
        let mut said = Vec::new();
        let kill = async {
            let mut process = self.backend.exec_raw(&self.id, raw).await?;
            drop(process.stdin.take());
            while let Some(chunk) = process.output.next().await {
                let chunk = chunk.map_err(|e| {
                    Error::new(ErrorKind::Backend, "the kill exec broke").with_source(e)
                })?;
                if let crate::exec::OutputChunk::Stderr(b) = chunk {
                    let room = 512usize.saturating_sub(said.len());
                    said.extend_from_slice(&b[..b.len().min(room)]);
                }
            }
            process.status.status().await
        };
        let status = tokio::time::timeout(KILL_EXEC_BOUND, kill)
            .await
            .map_err(|_| {
                Error::new(ErrorKind::Timeout, "the kill exec did not end").with("run", &self.id)
            })??;
        if status.success() {
            Ok(())
        } else {
            let said = String::from_utf8_lossy(&said);
            let said = said.trim();
            Err(Error::new(
                ErrorKind::Backend,
                if said.is_empty() {
                    format!("the kill exec {status}")
                } else {
                    format!("the kill exec {status}: {said}")
                },
            )
            .with("run", &self.id))
        }
    }
}

#[cfg(test)]
mod overlay_tests {
    use super::Overlay;

    /// The settings file lives in the sandbox: a host path in it is neither written nor
    /// believed.
    #[test]
    fn the_settings_file_never_carries_a_host_path() {
        let forged = r#"{"env":[],"working_dir":null,"sync_back":["/etc","/workspace"]}"#;
        let read: Overlay = serde_json::from_str(forged).unwrap();
        assert!(read.sync_back.is_none());
        let written = serde_json::to_string(&Overlay {
            env: vec![("A".into(), "1".into())],
            working_dir: None,
            sync_back: Some(("/home/me/project".into(), "/workspace".into())),
        })
        .unwrap();
        assert!(!written.contains("/home/me/project"), "{written}");
        assert!(!written.contains("sync_back"), "{written}");
    }
}
