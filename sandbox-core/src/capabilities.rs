//! What a driver can do. The conformance suite runs only what applies, and
//! [`Capabilities::check`] turns a spec field a driver cannot honour into an
//! [`crate::ErrorKind::Unsupported`] error instead of silently ignoring it.

use serde::Serialize;

use crate::error::{Error, Result};
use crate::spec::{Network, RunSpec};

/// A driver's features, all off by default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Capabilities {
    /// The workspace host directory is mounted live: writes show on the host at once.
    pub workspace_mount: bool,
    /// The workspace host directory is copied in at start (when not mounted).
    pub workspace_seed: bool,
    /// Per-exec user override.
    pub exec_user: bool,
    /// Users given by name (not only numeric `uid[:gid]`).
    pub user_names: bool,
    /// `resources.memory_bytes`.
    pub memory_limit: bool,
    /// `resources.cpus`.
    pub cpu_limit: bool,
    /// `resources.pids`.
    pub pids_limit: bool,
    /// `network: none`.
    pub network_none: bool,
    /// `security.read_only_rootfs`.
    pub read_only_rootfs: bool,
    /// `security.cap_drop`.
    pub cap_drop: bool,
    /// `security.no_new_privileges`.
    pub no_new_privileges: bool,
    /// `ttl`, enforced by the backend or by [`crate::reap`].
    pub ttl: bool,
    /// `put_archive` / `get_archive`.
    pub files: bool,
    /// `Stdin::Piped`: stdin written while the command runs (bytes and none always work).
    pub stdin_streaming: bool,
    /// `Driver::attach` to a run by id from another process.
    pub attach: bool,
    /// The CA bundle is added to the image's system trust store (where it has one).
    pub system_trust_store: bool,
}

impl Capabilities {
    /// Errors with [`crate::ErrorKind::Unsupported`] naming the first field of `spec` this
    /// driver cannot honour.
    pub fn check(&self, spec: &RunSpec) -> Result<()> {
        let unsupported = |field: &str, what: &str| {
            Err(Error::unsupported(
                field,
                format!("this driver does not support {what}"),
            ))
        };
        if spec.workspace.host_dir.is_some() && !(self.workspace_mount || self.workspace_seed) {
            return unsupported("workspace.host_dir", "a host workspace directory");
        }
        if let Some(user) = &spec.user
            && !self.user_names
            && !is_numeric_user(user)
        {
            return unsupported("user", "user names (give a numeric uid[:gid])");
        }
        if spec.resources.memory_bytes.is_some() && !self.memory_limit {
            return unsupported("resources.memory_bytes", "memory limits");
        }
        if spec.resources.cpus.is_some() && !self.cpu_limit {
            return unsupported("resources.cpus", "cpu limits");
        }
        if spec.resources.pids.is_some() && !self.pids_limit {
            return unsupported("resources.pids", "pids limits");
        }
        if spec.network == Network::None && !self.network_none {
            return unsupported("network", "network none");
        }
        if spec.security.read_only_rootfs && !self.read_only_rootfs {
            return unsupported("security.read_only_rootfs", "a read-only root filesystem");
        }
        if !spec.security.cap_drop.is_empty() && !self.cap_drop {
            return unsupported("security.cap_drop", "dropping capabilities");
        }
        if spec.security.no_new_privileges && !self.no_new_privileges {
            return unsupported("security.no_new_privileges", "no-new-privileges");
        }
        if spec.ttl.is_some() && !self.ttl {
            return unsupported("ttl", "a maximum lifetime");
        }
        Ok(())
    }
}

/// True for `uid` or `uid:gid` with numeric parts.
pub fn is_numeric_user(user: &str) -> bool {
    let numeric = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_digit());
    match user.split_once(':') {
        Some((u, g)) => numeric(u) && numeric(g),
        None => numeric(user),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsupported_fields_are_named() {
        let none = Capabilities::default();
        let mut spec = RunSpec::new("img");
        spec.security.no_new_privileges = false;
        none.check(&spec).unwrap();
        spec.user = Some("1000:1000".into());
        none.check(&spec).unwrap();
        spec.user = Some("nobody".into());
        assert_eq!(none.check(&spec).unwrap_err().field(), Some("user"));
        spec.user = None;
        spec.network = Network::None;
        assert_eq!(none.check(&spec).unwrap_err().field(), Some("network"));
        let caps = Capabilities {
            network_none: true,
            ..none
        };
        caps.check(&spec).unwrap();
    }
}
