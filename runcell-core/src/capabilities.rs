//! What a driver can do. The conformance suite runs only what applies, and
//! [`Capabilities::check`] and [`Capabilities::check_exec`] turn a spec field a driver
//! cannot honour into an [`crate::ErrorKind::Unsupported`] error instead of silently
//! ignoring it.

use serde::Serialize;

use crate::error::{Error, Result};
use crate::spec::{ExecSpec, Network, RunSpec, Stdin};

/// Declares the struct, [`Capabilities::none`] and one setter per field from one list, so
/// that a new capability cannot miss its setter.
macro_rules! capabilities {
    ($($(#[doc = $doc:literal])+ $name:ident,)+) => {
        /// A driver's features, all off by default.
        ///
        /// The struct is `#[non_exhaustive]`, so other crates build it from
        /// [`Capabilities::none`] with one setter per field, named like the field:
        ///
        /// ```
        /// # use runcell_core::Capabilities;
        /// let caps = Capabilities::none().files(true).ttl(true);
        /// assert!(caps.files && caps.ttl && !caps.attach);
        /// ```
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
        #[non_exhaustive]
        pub struct Capabilities {
            $($(#[doc = $doc])+ pub $name: bool,)+
        }

        impl Capabilities {
            /// Every feature off, the same as [`Capabilities::default`].
            pub const fn none() -> Self {
                Capabilities { $($name: false,)+ }
            }

            $(
                #[doc = concat!("Sets `", stringify!($name), "`:")]
                $(#[doc = $doc])+
                pub const fn $name(mut self, on: bool) -> Self {
                    self.$name = on;
                    self
                }
            )+
        }
    };
}

capabilities! {
    /// The workspace host directory is mounted live: writes show on the host at once.
    workspace_mount,
    /// The workspace host directory is copied in at start (when not mounted).
    workspace_seed,
    /// Per-exec user override (`ExecSpec::user`).
    exec_user,
    /// Users given by name (not only numeric `uid[:gid]`), for the run and for execs.
    user_names,
    /// `resources.memory_bytes`.
    memory_limit,
    /// `resources.cpus`.
    cpu_limit,
    /// `resources.pids`.
    pids_limit,
    /// `resources.disk_bytes`: a limit on the sandbox's local disk use, enforced by the
    /// engine (the run ends as `RunLost` when it is exceeded).
    disk_limit,
    /// `network: none`.
    network_none,
    /// `security.read_only_rootfs`.
    read_only_rootfs,
    /// `security.cap_drop`.
    cap_drop,
    /// `security.no_new_privileges`.
    no_new_privileges,
    /// `ttl`, enforced by the backend or by [`crate::reap`].
    ttl,
    /// `put_archive` / `get_archive`.
    files,
    /// `Stdin::Piped`: stdin written while the command runs (bytes and none always work).
    stdin_streaming,
    /// `ExecSpec::tty`: a command on a pseudo-terminal, with resize and terminal signals.
    tty,
    /// Execs that outlive their connection: `ExecSpec::detach`, `Run::execs`,
    /// `Run::reattach` (output from any offset, from any process), `Run::kill_exec`, and
    /// a stream that resumes by itself when the connection breaks (`ExecSpec::grace`).
    durable_execs,
    /// `Driver::attach` to a run by id from another process.
    attach,
    /// The CA bundle is added to the image's system trust store (where it has one).
    system_trust_store,
    /// Warm pools ([`crate::Pool`]): targets created ahead, claimed atomically by any
    /// process, the run's settings applied after the claim. A pooled run's host workspace
    /// is copied in (and, where cold runs mount it, copied back at stop).
    pool,
    /// Filesystem snapshots: `Run::snapshot`, `RunSpec::from_snapshot`, `DriverExt::fork`,
    /// `Driver::snapshots`, `Driver::remove_snapshot`.
    snapshots,
    /// Snapshots of runs that have the exec helper only (the backend reads what the run
    /// changed through it): a driver's [`crate::Driver::capabilities`] then report
    /// `snapshots` unless the helper is off, and a run on the plain exec path refuses a
    /// snapshot (`Unsupported`).
    snapshots_with_helper,
    /// A claim gives the pooled target the run's own labels, owner and TTL. Without it
    /// they stay those of the pool, so a spec whose `labels` or `ttl` differ from the
    /// pool's does not match it.
    pool_relabel,
}

fn unsupported(field: &str, what: &str) -> Result<()> {
    Err(Error::unsupported(
        field,
        format!("this driver does not support {what}"),
    ))
}

impl Capabilities {
    /// Errors with [`crate::ErrorKind::Unsupported`] naming the first field of `spec` this
    /// driver cannot honour.
    ///
    /// Every field a driver may lack is checked: `workspace.host_dir`, `user` (names),
    /// `resources.*`, `network`, `security.*` and `ttl`. The other fields every driver
    /// honours, core doing part of the work (env, proxy, CA files, post-create, labels).
    /// `security.no_new_privileges: false` needs nothing: a driver without the option
    /// leaves privileges alone.
    pub fn check(&self, spec: &RunSpec) -> Result<()> {
        if spec.workspace.host_dir.is_some() && !(self.workspace_mount || self.workspace_seed) {
            return unsupported("workspace.host_dir", "a host workspace directory");
        }
        if let Some(user) = &spec.user {
            self.check_user_name(user)?;
        }
        if spec.from_snapshot.is_some() && !(self.snapshots || self.snapshots_with_helper) {
            return unsupported("from_snapshot", "snapshots");
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
        if spec.resources.disk_bytes.is_some() && !self.disk_limit {
            return unsupported("resources.disk_bytes", "disk limits");
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

    /// Errors with [`crate::ErrorKind::Unsupported`] naming the first field of an exec this
    /// driver cannot honour: `user` (an override without `exec_user`, or a name without
    /// `user_names`) and `stdin` ([`Stdin::Piped`] without `stdin_streaming`). The rest of an exec (argv, env, working
    /// directory, timeout, output limit) every driver honours.
    pub fn check_exec(&self, spec: &ExecSpec) -> Result<()> {
        if let Some(user) = &spec.user {
            if !self.exec_user {
                return unsupported("user", "a per-exec user");
            }
            self.check_user_name(user)?;
        }
        if spec.tty.is_some() && !self.tty {
            return unsupported("tty", "a terminal");
        }
        if spec.detach && !self.durable_execs {
            return unsupported("detach", "commands that outlive their connection");
        }
        if matches!(spec.stdin, Stdin::Piped) && !self.stdin_streaming {
            return unsupported(
                "stdin",
                "stdin written while the command runs (give the bytes up front)",
            );
        }
        Ok(())
    }

    fn check_user_name(&self, user: &str) -> Result<()> {
        if !self.user_names && !is_numeric_user(user) {
            return unsupported("user", "user names (give a numeric uid[:gid])");
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
    use std::time::Duration;

    use super::*;
    use crate::ErrorKind;

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

    #[test]
    fn none_is_the_default_and_setters_set_their_field() {
        const _USABLE_IN_CONSTANTS: Capabilities = Capabilities::none().files(true);
        assert_eq!(Capabilities::none(), Capabilities::default());
        let caps = Capabilities::none()
            .workspace_mount(true)
            .workspace_seed(true)
            .exec_user(true)
            .user_names(true)
            .memory_limit(true)
            .cpu_limit(true)
            .pids_limit(true)
            .disk_limit(true)
            .network_none(true)
            .read_only_rootfs(true)
            .cap_drop(true)
            .no_new_privileges(true)
            .ttl(true)
            .files(true)
            .stdin_streaming(true)
            .tty(true)
            .durable_execs(true)
            .attach(true)
            .system_trust_store(true)
            .pool(true)
            .snapshots(true)
            .snapshots_with_helper(true)
            .pool_relabel(true);
        let text = format!("{caps:?}");
        assert!(
            !text.contains("false"),
            "a setter left its field off: {text}"
        );
        assert!(!caps.ttl(false).ttl);
    }

    /// Each spec field a driver may lack, with the capability that allows it: rejected
    /// naming the field without the capability, accepted with it.
    #[test]
    fn every_optional_run_field_is_checked() {
        let dir = std::env::temp_dir();
        let base = || RunSpec::new("img").no_new_privileges(false);
        let cases: Vec<(RunSpec, &str, Capabilities)> = vec![
            (
                base().workspace_dir(&dir),
                "workspace.host_dir",
                Capabilities::none().workspace_mount(true),
            ),
            (
                base().workspace_dir(&dir),
                "workspace.host_dir",
                Capabilities::none().workspace_seed(true),
            ),
            (
                base().user("nobody"),
                "user",
                Capabilities::none().user_names(true),
            ),
            (
                base().memory_bytes(64 << 20),
                "resources.memory_bytes",
                Capabilities::none().memory_limit(true),
            ),
            (
                base().cpus(0.5),
                "resources.cpus",
                Capabilities::none().cpu_limit(true),
            ),
            (
                base().pids(64),
                "resources.pids",
                Capabilities::none().pids_limit(true),
            ),
            (
                base().disk_bytes(64 << 20),
                "resources.disk_bytes",
                Capabilities::none().disk_limit(true),
            ),
            (
                base().network(Network::None),
                "network",
                Capabilities::none().network_none(true),
            ),
            (
                base().read_only_rootfs(true),
                "security.read_only_rootfs",
                Capabilities::none().read_only_rootfs(true),
            ),
            (
                base().cap_drop("ALL"),
                "security.cap_drop",
                Capabilities::none().cap_drop(true),
            ),
            (
                base().no_new_privileges(true),
                "security.no_new_privileges",
                Capabilities::none().no_new_privileges(true),
            ),
            (
                base().ttl(Duration::from_secs(60)),
                "ttl",
                Capabilities::none().ttl(true),
            ),
        ];
        for (spec, field, enough) in cases {
            let e = Capabilities::none().check(&spec).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
            assert_eq!(e.field(), Some(field), "{e}");
            enough
                .check(&spec)
                .unwrap_or_else(|e| panic!("{field}: {e}"));
        }
    }

    #[test]
    fn exec_user_and_piped_stdin_need_their_capability() {
        let none = Capabilities::none();
        let plain = ExecSpec::new(["true"]).stdin_bytes(&b"data"[..]);
        none.check_exec(&plain).unwrap();

        let numeric = ExecSpec::new(["id"]).user("1000:1000");
        let e = none.check_exec(&numeric).unwrap_err();
        assert_eq!(
            (e.kind(), e.field()),
            (ErrorKind::Unsupported, Some("user"))
        );
        none.exec_user(true).check_exec(&numeric).unwrap();

        let named = ExecSpec::new(["id"]).user("nobody");
        let e = none.exec_user(true).check_exec(&named).unwrap_err();
        assert_eq!(e.field(), Some("user"), "{e}");
        assert!(e.message().contains("user names"), "{e}");
        none.exec_user(true)
            .user_names(true)
            .check_exec(&named)
            .unwrap();
        // A name alone is not enough: the exec needs a per-exec user first.
        let e = none.user_names(true).check_exec(&named).unwrap_err();
        assert!(e.message().contains("per-exec user"), "{e}");

        let piped = ExecSpec::new(["cat"]).stdin_piped();
        let e = none.check_exec(&piped).unwrap_err();
        assert_eq!(
            (e.kind(), e.field()),
            (ErrorKind::Unsupported, Some("stdin"))
        );
        none.stdin_streaming(true).check_exec(&piped).unwrap();
    }
}
