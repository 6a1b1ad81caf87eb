//! The driver kit: what an engine must supply, and nothing else.
//!
//! A driver implements [`Backend`]: create the target of an already validated [`Plan`],
//! start one raw exec ([`RawExec`] in, [`RawProcess`] out), remove, list by label, check
//! a target for attach, move tar streams. Every [`Backend`] is a [`crate::Driver`]
//! through a blanket implementation in which core runs every shared step once, for every
//! driver:
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
//! (core makes every [`Plan`], through one constructor that validates and checks its
//! spec) and never hands a run out itself. See `examples/third-party-driver` for a
//! complete one; a driver that wraps another backend writes only what it changes
//! ([`Layer`]). For a backend's own work inside a target (tar through exec, setup
//! scripts), [`crate::exec_in`] runs an exec through core.
//!
//! This module is the ground floor of the lifecycle: it uses nothing of runs, pools or
//! the exec helper.

use std::collections::BTreeMap;
use std::fmt;
use std::pin::Pin;

use async_trait::async_trait;
use futures::stream::BoxStream;
use tokio::io::AsyncWrite;
use tokio_util::task::TaskTracker;

use crate::capabilities::Capabilities;
use crate::error::{Error, ErrorKind, Result};
use crate::exec::{ExitStatus, OutputChunk};
use crate::files::{self, ByteStream};
use crate::labels;
use crate::progress::{Progress, ProgressFn};
use crate::spec::{RunSpec, Stdin};

pub use crate::exec::{EXEC_ID_ENV, KILL_SCRIPT};
pub use crate::helper::{HELPER_PATH, helper_binary, helper_build};

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

impl<'a> Plan<'a> {
    /// The plan of target `id` for `spec`, and the only way to one: `spec` is validated
    /// ([`RunSpec::validate`]) and checked against `caps` ([`Capabilities::check`]), and
    /// its CA bundle parsed, before anything else, so that a backend never sees an
    /// unchecked spec. The plan carries the run's env ([`RunSpec::run_env`]) and CA, no
    /// pool and no progress callback (see the `with_` methods).
    pub(crate) fn checked(
        id: String,
        labels: BTreeMap<String, String>,
        spec: &'a RunSpec,
        caps: &Capabilities,
    ) -> Result<Plan<'a>> {
        spec.validate()?;
        caps.check(spec)?;
        let ca_pem = spec
            .ca_bundle
            .as_deref()
            .map(crate::ca::parse_certificates)
            .transpose()?;
        Ok(Plan {
            id,
            labels,
            env: spec.run_env(),
            ca_pem,
            spec,
            pool: None,
            stale_labels: Vec::new(),
            progress: None,
            in_flight: TaskTracker::new(),
        })
    }

    /// The plan of a target warmed ahead for pool `key`: the spec is the pool's shape, and
    /// nothing run-specific (env, CA) is created with it.
    pub(crate) fn warming(self, key: &str) -> Plan<'a> {
        Plan {
            env: Vec::new(),
            ca_pem: None,
            pool: Some(key.to_string()),
            ..self
        }
    }

    /// The plan of a claim of a ready target of pool `key`, which carries `stale_labels`
    /// that the run must not.
    pub(crate) fn claiming(self, key: &str, stale_labels: Vec<String>) -> Plan<'a> {
        Plan {
            pool: Some(key.to_string()),
            stale_labels,
            ..self
        }
    }

    /// The plan with the caller's progress callback.
    pub(crate) fn with_progress(self, progress: Option<ProgressFn>) -> Plan<'a> {
        Plan { progress, ..self }
    }

    /// The requests of this create that run on when it is cancelled
    /// ([`Plan::uncancelled`]).
    pub(crate) fn in_flight(&self) -> &TaskTracker {
        &self.in_flight
    }

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
    /// The command's stdout says where it ends (the exec helper's protocol): a backend
    /// that marks the end of a command's output in band (Kubernetes: its stdout mark)
    /// need not, and must then not hold back any of it.
    pub self_delimited: bool,
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
            self_delimited: false,
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

/// What [`Backend::list_targets`] (and [`crate::Driver::list`]) reports of a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunInfo {
    /// The run id.
    pub id: String,
    /// Every label of the target (the library's and the caller's).
    pub labels: BTreeMap<String, String>,
    /// False once the target has exited or died (a target being created counts as running).
    pub running: bool,
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

/// A run's files as its exec helper reads them, for [`Backend::snapshot_target`]: paths
/// are resolved through held descriptors, entries renamed while they are read are each
/// whole or absent, and an archive that ends short fails.
#[async_trait]
pub trait RunFiles: Send + Sync {
    /// The archive of absolute `path` (directories with everything below them: regular
    /// files, hard links among them, directories, symbolic links, fifos), or `None` when
    /// the run has no exec helper (the plain exec path).
    async fn helper_archive(&self, path: &str) -> Result<Option<ByteStream>>;

    /// What changed in the run's root filesystem since it was created, as an OCI image
    /// layer (a tar stream; a deletion is an empty regular file named `.wh.<name>` in its
    /// directory), or `None` when the run has no exec helper (the plain exec path). What
    /// counts: every entry whose change time is past the run's base listing, taken at
    /// create for a backend whose [`Backend::snapshot_base`] says so (without one this
    /// fails); never `/proc`, `/sys`, `/dev`, the helper's directory or mount points,
    /// except `workspace` (absolute, or empty for none): a mount point there is in the
    /// layer whole (mount points below it are not). Sockets and devices are left out.
    async fn helper_layer(&self, workspace: &str) -> Result<Option<ByteStream>>;
}

/// What an engine supplies. Implement this; the [`crate::Driver`] comes with it.
///
/// Cheap to clone (a client handle): each run keeps a clone. Method names differ from
/// [`crate::Driver`]'s so that both traits can be in scope.
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

    /// Saves target `id`'s filesystem state as a snapshot with `labels` and
    /// [`crate::snapshot_labels::SNAPSHOT_WORKSPACE`] (see [`crate::Snapshot`]: what the
    /// run's code changed, never what the library put there for the run). `run` reads
    /// the run's files through its exec helper, where the engine has no faithful way.
    /// Default: unsupported.
    async fn snapshot_target(
        &self,
        id: &str,
        labels: &BTreeMap<String, String>,
        run: &dyn RunFiles,
    ) -> Result<crate::Snapshot> {
        let _ = (id, labels, run);
        Err(Error::unsupported(
            "snapshot",
            "this driver has no snapshots",
        ))
    }

    /// Every snapshot of this backend. Default: none.
    async fn list_snapshots(&self) -> Result<Vec<crate::Snapshot>> {
        Ok(Vec::new())
    }

    /// Whether the backend's snapshots need the run's base listing at create (they read
    /// the run's changes with [`RunFiles::helper_layer`]): core has the exec helper record
    /// it right after it started, before any command of the run. Default: false.
    fn snapshot_base(&self) -> bool {
        false
    }

    /// Whether the target of `plan` finds this build's exec helper at
    /// [`HELPER_PATH`] when it starts, put there by the engine from the run's image (a
    /// snapshot image that carries it: see [`helper_build`]). Core then starts it without
    /// an upload, and uploads it if that fails. Default: false.
    async fn helper_in_image(&self, plan: &Plan<'_>) -> bool {
        let _ = plan;
        false
    }

    /// Removes snapshot `id` (checked); one that does not exist is success. Default:
    /// unsupported.
    async fn remove_snapshot(&self, id: &str) -> Result<()> {
        let _ = id;
        Err(Error::unsupported(
            "snapshot",
            "this driver has no snapshots",
        ))
    }

    /// [`crate::Driver::push_snapshot`] (`id` and `repository` checked). Default:
    /// unsupported.
    async fn push_snapshot(&self, id: &str, repository: &str) -> Result<String> {
        let _ = (id, repository);
        Err(Error::unsupported(
            "push_snapshot",
            "this driver cannot push snapshots",
        ))
    }

    /// [`crate::Driver::pull_snapshot`] (`reference` checked). Default: unsupported.
    async fn pull_snapshot(&self, reference: &str) -> Result<crate::Snapshot> {
        let _ = reference;
        Err(Error::unsupported(
            "pull_snapshot",
            "this driver cannot pull snapshots",
        ))
    }

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

/// A backend that wraps another ([`Layer::Inner`]) and changes only part of what it does:
/// implement this instead of [`Backend`], and write only the methods that change.
///
/// Every method has a default that forwards to the same method of [`Layer::inner`] (the
/// defaulted hooks of [`Backend`] too: set-up, stop and the warm-pool hooks), and every
/// `Layer` is a [`Backend`] (so a [`crate::Driver`]) through a blanket implementation. A
/// wrapper thus keeps everything the inner backend declares in [`Backend::supports`]
/// working, the pool hooks included, without forwarding them by hand. A default forwards
/// to the inner backend only, never to another method of the layer: a layer that changes
/// [`Layer::put_tar`] and wants [`Layer::put_executable`] to go through it writes both.
///
/// The model is OpenDAL's `LayeredAccess`. A type implements either `Layer` or
/// [`Backend`], not both. With both traits in scope, call a method of a layer as
/// `Backend::method(&layer, ...)` (or `Layer::...`) where the name alone is ambiguous.
///
/// ```
/// use runcell_core::raw::{Backend, Layer, RawExec, RawProcess};
/// use runcell_core::{Result, async_trait};
///
/// /// Any backend, with every exec's program logged.
/// #[derive(Debug, Clone)]
/// struct Logged<B>(B);
///
/// #[async_trait]
/// impl<B: Backend> Layer for Logged<B> {
///     const NAME: &'static str = "logged";
///     type Inner = B;
///
///     fn inner(&self) -> &B {
///         &self.0
///     }
///
///     async fn exec_raw(&self, id: &str, exec: RawExec) -> Result<RawProcess> {
///         tracing::info!(run = id, program = exec.argv.first().map(String::as_str), "exec");
///         self.0.exec_raw(id, exec).await
///     }
/// }
/// ```
#[async_trait]
pub trait Layer: Clone + Send + Sync + fmt::Debug + 'static {
    /// The registry name of the wrapping driver ([`Backend::NAME`]).
    const NAME: &'static str;

    /// The backend wrapped.
    type Inner: Backend;

    /// The backend wrapped, to which every method not written forwards.
    fn inner(&self) -> &Self::Inner;

    /// [`Backend::supports`]; default: the inner backend's.
    fn supports(&self) -> Capabilities {
        self.inner().supports()
    }

    /// [`Backend::create_target`]; default: the inner backend's.
    async fn create_target(&self, plan: &Plan<'_>) -> Result<()> {
        self.inner().create_target(plan).await
    }

    /// [`Backend::attach_target`]; default: the inner backend's.
    async fn attach_target(&self, id: &str) -> Result<()> {
        self.inner().attach_target(id).await
    }

    /// [`Backend::list_targets`]; default: the inner backend's.
    async fn list_targets(&self, selector: &BTreeMap<String, String>) -> Result<Vec<RunInfo>> {
        self.inner().list_targets(selector).await
    }

    /// [`Backend::snapshot_target`]; default: the inner backend's.
    async fn snapshot_target(
        &self,
        id: &str,
        labels: &BTreeMap<String, String>,
        run: &dyn RunFiles,
    ) -> Result<crate::Snapshot> {
        self.inner().snapshot_target(id, labels, run).await
    }

    /// [`Backend::list_snapshots`]; default: the inner backend's.
    async fn list_snapshots(&self) -> Result<Vec<crate::Snapshot>> {
        self.inner().list_snapshots().await
    }

    /// [`Backend::snapshot_base`]; default: the inner backend's.
    fn snapshot_base(&self) -> bool {
        self.inner().snapshot_base()
    }

    /// [`Backend::helper_in_image`]; default: the inner backend's.
    async fn helper_in_image(&self, plan: &Plan<'_>) -> bool {
        self.inner().helper_in_image(plan).await
    }

    /// [`Backend::remove_snapshot`]; default: the inner backend's.
    async fn remove_snapshot(&self, id: &str) -> Result<()> {
        self.inner().remove_snapshot(id).await
    }

    /// [`Backend::push_snapshot`]; default: the inner backend's.
    async fn push_snapshot(&self, id: &str, repository: &str) -> Result<String> {
        self.inner().push_snapshot(id, repository).await
    }

    /// [`Backend::pull_snapshot`]; default: the inner backend's.
    async fn pull_snapshot(&self, reference: &str) -> Result<crate::Snapshot> {
        self.inner().pull_snapshot(reference).await
    }

    /// [`Backend::remove_target`]; default: the inner backend's.
    async fn remove_target(&self, id: &str) -> Result<()> {
        self.inner().remove_target(id).await
    }

    /// [`Backend::exec_raw`]; default: the inner backend's.
    async fn exec_raw(&self, id: &str, exec: RawExec) -> Result<RawProcess> {
        self.inner().exec_raw(id, exec).await
    }

    /// [`Backend::put_tar`]; default: the inner backend's.
    async fn put_tar(&self, id: &str, dir: &str, tar: ByteStream) -> Result<()> {
        self.inner().put_tar(id, dir, tar).await
    }

    /// [`Backend::get_tar`]; default: the inner backend's.
    async fn get_tar(&self, id: &str, path: &str) -> Result<ByteStream> {
        self.inner().get_tar(id, path).await
    }

    /// [`Backend::prepare_target`]; default: the inner backend's.
    async fn prepare_target(&self, plan: &Plan<'_>) -> Result<()> {
        self.inner().prepare_target(plan).await
    }

    /// [`Backend::put_executable`]; default: the inner backend's.
    async fn put_executable(&self, id: &str, path: &str, contents: bytes::Bytes) -> Result<()> {
        self.inner().put_executable(id, path, contents).await
    }

    /// [`Backend::diagnose`]; default: the inner backend's.
    async fn diagnose(&self, id: &str) -> Vec<(&'static str, String)> {
        self.inner().diagnose(id).await
    }

    /// [`Backend::before_stop`]; default: the inner backend's.
    async fn before_stop(&self, id: &str) -> Result<()> {
        self.inner().before_stop(id).await
    }

    /// [`Backend::pool_id`]; default: the inner backend's.
    fn pool_id(&self, run_id: &str, state: PoolState) -> String {
        self.inner().pool_id(run_id, state)
    }

    /// [`Backend::pool_mark_ready`]; default: the inner backend's.
    async fn pool_mark_ready(&self, run_id: &str) -> Result<()> {
        self.inner().pool_mark_ready(run_id).await
    }

    /// [`Backend::pool_ready_targets`]; default: the inner backend's.
    async fn pool_ready_targets(&self, key: &str) -> Result<Vec<String>> {
        self.inner().pool_ready_targets(key).await
    }

    /// [`Backend::pool_claim_target`]; default: the inner backend's.
    async fn pool_claim_target(&self, plan: &Plan<'_>) -> Result<bool> {
        self.inner().pool_claim_target(plan).await
    }

    /// [`Backend::pool_remove`]; default: the inner backend's.
    async fn pool_remove(&self, run_id: &str) -> Result<()> {
        self.inner().pool_remove(run_id).await
    }
}

#[async_trait]
impl<L: Layer> Backend for L {
    const NAME: &'static str = L::NAME;

    fn supports(&self) -> Capabilities {
        Layer::supports(self)
    }

    async fn create_target(&self, plan: &Plan<'_>) -> Result<()> {
        Layer::create_target(self, plan).await
    }

    async fn attach_target(&self, id: &str) -> Result<()> {
        Layer::attach_target(self, id).await
    }

    async fn list_targets(&self, selector: &BTreeMap<String, String>) -> Result<Vec<RunInfo>> {
        Layer::list_targets(self, selector).await
    }

    async fn remove_target(&self, id: &str) -> Result<()> {
        Layer::remove_target(self, id).await
    }

    async fn snapshot_target(
        &self,
        id: &str,
        labels: &BTreeMap<String, String>,
        run: &dyn RunFiles,
    ) -> Result<crate::Snapshot> {
        Layer::snapshot_target(self, id, labels, run).await
    }

    async fn list_snapshots(&self) -> Result<Vec<crate::Snapshot>> {
        Layer::list_snapshots(self).await
    }

    fn snapshot_base(&self) -> bool {
        Layer::snapshot_base(self)
    }

    async fn helper_in_image(&self, plan: &Plan<'_>) -> bool {
        Layer::helper_in_image(self, plan).await
    }

    async fn remove_snapshot(&self, id: &str) -> Result<()> {
        Layer::remove_snapshot(self, id).await
    }

    async fn push_snapshot(&self, id: &str, repository: &str) -> Result<String> {
        Layer::push_snapshot(self, id, repository).await
    }

    async fn pull_snapshot(&self, reference: &str) -> Result<crate::Snapshot> {
        Layer::pull_snapshot(self, reference).await
    }

    async fn exec_raw(&self, id: &str, exec: RawExec) -> Result<RawProcess> {
        Layer::exec_raw(self, id, exec).await
    }

    async fn put_tar(&self, id: &str, dir: &str, tar: ByteStream) -> Result<()> {
        Layer::put_tar(self, id, dir, tar).await
    }

    async fn get_tar(&self, id: &str, path: &str) -> Result<ByteStream> {
        Layer::get_tar(self, id, path).await
    }

    async fn prepare_target(&self, plan: &Plan<'_>) -> Result<()> {
        Layer::prepare_target(self, plan).await
    }

    async fn put_executable(&self, id: &str, path: &str, contents: bytes::Bytes) -> Result<()> {
        Layer::put_executable(self, id, path, contents).await
    }

    async fn diagnose(&self, id: &str) -> Vec<(&'static str, String)> {
        Layer::diagnose(self, id).await
    }

    async fn before_stop(&self, id: &str) -> Result<()> {
        Layer::before_stop(self, id).await
    }

    fn pool_id(&self, run_id: &str, state: PoolState) -> String {
        Layer::pool_id(self, run_id, state)
    }

    async fn pool_mark_ready(&self, run_id: &str) -> Result<()> {
        Layer::pool_mark_ready(self, run_id).await
    }

    async fn pool_ready_targets(&self, key: &str) -> Result<Vec<String>> {
        Layer::pool_ready_targets(self, key).await
    }

    async fn pool_claim_target(&self, plan: &Plan<'_>) -> Result<bool> {
        Layer::pool_claim_target(self, plan).await
    }

    async fn pool_remove(&self, run_id: &str) -> Result<()> {
        Layer::pool_remove(self, run_id).await
    }
}
