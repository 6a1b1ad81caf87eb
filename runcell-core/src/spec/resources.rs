//! Resource limits, network mode, hardening and pull policy.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// When to pull the image (the closed set Docker and Kubernetes share).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PullPolicy {
    /// Pull every time a run starts.
    Always,
    /// Pull only when the image is not present locally (the default).
    #[default]
    IfNotPresent,
    /// Never pull; a missing image is a [`crate::ErrorKind::NotFound`] error.
    Never,
}

/// The smallest memory limit engines take (Docker's and runc's minimum, 6 MiB).
pub const MIN_MEMORY_BYTES: u64 = 6 << 20;

/// The smallest disk limit taken (below it the sandbox's own files would exceed it).
pub const MIN_DISK_BYTES: u64 = 1 << 20;

/// Resource limits of the sandbox.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Resources {
    /// Memory limit in bytes, at least [`MIN_MEMORY_BYTES`].
    pub memory_bytes: Option<u64>,
    /// CPU limit in cores (e.g. `1.5`).
    pub cpus: Option<f64>,
    /// Maximum number of processes.
    pub pids: Option<u32>,
    /// Limit in bytes on the sandbox's local disk use: its writable root filesystem and a
    /// workspace the driver provides (not a host folder or a volume claim). A run that
    /// writes more is ended by its engine and its execs end as
    /// [`crate::ErrorKind::RunLost`] with the engine's reason (Kubernetes: the
    /// `ephemeral-storage` limit, enforced by the kubelet's eviction). Drivers without
    /// the capability `disk_limit` refuse it.
    pub disk_bytes: Option<u64>,
}

/// The sandbox's network. Other modes belong in a driver's own config, so this set stays
/// closed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Network {
    /// The engine's default network.
    #[default]
    Default,
    /// No network but loopback.
    None,
}

/// Hardening of the sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Security {
    /// Processes cannot gain privileges (setuid, file capabilities). On by default.
    pub no_new_privileges: bool,
    /// Linux capabilities to drop (`ALL`, `NET_RAW`, ...).
    pub cap_drop: Vec<String>,
    /// Mount the root filesystem read-only (the workspace and `/tmp` stay writable).
    pub read_only_rootfs: bool,
}

impl Default for Security {
    fn default() -> Self {
        Security {
            no_new_privileges: true,
            cap_drop: Vec::new(),
            read_only_rootfs: false,
        }
    }
}

impl Resources {
    /// Checks that each limit set is one an engine accepts, naming `resources.cpus`,
    /// `resources.memory_bytes`, `resources.pids` or `resources.disk_bytes`.
    pub(crate) fn validate(&self) -> Result<()> {
        if let Some(cpus) = self.cpus
            && !(cpus.is_finite() && (0.01..=1e6).contains(&cpus))
        {
            return Err(Error::invalid_spec(
                "resources.cpus",
                "must be a number of cores from 0.01",
            ));
        }
        if self.memory_bytes.is_some_and(|m| m > i64::MAX as u64) {
            return Err(Error::invalid_spec(
                "resources.memory_bytes",
                "is too large",
            ));
        }
        if let Some(m) = self.memory_bytes
            && m < MIN_MEMORY_BYTES
        {
            // Docker refuses less at create; Kubernetes creates the pod, then its
            // container fails (CreateContainerError): refused here, before anything exists.
            return Err(Error::invalid_spec(
                "resources.memory_bytes",
                format!(
                    "is {m} bytes; engines refuse a memory limit below {} MiB",
                    MIN_MEMORY_BYTES >> 20
                ),
            ));
        }
        if self.pids == Some(0) {
            return Err(Error::invalid_spec("resources.pids", "must be positive"));
        }
        if let Some(d) = self.disk_bytes
            && !(MIN_DISK_BYTES..=i64::MAX as u64).contains(&d)
        {
            return Err(Error::invalid_spec(
                "resources.disk_bytes",
                format!(
                    "is {d} bytes; must be from {} MiB to {} bytes",
                    MIN_DISK_BYTES >> 20,
                    i64::MAX
                ),
            ));
        }
        Ok(())
    }
}

impl Security {
    /// Checks that each capability to drop is a name, naming `security.cap_drop[i]`.
    pub(crate) fn validate(&self) -> Result<()> {
        for (i, cap) in self.cap_drop.iter().enumerate() {
            if cap.is_empty() || !cap.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return Err(Error::invalid_spec(
                    format!("security.cap_drop[{i}]"),
                    format!("{cap:?} is not a capability name"),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_outside_what_engines_take_name_their_field() {
        let field = |r: Resources| r.validate().unwrap_err().field().unwrap().to_string();
        for cpus in [0.0, 1e-12, -1.0, f64::NAN, f64::INFINITY, 2e6] {
            let r = Resources {
                cpus: Some(cpus),
                ..Resources::default()
            };
            assert_eq!(field(r), "resources.cpus", "{cpus}");
        }
        for memory in [0, 1, (6 << 20) - 1, u64::MAX] {
            let r = Resources {
                memory_bytes: Some(memory),
                ..Resources::default()
            };
            assert_eq!(field(r), "resources.memory_bytes", "{memory}");
        }
        let r = Resources {
            pids: Some(0),
            ..Resources::default()
        };
        assert_eq!(field(r), "resources.pids");
        for disk in [0, 1, (1 << 20) - 1, u64::MAX] {
            let r = Resources {
                disk_bytes: Some(disk),
                ..Resources::default()
            };
            assert_eq!(field(r), "resources.disk_bytes", "{disk}");
        }
        Resources::default().validate().unwrap();
        Resources {
            memory_bytes: Some(64 << 20),
            cpus: Some(0.5),
            pids: Some(1),
            disk_bytes: Some(1 << 20),
        }
        .validate()
        .unwrap();
    }

    #[test]
    fn capability_names_are_checked() {
        let mut s = Security {
            cap_drop: vec!["ALL".into(), "NET_RAW".into()],
            ..Security::default()
        };
        s.validate().unwrap();
        s.cap_drop.push("cap net".into());
        let e = s.validate().unwrap_err();
        assert_eq!(e.field(), Some("security.cap_drop[2]"));
        s.cap_drop = vec![String::new()];
        assert_eq!(
            s.validate().unwrap_err().field(),
            Some("security.cap_drop[0]")
        );
    }
}
