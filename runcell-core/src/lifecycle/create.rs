//! The create sequence, once for every backend: the checked plan, the create guard
//! (armed before the first backend call), the target's bring-up (created, then answering
//! through the exec helper or a plain exec), the backend's set-up, the post-create
//! commands, and removal on any failure.

use std::time::Duration;

use crate::cleanup::CreateGuard;
use crate::error::{Error, ErrorKind, Result};
use crate::helper::{self, ExecHelper};
use crate::labels::{self, Owner};
use crate::progress::{CreateOptions, Progress};
use crate::raw::{Backend, Plan};
use crate::run::{Run, RunExt};
use crate::spec::{ExecSpec, RunSpec};

use super::run::{CoreRun, HelperState};

/// How long core's liveness check may take.
const LIVENESS_TIMEOUT: Duration = Duration::from_secs(60);

/// A cold create of a run of `spec` ([`crate::Driver::create_with`]).
pub(super) async fn create<B: Backend>(
    backend: &B,
    spec: &RunSpec,
    options: CreateOptions,
) -> Result<Box<dyn Run>> {
    let id = crate::run::new_run_id();
    let labels = labels::run_labels(
        &id,
        (!options.detached).then(Owner::current).as_ref(),
        spec.ttl,
        &spec.labels,
    );
    let plan =
        Plan::checked(id, labels, spec, &backend.supports())?.with_progress(options.progress);
    let span =
        tracing::debug_span!("run.create", driver = B::NAME, run = %plan.id, image = %spec.image);
    tracing::Instrument::instrument(create_run(backend, plan), span).await
}

/// The create sequence, once for every backend.
async fn create_run<B: Backend>(backend: &B, plan: Plan<'_>) -> Result<Box<dyn Run>> {
    let id = plan.id.clone();
    // From here on, a dropped future or a signal removes whatever the backend made.
    let guard = {
        let (backend, id) = (backend.clone(), id.clone());
        CreateGuard::new(plan.in_flight(), move || {
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
/// returns `e`. A removal that fails because a limit was reached (the host out of file
/// descriptors: what often failed the create too, and what passes as other work ends) is
/// tried again, for at most [`REMOVE_RETRIES`]; a removal that still fails is named in
/// the error's context (`left`), never silent.
pub(super) async fn remove_failed<B: Backend>(
    backend: &B,
    id: &str,
    guard: CreateGuard,
    e: Error,
) -> Error {
    removed_or_named(id, guard, e, || backend.remove_target(id)).await
}

/// [`remove_failed`] with the removal `remove` (a pooled target's is
/// [`Backend::pool_remove`], which spares one claimed meanwhile).
pub(super) async fn removed_or_named<F, Fut>(
    id: &str,
    guard: CreateGuard,
    e: Error,
    remove: F,
) -> Error
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    let mut result = remove().await;
    for pause in REMOVE_RETRIES {
        match &result {
            Err(cleanup) if cleanup.kind() == ErrorKind::LimitReached => {
                tokio::time::sleep(*pause).await;
                result = remove().await;
            }
            _ => break,
        }
    }
    guard.disarm();
    match result {
        Ok(()) => e,
        Err(cleanup) => {
            tracing::error!(run = %id, "could not remove the failed run: {cleanup}");
            e.with(
                "left",
                format!("{id} may be left: its removal failed: {cleanup}"),
            )
        }
    }
}

/// The pauses before each new try of a failed create's removal.
const REMOVE_RETRIES: &[Duration] = &[
    Duration::from_millis(100),
    Duration::from_millis(400),
    Duration::from_secs(1),
    Duration::from_secs(2),
    Duration::from_secs(4),
    Duration::from_secs(8),
];

/// Creates the target of `plan` and checks that it answers: through the exec helper
/// (its greeting), else a plain exec. `run`'s helper state is set from what worked.
pub(super) async fn bring_up<B: Backend>(
    backend: &B,
    plan: &Plan<'_>,
    run: &CoreRun<B>,
) -> Result<()> {
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
            _ => match unless_gone(
                backend,
                id,
                helper::start_with(backend, id, backend.helper_in_image(plan).await),
            )
            .await
            {
                Ok(session) => {
                    // Before any command of the run: what its snapshots are taken against.
                    // Without it a later snapshot fails, saying why.
                    if backend.snapshot_base()
                        && let Err(e) = helper::files::base(&session).await
                    {
                        tracing::warn!(
                            run = %id,
                            "could not record the run's base listing (its snapshots will fail): {e}"
                        );
                    }
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
                if e.kind() == ErrorKind::LimitReached {
                    // Not the helper's fault: the limit says what to do.
                    return Err(e.with("run", id));
                }
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
        // A limit of the host or engine says what to do, not the sandbox.
        Err(e) if e.kind() == ErrorKind::LimitReached => Err(e),
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
