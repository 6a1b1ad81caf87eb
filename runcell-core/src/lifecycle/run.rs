//! [`CoreRun`], the one [`Run`] of every driver: a backend, a target id and its exec
//! helper. Its exec front half runs once for every backend: validation, the path (the
//! helper's session, started on first use, or one raw exec), the exec capability checks
//! of that path, the marker, then the pump and its control.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;

use crate::capabilities::Capabilities;
use crate::error::{Error, ErrorKind, Result};
use crate::exec::OutputChunk;
use crate::exec::{EXEC_ID_ENV, ExecStream};
use crate::execs::{ExecId, ExecInfo, FROM_NOW};
use crate::files::{self, ByteStream};
use crate::helper::durable::{ExecLink, Reconnect, Resume, SpawnOpts};
use crate::helper::{self, ExecHelper, ExecPath, Session};
use crate::raw::{Backend, Plan, RawExec};
use crate::run::Run;
use crate::spec::ExecSpec;

use futures::StreamExt;

use super::control::{Control, HelperControl, ReattachControl, TARGET_CHECK_BOUND};

/// `caps` with what the exec helper does on any backend.
pub(super) fn with_helper(caps: Capabilities) -> Capabilities {
    caps.exec_user(true)
        .stdin_streaming(true)
        .tty(true)
        .durable_execs(true)
        .snapshots(caps.snapshots || caps.snapshots_with_helper)
}

/// Where a run's helper stands.
#[derive(Debug)]
pub(super) enum HelperState {
    /// Not started yet (an attached run), or its stream broke: the next exec starts one.
    Untried,
    Ready(Arc<Session>),
    /// It could not start: plain execs for the rest of the run.
    Plain,
}

/// The one [`Run`] of every driver: a backend, a target id and its exec helper.
#[derive(Debug)]
pub(crate) struct CoreRun<B: Backend> {
    pub(super) backend: B,
    pub(super) id: String,
    pub(super) mode: ExecHelper,
    /// Shared with the exec streams that may resume through a new connection.
    pub(super) helper: Arc<tokio::sync::Mutex<HelperState>>,
    /// What a pooled run adds to every exec, since its target was created without it:
    /// known at create and claim, read from the target ([`OVERLAY_FILE`]) by an attached
    /// run's first exec. What is read back only shapes execs inside the target (env,
    /// working directory), never a host path.
    pub(super) overlay: tokio::sync::OnceCell<Option<Overlay>>,
}

/// Where a claimed pooled target keeps its run's settings, for runs attached later.
pub(super) const OVERLAY_FILE: &str = "/.runcell/run.json";

/// The run-specific settings of a claimed pooled target, applied per exec.
#[derive(serde::Serialize, serde::Deserialize)]
pub(super) struct Overlay {
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
    pub(super) fn new(backend: B, id: &str, mode: ExecHelper) -> CoreRun<B> {
        let state = match mode {
            ExecHelper::Off => HelperState::Plain,
            _ => HelperState::Untried,
        };
        CoreRun {
            backend,
            id: id.to_string(),
            mode,
            helper: Arc::new(tokio::sync::Mutex::new(state)),
            overlay: tokio::sync::OnceCell::new_with(Some(None)),
        }
    }

    /// An attached run: its overlay, if any, is read from the target when first needed.
    pub(super) fn attached(backend: B, id: &str, mode: ExecHelper) -> CoreRun<B> {
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
    pub(super) fn claimed(
        backend: B,
        plan: &Plan<'_>,
        session: Option<Arc<Session>>,
    ) -> CoreRun<B> {
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
            run.helper = Arc::new(tokio::sync::Mutex::new(HelperState::Ready(session)));
        }
        run.overlay = tokio::sync::OnceCell::new_with(Some(Some(Overlay {
            env: plan.env.clone(),
            working_dir: spec.working_dir.clone(),
            sync_back,
        })));
        run
    }

    /// The helper session the bring-up started, if it did.
    pub(super) async fn ready_session(&self) -> Option<Arc<Session>> {
        match &*self.helper.lock().await {
            HelperState::Ready(s) => Some(s.clone()),
            _ => None,
        }
    }

    /// The live helper session, starting one when there is none (first exec of an
    /// attached run, or after its stream broke); `None`: plain execs.
    async fn session(&self) -> Result<Option<Arc<Session>>> {
        live_session(&self.backend, &self.id, self.mode, &self.helper).await
    }

    /// How an exec's output reconnects when its connection broke: the run's live session,
    /// or a new one (one for every exec that resumes at the same time).
    fn reconnect(&self) -> Reconnect {
        let (backend, id, mode, state) = (
            self.backend.clone(),
            self.id.clone(),
            self.mode,
            self.helper.clone(),
        );
        Arc::new(move || {
            let (backend, id, state) = (backend.clone(), id.clone(), state.clone());
            Box::pin(async move {
                // A broken stream most often means the target died: say so at once
                // rather than retry a start that cannot work.
                if let Ok(Err(gone)) =
                    tokio::time::timeout(TARGET_CHECK_BOUND, backend.attach_target(&id)).await
                    && matches!(gone.kind(), ErrorKind::RunLost | ErrorKind::NotFound)
                {
                    return Err(Error::new(
                        ErrorKind::RunLost,
                        format!("the run's target is gone: {gone}"),
                    ));
                }
                // A run that took the plain path for good (its helper could not start,
                // `ExecHelper::Auto`) has no helper to resume through: final.
                live_session(&backend, &id, mode, &state)
                    .await?
                    .ok_or_else(|| {
                        Error::new(
                            ErrorKind::Unsupported,
                            "the run's exec helper could not start again: its execs take \
                             the plain path now",
                        )
                    })
            })
        })
    }

    /// [`ErrorKind::NotFound`] naming `exec_id` unless the helper has a record of `id`.
    async fn known_exec(&self, session: &Session, id: ExecId) -> Result<()> {
        let list = session.list().await.map_err(|e| e.with("run", &self.id))?;
        if list.iter().any(|e| e.id == id.get()) {
            Ok(())
        } else {
            Err(crate::execs::no_such_exec(id, &self.id))
        }
    }

    /// The session for a durable-exec operation (`execs`, `reattach`, ...): the helper's,
    /// or [`ErrorKind::Unsupported`] naming `field` on the plain path.
    async fn durable_session(&self, field: &str) -> Result<Arc<Session>> {
        match self.session().await? {
            Some(s) if s.hello.durable => Ok(s),
            Some(_) => Err(Error::unsupported(
                field,
                "exec records: this run's helper cannot keep a daemon (no writable, private \
                 directory beside it)",
            )),
            None => Err(Error::unsupported(
                field,
                "exec records on the plain exec path (they need the exec helper)",
            )),
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
impl<B: Backend> crate::raw::RunFiles for CoreRun<B> {
    async fn helper_archive(&self, path: &str) -> Result<Option<ByteStream>> {
        files::validate_dir_path(path)?;
        match self.session().await? {
            Some(session) => helper::files::get(&session, path)
                .await
                .map(Some)
                .map_err(|e| e.with("run", &self.id)),
            None => Ok(None),
        }
    }

    async fn helper_layer(&self, workspace: &str) -> Result<Option<ByteStream>> {
        if !workspace.is_empty() {
            files::validate_dir_path(workspace)?;
        }
        match self.session().await? {
            Some(session) => helper::files::layer(&session, workspace)
                .await
                .map(Some)
                .map_err(|e| e.with("run", &self.id)),
            None => Ok(None),
        }
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
            self_delimited: false,
        };
        let plain_control = |status| Control {
            backend: self.backend.clone(),
            id: self.id.clone(),
            marker: marker.clone(),
            user: spec.user.clone(),
            env: spec.env.clone(),
            status,
        };
        if spec.detach && session.is_none() {
            return Err(Error::unsupported(
                "detach",
                "a detached command on the plain exec path (it needs the exec helper)",
            ));
        }
        if let Some(session) = session {
            if spec.detach && !session.hello.durable {
                return Err(Error::unsupported(
                    "detach",
                    "a detached command in this run: its exec helper cannot keep a daemon \
                     (no writable, private directory beside it)",
                ));
            }
            let opts = SpawnOpts::of(&spec);
            let tty = opts.tty;
            let (hid, process, link) = session
                .spawn(&raw, &opts, deadline, Some(self.reconnect()))
                .await
                .map_err(|e| e.with("run", &self.id))?;
            let durable = session.hello.durable;
            let mut left = spec.clone();
            left.timeout =
                deadline.map(|d| d.saturating_duration_since(tokio::time::Instant::now()));
            let resizer = tty.is_some().then(|| {
                let link = link.clone();
                Box::new(move |rows, cols| link.session().resize(link.id, rows, cols))
                    as crate::exec::Resizer
            });
            let leaver = durable.then(|| {
                let link = link.clone();
                Box::new(move || link.leave()) as crate::exec::Leaver
            });
            let control = HelperControl {
                link,
                detached: spec.detach,
                fallback: plain_control(process.status),
            };
            let mut stream = span.in_scope(|| {
                ExecStream::spawn(&left, process.output, process.stdin, Box::new(control))
            });
            if let Some(resizer) = resizer {
                stream = stream.with_resizer(resizer);
            }
            if let Some(leaver) = leaver
                && let Some(id) = ExecId::new(hid)
            {
                stream = stream.with_id(id, 0, leaver);
            }
            return Ok(stream);
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

    async fn execs(&self) -> Result<Vec<ExecInfo>> {
        let session = self.durable_session("execs").await?;
        let list = session.list().await.map_err(|e| e.with("run", &self.id))?;
        Ok(list.into_iter().filter_map(ExecInfo::from_wire).collect())
    }

    async fn snapshot(&self, options: crate::SnapshotOptions) -> Result<crate::Snapshot> {
        options.validate()?;
        let caps = self.backend.supports();
        if !(caps.snapshots || caps.snapshots_with_helper) {
            return Err(Error::unsupported(
                "snapshot",
                "this driver has no snapshots",
            ));
        }
        let id = crate::snapshot::new_snapshot_id();
        let labels = options.labels(&id, &self.id);
        let span = tracing::debug_span!("snapshot", run = %self.id, snapshot = %id);
        tracing::Instrument::instrument(self.backend.snapshot_target(&self.id, &labels, self), span)
            .await
    }

    async fn reattach(&self, id: ExecId, from: u64) -> Result<ExecStream> {
        let session = self.durable_session("exec_id").await?;
        let Some((attached, events)) = session
            .attach(id.get(), from)
            .await
            .map_err(|e| e.with("run", &self.id))?
        else {
            return Err(crate::execs::no_such_exec(id, &self.id));
        };
        let link = ExecLink::new(id.get(), session, events.handover.clone());
        let status = Arc::new(std::sync::Mutex::new(None));
        let resume = Resume::reattached(link.clone(), self.reconnect(), attached.at);
        let mut output = events.into_output(status.clone(), Some(resume));
        let lost = if from == FROM_NOW {
            0
        } else {
            attached.at.saturating_sub(from)
        };
        if lost > 0 {
            output = futures::stream::iter([Ok(OutputChunk::Lost(lost))])
                .chain(output)
                .boxed();
        }
        let leaver = {
            let link = link.clone();
            Box::new(move || link.leave()) as crate::exec::Leaver
        };
        let control = ReattachControl {
            link,
            detached: attached.detach,
            status: Box::new(helper::durable::SharedStatus(status)),
        };
        let spec = ExecSpec::new(["reattach"]);
        let span = tracing::debug_span!("run", run = %self.id);
        let stream = span.in_scope(|| ExecStream::spawn(&spec, output, None, Box::new(control)));
        let start = if from == FROM_NOW {
            attached.at
        } else {
            from.min(attached.at)
        };
        Ok(stream.with_id(id, start, leaver))
    }

    async fn kill_exec(&self, id: ExecId) -> Result<()> {
        let session = self.durable_session("exec_id").await?;
        self.known_exec(&session, id).await?;
        match tokio::time::timeout(helper::KILL_ANSWER_TIMEOUT, session.kill(id.get())).await {
            Ok(r) => r.map_err(|e| e.with("run", &self.id)),
            Err(_) => {
                session.retire("the helper did not confirm a kill in time");
                Err(Error::new(
                    ErrorKind::Backend,
                    format!("the exec helper did not confirm the kill of exec {id} in time"),
                )
                .with("run", &self.id))
            }
        }
    }

    async fn release_exec(&self, id: ExecId) -> Result<()> {
        let session = self.durable_session("exec_id").await?;
        self.known_exec(&session, id).await?;
        session
            .release(id.get())
            .map_err(|e| e.with("run", &self.id))?;
        // Frames of one connection are taken in order: once a later `LIST` is answered,
        // the release was, and no process finds the record any more.
        session.list().await.map_err(|e| e.with("run", &self.id))?;
        Ok(())
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

/// The live helper session of run `id`, starting one when there is none (first exec of
/// an attached run, or after its stream broke); `None`: plain execs.
async fn live_session<B: Backend>(
    backend: &B,
    id: &str,
    mode: ExecHelper,
    state: &tokio::sync::Mutex<HelperState>,
) -> Result<Option<Arc<Session>>> {
    let mut state = state.lock().await;
    match &*state {
        HelperState::Plain => return Ok(None),
        HelperState::Ready(s) if s.dead().is_none() => return Ok(Some(s.clone())),
        HelperState::Ready(s) => {
            tracing::info!(run = %id, "the exec helper's stream broke ({}); starting a new one", crate::Shown(s.dead().unwrap_or_default()));
        }
        HelperState::Untried => {}
    }
    let started = match helper::start(backend, id).await {
        // Every step of a start fails on a target that is gone (an upload's 404, an
        // exec that cannot begin): that is the run lost, not a helper problem.
        Err(e) if e.kind() != ErrorKind::RunLost => {
            match tokio::time::timeout(TARGET_CHECK_BOUND, backend.attach_target(id)).await {
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
        Err(e) if mode == ExecHelper::Required || e.kind() == ErrorKind::RunLost => {
            *state = HelperState::Untried;
            Err(e.with("run", id))
        }
        Err(e) => {
            helper::log_fallback(id, &e);
            *state = HelperState::Plain;
            Ok(None)
        }
    }
}

/// For driver authors: an exec in target `id` of `backend` through core (marker, pump,
/// timeout, kill), for a backend's own work inside a target (tar through exec, setup
/// scripts). Dropping the stream kills it, like any exec.
///
/// It takes the plain path (one raw exec per command), never the helper: the helper's own
/// installation may go through it.
pub async fn exec_in<B: Backend>(backend: &B, id: &str, spec: ExecSpec) -> Result<ExecStream> {
    CoreRun::new(backend.clone(), id, ExecHelper::Off)
        .exec_stream(spec)
        .await
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
