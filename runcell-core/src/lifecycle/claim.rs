//! Warm pools over the kit: a target of a pool's shape warmed ahead (created, checked,
//! made claimable) and the claim of one for a run, after which everything run-specific is
//! applied in the order a cold create applies it.

use crate::cleanup::CreateGuard;
use crate::error::{Error, ErrorKind, Result};
use crate::files;
use crate::labels::{self, Owner};
use crate::progress::{CreateOptions, Progress};
use crate::raw::{Backend, Plan, PoolState};
use crate::run::Run;
use crate::spec::RunSpec;
use crate::warm::Warm;

use super::create::{bring_up, remove_failed, removed_or_named};
use super::run::{CoreRun, OVERLAY_FILE};

/// Creates a target of `shape` for pool `key`, waits until it answers, and makes it
/// claimable ([`crate::PoolProtocol::pool_warm`]).
pub(super) async fn warm<B: Backend>(backend: &B, shape: &RunSpec, key: &str) -> Result<Warm> {
    if !backend.supports().pool {
        return Err(Error::unsupported(
            "pool",
            "warm pools are not supported by this driver",
        ));
    }
    let run_id = crate::run::new_run_id();
    let id = backend.pool_id(&run_id, PoolState::Warming);
    let mut labels = labels::run_labels(&run_id, Some(&Owner::current()), shape.ttl, &shape.labels);
    labels.insert(labels::POOL.into(), key.into());
    labels.insert(labels::POOL_STATE.into(), labels::POOL_WARMING.into());
    let plan = Plan::checked(id.clone(), labels, shape, &backend.supports())?.warming(key);
    let span = tracing::debug_span!("pool.warm", driver = B::NAME, run = %run_id, pool = %key);
    let warm = async {
        // Removes the target in whichever state it got to, unless someone claimed it;
        // after the create, the returned `Warm` carries it.
        let guard = {
            let (backend, run_id) = (backend.clone(), run_id.clone());
            CreateGuard::new(plan.in_flight(), move || {
                let (backend, run_id) = (backend.clone(), run_id.clone());
                async move { backend.pool_remove(&run_id).await }
            })
        };
        let mode = shape.exec_helper.effective();
        let run = CoreRun::new(backend.clone(), &id, mode);
        let ready = async {
            bring_up(backend, &plan, &run).await?;
            backend.pool_mark_ready(&run_id).await
        }
        .await;
        if let Err(e) = ready {
            // As a failed create: a removal that hit a limit is tried again, and one that
            // still fails is named in the error (`left`).
            return Err(removed_or_named(&id, guard, e, || backend.pool_remove(&run_id)).await);
        }
        let pooled = guard;
        let session = run.ready_session().await;
        tracing::debug!(run = %run_id, "pooled target ready");
        let keys = plan.labels.keys().cloned().collect();
        Ok(Warm::new(run_id.clone(), key, keys, session, Some(pooled)))
    };
    tracing::Instrument::instrument(warm, span).await
}

/// Claims `warm` atomically for a run of `spec`, then applies everything run-specific
/// ([`crate::PoolProtocol::pool_claim`]).
pub(super) async fn claim<B: Backend>(
    backend: &B,
    warm: Warm,
    spec: &RunSpec,
    options: CreateOptions,
) -> Result<Option<Box<dyn Run>>> {
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
    let plan = Plan::checked(run_id.clone(), run_labels, spec, &backend.supports())?
        .claiming(&key, stale_labels)
        .with_progress(options.progress);
    let span = tracing::debug_span!("pool.claim", driver = B::NAME, run = %run_id);
    let claim = async {
        let won = match backend.pool_claim_target(&plan).await {
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
            let (backend, id) = (backend.clone(), run_id.clone());
            CreateGuard::new(plan.in_flight(), move || {
                let (backend, id) = (backend.clone(), id.clone());
                async move { backend.remove_target(&id).await }
            })
        };
        let session = warm.release();
        let run = CoreRun::claimed(backend.clone(), &plan, session);
        if let Err(e) = claim_setup(backend, &plan, &run).await {
            return Err(remove_failed(backend, &run_id, guard, e).await);
        }
        guard.disarm();
        tracing::debug!(run = %run_id, "pooled target claimed");
        Ok(Some(Box::new(run) as Box<dyn Run>))
    };
    tracing::Instrument::instrument(claim, span).await
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
