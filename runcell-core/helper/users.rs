//! Per-exec users: a `SPAWN`'s user resolved from the image's `/etc/passwd` and
//! `/etc/group` (as runc does), and the permission checks made as that user before the
//! switch (the working directory, the program on `PATH`).

use std::ffi::OsStr;
use std::fs::{self, Metadata};
use std::io::ErrorKind;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::proto::SpawnError;
use crate::sys;

/// A resolved per-exec user.
#[derive(Debug, Clone)]
pub(crate) struct Creds {
    pub(crate) uid: u32,
    pub(crate) gid: u32,
    /// Supplementary groups, the primary gid first.
    pub(crate) groups: Vec<u32>,
    pub(crate) home: Vec<u8>,
}

/// Lines of a colon-separated database (`/etc/passwd`, `/etc/group`); missing = empty.
fn read_db(path: &str) -> Vec<Vec<Vec<u8>>> {
    let data = fs::read(path).unwrap_or_default();
    data.split(|&b| b == b'\n')
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l))
        .filter(|l| !l.is_empty() && !matches!(l[0], b'#' | b'+' | b'-'))
        .map(|l| l.split(|&b| b == b':').map(<[u8]>::to_vec).collect())
        .collect()
}

/// A decimal id.
fn parse_id(b: &[u8]) -> Option<u32> {
    if b.is_empty() || !b.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(b).ok()?.parse().ok()
}

/// Resolves `name`, `uid`, `name:group`, `uid:gid`, `uid:group` or `name:gid` from the
/// image's `/etc/passwd` and `/etc/group`, as runc does (a numeric uid not in passwd gets
/// gid 0, or the given one, and home `/`).
pub(crate) fn resolve_user(spec: &[u8]) -> Result<Creds, (SpawnError, String)> {
    resolve_user_in(spec, "/etc/passwd", "/etc/group")
}

/// [`resolve_user`] with the given passwd and group files.
fn resolve_user_in(
    spec: &[u8],
    passwd_path: &str,
    group_path: &str,
) -> Result<Creds, (SpawnError, String)> {
    let shown = String::from_utf8_lossy(spec);
    let unknown = |what: &str| (SpawnError::UnknownUser, format!("{what} in user {shown}"));
    let (u, g) = match spec.iter().position(|&b| b == b':') {
        Some(i) => (&spec[..i], Some(&spec[i + 1..])),
        None => (spec, None),
    };
    if u.is_empty() || g.is_some_and(<[u8]>::is_empty) {
        return Err(unknown("empty name"));
    }
    let passwd = read_db(passwd_path);
    let numeric = parse_id(u);
    let entry = passwd.iter().find(|f| {
        f.len() >= 4
            && match numeric {
                Some(uid) => parse_id(&f[2]) == Some(uid),
                None => f[0] == u,
            }
    });
    let (uid, primary, home, name) = match (entry, numeric) {
        (Some(f), _) => {
            let uid = parse_id(&f[2]).ok_or_else(|| unknown("malformed passwd entry"))?;
            let home = f
                .get(5)
                .filter(|h| !h.is_empty())
                .cloned()
                .unwrap_or_else(|| b"/".to_vec());
            (uid, parse_id(&f[3]).unwrap_or(0), home, Some(f[0].clone()))
        }
        (None, Some(uid)) => (uid, 0, b"/".to_vec(), None),
        (None, None) => return Err(unknown("unknown user")),
    };
    let group = read_db(group_path);
    let gid = match g {
        None => primary,
        Some(g) => match parse_id(g) {
            Some(gid) => gid,
            None => group
                .iter()
                .find(|f| f.len() >= 3 && f[0] == g)
                .and_then(|f| parse_id(&f[2]))
                .ok_or_else(|| unknown("unknown group"))?,
        },
    };
    let mut groups = vec![gid];
    if let Some(name) = &name {
        for f in &group {
            if f.len() >= 4
                && f[3]
                    .split(|&b| b == b',')
                    .any(|m| m.trim_ascii() == name.as_slice())
                && let Some(n) = parse_id(&f[2])
                && !groups.contains(&n)
            {
                groups.push(n);
            }
        }
    }
    Ok(Creds {
        uid,
        gid,
        groups,
        home,
    })
}

/// Whether `c` has permission `bit` (4 read, 2 write, 1 execute/search) by mode bits.
fn permitted(md: &Metadata, c: &Creds, bit: u32) -> bool {
    let mode = md.mode();
    if c.uid == 0 {
        return bit != 1 || md.is_dir() || mode & 0o111 != 0;
    }
    let shift = if md.uid() == c.uid {
        6
    } else if c.groups.contains(&md.gid()) {
        3
    } else {
        0
    };
    (mode >> shift) & bit != 0
}

/// Whether `c` may enter `dir`: search permission on it and every ancestor.
pub(crate) fn can_search_as(dir: &Path, c: &Creds) -> bool {
    if c.uid == 0 {
        return true;
    }
    let Ok(real) = fs::canonicalize(dir) else {
        return false;
    };
    real.ancestors()
        .all(|a| fs::metadata(a).is_ok_and(|m| permitted(&m, c, 1)))
}

/// Looks a bare program name up on `PATH` like `execvp` (an empty entry is the working
/// directory; no PATH: `/bin:/usr/bin`).
pub(crate) fn find_program(
    name: &[u8],
    path: Option<&[u8]>,
    dir: &Path,
    switch: Option<&Creds>,
) -> Result<PathBuf, (SpawnError, String)> {
    let mut denied = false;
    for entry in path.unwrap_or(b"/bin:/usr/bin").split(|&b| b == b':') {
        let entry: &[u8] = if entry.is_empty() { b"." } else { entry };
        let cand = dir
            .join(OsStr::from_bytes(entry))
            .join(OsStr::from_bytes(name));
        match fs::metadata(&cand) {
            Ok(m) if m.is_file() => {
                let ok = match switch {
                    Some(c) => permitted(&m, c, 1),
                    None => sys::can_execute(&cand),
                };
                if ok {
                    return Ok(cand);
                }
                denied = true;
            }
            Ok(_) => denied = true,
            Err(e) if e.kind() == ErrorKind::PermissionDenied => denied = true,
            Err(_) => {}
        }
    }
    let shown = String::from_utf8_lossy(name);
    Err(if denied {
        (
            SpawnError::NotExecutable,
            format!("{shown}: permission denied"),
        )
    } else {
        (SpawnError::NotFound, format!("{shown}: not found on PATH"))
    })
}

#[cfg(test)]
mod tests {
    use std::fs::Permissions;
    use std::os::unix::fs::PermissionsExt;

    use super::*;
    use crate::testing::TempDir;

    const PASSWD: &str = "# users\n\
        root:x:0:0:root:/root:/bin/sh\n\
        alice:x:1000:1000:Alice:/home/alice:/bin/sh\n\
        bob:x:1001:1001::/home/bob:/bin/sh\r\n\
        \n\
        nohome:x:1002:1002:::/bin/sh\n\
        short:x:1003\n\
        +nis:x:5:5::/:/bin/sh\n\
        -minus:x:6:6::/:/bin/sh\n\
        broken:x:abc:1:::/bin/sh\n";
    const GROUP: &str = "root:x:0:\n\
        wheel:x:10:root\n\
        alice:x:1000:\n\
        bob:x:1001:\n\
        dev:x:2000:alice, bob\n\
        ops:x:2001:bob,carol\n\
        again:x:1001:bob\n\
        bad:x:nope:alice\n";

    /// The two databases, written to files.
    struct Dbs {
        dir: TempDir,
    }

    impl Dbs {
        fn new(passwd: &str, group: &str) -> Dbs {
            let dir = TempDir::new();
            fs::write(dir.join("passwd"), passwd).unwrap();
            fs::write(dir.join("group"), group).unwrap();
            Dbs { dir }
        }

        fn resolve(&self, spec: &str) -> Result<Creds, (SpawnError, String)> {
            let p = self.dir.join("passwd");
            let g = self.dir.join("group");
            resolve_user_in(spec.as_bytes(), p.to_str().unwrap(), g.to_str().unwrap())
        }

        /// uid, gid, groups, home.
        fn creds(&self, spec: &str) -> (u32, u32, Vec<u32>, String) {
            let c = self
                .resolve(spec)
                .unwrap_or_else(|e| panic!("{spec}: {e:?}"));
            (c.uid, c.gid, c.groups, String::from_utf8(c.home).unwrap())
        }

        fn error(&self, spec: &str) -> (SpawnError, String) {
            self.resolve(spec).expect_err(spec)
        }
    }

    #[test]
    fn read_db_skips_comments_nis_and_empty_lines() {
        let dir = TempDir::new();
        let path = dir.join("passwd");
        fs::write(&path, PASSWD).unwrap();
        let db = read_db(path.to_str().unwrap());
        let names: Vec<&[u8]> = db.iter().map(|f| f[0].as_slice()).collect();
        assert_eq!(
            names,
            [
                &b"root"[..],
                b"alice",
                b"bob",
                b"nohome",
                b"short",
                b"broken"
            ]
        );
        assert_eq!(db[1].len(), 7);
        assert_eq!(db[1][5], b"/home/alice");
        // A CRLF line ends without its CR.
        assert_eq!(db[2][6], b"/bin/sh");
        assert_eq!(db[3][5], b"");
        assert_eq!(db[4], [&b"short"[..], b"x", b"1003"]);
        assert!(read_db(dir.join("missing").to_str().unwrap()).is_empty());
    }

    #[test]
    fn parse_id_takes_plain_decimal_u32_only() {
        assert_eq!(parse_id(b"0"), Some(0));
        assert_eq!(parse_id(b"65534"), Some(65534));
        assert_eq!(parse_id(b"4294967295"), Some(u32::MAX));
        for bad in [
            &b""[..],
            b"4294967296",
            b"-1",
            b"+1",
            b" 1",
            b"1 ",
            b"0x10",
            b"abc",
        ] {
            assert_eq!(parse_id(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn a_user_by_name_gets_its_ids_home_and_member_groups() {
        let db = Dbs::new(PASSWD, GROUP);
        let alice = (1000, 1000, vec![1000, 2000], "/home/alice".to_string());
        assert_eq!(db.creds("alice"), alice);
        assert_eq!(db.creds("1000"), alice);
        // Members are trimmed; a group listed twice (by gid) counts once; a group with a
        // malformed gid is skipped.
        let bob = (1001, 1001, vec![1001, 2000, 2001], "/home/bob".to_string());
        assert_eq!(db.creds("bob"), bob);
        assert_eq!(db.creds("1001"), bob);
        assert_eq!(db.creds("root"), (0, 0, vec![0, 10], "/root".to_string()));
        assert_eq!(db.creds("nohome").3, "/");
    }

    #[test]
    fn a_given_group_replaces_the_primary_one() {
        let db = Dbs::new(PASSWD, GROUP);
        assert_eq!(db.creds("alice:ops").1, 2001);
        assert_eq!(db.creds("alice:ops").2, [2001, 2000]);
        assert_eq!(db.creds("alice:0").2, [0, 2000]);
        assert_eq!(db.creds("1000:2001").2, [2001, 2000]);
        assert_eq!(db.creds("bob:dev").2, [2000, 2001, 1001]);
    }

    #[test]
    fn a_numeric_user_not_in_passwd_gets_gid_0_and_home_slash() {
        let db = Dbs::new(PASSWD, GROUP);
        assert_eq!(db.creds("54321"), (54321, 0, vec![0], "/".to_string()));
        assert_eq!(db.creds("54321:7"), (54321, 7, vec![7], "/".to_string()));
        assert_eq!(
            db.creds("54321:dev"),
            (54321, 2000, vec![2000], "/".to_string())
        );
        // With no databases at all, only numbers resolve.
        let none = Dbs::new("", "");
        fs::remove_file(none.dir.join("passwd")).unwrap();
        fs::remove_file(none.dir.join("group")).unwrap();
        assert_eq!(none.creds("0:0"), (0, 0, vec![0], "/".to_string()));
        assert_eq!(none.error("root").0, SpawnError::UnknownUser);
    }

    #[test]
    fn unknown_or_malformed_users_are_typed_errors() {
        let db = Dbs::new(PASSWD, GROUP);
        for (spec, what) in [
            ("", "empty name"),
            (":0", "empty name"),
            ("alice:", "empty name"),
            ("mallory", "unknown user"),
            ("short", "unknown user"),
            ("nis", "unknown user"),
            ("+nis", "unknown user"),
            ("broken", "malformed passwd entry"),
            ("alice:nogroup", "unknown group"),
            ("alice:bad", "unknown group"),
        ] {
            let (kind, msg) = db.error(spec);
            assert_eq!(kind, SpawnError::UnknownUser, "{spec}");
            assert_eq!(msg, format!("{what} in user {spec}"));
        }
    }

    /// A file of `mode` owned by someone other than root (root chowns it to 4321:4322).
    fn owned_file(dir: &TempDir, name: &str, mode: u32) -> (PathBuf, Metadata) {
        let path = dir.join(name);
        fs::write(&path, "#!/bin/sh\n").unwrap();
        if sys::ids().2 == 0 {
            std::os::unix::fs::chown(&path, Some(4321), Some(4322)).unwrap();
        }
        fs::set_permissions(&path, Permissions::from_mode(mode)).unwrap();
        let md = fs::metadata(&path).unwrap();
        assert_ne!(md.uid(), 0);
        (path, md)
    }

    fn creds(uid: u32, groups: &[u32]) -> Creds {
        Creds {
            uid,
            gid: groups.first().copied().unwrap_or(uid),
            groups: groups.to_vec(),
            home: b"/".to_vec(),
        }
    }

    #[test]
    fn permitted_takes_the_owner_group_or_other_bits() {
        let dir = TempDir::new();
        let (_, md) = owned_file(&dir, "f", 0o000);
        let owner = creds(md.uid(), &[md.gid() + 1]);
        let member = creds(md.uid() + 1, &[md.gid() + 1, md.gid()]);
        let other = creds(md.uid() + 2, &[md.gid() + 2]);
        for (mode, who, bits) in [
            (0o700, &owner, 7),
            (0o070, &owner, 0),
            (0o070, &member, 7),
            (0o007, &member, 0),
            (0o007, &other, 7),
            (0o770, &other, 0),
            (0o421, &owner, 4),
            (0o421, &member, 2),
            (0o421, &other, 1),
            (0o000, &owner, 0),
        ] {
            fs::set_permissions(dir.join("f"), Permissions::from_mode(mode)).unwrap();
            let md = fs::metadata(dir.join("f")).unwrap();
            for bit in [4, 2, 1] {
                assert_eq!(
                    permitted(&md, who, bit),
                    bits & bit != 0,
                    "mode {mode:o}, uid {}, bit {bit}",
                    who.uid
                );
            }
        }
    }

    #[test]
    fn root_may_read_and_write_anything_but_execute_only_with_an_execute_bit() {
        let dir = TempDir::new();
        let root = creds(0, &[0]);
        let (path, md) = owned_file(&dir, "f", 0o000);
        assert!(permitted(&md, &root, 4));
        assert!(permitted(&md, &root, 2));
        assert!(!permitted(&md, &root, 1));
        fs::set_permissions(&path, Permissions::from_mode(0o001)).unwrap();
        assert!(permitted(&fs::metadata(&path).unwrap(), &root, 1));
        // A directory is always searchable by root.
        fs::create_dir(dir.join("d")).unwrap();
        fs::set_permissions(dir.join("d"), Permissions::from_mode(0o000)).unwrap();
        assert!(permitted(&fs::metadata(dir.join("d")).unwrap(), &root, 1));
    }

    #[test]
    fn can_search_as_needs_search_permission_on_every_ancestor() {
        let dir = TempDir::new();
        let inner = dir.join("a/b");
        fs::create_dir_all(&inner).unwrap();
        let stranger = creds(54321, &[54321]);
        fs::set_permissions(dir.path(), Permissions::from_mode(0o711)).unwrap();
        fs::set_permissions(dir.join("a"), Permissions::from_mode(0o711)).unwrap();
        fs::set_permissions(&inner, Permissions::from_mode(0o711)).unwrap();
        assert!(can_search_as(&inner, &stranger));
        // An ancestor closed to others.
        fs::set_permissions(dir.join("a"), Permissions::from_mode(0o770)).unwrap();
        assert!(!can_search_as(&inner, &stranger));
        assert!(!can_search_as(&dir.join("a"), &stranger));
        assert!(can_search_as(dir.path(), &stranger));
        // Root may enter anything, even what does not exist; others not.
        assert!(can_search_as(&inner, &creds(0, &[0])));
        assert!(!can_search_as(&dir.join("missing"), &stranger));
        fs::set_permissions(dir.join("a"), Permissions::from_mode(0o755)).unwrap();
    }

    #[test]
    fn find_program_walks_path_like_execvp() {
        let dir = TempDir::new();
        for d in ["plain", "exec", "isdir/prog"] {
            fs::create_dir_all(dir.join(d)).unwrap();
        }
        fs::write(dir.join("plain/prog"), "data").unwrap();
        fs::set_permissions(dir.join("plain/prog"), Permissions::from_mode(0o644)).unwrap();
        fs::write(dir.join("exec/prog"), "#!/bin/sh\n").unwrap();
        fs::set_permissions(dir.join("exec/prog"), Permissions::from_mode(0o755)).unwrap();
        fs::write(dir.join("prog"), "#!/bin/sh\n").unwrap();
        fs::set_permissions(dir.join("prog"), Permissions::from_mode(0o755)).unwrap();
        let find = |path: &str| find_program(b"prog", Some(path.as_bytes()), dir.path(), None);

        // Relative entries are taken from the working directory; the first usable wins.
        assert_eq!(find("plain:exec").unwrap(), dir.join("exec/prog"));
        assert_eq!(find("missing:exec:plain").unwrap(), dir.join("exec/prog"));
        let abs = dir.join("exec");
        assert_eq!(find(abs.to_str().unwrap()).unwrap(), abs.join("prog"));
        // An empty entry is the working directory.
        assert_eq!(find("missing:").unwrap(), dir.path().join(".").join("prog"));
        assert_eq!(find(":exec").unwrap(), dir.path().join(".").join("prog"));
        // Found but not executable (or a directory): denied, not missing.
        let denied = find("plain").unwrap_err();
        assert_eq!(
            denied,
            (SpawnError::NotExecutable, "prog: permission denied".into())
        );
        assert_eq!(find("isdir").unwrap_err().0, SpawnError::NotExecutable);
        assert_eq!(
            find("missing:nowhere").unwrap_err(),
            (SpawnError::NotFound, "prog: not found on PATH".into())
        );
        // No PATH: /bin:/usr/bin.
        let sh = find_program(b"sh", None, dir.path(), None).unwrap();
        assert!(
            sh == Path::new("/bin/sh") || sh == Path::new("/usr/bin/sh"),
            "{sh:?}"
        );
    }

    #[test]
    fn find_program_checks_the_mode_bits_of_the_user_switched_to() {
        let dir = TempDir::new();
        let (_, md) = owned_file(&dir, "prog", 0o750);
        let find = |c: &Creds| find_program(b"prog", Some(b""), dir.path(), Some(c));
        let owner = creds(md.uid(), &[md.uid()]);
        let member = creds(md.uid() + 1, &[md.gid()]);
        let other = creds(md.uid() + 2, &[md.gid() + 2]);
        assert!(find(&owner).is_ok());
        assert!(find(&member).is_ok());
        assert_eq!(find(&other).unwrap_err().0, SpawnError::NotExecutable);
        fs::set_permissions(dir.join("prog"), Permissions::from_mode(0o640)).unwrap();
        assert_eq!(find(&owner).unwrap_err().0, SpawnError::NotExecutable);
        assert_eq!(
            find(&creds(0, &[0])).unwrap_err().0,
            SpawnError::NotExecutable
        );
        fs::set_permissions(dir.join("prog"), Permissions::from_mode(0o601)).unwrap();
        assert!(find(&other).is_ok());
        assert!(find(&creds(0, &[0])).is_ok());
    }
}
