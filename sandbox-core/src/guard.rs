//! Cleanup that cannot be forgotten: [`RunGuard`] stops a run when dropped (also while
//! unwinding), [`CreateGuard`] removes a half-created run when `create` is cancelled, and
//! [`stop_runs_on_signal`] stops both kinds on SIGINT/SIGTERM.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio_util::task::TaskTracker;

use crate::error::{Error, ErrorKind, Result};
use crate::run::Run;

/// Removes a half-created run when the future of [`crate::Driver::create`] is dropped (cancelled)
/// before it finished, and lets [`stop_runs_on_signal`] remove it too. Core arms it
/// before the first backend call and disarms it once the run is handed out (or removed
/// on an error path).
pub(crate) struct CreateGuard {
    remove: Option<Remover>,
    in_flight: TaskTracker,
    key: u64,
}

impl CreateGuard {
    /// Arms the guard with an idempotent removal of everything the create may make;
    /// `in_flight` tracks the create's requests that run on when it is cancelled
    /// ([`crate::raw::Plan::uncancelled`]).
    pub fn new<F, Fut>(in_flight: &TaskTracker, remove: F) -> CreateGuard
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<()>> + Send + 'static,
    {
        let remove: Remover = Arc::new(move || Box::pin(remove()));
        let key = register(Guarded::Creating(remove.clone(), in_flight.clone()));
        CreateGuard {
            remove: Some(remove),
            in_flight: in_flight.clone(),
            key,
        }
    }

    /// The run was handed out (or removed on an error path): nothing to clean up.
    pub fn disarm(mut self) {
        guarded().remove(&self.key);
        self.remove = None;
    }

    /// Removes now (awaited, not from a drop), then disarms.
    pub async fn discard(mut self) -> Result<()> {
        let result = match self.remove.take() {
            Some(remove) => remove().await,
            None => Ok(()),
        };
        guarded().remove(&self.key);
        result
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
            if let Err(e) = remove_bounded(&first).await {
                tracing::error!("could not remove a cancelled run: {e}");
            }
        });
        // Once more after the create's requests settled: an engine may still make an
        // object after the client hung up. Not awaited here: on a current-thread runtime
        // the requests cannot advance while this drop blocks.
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            let in_flight = self.in_flight.clone();
            handle.spawn(async move {
                if let Err(e) = remove_when_settled(&remove, &in_flight).await {
                    tracing::error!("could not remove a cancelled run: {e}");
                }
            });
        }
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

/// A cancelled create's removal is repeated once its tracked requests settled, and not
/// before this (for a backend whose requests are not tracked).
const CREATE_RETRY_DELAY: Duration = Duration::from_secs(2);

/// How long a cancelled create's removal waits for its requests to settle.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(120);

/// The later removal of a cancelled create: once its requests settled (or
/// [`SETTLE_TIMEOUT`] passed) and at least [`CREATE_RETRY_DELAY`] after the first.
async fn remove_when_settled(remove: &Remover, in_flight: &TaskTracker) -> Result<()> {
    in_flight.close();
    let settled = async {
        if tokio::time::timeout(SETTLE_TIMEOUT, in_flight.wait())
            .await
            .is_err()
        {
            tracing::warn!("a cancelled create's requests did not settle; removing it anyway");
        }
    };
    tokio::join!(settled, tokio::time::sleep(CREATE_RETRY_DELAY));
    remove_bounded(remove).await
}

/// One removal of a cancelled create, bounded.
async fn remove_bounded(remove: &Remover) -> Result<()> {
    bounded("removing a cancelled run", remove()).await
}

/// A stop or a removal made on the way out, bounded by [`DROP_STOP_TIMEOUT`]: a
/// [`ErrorKind::Timeout`] saying `what` timed out after that.
async fn bounded(what: &str, step: impl Future<Output = Result<()>>) -> Result<()> {
    tokio::time::timeout(DROP_STOP_TIMEOUT, step)
        .await
        .unwrap_or_else(|_| Err(Error::new(ErrorKind::Timeout, format!("{what} timed out"))))
}

/// How long a drop may block on stopping the run.
const DROP_STOP_TIMEOUT: Duration = Duration::from_secs(30);

type Remover = Arc<dyn Fn() -> BoxFuture<'static, Result<()>> + Send + Sync>;

/// What the signal handler must stop: runs held by guards, and runs being created.
enum Guarded {
    Run(Weak<dyn Run>),
    Creating(Remover, TaskTracker),
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
pub(crate) fn cleanup_from_drop(cleanup: impl Future<Output = ()> + Send + 'static) {
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
    // Each step bounded: a stop and each removal by DROP_STOP_TIMEOUT, a cancelled
    // create's wait for its requests by SETTLE_TIMEOUT.
    let stops: Vec<BoxFuture<'static, Result<()>>> = guarded()
        .values()
        .filter_map(|entry| match entry {
            Guarded::Run(weak) => weak.upgrade().map(|run| {
                let stop: BoxFuture<'static, Result<()>> =
                    Box::pin(async move { bounded("stopping the run", run.stop()).await });
                stop
            }),
            // At once, and again once its requests settled: a create request still in
            // flight may make its target after the first removal (as in
            // `CreateGuard::drop`).
            Guarded::Creating(remove, in_flight) => {
                let (remove, in_flight) = (remove.clone(), in_flight.clone());
                let twice: BoxFuture<'static, Result<()>> = Box::pin(async move {
                    let first = remove_bounded(&remove).await;
                    remove_when_settled(&remove, &in_flight).await.and(first)
                });
                Some(twice)
            }
        })
        .collect();
    let stops = stops.into_iter().map(|stop| async move {
        if let Err(e) = stop.await {
            tracing::error!("could not stop a run on signal: {e}");
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
            if let Err(e) = bounded("stopping the run", run.stop()).await {
                tracing::error!(run = %id, "dropped run could not be stopped: {e}");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    /// An engine may make the object after the client hung up: a cancelled create is
    /// removed again once its requests settled, however long they take, not only after a
    /// fixed delay.
    #[tokio::test(start_paused = true)]
    async fn a_cancelled_create_is_removed_after_its_requests_settle() {
        let exists = Arc::new(AtomicBool::new(false));
        let removals = Arc::new(AtomicU64::new(0));
        let in_flight = TaskTracker::new();
        let guard = {
            let (exists, removals) = (exists.clone(), removals.clone());
            CreateGuard::new(&in_flight, move || {
                let (exists, removals) = (exists.clone(), removals.clone());
                async move {
                    exists.store(false, Ordering::SeqCst);
                    removals.fetch_add(1, Ordering::SeqCst);
                    Ok(())
                }
            })
        };
        // The create request: the engine makes the object 10 s later, whoever waits.
        drop({
            let exists = exists.clone();
            in_flight.spawn(async move {
                tokio::time::sleep(Duration::from_secs(10)).await;
                exists.store(true, Ordering::SeqCst);
            })
        });
        drop(guard);
        assert_eq!(removals.load(Ordering::SeqCst), 1, "removed at once");
        tokio::time::sleep(Duration::from_secs(9)).await;
        assert_eq!(removals.load(Ordering::SeqCst), 1, "waits for the request");
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(removals.load(Ordering::SeqCst), 2, "removed once more");
        assert!(!exists.load(Ordering::SeqCst), "the late object was left");
    }
}
