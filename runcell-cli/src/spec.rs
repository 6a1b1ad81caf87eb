//! The run spec: from a spec file (`--spec`, YAML/TOML/JSON) and the spec flags.
//!
//! A spec file holds a `RunSpec` as the library serializes it (so a `RunSpec` written with
//! serde reads back), with friendlier forms allowed where people write by hand: env as a
//! map, `post_create` entries as one shell-like string, sizes like `512m`, durations like
//! `1h`, `ca_file` next to `ca_bundle`. Unknown fields are errors, and every error names
//! its field and line.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;
use runcell_core::{Network, PullPolicy, RunSpec};
use serde::Deserialize;
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};

use crate::doc::{self, Format, Node};
use crate::errors::Failure;
use crate::units;

/// The spec flags of `start` and `run`. A flag wins over the same field of `--spec`;
/// `--env`, `--label`, `--post-create` and `--cap-drop` add to the file's.
#[derive(Args, Debug, Default, Clone)]
pub struct SpecArgs {
    /// A spec file (.yaml, .yml, .toml or .json) holding a RunSpec; flags override it.
    #[arg(long, value_name = "FILE", conflicts_with = "devcontainer")]
    pub spec: Option<PathBuf>,
    /// A devcontainer.json, or a folder with `.devcontainer/devcontainer.json`, as the base
    /// spec (image, env, lifecycle commands, user, workspace); flags override it.
    #[arg(long, value_name = "PATH")]
    pub devcontainer: Option<PathBuf>,
    /// Let the devcontainer.json's `workspaceMount` bind a host folder outside its project
    /// (the folder and its git repository); refused without this.
    #[arg(long, requires = "devcontainer")]
    pub allow_mounts_outside_project: bool,
    /// The image; its ENTRYPOINT and CMD never run.
    #[arg(long)]
    pub image: Option<String>,
    /// Start from a snapshot (`sandbox snapshot`): its filesystem and workspace; the rest
    /// (env, proxy, CA, user, limits, ...) from this command line and --spec.
    #[arg(long, value_name = "SNAPSHOT", conflicts_with_all = ["image", "pull", "workspace", "workspace_path"])]
    pub from_snapshot: Option<String>,
    /// When to pull the image.
    #[arg(long, value_name = "POLICY", value_parser = ["always", "if-not-present", "never"])]
    pub pull: Option<String>,
    /// A host directory seen at the workspace path (mounted by Docker, copied in on Kubernetes).
    #[arg(long, value_name = "DIR")]
    pub workspace: Option<PathBuf>,
    /// The workspace path inside the sandbox [default: /workspace].
    #[arg(long, value_name = "PATH")]
    pub workspace_path: Option<String>,
    /// Environment of every exec: NAME=VALUE, or NAME to pass this shell's value (keeps it
    /// off the command line). Repeatable.
    #[arg(short, long = "env", value_name = "NAME[=VALUE]")]
    pub env: Vec<String>,
    /// Outbound proxy URL for both HTTP_PROXY and HTTPS_PROXY.
    #[arg(long, value_name = "URL")]
    pub proxy: Option<String>,
    /// Outbound proxy for HTTP_PROXY only.
    #[arg(long, value_name = "URL")]
    pub http_proxy: Option<String>,
    /// Outbound proxy for HTTPS_PROXY only.
    #[arg(long, value_name = "URL")]
    pub https_proxy: Option<String>,
    /// Hosts that bypass the proxy, comma-separated (loopback is always added).
    #[arg(long, value_name = "HOSTS")]
    pub no_proxy: Option<String>,
    /// A PEM file of extra CA certificates to trust inside the run.
    #[arg(long, value_name = "FILE")]
    pub ca_file: Option<PathBuf>,
    /// A command run once before the run is handed out. Split like a shell would
    /// (quotes, backslashes) but never run by one: 'sh -c "make deps"' for shell syntax.
    /// Repeatable, run in order.
    #[arg(long, value_name = "COMMAND")]
    pub post_create: Vec<String>,
    /// Working directory of every exec [default: the workspace path].
    #[arg(short = 'w', long, value_name = "DIR")]
    pub workdir: Option<String>,
    /// User of every exec: uid, uid:gid, or a name where the driver allows.
    #[arg(short, long)]
    pub user: Option<String>,
    /// Memory limit: bytes, or with k, m, g (powers of 1024): 512m.
    #[arg(long, value_name = "SIZE")]
    pub memory: Option<String>,
    /// CPU limit in cores: 1.5.
    #[arg(long)]
    pub cpus: Option<f64>,
    /// Maximum number of processes.
    #[arg(long)]
    pub pids: Option<u32>,
    /// Limit on local disk use (root filesystem and the driver's workspace): bytes, or
    /// with k, m, g: 1g. Where the driver has it (Kubernetes' ephemeral-storage).
    #[arg(long, value_name = "SIZE")]
    pub disk: Option<String>,
    /// Network mode.
    #[arg(long, value_parser = ["default", "none"])]
    pub network: Option<String>,
    /// A label on the run: KEY=VALUE. Repeatable.
    #[arg(short, long = "label", value_name = "KEY=VALUE")]
    pub label: Vec<String>,
    /// Maximum lifetime, after which `sandbox gc` (or the backend) removes the run:
    /// 90, 30s, 10m, 2h, 1d; `none` for no limit. `start` defaults to 24h.
    #[arg(long, value_name = "DURATION")]
    pub ttl: Option<String>,
    /// A Linux capability to drop (ALL, NET_RAW, ...). Repeatable.
    #[arg(long, value_name = "CAP")]
    pub cap_drop: Vec<String>,
    /// Mount the root filesystem read-only (the workspace and /tmp stay writable).
    #[arg(long)]
    pub read_only: bool,
}

/// A spec file read into a tree, kept to place errors found later at their line.
pub struct SpecSource {
    pub path: PathBuf,
    pub root: Node,
}

impl SpecSource {
    /// `FILE:LINE` of a field the file sets, if it sets it.
    pub fn locate(&self, field: &str) -> Option<String> {
        let line = doc::line_of(&self.root, field).or_else(|| {
            // The file may give the CA as `ca_file`.
            field
                .strip_prefix("ca_bundle")
                .and_then(|_| doc::line_of(&self.root, "ca_file"))
        })?;
        Some(format!("{}:{line}", self.path.display()))
    }
}

/// The spec from the flags (and the file they name), with where the file's fields are.
pub fn build(
    args: &SpecArgs,
    default_ttl: Option<Duration>,
) -> Result<(RunSpec, Option<SpecSource>), Failure> {
    let (mut spec, source) = match (&args.spec, &args.devcontainer) {
        (Some(path), _) => {
            let (spec, source) = read_file(path)?;
            (spec, Some(source))
        }
        (None, Some(path)) => (
            runcell_devcontainer::load_with(path, |cx| {
                cx.allow_mounts_outside_project(args.allow_mounts_outside_project)
            })?,
            None,
        ),
        (None, None) => (RunSpec::default(), None),
    };
    let ttl_from_file = spec.ttl.is_some();
    apply_flags(&mut spec, args)?;
    if spec.image.is_empty() && args.from_snapshot.is_none() {
        return Err(Failure::usage(
            "no image: give --image IMAGE (or `image` in the --spec file)",
        ));
    }
    if args.ttl.is_none() && !ttl_from_file && spec.ttl.is_none() {
        spec.ttl = default_ttl;
    }
    Ok((spec, source))
}

/// Reads a spec file: parse errors, unknown fields, wrong types and every value the
/// library rejects are reported with the file, the line and the field.
pub fn read_file(path: &Path) -> Result<(RunSpec, SpecSource), Failure> {
    let format = Format::of(path).map_err(Failure::usage)?;
    let text = doc::read(path).map_err(Failure::usage)?;
    let root = doc::parse(&text, format).map_err(|e| {
        Failure::usage(match e.line {
            Some(line) => format!("{}:{line}: {}", path.display(), e.message),
            None => format!("{}: {}", path.display(), e.message),
        })
    })?;
    let file: SpecFile = doc::from_node(&root).map_err(|e| {
        let at = match e.line {
            Some(line) => format!("{}:{line}", path.display()),
            None => path.display().to_string(),
        };
        let field = e.path();
        Failure::usage(if field.is_empty() {
            format!("{at}: invalid spec: {e}")
        } else {
            format!("{at}: invalid spec ({field}): {e}")
        })
    })?;
    let source = SpecSource {
        path: path.to_path_buf(),
        root,
    };
    let base = path.parent().unwrap_or(Path::new("."));
    let spec = file.into_spec(base).map_err(|(field, message)| {
        let error = runcell_core::Error::invalid_spec(field, message);
        Failure::spec(error, &source)
    })?;
    // What the library will reject, found now, at its line in the file. A missing image
    // may come from --image: check the rest with a stand-in.
    let mut check = spec.clone();
    if check.image.is_empty() {
        check.image = "image".into();
    }
    check
        .validate()
        .map_err(|error| Failure::spec(error, &source))?;
    Ok((spec, source))
}

/// A CA file, refused unread when larger than a CA bundle may be.
fn read_ca_file(path: &Path) -> Result<String, String> {
    doc::read_at_most(
        path,
        runcell_core::ca::MAX_CA_BUNDLE_BYTES as u64,
        "the most a CA bundle may be",
    )
}

fn apply_flags(spec: &mut RunSpec, a: &SpecArgs) -> Result<(), Failure> {
    if let Some(image) = &a.image {
        spec.image = image.clone();
    }
    if let Some(pull) = &a.pull {
        spec.pull = match pull.as_str() {
            "always" => PullPolicy::Always,
            "never" => PullPolicy::Never,
            _ => PullPolicy::IfNotPresent,
        };
    }
    if let Some(dir) = &a.workspace {
        spec.workspace.host_dir = Some(absolute(dir)?);
    }
    if let Some(path) = &a.workspace_path {
        spec.workspace.path = path.clone();
    }
    for e in &a.env {
        spec.env.push(env_pair(e)?);
    }
    if let Some(p) = &a.proxy {
        spec.proxy.http = Some(p.clone());
        spec.proxy.https = Some(p.clone());
    }
    if let Some(p) = &a.http_proxy {
        spec.proxy.http = Some(p.clone());
    }
    if let Some(p) = &a.https_proxy {
        spec.proxy.https = Some(p.clone());
    }
    if let Some(hosts) = &a.no_proxy {
        spec.proxy.no_proxy = split_hosts(hosts);
    }
    if let Some(file) = &a.ca_file {
        spec.ca_bundle =
            Some(read_ca_file(file).map_err(|e| Failure::usage(format!("--ca-file {e}")))?);
    }
    for cmd in &a.post_create {
        spec.post_create.push(
            split_command(cmd)
                .map_err(|e| Failure::usage(format!("--post-create {cmd:?}: {e}")))?,
        );
    }
    if let Some(dir) = &a.workdir {
        spec.working_dir = Some(dir.clone());
    }
    if let Some(user) = &a.user {
        spec.user = Some(user.clone());
    }
    if let Some(m) = &a.memory {
        spec.resources.memory_bytes =
            Some(units::parse_size(m).map_err(|e| Failure::usage(format!("--memory: {e}")))?);
    }
    if let Some(c) = a.cpus {
        spec.resources.cpus = Some(c);
    }
    if let Some(p) = a.pids {
        spec.resources.pids = Some(p);
    }
    if let Some(d) = &a.disk {
        spec.resources.disk_bytes =
            Some(units::parse_size(d).map_err(|e| Failure::usage(format!("--disk: {e}")))?);
    }
    if let Some(n) = &a.network {
        spec.network = if n == "none" {
            Network::None
        } else {
            Network::Default
        };
    }
    for l in &a.label {
        let (k, v) = key_value(l).map_err(|e| Failure::usage(format!("--label: {e}")))?;
        spec.labels.insert(k, v);
    }
    if let Some(ttl) = &a.ttl {
        spec.ttl = parse_ttl(ttl).map_err(|e| Failure::usage(format!("--ttl: {e}")))?;
    }
    spec.security.cap_drop.extend(a.cap_drop.iter().cloned());
    if a.read_only {
        spec.security.read_only_rootfs = true;
    }
    Ok(())
}

/// `none` (no limit) or a positive duration.
pub fn parse_ttl(text: &str) -> Result<Option<Duration>, String> {
    if text.eq_ignore_ascii_case("none") {
        return Ok(None);
    }
    units::parse_duration(text).map(Some)
}

fn absolute(dir: &Path) -> Result<PathBuf, Failure> {
    std::path::absolute(dir)
        .map_err(|e| Failure::usage(format!("--workspace {}: {e}", dir.display())))
}

/// `NAME=VALUE`, or `NAME` for this process's value of NAME.
pub fn env_pair(text: &str) -> Result<(String, String), Failure> {
    match text.split_once('=') {
        Some((k, v)) => Ok((k.to_string(), v.to_string())),
        None => match std::env::var(text) {
            Ok(v) => Ok((text.to_string(), v)),
            Err(_) => Err(Failure::usage(format!(
                "--env {text}: give NAME=VALUE, or NAME of a variable set here (it is not)"
            ))),
        },
    }
}

/// `KEY=VALUE`.
pub fn key_value(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("{text:?}: expected KEY=VALUE")),
    }
}

/// Splits a command like a POSIX shell splits words (quotes and backslashes), without
/// running a shell: no variables, globs, pipes or `;`.
pub fn split_command(cmd: &str) -> Result<Vec<String>, String> {
    let argv = shell_words::split(cmd).map_err(|e| format!("cannot split into words: {e}"))?;
    if argv.is_empty() {
        return Err("is empty".into());
    }
    Ok(argv)
}

fn split_hosts(hosts: &str) -> Vec<String> {
    hosts
        .split(',')
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .map(str::to_string)
        .collect()
}

// ---------------------------------------------------------------------------------------
// The file's shape: RunSpec's own fields, every one optional, nothing else.

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct SpecFile {
    image: Option<String>,
    pull: Option<PullPolicy>,
    workspace: WorkspaceFile,
    env: EnvList,
    proxy: ProxyFile,
    ca_bundle: Option<String>,
    /// Not a RunSpec field: a PEM file, relative to the spec file.
    ca_file: Option<PathBuf>,
    post_create: Vec<Argv>,
    working_dir: Option<String>,
    user: Option<String>,
    labels: BTreeMap<String, String>,
    resources: ResourcesFile,
    network: Option<Network>,
    security: SecurityFile,
    ttl: Option<Ttl>,
    exec_helper: Option<runcell_core::ExecHelper>,
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct WorkspaceFile {
    host_dir: Option<PathBuf>,
    path: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct ProxyFile {
    http: Option<String>,
    https: Option<String>,
    no_proxy: Hosts,
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct ResourcesFile {
    memory_bytes: Option<Size>,
    cpus: Option<f64>,
    pids: Option<u32>,
    disk_bytes: Option<Size>,
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct SecurityFile {
    no_new_privileges: Option<bool>,
    cap_drop: Vec<String>,
    read_only_rootfs: Option<bool>,
}

impl SpecFile {
    /// The RunSpec; an error names the field.
    fn into_spec(self, base: &Path) -> Result<RunSpec, (String, String)> {
        let mut spec = RunSpec::default();
        if let Some(image) = self.image {
            spec.image = image;
        }
        if let Some(pull) = self.pull {
            spec.pull = pull;
        }
        if let Some(dir) = self.workspace.host_dir {
            // Relative to the spec file, as a person reading the file would expect.
            spec.workspace.host_dir = Some(if dir.is_absolute() {
                dir
            } else {
                std::path::absolute(base.join(&dir)).unwrap_or(dir)
            });
        }
        if let Some(path) = self.workspace.path {
            spec.workspace.path = path;
        }
        spec.env = self.env.0;
        spec.proxy.http = self.proxy.http;
        spec.proxy.https = self.proxy.https;
        spec.proxy.no_proxy = self.proxy.no_proxy.0;
        match (self.ca_bundle, self.ca_file) {
            (Some(_), Some(_)) => {
                return Err((
                    "ca_file".into(),
                    "give ca_bundle (PEM text) or ca_file (a path), not both".into(),
                ));
            }
            (Some(pem), None) => spec.ca_bundle = Some(pem),
            (None, Some(file)) => {
                let file = base.join(file);
                spec.ca_bundle = Some(read_ca_file(&file).map_err(|e| ("ca_file".to_string(), e))?);
            }
            (None, None) => {}
        }
        spec.post_create = self.post_create.into_iter().map(|a| a.0).collect();
        spec.working_dir = self.working_dir;
        spec.user = self.user;
        spec.labels = self.labels;
        spec.resources.memory_bytes = self.resources.memory_bytes.map(|s| s.0);
        spec.resources.cpus = self.resources.cpus;
        spec.resources.pids = self.resources.pids;
        spec.resources.disk_bytes = self.resources.disk_bytes.map(|s| s.0);
        if let Some(network) = self.network {
            spec.network = network;
        }
        if let Some(on) = self.security.no_new_privileges {
            spec.security.no_new_privileges = on;
        }
        spec.security.cap_drop = self.security.cap_drop;
        if let Some(on) = self.security.read_only_rootfs {
            spec.security.read_only_rootfs = on;
        }
        spec.ttl = self.ttl.map(|t| t.0);
        if let Some(mode) = self.exec_helper {
            spec.exec_helper = mode;
        }
        Ok(spec)
    }
}

/// Env as a map (`NAME: value`), a list of `[name, value]` pairs (RunSpec's own form) or a
/// list of `NAME=value` strings.
#[derive(Default)]
struct EnvList(Vec<(String, String)>);

impl<'de> Deserialize<'de> for EnvList {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = EnvList;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map of NAME: value, or a list of [NAME, value] or \"NAME=value\"")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<EnvList, A::Error> {
                let mut out = Vec::new();
                while let Some((k, ScalarText(v))) = map.next_entry::<String, ScalarText>()? {
                    out.push((k, v));
                }
                Ok(EnvList(out))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<EnvList, A::Error> {
                let mut out = Vec::new();
                while let Some(EnvItem(k, v)) = seq.next_element()? {
                    out.push((k, v));
                }
                Ok(EnvList(out))
            }
        }
        d.deserialize_any(V)
    }
}

/// An env value in a map: a string, or a number or boolean taken as written (`PORT:
/// 8080`, as in Compose files). The one field that takes a scalar's text.
struct ScalarText(String);

impl<'de> Deserialize<'de> for ScalarText {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ScalarText;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, number or boolean")
            }
            fn visit_newtype_struct<D: Deserializer<'de>>(
                self,
                d: D,
            ) -> Result<ScalarText, D::Error> {
                String::deserialize(d).map(ScalarText)
            }
        }
        d.deserialize_newtype_struct(doc::SCALAR_TEXT, V)
    }
}

struct EnvItem(String, String);

impl<'de> Deserialize<'de> for EnvItem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = EnvItem;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("[NAME, value] or \"NAME=value\"")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<EnvItem, E> {
                match s.split_once('=') {
                    Some((k, v)) => Ok(EnvItem(k.into(), v.into())),
                    None => Err(E::custom(format!("{s:?}: expected NAME=value"))),
                }
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<EnvItem, A::Error> {
                let k: String = seq
                    .next_element()?
                    .ok_or_else(|| de::Error::custom("expected [NAME, value]"))?;
                let v: String = seq
                    .next_element()?
                    .ok_or_else(|| de::Error::custom("expected [NAME, value]"))?;
                if seq.next_element::<de::IgnoredAny>()?.is_some() {
                    return Err(de::Error::custom("expected [NAME, value], found more"));
                }
                Ok(EnvItem(k, v))
            }
        }
        d.deserialize_any(V)
    }
}

/// A command: a list of arguments, or one string split like a shell splits words.
struct Argv(Vec<String>);

impl<'de> Deserialize<'de> for Argv {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Argv;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list of arguments, or a command line as one string")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Argv, E> {
                split_command(s).map(Argv).map_err(E::custom)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Argv, A::Error> {
                let mut out = Vec::new();
                while let Some(s) = seq.next_element::<String>()? {
                    out.push(s);
                }
                Ok(Argv(out))
            }
        }
        d.deserialize_any(V)
    }
}

/// `no_proxy`: a list, or one comma-separated string.
#[derive(Default)]
struct Hosts(Vec<String>);

impl<'de> Deserialize<'de> for Hosts {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Hosts;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list of hosts, or hosts separated by commas")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Hosts, E> {
                Ok(Hosts(split_hosts(s)))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Hosts, A::Error> {
                let mut out = Vec::new();
                while let Some(s) = seq.next_element::<String>()? {
                    out.push(s);
                }
                Ok(Hosts(out))
            }
        }
        d.deserialize_any(V)
    }
}

/// Bytes: a number, or a size like `512m`.
struct Size(u64);

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Size;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a number of bytes, or a size like 512m")
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<Size, E> {
                Ok(Size(n))
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<Size, E> {
                u64::try_from(n)
                    .map(Size)
                    .map_err(|_| E::custom("must not be negative"))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Size, E> {
                units::parse_size(s).map(Size).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// A TTL: seconds, a duration like `2h`, or `{secs, nanos}` (RunSpec's own form).
struct Ttl(Duration);

impl<'de> Deserialize<'de> for Ttl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Ttl;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("seconds, a duration like 2h, or {secs, nanos}")
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<Ttl, E> {
                Ok(Ttl(Duration::from_secs(n)))
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<Ttl, E> {
                u64::try_from(n)
                    .map(|n| Ttl(Duration::from_secs(n)))
                    .map_err(|_| E::custom("must not be negative"))
            }
            fn visit_f64<E: de::Error>(self, n: f64) -> Result<Ttl, E> {
                Duration::try_from_secs_f64(n)
                    .map(Ttl)
                    .map_err(|e| E::custom(e.to_string()))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Ttl, E> {
                units::parse_duration(s).map(Ttl).map_err(E::custom)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Ttl, A::Error> {
                Duration::deserialize(de::value::MapAccessDeserializer::new(map)).map(Ttl)
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(name: &str, text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    fn error_of(name: &str, text: &str) -> String {
        let (_dir, path) = write(name, text);
        match read_file(&path) {
            Ok(_) => panic!("{name} should be rejected"),
            Err(f) => f.to_string().replace(&path.display().to_string(), name),
        }
    }

    #[test]
    fn a_serialized_run_spec_reads_back_from_json_toml_and_yaml() {
        let ws = tempfile::tempdir().unwrap();
        let mut spec = RunSpec::new("busybox:1")
            .workspace_dir(ws.path())
            .env("A", "1")
            .env("B", "two words")
            .post_create(["sh", "-c", "echo hi"])
            .label("app", "x")
            .memory_bytes(64 << 20)
            .cpus(1.5)
            .pids(100)
            .disk_bytes(1 << 30)
            .network(Network::None)
            .cap_drop("ALL")
            .read_only_rootfs(true)
            .ttl(Duration::from_secs(3600))
            .pull(PullPolicy::Never)
            .working_dir("/workspace/sub")
            .user("1000:1000")
            .exec_helper(runcell_core::ExecHelper::Off);
        spec.proxy.http = Some("http://proxy:3128".into());
        spec.proxy.no_proxy = vec!["internal".into()];
        let json = serde_json::to_string_pretty(&spec).unwrap();
        let toml = toml::to_string(&spec).unwrap();
        for (name, text) in [("s.json", &json), ("s.yaml", &json), ("s.toml", &toml)] {
            let (_dir, path) = write(name, text);
            let (back, _) = read_file(&path).unwrap_or_else(|e| panic!("{name}: {e}\n{text}"));
            assert_eq!(back, spec, "{name}");
        }
    }

    #[test]
    fn hand_written_forms() {
        let (dir, path) = write(
            "s.yaml",
            "image: busybox\nenv:\n  PORT: 8080\n  DEBUG: true\npost_create:\n  - sh -c 'echo \"a b\" > x'\n  - [touch, y]\nresources:\n  memory_bytes: 512m\n  disk_bytes: 2g\nttl: 2h\nproxy:\n  no_proxy: a, b\nworkspace:\n  host_dir: .\n",
        );
        let (spec, _) = read_file(&path).unwrap();
        assert_eq!(
            spec.env,
            vec![
                ("PORT".into(), "8080".into()),
                ("DEBUG".into(), "true".into())
            ]
        );
        assert_eq!(spec.post_create[0], ["sh", "-c", "echo \"a b\" > x"]);
        assert_eq!(spec.post_create[1], ["touch", "y"]);
        assert_eq!(spec.resources.memory_bytes, Some(512 << 20));
        assert_eq!(spec.resources.disk_bytes, Some(2 << 30));
        assert_eq!(spec.ttl, Some(Duration::from_secs(7200)));
        assert_eq!(spec.proxy.no_proxy, ["a", "b"]);
        assert_eq!(
            spec.workspace
                .host_dir
                .as_deref()
                .map(|p| p.canonicalize().unwrap()),
            Some(dir.path().canonicalize().unwrap())
        );
    }

    #[test]
    fn errors_name_the_field_and_the_line() {
        let e = error_of("s.yaml", "image: busybox\nimgae: x\n");
        assert!(
            e.starts_with("s.yaml:2: invalid spec: unknown field `imgae`"),
            "{e}"
        );
        let e = error_of("s.yaml", "image: busybox\nresources:\n  cpus: 0\n");
        assert_eq!(
            e,
            "s.yaml:3: invalid spec (resources.cpus): must be a number of cores from 0.01"
        );
        let e = error_of("s.yaml", "image: busybox\nresources:\n  pids: many\n");
        assert!(
            e.starts_with("s.yaml:3: invalid spec (resources.pids): "),
            "{e}"
        );
        let e = error_of("s.yaml", "image: busybox\nenv:\n  A: 1\n  B=C: 2\n");
        assert!(
            e.starts_with("s.yaml:4: invalid spec (env[1].name): "),
            "{e}"
        );
        let e = error_of(
            "s.toml",
            "image = \"busybox\"\n\n[security]\nread_only = true\n",
        );
        assert!(
            e.starts_with("s.toml:4: invalid spec (security): unknown field `read_only`"),
            "{e}"
        );
        let e = error_of(
            "s.json",
            "{\n  \"image\": \"busybox\",\n  \"ttl\": \"soon\"\n}\n",
        );
        assert!(e.starts_with("s.json:3: invalid spec (ttl): "), "{e}");
        let e = error_of(
            "s.json",
            "{\n  \"image\": \"busybox\",\n  \"labels\": {\"bad key\": \"x\"}\n}\n",
        );
        assert!(
            e.starts_with("s.json:3: invalid spec (labels[\"bad key\"]): "),
            "{e}"
        );
        let e = error_of("s.yaml", "image: busybox\nworking_dir: relative\n");
        assert!(
            e.starts_with("s.yaml:2: invalid spec (working_dir): "),
            "{e}"
        );
        let e = error_of("s.yaml", "image: [busybox\n");
        assert!(e.starts_with("s.yaml:"), "{e}");
        let e = error_of("s.txt", "image: busybox\n");
        assert!(e.contains("unknown format"), "{e}");
    }

    #[test]
    fn a_field_of_the_wrong_type_is_an_error_in_every_format() {
        // `image = 5` once started the local image whose ID begins with 5.
        for (name, text, line, field, found) in [
            ("s.toml", "image = 5\n", 1, "image", "an integer"),
            (
                "s.yaml",
                "pull: never\nimage: 5\n",
                2,
                "image",
                "an integer",
            ),
            ("s.json", "{\n  \"image\": 5\n}\n", 2, "image", "an integer"),
            ("s.yaml", "image: x\nuser: 1000\n", 2, "user", "an integer"),
            (
                "s.toml",
                "image = \"x\"\nworking_dir = true\n",
                2,
                "working_dir",
                "a boolean",
            ),
            (
                "s.yaml",
                "image: x\nlabels:\n  app: 1.5\n",
                3,
                "labels.app",
                "a number",
            ),
            (
                "s.json",
                "{\"image\": \"x\",\n \"post_create\": [[\"touch\", 1]]}",
                2,
                "post_create[0][1]",
                "an integer",
            ),
            (
                "s.yaml",
                "image: x\nproxy:\n  http: 80\n",
                3,
                "proxy.http",
                "an integer",
            ),
            (
                "s.yaml",
                "image: x\nsecurity:\n  cap_drop: [1]\n",
                3,
                "security.cap_drop[0]",
                "an integer",
            ),
            (
                "s.yaml",
                "image: x\nenv: [[A, 1]]\n",
                2,
                "env[0][1]",
                "an integer",
            ),
        ] {
            let e = error_of(name, text);
            let want =
                format!("{name}:{line}: invalid spec ({field}): expected a string, found {found}");
            assert!(e.starts_with(&want), "{name} {text:?}: {e}");
        }
        // Numbers where numbers belong, booleans where booleans do.
        for (name, text) in [
            ("s.yaml", "image: x\nresources:\n  pids: \"64\"\n"),
            (
                "s.toml",
                "image = \"x\"\n[security]\nread_only_rootfs = \"true\"\n",
            ),
        ] {
            let e = error_of(name, text);
            assert!(e.contains("invalid type: string"), "{name}: {e}");
        }
    }

    #[test]
    fn hostile_spec_files_fail_fast_in_bounded_memory() {
        // A YAML alias bomb of under 1 KiB: billions of values if expanded.
        let mut bomb = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
        for i in 1..12 {
            let prev = (b'a' + i - 1) as char;
            let this = (b'a' + i) as char;
            bomb.push_str(&format!(
                "{this}: &{this} [*{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}]\n"
            ));
        }
        assert!(bomb.len() < 1024, "{}", bomb.len());
        let started = std::time::Instant::now();
        let e = error_of("s.yaml", &bomb);
        assert!(e.contains("more than 100000 values"), "{e}");
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        // Aliases of one long text: values few, bytes many.
        let mut copies = format!("image: x\nlabels:\n  a: &t {}\n", "y".repeat(512 << 10));
        copies.push_str("post_create:\n");
        for _ in 0..1000 {
            copies.push_str("  - [*t]\n");
        }
        let e = error_of("s.yaml", &copies);
        assert!(e.contains("more than 100000 values"), "{e}");
        // Nesting past the depth bound, in each format.
        let deep = 10_000;
        for (name, text) in [
            (
                "s.yaml",
                format!("image: {}x{}", "[".repeat(deep), "]".repeat(deep)),
            ),
            (
                "s.json",
                format!("{{\"image\": {}1{}}}", "[".repeat(100), "]".repeat(100)),
            ),
            (
                "s.toml",
                format!("image = {}1{}", "[".repeat(100), "]".repeat(100)),
            ),
        ] {
            let e = error_of(name, &text);
            assert!(
                e.contains("deeper than") || e.contains("recursion"),
                "{name}: {e}"
            );
        }
        // A file over the size bound is refused unread.
        let big = format!("image: x\n#{}\n", "x".repeat(2 << 20));
        let e = error_of("s.yaml", &big);
        assert!(e.contains("larger than 1024 KiB"), "{e}");
        // So is a CA file larger than any CA bundle.
        let (dir, _) = write("ca.pem", &"x".repeat(600 << 10));
        let e = error_of(
            "s.yaml",
            &format!(
                "image: x\nca_file: {}\n",
                dir.path().join("ca.pem").display()
            ),
        );
        assert!(e.contains("larger than 512 KiB"), "{e}");
    }

    #[test]
    fn commands_split_like_a_shell_without_one() {
        assert_eq!(
            split_command("pip install 'a b' c\\ d").unwrap(),
            ["pip", "install", "a b", "c d"]
        );
        assert!(split_command("echo 'open").is_err());
        assert!(split_command("  ").is_err());
    }
}
