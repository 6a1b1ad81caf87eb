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
        if let Some(user) = &self.user {
            validate_user(user)?;
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

    /// Sets the user (`uid[:gid]` or a name, where the driver supports it).
    pub fn user(mut self, user: impl Into<String>) -> Self {
        self.user = Some(user.into());
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
        if let Some(user) = &self.user {
            validate_user(user)?;
        }
        let total: usize = self.env.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
        if total > MAX_ENV_TOTAL {
            return Err(Error::invalid_spec(
                "env",
                format!(
                    "is {total} bytes in all, over {MAX_ENV_TOTAL}: pass large data on stdin or as a file"
                ),
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

/// A URL with everything between the scheme (if any) and the last `@` hidden, whatever
/// the URL's form (`http://u:p@h`, `u:p@h:3128`, a password holding `/` or `@`).
fn redact_url(url: &str) -> String {
    let Some(at) = url.rfind('@') else {
        return url.to_string();
    };
    let start = url.find("://").map_or(0, |i| i + 3);
    if start > at {
        return url.to_string();
    }
    format!("{}***@{}", &url[..start], &url[at + 1..])
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

/// The kernel's limit for one argument or `NAME=value` string, with its NUL
/// (`MAX_ARG_STRLEN`, 128 KiB).
pub const MAX_ARG_STRLEN: usize = 128 << 10;

/// The most the library lets argv, or the environment, weigh in all (1 MiB; the kernel
/// allows a quarter of the stack limit for both together, usually 2 MiB).
pub const MAX_ENV_TOTAL: usize = 1 << 20;

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
    if let Some(i) = argv.iter().position(|a| a.len() + 1 > MAX_ARG_STRLEN) {
        return Err(Error::invalid_spec(
            format!("{field}[{i}]"),
            format!(
                "is {} bytes, over the kernel's {MAX_ARG_STRLEN}-byte limit for one argument: pass large data on stdin or as a file",
                argv[i].len()
            ),
        ));
    }
    let total: usize = argv.iter().map(|a| a.len() + 1).sum();
    if total > MAX_ENV_TOTAL {
        return Err(Error::invalid_spec(
            field,
            format!(
                "is {total} bytes in all, over {MAX_ENV_TOTAL}: pass large data on stdin or as a file"
            ),
        ));
    }
    Ok(())
}

fn validate_user(user: &str) -> Result<()> {
    if user.is_empty() || user.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(Error::invalid_spec(
            "user",
            "must be a non-empty name or uid[:gid] without whitespace or control characters",
        ));
    }
    if user.starts_with('-') || user.matches(':').count() > 1 {
        return Err(Error::invalid_spec(
            "user",
            format!("{user:?} is not a user name or uid[:gid]"),
        ));
    }
    Ok(())
}

/// Checks an image reference against the grammar engines accept
/// (`[host[:port]/]path[:tag][@algorithm:hex]`, path components lowercase), so that a
/// reference no engine can use is an invalid spec naming `image`, not a backend error.
pub fn validate_image(image: &str) -> Result<()> {
    let bad = |why: String| Error::invalid_spec("image", format!("{image:?} {why}"));
    if image.is_empty() {
        return Err(Error::invalid_spec("image", "must not be empty"));
    }
    if image.len() > 4096 || image.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(bad(
            "is not an image reference (whitespace, control characters or too long)".into(),
        ));
    }
    let (rest, digest) = match image.split_once('@') {
        Some((rest, digest)) => (rest, Some(digest)),
        None => (image, None),
    };
    if let Some(digest) = digest {
        let (algorithm, hex) = digest
            .split_once(':')
            .ok_or_else(|| bad("has a digest without algorithm:hex".into()))?;
        let algorithm_ok = !algorithm.is_empty()
            && algorithm.split(['+', '.', '_', '-']).all(|c| {
                c.chars().next().is_some_and(|f| f.is_ascii_alphabetic())
                    && c.chars().all(|x| x.is_ascii_alphanumeric())
            });
        if !algorithm_ok || hex.len() < 32 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
            return Err(bad(format!("has an invalid digest {digest:?}")));
        }
    }
    // A tag is after the last ':' that follows the last '/'.
    let last_slash = rest.rfind('/').map_or(0, |i| i + 1);
    let (name, tag) = match rest[last_slash..].rfind(':') {
        Some(i) => (&rest[..last_slash + i], Some(&rest[last_slash + i + 1..])),
        None => (rest, None),
    };
    if let Some(tag) = tag {
        let ok = !tag.is_empty()
            && tag.len() <= 128
            && tag
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
            && tag
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
        if !ok {
            return Err(bad(format!("has an invalid tag {tag:?}")));
        }
    }
    if name.is_empty() || name.len() > 255 {
        return Err(bad(
            "has no repository name, or one over 255 characters".into()
        ));
    }
    let mut components: Vec<&str> = name.split('/').collect();
    // The first component is a registry host when it looks like one.
    if components.len() > 1 {
        let first = components[0];
        if first.contains(['.', ':'])
            || first == "localhost"
            || first.chars().any(|c| c.is_ascii_uppercase())
        {
            validate_registry_host(first).map_err(bad)?;
            components.remove(0);
        }
    }
    for component in components {
        if !is_path_component(component) {
            return Err(bad(format!(
                "has an invalid repository component {component:?} (lowercase letters, digits and . _ __ - separators)"
            )));
        }
    }
    Ok(())
}

fn validate_registry_host(host: &str) -> std::result::Result<(), String> {
    let (name, port) = if let Some(rest) = host.strip_prefix('[') {
        let (ip, after) = rest
            .split_once(']')
            .ok_or_else(|| format!("has an invalid registry host {host:?}"))?;
        if ip.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(format!("has an invalid registry host {host:?}"));
        }
        (None, after.strip_prefix(':'))
    } else {
        match host.split_once(':') {
            Some((n, p)) => (Some(n), Some(p)),
            None => (Some(host), None),
        }
    };
    if let Some(name) = name {
        let ok = name.split('.').all(|c| {
            !c.is_empty()
                && c.chars().all(|x| x.is_ascii_alphanumeric() || x == '-')
                && !c.starts_with('-')
                && !c.ends_with('-')
        });
        if !ok {
            return Err(format!("has an invalid registry host {host:?}"));
        }
    }
    if let Some(port) = port
        && (port.is_empty() || port.parse::<u16>().is_err())
    {
        return Err(format!("has an invalid registry port in {host:?}"));
    }
    Ok(())
}

/// `[a-z0-9]+` joined by `.`, `_`, `__` or runs of `-`.
fn is_path_component(c: &str) -> bool {
    let bytes = c.as_bytes();
    if bytes.is_empty()
        || !bytes[0].is_ascii_alphanumeric()
        || !bytes[bytes.len() - 1].is_ascii_alphanumeric()
    {
        return false;
    }
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b.is_ascii_lowercase() || b.is_ascii_digit() {
            i += 1;
            continue;
        }
        // A separator: ".", "_", "__" or "-"+, always between alphanumerics.
        let start = i;
        match b {
            b'.' => i += 1,
            b'_' => {
                i += 1;
                if i < bytes.len() && bytes[i] == b'_' {
                    i += 1;
                }
            }
            b'-' => {
                while i < bytes.len() && bytes[i] == b'-' {
                    i += 1;
                }
            }
            _ => return false,
        }
        if i >= bytes.len()
            || !(bytes[i].is_ascii_lowercase() || bytes[i].is_ascii_digit())
            || start == 0
        {
            return false;
        }
    }
    true
}

fn validate_env(field: &str, env: &[(String, String)]) -> Result<()> {
    for (i, (name, value)) in env.iter().enumerate() {
        if name.is_empty() {
            return Err(Error::invalid_spec(
                format!("{field}[{i}].name"),
                "must not be empty",
            ));
        }
        if name.contains('=') || name.chars().any(char::is_control) {
            return Err(Error::invalid_spec(
                format!("{field}[{i}].name"),
                format!("{name:?} must not contain '=', NUL, newlines or other control characters"),
            ));
        }
        if value.contains('\0') {
            // The value is not echoed: it may be a secret.
            return Err(Error::invalid_spec(
                format!("{field}[{i}].value"),
                format!("the value of {name} must not contain NUL"),
            ));
        }
        if name.len() + value.len() + 2 > MAX_ARG_STRLEN {
            return Err(Error::invalid_spec(
                format!("{field}[{i}].value"),
                format!(
                    "{name}={{{} bytes}} is over the kernel's {MAX_ARG_STRLEN}-byte limit for one variable: pass large data as a file or on stdin",
                    value.len()
                ),
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
    if path.chars().any(char::is_control) {
        return Err(Error::invalid_spec(
            field,
            "must not contain NUL, newlines or other control characters",
        ));
    }
    if path.len() >= 4096 {
        return Err(Error::invalid_spec(field, "is longer than PATH_MAX"));
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
    fn image_references_follow_the_engines_grammar() {
        for ok in [
            "busybox",
            "busybox:latest",
            "library/busybox:1.36",
            "sandbox-test/busybox:latest",
            "localhost:5000/team/img:v1",
            "registry.example.com/a/b/c",
            "Registry.Example.com/a",
            "[::1]:5000/img",
            "img@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
            "my_img__x.y-z---w:TAG_1.2-3",
        ] {
            validate_image(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        for bad in [
            "",
            "team/UPPER",
            "Busybox",
            "garbage:::",
            "a b",
            "img:",
            "img:-tag",
            "/img",
            "img/",
            "a//b",
            "-img",
            "img-",
            "img@sha256:short",
            "img@:0123456789abcdef0123456789abcdef",
            "host:99999/img",
            "img\n",
        ] {
            let e = validate_image(bad).expect_err(bad);
            assert_eq!(e.field(), Some("image"), "{bad}");
        }
    }

    #[test]
    fn expired_and_future_cas_are_rejected() {
        for pem in [
            include_str!("../testdata/expired-ca.pem"),
            include_str!("../testdata/not-yet-valid-ca.pem"),
        ] {
            let mut s = RunSpec::new("busybox");
            s.ca_bundle = Some(pem.into());
            assert_eq!(field_of(&s), "ca_bundle");
        }
    }

    #[test]
    fn proxy_credentials_are_hidden_whatever_the_form() {
        for url in [
            "http://user:pa55@proxy:3128",
            "user:pa55@proxy:3128",
            "http://user:pa/55@proxy:3128",
            "http://us@er:pa55@proxy:3128/",
            "socks5h://:pa55@proxy",
        ] {
            let mut spec = RunSpec::new("img");
            spec.proxy.https = Some(url.into());
            let text = format!("{spec:?}");
            assert!(
                !text.contains("pa55") && text.contains("proxy"),
                "{url}: {text}"
            );
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

#[cfg(test)]
mod properties {
    use proptest::prelude::*;

    use super::*;

    fn any_duration() -> impl Strategy<Value = Duration> {
        prop_oneof![
            Just(Duration::MAX),
            Just(Duration::ZERO),
            any::<u64>().prop_map(Duration::from_secs),
            (any::<u64>(), 0u32..1_000_000_000).prop_map(|(s, n)| Duration::new(s, n)),
        ]
    }

    fn text() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<String>(),
            "[ -~]{0,40}",
            Just("-i".to_string()),
            Just("a\nb".to_string()),
            Just("/".to_string()),
            Just("/a/../b".to_string()),
        ]
    }

    prop_compose! {
        fn any_run_spec()(
            image in text(),
            env in proptest::collection::vec((text(), text()), 0..4),
            working_dir in proptest::option::of(text()),
            user in proptest::option::of(text()),
            ws_path in text(),
            ttl in proptest::option::of(any_duration()),
            cpus in proptest::option::of(any::<f64>()),
            memory in proptest::option::of(any::<u64>()),
            pids in proptest::option::of(any::<u32>()),
            proxy in proptest::option::of(text()),
            labels in proptest::collection::btree_map(text(), text(), 0..3),
            post in proptest::collection::vec(proptest::collection::vec(text(), 0..3), 0..2),
            ca in proptest::option::of(text()),
        ) -> RunSpec {
            let mut s = RunSpec::new(image);
            s.env = env;
            s.working_dir = working_dir;
            s.user = user;
            s.workspace.path = ws_path;
            s.ttl = ttl;
            s.resources = Resources { memory_bytes: memory, cpus, pids };
            s.proxy.http = proxy;
            s.labels = labels;
            s.post_create = post;
            s.ca_bundle = ca;
            s
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Validation never panics; what it rejects names a field; and what it accepts
        /// survives the arithmetic drivers do with it.
        #[test]
        fn run_spec_validation_never_panics(spec in any_run_spec()) {
            let _ = format!("{spec:?}");
            match spec.validate() {
                Ok(()) => {
                    let labels = crate::labels::run_labels("sbx-0", &crate::labels::Owner::current(), spec.ttl, &spec.labels);
                    prop_assert!(labels.contains_key(crate::labels::RUN_ID));
                    let _ = spec.run_env();
                }
                Err(e) => prop_assert!(e.field().is_some(), "{e}"),
            }
        }

        #[test]
        fn exec_spec_validation_never_panics(
            argv in proptest::collection::vec(text(), 0..4),
            env in proptest::collection::vec((text(), text()), 0..3),
            dir in proptest::option::of(text()),
            user in proptest::option::of(text()),
            timeout in proptest::option::of(any_duration()),
        ) {
            let spec = ExecSpec { argv, env, working_dir: dir, user, timeout, ..Default::default() };
            let _ = format!("{spec:?}");
            if let Err(e) = spec.validate() {
                prop_assert!(e.field().is_some(), "{e}");
            }
        }
    }

    /// The exec pump with any timeout: no overflow, and a deadline far away is no deadline.
    #[tokio::test(start_paused = true)]
    async fn any_timeout_is_safe_in_the_pump() {
        use futures::StreamExt;
        for timeout in [
            Duration::MAX,
            Duration::from_secs(u64::MAX / 2),
            Duration::new(u64::MAX, 999_999_999),
            Duration::from_nanos(1),
        ] {
            let spec = ExecSpec::new(["x"]).timeout(timeout);
            let stream = crate::ExecStream::spawn(
                &spec,
                futures::stream::empty().boxed(),
                None,
                Box::new(Done),
            );
            let status = stream.wait().await;
            prop_assert_ok(&status);
        }
    }

    fn prop_assert_ok(status: &crate::ExitStatus) {
        assert!(
            matches!(
                status,
                crate::ExitStatus::Exited(0) | crate::ExitStatus::TimedOut
            ),
            "{status}"
        );
    }

    struct Done;

    #[async_trait::async_trait]
    impl crate::ExecControl for Done {
        async fn status(&self) -> crate::Result<crate::ExitStatus> {
            Ok(crate::ExitStatus::Exited(0))
        }
        async fn kill(&self) -> crate::Result<()> {
            Ok(())
        }
    }
}
