//! Integration tests of per-exec users, a helper not running as root, and pids limits.
//!
//! They start the built helper on this host (as a child with piped stdin/stdout, no
//! container) and speak the protocol to it; the harness is `common/mod.rs`. Several tests
//! need root (per-exec users, owners); the crate's tests run as root here.

mod common;

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use common::*;

/// Lines of a colon file as fields.
fn db(path: &str) -> Vec<Vec<String>> {
    fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| l.split(':').map(str::to_string).collect())
        .collect()
}

/// What `id -G` should print for a user of /etc/passwd: primary gid + member groups.
fn expected_groups(name: &str) -> Vec<u32> {
    let passwd = db("/etc/passwd");
    let user = passwd.iter().find(|f| f[0] == name).unwrap();
    let mut groups: Vec<u32> = vec![user[3].parse().unwrap()];
    for g in db("/etc/group") {
        if g.len() >= 4 && g[3].split(',').any(|m| m == name) {
            groups.push(g[2].parse().unwrap());
        }
    }
    groups.sort_unstable();
    groups.dedup();
    groups
}

fn id_groups(out: &str) -> Vec<u32> {
    let mut g: Vec<u32> = out.split_whitespace().map(|x| x.parse().unwrap()).collect();
    g.sort_unstable();
    g.dedup();
    g
}

#[test]
fn per_exec_user() {
    if !is_root() {
        eprintln!("skipped: needs root");
        return;
    }
    let mut h = Helper::start();
    let script = r#"id -u; id -g; id -G; echo "$HOME""#;

    let mut sp = sh(script);
    sp.user = Some(b"nobody".to_vec());
    let o = h.run(1, &sp);
    assert_eq!(o.exit, (EXITED, 0), "{o:?}");
    let lines: Vec<&str> = std::str::from_utf8(&o.stdout).unwrap().lines().collect();
    assert_eq!(lines[0], "65534");
    assert_eq!(id_groups(lines[2]), expected_groups("nobody"));
    let home = db("/etc/passwd")
        .into_iter()
        .find(|f| f[0] == "nobody")
        .unwrap()[5]
        .clone();
    assert_eq!(lines[3], home);

    // uid:gid, and the exec's own HOME wins.
    let mut sp = sh(script);
    sp.user = Some(b"65534:65534".to_vec());
    sp.env.push((b"HOME".to_vec(), b"/custom".to_vec()));
    let o = h.run(2, &sp);
    let lines: Vec<&str> = std::str::from_utf8(&o.stdout).unwrap().lines().collect();
    assert_eq!(&lines[..2], &["65534", "65534"]);
    assert_eq!(lines[3], "/custom");

    // A uid not in /etc/passwd: gid 0, home "/".
    let mut sp = sh(script);
    sp.user = Some(b"54321".to_vec());
    let o = h.run(3, &sp);
    let lines: Vec<&str> = std::str::from_utf8(&o.stdout).unwrap().lines().collect();
    assert_eq!(&lines[..2], &["54321", "0"]);
    assert_eq!(id_groups(lines[2]), vec![0]);
    assert_eq!(lines[3], "/");

    // Supplementary groups of a user listed as a member in /etc/group, if there is one.
    let passwd = db("/etc/passwd");
    let member = db("/etc/group").into_iter().find_map(|g| {
        let m = g.get(3)?.split(',').find(|m| {
            !m.is_empty()
                && m.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })?;
        passwd.iter().any(|p| p[0] == m).then(|| m.to_string())
    });
    if let Some(name) = member {
        let mut sp = sh("id -G");
        sp.user = Some(name.clone().into_bytes());
        let o = h.run(4, &sp);
        assert_eq!(id_groups(&o.text()), expected_groups(&name), "user {name}");
        assert!(expected_groups(&name).len() > 1);
    }
}

#[test]
fn a_pids_limit_gives_typed_resource_errors() {
    if !is_root() || !Path::new("/usr/bin/prlimit").exists() {
        eprintln!("skipped: needs root and prlimit");
        return;
    }
    // RLIMIT_NPROC counts the tasks of a uid (a uid of its own per helper). The helper has
    // 3 threads (main, writer, reaper); an exec takes its shepherd, its process and an
    // output thread.
    // The install's directory is root's: a relay of another user cannot make the daemon
    // directory there, and serves its connection itself (3 threads, as version 2 did).
    let start_limited = |uid: u32, nproc: u32| {
        use std::os::unix::process::CommandExt;
        let inst = Instance::new();
        let mut p = Command::new("/usr/bin/prlimit");
        p.arg(format!("--nproc={nproc}")).arg("--").arg(&inst.exe);
        p.uid(uid).gid(uid).current_dir("/");
        let h = Helper::start_cmd(inst, p);
        assert!(!h.hello.durable);
        h
    };
    let uid = 54000 + (std::process::id() % 1000) * 2;

    // How many tasks the helper's own threads take varies a little with timing (kill
    // threads come and go), so the limit is not counted exactly: execs are
    // started until the kernel refuses one, which must be a typed error, never a crash.
    let mut h = start_limited(uid, 8);
    let mut roots = Vec::new();
    let mut refused = None;
    for id in 1..=8 {
        match h.spawn(id, &spawn_of(&["sleep", "1000"])) {
            Ok(root) => roots.push((id, root, assert_alive(root))),
            Err((kind, msg)) => {
                refused = Some((kind, msg));
                break;
            }
        }
    }
    let (kind, msg) = refused.expect("the pids limit never refused a spawn");
    assert_eq!(kind, SpawnError::Resources, "{msg}");
    assert!(!roots.is_empty(), "no exec fitted under the limit");
    let mut sp = spawn_of(&["cat"]);
    sp.stdin_piped = true;
    assert_eq!(h.spawn(20, &sp).unwrap_err().0, SpawnError::Resources);
    h.send_empty(PING, 21);
    assert_eq!(h.recv().kind, PONG);
    // KILL works without a thread to spare.
    for (id, root, start) in roots {
        h.send_empty(KILL, id);
        let (mut killed, mut exited) = (false, false);
        while !killed || !exited {
            let f = h.recv();
            killed |= f.kind == KILLED && f.id == id;
            exited |= f.kind == EXIT && f.id == id;
        }
        assert_gone(root, start);
    }
    // Room again.
    assert_eq!(h.run(30, &spawn_of(&["true"])).exit, (EXITED, 0));
}

#[test]
fn helper_not_running_as_root() {
    if !is_root() {
        eprintln!("skipped: needs root to start the helper as another user");
        return;
    }
    let dir = TempDir::new();
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let secret = dir.path().join("secret");
    fs::write(&secret, "s3cret").unwrap();
    fs::set_permissions(&secret, fs::Permissions::from_mode(0o600)).unwrap();
    let d = dir.path().to_path_buf();
    let mut h = Helper::start_with(|c| {
        use std::os::unix::process::CommandExt;
        c.uid(65534).gid(65534).current_dir(&d);
    });
    assert_eq!((h.hello.uid, h.hello.gid), (65534, 65534));
    // It reads its own executable although it is not dumpable.
    assert_eq!((h.hello.size, h.hello.digest), fnv_of_file(BIN));
    // Its install's directory is root's: it serves its connection itself.
    assert!(!h.hello.durable);
    // Not dumpable: its /proc files belong to root, so processes of its own uid cannot
    // read its descriptors or ptrace it.
    // (`/proc/<pid>` itself, world-readable, keeps showing its effective uid.)
    for f in ["fd", "environ", "mem"] {
        let m = fs::metadata(format!("/proc/{}/{f}", h.hello.pid)).unwrap();
        assert_eq!((m.uid(), m.gid()), (0, 0), "/proc/<helper>/{f}");
    }

    // Reading /proc (of its children) still works: a KILL takes the whole tree.
    let root = h.spawn(10, &sh("sleep 1000 & echo $!; wait")).unwrap();
    let pid: u32 = h.read_lines(10, 1)[0].parse().unwrap();
    let (root_start, start) = (assert_alive(root), assert_alive(pid));
    h.send_empty(KILL, 10);
    let (mut killed, mut exited) = (false, false);
    while !killed || !exited {
        let f = h.recv();
        assert_eq!(f.id, 10, "{f:?}");
        killed |= f.kind == KILLED;
        exited |= f.kind == EXIT;
    }
    assert_gone(root, root_start);
    assert_gone(pid, start);

    // Switching user needs root; its own user is fine.
    let mut sp = spawn_of(&["id", "-u"]);
    sp.user = Some(b"root".to_vec());
    assert_eq!(h.spawn(1, &sp).unwrap_err().0, SpawnError::UserDenied);
    sp.user = Some(b"65534:65534".to_vec());
    assert_eq!(h.run(2, &sp).text(), "65534\n");

    // An unreadable file: Denied, with its path.
    h.send_path(GET, 3, &secret);
    assert_eq!(
        file_error(&h.recv()),
        (FileError::Denied, "secret".to_string())
    );
    let name = dir
        .path()
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    h.send_path(GET, 4, dir.path());
    let mut last;
    loop {
        last = h.recv();
        if last.kind != ENTRY {
            break;
        }
    }
    assert_eq!(
        file_error(&last),
        (FileError::Denied, format!("{name}/secret"))
    );

    // A directory it may not enter, as a working directory.
    let closed = dir.path().join("closed");
    fs::create_dir(&closed).unwrap();
    fs::set_permissions(&closed, fs::Permissions::from_mode(0o700)).unwrap();
    let mut sp = spawn_of(&["true"]);
    sp.working_dir = Some(closed.as_os_str().as_encoded_bytes().to_vec());
    assert_eq!(h.spawn(5, &sp).unwrap_err().0, SpawnError::WorkingDirDenied);
}

/// The pids of the processes whose `/proc/<pid>` belongs to `uid`.
fn processes_of(uid: u32) -> Vec<u32> {
    let mut v: Vec<u32> = fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            fs::metadata(format!("/proc/{pid}")).is_ok_and(|m| m.uid() == uid)
                && proc_stat(*pid).is_some_and(|(state, _)| state != 'Z')
        })
        .collect();
    v.sort();
    v
}

#[test]
fn a_fork_bomb_under_a_pids_limit_is_killed_by_its_shepherd() {
    if !is_root() || !Path::new("/usr/bin/prlimit").exists() {
        eprintln!("skipped: needs root and prlimit");
        return;
    }
    let uid = 57000 + (std::process::id() % 1000) * 2;
    let inst = Instance::new();
    let mut p = Command::new("/usr/bin/prlimit");
    {
        use std::os::unix::process::CommandExt;
        p.arg("--nproc=48").arg("--").arg(&inst.exe);
        p.uid(uid).gid(uid).current_dir("/");
    }
    let mut h = Helper::start_cmd(inst, p);
    let other = h.spawn(1, &spawn_of(&["sleep", "1000"])).unwrap();
    let other_start = assert_alive(other);
    let other_shepherd = stat_fields(other).unwrap().ppid;
    // A spare shepherd, not taken by an exec: the helper's child with no child itself.
    let helper = h.child.id();
    let spare = |pid: &u32| {
        stat_fields(*pid).is_some_and(|s| s.ppid == helper)
            && fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.starts_with(b"runcell-shepherd\0"))
            && !processes_of(uid)
                .iter()
                .any(|c| stat_fields(*c).is_some_and(|s| s.ppid == *pid))
    };
    // The spare that replaces the one exec 1 took is started after its STARTED: idle
    // is what runs once it is there.
    eventually("the next spare is ready", || {
        processes_of(uid).iter().any(&spare)
    });
    let idle = processes_of(uid);
    // Forks until the kernel refuses (the shell then exits, its children orphaned to
    // the shepherd): no process slot is left for anything new.
    let o = h.run(2, &sh("while :; do sleep 1000 & done"));
    assert_ne!(o.exit, (EXITED, 0));
    let full = processes_of(uid).len();
    assert!(full > 30, "{full} processes");
    // The kill needs no new process: the shepherd is there already.
    let t = Instant::now();
    h.send_empty(KILL, 2);
    let f = h.recv();
    assert_eq!((f.kind, f.id), (KILLED, 2));
    eprintln!("{full} processes, killed in {:?}", t.elapsed());
    // Left: what ran before the bomb (the helper, the other exec and its shepherd; the
    // spare shepherd the bomb's exec took is gone), and at most one new spare.
    eventually(
        "only the helper, the other exec and a spare are left",
        || {
            let now = processes_of(uid);
            let new: Vec<&u32> = now.iter().filter(|p| !idle.contains(p)).collect();
            now.len() <= idle.len() && new.len() <= 1 && new.into_iter().all(spare)
        },
    );
    assert_eq!(
        assert_alive(other),
        other_start,
        "the other exec was killed"
    );
    assert!(idle.contains(&other_shepherd));
    // Room again, once the kernel counted the reaped tasks out of the limit.
    let mut id = 4;
    let deadline = Instant::now() + PATIENCE;
    loop {
        match h.spawn(id, &spawn_of(&["true"])) {
            Ok(_) => break,
            Err((SpawnError::Resources, msg)) => {
                assert!(Instant::now() < deadline, "never room again: {msg}");
                thread::sleep(Duration::from_millis(50));
                id += 1;
            }
            Err(e) => panic!("{e:?}"),
        }
    }
    assert_eq!(h.wait_exit(id).exit, (EXITED, 0));
    assert_eq!(kill_and_wait(&mut h, 1).0, SIGNALED);
}
