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

use crate::capabilities::Capabilities;
use crate::error::{Error, ErrorKind, Result};
use crate::exec::{ExecControl, ExecStream, ExitStatus, OutputChunk};
use crate::files::{self, ByteStream};
use crate::guard::CreateGuard;
use crate::helper::{self, ExecHelper, ExecPath, Session};
use crate::labels::{self, Owner};
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
    /// Where progress goes (the caller's callback, if any).
    progress: Option<ProgressFn>,
}

impl fmt::Debug for Plan<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Plan")
            .field("id", &self.id)
            .field("labels", &self.labels)
            .field("env", &self.env.iter().map(|(k, _)| k).collect::<Vec<_>>())
            .field("ca_pem", &self.ca_pem.is_some())
            .field("spec", &self.spec)
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
    /// removes the target on any error after this is called, and on cancellation.
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
        };
        tracing::Instrument::instrument(create_run(self, plan), span).await
    }

    async fn attach(&self, id: &str) -> Result<Box<dyn Run>> {
        self.attach_target(id).await?;
        Ok(Box::new(CoreRun::new(
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
}

/// The create sequence, once for every backend.
async fn create_run<B: Backend>(backend: &B, plan: Plan<'_>) -> Result<Box<dyn Run>> {
    let id = plan.id.clone();
    // From here on, a dropped future or a signal removes whatever the backend made.
    let guard = {
        let (backend, id) = (backend.clone(), id.clone());
        CreateGuard::new(move || {
            let (backend, id) = (backend.clone(), id.clone());
            async move { backend.remove_target(&id).await }
        })
    };
    let mode = plan.spec.exec_helper.effective();
    let run = CoreRun::new(backend.clone(), &id, mode);
    let result = async {
        backend.create_target(&plan).await?;
        plan.report(Progress::Step("checking that the sandbox answers".into()));
        // A greeting helper proves the target runs and answers with the run's user and
        // working directory; without one, a plain exec does.
        let helper_error = match mode {
            ExecHelper::Off => None,
            _ => match helper::start(backend, &id, true).await {
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
            check_alive(&run)
                .await
                .map_err(|alive| alive.with("exec_helper", &e))?;
            if mode == ExecHelper::Required {
                return Err(Error::new(
                    ErrorKind::StartFailed,
                    format!("the exec helper could not start: {e}"),
                )
                .with_field("exec_helper")
                .with("run", &id));
            }
            tracing::info!(run = %id, "the exec helper could not start ({e}); using plain execs");
        } else if mode == ExecHelper::Off {
            check_alive(&run).await?;
        }
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
        if let Err(cleanup) = backend.remove_target(&id).await {
            tracing::error!(run = %id, "could not remove the failed run: {cleanup}");
        }
        guard.disarm();
        return Err(e);
    }
    guard.disarm();
    tracing::debug!(run = %id, "run started");
    Ok(Box::new(run))
}

/// A run is handed out only when its target runs and answers an exec with the run's own
/// user and working directory.
async fn check_alive<B: Backend>(run: &CoreRun<B>) -> Result<()> {
    let probe = run
        .exec(ExecSpec::new(["sh", "-c", ":"]).timeout(LIVENESS_TIMEOUT))
        .await;
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
        }
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
        match helper::start(&self.backend, &self.id, false).await {
            Ok(s) => {
                *state = HelperState::Ready(s.clone());
                Ok(Some(s))
            }
            Err(e) if self.mode == ExecHelper::Required || e.kind() == ErrorKind::RunLost => {
                *state = HelperState::Untried;
                Err(e.with("run", &self.id))
            }
            Err(e) => {
                tracing::info!(run = %self.id, "the exec helper could not start ({e}); using plain execs");
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
        let mut env = spec.env.clone();
        env.push((EXEC_ID_ENV.to_string(), marker.clone()));
        let raw = RawExec {
            argv: spec.argv.clone(),
            env,
            working_dir: spec.working_dir.clone(),
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
                .spawn(&raw)
                .await
                .map_err(|e| e.with("run", &self.id))?;
            let control = HelperControl {
                session,
                hid,
                fallback: plain_control(process.status),
            };
            return Ok(span.in_scope(|| {
                ExecStream::spawn(&spec, process.output, process.stdin, Box::new(control))
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
            None => self.backend.put_tar(&self.id, dir, tar).await,
        }
    }

    async fn get_archive(&self, path: &str) -> Result<ByteStream> {
        files::validate_dir_path(path)?;
        match self.session().await? {
            Some(session) => helper::files::get(&session, path)
                .await
                .map_err(|e| e.with("run", &self.id)),
            None => self.backend.get_tar(&self.id, path).await,
        }
    }

    async fn stop(&self) -> Result<()> {
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
        self.fallback.status.status().await
    }

    async fn kill(&self) -> Result<()> {
        match tokio::time::timeout(KILL_EXEC_BOUND, self.session.kill(self.hid)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => {
                tracing::debug!(run = %self.fallback.id, "the helper cannot kill ({e}); killing by the exec marker");
                self.fallback.kill().await
            }
            Err(_) => self.fallback.kill().await,
        }
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
        self.status.status().await
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
        let kill = async {
            let mut process = self.backend.exec_raw(&self.id, raw).await?;
            drop(process.stdin.take());
            while let Some(chunk) = process.output.next().await {
                chunk.map_err(|e| {
                    Error::new(ErrorKind::Backend, "the kill exec broke").with_source(e)
                })?;
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
            Err(
                Error::new(ErrorKind::Backend, format!("the kill exec {status}"))
                    .with("run", &self.id),
            )
        }
    }
}
