//! [`RunGuard`] stops a run when dropped (also while unwinding), and is found by
//! [`stop_runs_on_signal`] on SIGINT/SIGTERM; [`DriverExt::start`] creates a run inside
//! one.

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use async_trait::async_trait;

use crate::cleanup::{self, bounded, cleanup_from_drop};
use crate::error::Result;
use crate::progress::CreateOptions;
use crate::run::{Driver, Run};
use crate::spec::RunSpec;

pub use crate::cleanup::{stop_guarded_runs, stop_runs_on_signal};

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

impl RunGuard {
    /// Guards `run`.
    pub fn new(run: Box<dyn Run>) -> RunGuard {
        let run: Arc<dyn Run> = Arc::from(run);
        let weak = Arc::downgrade(&run);
        let key = cleanup::register_run(Box::new(move || {
            let run = weak.upgrade()?;
            Some(Box::pin(async move { run.stop().await }))
        }));
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
        cleanup::unregister(self.key);
        Ok(())
    }

    /// Disarms the guard: the run lives on after it.
    pub fn into_inner(mut self) -> Arc<dyn Run> {
        cleanup::unregister(self.key);
        self.run
            .take()
            .expect("a guard always holds its run until consumed")
    }
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
        cleanup::unregister(self.key);
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

/// Conveniences over [`Driver`].
#[async_trait]
pub trait DriverExt: Driver {
    /// Creates a run wrapped in a [`RunGuard`] that stops it on drop.
    async fn start(&self, spec: &RunSpec) -> Result<RunGuard> {
        Ok(RunGuard::new(self.create(spec).await?))
    }

    /// [`DriverExt::start`] with options (progress callback).
    async fn start_with(&self, spec: &RunSpec, options: CreateOptions) -> Result<RunGuard> {
        Ok(RunGuard::new(self.create_with(spec, options).await?))
    }

    /// Starts `n` runs of `spec` (one from a snapshot: [`RunSpec::from_snapshot`]), up to 8
    /// at once. All or nothing: if one fails, the others are stopped and its error
    /// returned.
    async fn fork(&self, spec: &RunSpec, n: usize) -> Result<Vec<RunGuard>> {
        let runs = self.fork_with(spec, n, CreateOptions::default()).await?;
        Ok(runs.into_iter().map(RunGuard::new).collect())
    }

    /// [`DriverExt::fork`] with options (e.g. detached runs, as the CLI makes), the runs
    /// unguarded.
    async fn fork_with(
        &self,
        spec: &RunSpec,
        n: usize,
        options: CreateOptions,
    ) -> Result<Vec<Box<dyn crate::Run>>> {
        use futures::StreamExt;
        if spec.from_snapshot.is_none() {
            return Err(crate::Error::invalid_spec(
                "from_snapshot",
                "fork starts runs from a snapshot (RunSpec::from_snapshot)",
            ));
        }
        if n == 0 {
            return Err(crate::Error::invalid_spec(
                "n",
                "fork starts at least one run",
            ));
        }
        let mut made = futures::stream::iter(0..n)
            .map(|_| self.create_with(spec, options.clone()))
            .buffer_unordered(8);
        let (mut runs, mut failed) = (Vec::with_capacity(n), None);
        while let Some(result) = made.next().await {
            match result {
                Ok(run) => runs.push(run),
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        match failed {
            None => Ok(runs),
            Some(e) => {
                for run in runs {
                    if let Err(cleanup) = run.stop().await {
                        tracing::warn!("fork: stopping a run after another failed: {cleanup}");
                    }
                }
                Err(e)
            }
        }
    }
}

impl<T: Driver + ?Sized> DriverExt for T {}
