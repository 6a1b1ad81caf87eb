//! Dev Container configurations (`devcontainer.json`) as a [`RunSpec`]: run where users
//! already are.
//!
//! [`RunSpec::from_devcontainer`](FromDevcontainer::from_devcontainer) (with the
//! [`FromDevcontainer`] trait in scope; the same as [`load`]) reads a project's
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
//! workspace whatever the opt-in (see [`runcell_core::Workspace`]).
//!
//! [devcontainer.json reference]: https://containers.dev/implementors/json_reference/
#![forbid(unsafe_code)]

use std::path::Path;

use runcell_core::{Error, ErrorKind, Result, RunSpec};

mod context;
mod mapper;
mod parse;
#[cfg(test)]
mod tests;

pub use context::Context;
pub use parse::parse;

use context::canonical;
use parse::MAX_FILE_BYTES;

/// [`RunSpec::from_devcontainer`](FromDevcontainer::from_devcontainer): a spec from a Dev
/// Container configuration, with this trait in scope.
pub trait FromDevcontainer: Sized {
    /// The spec of a Dev Container configuration: `path` is a `devcontainer.json` file or a
    /// project folder holding `.devcontainer/devcontainer.json` (or `.devcontainer.json`).
    /// The same as [`load`]; the [crate docs](crate) list what each property becomes and
    /// what is refused.
    ///
    /// ```no_run
    /// # fn demo() -> runcell_core::Result<()> {
    /// use runcell_core::RunSpec;
    /// use runcell_devcontainer::FromDevcontainer as _;
    /// let spec = RunSpec::from_devcontainer(".")?   // ./.devcontainer/devcontainer.json
    ///     .label("team", "agents");
    /// # Ok(()) }
    /// ```
    fn from_devcontainer(path: impl AsRef<Path>) -> Result<Self>;
}

impl FromDevcontainer for RunSpec {
    fn from_devcontainer(path: impl AsRef<Path>) -> Result<RunSpec> {
        load(path)
    }
}

/// Reads a Dev Container configuration and maps it to a spec (see
/// [`RunSpec::from_devcontainer`](FromDevcontainer::from_devcontainer)).
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
/// use runcell_devcontainer as devcontainer;
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
