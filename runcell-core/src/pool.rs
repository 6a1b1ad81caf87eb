//! Warm pools: see [`Pool`].

use std::collections::{BTreeSet, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::cleanup::cleanup_from_drop;
use crate::error::{Error, ErrorKind, Result};
use crate::guard::RunGuard;
use crate::progress::CreateOptions;
use crate::run::{Driver, PoolProtocol, Run};
use crate::spec::{RunSpec, Workspace};

pub use crate::warm::Warm;

/// What [`Pool::start`] does when no target is ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnEmpty {
    /// Create the run cold (counted as a miss), and raise the pool's goal toward
    /// [`PoolConfig::max`].
    #[default]
    Create,
    /// Fail with [`ErrorKind::Unavailable`] naming `pool`.
    Fail,
}

/// What [`Pool::start`] does with a spec whose shape differs from the pool's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnMismatch {
    /// Fail with [`ErrorKind::InvalidSpec`] naming the first field that differs.
    #[default]
    Fail,
    /// Create the run cold, outside the pool.
    Cold,
}

/// How a [`Pool`] behaves.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct PoolConfig {
    /// Targets kept ready (default 2).
    pub min_ready: usize,
    /// The most targets kept ready after misses raised the goal (default: `min_ready`
    /// twice). Each miss raises the goal by one up to `max`; each idle expiry lowers it
    /// back toward `min_ready`.
    pub max: usize,
    /// A ready target unclaimed this long is replaced (default 10 minutes).
    pub idle_ttl: Duration,
    /// What to do when nothing is ready.
    pub on_empty: OnEmpty,
    /// What to do with a spec of another shape.
    pub on_mismatch: OnMismatch,
    /// How many targets are created at once while refilling (default 2).
    pub parallel: usize,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            min_ready: 2,
            max: 4,
            idle_ttl: Duration::from_secs(600),
            on_empty: OnEmpty::Create,
            on_mismatch: OnMismatch::Fail,
            parallel: 2,
        }
    }
}

impl PoolConfig {
    /// Keeps `n` targets ready (and raises `max` to at least `n`).
    pub fn min_ready(mut self, n: usize) -> Self {
        self.min_ready = n;
        self.max = self.max.max(n);
        self
    }

    /// Sets the most targets kept ready.
    pub fn max(mut self, n: usize) -> Self {
        self.max = n;
        self
    }

    /// Sets the idle TTL of ready targets.
    pub fn idle_ttl(mut self, ttl: Duration) -> Self {
        self.idle_ttl = ttl;
        self
    }

    /// Sets what happens when nothing is ready.
    pub fn on_empty(mut self, on_empty: OnEmpty) -> Self {
        self.on_empty = on_empty;
        self
    }

    /// Sets what happens with a spec of another shape.
    pub fn on_mismatch(mut self, on_mismatch: OnMismatch) -> Self {
        self.on_mismatch = on_mismatch;
        self
    }

    /// Sets how many targets are created at once.
    pub fn parallel(mut self, n: usize) -> Self {
        self.parallel = n;
        self
    }

    fn validate(&self) -> Result<()> {
        if self.max < self.min_ready {
            return Err(Error::invalid_spec(
                "max",
                format!("{} is less than min_ready ({})", self.max, self.min_ready),
            ));
        }
        if self.parallel == 0 {
            return Err(Error::invalid_spec("parallel", "must be at least 1"));
        }
        if self.idle_ttl.is_zero() {
            return Err(Error::invalid_spec("idle_ttl", "must be more than zero"));
        }
        Ok(())
    }
}

/// What a pool did so far ([`Pool::stats`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolStats {
    /// Targets ready now, in this process.
    pub ready: usize,
    /// Targets being created now.
    pub creating: usize,
    /// The number of ready targets the pool aims at now.
    pub goal: usize,
    /// Runs started from a ready target (this process's or another's).
    pub hits: u64,
    /// Runs started cold because nothing was ready.
    pub misses: u64,
    /// Runs started cold because their shape differed ([`OnMismatch::Cold`]).
    pub mismatches: u64,
    /// Claims lost to another process or pool (each then tried the next target).
    pub lost_claims: u64,
    /// Targets that failed to be created.
    pub create_failures: u64,
    /// Ready targets removed unclaimed (idle TTL), or found no longer ready (claimed by
    /// another process, or gone) and given up.
    pub expired: u64,
    /// The last create failure.
    pub last_error: Option<String>,
    /// Time from [`Pool::start`] to a claimed, set-up run, over the hits.
    pub claim_latency_total: Duration,
    /// The longest of them.
    pub claim_latency_max: Duration,
}

#[derive(Default)]
struct State {
    ready: VecDeque<Warm>,
    creating: usize,
    goal: usize,
    stats: PoolStats,
    /// When a listing last found no other process's target ready: within
    /// [`FOREIGN_EMPTY_FOR`] of it a miss lists no more (a list is O(every container) on
    /// the engine, and a pool drained by a burst of claims misses on each).
    foreign_empty_at: Option<Instant>,
}

/// How long an empty listing of other processes' ready targets is believed.
const FOREIGN_EMPTY_FOR: Duration = Duration::from_secs(1);

struct Inner {
    driver: Arc<dyn Driver>,
    shape: RunSpec,
    key: String,
    config: PoolConfig,
    relabel: bool,
    state: Mutex<State>,
    wake: tokio::sync::Notify,
    changed: tokio::sync::Notify,
    closed: AtomicBool,
}

impl Inner {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Warm pools: targets created ahead of time, so that a run starts in the time of a claim
/// instead of a container or pod start.
///
/// A [`Pool`] is keyed by the create-time *shape* of a [`RunSpec`]: image, pull policy,
/// workspace path, user, resources, network, security, exec helper mode, and the pool's
/// labels and TTL. It keeps [`PoolConfig::min_ready`] targets of that shape ready (the
/// helper answers), refilled in the background. [`Pool::start`] claims one atomically (no
/// other process or pool can get the same target) and then applies everything
/// run-specific, which is never baked into a pooled target: env, proxy, CA files and trust
/// store, working directory, host workspace (copied in), post-create, and, where the
/// driver can relabel ([`crate::Capabilities::pool_relabel`]), the run's labels, owner
/// and TTL. A target serves one run only: it is removed when the run stops.
///
/// Pools with the same shape share their targets across processes: a pool that has
/// nothing ready of its own claims what another process made ready. Pooled targets carry
/// owner labels like runs, so [`crate::reap`] removes those of a killed process, and a
/// dropped pool removes its unclaimed targets.
///
/// Needs a Tokio runtime (it refills in a background task). Dropping it removes its
/// unclaimed targets (blocking, like a dropped [`RunGuard`]); prefer [`Pool::shutdown`].
/// Runs it handed out are not affected.
pub struct Pool {
    inner: Arc<Inner>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("driver", &self.inner.driver.name())
            .field("key", &self.inner.key)
            .field("shape", &self.inner.shape)
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

static POOL_SEQ: AtomicU64 = AtomicU64::new(0);

/// `driver`'s pool protocol, or the error that it has none.
fn protocol(driver: &dyn Driver) -> Result<&dyn PoolProtocol> {
    match driver.pooling() {
        Some(p) if driver.capabilities().pool => Ok(p),
        _ => Err(Error::unsupported(
            "pool",
            format!("driver {} has no warm pools", driver.name()),
        )),
    }
}

impl Pool {
    /// One run of `spec` from a target warmed for it now, with no pool kept: checked as
    /// [`Pool::create`] checks (the spec, the driver's capabilities; a detached run needs
    /// [`crate::Capabilities::pool_relabel`]) before anything exists, then a target of
    /// `spec`'s shape is warmed and claimed for it. As slow as a cold start; it shows that a
    /// pooled run behaves as a cold one (the conformance suite's pooled mode uses it).
    pub async fn warm_and_claim(
        driver: &dyn Driver,
        spec: &RunSpec,
        options: CreateOptions,
    ) -> Result<Box<dyn Run>> {
        let protocol = protocol(driver)?;
        spec.validate()?;
        let caps = driver.capabilities();
        caps.check(spec)?;
        if options.detached && !caps.pool_relabel {
            return Err(Error::invalid_spec(
                "detached",
                "a detached run needs a driver whose claims relabel (pool_relabel)",
            ));
        }
        let shape = shape_of(spec);
        let warm = protocol.pool_warm(&shape, &shape_key(&shape)).await?;
        protocol
            .pool_claim(warm, spec, options)
            .await?
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::Backend,
                    "a target warmed for this run was claimed by another",
                )
            })
    }

    /// A pool of `spec`'s shape on `driver`. Only the shape fields of `spec` matter (see
    /// [`Pool`]); its run-specific fields are ignored. Errors, before anything
    /// is created: an invalid spec or config (naming the field), a driver without
    /// [`crate::Capabilities::pool`], or no Tokio runtime.
    pub fn new(driver: Arc<dyn Driver>, spec: &RunSpec, config: PoolConfig) -> Result<Pool> {
        config.validate()?;
        let caps = driver.capabilities();
        protocol(&*driver)?;
        let shape = shape_of(spec);
        shape.validate()?;
        caps.check(&shape)?;
        let handle = tokio::runtime::Handle::try_current().map_err(|_| {
            Error::new(ErrorKind::InvalidSpec, "a pool needs a Tokio runtime").with_field("pool")
        })?;
        let key = shape_key(&shape);
        let inner = Arc::new(Inner {
            driver,
            key,
            relabel: caps.pool_relabel,
            state: Mutex::new(State {
                goal: config.min_ready,
                ..Default::default()
            }),
            shape,
            config,
            wake: tokio::sync::Notify::new(),
            changed: tokio::sync::Notify::new(),
            closed: AtomicBool::new(false),
        });
        let seq = POOL_SEQ.fetch_add(1, Ordering::Relaxed);
        let span = tracing::debug_span!("pool", key = %inner.key, seq);
        let task = handle.spawn(tracing::Instrument::instrument(
            refill(Arc::downgrade(&inner)),
            span,
        ));
        Ok(Pool {
            inner,
            task: Some(task),
        })
    }

    /// The pool key: a digest of the shape, on every pooled target as
    /// [`crate::labels::POOL`]. Pools of the same shape share it, and their targets.
    pub fn key(&self) -> &str {
        &self.inner.key
    }

    /// The shape the pool creates (the spec given to [`Pool::new`] without its
    /// run-specific fields).
    pub fn shape(&self) -> &RunSpec {
        &self.inner.shape
    }

    /// Counters and gauges, for metrics.
    pub fn stats(&self) -> PoolStats {
        let state = self.inner.state();
        PoolStats {
            ready: state.ready.len(),
            creating: state.creating,
            goal: state.goal,
            ..state.stats.clone()
        }
    }

    /// Waits until at least `n` targets are ready in this pool, or `timeout` passed
    /// ([`ErrorKind::Timeout`], with the last create error). For warm-up at start and for
    /// tests.
    pub async fn wait_ready(&self, n: usize, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let changed = self.inner.changed.notified();
            let (ready, last) = {
                let state = self.inner.state();
                (state.ready.len(), state.stats.last_error.clone())
            };
            if ready >= n {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let mut e = Error::new(
                    ErrorKind::Timeout,
                    format!("the pool has {ready} of {n} targets ready after {timeout:?}"),
                )
                .with_field("pool");
                if let Some(last) = last {
                    e = e.with("last_error", last);
                }
                return Err(e);
            }
            let _ = tokio::time::timeout(left.min(Duration::from_secs(1)), changed).await;
        }
    }

    /// Starts a run of `spec` from the pool, guarded like [`crate::DriverExt::start`].
    pub async fn start(&self, spec: &RunSpec) -> Result<RunGuard> {
        Ok(RunGuard::new(
            self.create(spec, CreateOptions::default()).await?,
        ))
    }

    /// Starts a run of `spec` from the pool: a ready target of this process, else one
    /// another process made ready, claimed atomically and set up for `spec`; when none is
    /// ready, [`PoolConfig::on_empty`] decides. A spec of another shape is refused naming
    /// the field that differs, or created cold ([`PoolConfig::on_mismatch`]).
    pub async fn create(&self, spec: &RunSpec, options: CreateOptions) -> Result<Box<dyn Run>> {
        let inner = &self.inner;
        spec.validate()?;
        inner.driver.capabilities().check(spec)?;
        if let Some((field, why)) = mismatch(&inner.shape, spec, inner.relabel) {
            return match inner.config.on_mismatch {
                OnMismatch::Fail => Err(Error::invalid_spec(
                    field,
                    format!("does not match the pool ({why})"),
                )
                .with("pool", &inner.key)),
                OnMismatch::Cold => {
                    inner.state().stats.mismatches += 1;
                    inner.driver.create_with(spec, options).await
                }
            };
        }
        if options.detached && !inner.relabel {
            // The owner labels of a pooled target cannot be taken off on this driver.
            let why = "a detached run needs a driver whose claims relabel (pool_relabel)";
            return match inner.config.on_mismatch {
                OnMismatch::Fail => Err(Error::invalid_spec("detached", why)),
                OnMismatch::Cold => {
                    inner.state().stats.mismatches += 1;
                    inner.driver.create_with(spec, options).await
                }
            };
        }
        let started = Instant::now();
        // Ours first (their helper is already up), then other processes'.
        loop {
            let next = inner.state().ready.pop_front();
            inner.wake.notify_one();
            let Some(mut warm) = next else { break };
            if warm.dead() {
                warm.drop_session();
            }
            if let Some(run) = self.claim(warm, spec, &options).await? {
                return Ok(self.hit(run, started));
            }
        }
        // Another process's: list, try each in random order (so that racing claimers
        // spread out), and list again while claims were lost, since a list is only a
        // snapshot: the pool is empty when a listing shows nothing not yet tried.
        let mut tried = BTreeSet::new();
        let believed_empty = inner
            .state()
            .foreign_empty_at
            .is_some_and(|at| at.elapsed() < FOREIGN_EMPTY_FOR);
        'listing: while !believed_empty && tried.len() < MAX_FOREIGN_TRIES {
            let mut listed = protocol(&*inner.driver)?.pool_ready(&inner.key).await?;
            if listed.is_empty() {
                inner.state().foreign_empty_at = Some(Instant::now());
            }
            listed.retain(|id| !tried.contains(id));
            if listed.is_empty() {
                break;
            }
            rand::seq::SliceRandom::shuffle(&mut listed[..], &mut rand::rng());
            tracing::debug!(pool = %inner.key, ?listed, "claiming another process's target");
            for id in listed {
                if tried.len() >= MAX_FOREIGN_TRIES {
                    break 'listing;
                }
                tried.insert(id.clone());
                let warm = Warm::foreign(id, inner.key.clone(), &inner.shape);
                if let Some(run) = self.claim(warm, spec, &options).await? {
                    return Ok(self.hit(run, started));
                }
            }
        }
        {
            let mut state = inner.state();
            state.stats.misses += 1;
            state.goal = (state.goal + 1).min(inner.config.max);
        }
        inner.wake.notify_one();
        match inner.config.on_empty {
            OnEmpty::Create => inner.driver.create_with(spec, options).await,
            OnEmpty::Fail => Err(Error::new(
                ErrorKind::Unavailable,
                "no target of the pool is ready (on_empty: fail)",
            )
            .with_field("pool")
            .with("pool", &inner.key)),
        }
    }

    async fn claim(
        &self,
        warm: Warm,
        spec: &RunSpec,
        options: &CreateOptions,
    ) -> Result<Option<Box<dyn Run>>> {
        let claimed = protocol(&*self.inner.driver)?
            .pool_claim(warm, spec, options.clone())
            .await?;
        if claimed.is_none() {
            self.inner.state().stats.lost_claims += 1;
        }
        Ok(claimed)
    }

    fn hit(&self, run: Box<dyn Run>, started: Instant) -> Box<dyn Run> {
        let took = started.elapsed();
        let mut state = self.inner.state();
        state.stats.hits += 1;
        state.stats.claim_latency_total += took;
        state.stats.claim_latency_max = state.stats.claim_latency_max.max(took);
        run
    }

    /// Stops refilling and removes every unclaimed target of this pool, waiting for the
    /// targets being created to be made and removed too (up to [`CLOSE_WAIT`], then they
    /// are cancelled). Runs it handed out are not affected.
    pub async fn shutdown(mut self) -> Result<()> {
        let (task, removals) = self.close();
        finish(task, removals).await
    }

    /// Marks the pool closed (the refill task then waits for its creates, removes what
    /// they made, and ends) and returns the task and the removals of the ready targets.
    fn close(&mut self) -> (Option<tokio::task::JoinHandle<()>>, Vec<Warm>) {
        self.inner.closed.store(true, Ordering::SeqCst);
        self.inner.wake.notify_one();
        let ready: Vec<Warm> = self.inner.state().ready.drain(..).collect();
        (self.task.take(), ready)
    }
}

/// How many targets of other processes one start tries to claim before it counts as a
/// miss.
const MAX_FOREIGN_TRIES: usize = 32;

/// How long closing a pool waits for the creates in flight before cancelling them.
pub const CLOSE_WAIT: Duration = Duration::from_secs(30);

async fn finish(task: Option<tokio::task::JoinHandle<()>>, ready: Vec<Warm>) -> Result<()> {
    let removals = futures::future::join_all(ready.into_iter().map(Warm::discard));
    let waited = async {
        if let Some(mut task) = task
            && tokio::time::timeout(CLOSE_WAIT, &mut task).await.is_err()
        {
            // Cancelled creates remove their targets as they are dropped.
            task.abort();
            let _ = task.await;
        }
    };
    let (results, ()) = futures::join!(removals, waited);
    first_error(results)
}

impl Drop for Pool {
    fn drop(&mut self) {
        if self.task.is_none() {
            return;
        }
        let (task, ready) = self.close();
        cleanup_from_drop(async move {
            if let Err(e) = finish(task, ready).await {
                tracing::error!("a dropped pool could not remove its targets: {e}");
            }
        });
    }
}

fn first_error(results: Vec<Result<()>>) -> Result<()> {
    results.into_iter().find(|r| r.is_err()).unwrap_or(Ok(()))
}

/// The background refill: keeps `goal` targets ready or being created, replaces those
/// idle past the TTL, backs off after failures. Ends when the pool is closed (the pool
/// also aborts it, which cancels the creates in flight).
async fn refill(inner: std::sync::Weak<Inner>) {
    let mut creating: tokio::task::JoinSet<Result<Warm>> = tokio::task::JoinSet::new();
    let mut backoff = Duration::ZERO;
    let mut blocked_until = tokio::time::Instant::now();
    loop {
        let Some(pool) = inner.upgrade() else { return };
        if pool.closed.load(Ordering::SeqCst) {
            // What is being created is removed once made, so nothing outlives the pool.
            while let Some(done) = creating.join_next().await {
                if let Ok(Ok(warm)) = done
                    && let Err(e) = warm.discard().await
                {
                    tracing::warn!("could not remove a pooled target: {e}");
                }
            }
            return;
        }
        // A ready target whose helper stream broke is kept only if it is still ready
        // (another process may have claimed it, or it is gone): one listing tells.
        let still_ready = if pool.state().ready.iter().any(Warm::dead) {
            match protocol(&*pool.driver) {
                Ok(p) => p.pool_ready(&pool.key).await.ok(),
                Err(_) => None,
            }
            .map(|ids| ids.into_iter().collect::<BTreeSet<_>>())
        } else {
            None
        };
        // Idle targets out, the goal back down one step per expiry.
        let ttl = pool.config.idle_ttl;
        let expired: Vec<Warm> = {
            let mut state = pool.state();
            if let Some(still_ready) = &still_ready {
                for warm in state.ready.iter_mut().filter(|w| w.dead()) {
                    if still_ready.contains(warm.run_id()) {
                        warm.drop_session();
                    }
                }
            }
            let (keep, old): (VecDeque<Warm>, VecDeque<Warm>) = state
                .ready
                .drain(..)
                .partition(|w| w.made().elapsed() < ttl && !w.dead());
            state.ready = keep;
            state.stats.expired += old.len() as u64;
            state.goal = state
                .goal
                .saturating_sub(old.len())
                .max(pool.config.min_ready);
            old.into_iter().collect()
        };
        for warm in expired {
            tracing::debug!(run = %warm.run_id(), "pooled target expired");
            if let Err(e) = warm.discard().await {
                tracing::warn!("could not remove an idle pooled target: {e}");
            }
        }
        let wanted = {
            let state = pool.state();
            (state
                .goal
                .saturating_sub(state.ready.len() + state.creating))
            .min(pool.config.parallel.saturating_sub(state.creating))
        };
        if tokio::time::Instant::now() >= blocked_until {
            for _ in 0..wanted {
                pool.state().creating += 1;
                let (driver, shape, key) =
                    (pool.driver.clone(), pool.shape.clone(), pool.key.clone());
                creating.spawn(async move { protocol(&*driver)?.pool_warm(&shape, &key).await });
            }
        }
        let wake = pool.wake.notified();
        tokio::select! {
            Some(done) = creating.join_next(), if !creating.is_empty() => {
                let mut late = None;
                {
                    let mut state = pool.state();
                    state.creating -= 1;
                    match done {
                        Ok(Ok(warm)) if !pool.closed.load(Ordering::SeqCst) => {
                            state.ready.push_back(warm);
                            backoff = Duration::ZERO;
                        }
                        Ok(Ok(warm)) => late = Some(warm),
                        Ok(Err(e)) => {
                            tracing::warn!("the pool could not create a target: {e}");
                            state.stats.create_failures += 1;
                            state.stats.last_error = Some(e.to_string());
                            backoff = (backoff * 2)
                                .clamp(Duration::from_millis(500), Duration::from_secs(30));
                            blocked_until = tokio::time::Instant::now() + backoff;
                        }
                        Err(e) => {
                            state.stats.create_failures += 1;
                            state.stats.last_error = Some(format!("the create task failed: {e}"));
                        }
                    }
                }
                pool.changed.notify_waiters();
                if let Some(warm) = late {
                    let _ = warm.discard().await;
                }
            }
            _ = wake => {}
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

/// `spec` without its run-specific fields: what a pooled target is created from.
fn shape_of(spec: &RunSpec) -> RunSpec {
    RunSpec {
        image: spec.image.clone(),
        pull: spec.pull,
        workspace: Workspace {
            host_dir: None,
            path: spec.workspace.path.clone(),
        },
        user: spec.user.clone(),
        labels: spec.labels.clone(),
        resources: spec.resources.clone(),
        network: spec.network,
        security: spec.security.clone(),
        ttl: spec.ttl,
        exec_helper: spec.exec_helper.effective(),
        from_snapshot: spec.from_snapshot.clone(),
        ..RunSpec::default()
    }
}

/// The first shape field where `spec` differs from the pool's `shape`, with why.
/// `labels` and `ttl` count only where a claim cannot relabel.
fn mismatch(shape: &RunSpec, spec: &RunSpec, relabel: bool) -> Option<(&'static str, String)> {
    let theirs = shape_of(spec);
    let differs = |field: &'static str, a: String, b: String| {
        (a != b).then(|| (field, format!("the pool has {a}, the spec {b}")))
    };
    differs("image", shape.image.clone(), theirs.image.clone())
        .or_else(|| {
            differs(
                "from_snapshot",
                format!("{:?}", shape.from_snapshot),
                format!("{:?}", theirs.from_snapshot),
            )
        })
        .or_else(|| {
            differs(
                "pull",
                format!("{:?}", shape.pull),
                format!("{:?}", theirs.pull),
            )
        })
        .or_else(|| {
            differs(
                "workspace.path",
                shape.workspace.path.clone(),
                theirs.workspace.path.clone(),
            )
        })
        .or_else(|| {
            differs(
                "user",
                format!("{:?}", shape.user),
                format!("{:?}", theirs.user),
            )
        })
        .or_else(|| {
            differs(
                "resources",
                format!("{:?}", shape.resources),
                format!("{:?}", theirs.resources),
            )
        })
        .or_else(|| {
            differs(
                "network",
                format!("{:?}", shape.network),
                format!("{:?}", theirs.network),
            )
        })
        .or_else(|| {
            differs(
                "security",
                format!("{:?}", shape.security),
                format!("{:?}", theirs.security),
            )
        })
        .or_else(|| {
            differs(
                "exec_helper",
                format!("{:?}", shape.exec_helper),
                format!("{:?}", theirs.exec_helper),
            )
        })
        .or_else(|| {
            if relabel {
                return None;
            }
            differs(
                "labels",
                format!("{:?}", shape.labels),
                format!("{:?}", theirs.labels),
            )
            .or_else(|| {
                differs(
                    "ttl",
                    format!("{:?}", shape.ttl),
                    format!("{:?}", theirs.ttl),
                )
            })
        })
}

/// A stable digest of a shape, valid as a label value: 16 hex digits of FNV-1a over its
/// JSON form.
fn shape_key(shape: &RunSpec) -> String {
    let json = serde_json::to_string(shape).unwrap_or_default();
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in json.bytes() {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    format!("p{hash:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shape_drops_run_specific_fields_and_keys_are_stable() {
        let a = RunSpec::new("img:1")
            .env("A", "1")
            .working_dir("/w")
            .workspace_dir("/tmp")
            .post_create(["true"])
            .label("team", "x");
        let b = RunSpec::new("img:1").label("team", "x");
        assert_eq!(shape_of(&a), shape_of(&b));
        assert_eq!(shape_key(&shape_of(&a)), shape_key(&shape_of(&b)));
        let key = shape_key(&shape_of(&a));
        crate::labels::validate_value(&key).unwrap();
        assert_ne!(key, shape_key(&shape_of(&RunSpec::new("img:2"))));
    }

    #[test]
    fn a_mismatch_names_the_field() {
        let shape = shape_of(&RunSpec::new("img:1").label("team", "x"));
        assert_eq!(
            mismatch(&shape, &RunSpec::new("img:2"), true).unwrap().0,
            "image"
        );
        assert_eq!(
            mismatch(&shape, &RunSpec::new("img:1").memory_bytes(1 << 30), true)
                .unwrap()
                .0,
            "resources"
        );
        assert_eq!(
            mismatch(&shape, &RunSpec::new("img:1").user("1000"), true)
                .unwrap()
                .0,
            "user"
        );
        // Labels count only where a claim cannot relabel.
        assert!(mismatch(&shape, &RunSpec::new("img:1"), true).is_none());
        assert_eq!(
            mismatch(&shape, &RunSpec::new("img:1"), false).unwrap().0,
            "labels"
        );
        let same = RunSpec::new("img:1").label("team", "x").env("K", "v");
        assert!(mismatch(&shape, &same, false).is_none());
    }

    #[test]
    fn config_is_checked() {
        assert_eq!(
            PoolConfig::default()
                .max(1)
                .min_ready(0)
                .max(0)
                .validate()
                .ok(),
            Some(())
        );
        let bad = PoolConfig {
            min_ready: 3,
            max: 1,
            ..Default::default()
        };
        assert_eq!(bad.validate().unwrap_err().field(), Some("max"));
        assert_eq!(
            PoolConfig::default()
                .parallel(0)
                .validate()
                .unwrap_err()
                .field(),
            Some("parallel")
        );
    }
}
