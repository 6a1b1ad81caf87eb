//! The host side of a run's workspace bind mount, after the run.
//!
//! Code in a run may be root, and a bind mount shows the host what it writes as it wrote
//! it: a setuid-root program, a device node. Docker cannot mount a bind `nosuid,nodev`
//! (20.10 refuses the flags; Podman takes them: `body::podman_binds`), and
//! such flags would only guard the container's own view anyway: on the host's own mount
//! the bits count. So when a run's container is gone, its workspace is walked once
//! ([`defuse`]): setuid and setgid bits come off files, device nodes are removed.
//! Symbolic links are never followed, nor other filesystems entered.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use bollard::models::ContainerInspectResponse;

/// The host directory bound into the container, as the engine recorded it at creation
/// (never anything the container says): runcell makes one bind, the workspace's.
pub(crate) fn workspace_bind(inspect: &ContainerInspectResponse) -> Option<PathBuf> {
    inspect
        .mounts
        .iter()
        .flatten()
        .find(|m| m.typ.as_deref() == Some("bind"))
        .and_then(|m| m.source.as_deref())
        .filter(|s| s.starts_with('/'))
        .map(PathBuf::from)
}

/// What [`defuse`] did.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Defused {
    /// Files whose setuid or setgid bit came off.
    pub(crate) cleared: usize,
    /// Device nodes removed.
    pub(crate) removed: usize,
    /// Entries that could not be changed (say, root's files in a rootful engine while the
    /// library is not root), with the error.
    pub(crate) failed: Vec<(PathBuf, String)>,
}

/// Walks `dir` (not following symbolic links, staying on its filesystem): clears the
/// setuid and setgid bits of every non-directory, removes block and character devices.
/// Directories keep theirs (a setgid directory only passes its group on). Call it once
/// nothing in the sandbox can write there any more.
pub(crate) fn defuse(dir: &Path) -> Defused {
    use rustix::fs::{AtFlags, CWD, Dir, FileType, Mode, OFlags, fstat, openat, statat};
    let mut done = Defused::default();
    let dir_flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let Ok(root) = openat(CWD, dir, dir_flags, Mode::empty()) else {
        return done;
    };
    let Ok(root_dev) = fstat(&root).map(|st| st.st_dev) else {
        return done;
    };
    // Another run may share the folder and swap names while this walks: every name is
    // looked at and changed through descriptors of held directories, never by path.
    let mut stack = vec![(root, dir.to_path_buf())];
    while let Some((fd, at)) = stack.pop() {
        let entries = match Dir::read_from(&fd) {
            Ok(entries) => entries,
            Err(e) => {
                done.failed.push((at, e.to_string()));
                continue;
            }
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_owned();
            if matches!(name.to_bytes(), b"." | b"..") {
                continue;
            }
            let path = at.join(std::ffi::OsStr::from_bytes(name.to_bytes()));
            let Ok(st) = statat(&fd, &name, AtFlags::SYMLINK_NOFOLLOW) else {
                continue;
            };
            match FileType::from_raw_mode(st.st_mode) {
                FileType::Symlink => {}
                FileType::Directory => {
                    if st.st_dev == root_dev
                        && let Ok(sub) = openat(&fd, &name, dir_flags, Mode::empty())
                    {
                        stack.push((sub, path));
                    }
                }
                // Whatever is at the name now goes: it is inside the folder.
                FileType::BlockDevice | FileType::CharacterDevice => {
                    match rustix::fs::unlinkat(&fd, &name, AtFlags::empty()) {
                        Ok(()) => done.removed += 1,
                        Err(e) => done.failed.push((path, e.to_string())),
                    }
                }
                FileType::RegularFile => {
                    let flags = OFlags::RDONLY
                        | OFlags::NOFOLLOW
                        | OFlags::NONBLOCK
                        | OFlags::NOCTTY
                        | OFlags::CLOEXEC;
                    let Ok(file) = openat(&fd, &name, flags, Mode::empty()) else {
                        continue;
                    };
                    // The file opened is the one examined, or it is left alone.
                    let Ok(st) = fstat(&file) else { continue };
                    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
                        continue;
                    }
                    match rustix::fs::fremovexattr(&file, "security.capability") {
                        Ok(()) => done.cleared += 1,
                        Err(rustix::io::Errno::NODATA | rustix::io::Errno::NOTSUP) => {}
                        Err(e) => done.failed.push((path.clone(), e.to_string())),
                    }
                    let mode = st.st_mode & 0o7777;
                    if mode & 0o6000 != 0 {
                        match rustix::fs::fchmod(&file, Mode::from_raw_mode(mode & 0o1777)) {
                            Ok(()) => done.cleared += 1,
                            Err(e) => done.failed.push((path, e.to_string())),
                        }
                    }
                }
                _ => {}
            }
        }
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn setuid_and_setgid_bits_come_off_files_and_links_are_not_followed() {
        let base = std::env::temp_dir().join(format!(
            "runcell-defuse-{}-{:x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        let (ws, outside) = (base.join("ws"), base.join("outside"));
        std::fs::create_dir_all(ws.join("sub")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        let mode = |p: &Path| std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777;
        let set = |p: &Path, m: u32| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap()
        };
        for (name, m) in [("sub/suid", 0o4755), ("sgid", 0o2750), ("plain", 0o644)] {
            std::fs::write(ws.join(name), "x").unwrap();
            set(&ws.join(name), m);
        }
        std::fs::write(outside.join("theirs"), "x").unwrap();
        set(&outside.join("theirs"), 0o4755);
        std::os::unix::fs::symlink(&outside, ws.join("link")).unwrap();
        std::os::unix::fs::symlink(outside.join("theirs"), ws.join("file-link")).unwrap();
        set(&ws.join("sub"), 0o2775);

        let done = defuse(&ws);
        assert_eq!((done.cleared, done.removed), (2, 0), "{done:?}");
        assert!(done.failed.is_empty(), "{done:?}");
        assert_eq!(mode(&ws.join("sub/suid")), 0o755);
        assert_eq!(mode(&ws.join("sgid")), 0o750);
        assert_eq!(mode(&ws.join("plain")), 0o644);
        assert_eq!(mode(&ws.join("sub")), 0o2775, "directories keep their bits");
        assert_eq!(mode(&outside.join("theirs")), 0o4755, "a link was followed");
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn file_capabilities_come_off() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("capable");
        std::fs::write(&file, "x").unwrap();
        // vfs_cap_data revision 2, effective: cap_setuid (bit 7) permitted.
        let mut cap = Vec::new();
        for word in [0x0200_0001u32, 1 << 7, 0, 0, 0] {
            cap.extend_from_slice(&word.to_le_bytes());
        }
        let name = "security.capability";
        if let Err(e) = rustix::fs::setxattr(&file, name, &cap, rustix::fs::XattrFlags::empty()) {
            // Setting it takes CAP_SETFCAP and a file system with xattrs (CI has both).
            assert!(
                std::env::var_os("CI").is_none(),
                "cannot set a file capability here: {e}"
            );
            eprintln!("skipped: cannot set a file capability here: {e}");
            return;
        }
        let done = defuse(dir.path());
        assert_eq!(done.cleared, 1, "{done:?}");
        let mut buf = [0u8; 64];
        assert_eq!(
            rustix::fs::getxattr(&file, name, &mut buf[..]).unwrap_err(),
            rustix::io::Errno::NODATA
        );
    }

    #[test]
    fn a_missing_directory_is_nothing_to_do() {
        assert_eq!(
            defuse(Path::new("/no/such/dir/for/runcell")),
            Defused::default()
        );
    }
}
