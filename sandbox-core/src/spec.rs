//! What a run and an exec are made of, and their validation.
//!
//! Specs are plain data with public fields and builder-style helpers. Validation runs
//! before a driver creates anything; each failure is an [`ErrorKind::InvalidSpec`]
//! error naming the field.
//!
//! [`ErrorKind::InvalidSpec`]: crate::ErrorKind::InvalidSpec

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The default path of the workspace inside the sandbox.
pub const DEFAULT_WORKSPACE_PATH: &str = "/workspace";

/// When to pull the image.
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

/// The run's working tree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Workspace {
    /// A host directory whose content the run sees at [`Workspace::path`]. Docker mounts it;
    /// drivers that cannot mount seed from it (see [`crate::Capabilities`]). `None`: an empty
    /// workspace that lives as long as the run.
    pub host_dir: Option<PathBuf>,
    /// Absolute path inside the sandbox.
    pub path: String,
}

impl Default for Workspace {
    fn default() -> Self {
        Workspace {
            host_dir: None,
            path: DEFAULT_WORKSPACE_PATH.to_string(),
        }
    }
}

/// Outbound HTTP proxy settings, injected in both upper and lower case. `Debug` hides
/// credentials in the URLs.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Proxy {
    /// `HTTP_PROXY` / `http_proxy`.
    pub http: Option<String>,
    /// `HTTPS_PROXY` / `https_proxy`.
    pub https: Option<String>,
    /// Hosts that bypass the proxy; `localhost,127.0.0.1,::1` are always added.
    pub no_proxy: Vec<String>,
}

impl Proxy {
    /// The hosts always present in `no_proxy`.
    pub const ALWAYS_NO_PROXY: [&'static str; 3] = ["localhost", "127.0.0.1", "::1"];

    /// True when no proxy is configured at all.
    pub fn is_empty(&self) -> bool {
        self.http.is_none() && self.https.is_none() && self.no_proxy.is_empty()
    }

    /// The environment this proxy adds to the run, in both cases, `no_proxy` always
    /// including loopback. Empty when no proxy is set.
    pub fn env(&self) -> Vec<(String, String)> {
        if self.is_empty() {
            return Vec::new();
        }
        let mut env = Vec::new();
        let mut both = |name: &str, value: &str| {
            env.push((name.to_ascii_uppercase(), value.to_string()));
            env.push((name.to_string(), value.to_string()));
        };
        if let Some(v) = &self.http {
            both("http_proxy", v);
        }
        if let Some(v) = &self.https {
            both("https_proxy", v);
        }
        let mut hosts: Vec<&str> = Vec::new();
        for h in self
            .no_proxy
            .iter()
            .map(String::as_str)
            .chain(Self::ALWAYS_NO_PROXY)
        {
            if !h.is_empty() && !hosts.contains(&h) {
                hosts.push(h);
            }
        }
        both("no_proxy", &hosts.join(","));
        env
    }
}

/// Resource limits of the sandbox.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Resources {
    /// Memory limit in bytes.
    pub memory_bytes: Option<u64>,
    /// CPU limit in cores (e.g. `1.5`).
    pub cpus: Option<f64>,
    /// Maximum number of processes.
    pub pids: Option<u32>,
}

/// The sandbox's network.
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

/// Everything a run is created from. `Debug` shows env names but not their values, and
/// hides proxy credentials.
#[derive(Clone, Default, PartialEq, Serialize, Deserialize)]
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
}

impl RunSpec {
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
        if self.image.trim().is_empty() {
            return Err(Error::invalid_spec("image", "must not be empty"));
        }
        if self.image.chars().any(|c| c.is_whitespace() || c == '\0') {
            return Err(Error::invalid_spec(
                "image",
                "must not contain whitespace or NUL",
            ));
        }
        validate_abs_path("workspace.path", &self.workspace.path)?;
        let ws = self.workspace.path.trim_end_matches('/');
        if ws.is_empty()
            || self
                .workspace
                .path
                .split('/')
                .any(|c| c == ".." || c == ".")
        {
            return Err(Error::invalid_spec(
                "workspace.path",
                "must be a directory below / without . or .. components",
            ));
        }
        for reserved in ["/tmp", crate::ca::DIR, "/proc", "/sys", "/dev"] {
            if ws == reserved || ws.starts_with(&format!("{reserved}/")) {
                return Err(Error::invalid_spec(
                    "workspace.path",
                    format!("{reserved} is used by the sandbox itself"),
                ));
            }
        }
        if let Some(dir) = &self.workspace.host_dir {
            if !dir.is_absolute() {
                return Err(Error::invalid_spec(
                    "workspace.host_dir",
                    format!("must be an absolute path, got {}", dir.display()),
                ));
            }
            if !dir.is_dir() {
                return Err(Error::invalid_spec(
                    "workspace.host_dir",
                    format!("{} is not an existing directory", dir.display()),
                ));
            }
        }
        validate_env("env", &self.env)?;
        for (name, value) in [
            ("proxy.http", &self.proxy.http),
            ("proxy.https", &self.proxy.https),
        ] {
            if let Some(v) = value {
                validate_value(name, v)?;
            }
        }
        for (i, h) in self.proxy.no_proxy.iter().enumerate() {
            if h.contains(',') || h.contains('\0') {
                return Err(Error::invalid_spec(
                    format!("proxy.no_proxy[{i}]"),
                    "must be one host without ',' or NUL",
                ));
            }
        }
        if let Some(pem) = &self.ca_bundle {
            crate::ca::parse_certificates(pem)?;
        }
        for (i, argv) in self.post_create.iter().enumerate() {
            validate_argv(&format!("post_create[{i}]"), argv)?;
        }
        if let Some(dir) = &self.working_dir {
            validate_abs_path("working_dir", dir)?;
        }
        if let Some(user) = &self.user
            && (user.is_empty() || user.contains('\0') || user.chars().any(char::is_whitespace))
        {
            return Err(Error::invalid_spec(
                "user",
                "must be a non-empty name or uid[:gid] without whitespace",
            ));
        }
        for (k, v) in &self.labels {
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
        if let Some(cpus) = self.resources.cpus
            && !(cpus.is_finite() && (0.01..=1e6).contains(&cpus))
        {
            return Err(Error::invalid_spec(
                "resources.cpus",
                "must be a number of cores from 0.01",
            ));
        }
        if self
            .resources
            .memory_bytes
            .is_some_and(|m| m > i64::MAX as u64)
        {
            return Err(Error::invalid_spec(
                "resources.memory_bytes",
                "is too large",
            ));
        }
        if self.resources.memory_bytes == Some(0) {
            return Err(Error::invalid_spec(
                "resources.memory_bytes",
                "must be positive",
            ));
        }
        if self.resources.pids == Some(0) {
            return Err(Error::invalid_spec("resources.pids", "must be positive"));
        }
        for (i, cap) in self.security.cap_drop.iter().enumerate() {
            if cap.is_empty() || !cap.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return Err(Error::invalid_spec(
                    format!("security.cap_drop[{i}]"),
                    format!("{cap:?} is not a capability name"),
                ));
            }
        }
        if self.ttl == Some(Duration::ZERO) {
            return Err(Error::invalid_spec("ttl", "must be positive"));
        }
        Ok(())
    }
}

/// What the exec'd process reads on stdin. `Debug` shows sizes, not bytes.
#[derive(Clone, Default)]
pub enum Stdin {
    /// Nothing: stdin is closed at once (EOF).
    #[default]
    Null,
    /// These bytes, then EOF.
    Bytes(Bytes),
    /// A writer handed out by [`crate::ExecStream::take_stdin`]; EOF when it is closed or dropped.
    Piped,
}

/// One command to run inside a run. `Debug` shows env names but not their values.
#[derive(Clone, Default)]
pub struct ExecSpec {
    /// The program and its arguments. Never passed through a shell.
    pub argv: Vec<String>,
    /// Extra environment; wins over the run's environment.
    pub env: Vec<(String, String)>,
    /// Overrides the run's working directory.
    pub working_dir: Option<String>,
    /// Overrides the run's user, where the driver supports it.
    pub user: Option<String>,
    /// What the process reads on stdin.
    pub stdin: Stdin,
    /// Past this, the whole process tree of the exec is killed (TERM, then KILL) and the
    /// status is [`crate::ExitStatus::TimedOut`].
    pub timeout: Option<Duration>,
    /// Per-stream cap of a buffered exec's output, in bytes (default 16 MiB).
    pub output_limit: Option<usize>,
}

impl ExecSpec {
    /// An exec of `argv`.
    pub fn new<I, S>(argv: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        ExecSpec {
            argv: argv.into_iter().map(Into::into).collect(),
            ..Default::default()
        }
    }

    /// Adds an environment variable.
    pub fn env(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((name.into(), value.into()));
        self
    }

    /// Sets the working directory.
    pub fn working_dir(mut self, dir: impl Into<String>) -> Self {
        self.working_dir = Some(dir.into());
        self
    }

    /// Feeds these bytes on stdin, then EOF.
    pub fn stdin_bytes(mut self, bytes: impl Into<Bytes>) -> Self {
        self.stdin = Stdin::Bytes(bytes.into());
        self
    }

    /// Hands out a stdin writer on the stream.
    pub fn stdin_piped(mut self) -> Self {
        self.stdin = Stdin::Piped;
        self
    }

    /// Sets the timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Sets the per-stream output cap of buffered execs.
    pub fn output_limit(mut self, bytes: usize) -> Self {
        self.output_limit = Some(bytes);
        self
    }

    /// Checks every field; the first problem is returned naming its field.
    pub fn validate(&self) -> Result<()> {
        validate_argv("argv", &self.argv)?;
        validate_env("env", &self.env)?;
        if let Some(dir) = &self.working_dir {
            validate_abs_path("working_dir", dir)?;
        }
        if let Some(user) = &self.user
            && (user.is_empty() || user.contains('\0'))
        {
            return Err(Error::invalid_spec(
                "user",
                "must be non-empty, without NUL",
            ));
        }
        if self.timeout == Some(Duration::ZERO) {
            return Err(Error::invalid_spec("timeout", "must be positive"));
        }
        Ok(())
    }
}

/// Env for `Debug`: names only, values may be secrets.
struct EnvNames<'a>(&'a [(String, String)]);

impl fmt::Debug for EnvNames<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|(k, _)| format!("{k}=***")))
            .finish()
    }
}

/// A URL with any `user:password@` replaced.
fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}***@{}", &url[..scheme + 3], &url[at + 1..])
        }
        _ => url.to_string(),
    }
}

impl fmt::Debug for Proxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Proxy")
            .field("http", &self.http.as_deref().map(redact_url))
            .field("https", &self.https.as_deref().map(redact_url))
            .field("no_proxy", &self.no_proxy)
            .finish()
    }
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
            .finish()
    }
}

impl fmt::Debug for Stdin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Stdin::Null => f.write_str("Null"),
            Stdin::Bytes(b) => write!(f, "Bytes(<{} bytes>)", b.len()),
            Stdin::Piped => f.write_str("Piped"),
        }
    }
}

impl fmt::Debug for ExecSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecSpec")
            .field("argv", &self.argv)
            .field("env", &EnvNames(&self.env))
            .field("working_dir", &self.working_dir)
            .field("user", &self.user)
            .field("stdin", &self.stdin)
            .field("timeout", &self.timeout)
            .field("output_limit", &self.output_limit)
            .finish()
    }
}

fn validate_argv(field: &str, argv: &[String]) -> Result<()> {
    if argv.is_empty() || argv[0].is_empty() {
        return Err(Error::invalid_spec(field, "must name a program"));
    }
    if let Some(i) = argv.iter().position(|a| a.contains('\0')) {
        return Err(Error::invalid_spec(
            format!("{field}[{i}]"),
            "must not contain NUL",
        ));
    }
    Ok(())
}

fn validate_env(field: &str, env: &[(String, String)]) -> Result<()> {
    for (i, (name, value)) in env.iter().enumerate() {
        if name.is_empty() {
            return Err(Error::invalid_spec(
                format!("{field}[{i}].name"),
                "must not be empty",
            ));
        }
        if name.contains('=') || name.contains('\0') {
            return Err(Error::invalid_spec(
                format!("{field}[{i}].name"),
                format!("{name:?} must not contain '=' or NUL"),
            ));
        }
        if value.contains('\0') {
            // The value is not echoed: it may be a secret.
            return Err(Error::invalid_spec(
                format!("{field}[{i}].value"),
                format!("the value of {name} must not contain NUL"),
            ));
        }
    }
    Ok(())
}

fn validate_value(field: &str, value: &str) -> Result<()> {
    if value.contains('\0') {
        return Err(Error::invalid_spec(field, "must not contain NUL"));
    }
    Ok(())
}

fn validate_abs_path(field: &str, path: &str) -> Result<()> {
    if !path.starts_with('/') {
        return Err(Error::invalid_spec(
            field,
            format!("{path:?} must be an absolute path"),
        ));
    }
    if path.contains('\0') {
        return Err(Error::invalid_spec(field, "must not contain NUL"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    fn field_of(spec: &RunSpec) -> String {
        let e = spec.validate().expect_err("spec should be rejected");
        assert_eq!(e.kind(), ErrorKind::InvalidSpec, "{e}");
        e.field().unwrap().to_string()
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
    fn exec_spec_validation() {
        let e = ExecSpec::new(Vec::<String>::new()).validate().unwrap_err();
        assert_eq!(e.field(), Some("argv"));
        let e = ExecSpec::new(["echo", "a\0"]).validate().unwrap_err();
        assert_eq!(e.field(), Some("argv[1]"));
        let e = ExecSpec::new(["true"])
            .working_dir("tmp")
            .validate()
            .unwrap_err();
        assert_eq!(e.field(), Some("working_dir"));
        let e = ExecSpec::new(["true"]).env("=", "").validate().unwrap_err();
        assert_eq!(e.field(), Some("env[0].name"));
        ExecSpec::new(["true"]).validate().unwrap();
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

    #[test]
    fn proxy_env_sets_both_cases_and_loopback() {
        let p = Proxy {
            http: Some("http://proxy:3128".into()),
            https: None,
            no_proxy: vec!["internal".into(), "localhost".into()],
        };
        let env = p.env();
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("HTTP_PROXY"), Some("http://proxy:3128"));
        assert_eq!(get("http_proxy"), Some("http://proxy:3128"));
        assert_eq!(get("HTTPS_PROXY"), None);
        assert_eq!(get("no_proxy"), Some("internal,localhost,127.0.0.1,::1"));
        assert_eq!(get("NO_PROXY"), get("no_proxy"));
        assert!(Proxy::default().env().is_empty());
    }
}
