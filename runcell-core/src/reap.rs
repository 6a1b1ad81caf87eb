//! Removing runs nobody can use any more: expired, orphaned by a dead owner, or dead.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use futures::StreamExt;

use crate::error::Result;
use crate::labels::{self, Owner};
use crate::raw::RunInfo;
use crate::run::Driver;

/// Runs [`reap`] removes at once.
const REMOVALS: usize = 16;

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

impl ReapReason {
    /// Why [`reap`] would remove `run` at `now` (seconds since the epoch), `None` if it
    /// keeps it: the decision alone, for a dry run.
    pub fn of(run: &RunInfo, now: u64) -> Option<ReapReason> {
        let expired = run
            .labels
            .get(labels::EXPIRES_AT)
            .and_then(|v| v.parse::<u64>().ok())
            .is_some_and(|at| at <= now);
        if expired {
            Some(ReapReason::Expired)
        } else if Owner::from_labels(&run.labels).and_then(|o| o.is_alive()) == Some(false) {
            Some(ReapReason::OwnerGone)
        } else if !run.running {
            Some(ReapReason::NotRunning)
        } else {
            None
        }
    }
}

/// Removes the managed runs matching `selector` (empty: all) that nobody can use any more:
/// expired, owned by a dead process of this host, or no longer running; then the
/// snapshots ([`crate::Snapshot`], whatever `selector`) that are expired or whose owner is
/// gone on this host. Returns what it removed and why (a snapshot by its `snap-` id).
/// Runs and snapshots of live owners and of other hosts are left alone until they expire.
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
    let doomed: Vec<(String, ReapReason)> = driver
        .list(&selector)
        .await?
        .into_iter()
        .filter_map(|run| ReapReason::of(&run, now).map(|reason| (run.id, reason)))
        .collect();
    // REMOVALS at a time: an engine removes containers one by one slower than it takes
    // them side by side (500 runs of a SIGKILLed owner: the scale bench).
    let mut removals = futures::stream::iter(doomed)
        .map(|(id, reason)| async move {
            let removed = driver.remove(&id).await;
            (id, reason, removed)
        })
        .buffer_unordered(REMOVALS);
    while let Some((id, reason, removed)) = removals.next().await {
        // One failure must not keep the others alive: go on, report the first at the end.
        match removed {
            Ok(()) => {
                tracing::info!(run = %id, ?reason, "reaped");
                reaped.push((id, reason));
            }
            Err(e) => {
                tracing::error!(run = %id, "could not reap: {e}");
                first_error.get_or_insert(e);
            }
        }
    }
    for snapshot in driver.snapshots().await? {
        let Some(reason) = snapshot.reap_reason(now) else {
            continue;
        };
        match driver.remove_snapshot(&snapshot.id).await {
            Ok(()) => {
                tracing::info!(snapshot = %snapshot.id, ?reason, "reaped");
                reaped.push((snapshot.id, reason));
            }
            Err(e) => {
                tracing::error!(snapshot = %snapshot.id, "could not reap: {e}");
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) if reaped.is_empty() => Err(e),
        _ => Ok(reaped),
    }
}
