//! The workspace (`workspaceFolder`, `workspaceMount`) and `mounts`: a run has one mount,
//! its workspace, and a `devcontainer.json` may mount only its project unless the caller
//! opts in.

use std::path::{Path, PathBuf};

use jsonc_parser::ast::Value;
use jsonc_parser::common::Range;
use runcell_core::Result;

use super::Mapper;
use crate::parse::value_range;

impl<'a> Mapper<'a> {
    pub(super) fn map_workspace(
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

    pub(super) fn map_mounts(&mut self, mounts: &Value<'a>) -> Result<()> {
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
    use crate::{Context, parse};
    use runcell_core::ErrorKind;

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
}
