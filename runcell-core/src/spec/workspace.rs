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
    /// workspace that lives as long as the run. The run may write anything there (its code
    /// may be root), so `/` and system directories (`/etc`, `/usr/bin`, `/var`, `/home`,
    /// the home directory itself, ...) are refused.
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
    /// uses) and `host_dir` (an existing absolute directory, symlinks resolved, that is not
    /// a system directory), naming `workspace.path` or `workspace.host_dir`.
    pub(crate) fn validate(&self) -> Result<()> {
        validate_abs_path("workspace.path", &self.path)?;
        let ws = self.path.trim_end_matches('/');
        if ws.is_empty() || self.path.split('/').any(|c| c == ".." || c == ".") {
            return Err(Error::invalid_spec(
                "workspace.path",
                "must be a directory below / without . or .. components",
            ));
        }
        for reserved in [
            "/tmp",
            crate::ca::DIR,
            crate::HELPER_DIR,
            "/proc",
            "/sys",
            "/dev",
        ] {
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
            // The directory as the engine will find it: symlinks and `..` resolved.
            let real = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.clone());
            let home = std::env::var_os("HOME")
                .filter(|h| !h.is_empty())
                .map(|h| std::fs::canonicalize(&h).unwrap_or_else(|_| PathBuf::from(h)));
            if let Some(why) = system_dir(&real, home.as_deref()) {
                return Err(Error::invalid_spec(
                    "workspace.host_dir",
                    format!(
                        "{} {why}: the sandbox may write anything there (its code may run as root), so a workspace is a project's own folder",
                        real.display()
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Host directories that hold the system itself, with everything below them: a workspace
/// there hands the sandbox the host's programs, libraries, configuration, boot files or
/// kernel interfaces.
const SYSTEM_TREES: &[&str] = &[
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/proc",
    // Runtime sockets and state: the engines', the user's agents (`/run/user/UID`).
    "/run",
    "/sbin",
    "/sys",
    "/usr/bin",
    "/usr/include",
    "/usr/lib",
    "/usr/lib32",
    "/usr/lib64",
    "/usr/libexec",
    "/usr/sbin",
    "/usr/share",
    // Container engines' and the kubelet's data: writing there is root on the host.
    "/var/lib/containers",
    "/var/lib/docker",
    "/var/lib/kubelet",
    // macOS
    "/Library",
    "/System",
    "/private/etc",
];

/// Host directories that hold many users' or services' data: refused themselves (their
/// subdirectories, say `/home/me/project` or `/var/lib/ci/job-1`, are fine).
const SHARED_ROOTS: &[&str] = &[
    "/",
    "/home",
    "/media",
    "/mnt",
    "/opt",
    "/root",
    "/snap",
    "/srv",
    "/tmp",
    "/usr",
    "/usr/local",
    "/var",
    "/var/cache",
    "/var/lib",
    "/var/log",
    "/var/spool",
    "/var/tmp",
    "/nix",
    // macOS
    "/Users",
    "/Volumes",
    "/private",
    "/private/tmp",
    "/private/var",
];

/// Folders of the home directory that hold credentials, with everything below them.
const HOME_CREDENTIALS: &[&str] = &[".aws", ".docker", ".gnupg", ".kube", ".ssh"];

/// Why `dir` (absolute, resolved) cannot be a workspace, if it is a system directory:
/// one of [`SYSTEM_TREES`] or below, one of [`SHARED_ROOTS`], the user's home directory
/// `home` itself or the directory holding it (a workspace is a folder in it), or one of
/// its [`HOME_CREDENTIALS`] or below.
fn system_dir(dir: &std::path::Path, home: Option<&std::path::Path>) -> Option<&'static str> {
    if let Some(tree) = SYSTEM_TREES.iter().find(|t| dir.starts_with(t)) {
        return Some(if dir == std::path::Path::new(tree) {
            "is a system directory"
        } else {
            "is inside a system directory"
        });
    }
    if SHARED_ROOTS.iter().any(|r| dir == std::path::Path::new(r)) {
        return Some("is a system directory");
    }
    if let Some(home) = home {
        if dir == home {
            return Some("is the home directory itself");
        }
        if home.parent() == Some(dir) {
            return Some("holds the home directories");
        }
        if HOME_CREDENTIALS
            .iter()
            .any(|c| dir.starts_with(home.join(c)))
        {
            return Some("holds the user's credentials");
        }
    }
    None
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
        let dir = std::env::temp_dir().join(format!("runcell-ws-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ws = Workspace {
            host_dir: Some(dir.clone()),
            path: "/src/".into(),
        };
        let valid = ws.validate();
        std::fs::remove_dir(&dir).unwrap();
        valid.unwrap();
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

    /// The host's root and system directories are never a workspace, however written.
    #[test]
    fn system_directories_are_refused_as_host_dirs() {
        for bad in [
            "/",
            "//",
            "/etc",
            "/etc/..",
            "/usr/../etc/",
            "/proc",
            "/dev",
            "/tmp",
        ] {
            let ws = Workspace {
                host_dir: Some(bad.into()),
                ..Workspace::default()
            };
            let e = ws.validate().unwrap_err();
            assert_eq!(e.kind(), crate::ErrorKind::InvalidSpec, "{bad}");
            assert_eq!(e.field(), Some("workspace.host_dir"), "{bad}");
        }
        // A symlink to / is / (std's temp_dir may itself be a link, as on macOS).
        let link = std::env::temp_dir().join(format!("runcell-root-link-{}", std::process::id()));
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink("/", &link).unwrap();
        let e = Workspace {
            host_dir: Some(link.clone()),
            ..Workspace::default()
        }
        .validate()
        .unwrap_err();
        std::fs::remove_file(&link).unwrap();
        assert_eq!(e.field(), Some("workspace.host_dir"));
    }

    #[test]
    fn the_system_directory_list_spares_project_folders() {
        use std::path::Path;
        let home = Some(Path::new("/home/me"));
        for bad in [
            "/",
            "/etc",
            "/etc/ssh",
            "/usr",
            "/usr/bin",
            "/usr/lib/x",
            "/var",
            "/var/lib",
            "/home",
            "/root",
            "/boot/grub",
            "/sys/fs",
            "/home/me",
            "/run",
            "/run/user/1000",
            "/var/lib/docker/volumes/x",
            "/home/me/.ssh",
            "/home/me/.kube/x",
        ] {
            assert!(system_dir(Path::new(bad), home).is_some(), "{bad}");
        }
        for good in [
            "/home/me/project",
            "/home/other",
            "/root/project",
            "/tmp/x",
            "/var/lib/ci/job-1",
            "/usr/src/app",
            "/usr/local/src/x",
            "/srv/work/run-1",
            "/etcetera",
            "/home/me/.sshx",
            "/home/me/.dotfiles",
        ] {
            assert_eq!(system_dir(Path::new(good), home), None, "{good}");
        }
        // A home elsewhere: it and the directory holding it.
        let home = Some(Path::new("/data/users/me"));
        assert!(system_dir(Path::new("/data/users"), home).is_some());
        assert!(system_dir(Path::new("/data/users/me"), home).is_some());
        assert_eq!(system_dir(Path::new("/data/users/me/p"), home), None);
    }
}
