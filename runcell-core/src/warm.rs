//! [`Warm`]: a ready pooled target, the token the warm-pool protocol passes from a warm
//! (or a listing) to a claim. Below runs and pools: it knows a target's id, its helper
//! session and the guard that removes it, nothing of the run it may become.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use crate::cleanup::CreateGuard;
use crate::error::Result;
use crate::helper::Session;
use crate::spec::RunSpec;

/// A ready pooled target, as [`crate::PoolProtocol::pool_warm`] made it or as another process's (by
/// id). Dropping it removes the target unless it was claimed.
pub struct Warm {
    run_id: String,
    key: String,
    label_keys: BTreeSet<String>,
    session: Option<Arc<Session>>,
    guard: Option<CreateGuard>,
    made: Instant,
}

impl fmt::Debug for Warm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Warm")
            .field("run_id", &self.run_id)
            .field("key", &self.key)
            .field("session", &self.session.is_some())
            .finish_non_exhaustive()
    }
}

impl Warm {
    pub(crate) fn new(
        run_id: String,
        key: &str,
        label_keys: BTreeSet<String>,
        session: Option<Arc<Session>>,
        guard: Option<CreateGuard>,
    ) -> Warm {
        Warm {
            run_id,
            key: key.to_string(),
            label_keys,
            session,
            guard,
            made: Instant::now(),
        }
    }

    /// A ready target another process made for a pool of `shape` (its key `key`):
    /// claimed by id, its helper started afresh.
    pub fn foreign(run_id: impl Into<String>, key: impl Into<String>, shape: &RunSpec) -> Warm {
        Warm::new(
            run_id.into(),
            &key.into(),
            crate::labels::pooled_keys(shape.ttl, &shape.labels),
            None,
            None,
        )
    }

    /// The id the run will have once claimed.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// The pool key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The keys of the labels the target carries while ready.
    pub fn label_keys(&self) -> &BTreeSet<String> {
        &self.label_keys
    }

    /// Whether its helper's stream broke while it waited: another process claimed the
    /// target (its claim starts a helper of its own), the target is gone, or only the
    /// stream broke. Then the session is dropped ([`Warm::drop_session`]) and the target
    /// stays a candidate: a claim tells these apart atomically, and a claimed run starts a
    /// helper afresh. Removing it instead would waste a ready target another process may
    /// need.
    pub(crate) fn dead(&self) -> bool {
        self.session.as_ref().is_some_and(|s| s.dead().is_some())
    }

    pub(crate) fn drop_session(&mut self) {
        self.session = None;
    }

    /// When it was made ready (by this process).
    pub(crate) fn made(&self) -> Instant {
        self.made
    }

    /// Stops guarding the target (claimed, or another claim won it) and hands over the
    /// helper session.
    pub(crate) fn release(mut self) -> Option<Arc<Session>> {
        if let Some(guard) = self.guard.take() {
            guard.disarm();
        }
        self.session.take()
    }

    /// Removes the target now, unless a run claimed it.
    pub(crate) async fn discard(mut self) -> Result<()> {
        match self.guard.take() {
            Some(guard) => guard.discard().await,
            None => Ok(()),
        }
    }
}
