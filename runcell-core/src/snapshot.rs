//! Snapshots: a run's filesystem state (what its commands changed in the target's own
//! filesystem, and the workspace), saved by [`crate::Run::snapshot`] as an image the
//! engine keeps, and runs started from it ([`crate::RunSpec::from_snapshot`],
//! [`crate::DriverExt::fork`]).
//!
//! What a snapshot holds is what the run's code made, never what the library put in the
//! target for that run: the run's env, proxy and CA settings, its labels and its
//! keep-alive are not in it (a run from it takes them from its own spec), and the CA files
//! the library installed are taken back out. The helper's place and the engine's mounts
//! other than the workspace are not in it.
//!
//! A snapshot is labelled like a run: the process that took it owns it (unless
//! [`SnapshotOptions::detached`]), and [`crate::reap`] removes one whose owner is gone on
//! this host or whose TTL passed. Its labels use their own keys (`sandbox.dev/snapshot-*`)
//! so that a run started from it, which sees its image's labels, never takes its owner or
//! expiry for its own.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::labels::{self, Owner};

/// The snapshot's id (`snap-` and 16 lowercase hex digits).
pub const SNAPSHOT_ID: &str = "sandbox.dev/snapshot-id";
/// The name given at [`crate::Run::snapshot`], if any.
pub const SNAPSHOT_NAME: &str = "sandbox.dev/snapshot-name";
/// The run it was taken from.
pub const SNAPSHOT_OF: &str = "sandbox.dev/snapshot-of";
/// The path of the workspace inside the target.
pub const SNAPSHOT_WORKSPACE: &str = "sandbox.dev/snapshot-workspace";
/// Owner of the snapshot (see [`Owner`]).
pub const SNAPSHOT_OWNER_HOST: &str = "sandbox.dev/snapshot-owner-host";
/// Owner's pid.
pub const SNAPSHOT_OWNER_PID: &str = "sandbox.dev/snapshot-owner-pid";
/// Owner's start time.
pub const SNAPSHOT_OWNER_START: &str = "sandbox.dev/snapshot-owner-start";
/// When the snapshot expires (seconds since the epoch).
pub const SNAPSHOT_EXPIRES_AT: &str = "sandbox.dev/snapshot-expires-at";
/// When it was taken (seconds since the epoch).
pub const SNAPSHOT_CREATED: &str = "sandbox.dev/snapshot-created";

/// A saved filesystem state ([`crate::Run::snapshot`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Snapshot {
    /// `snap-` and 16 hex digits.
    pub id: String,
    /// The engine's reference of the image a run from it starts from, so that no tag can
    /// be moved under it: its whole ID (`sha256:...`) on Docker and Podman, its registry
    /// reference by digest (`host/repository@sha256:...`) on Kubernetes.
    pub image: String,
    /// The image of the run it was taken from.
    pub base_image: String,
    /// The run it was taken from.
    pub source_run: String,
    /// Where the workspace is inside the target (a run from it has its workspace there).
    pub workspace_path: String,
    /// What it adds to its base image, in bytes.
    pub size_bytes: u64,
    /// When it was taken, seconds since the epoch.
    pub created: u64,
    /// Its labels (the library's `sandbox.dev/snapshot-*` keys).
    pub labels: BTreeMap<String, String>,
}

impl Snapshot {
    /// The snapshot an image's labels describe, `None` unless they are a whole set of the
    /// library's snapshot labels. `image` is the image's ID, `size_bytes` what it adds.
    pub fn from_labels(
        labels: &BTreeMap<String, String>,
        image: String,
        base_image: String,
        size_bytes: u64,
    ) -> Option<Snapshot> {
        if labels.get(labels::MANAGED_BY).map(String::as_str) != Some(labels::MANAGED_BY_VALUE) {
            return None;
        }
        let id = labels.get(SNAPSHOT_ID)?.clone();
        check_snapshot_id(&id).ok()?;
        Some(Snapshot {
            id,
            image,
            base_image,
            source_run: labels.get(SNAPSHOT_OF)?.clone(),
            workspace_path: labels.get(SNAPSHOT_WORKSPACE)?.clone(),
            size_bytes,
            created: labels.get(SNAPSHOT_CREATED)?.parse().ok()?,
            labels: labels.clone(),
        })
    }

    /// Who owns it: `None` for a detached snapshot.
    pub fn owner(&self) -> Option<Owner> {
        Some(Owner {
            host: self.labels.get(SNAPSHOT_OWNER_HOST)?.clone(),
            pid: self.labels.get(SNAPSHOT_OWNER_PID)?.parse().ok()?,
            start: self.labels.get(SNAPSHOT_OWNER_START)?.parse().ok()?,
        })
    }

    /// The name it was given, if any.
    pub fn name(&self) -> Option<&str> {
        self.labels.get(SNAPSHOT_NAME).map(String::as_str)
    }

    /// Why [`crate::reap`] would remove it at `now` (seconds since the epoch): its owner
    /// is gone on this host, or it expired; `None` if it keeps it.
    pub fn reap_reason(&self, now: u64) -> Option<crate::ReapReason> {
        if self.owner().and_then(|o| o.is_alive()) == Some(false) {
            return Some(crate::ReapReason::OwnerGone);
        }
        self.labels
            .get(SNAPSHOT_EXPIRES_AT)
            .and_then(|v| v.parse::<u64>().ok())
            .is_some_and(|at| at <= now)
            .then_some(crate::ReapReason::Expired)
    }
}

/// How [`crate::Run::snapshot`] takes a snapshot.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SnapshotOptions {
    /// A name to find it by (a label value: up to 63 of `[A-Za-z0-9._-]`).
    pub name: Option<String>,
    /// Its lifetime; past it, [`crate::reap`] removes it.
    pub ttl: Option<Duration>,
    /// Owned by no process: removed only by TTL or by hand (the CLI's snapshots).
    pub detached: bool,
}

impl SnapshotOptions {
    /// Sets [`SnapshotOptions::name`].
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Sets [`SnapshotOptions::ttl`].
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// Sets [`SnapshotOptions::detached`].
    pub fn detached(mut self, on: bool) -> Self {
        self.detached = on;
        self
    }

    /// Checks the options, naming the field.
    pub fn validate(&self) -> Result<()> {
        if let Some(name) = &self.name {
            labels::validate_value(name)
                .map_err(|why| Error::invalid_spec("snapshot.name", why))?;
            if name.is_empty() {
                return Err(Error::invalid_spec("snapshot.name", "must not be empty"));
            }
        }
        if self.ttl == Some(Duration::ZERO) {
            return Err(Error::invalid_spec("snapshot.ttl", "must be longer than 0"));
        }
        Ok(())
    }

    /// The labels of a new snapshot `id` of run `source`: the library's own keys only (the
    /// backend adds [`SNAPSHOT_WORKSPACE`]).
    pub fn labels(&self, id: &str, source: &str) -> BTreeMap<String, String> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let mut out = BTreeMap::new();
        out.insert(labels::MANAGED_BY.into(), labels::MANAGED_BY_VALUE.into());
        out.insert(SNAPSHOT_ID.into(), id.into());
        out.insert(SNAPSHOT_OF.into(), source.into());
        out.insert(SNAPSHOT_CREATED.into(), now.to_string());
        if let Some(name) = &self.name {
            out.insert(SNAPSHOT_NAME.into(), name.clone());
        }
        if !self.detached {
            let owner = Owner::current();
            out.insert(SNAPSHOT_OWNER_HOST.into(), owner.host);
            out.insert(SNAPSHOT_OWNER_PID.into(), owner.pid.to_string());
            out.insert(SNAPSHOT_OWNER_START.into(), owner.start.to_string());
        }
        if let Some(ttl) = self.ttl {
            out.insert(
                SNAPSHOT_EXPIRES_AT.into(),
                now.saturating_add(ttl.as_secs()).to_string(),
            );
        }
        out
    }
}

/// A new snapshot id.
pub fn new_snapshot_id() -> String {
    format!("snap-{:016x}", rand::random::<u64>())
}

/// Checks a snapshot id's shape (`snap-` and 16 lowercase hex digits), naming `snapshot`.
pub fn check_snapshot_id(id: &str) -> Result<()> {
    let ok = id.strip_prefix("snap-").is_some_and(|h| {
        h.len() == 16
            && h.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    });
    if ok {
        Ok(())
    } else {
        Err(Error::invalid_spec(
            "snapshot",
            format!(
                "{:?} is not a snapshot id (snap- and 16 lowercase hex digits)",
                id.chars().take(80).collect::<String>()
            ),
        ))
    }
}

/// Checks a registry repository snapshots are pushed to: `host[:port]/path`, the host
/// a registry's (with a dot or a port, or `localhost`), the path lowercase letters,
/// digits and `._-/` separators, no tag or digest. Bad: [`crate::ErrorKind::InvalidSpec`]
/// naming `repository`.
pub fn check_repository(repository: &str) -> Result<()> {
    let bad = |why: &str| {
        Err(Error::invalid_spec(
            "repository",
            format!(
                "{:?} {why} (host[:port]/path, e.g. registry.example:5000/snapshots)",
                repository.chars().take(200).collect::<String>()
            ),
        ))
    };
    if repository.len() > 255 {
        return bad("is longer than 255 bytes");
    }
    let Some((host, path)) = repository.split_once('/') else {
        return bad("names no registry host");
    };
    let (name, port) = match host.rsplit_once(':') {
        Some((name, port)) => (name, Some(port)),
        None => (host, None),
    };
    // Host labels: letters, digits and inner hyphens; a port up to 65535.
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    let host_ok = name.split('.').all(label_ok)
        && port.is_none_or(|p| {
            !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) && p.parse::<u16>().is_ok()
        })
        && (name.contains('.') || port.is_some() || name == "localhost");
    if !host_ok {
        return bad("names no registry host");
    }
    // Each part as the distribution grammar has it: [a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*.
    let part_ok = |part: &str| {
        let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
        let bytes = part.as_bytes();
        if bytes.is_empty() || !alnum(bytes[0]) || !alnum(bytes[bytes.len() - 1]) {
            return false;
        }
        let mut i = 0;
        while i < bytes.len() {
            if alnum(bytes[i]) {
                i += 1;
                continue;
            }
            let start = i;
            while i < bytes.len() && !alnum(bytes[i]) {
                i += 1;
            }
            let sep = &part[start..i];
            if !(sep == "." || sep == "_" || sep == "__" || sep.bytes().all(|b| b == b'-')) {
                return false;
            }
        }
        true
    };
    let path_ok = !path.is_empty() && path.split('/').all(part_ok);
    if !path_ok {
        return bad("is not a repository path (lowercase, no tag or digest)");
    }
    Ok(())
}

/// Splits a pushed snapshot's reference (`host[:port]/path:<snapshot id>`) into its
/// repository and snapshot id, both checked ([`check_repository`],
/// [`check_snapshot_id`]); bad: [`crate::ErrorKind::InvalidSpec`].
pub fn split_snapshot_reference(reference: &str) -> Result<(&str, &str)> {
    let Some((repository, id)) = reference.rsplit_once(':').filter(|(r, _)| r.contains('/')) else {
        return Err(Error::invalid_spec(
            "reference",
            format!(
                "{:?} is not a pushed snapshot (host[:port]/path:snap-...)",
                reference.chars().take(200).collect::<String>()
            ),
        ));
    };
    check_repository(repository)?;
    check_snapshot_id(id)?;
    Ok((repository, id))
}

/// [`split_snapshot_reference`], for its check alone.
pub fn check_snapshot_reference(reference: &str) -> Result<()> {
    split_snapshot_reference(reference).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repositories_and_references_are_checked() {
        for ok in [
            "127.0.0.1:5000/snaps",
            "registry.example/team/snaps",
            "localhost/a_b-c.d",
            "reg.example:5000/a__b/c--d/e.f",
        ] {
            check_repository(ok).unwrap();
        }
        for bad in [
            "snaps",
            "busybox/snaps",
            "127.0.0.1:5000/",
            "127.0.0.1:5000/Snaps",
            "127.0.0.1:5000/snaps:tag",
            "127.0.0.1:5000/snaps@sha256:00",
            "127.0.0.1:x/snaps",
            "127.0.0.1:5000//snaps",
            "127.0.0.1:5000/-snaps",
            "127.0.0.1:5000/a..b",
            "127.0.0.1:5000/a-",
            "127.0.0.1:5000/a.-b",
            "127.0.0.1:5000/../x",
            "127.0.0.1:99999/snaps",
            "-x.example/snaps",
            "a..b/snaps",
            "./snaps",
        ] {
            let e = check_repository(bad).unwrap_err();
            assert_eq!(e.field(), Some("repository"), "{bad}: {e}");
        }
        let (repo, id) =
            split_snapshot_reference("127.0.0.1:5000/snaps:snap-0123456789abcdef").unwrap();
        assert_eq!(
            (repo, id),
            ("127.0.0.1:5000/snaps", "snap-0123456789abcdef")
        );
        for bad in [
            "127.0.0.1:5000/snaps",
            "127.0.0.1:5000/snaps:latest",
            "snap-0123456789abcdef",
            "127.0.0.1:5000/Snaps:snap-0123456789abcdef",
        ] {
            assert!(split_snapshot_reference(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn labels_round_trip_and_ids_are_checked() {
        let id = new_snapshot_id();
        check_snapshot_id(&id).unwrap();
        for bad in [
            "snap-1",
            "snap-ABCDEF0123456789",
            "x",
            "snap-0123456789abcdef0",
        ] {
            assert!(check_snapshot_id(bad).is_err(), "{bad}");
        }
        let opts = SnapshotOptions::default()
            .name("prepared")
            .ttl(Duration::from_secs(60));
        let mut labels = opts.labels(&id, "sbx-1");
        labels.insert(SNAPSHOT_WORKSPACE.into(), "/workspace".into());
        let s = Snapshot::from_labels(&labels, "sha256:x".into(), "busybox".into(), 7).unwrap();
        assert_eq!((s.id.as_str(), s.name()), (id.as_str(), Some("prepared")));
        assert_eq!(s.owner(), Some(Owner::current()));
        assert_eq!(s.reap_reason(s.created), None);
        assert_eq!(
            s.reap_reason(s.created + 61),
            Some(crate::ReapReason::Expired)
        );
        // The run's own owner and expiry keys are never used.
        for k in [labels::OWNER_PID, labels::EXPIRES_AT, labels::RUN_ID] {
            assert!(!labels.contains_key(k), "{k}");
        }
        let detached = SnapshotOptions::default()
            .detached(true)
            .labels(&id, "sbx-1");
        assert!(!detached.contains_key(SNAPSHOT_OWNER_PID));
        assert!(SnapshotOptions::default().name("a b").validate().is_err());
    }
}
