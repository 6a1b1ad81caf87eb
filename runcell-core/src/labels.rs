//! The labels the library puts on every backend object, and who owns a run.
//!
//! Keys follow Kubernetes label syntax so the same labels work on every backend.
//! The owner labels (host, pid, process start time) let a later [`crate::reap`] find
//! runs whose creating process died without stopping them (SIGKILL, power loss).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The prefix reserved for the library's own label keys.
pub const PREFIX: &str = "sandbox.dev/";
/// Present on every object the library creates; the value is [`MANAGED_BY_VALUE`].
pub const MANAGED_BY: &str = "sandbox.dev/managed-by";
/// The value of [`MANAGED_BY`].
pub const MANAGED_BY_VALUE: &str = "sandbox";
/// The run id.
pub const RUN_ID: &str = "sandbox.dev/run-id";
/// Hostname of the process that created the run.
pub const OWNER_HOST: &str = "sandbox.dev/owner-host";
/// Pid of the process that created the run.
pub const OWNER_PID: &str = "sandbox.dev/owner-pid";
/// Start time (clock ticks since boot) of the process that created the run.
pub const OWNER_START: &str = "sandbox.dev/owner-start";
/// Unix time (seconds) after which the run may be reaped.
pub const EXPIRES_AT: &str = "sandbox.dev/expires-at";
/// On targets a [`crate::Pool`] created: the pool's key (a digest of the shape they were
/// created with), kept after the claim.
pub const POOL: &str = "sandbox.dev/pool";
/// On pooled targets where the backend keeps the state in labels: [`POOL_WARMING`],
/// [`POOL_READY`] or [`POOL_CLAIMED`].
pub const POOL_STATE: &str = "sandbox.dev/pool-state";
/// [`POOL_STATE`] while the target is created and checked.
pub const POOL_WARMING: &str = "warming";
/// [`POOL_STATE`] once the target answers and any process may claim it.
pub const POOL_READY: &str = "ready";
/// [`POOL_STATE`] once a run owns the target.
pub const POOL_CLAIMED: &str = "claimed";

/// Checks a label key against Kubernetes' rules: `[prefix/]name`, the name at most 63
/// characters of `[A-Za-z0-9._-]` starting and ending alphanumeric, the prefix a DNS subdomain.
pub fn validate_key(key: &str) -> Result<(), String> {
    let (prefix, name) = match key.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if let Some(p) = prefix {
        let ok = !p.is_empty()
            && p.len() <= 253
            && p.split('.').all(|part| {
                !part.is_empty()
                    && part.len() <= 63
                    && part
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                    && !part.starts_with('-')
                    && !part.ends_with('-')
            });
        if !ok {
            return Err(format!("key {key:?}: the prefix must be a DNS subdomain"));
        }
    }
    if !is_name(name) || name.is_empty() {
        return Err(format!(
            "key {key:?}: the name must be 1-63 characters of [A-Za-z0-9._-], alphanumeric at both ends"
        ));
    }
    Ok(())
}

/// Checks a label value: empty, or at most 63 characters of `[A-Za-z0-9._-]`,
/// alphanumeric at both ends.
pub fn validate_value(value: &str) -> Result<(), String> {
    if value.is_empty() || is_name(value) {
        Ok(())
    } else {
        Err(format!(
            "value {value:?} must be at most 63 characters of [A-Za-z0-9._-], alphanumeric at both ends"
        ))
    }
}

fn is_name(s: &str) -> bool {
    s.len() <= 63
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && s.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
        && s.chars().last().is_some_and(|c| c.is_ascii_alphanumeric())
}

/// Turns any text into a valid label value (for hostnames and the like).
pub fn sanitize_value(s: &str) -> String {
    let mapped: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '-'
            }
        })
        .take(63)
        .collect();
    mapped
        .trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_string()
}

/// The process that created a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    /// Hostname, sanitized as a label value.
    pub host: String,
    /// Process id.
    pub pid: u32,
    /// Start time in clock ticks since boot (0 where unknown).
    pub start: u64,
}

impl Owner {
    /// This process.
    pub fn current() -> Owner {
        let pid = std::process::id();
        Owner {
            host: hostname(),
            pid,
            start: process_start(pid).unwrap_or(0),
        }
    }

    /// Reads the owner from a run's labels.
    pub fn from_labels(labels: &BTreeMap<String, String>) -> Option<Owner> {
        Some(Owner {
            host: labels.get(OWNER_HOST)?.clone(),
            pid: labels.get(OWNER_PID)?.parse().ok()?,
            start: labels.get(OWNER_START)?.parse().ok()?,
        })
    }

    /// Whether the owner still lives: `Some(false)` only when it ran on this host and its
    /// pid is gone or now belongs to a process started at another time; `None` when that
    /// cannot be known here (another host).
    ///
    /// Unknown liveness means keep: a host without `/proc` (or whose name is unknown)
    /// cannot judge, so it never reports an owner as gone.
    pub fn is_alive(&self) -> Option<bool> {
        self.liveness(std::path::Path::new("/proc"), &hostname())
    }

    fn liveness(&self, proc_root: &std::path::Path, this_host: &str) -> Option<bool> {
        if self.host == UNKNOWN_HOST || self.host != this_host {
            return None;
        }
        if !proc_root.join("self/stat").exists() {
            return None;
        }
        match process_start_in(proc_root, self.pid) {
            None => Some(false),
            Some(start) => Some(self.start == 0 || start == self.start),
        }
    }
}

/// The library's labels for a new run, in insertion order of a map.
///
/// `owner` `None`: a detached run, owned by no process (reaped only by TTL or when dead).
pub fn run_labels(
    run_id: &str,
    owner: Option<&Owner>,
    ttl: Option<Duration>,
    user: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    let mut labels = user.clone();
    labels.insert(RUN_ID.into(), run_id.into());
    if let Some(owner) = owner {
        labels.insert(OWNER_HOST.into(), owner.host.clone());
        labels.insert(OWNER_PID.into(), owner.pid.to_string());
        labels.insert(OWNER_START.into(), owner.start.to_string());
    }
    if let Some(ttl) = ttl {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        // A TTL too long to add is as good as none, but keeps a label: it never expires.
        let secs = now.saturating_add(ttl.as_secs());
        labels.insert(EXPIRES_AT.into(), secs.to_string());
    }
    // Applied last so that nothing can override it.
    labels.insert(MANAGED_BY.into(), MANAGED_BY_VALUE.into());
    labels
}

/// The label keys of a ready pooled target ([`crate::Pool`]) whose shape has `ttl` and
/// the user labels `user` (`RunSpec::ttl` and `RunSpec::labels` of the shape): the run
/// labels of an owned run, the pool key and state. Pools of one shape key agree on them,
/// so a claim by any process knows what to take off.
pub fn pooled_keys(ttl: Option<Duration>, user: &BTreeMap<String, String>) -> BTreeSet<String> {
    let mut keys: BTreeSet<String> = run_labels("", Some(&Owner::current()), ttl, user)
        .into_keys()
        .collect();
    keys.extend([POOL.to_string(), POOL_STATE.to_string()]);
    keys
}

fn hostname() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_default();
    let host = sanitize_value(raw.trim());
    if host.is_empty() {
        UNKNOWN_HOST.into()
    } else {
        host
    }
}

/// The labels a run with `spec`'s labels and TTL gets, with a fixed run id
/// (`sbx-000000000001`), owner and expiry: for snapshot tests of what a backend sends.
pub fn fixed_for_snapshots(
    user: &BTreeMap<String, String>,
    ttl: Option<Duration>,
) -> BTreeMap<String, String> {
    let owner = Owner {
        host: "host-1".into(),
        pid: 4242,
        start: 777,
    };
    let mut labels = run_labels("sbx-000000000001", Some(&owner), None, user);
    if ttl.is_some() {
        labels.insert(EXPIRES_AT.into(), "1900000000".into());
    }
    labels
}

/// The owner host recorded when the host name cannot be read.
const UNKNOWN_HOST: &str = "unknown";

/// The start time of `pid` in clock ticks since boot (field 22 of `/proc/PID/stat`).
fn process_start(pid: u32) -> Option<u64> {
    process_start_in(std::path::Path::new("/proc"), pid)
}

fn process_start_in(proc_root: &std::path::Path, pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(proc_root.join(format!("{pid}/stat"))).ok()?;
    // The command name (field 2) may contain spaces and parentheses: skip past the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_liveness_is_never_dead() {
        let me = Owner::current();
        let proc = std::path::Path::new("/proc");
        assert_eq!(me.liveness(proc, &me.host), Some(true));
        // No /proc here: cannot tell, so keep.
        let empty = std::env::temp_dir().join("runcell-no-proc");
        assert_eq!(me.liveness(&empty, &me.host), None);
        // Another host, or an owner whose host was unknown: cannot tell.
        assert_eq!(me.liveness(proc, "elsewhere"), None);
        let unknown = Owner {
            host: UNKNOWN_HOST.into(),
            ..me.clone()
        };
        assert_eq!(unknown.liveness(proc, UNKNOWN_HOST), None);
        // A pid that is gone, on this host with /proc: dead.
        let gone = Owner {
            pid: u32::MAX - 1,
            ..me
        };
        assert_eq!(gone.liveness(proc, &gone.host), Some(false));
    }

    #[test]
    fn a_huge_ttl_saturates() {
        let labels = run_labels(
            "r",
            Some(&Owner::current()),
            Some(Duration::MAX),
            &BTreeMap::new(),
        );
        assert_eq!(labels[EXPIRES_AT], u64::MAX.to_string());
    }

    #[test]
    fn keys_and_values() {
        for ok in ["a", "app", "sandbox.dev/run-id", "x.y/Z_9", "A-b.c"] {
            validate_key(ok).unwrap();
        }
        for bad in [
            "",
            "-a",
            "a-",
            "a b",
            "a/b/c",
            "/a",
            "A.B/c",
            "a/",
            &"x".repeat(64),
        ] {
            assert!(validate_key(bad).is_err(), "{bad:?} should be rejected");
        }
        validate_value("").unwrap();
        validate_value("v1.2_3").unwrap();
        assert!(validate_value("a b").is_err());
        assert!(validate_value(&"x".repeat(64)).is_err());
        assert_eq!(sanitize_value("my host!.local."), "my-host-.local");
    }

    #[test]
    fn this_process_is_alive_and_a_dead_pid_is_not() {
        let me = Owner::current();
        assert!(me.start > 0);
        assert_eq!(me.is_alive(), Some(true));
        let restarted = Owner {
            start: me.start + 1,
            ..me.clone()
        };
        assert_eq!(restarted.is_alive(), Some(false));
        let elsewhere = Owner {
            host: "another-host-xyz".into(),
            ..me.clone()
        };
        assert_eq!(elsewhere.is_alive(), None);
        let labels = run_labels("sbx-1", Some(&me), None, &BTreeMap::new());
        assert_eq!(Owner::from_labels(&labels), Some(me));
        assert_eq!(labels[MANAGED_BY], MANAGED_BY_VALUE);
    }
}
