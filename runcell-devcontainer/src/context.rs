//! Where a `devcontainer.json` belongs: the [`Context`] a file is mapped in.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use runcell_core::{Error, ErrorKind, Result};

/// Where a `devcontainer.json` belongs: the file (named in errors), the host workspace
/// folder (`${localWorkspaceFolder}`, the run's `workspace.host_dir`) and the local
/// environment `${localEnv:...}` reads. `Debug` shows the names of a fixed local
/// environment, not its values.
#[derive(Clone)]
pub struct Context {
    pub(crate) file: PathBuf,
    pub(crate) workspace_folder: PathBuf,
    local_env: Option<BTreeMap<String, String>>,
    /// `workspaceMount` may bind a host folder outside the project.
    pub(crate) mounts_outside_project: bool,
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
    /// [module docs](crate#host-folders).
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
    pub(crate) fn local_var(&self, name: &str) -> Option<String> {
        self.local_value(name).filter(|v| !v.is_empty())
    }

    /// A local variable as it is (`runArgs --env NAME` passes an empty value on).
    pub(crate) fn local_value(&self, name: &str) -> Option<String> {
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

pub(crate) fn canonical(path: &Path) -> Result<PathBuf> {
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
