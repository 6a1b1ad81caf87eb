//! The run lifecycle: [`Driver`] creates runs, [`Run`] is one live sandbox.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use futures::future::BoxFuture;

use crate::capabilities::Capabilities;
use crate::error::{Error, ErrorKind, Result};
use crate::exec::{DEFAULT_OUTPUT_LIMIT, ExecOutput, ExecStream};
use crate::files::{self, ByteStream};
use crate::labels::{self, Owner};
use crate::spec::{ExecSpec, RunSpec};

/// A backend that creates runs: one long-lived container or pod each.
///
/// Object-safe; share it as `Arc<dyn Driver>`.
#[async_trait]
pub trait Driver: Send + Sync + fmt::Debug + 'static {
    /// The registry name (`docker`, `k8s`, ...).
    fn name(&self) -> &str;

    /// What this driver supports.
    fn capabilities(&self) -> Capabilities;

    /// Creates a run: validates `spec` (see [`prepare`]), creates the target, waits until
    /// it is ready, sets up CA and workspace, runs the post-create commands. On any
    /// failure nothing is left behind.
    async fn create(&self, spec: &RunSpec) -> Result<Box<dyn Run>>;

    /// Re-attaches to a live run by id (from this or another process).
    async fn attach(&self, id: &str) -> Result<Box<dyn Run>>;

    /// The runs this driver manages whose labels include every pair of `selector`.
    async fn list(&self, selector: &BTreeMap<String, String>) -> Result<Vec<RunInfo>>;

    /// Removes a run and everything created for it, without a grace period. Removing a
    /// run that does not exist succeeds.
    async fn remove(&self, id: &str) -> Result<()>;
}

/// One live sandbox. Every exec enters the same target.
#[async_trait]
pub trait Run: Send + Sync + fmt::Debug {
    /// The run id (also the name of the container or pod).
    fn id(&self) -> &str;

    /// Starts a command. A non-zero exit is reported in the status, not as an error;
    /// errors mean the exec could not start (invalid spec, run lost, backend down).
    async fn exec_stream(&self, spec: ExecSpec) -> Result<ExecStream>;

    /// Extracts a tar archive, read as a stream, into the directory `dir` (which must
    /// exist). It never replaces a directory with a non-directory or the reverse: that is
    /// [`ErrorKind::InvalidSpec`] naming `path`, and what was there is left as it was.
    async fn put_archive(&self, dir: &str, tar: ByteStream) -> Result<()>;

    /// A tar archive of `path` (a file or directory) as a stream, with `path`'s base name
    /// at its root. A path that does not exist is [`ErrorKind::NotFound`].
    async fn get_archive(&self, path: &str) -> Result<ByteStream>;

    /// Removes the target and everything created for the run. Idempotent; no grace period.
    async fn stop(&self) -> Result<()>;
}

/// Conveniences over [`Run`], for every run. Not meant to be implemented by hand.
#[async_trait]
pub trait RunExt: Run {
    /// Runs a command to its end and returns its buffered output, each stream capped at
    /// [`ExecSpec::output_limit`] (default [`DEFAULT_OUTPUT_LIMIT`]).
    ///
    /// A command that could not start because the exec's `working_dir` or `user` does not
    /// exist in the run is an [`ErrorKind::NotFound`] error naming that field
    /// ([`crate::ExitStatus::NotStarted`] on a stream).
    async fn exec(&self, spec: ExecSpec) -> Result<ExecOutput> {
        let limit = spec.output_limit.unwrap_or(DEFAULT_OUTPUT_LIMIT);
        let out = self.exec_stream(spec).await?.collect(limit).await;
        match out.status.not_started_error() {
            Some(e) => Err(e.with("run", self.id())),
            None => Ok(out),
        }
    }

    /// Writes one file (its parent directory must exist) with `mode`, replacing a regular
    /// file of that name. `path` must be absolute and name a file; a path that is a
    /// directory in the run is [`ErrorKind::InvalidSpec`] naming `path`, and nothing is
    /// changed. For large files see [`RunExt::put_file_stream`].
    async fn put_file(&self, path: &str, contents: &[u8], mode: u32) -> Result<()> {
        let len = contents.len() as u64;
        self.put_file_stream(path, std::io::Cursor::new(contents.to_vec()), len, mode)
            .await
    }

    /// Writes one file of exactly `len` bytes read from `contents`, streaming: memory stays
    /// bounded whatever the size. Same path rules as [`RunExt::put_file`].
    async fn put_file_stream<R>(&self, path: &str, contents: R, len: u64, mode: u32) -> Result<()>
    where
        R: tokio::io::AsyncRead + Send + Unpin + 'static,
    {
        let (dir, name) = files::split_file_path(path)?;
        let tar = files::file_tar_stream(name, contents, len, mode)?;
        self.put_archive(dir, tar)
            .await
            .map_err(|e| e.with("path", path))
    }

    /// Reads one regular file into memory, at most [`files::FILE_LIMIT`] bytes (a larger
    /// file is [`ErrorKind::InvalidSpec`] naming `path`; use [`RunExt::get_file_stream`]).
    /// A directory is [`ErrorKind::InvalidSpec`] naming `path`; a missing file
    /// [`ErrorKind::NotFound`].
    async fn get_file(&self, path: &str) -> Result<Vec<u8>> {
        self.get_file_stream(path)
            .await?
            .read_all(files::FILE_LIMIT, path)
            .await
    }

    /// Reads one regular file as a stream ([`files::FileReader`] is an `AsyncRead` that
    /// knows the size): memory stays bounded whatever the size.
    async fn get_file_stream(&self, path: &str) -> Result<files::FileReader> {
        files::split_file_path(path)?;
        let tar = self.get_archive(path).await?;
        files::file_from_tar_stream(tar, path).await
    }
}

impl<T: Run + ?Sized> RunExt for T {}

/// Removes a half-created run when the future of [`Driver::create`] is dropped (cancelled)
/// before it finished, and lets [`stop_runs_on_signal`] remove it too. Drivers arm it
/// before their first backend call and disarm it once the run is handed out (or removed
/// on an error path).
pub struct CreateGuard {
    remove: Option<Remover>,
    key: u64,
}

impl CreateGuard {
    /// Arms the guard with an idempotent removal of everything the create may make.
    pub fn new<F, Fut>(remove: F) -> CreateGuard
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<()>> + Send + 'static,
    {
        let remove: Remover = Arc::new(move || Box::pin(remove()));
        let key = register(Guarded::Creating(remove.clone()));
        CreateGuard {
            remove: Some(remove),
            key,
        }
    }

    /// The run was handed out (or removed on an error path): nothing to clean up.
    pub fn disarm(mut self) {
        guarded().remove(&self.key);
        self.remove = None;
    }
}

impl Drop for CreateGuard {
    fn drop(&mut self) {
        guarded().remove(&self.key);
        let Some(remove) = self.remove.take() else {
            return;
        };
        // At once, and blocking, so that it is done before a runtime shutdown.
        let first = remove.clone();
        cleanup_from_drop(async move {
            if let Err(e) = tokio::time::timeout(DROP_STOP_TIMEOUT, first())
                .await
                .unwrap_or_else(|_| {
                    Err(Error::new(
                        ErrorKind::Timeout,
                        "removing a cancelled run timed out",
                    ))
                })
            {
                tracing::error!("could not remove a cancelled run: {e}");
            }
        });
        // Once more a little later, in case a create request was still in flight.
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                tokio::time::sleep(Duration::from_secs(2)).await;
                if let Err(e) = remove().await {
                    tracing::error!("could not remove a cancelled run: {e}");
                }
            });
        }
    }
}

/// Runs the spec's post-create commands in order, with the run's env and directory.
/// The first failure is [`ErrorKind::PostCreateFailed`] with its status and the tails of
/// its output; the caller then removes the run.
pub async fn run_post_create(run: &dyn Run, spec: &RunSpec) -> Result<()> {
    const TAIL: usize = 4096;
    let tail = |b: &[u8]| String::from_utf8_lossy(&b[b.len().saturating_sub(TAIL)..]).into_owned();
    for (i, argv) in spec.post_create.iter().enumerate() {
        let span = tracing::debug_span!("post_create", index = i, program = %argv[0]);
        let out = tracing::Instrument::instrument(
            run.exec(ExecSpec {
                argv: argv.clone(),
                ..Default::default()
            }),
            span,
        )
        .await?;
        if !out.status.success() {
            return Err(Error::new(
                ErrorKind::PostCreateFailed,
                format!("post_create[{i}] ({}) {}", argv[0], out.status),
            )
            .with("run", run.id())
            .with("status", &out.status)
            .with("stdout", tail(&out.stdout))
            .with("stderr", tail(&out.stderr)));
        }
    }
    Ok(())
}

/// Conveniences over [`Driver`].
#[async_trait]
pub trait DriverExt: Driver {
    /// Creates a run wrapped in a [`RunGuard`] that stops it on drop.
    async fn start(&self, spec: &RunSpec) -> Result<RunGuard> {
        Ok(RunGuard::new(self.create(spec).await?))
    }
}

impl<T: Driver + ?Sized> DriverExt for T {}

/// What drivers call first in [`Driver::create`]: validates the spec and checks it
/// against the capabilities, before anything is created.
pub fn prepare(spec: &RunSpec, capabilities: &Capabilities) -> Result<()> {
    spec.validate()?;
    capabilities.check(spec)
}

/// A fresh run id: `sbx-` and 12 hex digits, valid as a container name and a
/// Kubernetes object name.
pub fn new_run_id() -> String {
    format!("sbx-{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff)
}

/// What [`Driver::list`] reports of a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunInfo {
    /// The run id.
    pub id: String,
    /// Every label of the target (the library's and the caller's).
    pub labels: BTreeMap<String, String>,
    /// False once the target has exited or died (a target being created counts as running).
    pub running: bool,
}

/// Why [`reap`] removed a run.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReapReason {
    /// Its expiry label has passed.
    Expired,
    /// It was created on this host by a process that no longer lives.
    OwnerGone,
    /// Its target is no longer running.
    NotRunning,
}

/// Removes the managed runs matching `selector` (empty: all) that nobody can use any more:
/// expired, owned by a dead process of this host, or no longer running. Returns what it
/// removed and why. Runs of live owners and of other hosts are left alone until they expire.
/// A run that cannot be removed is logged and skipped; reap fails only when it removed
/// nothing and at least one removal failed.
pub async fn reap(
    driver: &dyn Driver,
    selector: &BTreeMap<String, String>,
) -> Result<Vec<(String, ReapReason)>> {
    let mut selector = selector.clone();
    selector.insert(
        labels::MANAGED_BY.to_string(),
        labels::MANAGED_BY_VALUE.to_string(),
    );
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut reaped = Vec::new();
    let mut first_error = None;
    for run in driver.list(&selector).await? {
        let expired = run
            .labels
            .get(labels::EXPIRES_AT)
            .and_then(|v| v.parse::<u64>().ok())
            .is_some_and(|at| at <= now);
        let reason = if expired {
            ReapReason::Expired
        } else if Owner::from_labels(&run.labels).and_then(|o| o.is_alive()) == Some(false) {
            ReapReason::OwnerGone
        } else if !run.running {
            ReapReason::NotRunning
        } else {
            continue;
        };
        // One failure must not keep the others alive: go on, report the first at the end.
        match driver.remove(&run.id).await {
            Ok(()) => {
                tracing::info!(run = %run.id, ?reason, "reaped");
                reaped.push((run.id, reason));
            }
            Err(e) => {
                tracing::error!(run = %run.id, "could not reap: {e}");
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) if reaped.is_empty() => Err(e),
        _ => Ok(reaped),
    }
}

/// Owns a run and stops it when dropped (also while unwinding from a panic), and lets
/// [`stop_runs_on_signal`] find it.
///
/// Prefer [`RunGuard::stop`], which reports errors. The drop fallback blocks the current
/// thread until the stop is done on a multi-thread Tokio runtime; on a current-thread
/// runtime it stops from a helper thread with its own runtime.
pub struct RunGuard {
    run: Option<Arc<dyn Run>>,
    key: u64,
    /// Set once [`RunGuard::stop`] succeeded: the drop has nothing left to do.
    stopped: std::sync::atomic::AtomicBool,
}

/// How long a drop may block on stopping the run.
const DROP_STOP_TIMEOUT: Duration = Duration::from_secs(30);

type Remover = Arc<dyn Fn() -> BoxFuture<'static, Result<()>> + Send + Sync>;

/// What the signal handler must stop: runs held by guards, and runs being created.
enum Guarded {
    Run(Weak<dyn Run>),
    Creating(Remover),
}

static GUARDED: Mutex<BTreeMap<u64, Guarded>> = Mutex::new(BTreeMap::new());
static NEXT_KEY: AtomicU64 = AtomicU64::new(0);

fn guarded() -> std::sync::MutexGuard<'static, BTreeMap<u64, Guarded>> {
    GUARDED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn register(entry: Guarded) -> u64 {
    let key = NEXT_KEY.fetch_add(1, Ordering::Relaxed);
    guarded().insert(key, entry);
    key
}

/// Runs a cleanup from a `Drop`: blocking on a multi-thread runtime (so that it is done
/// before the runtime can shut down), else on a thread of its own with its own runtime.
fn cleanup_from_drop(cleanup: impl Future<Output = ()> + Send + 'static) {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(|| handle.block_on(cleanup));
        }
        _ => {
            let joined = std::thread::spawn(move || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map(|rt| rt.block_on(cleanup))
            })
            .join();
            if !matches!(joined, Ok(Ok(()))) {
                tracing::error!("a cleanup thread failed");
            }
        }
    }
}

impl RunGuard {
    /// Guards `run`.
    pub fn new(run: Box<dyn Run>) -> RunGuard {
        let run: Arc<dyn Run> = Arc::from(run);
        let key = register(Guarded::Run(Arc::downgrade(&run)));
        RunGuard {
            run: Some(run),
            key,
            stopped: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Stops the run and reports the outcome. Takes `&self`, so a guard shared as
    /// `Arc<RunGuard>` can be stopped too; once it succeeded, the drop does nothing.
    pub async fn stop(&self) -> Result<()> {
        let Some(run) = &self.run else { return Ok(()) };
        run.stop().await?;
        self.stopped.store(true, Ordering::SeqCst);
        guarded().remove(&self.key);
        Ok(())
    }

    /// Disarms the guard: the run lives on after it.
    pub fn into_inner(mut self) -> Arc<dyn Run> {
        guarded().remove(&self.key);
        self.run
            .take()
            .expect("a guard always holds its run until consumed")
    }
}

/// Stops every run held by a live [`RunGuard`] in this process, and removes every run
/// still being created.
pub async fn stop_guarded_runs() {
    let stops: Vec<BoxFuture<'static, Result<()>>> = guarded()
        .values()
        .filter_map(|entry| match entry {
            Guarded::Run(weak) => weak.upgrade().map(|run| {
                let stop: BoxFuture<'static, Result<()>> =
                    Box::pin(async move { run.stop().await });
                stop
            }),
            Guarded::Creating(remove) => Some(remove()),
        })
        .collect();
    let stops = stops.into_iter().map(|stop| async move {
        match tokio::time::timeout(DROP_STOP_TIMEOUT, stop).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!("could not stop a run on signal: {e}"),
            Err(_) => tracing::error!("stopping a run on signal timed out"),
        }
    });
    futures::future::join_all(stops).await;
}

/// Opt-in for binaries: on SIGINT or SIGTERM, stop every guarded run, then exit with
/// 128 + the signal number. Call once, inside a Tokio runtime.
pub fn stop_runs_on_signal() -> Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let err = |e: std::io::Error| {
        Error::new(ErrorKind::Backend, "cannot install the signal handler").with_source(e)
    };
    let mut int = signal(SignalKind::interrupt()).map_err(err)?;
    let mut term = signal(SignalKind::terminate()).map_err(err)?;
    tokio::spawn(async move {
        let code = tokio::select! {
            _ = int.recv() => 130,
            _ = term.recv() => 143,
        };
        tracing::warn!("signal received: stopping the runs of this process");
        stop_guarded_runs().await;
        std::process::exit(code);
    });
    Ok(())
}

impl Deref for RunGuard {
    type Target = dyn Run;

    fn deref(&self) -> &(dyn Run + 'static) {
        self.run
            .as_deref()
            .expect("a guard always holds its run until consumed")
    }
}

impl fmt::Debug for RunGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("RunGuard").field(&self.run).finish()
    }
}

impl Drop for RunGuard {
    fn drop(&mut self) {
        guarded().remove(&self.key);
        let Some(run) = self.run.take() else { return };
        if self.stopped.load(Ordering::SeqCst) {
            return;
        }
        cleanup_from_drop(async move {
            let id = run.id().to_string();
            match tokio::time::timeout(DROP_STOP_TIMEOUT, run.stop()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::error!(run = %id, "dropped run could not be stopped: {e}"),
                Err(_) => tracing::error!(run = %id, "dropped run: stop timed out"),
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_ids_are_valid_names() {
        let id = new_run_id();
        assert_eq!(id.len(), 16);
        assert!(id.starts_with("sbx-"));
        labels::validate_value(&id).unwrap();
        assert_ne!(new_run_id(), new_run_id());
    }
}
