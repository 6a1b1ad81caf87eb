//! A `SPAWN` resolved into a plan: the user (and whether the helper switches to it), the
//! environment, the working directory and the program, each checked as the exec's user
//! would meet it. The exec's shepherd is given the plan and only carries it out.

use std::ffi::{OsStr, OsString};
use std::fs;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use crate::Helper;
use crate::proto::{Spawn, SpawnError};
use crate::sys::{self, EACCES, ENOENT, ENOTDIR, EPERM};
use crate::users::{Creds, can_search_as, find_program, resolve_user};

impl Helper {
    /// Resolves user, environment, working directory and program of a `SPAWN`.
    pub(crate) fn plan(&self, sp: &Spawn) -> Result<Plan, (SpawnError, String)> {
        let Some(prog) = sp.argv.first() else {
            return Err((SpawnError::Other, "empty argv".into()));
        };
        if prog.is_empty() {
            return Err((SpawnError::NotFound, "empty program name".into()));
        }
        let creds = match &sp.user {
            Some(u) => Some(resolve_user(u)?),
            None => None,
        };
        let switch = match &creds {
            Some(c) if self.root => Some(c.clone()),
            Some(c) if c.uid == self.uid && c.gid == self.gid => None,
            Some(c) => {
                return Err((
                    SpawnError::UserDenied,
                    format!(
                        "the helper runs as {}:{} and cannot switch to {}:{}",
                        self.uid, self.gid, c.uid, c.gid
                    ),
                ));
            }
            None => None,
        };

        let mut env = self.base_env.clone();
        let mut home_set = false;
        for (k, v) in &sp.env {
            home_set |= k.as_slice() == b"HOME";
            set_env(&mut env, k, v);
        }
        if let (Some(c), false) = (&creds, home_set) {
            set_env(&mut env, b"HOME", &c.home);
        }

        let dir = match &sp.working_dir {
            Some(d) => self.cwd.join(OsStr::from_bytes(d)),
            None => self.cwd.clone(),
        };
        let mut cwd = None;
        if sp.working_dir.is_some() || switch.is_some() {
            let shown = dir.display();
            let m = fs::metadata(&dir).map_err(|e| {
                let kind = match e.raw_os_error() {
                    Some(ENOENT | ENOTDIR) => SpawnError::WorkingDirMissing,
                    Some(EACCES | EPERM) => SpawnError::WorkingDirDenied,
                    _ => SpawnError::Other,
                };
                (kind, format!("working directory {shown}: {e}"))
            })?;
            if !m.is_dir() {
                return Err((
                    SpawnError::WorkingDirMissing,
                    format!("working directory {shown}: not a directory"),
                ));
            }
            let enterable = match &switch {
                Some(c) => can_search_as(&dir, c),
                None => sys::can_execute(&dir),
            };
            if !enterable {
                return Err((
                    SpawnError::WorkingDirDenied,
                    format!("working directory {shown}: permission denied"),
                ));
            }
            if self.cwd_id != Some((m.dev(), m.ino())) {
                cwd = Some(dir.clone());
            }
        }

        // The program is resolved here, so std takes its posix_spawn path (it falls back to
        // fork+exec for a bare name with a PATH of its own) and PATH is the exec's.
        let program = if prog.contains(&b'/') {
            dir.join(OsStr::from_bytes(prog))
        } else {
            let path = env
                .iter()
                .find(|(k, _)| k.as_bytes() == b"PATH")
                .map(|(_, v)| v.as_bytes());
            find_program(prog, path, &dir, switch.as_ref())?
        };
        Ok(Plan {
            program,
            env,
            cwd,
            switch,
        })
    }
}

/// The resolved parts of a `SPAWN`.
pub(crate) struct Plan {
    pub(crate) program: PathBuf,
    pub(crate) env: Vec<(OsString, OsString)>,
    /// Set only when it differs from the helper's own (keeps std's posix_spawn path).
    pub(crate) cwd: Option<PathBuf>,
    /// The user to switch to in the child (the helper runs as root).
    pub(crate) switch: Option<Creds>,
}

/// Sets (or replaces) a variable.
fn set_env(env: &mut Vec<(OsString, OsString)>, k: &[u8], v: &[u8]) {
    let k = OsStr::from_bytes(k);
    let v = OsString::from_vec(v.to_vec());
    match env.iter_mut().find(|(n, _)| n == k) {
        Some(e) => e.1 = v,
        None => env.push((k.to_os_string(), v)),
    }
}

#[cfg(test)]
mod tests {
    use std::fs::Permissions;
    use std::os::unix::fs::PermissionsExt;
    use std::path::Path;

    use super::*;
    use crate::testing::TempDir;

    fn spawn(argv: &[&str]) -> Spawn {
        Spawn {
            argv: argv.iter().map(|a| a.as_bytes().to_vec()).collect(),
            ..Spawn::default()
        }
    }

    fn var<'a>(env: &'a [(OsString, OsString)], k: &str) -> Option<&'a OsStr> {
        env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_os_str())
    }

    fn executable(path: &Path, mode: u32) {
        fs::write(path, "#!/bin/sh\n").unwrap();
        fs::set_permissions(path, Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn set_env_replaces_a_variable_or_appends_it() {
        let mut env = vec![("A".into(), "1".into()), ("B".into(), "2".into())];
        set_env(&mut env, b"B", b"3");
        set_env(&mut env, b"C", b"4");
        set_env(&mut env, b"A", b"");
        let expected: Vec<(OsString, OsString)> = vec![
            ("A".into(), "".into()),
            ("B".into(), "3".into()),
            ("C".into(), "4".into()),
        ];
        assert_eq!(env, expected);
    }

    #[test]
    fn a_plan_needs_a_program() {
        let dir = TempDir::new();
        let h = Helper::for_tests(false, dir.path());
        let err = |sp: &Spawn| h.plan(sp).err().expect("an error");
        assert_eq!(err(&spawn(&[])), (SpawnError::Other, "empty argv".into()));
        assert_eq!(
            err(&spawn(&["", "x"])),
            (SpawnError::NotFound, "empty program name".into())
        );
        assert_eq!(
            err(&spawn(&["no-such-program-here"])).0,
            SpawnError::NotFound
        );
    }

    #[test]
    fn a_plan_resolves_the_program_with_the_execs_path_and_directory() {
        let dir = TempDir::new();
        fs::create_dir_all(dir.join("work/bin")).unwrap();
        executable(&dir.join("work/bin/tool"), 0o755);
        executable(&dir.join("work/local"), 0o755);
        let h = Helper::for_tests(false, dir.path());

        // A bare name on the PATH the exec sets (later settings win).
        let mut sp = spawn(&["tool"]);
        sp.env = vec![
            (b"PATH".to_vec(), b"/nowhere".to_vec()),
            (b"PATH".to_vec(), b"bin".to_vec()),
            (b"EXTRA".to_vec(), b"yes".to_vec()),
        ];
        sp.working_dir = Some(b"work".to_vec());
        let plan = h.plan(&sp).unwrap();
        assert_eq!(plan.program, dir.join("work/bin/tool"));
        assert_eq!(plan.cwd.as_deref(), Some(dir.join("work").as_path()));
        assert_eq!(var(&plan.env, "PATH"), Some(OsStr::new("bin")));
        assert_eq!(var(&plan.env, "EXTRA"), Some(OsStr::new("yes")));
        assert!(plan.switch.is_none());
        // The run's environment is kept.
        let (k, v) = h.base_env.first().expect("the test has an environment");
        assert_eq!(var(&plan.env, k.to_str().unwrap()), Some(v.as_os_str()));

        // A path with a slash is taken from the working directory, not looked up.
        let mut sp = spawn(&["./local"]);
        sp.working_dir = Some(b"work".to_vec());
        assert_eq!(h.plan(&sp).unwrap().program, dir.join("work/./local"));
        let sp = spawn(&["work/local"]);
        let plan = h.plan(&sp).unwrap();
        assert_eq!(plan.program, dir.join("work/local"));
        assert!(plan.cwd.is_none());
    }

    #[test]
    fn a_plan_names_the_working_directory_only_when_it_is_another() {
        let dir = TempDir::new();
        fs::create_dir(dir.join("sub")).unwrap();
        fs::write(dir.join("file"), "").unwrap();
        let h = Helper::for_tests(false, dir.path());
        let with_dir = |d: &Path| {
            let mut sp = spawn(&["/bin/sh"]);
            sp.working_dir = Some(d.as_os_str().as_bytes().to_vec());
            h.plan(&sp)
        };
        // The helper's own directory, by another name: std keeps its posix_spawn path.
        assert!(with_dir(dir.path()).unwrap().cwd.is_none());
        assert!(with_dir(&dir.join("sub/..")).unwrap().cwd.is_none());
        assert_eq!(
            with_dir(&dir.join("sub")).unwrap().cwd,
            Some(dir.join("sub"))
        );
        let (kind, msg) = with_dir(&dir.join("missing")).err().unwrap();
        assert_eq!(kind, SpawnError::WorkingDirMissing);
        assert!(msg.starts_with("working directory "), "{msg}");
        let (kind, msg) = with_dir(&dir.join("file")).err().unwrap();
        assert_eq!(kind, SpawnError::WorkingDirMissing);
        assert!(msg.ends_with("not a directory"), "{msg}");
        let (kind, _) = with_dir(&dir.join("file/below")).err().unwrap();
        assert_eq!(kind, SpawnError::WorkingDirMissing);
    }

    #[test]
    fn a_helper_not_running_as_root_runs_only_its_own_user() {
        let dir = TempDir::new();
        let h = Helper::for_tests(false, dir.path());
        let mut sp = spawn(&["/bin/sh"]);
        let other = format!("{}:{}", h.uid + 1, h.gid);
        sp.user = Some(other.into_bytes());
        let (kind, msg) = h.plan(&sp).err().unwrap();
        assert_eq!(kind, SpawnError::UserDenied);
        assert!(msg.contains("cannot switch to"), "{msg}");

        // Its own ids: no switch, and HOME is the user's unless the exec sets it.
        let own = format!("{}:{}", h.uid, h.gid);
        sp.user = Some(own.clone().into_bytes());
        let plan = h.plan(&sp).unwrap();
        assert!(plan.switch.is_none());
        let home = resolve_user(own.as_bytes()).unwrap().home;
        assert_eq!(
            var(&plan.env, "HOME").map(OsStrExt::as_bytes),
            Some(&home[..])
        );
        sp.env = vec![(b"HOME".to_vec(), b"/custom".to_vec())];
        let plan = h.plan(&sp).unwrap();
        assert_eq!(var(&plan.env, "HOME"), Some(OsStr::new("/custom")));
    }

    #[test]
    fn as_root_a_plan_checks_directory_and_program_as_the_user() {
        let dir = TempDir::new();
        fs::set_permissions(dir.path(), Permissions::from_mode(0o755)).unwrap();
        for (name, mode) in [("open", 0o755), ("closed", 0o700)] {
            fs::create_dir(dir.join(name)).unwrap();
            fs::set_permissions(dir.join(name), Permissions::from_mode(mode)).unwrap();
        }
        executable(&dir.join("open/mine"), 0o700);
        executable(&dir.join("open/ours"), 0o755);
        let h = Helper::for_tests(true, dir.path());
        let plan_of = |prog: &str, wd: &str| {
            let mut sp = spawn(&[prog]);
            // A uid in no passwd: gid 0, home "/".
            sp.user = Some(b"54321".to_vec());
            sp.working_dir = Some(wd.as_bytes().to_vec());
            sp.env = vec![(b"PATH".to_vec(), b".".to_vec())];
            h.plan(&sp)
        };
        let plan = plan_of("ours", "open").unwrap();
        assert_eq!(plan.program, dir.join("open/./ours"));
        let c = plan.switch.expect("a user switch");
        assert_eq!((c.uid, c.gid, c.groups), (54321, 0, vec![0]));
        assert_eq!(var(&plan.env, "HOME"), Some(OsStr::new("/")));
        assert_eq!(plan.cwd, Some(dir.join("open")));
        // The helper's own directory needs no change of directory.
        assert_eq!(plan_of("./open/ours", ".").unwrap().cwd, None);
        assert_eq!(
            plan_of("mine", "open").err().unwrap().0,
            SpawnError::NotExecutable
        );
        assert_eq!(
            plan_of("/bin/sh", "closed").err().unwrap().0,
            SpawnError::WorkingDirDenied
        );
        let mut sp = spawn(&["sh"]);
        sp.user = Some(b"54321".to_vec());
        assert!(h.plan(&sp).is_ok());
        // With a user, even the helper's own directory must be enterable by that user.
        let closed = Helper::for_tests(true, &dir.join("closed"));
        assert_eq!(
            closed.plan(&sp).err().unwrap().0,
            SpawnError::WorkingDirDenied
        );
        sp.user = None;
        assert!(closed.plan(&sp).is_ok());
    }
}
