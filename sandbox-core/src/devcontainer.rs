//! Dev Container configurations (`devcontainer.json`) as a [`RunSpec`]: run where users
//! already are.
//!
//! [`RunSpec::from_devcontainer`] (the same as [`load`]) reads a project's
//! `.devcontainer/devcontainer.json`; [`parse`] maps the text of one with an explicit
//! [`Context`] (the file to name in errors, the host workspace folder, the local
//! environment), for callers that hold the text already, and for tests.
//!
//! The file is read as its editors read it: JSON with comments and trailing commas. The
//! properties follow the [devcontainer.json reference]. Each one is mapped to a field of the
//! spec, or ignored because it only configures an editor or tool (a documented list), or
//! refused: what a run cannot express is an [`ErrorKind::Unsupported`] error naming the
//! property, never silently dropped, and a property the reference does not know (a typo)
//! is an [`ErrorKind::InvalidSpec`] error naming it. The spec returned passes
//! [`RunSpec::validate`]; when it would not, the error names the property the bad value came
//! from.
//!
//! # Mapping
//!
//! | property | in the [`RunSpec`] |
//! |---|---|
//! | `image` | `image`. Required: runcell runs an existing image (see `build` below) |
//! | the folder holding `.devcontainer/` (or `.devcontainer.json`) | `workspace.host_dir` |
//! | `workspaceFolder` | `workspace.path`. Absent: `/workspaces/${localWorkspaceFolderBasename}`, the reference's default for image-based configs |
//! | `workspaceMount` | a `type=bind` mount only: its source → `workspace.host_dir`, its target → `workspace.path`, and then a `workspaceFolder` other than the target → `working_dir`. Any other kind: `Unsupported`. A source outside the project (see below): `InvalidSpec`, unless the caller allows it |
//! | `containerEnv` | `env` |
//! | `remoteEnv` | `env` too, after `containerEnv` and `runArgs --env`, winning over them: runcell has no separate remote-user session, every exec (and every lifecycle command) gets the run's environment. A `null` value removes the variable if this file set it earlier (a variable of the image stays) |
//! | `containerUser`, `remoteUser` | `user`; `remoteUser` wins, being the user of tools and lifecycle commands (then `containerUser`, then `runArgs --user`) |
//! | `onCreateCommand`, `updateContentCommand`, `postCreateCommand`, `postStartCommand`, `postAttachCommand` | `post_create`, in this lifecycle order, as the run's user in its working directory. A string runs as `sh -c STRING`; an array is an argv run without a shell; an object holds named commands (each a string or an array) that run **one after another in the order written**, not in parallel as the devcontainer CLI runs them. An empty string or array runs nothing. A run starts once and is handed out once, so `postStartCommand` and `postAttachCommand` run once, last |
//! | `hostRequirements.cpus` | `resources.cpus`: the reference's minimum becomes the run's allotment |
//! | `hostRequirements.memory` | `resources.memory_bytes` (`"8gb"`; `kb`, `mb`, `gb`, `tb` are powers of 1024; plain bytes without unit) |
//! | `hostRequirements.storage` | checked for its form, not enforced: runcell sets no disk limit |
//! | `hostRequirements.gpu` | `false` or `"optional"`: nothing; `true` or an object: `Unsupported` |
//! | `runArgs` | the flags below, where expressible; any other argument: `Unsupported` naming `runArgs[i]` |
//! | `securityOpt` | `no-new-privileges` (`:true`, `=true`) → `security.no_new_privileges`, `:false` turns it off; anything else: `Unsupported` naming `securityOpt[i]` |
//! | `mounts` | a bind of the workspace folder at the workspace path is the workspace already: nothing to do. Any other mount (volumes, other host folders, read-only): `Unsupported` naming `mounts[i]` |
//! | `privileged` | `false`: nothing; `true`: `Unsupported` |
//! | `capAdd` | `[]`: nothing; any capability: `Unsupported` |
//! | `init` | nothing: every run has an init that reaps orphans, whatever the value |
//! | `overrideCommand` | `true`: what runcell always does (the keep-alive replaces the image's ENTRYPOINT and CMD, which never run); `false`, which asks for the image's command to run: `Unsupported` |
//! | `features` | `{}`: nothing; any feature: `Unsupported` (features install into a built image) |
//! | `build`, `dockerFile`, `context`, `dockerComposeFile`, `service`, `runServices`, `overrideFeatureInstallOrder` | `Unsupported`: build the image first and name it in `image`; Docker Compose is not a run |
//! | `appPort` | `[]`: nothing; ports: `Unsupported` (runcell publishes no ports) |
//! | `initializeCommand` | `Unsupported`: it runs on the host, and loading a spec runs nothing on the host |
//! | `name`, `$schema`, `customizations`, `extensions`, `settings`, `forwardPorts`, `portsAttributes`, `otherPortsAttributes`, `shutdownAction`, `updateRemoteUserUID`, `userEnvProbe`, `waitFor`, `secrets` | ignored: they configure an editor or tool (port forwarding, the UI, when to stop, how to probe the shell, recommended secrets), not the run. runcell does not rewrite the image's users (`updateRemoteUserUID`) |
//! | anything else | `InvalidSpec` naming it, with the closest known name |
//!
//! `security.no_new_privileges` is **off** unless `securityOpt` or `runArgs` asks for it,
//! unlike [`RunSpec::new`]: devcontainer images commonly run tools as a non-root
//! `remoteUser` who needs `sudo`, as under Docker's defaults. Set it after loading to
//! harden the run. Nothing else the reference leaves out is added: no proxy, CA, TTL or
//! labels (the caller adds those).
//!
//! ## `runArgs`
//!
//! Flags as the Docker CLI takes them (`--flag value`, `--flag=value`, `-f value`,
//! `-fvalue`):
//!
//! | flag | in the [`RunSpec`] |
//! |---|---|
//! | `--env`/`-e NAME=VALUE` (`NAME` alone: the local value, skipped when unset) | `env` |
//! | `--user`/`-u USER` | `user` |
//! | `--workdir`/`-w DIR` | `working_dir` |
//! | `--memory`/`-m SIZE` (`512m`, `1.5g`: Docker's units, powers of 1024) | `resources.memory_bytes` (over `hostRequirements.memory`) |
//! | `--cpus N` | `resources.cpus` (over `hostRequirements.cpus`) |
//! | `--pids-limit N` (`0` or `-1`: unlimited) | `resources.pids` |
//! | `--network`/`--net` `none` (`bridge`, `default`: the engine's default) | `network` |
//! | `--cap-drop CAP` (`net_raw`, `CAP_NET_RAW`: written as `NET_RAW`) | `security.cap_drop` |
//! | `--read-only` | `security.read_only_rootfs` |
//! | `--security-opt no-new-privileges` | `security.no_new_privileges` |
//! | `--label`/`-l KEY=VALUE` | `labels` |
//! | `--init` | nothing (every run has an init) |
//!
//! # Variables
//!
//! In every string that is mapped (not in keys):
//! `${localWorkspaceFolder}` and `${localWorkspaceFolderBasename}` (the host folder),
//! `${containerWorkspaceFolder}` and `${containerWorkspaceFolderBasename}` (the workspace
//! folder in the run), `${localEnv:NAME}` and `${localEnv:NAME:default}` (also the older
//! `${env:...}`: the host environment when the file is loaded, or [`Context::local_env`];
//! unset or empty gives the default, else an empty string; the default is everything after
//! the second colon). `${containerEnv:NAME}` is resolved only from what this file sets on
//! the container (`containerEnv`, `runArgs --env`), in `remoteEnv` and later properties; a
//! variable of the image is not known before the run exists, so any other use is
//! `Unsupported` naming the property (write the value out instead of leaving it to the
//! image). `${devcontainerId}` is `Unsupported`. Any other `${...}` stays as written, as
//! the devcontainer CLI leaves it: a shell expands `${HOME}` in `sh -c` commands.
//!
//! # Errors
//!
//! [`ErrorKind::InvalidSpec`] or [`ErrorKind::Unsupported`] whose [`Error::field`] is the
//! property path, such as `devcontainer.runArgs[2]`, `devcontainer.containerEnv["PATH"]` or
//! `devcontainer.postCreateCommand["build"]` (`devcontainer` for the file as a whole), with
//! the file's path in the context (`file`) and, for a property, its `line` and `column`. A
//! syntax error is `InvalidSpec` naming `devcontainer` with the line and column of the
//! fault; a missing file or folder without a configuration is [`ErrorKind::NotFound`].
//! Messages never echo an environment value.
//!
//! # Host folders
//!
//! A `devcontainer.json` comes with a repository, not from the caller, and a run's code
//! may run as root and write anything in its workspace: so the file may mount only the
//! project. `workspaceMount` may bind the workspace folder or a folder in it, or a folder
//! holding it up to the root of the git repository that holds it (a `.git` entry; a
//! configuration in a subfolder of a repository commonly mounts the repository). Any
//! other source (`/`, a home directory, a sibling of the repository) is
//! [`ErrorKind::InvalidSpec`] naming `devcontainer.workspaceMount`, unless the caller
//! opts in with [`Context::allow_mounts_outside_project`] (through [`load_with`]; the
//! CLI's `--allow-mounts-outside-project`). System directories are refused as a
//! workspace whatever the opt-in (see [`crate::Workspace`]).
//!
//! [devcontainer.json reference]: https://containers.dev/implementors/json_reference/

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use jsonc_parser::ast::{Object, ObjectProp, Value};
use jsonc_parser::common::Range;
use jsonc_parser::{CollectOptions, ParseOptions, parse_to_ast};

use crate::error::{Error, ErrorKind, Result};
use crate::spec::{Network, RunSpec};

/// The largest `devcontainer.json` read (they are a few kilobytes).
const MAX_FILE_BYTES: u64 = 4 << 20;

/// The lifecycle commands, in the order they run.
const LIFECYCLE: [&str; 5] = [
    "onCreateCommand",
    "updateContentCommand",
    "postCreateCommand",
    "postStartCommand",
    "postAttachCommand",
];

/// Properties mapped to the spec (or checked and accepted at some values).
const MAPPED: &[&str] = &[
    "image",
    "workspaceFolder",
    "workspaceMount",
    "containerEnv",
    "remoteEnv",
    "containerUser",
    "remoteUser",
    "onCreateCommand",
    "updateContentCommand",
    "postCreateCommand",
    "postStartCommand",
    "postAttachCommand",
    "hostRequirements",
    "runArgs",
    "securityOpt",
    "mounts",
    "privileged",
    "capAdd",
    "init",
    "overrideCommand",
    "features",
    "appPort",
];

/// Properties that configure an editor or tool, not the run: accepted and ignored.
const IGNORED: &[&str] = &[
    "name",
    "$schema",
    "customizations",
    "extensions",
    "settings",
    "forwardPorts",
    "portsAttributes",
    "otherPortsAttributes",
    "shutdownAction",
    "updateRemoteUserUID",
    "userEnvProbe",
    "waitFor",
    "secrets",
];

/// Properties a run cannot express, whatever their value, and why.
const UNSUPPORTED: &[(&str, &str)] = &[
    (
        "build",
        "building an image is not part of a run: build it first and name it in `image`",
    ),
    (
        "dockerFile",
        "building an image is not part of a run: build it first and name it in `image`",
    ),
    (
        "context",
        "building an image is not part of a run: build it first and name it in `image`",
    ),
    (
        "dockerComposeFile",
        "Docker Compose configurations are not supported: a run is one container, give its `image`",
    ),
    (
        "service",
        "Docker Compose configurations are not supported: a run is one container, give its `image`",
    ),
    (
        "runServices",
        "Docker Compose configurations are not supported: a run is one container, give its `image`",
    ),
    (
        "overrideFeatureInstallOrder",
        "features are not supported: install what they would into the image",
    ),
    (
        "initializeCommand",
        "it runs on the host, and loading a spec runs nothing on the host: run it yourself before starting",
    ),
];

/// Where a `devcontainer.json` belongs: the file (named in errors), the host workspace
/// folder (`${localWorkspaceFolder}`, the run's `workspace.host_dir`) and the local
/// environment `${localEnv:...}` reads. `Debug` shows the names of a fixed local
/// environment, not its values.
#[derive(Clone)]
pub struct Context {
    file: PathBuf,
    workspace_folder: PathBuf,
    local_env: Option<BTreeMap<String, String>>,
    /// `workspaceMount` may bind a host folder outside the project.
    mounts_outside_project: bool,
}

impl Context {
    /// A context for `file` (only named in errors here) whose workspace folder is
    /// `workspace_folder` (an absolute path of an existing directory, or the spec will not
    /// validate), reading `${localEnv:...}` from this process's environment.
    pub fn new(file: impl Into<PathBuf>, workspace_folder: impl Into<PathBuf>) -> Context {
        Context {
            file: file.into(),
            workspace_folder: workspace_folder.into(),
            local_env: None,
            mounts_outside_project: false,
        }
    }

    /// The context of an existing file, its workspace folder told by where it lies, as the
    /// reference places it: `FOLDER/.devcontainer/devcontainer.json` (any file name in
    /// `.devcontainer/`), `FOLDER/.devcontainer/SUB/devcontainer.json` or
    /// `FOLDER/.devcontainer.json`. The path is made absolute (symlinks resolved).
    /// Elsewhere: [`ErrorKind::InvalidSpec`] naming `devcontainer` (use [`Context::new`]).
    pub fn for_file(file: impl AsRef<Path>) -> Result<Context> {
        let file = canonical(file.as_ref())?;
        let name_of = |p: Option<&Path>| p.and_then(Path::file_name).map(|n| n.to_os_string());
        let parent = file.parent();
        let folder = if name_of(Some(&file)).is_some_and(|n| n == ".devcontainer.json") {
            parent
        } else if name_of(parent).is_some_and(|n| n == ".devcontainer") {
            parent.and_then(Path::parent)
        } else if name_of(parent.and_then(Path::parent)).is_some_and(|n| n == ".devcontainer") {
            parent.and_then(Path::parent).and_then(Path::parent)
        } else {
            None
        };
        let Some(folder) = folder else {
            return Err(Error::invalid_spec(
                "devcontainer",
                "the file is neither in a .devcontainer folder nor named .devcontainer.json, so its workspace folder cannot be told: give it with devcontainer::Context::new",
            )
            .with("file", file.display()));
        };
        Ok(Context {
            workspace_folder: folder.to_path_buf(),
            file,
            local_env: None,
            mounts_outside_project: false,
        })
    }

    /// Reads `${localEnv:...}` from these variables instead of this process's environment.
    pub fn local_env<I, K, V>(mut self, vars: I) -> Context
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<String>,
    {
        self.local_env = Some(
            vars.into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        );
        self
    }

    /// Lets `workspaceMount` bind a host folder outside the project (the workspace folder
    /// and the git repository holding it): an explicit opt-in, for a configuration the
    /// caller trusts as if they had written it. Off by default. See the
    /// [module docs](crate::devcontainer#host-folders).
    pub fn allow_mounts_outside_project(mut self, allow: bool) -> Context {
        self.mounts_outside_project = allow;
        self
    }

    /// The file named in errors.
    pub fn file(&self) -> &Path {
        &self.file
    }

    /// The host workspace folder.
    pub fn workspace_folder(&self) -> &Path {
        &self.workspace_folder
    }

    /// A local variable for `${localEnv:...}`; unset, not Unicode or empty is `None` (the
    /// devcontainer CLI takes an empty value for an unset one).
    fn local_var(&self, name: &str) -> Option<String> {
        self.local_value(name).filter(|v| !v.is_empty())
    }

    /// A local variable as it is (`runArgs --env NAME` passes an empty value on).
    fn local_value(&self, name: &str) -> Option<String> {
        match &self.local_env {
            Some(vars) => vars.get(name).cloned(),
            None => std::env::var(name).ok(),
        }
    }
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("file", &self.file)
            .field("workspace_folder", &self.workspace_folder)
            .field("mounts_outside_project", &self.mounts_outside_project)
            .field(
                "local_env",
                &self
                    .local_env
                    .as_ref()
                    .map(|vars| vars.keys().map(|k| format!("{k}=***")).collect::<Vec<_>>()),
            )
            .finish()
    }
}

impl RunSpec {
    /// The spec of a Dev Container configuration: `path` is a `devcontainer.json` file or a
    /// project folder holding `.devcontainer/devcontainer.json` (or `.devcontainer.json`).
    /// The same as [`load`]; the [module docs](crate::devcontainer) list what each property
    /// becomes and what is refused.
    ///
    /// ```no_run
    /// # fn demo() -> runcell_core::Result<()> {
    /// use runcell_core::RunSpec;
    /// let spec = RunSpec::from_devcontainer(".")?   // ./.devcontainer/devcontainer.json
    ///     .label("team", "agents");
    /// # Ok(()) }
    /// ```
    pub fn from_devcontainer(path: impl AsRef<Path>) -> Result<RunSpec> {
        load(path)
    }
}

/// Reads a Dev Container configuration and maps it to a spec (see [`RunSpec::from_devcontainer`]).
///
/// `path` is the file, or a folder: then `FOLDER/.devcontainer/devcontainer.json`, else
/// `FOLDER/.devcontainer.json` (a configuration in a subfolder of `.devcontainer/` is named
/// by its file). The workspace folder is told by where the file lies
/// ([`Context::for_file`]); `${localEnv:...}` reads this process's environment now.
pub fn load(path: impl AsRef<Path>) -> Result<RunSpec> {
    load_with(path, |cx| cx)
}

/// [`load`], with the [`Context`] found for the file changed by `configure` first: say, to
/// allow mounts outside the project ([`Context::allow_mounts_outside_project`]) or to fix
/// the local environment.
///
/// ```no_run
/// # fn demo() -> runcell_core::Result<()> {
/// use runcell_core::devcontainer;
/// // A configuration the caller trusts to mount folders beside its repository.
/// let spec = devcontainer::load_with(".", |cx| cx.allow_mounts_outside_project(true))?;
/// # Ok(()) }
/// ```
pub fn load_with(
    path: impl AsRef<Path>,
    configure: impl FnOnce(Context) -> Context,
) -> Result<RunSpec> {
    let path = canonical(path.as_ref())?;
    let file = if path.is_dir() {
        let candidates = [
            path.join(".devcontainer").join("devcontainer.json"),
            path.join(".devcontainer.json"),
        ];
        match candidates.iter().find(|c| c.is_file()) {
            Some(file) => file.clone(),
            None => {
                return Err(Error::new(
                    ErrorKind::NotFound,
                    format!(
                        "no .devcontainer/devcontainer.json or .devcontainer.json in {} (name a configuration in a subfolder of .devcontainer by its file)",
                        path.display()
                    ),
                )
                .with_field("devcontainer")
                .with("file", path.display()));
            }
        }
    } else {
        path
    };
    let cx = configure(Context::for_file(&file)?);
    let io_error = |e: std::io::Error| {
        Error::invalid_spec("devcontainer", "cannot read the file")
            .with("file", file.display())
            .with_source(e)
    };
    let size = std::fs::metadata(&file).map_err(io_error)?.len();
    if size > MAX_FILE_BYTES {
        return Err(Error::invalid_spec(
            "devcontainer",
            format!("is {size} bytes, more than the {MAX_FILE_BYTES} read"),
        )
        .with("file", file.display()));
    }
    // Read at most the bound whatever the size said (a file that grows, a device).
    let mut text = String::new();
    std::fs::File::open(&file)
        .and_then(|f| {
            use std::io::Read as _;
            f.take(MAX_FILE_BYTES + 1).read_to_string(&mut text)
        })
        .map_err(io_error)?;
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(Error::invalid_spec(
            "devcontainer",
            format!("is more than the {MAX_FILE_BYTES} bytes read"),
        )
        .with("file", file.display()));
    }
    parse(&text, &cx)
}

/// How deep objects and arrays may nest in a `devcontainer.json` (the parser recurses).
const MAX_DEPTH: usize = 64;

/// The deepest nesting of `{` and `[` outside strings and comments, found without
/// recursion, so that a hostile file cannot exhaust the parser's stack.
fn nesting(text: &str) -> usize {
    let (mut depth, mut deepest) = (0usize, 0usize);
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                while let Some(c) = chars.next() {
                    match c {
                        '\\' => {
                            chars.next();
                        }
                        '"' => break,
                        _ => {}
                    }
                }
            }
            '/' if chars.peek() == Some(&'/') => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        break;
                    }
                }
            }
            '/' if chars.peek() == Some(&'*') => {
                chars.next();
                let mut star = false;
                for c in chars.by_ref() {
                    if star && c == '/' {
                        break;
                    }
                    star = c == '*';
                }
            }
            '{' | '[' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            '}' | ']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

/// Maps the text of a `devcontainer.json` to a spec, in `cx` (the file named in errors, the
/// workspace folder, the local environment). The [module docs](crate::devcontainer) list
/// what each property becomes.
///
/// ```
/// use runcell_core::devcontainer::{Context, parse};
/// let folder = std::env::temp_dir().join("my-project");
/// # std::fs::create_dir_all(&folder).unwrap();
/// let cx = Context::new(folder.join(".devcontainer/devcontainer.json"), &folder);
/// let spec = parse(
///     r#"{
///         // comments and trailing commas are fine
///         "image": "python:3.12-slim",
///         "workspaceFolder": "/src",
///         "postCreateCommand": "pip install -r requirements.txt",
///     }"#,
///     &cx,
/// )?;
/// assert_eq!(spec.workspace.path, "/src");
/// assert_eq!(spec.post_create, [["sh", "-c", "pip install -r requirements.txt"]]);
/// # Ok::<(), runcell_core::Error>(())
/// ```
pub fn parse(text: &str, cx: &Context) -> Result<RunSpec> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(Error::invalid_spec(
            "devcontainer",
            format!("is more than the {MAX_FILE_BYTES} bytes read"),
        )
        .with("file", cx.file.display()));
    }
    if nesting(text) > MAX_DEPTH {
        return Err(Error::invalid_spec(
            "devcontainer",
            format!("nests objects and arrays deeper than {MAX_DEPTH}"),
        )
        .with("file", cx.file.display()));
    }
    // JSONC as editors read it: comments and trailing commas, nothing of JSON5.
    let options = ParseOptions {
        allow_comments: true,
        allow_trailing_commas: true,
        allow_loose_object_property_names: false,
        allow_missing_commas: false,
        allow_single_quoted_strings: false,
        allow_hexadecimal_numbers: false,
        allow_unary_plus_numbers: false,
        allow_bare_decimal_point_numbers: false,
        allow_non_finite_numbers: false,
        allow_extended_string_escapes: false,
    };
    let ast = parse_to_ast(text, &CollectOptions::default(), &options).map_err(|e| {
        Error::invalid_spec("devcontainer", format!("is not valid JSON: {}", e.kind()))
            .with("file", cx.file.display())
            .with("line", e.line_display())
            .with("column", e.column_display())
    })?;
    let root = match ast.value {
        Some(Value::Object(root)) => root,
        other => {
            let mapper = Mapper::new(cx, text)?;
            let range = other.as_ref().map_or(Range::new(0, 0), value_range);
            return Err(mapper.invalid("", range, "must be a JSON object"));
        }
    };
    Mapper::new(cx, text)?.map(&root)
}

/// Whether `source` (resolved) is in the project of workspace folder `folder`: the folder
/// or below it, or a folder holding it up to the root of the git repository that holds it.
fn in_project(source: &Path, folder: &Path) -> bool {
    use std::path::Component;
    // Unresolved (it does not exist): judged as written, and `..` is never inside.
    if source
        .components()
        .any(|c| matches!(c, Component::ParentDir | Component::CurDir))
    {
        return false;
    }
    let folder = std::fs::canonicalize(folder).unwrap_or_else(|_| folder.to_path_buf());
    if source.starts_with(&folder) {
        return true;
    }
    let repository = folder
        .ancestors()
        .find(|dir| dir.join(".git").symlink_metadata().is_ok());
    repository.is_some_and(|root| folder.starts_with(source) && source.starts_with(root))
}

fn canonical(path: &Path) -> Result<PathBuf> {
    std::fs::canonicalize(path).map_err(|e| {
        let kind = if e.kind() == std::io::ErrorKind::NotFound {
            ErrorKind::NotFound
        } else {
            ErrorKind::InvalidSpec
        };
        Error::new(kind, format!("cannot open {}", path.display()))
            .with_field("devcontainer")
            .with("file", path.display())
            .with_source(e)
    })
}

fn value_range(value: &Value<'_>) -> Range {
    match value {
        Value::StringLit(v) => v.range,
        Value::NumberLit(v) => v.range,
        Value::BooleanLit(v) => v.range,
        Value::Object(v) => v.range,
        Value::Array(v) => v.range,
        Value::NullKeyword(v) => v.range,
    }
}

fn kind_of(value: &Value<'_>) -> &'static str {
    match value {
        Value::StringLit(_) => "a string",
        Value::NumberLit(_) => "a number",
        Value::BooleanLit(_) => "a boolean",
        Value::Object(_) => "an object",
        Value::Array(_) => "an array",
        Value::NullKeyword(_) => "null",
    }
}

/// A key of an object property as a path step: `parent["key"]`.
fn key_path(parent: &str, key: &str) -> String {
    format!("{parent}[{key:?}]")
}

/// The last path component of a Unix path (`/` and empty: empty).
fn basename(path: &str) -> String {
    path.trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or_default()
        .to_string()
}

/// The spec field of a value, the devcontainer property it came from and where.
type Origins = BTreeMap<String, (String, Range)>;

/// Maps one parsed file.
struct Mapper<'a> {
    cx: &'a Context,
    text: &'a str,
    local_folder: String,
    local_basename: String,
    /// `${containerWorkspaceFolder}`: known once the workspace is mapped.
    container_folder: Option<String>,
    /// `${containerEnv:...}`: what the file sets on the container, once known.
    container_env: Option<BTreeMap<String, String>>,
    spec: RunSpec,
    /// The property of each `spec.env` entry, in step.
    env_origin: Vec<(String, Range)>,
    /// The property of each `spec.security.cap_drop` entry, in step.
    cap_origin: Vec<(String, Range)>,
    /// The property of each `spec.post_create` entry, in step.
    cmd_origin: Vec<(String, Range)>,
    /// The property of the other fields set.
    origins: Origins,
}

impl<'a> Mapper<'a> {
    fn new(cx: &'a Context, text: &'a str) -> Result<Mapper<'a>> {
        let local_folder = cx
            .workspace_folder
            .to_str()
            .ok_or_else(|| {
                Error::invalid_spec("devcontainer", "the workspace folder's path is not UTF-8")
                    .with("file", cx.file.display())
            })?
            .to_string();
        let mut spec = RunSpec::default();
        spec.security.no_new_privileges = false;
        Ok(Mapper {
            cx,
            text,
            local_basename: basename(&local_folder),
            local_folder,
            container_folder: None,
            container_env: None,
            spec,
            env_origin: Vec::new(),
            cap_origin: Vec::new(),
            cmd_origin: Vec::new(),
            origins: Origins::new(),
        })
    }

    // ---- errors ----

    fn error(
        &self,
        kind: ErrorKind,
        path: &str,
        range: Range,
        message: impl Into<String>,
    ) -> Error {
        let (line, column) = line_column(self.text, range.start);
        let field = if path.is_empty() {
            "devcontainer".to_string()
        } else if path.starts_with('[') {
            format!("devcontainer{path}")
        } else {
            format!("devcontainer.{path}")
        };
        Error::new(kind, message)
            .with_field(field)
            .with("file", self.cx.file.display())
            .with("line", line)
            .with("column", column)
    }

    fn invalid(&self, path: &str, range: Range, message: impl Into<String>) -> Error {
        self.error(ErrorKind::InvalidSpec, path, range, message)
    }

    fn unsupported(&self, path: &str, range: Range, message: impl Into<String>) -> Error {
        self.error(ErrorKind::Unsupported, path, range, message)
    }

    fn wrong_type(&self, path: &str, value: &Value<'_>, expected: &str) -> Error {
        self.invalid(
            path,
            value_range(value),
            format!("must be {expected}, not {}", kind_of(value)),
        )
    }

    // ---- typed access ----

    fn string(&self, path: &str, value: &Value<'_>) -> Result<String> {
        match value {
            Value::StringLit(s) => self.substitute(&s.value, path, s.range),
            other => Err(self.wrong_type(path, other, "a string")),
        }
    }

    fn boolean(&self, path: &str, value: &Value<'_>) -> Result<bool> {
        match value {
            Value::BooleanLit(b) => Ok(b.value),
            other => Err(self.wrong_type(path, other, "true or false")),
        }
    }

    fn object<'v>(&self, path: &str, value: &'v Value<'a>) -> Result<&'v Object<'a>> {
        match value {
            Value::Object(o) => Ok(o),
            other => Err(self.wrong_type(path, other, "an object")),
        }
    }

    fn array<'v>(&self, path: &str, value: &'v Value<'a>) -> Result<&'v [Value<'a>]> {
        match value {
            Value::Array(a) => Ok(&a.elements),
            other => Err(self.wrong_type(path, other, "an array")),
        }
    }

    /// The properties of an object, refusing duplicates (the later would win unseen).
    fn properties<'v>(
        &self,
        path: &str,
        object: &'v Object<'a>,
    ) -> Result<Vec<(String, &'v ObjectProp<'a>)>> {
        let mut seen = std::collections::BTreeSet::new();
        let mut props = Vec::with_capacity(object.properties.len());
        for prop in &object.properties {
            let name = prop.name.clone().into_string();
            if !seen.insert(name.clone()) {
                let p = if path.is_empty() {
                    name.clone()
                } else {
                    key_path(path, &name)
                };
                return Err(self.invalid(&p, prop.range, "is given twice"));
            }
            props.push((name, prop));
        }
        Ok(props)
    }

    // ---- variables ----

    fn substitute(&self, s: &str, path: &str, range: Range) -> Result<String> {
        let mut out = String::with_capacity(s.len());
        let mut rest = s;
        while let Some(start) = rest.find("${") {
            out.push_str(&rest[..start]);
            let after = &rest[start + 2..];
            let Some(end) = after.find('}') else {
                out.push_str(&rest[start..]);
                return Ok(out);
            };
            let inner = &after[..end];
            match self.variable(inner, path, range)? {
                Some(value) => out.push_str(&value),
                None => out.push_str(&rest[start..start + 2 + end + 1]),
            }
            rest = &after[end + 1..];
        }
        out.push_str(rest);
        Ok(out)
    }

    /// The value of `${inner}`; `None` leaves it as written.
    fn variable(&self, inner: &str, path: &str, range: Range) -> Result<Option<String>> {
        let (name, args) = match inner.split_once(':') {
            Some((name, args)) => (name, Some(args)),
            None => (inner, None),
        };
        let var_and_default = |args: &str| -> (String, Option<String>) {
            match args.split_once(':') {
                Some((var, default)) => (var.to_string(), Some(default.to_string())),
                None => (args.to_string(), None),
            }
        };
        Ok(match (name, args) {
            ("localWorkspaceFolder", None) => Some(self.local_folder.clone()),
            ("localWorkspaceFolderBasename", None) => Some(self.local_basename.clone()),
            ("containerWorkspaceFolder", None) | ("containerWorkspaceFolderBasename", None) => {
                let Some(folder) = &self.container_folder else {
                    return Err(self.invalid(
                        path,
                        range,
                        format!(
                            "${{{name}}} is the workspace folder in the run, which this property defines"
                        ),
                    ));
                };
                Some(if name == "containerWorkspaceFolder" {
                    folder.clone()
                } else {
                    basename(folder)
                })
            }
            ("localEnv" | "env", Some(args)) => {
                let (var, default) = var_and_default(args);
                Some(self.cx.local_var(&var).or(default).unwrap_or_default())
            }
            ("containerEnv", Some(args)) => {
                let (var, _) = var_and_default(args);
                let Some(env) = &self.container_env else {
                    return Err(self.unsupported(
                        path,
                        range,
                        format!(
                            "${{containerEnv:{var}}}: the container's environment is not known where it is being defined"
                        ),
                    ));
                };
                match env.get(&var) {
                    Some(value) => Some(value.clone()),
                    None => {
                        return Err(self.unsupported(
                            path,
                            range,
                            format!(
                                "${{containerEnv:{var}}} refers to the image's environment, which is not known before the run exists (only containerEnv and runArgs --env of this file are): write the value out"
                            ),
                        ));
                    }
                }
            }
            ("devcontainerId", None) => {
                return Err(self.unsupported(
                    path,
                    range,
                    "${devcontainerId} is not supported: runcell gives each run its own id",
                ));
            }
            _ => None,
        })
    }

    // ---- the mapping ----

    fn map(mut self, root: &Object<'a>) -> Result<RunSpec> {
        let props: BTreeMap<String, &ObjectProp<'a>> = {
            let list = self.properties("", root)?;
            // Unknown and unsupported properties first, in the order written.
            for (name, prop) in &list {
                if let Some((_, why)) = UNSUPPORTED.iter().find(|(n, _)| n == name) {
                    return Err(self.unsupported(name, prop.range, *why));
                }
                if !MAPPED.contains(&name.as_str()) && !IGNORED.contains(&name.as_str()) {
                    let mut message = "is not a devcontainer.json property".to_string();
                    if let Some(close) = closest(name) {
                        message.push_str(&format!("; did you mean `{close}`?"));
                    }
                    return Err(self.invalid(name, prop.range, message));
                }
            }
            list.into_iter().collect()
        };
        let get = |name: &str| props.get(name).map(|p| &p.value);

        self.map_checked(&props)?;
        self.map_workspace(get("workspaceFolder"), get("workspaceMount"))?;
        if let Some(env) = get("containerEnv") {
            self.map_container_env(env)?;
        }
        if let Some(req) = get("hostRequirements") {
            self.map_host_requirements(req)?;
        }
        if let Some(opts) = get("securityOpt") {
            let path = "securityOpt";
            for (i, opt) in self.array(path, opts)?.iter().enumerate() {
                let p = format!("{path}[{i}]");
                let value = self.string(&p, opt)?;
                if !self.security_opt(&value, &p, value_range(opt)) {
                    return Err(self.unsupported(
                        &p,
                        value_range(opt),
                        format!("{value:?}: only no-new-privileges is supported"),
                    ));
                }
            }
        }
        if let Some(args) = get("runArgs") {
            self.map_run_args(args)?;
        }
        self.container_env = Some(self.spec.env.iter().cloned().collect());
        if let Some(env) = get("remoteEnv") {
            self.map_remote_env(env)?;
        }
        for name in ["containerUser", "remoteUser"] {
            if let Some(value) = get(name) {
                let user = self.string(name, value)?;
                self.spec.user = Some(user);
                self.origins
                    .insert("user".into(), (name.into(), value_range(value)));
            }
        }
        if let Some(mounts) = get("mounts") {
            self.map_mounts(mounts)?;
        }
        for name in LIFECYCLE {
            if let Some(value) = get(name) {
                self.map_command(name, value)?;
            }
        }
        match get("image") {
            Some(value) => {
                self.spec.image = self.string("image", value)?;
                self.origins
                    .insert("image".into(), ("image".into(), value_range(value)));
            }
            None => {
                return Err(self.invalid(
                    "image",
                    root.range,
                    "is required: runcell runs an existing image (build, Dockerfile and Docker Compose configurations are not supported)",
                ));
            }
        }
        self.validated()
    }

    /// Properties accepted at some values only.
    fn map_checked(&self, props: &BTreeMap<String, &ObjectProp<'a>>) -> Result<()> {
        if let Some(prop) = props.get("privileged")
            && self.boolean("privileged", &prop.value)?
        {
            return Err(self.unsupported(
                "privileged",
                prop.range,
                "a privileged container is not supported",
            ));
        }
        if let Some(prop) = props.get("capAdd") {
            let caps = self.array("capAdd", &prop.value)?;
            if let Some(first) = caps.first() {
                return Err(self.unsupported(
                    "capAdd[0]",
                    value_range(first),
                    "adding capabilities is not supported",
                ));
            }
        }
        if let Some(prop) = props.get("init") {
            self.boolean("init", &prop.value)?;
        }
        if let Some(prop) = props.get("overrideCommand")
            && !self.boolean("overrideCommand", &prop.value)?
        {
            return Err(self.unsupported(
                "overrideCommand",
                prop.range,
                "false asks for the image's command to run; a run's only process is its keep-alive, and the image's ENTRYPOINT and CMD never run",
            ));
        }
        if let Some(prop) = props.get("features") {
            let features = self.object("features", &prop.value)?;
            if !features.properties.is_empty() {
                let ids: Vec<String> = features
                    .properties
                    .iter()
                    .map(|p| p.name.clone().into_string())
                    .collect();
                return Err(self.unsupported(
                    "features",
                    prop.range,
                    format!(
                        "features are not supported ({}): install what they would into the image",
                        ids.join(", ")
                    ),
                ));
            }
        }
        if let Some(prop) = props.get("appPort") {
            let empty = matches!(&prop.value, Value::Array(a) if a.elements.is_empty());
            if !empty {
                return Err(self.unsupported(
                    "appPort",
                    prop.range,
                    "publishing ports is not supported",
                ));
            }
        }
        Ok(())
    }

    fn map_workspace(
        &mut self,
        folder: Option<&Value<'a>>,
        mount: Option<&Value<'a>>,
    ) -> Result<()> {
        self.spec.workspace.host_dir = Some(self.cx.workspace_folder.clone());
        if let Some(mount) = mount {
            let path = "workspaceMount";
            let range = value_range(mount);
            let text = self.string(path, mount)?;
            let m = Mount::parse(&text).map_err(|why| self.invalid(path, range, why))?;
            let (source, target) = m
                .workspace_bind()
                .map_err(|why| self.unsupported(path, range, why))?;
            // `${localWorkspaceFolder}/..` and the like: the folder itself.
            let source = std::fs::canonicalize(&source).unwrap_or_else(|_| PathBuf::from(source));
            if !self.cx.mounts_outside_project && !in_project(&source, &self.cx.workspace_folder) {
                return Err(self.invalid(
                    path,
                    range,
                    format!(
                        "binds {}, outside the project ({} and the git repository holding it): a devcontainer.json may mount only its project, unless the caller allows more (devcontainer::Context::allow_mounts_outside_project, the CLI's --allow-mounts-outside-project)",
                        source.display(),
                        self.cx.workspace_folder.display()
                    ),
                ));
            }
            self.spec.workspace.host_dir = Some(source);
            self.spec.workspace.path = target;
            self.origins
                .insert("workspace.host_dir".into(), (path.into(), range));
            self.origins
                .insert("workspace.path".into(), (path.into(), range));
        } else {
            self.spec.workspace.path = format!("/workspaces/{}", self.local_basename);
            self.origins.insert(
                "workspace.host_dir".into(),
                (String::new(), Range::new(0, 0)),
            );
        }
        if let Some(folder) = folder {
            let path = "workspaceFolder";
            let range = value_range(folder);
            let dir = self.string(path, folder)?;
            if mount.is_some() {
                if dir.trim_end_matches('/') != self.spec.workspace.path.trim_end_matches('/') {
                    self.spec.working_dir = Some(dir.clone());
                    self.origins
                        .insert("working_dir".into(), (path.into(), range));
                }
            } else {
                self.spec.workspace.path = dir.clone();
                self.origins
                    .insert("workspace.path".into(), (path.into(), range));
            }
            self.container_folder = Some(dir);
        } else {
            self.container_folder = Some(self.spec.workspace.path.clone());
        }
        Ok(())
    }

    fn set_env(&mut self, name: String, value: String, origin: (String, Range)) {
        self.unset_env(&name);
        self.spec.env.push((name, value));
        self.env_origin.push(origin);
    }

    fn unset_env(&mut self, name: &str) {
        while let Some(i) = self.spec.env.iter().position(|(n, _)| n == name) {
            self.spec.env.remove(i);
            self.env_origin.remove(i);
        }
    }

    fn map_container_env(&mut self, env: &Value<'a>) -> Result<()> {
        let object = self.object("containerEnv", env)?;
        for (name, prop) in self.properties("containerEnv", object)? {
            let path = key_path("containerEnv", &name);
            let value = self.string(&path, &prop.value)?;
            self.set_env(name, value, (path, prop.range));
        }
        Ok(())
    }

    fn map_remote_env(&mut self, env: &Value<'a>) -> Result<()> {
        let object = self.object("remoteEnv", env)?;
        for (name, prop) in self.properties("remoteEnv", object)? {
            let path = key_path("remoteEnv", &name);
            match &prop.value {
                Value::NullKeyword(_) => self.unset_env(&name),
                value => {
                    let value = match value {
                        Value::StringLit(_) => self.string(&path, value)?,
                        other => return Err(self.wrong_type(&path, other, "a string or null")),
                    };
                    self.set_env(name, value, (path, prop.range));
                }
            }
        }
        Ok(())
    }

    fn map_host_requirements(&mut self, req: &Value<'a>) -> Result<()> {
        let object = self.object("hostRequirements", req)?;
        for (name, prop) in self.properties("hostRequirements", object)? {
            let path = format!("hostRequirements.{name}");
            let range = prop.range;
            match name.as_str() {
                "cpus" => {
                    let cpus = match &prop.value {
                        Value::NumberLit(n) => n.value.parse::<f64>().ok(),
                        other => return Err(self.wrong_type(&path, other, "a number")),
                    };
                    let Some(cpus) = cpus else {
                        return Err(self.invalid(&path, range, "is not a number"));
                    };
                    self.spec.resources.cpus = Some(cpus);
                    self.origins.insert("resources.cpus".into(), (path, range));
                }
                "memory" => {
                    let text = self.string(&path, &prop.value)?;
                    let bytes = host_size(&text).ok_or_else(|| {
                        self.invalid(
                            &path,
                            range,
                            format!(
                                "{text:?} is not a size such as \"8gb\" (tb, gb, mb, kb or bytes)"
                            ),
                        )
                    })?;
                    self.spec.resources.memory_bytes = Some(bytes);
                    self.origins
                        .insert("resources.memory_bytes".into(), (path, range));
                }
                "storage" => {
                    let text = self.string(&path, &prop.value)?;
                    if host_size(&text).is_none() {
                        return Err(self.invalid(
                            &path,
                            range,
                            format!(
                                "{text:?} is not a size such as \"32gb\" (tb, gb, mb, kb or bytes)"
                            ),
                        ));
                    }
                }
                "gpu" => match &prop.value {
                    Value::BooleanLit(b) if !b.value => {}
                    Value::StringLit(s) if s.value == "optional" => {}
                    Value::BooleanLit(_) | Value::Object(_) => {
                        return Err(self.unsupported(&path, range, "GPUs are not supported"));
                    }
                    other => {
                        return Err(self.wrong_type(
                            &path,
                            other,
                            "true, false, \"optional\" or an object",
                        ));
                    }
                },
                _ => {
                    return Err(self.invalid(
                        &path,
                        range,
                        "is not a host requirement (cpus, memory, storage, gpu)",
                    ));
                }
            }
        }
        Ok(())
    }

    /// Applies a security option; false when it is not one runcell has.
    fn security_opt(&mut self, opt: &str, path: &str, range: Range) -> bool {
        let on = match opt {
            "no-new-privileges" | "no-new-privileges:true" | "no-new-privileges=true" => true,
            "no-new-privileges:false" | "no-new-privileges=false" => false,
            _ => return false,
        };
        self.spec.security.no_new_privileges = on;
        self.origins
            .insert("security.no_new_privileges".into(), (path.into(), range));
        true
    }

    fn map_run_args(&mut self, args: &Value<'a>) -> Result<()> {
        let elements = self.array("runArgs", args)?;
        let mut args = Vec::with_capacity(elements.len());
        for (i, element) in elements.iter().enumerate() {
            let path = format!("runArgs[{i}]");
            args.push((self.string(&path, element)?, path, value_range(element)));
        }
        let mut i = 0;
        while i < args.len() {
            let (arg, path, range) = args[i].clone();
            i += 1;
            let (flag, inline) = split_flag(&arg);
            let Some(flag) = RunFlag::of(flag) else {
                let why = if arg.starts_with('-') {
                    format!(
                        "{arg:?} cannot be expressed in a run spec (see the runArgs table of runcell_core::devcontainer)"
                    )
                } else {
                    format!("{arg:?} is not a flag")
                };
                return Err(self.unsupported(&path, range, why));
            };
            if flag.is_switch() {
                let on = match inline.as_deref() {
                    None | Some("true") => true,
                    Some("false") => false,
                    Some(_) => {
                        return Err(self.invalid(
                            &path,
                            range,
                            format!("{arg:?}: the value must be true or false"),
                        ));
                    }
                };
                // --init: every run has one.
                if flag == RunFlag::ReadOnly {
                    self.spec.security.read_only_rootfs = on;
                    self.origins
                        .insert("security.read_only_rootfs".into(), (path, range));
                }
                continue;
            }
            let (value, vpath, vrange) = match inline {
                Some(value) => (value, path, range),
                None => match args.get(i) {
                    Some((value, vpath, vrange)) => {
                        i += 1;
                        (value.clone(), vpath.clone(), *vrange)
                    }
                    None => {
                        return Err(self.invalid(&path, range, format!("{arg:?} needs a value")));
                    }
                },
            };
            self.run_flag(flag, &value, vpath, vrange)?;
        }
        Ok(())
    }

    fn run_flag(&mut self, flag: RunFlag, value: &str, path: String, range: Range) -> Result<()> {
        match flag {
            RunFlag::Env => match value.split_once('=') {
                Some((name, v)) => self.set_env(name.into(), v.into(), (path, range)),
                None => {
                    if let Some(v) = self.cx.local_value(value) {
                        self.set_env(value.into(), v, (path, range));
                    }
                }
            },
            RunFlag::User => {
                self.spec.user = Some(value.into());
                self.origins.insert("user".into(), (path, range));
            }
            RunFlag::Workdir => {
                self.spec.working_dir = Some(value.into());
                self.origins.insert("working_dir".into(), (path, range));
            }
            RunFlag::Memory => {
                let bytes = docker_size(value).ok_or_else(|| {
                    self.invalid(
                        &path,
                        range,
                        format!("{value:?} is not a memory size such as 512m or 2g"),
                    )
                })?;
                self.spec.resources.memory_bytes = Some(bytes);
                self.origins
                    .insert("resources.memory_bytes".into(), (path, range));
            }
            RunFlag::Cpus => {
                let cpus = value.trim().parse::<f64>().map_err(|_| {
                    self.invalid(&path, range, format!("{value:?} is not a number of CPUs"))
                })?;
                self.spec.resources.cpus = Some(cpus);
                self.origins.insert("resources.cpus".into(), (path, range));
            }
            RunFlag::Pids => {
                let pids = value.trim().parse::<i64>().map_err(|_| {
                    self.invalid(
                        &path,
                        range,
                        format!("{value:?} is not a number of processes"),
                    )
                })?;
                self.spec.resources.pids =
                    if pids <= 0 {
                        None
                    } else {
                        Some(u32::try_from(pids).map_err(|_| {
                            self.invalid(&path, range, format!("{pids} is too large"))
                        })?)
                    };
                self.origins.insert("resources.pids".into(), (path, range));
            }
            RunFlag::Network => {
                self.spec.network = match value {
                    "none" => Network::None,
                    "default" | "bridge" => Network::Default,
                    other => {
                        return Err(self.unsupported(
                            &path,
                            range,
                            format!(
                                "network {other:?} is not supported (none, or the engine's default)"
                            ),
                        ));
                    }
                };
                self.origins.insert("network".into(), (path, range));
            }
            RunFlag::CapDrop => {
                let upper = value.to_ascii_uppercase();
                let cap = upper.strip_prefix("CAP_").unwrap_or(&upper).to_string();
                self.spec.security.cap_drop.push(cap);
                self.cap_origin.push((path, range));
            }
            RunFlag::SecurityOpt => {
                if !self.security_opt(value, &path, range) {
                    return Err(self.unsupported(
                        &path,
                        range,
                        format!(
                            "security option {value:?} is not supported (only no-new-privileges)"
                        ),
                    ));
                }
            }
            RunFlag::Label => {
                let (key, v) = value.split_once('=').unwrap_or((value, ""));
                self.spec.labels.insert(key.into(), v.into());
                self.origins
                    .insert(format!("labels[{key:?}]"), (path, range));
            }
            RunFlag::ReadOnly | RunFlag::Init => unreachable!("switches are handled by the caller"),
        }
        Ok(())
    }

    fn map_mounts(&mut self, mounts: &Value<'a>) -> Result<()> {
        for (i, mount) in self.array("mounts", mounts)?.iter().enumerate() {
            let path = format!("mounts[{i}]");
            let range = value_range(mount);
            let m = match mount {
                Value::StringLit(_) => {
                    let text = self.string(&path, mount)?;
                    Mount::parse(&text).map_err(|why| self.invalid(&path, range, why))?
                }
                Value::Object(object) => {
                    let mut m = Mount::default();
                    for (name, prop) in self.properties(&path, object)? {
                        let p = format!("{path}.{name}");
                        let value = self.string(&p, &prop.value)?;
                        match name.as_str() {
                            "type" => m.kind = Some(value),
                            "source" => m.source = Some(value),
                            "target" => m.target = Some(value),
                            _ => {
                                return Err(self.invalid(
                                    &p,
                                    prop.range,
                                    "is not a mount property (type, source, target)",
                                ));
                            }
                        }
                    }
                    m
                }
                other => return Err(self.wrong_type(&path, other, "a string or an object")),
            };
            if !self.is_the_workspace(&m) {
                return Err(self.unsupported(
                    &path,
                    range,
                    format!(
                        "{} cannot be expressed: a run has one mount, its workspace (a bind of the workspace folder at {} is the only mount accepted here)",
                        m.describe(),
                        self.spec.workspace.path
                    ),
                ));
            }
        }
        Ok(())
    }

    /// A bind of the workspace's host folder at the workspace path: what the run has anyway.
    fn is_the_workspace(&self, m: &Mount) -> bool {
        let Ok((source, target)) = m.workspace_bind() else {
            return false;
        };
        let same_source = self.spec.workspace.host_dir.as_ref().is_some_and(|dir| {
            let a = std::fs::canonicalize(&source).unwrap_or_else(|_| PathBuf::from(&source));
            let b = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.clone());
            a == b
        });
        same_source
            && target.trim_end_matches('/') == self.spec.workspace.path.trim_end_matches('/')
    }

    fn map_command(&mut self, name: &str, value: &Value<'a>) -> Result<()> {
        match value {
            Value::Object(object) => {
                for (key, prop) in self.properties(name, object)? {
                    let path = key_path(name, &key);
                    match &prop.value {
                        Value::StringLit(_) | Value::Array(_) => {
                            self.push_command(&path, &prop.value)?
                        }
                        other => {
                            return Err(self.wrong_type(
                                &path,
                                other,
                                "a string or an array of strings",
                            ));
                        }
                    }
                }
                Ok(())
            }
            Value::StringLit(_) | Value::Array(_) => self.push_command(name, value),
            other => {
                Err(self.wrong_type(name, other, "a string, an array of strings or an object"))
            }
        }
    }

    fn push_command(&mut self, path: &str, value: &Value<'a>) -> Result<()> {
        let argv = match value {
            Value::StringLit(_) => {
                let script = self.string(path, value)?;
                if script.trim().is_empty() {
                    return Ok(());
                }
                vec!["sh".to_string(), "-c".to_string(), script]
            }
            Value::Array(array) => {
                let mut argv = Vec::with_capacity(array.elements.len());
                for (i, element) in array.elements.iter().enumerate() {
                    argv.push(self.string(&format!("{path}[{i}]"), element)?);
                }
                if argv.is_empty() {
                    return Ok(());
                }
                argv
            }
            _ => unreachable!("checked by the caller"),
        };
        self.spec.post_create.push(argv);
        self.cmd_origin.push((path.to_string(), value_range(value)));
        Ok(())
    }

    /// The spec, validated; a rejected field is reported as the property it came from.
    fn validated(mut self) -> Result<RunSpec> {
        for (i, origin) in self.env_origin.iter().enumerate() {
            self.origins.insert(format!("env[{i}]"), origin.clone());
        }
        if let Some(last) = self.env_origin.last() {
            let top = last
                .0
                .split(['[', '.'])
                .next()
                .unwrap_or_default()
                .to_string();
            self.origins.insert("env".into(), (top, last.1));
        }
        for (i, origin) in self.cap_origin.iter().enumerate() {
            self.origins
                .insert(format!("security.cap_drop[{i}]"), origin.clone());
        }
        for (i, origin) in self.cmd_origin.iter().enumerate() {
            self.origins
                .insert(format!("post_create[{i}]"), origin.clone());
        }
        let Err(e) = self.spec.validate() else {
            return Ok(self.spec);
        };
        let spec_field = e.field().unwrap_or_default().to_string();
        let (path, range) = self
            .origins
            .iter()
            .filter(|(key, _)| {
                spec_field == **key
                    || spec_field
                        .strip_prefix(key.as_str())
                        .is_some_and(|rest| rest.starts_with(['.', '[']))
            })
            .max_by_key(|(key, _)| key.len())
            .map(|(_, origin)| origin.clone())
            .unwrap_or((String::new(), Range::new(0, 0)));
        let mut mapped = self.error(e.kind(), &path, range, e.message());
        if !spec_field.is_empty() {
            mapped = mapped.with("spec field", spec_field);
        }
        Err(mapped)
    }
}

/// 1-based line and column (in characters) of a byte offset.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let mut offset = offset.min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let column = before
        .rsplit('\n')
        .next()
        .unwrap_or_default()
        .chars()
        .count()
        + 1;
    (line, column)
}

/// The known property closest to a misspelt one.
fn closest(name: &str) -> Option<&'static str> {
    let known = MAPPED
        .iter()
        .chain(IGNORED)
        .copied()
        .chain(UNSUPPORTED.iter().map(|(n, _)| *n));
    known
        .map(|k| (edit_distance(&name.to_lowercase(), &k.to_lowercase()), k))
        .filter(|(d, k)| *d <= 3.max(k.len() / 4))
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = if ca == *cb {
                prev
            } else {
                1 + prev.min(cur).min(row[j])
            };
            prev = cur;
        }
    }
    row[b.len()]
}

/// A size in `hostRequirements`: digits, then `kb`, `mb`, `gb` or `tb` (powers of 1024) or
/// nothing (bytes), any case.
fn host_size(text: &str) -> Option<u64> {
    let lower = text.trim().to_ascii_lowercase();
    let digits_end = lower
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(lower.len());
    let (digits, unit) = lower.split_at(digits_end);
    let n: u64 = digits.parse().ok()?;
    let shift = match unit {
        "" => 0,
        "kb" => 10,
        "mb" => 20,
        "gb" => 30,
        "tb" => 40,
        _ => return None,
    };
    n.checked_mul(1 << shift)
}

/// A size as Docker's `--memory` takes it: a number (with decimals), then `b`, `k`, `m`,
/// `g`, `t` or `p` (powers of 1024), optionally with `i` and `b` after, any case.
fn docker_size(text: &str) -> Option<u64> {
    let lower = text.trim().to_ascii_lowercase();
    let number_end = lower
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(lower.len());
    let (number, unit) = lower.split_at(number_end);
    if number.is_empty() || number.starts_with('.') || number.ends_with('.') {
        return None;
    }
    let n: f64 = number.parse().ok()?;
    let unit = unit.trim_start();
    let unit = unit.strip_suffix('b').unwrap_or(unit);
    let unit = unit.strip_suffix('i').unwrap_or(unit);
    let shift = match unit {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        "p" => 50,
        _ => return None,
    };
    let bytes = n * (1u64 << shift) as f64;
    (bytes.is_finite() && bytes < u64::MAX as f64).then_some(bytes as u64)
}

/// A `runArgs` flag runcell can express.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RunFlag {
    Env,
    User,
    Workdir,
    Memory,
    Cpus,
    Pids,
    Network,
    CapDrop,
    SecurityOpt,
    Label,
    ReadOnly,
    Init,
}

impl RunFlag {
    fn of(flag: &str) -> Option<RunFlag> {
        Some(match flag {
            "-e" | "--env" => RunFlag::Env,
            "-u" | "--user" => RunFlag::User,
            "-w" | "--workdir" => RunFlag::Workdir,
            "-m" | "--memory" => RunFlag::Memory,
            "--cpus" => RunFlag::Cpus,
            "--pids-limit" => RunFlag::Pids,
            "--network" | "--net" => RunFlag::Network,
            "--cap-drop" => RunFlag::CapDrop,
            "--security-opt" => RunFlag::SecurityOpt,
            "-l" | "--label" => RunFlag::Label,
            "--read-only" => RunFlag::ReadOnly,
            "--init" => RunFlag::Init,
            _ => return None,
        })
    }

    /// A flag without a value (`--read-only`, `--init`; `=true`/`=false` allowed).
    fn is_switch(self) -> bool {
        matches!(self, RunFlag::ReadOnly | RunFlag::Init)
    }
}

/// `--flag=value` → (`--flag`, `value`); `-fvalue` and `-f=value` → (`-f`, `value`) for the
/// one-letter flags runcell knows; anything else as it is.
fn split_flag(arg: &str) -> (&str, Option<String>) {
    if let Some(long) = arg.strip_prefix("--") {
        return match long.split_once('=') {
            Some((name, value)) => (&arg[..2 + name.len()], Some(value.to_string())),
            None => (arg, None),
        };
    }
    if arg.len() > 2
        && arg.is_char_boundary(2)
        && matches!(&arg[..2], "-e" | "-u" | "-w" | "-m" | "-l")
    {
        let value = &arg[2..];
        return (
            &arg[..2],
            Some(value.strip_prefix('=').unwrap_or(value).to_string()),
        );
    }
    (arg, None)
}

/// A mount as `--mount` takes it (`type=bind,source=...,target=...`) or as an object.
#[derive(Debug, Default)]
struct Mount {
    kind: Option<String>,
    source: Option<String>,
    target: Option<String>,
    read_only: bool,
    /// Options runcell cannot honour (`bind-propagation`, `volume-*`...).
    other: Vec<String>,
}

impl Mount {
    fn parse(text: &str) -> std::result::Result<Mount, String> {
        let mut m = Mount::default();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = match part.split_once('=') {
                Some((k, v)) => (k.trim(), Some(v.trim().to_string())),
                None => (part, None),
            };
            match (key, value) {
                ("type", Some(v)) => m.kind = Some(v),
                ("source" | "src", Some(v)) => m.source = Some(v),
                ("target" | "destination" | "dst", Some(v)) => m.target = Some(v),
                ("readonly" | "ro", v) => {
                    m.read_only = !matches!(v.as_deref(), Some("false" | "0"));
                }
                // macOS file-sharing tuning, without effect elsewhere.
                ("consistency", Some(_)) => {}
                (other, _) => m.other.push(other.to_string()),
            }
        }
        if m.target.is_none() {
            return Err(format!("{text:?} is not a mount: it has no target"));
        }
        Ok(m)
    }

    /// The host folder and the path of a plain read-write bind mount.
    fn workspace_bind(&self) -> std::result::Result<(String, String), String> {
        // `--mount` without a type is a volume.
        let kind = self.kind.as_deref().unwrap_or("volume");
        if kind != "bind" {
            return Err(format!(
                "{} cannot be expressed: only a bind of the workspace folder is",
                self.describe()
            ));
        }
        if self.read_only {
            return Err("a read-only workspace is not supported".into());
        }
        if let Some(option) = self.other.first() {
            return Err(format!("the mount option {option:?} is not supported"));
        }
        let source = self.source.clone().ok_or("a bind mount needs a source")?;
        if !source.starts_with('/') {
            return Err(format!(
                "the bind source {source:?} is not an absolute host path"
            ));
        }
        let target = self.target.clone().unwrap_or_default();
        Ok((source, target))
    }

    fn describe(&self) -> String {
        let kind = self.kind.as_deref().unwrap_or("volume");
        let target = self.target.as_deref().unwrap_or("?");
        match &self.source {
            Some(source) => format!("a {kind} mount of {source} at {target}"),
            None => format!("a {kind} mount at {target}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn testdata(case: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("testdata/devcontainer")
            .join(case)
    }

    /// `case`'s `.devcontainer/devcontainer.json` (or `file` in it), with a fixed local env.
    fn load_case(case: &str, file: &str) -> Result<RunSpec> {
        let path = testdata(case).join(file);
        let cx = Context::for_file(&path)?.local_env([("HOME", "/home/dev")]);
        parse(&std::fs::read_to_string(&path).unwrap(), &cx)
    }

    /// The host folder as `<testdata>/...`, the same on every machine.
    macro_rules! assert_spec_snapshot {
        ($name:literal, $spec:expr) => {
            insta::assert_yaml_snapshot!($name, $spec, {
                ".workspace.host_dir" => insta::dynamic_redaction(|value, _| {
                    let root = std::fs::canonicalize(testdata("")).unwrap();
                    let path = PathBuf::from(value.as_str().unwrap());
                    format!("<testdata>/{}", path.strip_prefix(&root).unwrap().display())
                }),
            })
        };
    }

    /// An error of `text` in a folder that exists.
    fn error_of(text: &str) -> Error {
        let folder = testdata("python-app");
        let cx = Context::new(folder.join(".devcontainer/devcontainer.json"), &folder)
            .local_env([("SECRET_TOKEN", "s3cr3t")]);
        parse(text, &cx).expect_err(text)
    }

    fn spec_of(text: &str) -> RunSpec {
        let folder = testdata("python-app");
        let cx = Context::new(folder.join(".devcontainer/devcontainer.json"), &folder)
            .local_env([("SECRET_TOKEN", "s3cr3t")]);
        parse(text, &cx).unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    #[test]
    fn hostile_files_fail_fast_without_exhausting_the_stack() {
        // 500 000 levels would overflow the parser's stack; refused before parsing.
        let deep = format!(
            "{{\"image\": \"x\", \"a\": {}1{}}}",
            "[".repeat(500_000),
            "]".repeat(500_000)
        );
        let e = error_of(&deep);
        assert_eq!(e.field(), Some("devcontainer"));
        assert!(e.to_string().contains("deeper than 64"), "{e}");
        // Brackets in strings and comments do not count.
        let spec = spec_of(&format!(
            "{{\"image\": \"x\", // {}\n \"containerEnv\": {{\"A\": \"{}\"}}}}",
            "[".repeat(100),
            "{".repeat(100)
        ));
        assert_eq!(spec.image, "x");
        // Larger than the bound: refused unread.
        let e = error_of(&format!(
            "{{\"image\": \"x\", \"x\": \"{}\"}}",
            "y".repeat(5 << 20)
        ));
        assert!(e.to_string().contains("bytes read"), "{e}");
    }

    #[test]
    fn python_with_a_post_create_string_and_remote_user() {
        // Through the public entry point, from the project folder.
        let spec = RunSpec::from_devcontainer(testdata("python-app")).unwrap();
        assert_eq!(
            spec,
            load_case("python-app", ".devcontainer/devcontainer.json").unwrap()
        );
        assert_eq!(
            spec,
            RunSpec::from_devcontainer(testdata("python-app/.devcontainer/devcontainer.json"))
                .unwrap()
        );
        assert_spec_snapshot!("python_app", spec);
    }

    #[test]
    fn node_with_comments_trailing_commas_named_commands_and_local_env() {
        let spec = load_case("node-app", ".devcontainer/devcontainer.json").unwrap();
        assert_spec_snapshot!("node_app", spec);
    }

    #[test]
    fn run_args_host_requirements_and_workspace_folder() {
        let spec = load_case("rust-workspace", ".devcontainer/devcontainer.json").unwrap();
        assert_spec_snapshot!("rust_workspace", spec);
    }

    #[test]
    fn a_subfolder_configuration_mounting_its_repository() {
        let spec = load_case(
            "monorepo/services/api",
            ".devcontainer/api/devcontainer.json",
        )
        .unwrap();
        assert_eq!(
            spec.workspace.host_dir,
            Some(std::fs::canonicalize(testdata("monorepo")).unwrap())
        );
        assert_spec_snapshot!("monorepo_api", spec);
    }

    #[test]
    fn build_and_features_are_unsupported_naming_the_property() {
        for (case, field, line) in [
            ("build-config", "devcontainer.build", "3"),
            ("features-config", "devcontainer.features", "3"),
        ] {
            let e = RunSpec::from_devcontainer(testdata(case)).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
            assert_eq!(e.field(), Some(field), "{e}");
            assert_eq!(e.context_value("line"), Some(line), "{e}");
            let file = e.context_value("file").unwrap();
            assert!(
                file.ends_with(&format!("{case}/.devcontainer/devcontainer.json")),
                "{e}"
            );
        }
        let e = RunSpec::from_devcontainer(testdata("features-config")).unwrap_err();
        assert!(
            e.message()
                .contains("ghcr.io/devcontainers/features/node:1"),
            "{e}"
        );
    }

    #[test]
    fn an_unknown_property_is_an_error_with_the_closest_name() {
        let e = RunSpec::from_devcontainer(testdata("typo-config")).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidSpec, "{e}");
        assert_eq!(e.field(), Some("devcontainer.postCreateComand"));
        assert!(
            e.message().contains("did you mean `postCreateCommand`"),
            "{e}"
        );
        assert_eq!(e.context_value("line"), Some("4"));
        assert_eq!(e.context_value("column"), Some("2"));
    }

    #[test]
    fn syntax_errors_point_at_line_and_column() {
        let e = error_of("{\n  \"image\": \"busybox\",\n  \"name\" \"x\"\n}");
        assert_eq!(e.kind(), ErrorKind::InvalidSpec);
        assert_eq!(e.field(), Some("devcontainer"));
        assert_eq!(e.context_value("line"), Some("3"), "{e}");
        assert_eq!(e.context_value("column"), Some("10"), "{e}");
        assert!(e.to_string().contains("devcontainer.json"), "{e}");
        // JSONC, not JSON5: no single quotes, no bare keys, no hex.
        for text in [
            "{'image': 'x'}",
            "{image: \"x\"}",
            "{\"image\": \"x\", \"hostRequirements\": {\"cpus\": 0x2}}",
            "",
            "{\"image\": \"x\"} {}",
        ] {
            let e = error_of(text);
            assert_eq!(e.field(), Some("devcontainer"), "{text}: {e}");
            assert!(e.context_value("line").is_some(), "{text}: {e}");
        }
        let e = error_of("[\"image\"]");
        assert_eq!(e.field(), Some("devcontainer"), "{e}");
        assert!(e.message().contains("JSON object"), "{e}");
    }

    #[test]
    fn each_refusal_names_its_property() {
        // KIND FIELD | TEXT: I for InvalidSpec, U for Unsupported; FIELD after
        // `devcontainer.`; TEXT inside `{"image": "x", ...}` unless it is an object itself.
        let cases = r#"
            I image                    | {"name": "x"}
            I image                    | {"image": 3}
            I image                    | {"image": "x", "image": "y"}
            I image                    | {"image": "Not/An/Image"}
            U dockerComposeFile        | "dockerComposeFile": "c.yml", "service": "app"
            U dockerFile               | "dockerFile": "Dockerfile"
            U initializeCommand        | "initializeCommand": "echo host"
            U privileged               | "privileged": true
            I privileged               | "privileged": "yes"
            U capAdd[0]                | "capAdd": ["SYS_PTRACE"]
            U securityOpt[0]           | "securityOpt": ["seccomp=unconfined"]
            U overrideCommand          | "overrideCommand": false
            U appPort                  | "appPort": [3000]
            U features                 | "features": {"ghcr.io/devcontainers/features/git:1": {}}
            I features                 | "features": []
            I remoteenv                | "remoteenv": {}
            U hostRequirements.gpu     | "hostRequirements": {"gpu": true}
            I hostRequirements.memory  | "hostRequirements": {"memory": "lots"}
            I hostRequirements.cpu     | "hostRequirements": {"cpu": 2}
            I hostRequirements.cpus    | "hostRequirements": {"cpus": 0}
            I runArgs                  | "runArgs": "--init"
            U runArgs[2]               | "runArgs": ["--env", "A=1", "--privileged"]
            U runArgs[0]               | "runArgs": ["--cap-add=SYS_PTRACE"]
            U runArgs[0]               | "runArgs": ["--network=host"]
            U runArgs[1]               | "runArgs": ["--security-opt", "seccomp=unconfined"]
            U runArgs[0]               | "runArgs": ["-v", "/a:/b"]
            U runArgs[0]               | "runArgs": ["image-name"]
            I runArgs[0]               | "runArgs": ["--memory"]
            I runArgs[1]               | "runArgs": ["--memory", "lots"]
            I runArgs[0]               | "runArgs": ["--cpus=0"]
            I runArgs[3]               | "runArgs": ["-e", "A=1", "--label", "bad key=v"]
            I runArgs[1]               | "runArgs": ["--cap-drop", "net raw"]
            U mounts[0]                | "mounts": ["source=m,target=/workspaces/python-app/m,type=volume"]
            U mounts[0]                | "mounts": ["source=/etc,target=/host-etc,type=bind"]
            U mounts[0]                | "mounts": [{"source": "${localWorkspaceFolder}", "target": "/x", "type": "bind"}]
            U mounts[0]                | "mounts": ["src=${localWorkspaceFolder},dst=${containerWorkspaceFolder},type=bind,ro"]
            U workspaceMount           | "workspaceMount": "source=ws,target=/ws,type=volume"
            I workspaceMount           | "workspaceMount": "type=bind,source=/x"
            I workspaceFolder          | "workspaceFolder": "src"
            I workspaceFolder          | "workspaceFolder": "/tmp/ws"
            I workspaceFolder          | "workspaceFolder": "${containerWorkspaceFolder}/x"
            I containerEnv["A=B"]      | "containerEnv": {"A=B": "1"}
            I containerEnv["A"]        | "containerEnv": {"A": 1}
            I containerEnv["A"]        | "containerEnv": {"A": null}
            U containerEnv["A"]        | "containerEnv": {"A": "${containerEnv:B}"}
            U containerEnv["ID"]       | "containerEnv": {"ID": "${devcontainerId}"}
            U remoteEnv["PATH"]        | "remoteEnv": {"PATH": "${containerEnv:PATH}:/opt/bin"}
            U postCreateCommand        | "postCreateCommand": "echo ${containerEnv:HOME}"
            I remoteUser               | "remoteUser": "a b"
            I containerUser            | "containerUser": "-root"
            I postCreateCommand        | "postCreateCommand": 42
            I postCreateCommand        | "postCreateCommand": ["", "x"]
            I postCreateCommand[1]     | "postCreateCommand": ["echo", 1]
            I postStartCommand["b"]    | "postStartCommand": {"a": "true", "b": ["echo", "a\u0000b"]}
            I onCreateCommand["a"]     | "onCreateCommand": {"a": null}
        "#;
        for line in cases.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let (head, body) = line.split_once(" | ").unwrap();
            let (kind, field) = head.trim().split_once(' ').unwrap();
            let kind = if kind == "I" {
                ErrorKind::InvalidSpec
            } else {
                ErrorKind::Unsupported
            };
            let text = if body.starts_with('{') {
                body.to_string()
            } else {
                format!(r#"{{"image": "x", {body}}}"#)
            };
            let e = error_of(&text);
            let field = format!("devcontainer.{field}");
            assert_eq!(
                (e.kind(), e.field()),
                (kind, Some(field.as_str())),
                "{text}: {e}"
            );
            assert!(
                e.context_value("file")
                    .unwrap()
                    .ends_with("devcontainer.json"),
                "{e}"
            );
            assert!(e.context_value("line").is_some(), "{text}: {e}");
        }
        let e = error_of(r#"{"image": "x", "remoteenv": {}}"#);
        assert!(e.message().contains("did you mean `remoteEnv`"), "{e}");
        let e = error_of(r#"{"image": "x", "workspaceFolder": "/tmp/ws"}"#);
        assert_eq!(e.context_value("spec field"), Some("workspace.path"), "{e}");
    }

    #[test]
    fn errors_never_echo_environment_values() {
        for text in [
            r#"{"image": "x", "containerEnv": {"T": "${localEnv:SECRET_TOKEN}\u0000"}}"#,
            r#"{"image": "x", "remoteEnv": {"T": "${localEnv:SECRET_TOKEN}\u0000"}}"#,
        ] {
            let e = error_of(text);
            assert!(!format!("{e} {e:?}").contains("s3cr3t"), "{e:?}");
        }
        let cx =
            Context::new("/x/.devcontainer/devcontainer.json", "/x").local_env([("T", "s3cr3t")]);
        assert!(!format!("{cx:?}").contains("s3cr3t"), "{cx:?}");
    }

    #[test]
    fn variables_resolve_or_stay_for_the_shell() {
        let spec = spec_of(
            r#"{
                "image": "busybox:${localEnv:TAG:1.36}",
                "containerEnv": {
                    "TOKEN": "${localEnv:SECRET_TOKEN}",
                    "OLD_FORM": "${env:SECRET_TOKEN}",
                    "UNSET": "[${localEnv:NOT_SET_ANYWHERE}]",
                    "URL": "${localEnv:NOT_SET:http://mirror:8080/x}",
                    "NAMES": "${localWorkspaceFolderBasename} ${containerWorkspaceFolderBasename}",
                    "UNTERMINATED": "${localEnv:SECRET_TOKEN",
                },
                "remoteEnv": { "FROM_CONTAINER": "${containerEnv:TOKEN}-x" },
                "postCreateCommand": "echo ${HOME} $${PATH} ${localWorkspaceFolderBasename}",
            }"#,
        );
        assert_eq!(spec.image, "busybox:1.36");
        let env: BTreeMap<_, _> = spec.env.iter().cloned().collect();
        assert_eq!(env["TOKEN"], "s3cr3t");
        assert_eq!(env["OLD_FORM"], "s3cr3t");
        assert_eq!(env["UNSET"], "[]");
        assert_eq!(env["URL"], "http://mirror:8080/x");
        assert_eq!(env["NAMES"], "python-app python-app");
        assert_eq!(env["UNTERMINATED"], "${localEnv:SECRET_TOKEN");
        assert_eq!(env["FROM_CONTAINER"], "s3cr3t-x");
        assert_eq!(
            spec.post_create,
            [["sh", "-c", "echo ${HOME} $${PATH} python-app"]]
        );
    }

    #[test]
    fn env_layers_and_null_unsets() {
        let spec = spec_of(
            r#"{
                "image": "x",
                "containerEnv": { "A": "container", "B": "container", "C": "container" },
                "runArgs": ["-e", "B=run-arg", "--env", "SECRET_TOKEN", "-e", "NOT_SET_ANYWHERE"],
                "remoteEnv": { "C": "remote", "A": null, "D": "remote" },
            }"#,
        );
        assert_eq!(
            spec.env,
            [
                ("B".to_string(), "run-arg".to_string()),
                ("SECRET_TOKEN".into(), "s3cr3t".into()),
                ("C".into(), "remote".into()),
                ("D".into(), "remote".into()),
            ]
        );
    }

    #[test]
    fn users_resources_and_flags_take_their_precedence() {
        let spec = spec_of(
            r#"{
                "image": "x",
                "containerUser": "1000",
                "runArgs": ["-u", "2000", "--cpus=1.5", "-m512m", "--pids-limit=-1", "--net=none",
                            "--read-only=false", "-w=/workspaces/python-app/src", "--security-opt=no-new-privileges:true",
                            "-lowner=me", "--label", "bare"],
                "hostRequirements": { "cpus": 8, "memory": "16gb", "gpu": "optional", "storage": "64GB" },
            }"#,
        );
        assert_eq!(spec.user.as_deref(), Some("1000"));
        assert_eq!(spec.resources.cpus, Some(1.5));
        assert_eq!(spec.resources.memory_bytes, Some(512 << 20));
        assert_eq!(spec.resources.pids, None);
        assert_eq!(spec.network, Network::None);
        assert!(!spec.security.read_only_rootfs);
        assert!(spec.security.no_new_privileges);
        assert_eq!(
            spec.working_dir.as_deref(),
            Some("/workspaces/python-app/src")
        );
        assert_eq!(spec.labels["owner"], "me");
        assert_eq!(spec.labels["bare"], "");
        let spec = spec_of(r#"{"image": "x", "containerUser": "1000", "remoteUser": "vscode"}"#);
        assert_eq!(spec.user.as_deref(), Some("vscode"));
        // The devcontainer defaults: no no-new-privileges (sudo works), nothing else added.
        let spec = spec_of(r#"{"image": "x"}"#);
        assert!(!spec.security.no_new_privileges);
        assert_eq!(spec.workspace.path, "/workspaces/python-app");
        assert_eq!(spec.workspace.host_dir, Some(testdata("python-app")));
        assert!(spec.post_create.is_empty() && spec.env.is_empty() && spec.labels.is_empty());
        // Values accepted and mapped to nothing.
        let spec = spec_of(
            r#"{"image": "x", "privileged": false, "capAdd": [], "features": {}, "appPort": [],
                "init": false, "overrideCommand": true, "hostRequirements": {"gpu": false},
                "postCreateCommand": "", "postStartCommand": [], "postAttachCommand": {},
                "securityOpt": ["no-new-privileges=false"]}"#,
        );
        assert_eq!(spec, {
            let mut s = RunSpec::new("x").workspace_dir(testdata("python-app"));
            s.workspace.path = "/workspaces/python-app".into();
            s.security.no_new_privileges = false;
            s
        });
    }

    #[test]
    fn lifecycle_commands_run_in_lifecycle_order() {
        let spec = spec_of(
            r#"{
                "image": "x",
                "postAttachCommand": "attach",
                "postStartCommand": ["start", "${containerWorkspaceFolder}"],
                "postCreateCommand": { "z": "create z", "a": ["create", "a"] },
                "updateContentCommand": "update",
                "onCreateCommand": "on create",
            }"#,
        );
        let sh = |s: &str| vec!["sh".to_string(), "-c".into(), s.into()];
        assert_eq!(
            spec.post_create,
            [
                sh("on create"),
                sh("update"),
                sh("create z"),
                vec!["create".to_string(), "a".into()],
                vec!["start".to_string(), "/workspaces/python-app".into()],
                sh("attach"),
            ]
        );
    }

    /// `workspaceMount` binds the project (its folder, or up to its repository's root)
    /// and nothing else unless the caller opts in; system folders never.
    #[test]
    fn a_workspace_mount_outside_the_project_needs_the_callers_opt_in() {
        let base = std::env::temp_dir().join(format!("runcell-dc-mounts-{}", std::process::id()));
        let project = base.join("repo/services/api");
        for dir in [
            project.join("src"),
            base.join("repo/.git"),
            base.join("repo/other"),
            base.join("outside"),
        ] {
            std::fs::create_dir_all(dir).unwrap();
        }
        let base = std::fs::canonicalize(&base).unwrap();
        std::os::unix::fs::symlink(base.join("outside"), project.join("link")).unwrap();
        let result = std::panic::catch_unwind(|| {
            let project = base.join("repo/services/api");
            let map = |source: &str, allow: bool| {
                let cx = Context::new(project.join(".devcontainer/devcontainer.json"), &project)
                    .allow_mounts_outside_project(allow);
                let text = format!(
                    r#"{{"image": "x", "workspaceMount": "type=bind,source={source},target=/ws"}}"#
                );
                parse(&text, &cx)
            };
            let inside = [
                "${localWorkspaceFolder}".to_string(),
                "${localWorkspaceFolder}/src".to_string(),
                "${localWorkspaceFolder}/../..".to_string(),
                base.join("repo/services").display().to_string(),
            ];
            for source in &inside {
                let spec = map(source, false).unwrap_or_else(|e| panic!("{source}: {e}"));
                assert!(
                    spec.workspace.host_dir.unwrap().starts_with(&base),
                    "{source}"
                );
            }
            let outside = [
                "/".to_string(),
                "${localWorkspaceFolder}/../../..".to_string(),
                "${localWorkspaceFolder}/../../other".to_string(),
                base.join("outside").display().to_string(),
                "${localEnv:HOME}".to_string(),
                // A link in the project to a folder outside it.
                "${localWorkspaceFolder}/link".to_string(),
            ];
            for source in &outside {
                let e = map(source, false).unwrap_err();
                assert_eq!(e.kind(), ErrorKind::InvalidSpec, "{source}: {e}");
                assert_eq!(e.field(), Some("devcontainer.workspaceMount"), "{source}");
                assert!(e.message().contains("allow_mounts_outside_project"), "{e}");
            }
            // Opted in: folders outside the project, but never a system folder.
            for source in &outside[1..4] {
                map(source, true).unwrap_or_else(|e| panic!("{source}: {e}"));
            }
            let e = map("/", true).unwrap_err();
            assert_eq!(e.field(), Some("devcontainer.workspaceMount"), "{e}");
            assert!(e.message().contains("system directory"), "{e}");
            // No repository: only the folder and below.
            let lone = base.join("outside");
            std::fs::create_dir_all(lone.join("sub")).unwrap();
            assert!(in_project(&lone.join("sub"), &lone));
            assert!(!in_project(&base, &lone));
        });
        std::fs::remove_dir_all(&base).unwrap();
        if let Err(panic) = result {
            std::panic::resume_unwind(panic);
        }
    }

    #[test]
    fn files_are_found_where_the_reference_puts_them() {
        let root =
            std::env::temp_dir().join(format!("runcell-devcontainer-{}", std::process::id()));
        let project = root.join("my-project");
        std::fs::create_dir_all(project.join(".devcontainer/gpu")).unwrap();
        let result = std::panic::catch_unwind(|| {
            let e = RunSpec::from_devcontainer(&project).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
            let e = RunSpec::from_devcontainer(project.join("nope.json")).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");

            std::fs::write(
                project.join(".devcontainer.json"),
                r#"{"image": "root-file"}"#,
            )
            .unwrap();
            let spec = RunSpec::from_devcontainer(&project).unwrap();
            assert_eq!(spec.image, "root-file");
            assert_eq!(spec.workspace.path, "/workspaces/my-project");
            let folder = std::fs::canonicalize(&project).unwrap();
            assert_eq!(spec.workspace.host_dir.as_deref(), Some(folder.as_path()));

            // .devcontainer/devcontainer.json comes first.
            std::fs::write(
                project.join(".devcontainer/devcontainer.json"),
                r#"{"image": "in-folder"}"#,
            )
            .unwrap();
            assert_eq!(
                RunSpec::from_devcontainer(&project).unwrap().image,
                "in-folder"
            );

            let gpu = project.join(".devcontainer/gpu/devcontainer.json");
            std::fs::write(&gpu, r#"{"image": "sub"}"#).unwrap();
            let spec = RunSpec::from_devcontainer(&gpu).unwrap();
            assert_eq!(spec.image, "sub");
            assert_eq!(spec.workspace.host_dir.as_deref(), Some(folder.as_path()));

            // Anywhere else the folder cannot be told.
            let loose = root.join("loose.json");
            std::fs::write(&loose, r#"{"image": "x"}"#).unwrap();
            let e = RunSpec::from_devcontainer(&loose).unwrap_err();
            assert_eq!(
                (e.kind(), e.field()),
                (ErrorKind::InvalidSpec, Some("devcontainer")),
                "{e}"
            );
        });
        std::fs::remove_dir_all(&root).unwrap();
        if let Err(panic) = result {
            std::panic::resume_unwind(panic);
        }
    }

    #[test]
    fn sizes_follow_their_formats() {
        assert_eq!(host_size("8gb"), Some(8 << 30));
        assert_eq!(host_size("512MB"), Some(512 << 20));
        assert_eq!(host_size("1tb"), Some(1 << 40));
        assert_eq!(host_size("4096"), Some(4096));
        for bad in ["", "gb", "8 gb", "8g", "1.5gb", "-1gb", "99999999999999tb"] {
            assert_eq!(host_size(bad), None, "{bad}");
        }
        assert_eq!(docker_size("512m"), Some(512 << 20));
        assert_eq!(docker_size("1.5g"), Some(3 << 29));
        assert_eq!(docker_size("2GiB"), Some(2 << 30));
        assert_eq!(docker_size("2 GB"), Some(2 << 30));
        assert_eq!(docker_size("1024"), Some(1024));
        assert_eq!(docker_size("64k"), Some(64 << 10));
        for bad in ["", "m", ".5g", "1.g", "1x", "1e9", "-1m", "99999999999p"] {
            assert_eq!(docker_size(bad), None, "{bad}");
        }
    }

    #[test]
    fn flags_split_as_the_docker_cli_splits_them() {
        assert_eq!(split_flag("--env=A=1"), ("--env", Some("A=1".into())));
        assert_eq!(split_flag("--env"), ("--env", None));
        assert_eq!(split_flag("-eA=1"), ("-e", Some("A=1".into())));
        assert_eq!(split_flag("-e=A=1"), ("-e", Some("A=1".into())));
        assert_eq!(split_flag("-e"), ("-e", None));
        assert_eq!(split_flag("-it"), ("-it", None));
        assert_eq!(split_flag("-é"), ("-é", None));
    }
}
