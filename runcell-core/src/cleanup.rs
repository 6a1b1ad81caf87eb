//! Cleanup that cannot be forgotten, below every run type: [`CreateGuard`] removes a
//! half-created run when `create` is cancelled, and [`stop_runs_on_signal`] stops, on
//! SIGINT/SIGTERM, the runs held by a [`crate::RunGuard`] and the runs being created. The
//! guarded runs are kept here as their stop only, so that this module knows nothing of
//! runs.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio_util::task::TaskTracker;

use crate::error::{Error, ErrorKind, Result};

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
pub(crate) async fn bounded(what: &str, step: impl Future<Output = Result<()>>) -> Result<()> {
    tokio::time::timeout(DROP_STOP_TIMEOUT, step)
        .await
        .unwrap_or_else(|_| Err(Error::new(ErrorKind::Timeout, format!("{what} timed out"))))
}

/// How long a drop may block on stopping the run.
const DROP_STOP_TIMEOUT: Duration = Duration::from_secs(30);

type Remover = Arc<dyn Fn() -> BoxFuture<'static, Result<()>> + Send + Sync>;

/// The stop of a guarded run: `None` once the run is gone.
pub(crate) type Stopper = Box<dyn Fn() -> Option<BoxFuture<'static, Result<()>>> + Send + Sync>;

/// What the signal handler must stop: runs held by guards, and runs being created.
enum Guarded {
    Run(Stopper),
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

/// Registers the stop of a run held by a guard, for [`stop_guarded_runs`]; returns its
/// key for [`unregister`].
pub(crate) fn register_run(stop: Stopper) -> u64 {
    register(Guarded::Run(stop))
}

/// Forgets the entry of `key`: its run was stopped, handed back or removed.
pub(crate) fn unregister(key: u64) {
    guarded().remove(&key);
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

/// still being created.
pub async fn stop_guarded_runs() {
    // Each step bounded: a stop and each removal by DROP_STOP_TIMEOUT, a cancelled
    // create's wait for its requests by SETTLE_TIMEOUT.
    let stops: Vec<BoxFuture<'static, Result<()>>> = guarded()
        .values()
        .filter_map(|entry| match entry {
            Guarded::Run(stop) => stop().map(|stop| {
                let stop: BoxFuture<'static, Result<()>> =
                    Box::pin(async move { bounded("stopping the run", stop).await });
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
