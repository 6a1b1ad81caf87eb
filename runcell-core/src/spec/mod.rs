//! What a run and an exec are made of, and their validation.
//!
//! Specs are plain data with public fields and builder-style helpers. Validation runs
//! before a driver creates anything; each failure is an [`ErrorKind::InvalidSpec`]
//! error naming the field. [`RunSpec::validate`] checks its own fields and asks each
//! part to check itself: the [`Workspace`], the [`Proxy`], the [`Resources`] and the
//! [`Security`] options; the shared string checks and size limits live in `env`, the
//! image reference grammar in `image`.
//!
//! [`ErrorKind::InvalidSpec`]: crate::ErrorKind::InvalidSpec

mod env;
mod exec;
mod helper_mode;
mod image;
mod proxy;
mod resources;
mod workspace;

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use env::{EnvNames, MAX_ENV_TOTAL, validate_abs_path, validate_argv, validate_env, validate_user};

pub use exec::{
    DEFAULT_GRACE, DEFAULT_OUTPUT_BUFFER, ExecSpec, MAX_GRACE, MAX_OUTPUT_BUFFER,
    MIN_OUTPUT_BUFFER, Stdin, TerminalSize,
};
pub use helper_mode::{EXEC_HELPER_ENV, ExecHelper};
pub use image::{could_be_id_prefix, qualified_name, validate_image};
pub use proxy::Proxy;
pub use resources::{MIN_DISK_BYTES, MIN_MEMORY_BYTES, Network, PullPolicy, Resources, Security};
pub use workspace::{DEFAULT_WORKSPACE_PATH, Workspace};

/// Everything a run is created from. `Debug` shows env names but not their values, and
/// hides proxy credentials.
#[derive(Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RunSpec {
    /// The image reference. Its ENTRYPOINT and CMD are never run.
    pub image: String,
    /// When to pull [`RunSpec::image`].
    pub pull: PullPolicy,
    /// The working tree mounted (or seeded) into the run.
    pub workspace: Workspace,
    /// Environment of every exec, in order (later entries win).
    pub env: Vec<(String, String)>,
    /// Outbound proxy.
    pub proxy: Proxy,
    /// Extra CA certificates (PEM) to trust inside the run.
    pub ca_bundle: Option<String>,
    /// Commands (argv, no shell) run once, in order, before the run is handed out.
    pub post_create: Vec<Vec<String>>,
    /// Working directory of every exec; `None` means the workspace path.
    pub working_dir: Option<String>,
    /// User of every exec (`uid`, `uid:gid`, or a name where the driver allows).
    pub user: Option<String>,
    /// Labels put on the backend objects, next to the library's own.
    pub labels: BTreeMap<String, String>,
    /// Resource limits.
    pub resources: Resources,
    /// Network mode.
    pub network: Network,
    /// Hardening options.
    pub security: Security,
    /// Maximum lifetime of the run; past it, the backend or the next reap removes it.
    pub ttl: Option<Duration>,
    /// Whether execs go through the in-sandbox helper (default: where it can run).
    pub exec_helper: ExecHelper,
    /// The snapshot this run starts from ([`RunSpec::from_snapshot`]): its filesystem and
    /// workspace are the snapshot's; everything else comes from this spec.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from_snapshot: Option<String>,
}

impl RunSpec {
    /// A spec for a run whose filesystem and workspace are `snapshot`'s (its image, by
    /// ID, never pulled; the workspace at the snapshot's path). Env, proxy, CA, user,
    /// limits and the rest come from the spec as built on from here, never from the run
    /// the snapshot was taken of. A host workspace directory is refused with it.
    pub fn from_snapshot(snapshot: &crate::Snapshot) -> Self {
        let mut spec = RunSpec::new(snapshot.image.clone()).pull(PullPolicy::Never);
        spec.workspace.path = snapshot.workspace_path.clone();
        spec.from_snapshot = Some(snapshot.id.clone());
        spec
    }

    /// A spec with `image` and every other field at its default.
    pub fn new(image: impl Into<String>) -> Self {
        RunSpec {
            image: image.into(),
            ..Default::default()
        }
    }

    /// Mounts (or seeds) `host_dir` as the workspace.
    pub fn workspace_dir(mut self, host_dir: impl Into<PathBuf>) -> Self {
        self.workspace.host_dir = Some(host_dir.into());
        self
    }

    /// Adds an environment variable.
    pub fn env(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((name.into(), value.into()));
        self
    }

    /// Sets the pull policy.
    pub fn pull(mut self, policy: PullPolicy) -> Self {
        self.pull = policy;
        self
    }

    /// Sets the workspace path inside the sandbox (default `/workspace`).
    pub fn workspace_path(mut self, path: impl Into<String>) -> Self {
        self.workspace.path = path.into();
        self
    }

    /// Sets the outbound proxy.
    pub fn proxy(mut self, proxy: Proxy) -> Self {
        self.proxy = proxy;
        self
    }

    /// Trusts these extra CA certificates (PEM) inside the run.
    pub fn ca_bundle(mut self, pem: impl Into<String>) -> Self {
        self.ca_bundle = Some(pem.into());
        self
    }

    /// Sets the working directory of every exec.
    pub fn working_dir(mut self, dir: impl Into<String>) -> Self {
        self.working_dir = Some(dir.into());
        self
    }

    /// Sets the user of every exec.
    pub fn user(mut self, user: impl Into<String>) -> Self {
        self.user = Some(user.into());
        self
    }

    /// Sets the memory limit in bytes.
    pub fn memory_bytes(mut self, bytes: u64) -> Self {
        self.resources.memory_bytes = Some(bytes);
        self
    }

    /// Sets the CPU limit in cores.
    pub fn cpus(mut self, cpus: f64) -> Self {
        self.resources.cpus = Some(cpus);
        self
    }

    /// Sets the maximum number of processes.
    pub fn pids(mut self, pids: u32) -> Self {
        self.resources.pids = Some(pids);
        self
    }

    /// Sets the limit on local disk use in bytes (see [`Resources::disk_bytes`]).
    pub fn disk_bytes(mut self, bytes: u64) -> Self {
        self.resources.disk_bytes = Some(bytes);
        self
    }

    /// Sets the network mode.
    pub fn network(mut self, network: Network) -> Self {
        self.network = network;
        self
    }

    /// Sets the hardening options.
    pub fn security(mut self, security: Security) -> Self {
        self.security = security;
        self
    }

    /// Drops a Linux capability (`ALL`, `NET_RAW`, ...).
    pub fn cap_drop(mut self, capability: impl Into<String>) -> Self {
        self.security.cap_drop.push(capability.into());
        self
    }

    /// Mounts the root filesystem read-only.
    pub fn read_only_rootfs(mut self, on: bool) -> Self {
        self.security.read_only_rootfs = on;
        self
    }

    /// Sets `no_new_privileges` (on by default).
    pub fn no_new_privileges(mut self, on: bool) -> Self {
        self.security.no_new_privileges = on;
        self
    }

    /// Sets the maximum lifetime of the run.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// Chooses the exec path: the in-sandbox helper where it can run (default), always,
    /// or never.
    pub fn exec_helper(mut self, mode: ExecHelper) -> Self {
        self.exec_helper = mode;
        self
    }

    /// Adds a label.
    pub fn label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    /// Adds a post-create command.
    pub fn post_create<I, S>(mut self, argv: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.post_create
            .push(argv.into_iter().map(Into::into).collect());
        self
    }

    /// The run's environment as drivers set it on the target: proxy (both cases), the CA
    /// variables when a CA bundle is given, then [`RunSpec::env`]; a later entry replaces an
    /// earlier one of the same name, so the caller's own values win.
    pub fn run_env(&self) -> Vec<(String, String)> {
        let mut env: Vec<(String, String)> = self.proxy.env();
        if self.ca_bundle.is_some() {
            env.extend(crate::ca::env());
        }
        env.extend(self.env.iter().cloned());
        let mut merged: Vec<(String, String)> = Vec::with_capacity(env.len());
        for (k, v) in env {
            match merged.iter_mut().find(|(name, _)| *name == k) {
                Some(slot) => slot.1 = v,
                None => merged.push((k, v)),
            }
        }
        merged
    }

    /// The effective working directory of execs.
    pub fn effective_working_dir(&self) -> &str {
        self.working_dir.as_deref().unwrap_or(&self.workspace.path)
    }

    /// Checks every field; the first problem is returned naming its field.
    pub fn validate(&self) -> Result<()> {
        validate_image(&self.image)?;
        self.workspace.validate()?;
        validate_env("env", &self.env)?;
        let total: usize = self
            .run_env()
            .iter()
            .map(|(k, v)| k.len() + v.len() + 2)
            .sum();
        if total > MAX_ENV_TOTAL {
            return Err(Error::invalid_spec(
                "env",
                format!(
                    "the run's environment (with proxy and CA variables) is {total} bytes, more than {MAX_ENV_TOTAL}: pass large data as a file"
                ),
            ));
        }
        self.proxy.validate()?;
        if let Some(pem) = &self.ca_bundle {
            crate::ca::parse_certificates(pem)?;
        }
        for (i, argv) in self.post_create.iter().enumerate() {
            validate_argv(&format!("post_create[{i}]"), argv)?;
        }
        if let Some(dir) = &self.working_dir {
            validate_abs_path("working_dir", dir)?;
        }
        if let Some(user) = &self.user {
            validate_user(user)?;
        }
        validate_labels(&self.labels)?;
        if let Some(id) = &self.from_snapshot {
            crate::snapshot::check_snapshot_id(id).map_err(|e| e.with_field("from_snapshot"))?;
            if self.workspace.host_dir.is_some() {
                return Err(Error::invalid_spec(
                    "workspace.host_dir",
                    "a run from a snapshot has the snapshot's workspace: give no host directory",
                ));
            }
            if self.pull != PullPolicy::Never {
                return Err(Error::invalid_spec(
                    "pull",
                    "a snapshot's image is never pulled (RunSpec::from_snapshot sets Never)",
                ));
            }
        }
        self.resources.validate()?;
        self.security.validate()?;
        if self.ttl == Some(Duration::ZERO) {
            return Err(Error::invalid_spec("ttl", "must be positive"));
        }
        Ok(())
    }
}

/// The caller's labels: valid as label keys and values, none under the library's prefix.
fn validate_labels(labels: &BTreeMap<String, String>) -> Result<()> {
    for (k, v) in labels {
        crate::labels::validate_key(k)
            .map_err(|m| Error::invalid_spec(format!("labels[{k:?}]"), m))?;
        crate::labels::validate_value(v)
            .map_err(|m| Error::invalid_spec(format!("labels[{k:?}]"), m))?;
        if k.starts_with(crate::labels::PREFIX) {
            return Err(Error::invalid_spec(
                format!("labels[{k:?}]"),
                format!(
                    "the prefix {} is reserved for the library",
                    crate::labels::PREFIX
                ),
            ));
        }
    }
    Ok(())
}

impl fmt::Debug for RunSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RunSpec")
            .field("image", &self.image)
            .field("pull", &self.pull)
            .field("workspace", &self.workspace)
            .field("env", &EnvNames(&self.env))
            .field("proxy", &self.proxy)
            .field(
                "ca_bundle",
                &self
                    .ca_bundle
                    .as_ref()
                    .map(|p| format!("<{} bytes of PEM>", p.len())),
            )
            .field("post_create", &self.post_create)
            .field("working_dir", &self.working_dir)
            .field("user", &self.user)
            .field("labels", &self.labels)
            .field("resources", &self.resources)
            .field("network", &self.network)
            .field("security", &self.security)
            .field("ttl", &self.ttl)
            .field("exec_helper", &self.exec_helper)
            .field("from_snapshot", &self.from_snapshot)
            .finish()
    }
}

/// The registry host of an image reference, as Docker and the kubelet resolve it: the first path
/// component when it looks like a host (has `.` or `:`, or is `localhost`), else
/// `docker.io`.
pub fn registry_of(image: &str) -> String {
    match image.split_once('/') {
        Some((first, _)) if first.contains('.') || first.contains(':') || first == "localhost" => {
            normalize_registry(first)
        }
        _ => "docker.io".to_string(),
    }
}

/// A registry as written in a config (`https://index.docker.io/v1/`, `http://h:5000`,
/// `h:5000`) reduced to the host Docker compares: scheme and path dropped, Docker Hub's
/// aliases made `docker.io`.
pub fn normalize_registry(server: &str) -> String {
    let rest = server
        .strip_prefix("https://")
        .or_else(|| server.strip_prefix("http://"))
        .unwrap_or(server);
    let host = rest.split('/').next().unwrap_or(rest).to_ascii_lowercase();
    match host.as_str() {
        "index.docker.io" | "registry-1.docker.io" | "registry.hub.docker.com" => {
            "docker.io".to_string()
        }
        _ => host,
    }
}

#[cfg(test)]
mod tests {
    use super::env::MAX_ARG_STRLEN;
    use super::*;
    use crate::ErrorKind;

    fn field_of(spec: &RunSpec) -> String {
        let e = spec.validate().expect_err("spec should be rejected");
        assert_eq!(e.kind(), ErrorKind::InvalidSpec, "{e}");
        e.field().unwrap().to_string()
    }

    #[test]
    fn spec_files_may_omit_fields_but_not_misspell_them() {
        let spec: RunSpec =
            serde_json::from_str(r#"{"image": "busybox", "resources": {"cpus": 0.5}}"#).unwrap();
        assert_eq!(spec.resources.cpus, Some(0.5));
        assert_eq!(spec.workspace.path, DEFAULT_WORKSPACE_PATH);
        assert!(spec.security.no_new_privileges);
        for bad in [
            r#"{"image": "busybox", "cpu": 1}"#,
            r#"{"image": "busybox", "resources": {"cpu": 1}}"#,
            r#"{"image": "busybox", "security": {"readonly": true}}"#,
            r#"{"image": "busybox", "proxy": {"http_proxy": "x"}}"#,
            r#"{"image": "busybox", "workspace": {"dir": "/x"}}"#,
        ] {
            assert!(serde_json::from_str::<RunSpec>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn default_spec_with_image_is_valid() {
        RunSpec::new("busybox").validate().unwrap();
    }
    #[test]
    fn each_bad_field_is_named() {
        let base = RunSpec::new("busybox");
        assert_eq!(field_of(&RunSpec::new("")), "image");
        assert_eq!(field_of(&base.clone().env("", "x")), "env[0].name");
        assert_eq!(
            field_of(&base.clone().env("A", "1").env("B=C", "x")),
            "env[1].name"
        );
        assert_eq!(field_of(&base.clone().env("A\0", "x")), "env[0].name");
        assert_eq!(field_of(&base.clone().env("A", "x\0y")), "env[0].value");
        assert_eq!(
            field_of(&base.clone().post_create(Vec::<String>::new())),
            "post_create[0]"
        );
        assert_eq!(
            field_of(&base.clone().post_create(["sh", "a\0b"])),
            "post_create[0][1]"
        );
        let mut s = base.clone();
        s.working_dir = Some("relative".into());
        assert_eq!(field_of(&s), "working_dir");
        let mut s = base.clone();
        s.workspace.path = "ws".into();
        assert_eq!(field_of(&s), "workspace.path");
        let mut s = base.clone();
        s.workspace.host_dir = Some("rel/dir".into());
        assert_eq!(field_of(&s), "workspace.host_dir");
        assert_eq!(
            field_of(&base.clone().label("bad key", "v")),
            "labels[\"bad key\"]"
        );
        assert_eq!(
            field_of(&base.clone().label("a/b/c", "v")),
            "labels[\"a/b/c\"]"
        );
        assert_eq!(
            field_of(&base.clone().label("ok", "bad value!")),
            "labels[\"ok\"]"
        );
        assert_eq!(
            field_of(&base.clone().label("sandbox.dev/run-id", "x")),
            "labels[\"sandbox.dev/run-id\"]"
        );
        let mut s = base.clone();
        s.ca_bundle = Some("not a pem".into());
        assert_eq!(field_of(&s), "ca_bundle");
        let mut s = base.clone();
        s.resources.cpus = Some(0.0);
        assert_eq!(field_of(&s), "resources.cpus");
        s.resources.cpus = Some(1e-12);
        assert_eq!(field_of(&s), "resources.cpus");
        for bad in ["/", "/tmp", "/etc/sandbox", "/a/../b", "/proc/x"] {
            let mut s = base.clone();
            s.workspace.path = bad.into();
            assert_eq!(field_of(&s), "workspace.path", "{bad}");
        }
    }

    #[test]
    fn what_engines_and_the_kernel_refuse_is_rejected_first() {
        let base = RunSpec::new("busybox");
        // Env names with control characters, values over the kernel's per-string limit.
        assert_eq!(field_of(&base.clone().env("A\nB", "x")), "env[0].name");
        assert_eq!(field_of(&base.clone().env("A\tB", "x")), "env[0].name");
        assert_eq!(
            field_of(&base.clone().env("BIG", "x".repeat(MAX_ARG_STRLEN))),
            "env[0].value"
        );
        RunSpec::new("busybox")
            .env("OK", "x".repeat(MAX_ARG_STRLEN - 10))
            .validate()
            .unwrap();
        let mut many = base.clone();
        for i in 0..10 {
            many = many.env(format!("V{i}"), "x".repeat(120 << 10));
        }
        assert_eq!(field_of(&many), "env");
        // Odd but valid names pass: they are the caller's business.
        base.clone()
            .env("-i", "1")
            .env("my.var", "2")
            .validate()
            .unwrap();
        // Exec specs follow the same rules.
        let e = ExecSpec::new(["true"])
            .env("A\nB", "x")
            .validate()
            .unwrap_err();
        assert_eq!(e.field(), Some("env[0].name"));
        let e = ExecSpec::new(["echo", &"x".repeat(MAX_ARG_STRLEN)])
            .validate()
            .unwrap_err();
        assert_eq!(e.field(), Some("argv[1]"));
        let e = ExecSpec::new(["true"])
            .working_dir("/a\nb")
            .validate()
            .unwrap_err();
        assert_eq!(e.field(), Some("working_dir"));
        let e = ExecSpec::new(["true"]).user("a b").validate().unwrap_err();
        assert_eq!(e.field(), Some("user"));
    }

    #[test]
    fn expired_and_future_cas_are_rejected() {
        for pem in [
            include_str!("../../testdata/expired-ca.pem"),
            include_str!("../../testdata/not-yet-valid-ca.pem"),
        ] {
            let mut s = RunSpec::new("busybox");
            s.ca_bundle = Some(pem.into());
            assert_eq!(field_of(&s), "ca_bundle");
        }
    }

    #[test]
    fn debug_hides_env_values_stdin_and_proxy_credentials() {
        let mut spec = RunSpec::new("img").env("TOKEN", "s3cr3t");
        spec.proxy.http = Some("http://user:pa55@proxy:3128".into());
        let text = format!("{spec:?}");
        assert!(
            text.contains("TOKEN=***") && text.contains("http://***@proxy:3128"),
            "{text}"
        );
        assert!(!text.contains("s3cr3t") && !text.contains("pa55"), "{text}");
        let exec = ExecSpec::new(["x"])
            .env("K", "hidden")
            .stdin_bytes(&b"hidden"[..]);
        let text = format!("{exec:?}");
        assert!(
            !text.contains("hidden") && text.contains("<6 bytes>"),
            "{text}"
        );
    }

    #[test]
    fn secret_values_are_not_echoed() {
        let e = RunSpec::new("x")
            .env("TOKEN", "s3cr3t\0")
            .validate()
            .unwrap_err();
        assert!(!e.to_string().contains("s3cr3t"), "{e}");
    }

    #[test]
    fn caller_env_wins_over_injected_and_is_deduplicated() {
        let mut spec = RunSpec::new("x")
            .env("SSL_CERT_FILE", "/mine.pem")
            .env("A", "1")
            .env("A", "2");
        spec.ca_bundle = Some("pem".into());
        let env = spec.run_env();
        assert_eq!(env.iter().filter(|(k, _)| k == "SSL_CERT_FILE").count(), 1);
        assert!(env.contains(&("SSL_CERT_FILE".into(), "/mine.pem".into())));
        assert!(env.contains(&("A".into(), "2".into())));
        assert!(env.contains(&("NODE_EXTRA_CA_CERTS".into(), crate::ca::CA_FILE.into())));
    }
}

#[cfg(test)]
mod properties;
