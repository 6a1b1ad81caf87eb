//! The run's working tree: where it lives inside the sandbox and which host directory
//! backs it.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::env::validate_abs_path;
use crate::error::{Error, Result};

/// The default path of the workspace inside the sandbox.
pub const DEFAULT_WORKSPACE_PATH: &str = "/workspace";

/// The run's working tree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
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

impl Workspace {
    /// Checks `path` (an absolute directory below `/`, away from what the sandbox itself
    /// uses) and `host_dir` (an existing absolute directory), naming `workspace.path` or
    /// `workspace.host_dir`.
    pub(crate) fn validate(&self) -> Result<()> {
        validate_abs_path("workspace.path", &self.path)?;
        let ws = self.path.trim_end_matches('/');
        if ws.is_empty() || self.path.split('/').any(|c| c == ".." || c == ".") {
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
        if let Some(dir) = &self.host_dir {
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
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(ws: Workspace) -> Option<String> {
        ws.validate()
            .err()
            .and_then(|e| e.field().map(str::to_string))
    }

    #[test]
    fn the_default_and_a_host_directory_are_valid() {
        Workspace::default().validate().unwrap();
        let ws = Workspace {
            host_dir: Some(std::env::temp_dir()),
            path: "/src/".into(),
        };
        ws.validate().unwrap();
    }

    #[test]
    fn bad_paths_and_host_dirs_name_their_field() {
        for bad in ["ws", "/", "//", "/tmp/x", "/a/./b", "/dev", "/a\nb"] {
            let ws = Workspace {
                path: bad.into(),
                ..Workspace::default()
            };
            assert_eq!(field_of(ws).as_deref(), Some("workspace.path"), "{bad}");
        }
        for bad in ["relative", "/no/such/dir/for/runcell"] {
            let ws = Workspace {
                host_dir: Some(bad.into()),
                ..Workspace::default()
            };
            assert_eq!(field_of(ws).as_deref(), Some("workspace.host_dir"), "{bad}");
        }
    }
}
