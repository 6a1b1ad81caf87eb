//! Integration tests of the daemon, the relay and durable execs (protocol version 3):
//! execs that outlive their connection, `ATTACH` from an offset, retained output and its
//! bound, detached execs, grace, `LIST`, `RELEASE`, ids across connections, one daemon
//! for relays started at once, the relay serving itself when the daemon cannot be used.
//!
//! Each test has an install of the helper of its own (its own daemon); the harness is
//! `common/mod.rs`.

mod common;

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::process::Command;
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use common::*;

/// A spawn with a grace, a detach flag and a `keep`.
fn durable(script: &str, detach: bool, grace_ms: u32, keep: u32) -> Spawn {
    Spawn {
        detach,
        grace_ms,
        keep,
        ..sh(script)
    }
}

/// The output of the counter script below for `0..n`.
fn counter_output(n: usize) -> Vec<u8> {
    (0..n)
        .flat_map(|i| format!("line {i}\n").into_bytes())
        .collect()
}

/// Prints `line 0` to `line {n-1}`, one every 10 ms.
fn counter(n: usize) -> String {
    format!("i=0; while [ $i -lt {n} ]; do echo line $i; i=$((i+1)); sleep 0.01; done")
}

/// Reads the exec's output (both streams, in order) until its `EXIT`, granting credit.
fn output_until_exit(h: &mut Helper, id: u32) -> (Vec<u8>, (u8, i32)) {
    let mut out = Vec::new();
    loop {
        let f = h.recv();
        assert_eq!(f.id, id, "{f:?}");
        match f.kind {
            STDOUT | STDERR => {
                out.extend_from_slice(&f.payload);
                h.send_u32(CREDIT, id, f.payload.len() as u32);
            }
            EXIT => {
                let mut d = Dec::new(&f.payload);
                return (out, (d.u8().unwrap(), d.i32().unwrap()));
            }
            STDIN_ACK | KILLED => {}
            k => panic!("unexpected frame kind {k}"),
        }
    }
}

/// The record of `id` in a `LIST`.
fn listed(h: &mut Helper, id: u32) -> Option<ExecInfo> {
    h.list(0x7000_0000 + id).into_iter().find(|i| i.id == id)
}

/// Waits until `LIST` shows the exec `id` over; its record then.
fn wait_listed_exit(h: &mut Helper, id: u32) -> ExecInfo {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let info = listed(h, id).expect("listed");
        if info.exit.is_some() {
            return info;
        }
        assert!(
            Instant::now() < deadline,
            "exec {id} never exited: {info:?}"
        );
        thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_command_outlives_its_connection_and_resumes_from_the_offset_received() {
    let n = 300;
    let mut h = Helper::start();
    assert!(h.hello.durable);
    let root = h.spawn(1, &durable(&counter(n), false, 60_000, 0)).unwrap();
    // Some of its output arrives here.
    let mut first = Vec::new();
    while first.len() < 200 {
        let f = h.recv();
        assert_eq!((f.kind, f.id), (STDOUT, 1), "{f:?}");
        first.extend_from_slice(&f.payload);
        h.send_u32(CREDIT, 1, f.payload.len() as u32);
    }
    // The connection ends (what was in flight is lost with it); the command runs on.
    let status = h.close();
    assert!(status.success(), "{status:?}");
    let start = assert_alive(root);
    thread::sleep(Duration::from_millis(300));
    assert_eq!(assert_alive(root), start, "the command was killed");

    let mut h2 = h.connect();
    assert_eq!(h2.hello.pid, h.hello.pid, "another daemon");
    assert_eq!(h2.hello.relay, h2.child.id());
    let info = listed(&mut h2, 1).expect("listed");
    assert_eq!((info.pid, info.detach, info.exit), (root, false, None));
    assert!(!info.attached, "{info:?}");
    let a = h2
        .attach(1, first.len() as u64)
        .expect("the record is there");
    assert_eq!(a.at, first.len() as u64, "{a:?}");
    assert!(a.end >= a.at);
    assert_eq!(
        (a.pid, a.detach, a.tty, a.stdin_open),
        (root, false, false, false)
    );
    let (rest, exit) = output_until_exit(&mut h2, 1);
    assert_eq!(exit, (EXITED, 0));
    let all = [first, rest].concat();
    assert!(
        all == counter_output(n),
        "the output differs: {} bytes, {} expected",
        all.len(),
        counter_output(n).len()
    );
    // The EXIT of a non-detached exec went out: its record is forgotten.
    eventually("the record is forgotten", || listed(&mut h2, 1).is_none());
    assert!(h2.attach(1, 0).is_none());
}

#[test]
fn a_detached_exec_runs_on_without_a_connection_and_is_listed() {
    let mut h = Helper::start();
    let sp = durable("sleep 1000", true, 0, 0);
    let root = h.spawn(5, &sp).unwrap();
    let start = assert_alive(root);
    assert!(h.close().success());
    thread::sleep(Duration::from_millis(300));
    assert_eq!(assert_alive(root), start, "a detached exec was killed");

    let mut h2 = h.connect();
    let info = listed(&mut h2, 5).expect("listed");
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    assert_eq!(info.argv, sp.argv);
    assert_eq!((info.pid, info.detach, info.attached), (root, true, false));
    assert_eq!((info.exit, info.end, info.kept_from), (None, 0, 0));
    assert!(info.started_ms <= now_ms && info.started_ms + 60_000 > now_ms);
    // A KILL from any connection; the record keeps its status.
    assert_eq!(kill_and_wait_killed(&mut h2, 5), 1);
    assert_gone(root, start);
    let info = wait_listed_exit(&mut h2, 5);
    assert_eq!(info.exit.unwrap().0, SIGNALED);
    // Attached after it exited: ATTACHED, then EXIT at once.
    let a = h2.attach(5, u64::MAX).unwrap();
    assert_eq!((a.at, a.end, a.detach), (0, 0, true));
    let f = h2.recv();
    assert_eq!((f.kind, f.id), (EXIT, 5), "{f:?}");
    // Still listed (detached): until RELEASE.
    assert!(listed(&mut h2, 5).is_some());
    h2.send_empty(RELEASE, 5);
    assert!(listed(&mut h2, 5).is_none());
    assert!(h2.attach(5, 0).is_none());
}

/// KILL and its KILLED (frames of other kinds skipped): KILLED's byte.
fn kill_and_wait_killed(h: &mut Helper, id: u32) -> u8 {
    h.send_empty(KILL, id);
    loop {
        let f = h.recv();
        if (f.kind, f.id) == (KILLED, id) {
            return f.payload.first().copied().unwrap_or(1);
        }
    }
}

#[test]
fn output_beyond_keep_while_unattached_leaves_the_exact_tail() {
    let mut h = Helper::start();
    // It prints once its connection is gone.
    let total_lines = 60_000;
    let script = format!("sleep 1; seq 1 {total_lines}");
    h.spawn(3, &durable(&script, true, 0, MIN_KEEP)).unwrap();
    assert!(h.close().success());
    let expected: Vec<u8> = (1..=total_lines)
        .flat_map(|i| format!("{i}\n").into_bytes())
        .collect();
    let total = expected.len();
    assert!(total > 4 * MIN_KEEP as usize);

    let mut h2 = h.connect();
    let info = wait_listed_exit(&mut h2, 3);
    assert_eq!(info.exit, Some((EXITED, 0)));
    assert_eq!(info.end, total as u64);
    assert_eq!(info.kept_from, (total - MIN_KEEP as usize) as u64);
    let a = h2.attach(3, 0).unwrap();
    assert_eq!(a.end, total as u64);
    assert_eq!(a.at, (total - MIN_KEEP as usize) as u64, "{a:?}");
    let (tail, exit) = output_until_exit(&mut h2, 3);
    assert_eq!(exit, (EXITED, 0));
    assert!(tail == expected[a.at as usize..], "not the exact tail");
    // From an offset inside what is kept: exactly from there.
    let a = h2.attach(3, total as u64 - 10).unwrap();
    assert_eq!(a.at, total as u64 - 10);
    let (tail, _) = output_until_exit(&mut h2, 3);
    assert_eq!(tail, expected[total - 10..]);
}

#[test]
fn the_grace_passing_kills_a_non_detached_exec_and_forgets_it() {
    let mut h = Helper::start();
    let sp = durable("sleep 1000 & echo $!; wait", false, 1500, 0);
    let root = h.spawn(2, &sp).unwrap();
    let bg: u32 = h.read_lines(2, 1)[0].parse().unwrap();
    let starts = (assert_alive(root), assert_alive(bg));
    let closed = Instant::now();
    assert!(h.close().success());
    // Within its grace it runs on, unattached.
    let mut h2 = h.connect();
    let info = listed(&mut h2, 2).expect("listed");
    assert!(!info.attached && info.exit.is_none(), "{info:?}");
    assert_eq!(assert_alive(root), starts.0);
    // Then its whole tree is killed, and the record forgotten.
    assert_gone(root, starts.0);
    assert_gone(bg, starts.1);
    assert!(
        closed.elapsed() >= Duration::from_millis(1400),
        "killed after {:?}",
        closed.elapsed()
    );
    eventually("the record is forgotten", || listed(&mut h2, 2).is_none());
    assert!(h2.attach(2, 0).is_none());
}

/// A host gives up on a spawn that its stopped daemon does not answer, and ends the
/// connection (here with no `KILL`: a broken stream takes it along). Once the daemon goes
/// on, it reads the `SPAWN` with the end behind it: the command does not run on (it did,
/// for its grace, unattached, with no host knowing of it), and the daemon serves on.
#[test]
fn a_spawn_read_after_its_connection_ended_does_not_run_on() {
    let mut h = Helper::start();
    let daemon = h.hello.pid.to_string();
    let dir = TempDir::new();
    let pidfile = dir.path().join("pid");
    let signal = |sig: &str| {
        let status = Command::new("kill").args([sig, &daemon]).status();
        assert!(status.unwrap().success());
    };
    signal("-STOP");
    let script = format!("echo $$ > {}; exec sleep 1000", pidfile.display());
    let mut e = Enc::frame(SPAWN, 3);
    durable(&script, false, 600_000, 0).encode(&mut e);
    h.send(e.finish());
    drop(h.stdin.take());
    // The relay forwards the `SPAWN` and the end before the daemon goes on.
    thread::sleep(Duration::from_millis(300));
    signal("-CONT");
    thread::sleep(Duration::from_millis(1000));
    if let Ok(pid) = fs::read_to_string(&pidfile) {
        let pid: u32 = pid.trim().parse().unwrap();
        if let Some((_, start)) = proc_stat(pid) {
            assert_gone(pid, start);
        }
    }
    let mut h2 = h.connect();
    assert_eq!(h2.run(4, &sh("echo on")).stdout, b"on\n");
    assert!(
        listed(&mut h2, 3).is_none_or(|i| i.exit.is_some()),
        "{:?}",
        listed(&mut h2, 3)
    );
}

#[test]
fn an_attach_within_the_grace_keeps_the_exec() {
    let mut h = Helper::start();
    let root = h.spawn(2, &durable("sleep 1000", false, 1000, 0)).unwrap();
    let start = assert_alive(root);
    assert!(h.close().success());
    let mut h2 = h.connect();
    let a = h2.attach(2, u64::MAX).unwrap();
    assert_eq!(a.pid, root);
    // Well past the grace: attached, it runs on.
    thread::sleep(Duration::from_millis(2000));
    assert_eq!(assert_alive(root), start);
    assert_eq!(kill_and_wait(&mut h2, 2).0, SIGNALED);
}

#[test]
fn no_grace_kills_at_once_and_forgets_the_record() {
    let mut h = Helper::start();
    let root = h.spawn(4, &durable("sleep 1000", false, 0, 0)).unwrap();
    let start = assert_alive(root);
    h.spawn(5, &durable("true", false, 0, 0)).unwrap();
    assert_eq!(h.wait_exit(5).exit, (EXITED, 0));
    assert!(h.close().success());
    // Killed by the time the relay exited (the daemon kills before it closes).
    assert_gone(root, start);
    let mut h2 = h.connect();
    eventually("the record is forgotten", || listed(&mut h2, 4).is_none());
    assert!(h2.attach(4, 0).is_none());
    assert!(h2.attach(5, 0).is_none());
}

#[test]
fn an_exited_exec_whose_exit_was_not_sent_keeps_its_record_for_the_grace() {
    let mut h = Helper::start();
    // More output than the initial credit: the EXIT waits for credit never granted.
    let big = INITIAL_CREDIT as usize + 1000;
    let script = format!("head -c {big} /dev/zero");
    h.spawn(6, &durable(&script, false, 60_000, 4 << 20))
        .unwrap();
    drain_initial_credit(&mut h, 6);
    assert!(h.close().success());
    let mut h2 = h.connect();
    let info = wait_listed_exit(&mut h2, 6);
    assert_eq!(info.exit, Some((EXITED, 0)));
    assert_eq!(info.end, big as u64);
    // Resumed where the first connection stopped: the rest, then the EXIT.
    let a = h2.attach(6, INITIAL_CREDIT as u64).unwrap();
    assert_eq!((a.at, a.end), (INITIAL_CREDIT as u64, big as u64));
    let (rest, exit) = output_until_exit(&mut h2, 6);
    assert_eq!((rest.len(), exit), (1000, (EXITED, 0)));
}

#[test]
fn another_connection_takes_an_exec_over() {
    let mut h = Helper::start();
    let mut sp = durable("cat", false, 60_000, 0);
    sp.stdin_piped = true;
    h.spawn(8, &sp).unwrap();
    h.send_data(STDIN, 8, b"one\n");
    let mut got = Vec::new();
    while got.len() < 4 {
        let f = h.recv();
        match f.kind {
            STDOUT => {
                got.extend_from_slice(&f.payload);
                h.send_u32(CREDIT, 8, f.payload.len() as u32);
            }
            STDIN_ACK => {}
            k => panic!("unexpected frame kind {k}"),
        }
    }
    assert_eq!(got, b"one\n");
    let mut h2 = h.connect();
    let a = h2.attach(8, u64::MAX).unwrap();
    assert_eq!((a.at, a.end, a.stdin_taken, a.stdin_open), (4, 4, 4, true));
    // The first connection is told, and gets nothing more of it (but the answers to
    // what it sends itself).
    let mut detached = false;
    while !detached {
        let f = h.recv();
        assert_eq!(f.id, 8, "{f:?}");
        match f.kind {
            DETACHED => detached = true,
            STDIN_ACK => {}
            k => panic!("unexpected frame kind {k} before DETACHED"),
        }
    }
    // Output goes to the connection attached, whichever sent the input; acks go to
    // the sender.
    let mut out = Vec::new();
    for (from_first, data) in [(false, &b"two\n"[..]), (true, b"three\n")] {
        if from_first {
            h.send_data(STDIN, 8, data);
        } else {
            h2.send_data(STDIN, 8, data);
        }
        let want = out.len() + data.len();
        let mut acked = from_first;
        while out.len() < want || !acked {
            let f = h2.recv();
            assert_eq!(f.id, 8);
            match f.kind {
                STDOUT => {
                    out.extend_from_slice(&f.payload);
                    h2.send_u32(CREDIT, 8, f.payload.len() as u32);
                }
                STDIN_ACK if !from_first => acked = true,
                k => panic!("unexpected frame kind {k}"),
            }
        }
    }
    assert_eq!(out, b"two\nthree\n");
    // The first connection's own data is acknowledged to it.
    let f = h.recv();
    assert_eq!(
        (f.kind, f.id, Dec::new(&f.payload).u32().unwrap()),
        (STDIN_ACK, 8, 6)
    );
    h.send_empty(STDIN_EOF, 8);
    let (rest, exit) = output_until_exit(&mut h2, 8);
    assert_eq!((rest.len(), exit), (0, (EXITED, 0)));
    assert!(h.try_recv(Duration::from_millis(300)).is_none());
}

#[test]
fn an_id_held_by_the_daemon_is_refused_across_connections() {
    let mut h = Helper::start();
    let mut h2 = h.connect();
    h.spawn(7, &durable("sleep 1000", false, 0, 0)).unwrap();
    let (kind, _) = h2.spawn(7, &spawn_of(&["true"])).unwrap_err();
    assert_eq!(kind, SpawnError::IdInUse);
    // The same on the connection that has it.
    assert_eq!(
        h.spawn(7, &spawn_of(&["true"])).unwrap_err().0,
        SpawnError::IdInUse
    );
    // Another id is fine.
    assert_eq!(h2.run(9, &spawn_of(&["true"])).exit, (EXITED, 0));
    // Once it is over (and its EXIT went out) the id is free again.
    assert_eq!(kill_and_wait(&mut h, 7).0, SIGNALED);
    let deadline = Instant::now() + PATIENCE;
    loop {
        match h2.spawn(7, &spawn_of(&["true"])) {
            Ok(_) => break,
            Err((SpawnError::IdInUse, _)) => {
                assert!(Instant::now() < deadline, "id 7 never freed");
                thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("{e:?}"),
        }
    }
    assert_eq!(h2.wait_exit(7).exit, (EXITED, 0));
    // Id 0 is the connection's.
    assert_eq!(
        h.spawn(0, &spawn_of(&["true"])).unwrap_err().0,
        SpawnError::Other
    );
}

#[test]
fn release_forgets_an_exited_record_and_a_running_one_once_it_exits() {
    let mut h = Helper::start();
    let o = h.run(1, &durable("echo hi", true, 0, 0));
    assert_eq!((o.stdout, o.exit), (b"hi\n".to_vec(), (EXITED, 0)));
    let info = listed(&mut h, 1).expect("a detached record stays");
    assert_eq!((info.end, info.exit), (3, Some((EXITED, 0))));
    h.send_empty(RELEASE, 1);
    assert!(h.attach(1, 0).is_none());
    assert!(listed(&mut h, 1).is_none());
    // Running: kept until it exits.
    h.spawn(2, &durable("sleep 0.5", true, 0, 0)).unwrap();
    h.send_empty(RELEASE, 2);
    assert!(listed(&mut h, 2).is_some());
    let f = h.recv();
    assert_eq!((f.kind, f.id), (EXIT, 2), "{f:?}");
    eventually("the released record is forgotten", || {
        listed(&mut h, 2).is_none()
    });
    // A RELEASE of an unknown id is ignored.
    h.send_empty(RELEASE, 99);
    h.send_empty(PING, 3);
    assert_eq!(h.recv().kind, PONG);
}

#[test]
fn discard_of_a_detached_exec_only_unattaches_it() {
    let mut h = Helper::start();
    h.spawn(4, &durable("sleep 0.3; echo late", true, 0, 0))
        .unwrap();
    h.send_empty(DISCARD, 4);
    assert!(!listed(&mut h, 4).expect("listed").attached);
    let info = wait_listed_exit(&mut h, 4);
    assert_eq!(info.end, 5);
    // Nothing of it came here; its output was kept.
    assert!(h.try_recv(Duration::from_millis(100)).is_none());
    h.attach(4, 0).unwrap();
    let (out, exit) = output_until_exit(&mut h, 4);
    assert_eq!((out, exit), (b"late\n".to_vec(), (EXITED, 0)));
}

#[test]
fn relays_started_at_once_share_one_daemon() {
    let inst = Instance::new();
    let n = 6;
    let barrier = Arc::new(Barrier::new(n));
    let threads: Vec<_> = (0..n)
        .map(|_| {
            let (inst, barrier) = (inst.clone(), barrier.clone());
            thread::spawn(move || {
                let cmd = inst.command();
                barrier.wait();
                let h = Helper::start_cmd(inst, cmd);
                (h.hello.pid, h.hello.durable, h)
            })
        })
        .collect();
    let results: Vec<(u32, bool, Helper)> =
        threads.into_iter().map(|t| t.join().unwrap()).collect();
    let pid = results[0].0;
    for (p, durable, _) in &results {
        assert_eq!((*p, *durable), (pid, true));
    }
    assert_eq!(inst.daemons(), [pid]);
    // The daemon's directory and files: ours, closed to others.
    let d = inst.daemon_dir();
    let md = fs::symlink_metadata(&d).unwrap();
    assert!(md.is_dir());
    assert_eq!(md.mode() & 0o7777, 0o700);
    let mut names: Vec<(String, u32)> = fs::read_dir(&d)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let mode = e.metadata().unwrap().mode() & 0o7777;
            (e.file_name().into_string().unwrap(), mode)
        })
        .collect();
    names.sort();
    let digest = format!("{:016x}", results[0].2.hello.digest);
    assert_eq!(
        names,
        [
            (format!("{digest}.lock"), 0o600),
            (format!("{digest}.sock"), 0o600)
        ]
    );
}

/// The relay of `inst` serves its connection itself: no daemon, `durable` false, and
/// the end of its stdin kills what runs, as version 2 did.
fn assert_serves_itself(inst: Arc<Instance>) {
    let mut h = Helper::start_cmd(inst.clone(), inst.command());
    assert!(!h.hello.durable);
    assert_eq!((h.hello.pid, h.hello.relay), (h.child.id(), 0));
    assert!(inst.daemons().is_empty());
    // Detached and with a grace: nothing outlives this stream.
    let root = h.spawn(1, &durable("sleep 1000", true, 60_000, 0)).unwrap();
    let start = assert_alive(root);
    assert_eq!(h.run(2, &sh("echo ok")).text(), "ok\n");
    assert!(h.close().success());
    assert_gone(root, start);
}

#[test]
fn a_file_where_the_daemon_directory_goes_makes_the_relay_serve_itself() {
    let inst = Instance::new();
    fs::write(inst.daemon_dir(), "not a directory").unwrap();
    assert_serves_itself(inst);
}

#[test]
fn a_link_where_the_daemon_directory_goes_is_not_followed() {
    let inst = Instance::new();
    let elsewhere = TempDir::new();
    fs::set_permissions(elsewhere.path(), fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::symlink(elsewhere.path(), inst.daemon_dir()).unwrap();
    assert_serves_itself(inst);
    assert_eq!(fs::read_dir(elsewhere.path()).unwrap().count(), 0);
}

#[test]
fn a_daemon_directory_of_another_user_is_not_used() {
    if !is_root() {
        eprintln!("skipped: needs root to give the directory away");
        return;
    }
    let inst = Instance::new();
    let d = inst.daemon_dir();
    fs::create_dir(&d).unwrap();
    fs::set_permissions(&d, fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::chown(&d, Some(65534), Some(65534)).unwrap();
    assert_serves_itself(inst);
}

#[test]
fn a_daemon_directory_of_ours_with_another_mode_is_made_private() {
    let inst = Instance::new();
    let d = inst.daemon_dir();
    fs::create_dir(&d).unwrap();
    fs::set_permissions(&d, fs::Permissions::from_mode(0o777)).unwrap();
    // Planted while it was open: this build's socket, which nobody listens on.
    let (_, digest) = fnv_of_file(BIN);
    let stale = std::os::unix::net::UnixListener::bind(d.join(format!("{digest:016x}.sock")));
    drop(stale.unwrap());
    let mut h = Helper::start_cmd(inst.clone(), inst.command());
    assert!(h.hello.durable);
    assert_eq!(h.run(1, &sh("echo ok")).text(), "ok\n");
    let md = fs::metadata(&d).unwrap();
    assert_eq!(md.mode() & 0o7777, 0o700);
}

#[test]
fn a_peer_of_another_uid_is_refused() {
    if !is_root() || Command::new("python3").arg("-V").output().is_err() {
        eprintln!("skipped: needs root and python3");
        return;
    }
    let h = Helper::start();
    let d = h.inst.daemon_dir();
    let sock = d.join(format!("{:016x}.sock", h.hello.digest));
    // Let another user reach the socket (the directory is the daemon's gate, the peer
    // check its second).
    fs::set_permissions(&d, fs::Permissions::from_mode(0o711)).unwrap();
    fs::set_permissions(&sock, fs::Permissions::from_mode(0o666)).unwrap();
    let script = "import socket,sys\ns=socket.socket(socket.AF_UNIX)\ns.connect(sys.argv[1])\n\
                  s.settimeout(20)\nprint(len(s.recv(4096)))";
    let run = |uid: u32| {
        use std::os::unix::process::CommandExt;
        let out = Command::new("python3")
            .args(["-c", script])
            .arg(&sock)
            .uid(uid)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout)
            .unwrap()
            .trim()
            .parse::<usize>()
            .unwrap()
    };
    // Another user: closed at once, no HELLO.
    assert_eq!(run(65534), 0);
    // Root: a HELLO.
    assert!(run(0) > 0);
    fs::set_permissions(&d, fs::Permissions::from_mode(0o700)).unwrap();
}

#[test]
fn a_killed_daemon_takes_its_execs_and_the_next_relay_starts_another() {
    let mut h = Helper::start();
    let root = h.spawn(1, &durable("sleep 1000", true, 60_000, 0)).unwrap();
    let start = assert_alive(root);
    let old = h.hello.pid;
    h.inst.kill_daemons();
    // Its relay's stream ends; its shepherd, cut off, kills the exec.
    let deadline = Instant::now() + PATIENCE;
    while h.child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "the relay did not exit");
        thread::sleep(Duration::from_millis(10));
    }
    assert_gone(root, start);
    let mut h2 = h.connect();
    assert!(h2.hello.durable);
    assert_ne!(h2.hello.pid, old);
    assert!(h2.attach(1, 0).is_none());
    assert_eq!(h2.run(1, &sh("echo again")).text(), "again\n");
}

#[test]
fn floods_of_attach_and_list_are_answered_and_bounded() {
    let mut h = Helper::start();
    h.spawn(1, &durable("seq 1 20000", true, 0, 1 << 20))
        .unwrap();
    let (out, _) = output_until_exit(&mut h, 1);
    let n = 300;
    // Never read while they are sent: the daemon keeps reading.
    for i in 0..n {
        let mut e = Enc::frame(ATTACH, 1);
        e.u64(0);
        h.send(e.finish());
        h.send_empty(LIST, 0x1000 + i);
    }
    h.send_empty(PING, 2);
    let (mut attached, mut lists, mut exits) = (0, 0, 0);
    let mut data = 0usize;
    loop {
        let f = h.recv();
        match (f.kind, f.id) {
            (ATTACHED, 1) => attached += 1,
            (EXECS, _) => lists += 1,
            (EXIT, 1) => exits += 1,
            (STDOUT, 1) => data += f.payload.len(),
            (PONG, 2) => break,
            _ => panic!("unexpected {f:?}"),
        }
    }
    assert_eq!((attached, lists), (n, n));
    // Output queued for an earlier attachment is dropped when the next one comes: at
    // most what one attachment sends was still going out when each came.
    assert!(exits >= 1 && exits <= n, "{exits}");
    assert!(
        data >= out.len() && data <= n as usize * out.len(),
        "{data}"
    );
    assert!(h.attach(1, u64::MAX).is_some());
}

#[test]
fn connections_beyond_the_bound_are_closed_and_a_bad_peer_harms_no_other() {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;
    let mut h = Helper::start();
    let idle = idle_threads(&mut h);
    let sock = h
        .inst
        .daemon_dir()
        .join(format!("{:016x}.sock", h.hello.digest));
    let hello_of = |s: &mut UnixStream| {
        s.set_read_timeout(Some(PATIENCE)).unwrap();
        let mut len = [0u8; 4];
        match s.read_exact(&mut len) {
            Ok(()) => {
                let mut rest = vec![0u8; u32::from_le_bytes(len) as usize];
                s.read_exact(&mut rest).unwrap();
                assert_eq!(rest[0], HELLO);
                true
            }
            Err(_) => false,
        }
    };
    // The test's own connection is one: the others up to the bound are served.
    let mut open: Vec<UnixStream> = (1..MAX_CONNECTIONS)
        .map(|_| {
            let mut s = UnixStream::connect(&sock).unwrap();
            assert!(hello_of(&mut s));
            s
        })
        .collect();
    // Beyond: closed at once, no HELLO.
    let mut extra = UnixStream::connect(&sock).unwrap();
    assert!(!hello_of(&mut extra));
    // A peer that sends garbage gets PROTOCOL_ERROR and its connection ends; the
    // others are served on.
    let mut bad = open.pop().unwrap();
    bad.write_all(&[0xff; 64]).unwrap();
    let mut rest = Vec::new();
    let _ = bad.read_to_end(&mut rest);
    let (kind, _, _, _) = split_frame(&rest).unwrap().unwrap();
    assert_eq!(kind, PROTOCOL_ERROR);
    assert_eq!(h.run(1, &sh("echo still")).text(), "still\n");
    // Once it is gone there is room for one more.
    eventually("room for another connection", || {
        let mut s = UnixStream::connect(&sock).unwrap();
        let served = hello_of(&mut s);
        if served {
            open.push(s);
        }
        served
    });
    drop(open);
    // Every connection's threads are gone with it.
    assert_threads_back_to(&h, idle);
}

#[test]
fn a_process_of_an_exec_cannot_reach_the_daemon() {
    let mut h = Helper::start();
    let exe = h.inst.exe.display().to_string();
    // The helper started as a relay from an exec: its connection is closed at once, no
    // HELLO reaches it.
    let relay = format!("'{exe}' </dev/null 2>/dev/null | wc -c");
    assert_eq!(h.run(1, &sh(&relay)).text().trim(), "0");
    // Nor from a process that left its exec's session and parent (it is reparented to
    // the exec's shepherd, still below the daemon).
    let out = h.inst.dir.join("orphan");
    let script = format!(
        "setsid -f sh -c \"{relay} > '{}.tmp' && mv '{0}.tmp' '{0}'\" </dev/null >/dev/null 2>&1",
        out.display()
    );
    h.run(2, &sh(&script));
    eventually("the orphan's count", || out.exists());
    assert_eq!(fs::read_to_string(&out).unwrap().trim(), "0");
    // A relay the engine (here: the test) starts is served.
    assert_eq!(h.connect().run(3, &sh("echo ok")).text(), "ok\n");
}

/// Resident memory of `pid`, kB.
fn rss_kb(pid: u32) -> u64 {
    let s = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

#[test]
fn a_peer_that_never_reads_cannot_grow_the_daemon() {
    use std::io::{ErrorKind, Read, Write};
    use std::os::unix::net::UnixStream;
    let mut h = Helper::start();
    let daemon = h.inst.daemons()[0];
    let before = rss_kb(daemon);
    let sock = h
        .inst
        .daemon_dir()
        .join(format!("{:016x}.sock", h.hello.digest));
    let mut s = UnixStream::connect(&sock).unwrap();
    s.set_nonblocking(true).unwrap();
    let ping = Enc::frame(PING, 1).finish();
    let batch = ping.repeat(100_000);
    // Far more answers than the daemon may queue (10 M PONGs took 1 GB before).
    let most = 10_000_000u64 * ping.len() as u64;
    let (mut sent, mut off) = (0u64, 0usize);
    let mut stalled: Option<Instant> = None;
    loop {
        assert!(
            sent < most,
            "the daemon kept reading: {sent} bytes of PING taken"
        );
        match s.write(&batch[off..]) {
            Ok(n) => {
                sent += n as u64;
                off = (off + n) % batch.len();
                stalled = None;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                let since = *stalled.get_or_insert_with(Instant::now);
                if since.elapsed() >= Duration::from_secs(2) {
                    break;
                }
                thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("{e}"),
        }
    }
    let grown = rss_kb(daemon).saturating_sub(before);
    assert!(grown < 160 * 1024, "the daemon grew by {grown} kB");
    // Other connections are served meanwhile.
    assert_eq!(h.run(5, &sh("echo alive")).text(), "alive\n");
    // Reading, the peer gets every answer: one PONG per whole PING.
    s.set_nonblocking(false).unwrap();
    let rest = (ping.len() - (sent % ping.len() as u64) as usize) % ping.len();
    let mut tail = s.try_clone().unwrap();
    let finish = thread::spawn(move || tail.write_all(&ping[ping.len() - rest..]).unwrap());
    let want = (sent + rest as u64) / 9;
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    let (mut buf, mut pongs) = (Vec::new(), 0u64);
    let mut chunk = vec![0u8; 1 << 20];
    while pongs < want {
        let n = s.read(&mut chunk).unwrap();
        assert!(n > 0, "closed after {pongs} of {want} PONGs");
        buf.extend_from_slice(&chunk[..n]);
        let mut at = 0;
        while let Some((kind, id, _, len)) = split_frame(&buf[at..]).unwrap() {
            match kind {
                HELLO => {}
                PONG => {
                    assert_eq!(id, 1);
                    pongs += 1;
                }
                _ => panic!("unexpected frame {kind}"),
            }
            at += len;
        }
        buf.drain(..at);
    }
    finish.join().unwrap();
}

#[test]
fn a_flood_of_kills_runs_one_kill_per_exec() {
    let mut h = Helper::start();
    let idle = idle_threads(&mut h);
    // It ignores SIGTERM: its kill takes the whole grace.
    h.spawn(
        1,
        &durable("trap '' TERM; while :; do sleep 0.1; done", false, 0, 0),
    )
    .unwrap();
    for _ in 0..20_000 {
        h.send_empty(KILL, 1);
    }
    let mut most = 0;
    let (mut killed, mut exit) = (0, false);
    let deadline = Instant::now() + PATIENCE;
    while !exit || killed == 0 {
        assert!(Instant::now() < deadline, "no end of the kill");
        most = most.max(threads(h.hello.pid));
        let Some(f) = h.try_recv(Duration::from_millis(5)) else {
            continue;
        };
        match (f.kind, f.id) {
            (KILLED, 1) => killed += 1,
            (EXIT, 1) => exit = true,
            (STARTED, 1) => {}
            _ => panic!("unexpected {f:?}"),
        }
    }
    // The exec's own threads and one kill, however many KILLs came.
    assert!(most <= idle + 4, "{most} threads ({idle} when idle)");
    assert!(killed >= 1, "{killed}");
    assert_threads_back_to(&h, idle);
}

#[test]
fn leave_unattaches_one_exec_as_a_broken_connection_would() {
    let mut h = Helper::start();
    // With a grace: it runs on unattached, nothing more of it comes here, and another
    // connection reads all of it.
    h.spawn(2, &durable("sleep 1000", false, 0, 0)).unwrap();
    h.spawn(1, &durable(&counter(30), false, 60_000, 0))
        .unwrap();
    let f = h.recv();
    assert_eq!((f.kind, f.id), (STDOUT, 1), "{f:?}");
    h.send_empty(LEAVE, 1);
    // From a connection it is not attached to: ignored.
    let mut h2 = h.connect();
    h2.send_empty(LEAVE, 2);
    h.send_empty(PING, 9);
    loop {
        let f = h.recv();
        match (f.kind, f.id) {
            (PONG, 9) => break,
            (STDOUT, 1) => {} // queued before the LEAVE was read
            _ => panic!("unexpected {f:?}"),
        }
    }
    let info = listed(&mut h2, 1).expect("listed");
    assert!(!info.attached, "{info:?}");
    assert!(listed(&mut h2, 2).expect("listed").attached);
    let a = h2.attach(1, 0).expect("attached");
    assert_eq!(a.at, 0);
    let (out, exit) = output_until_exit(&mut h2, 1);
    assert_eq!(out, counter_output(30));
    assert_eq!(exit, (EXITED, 0));
    assert!(h.try_recv(Duration::from_millis(300)).is_none());
    // Without a grace: killed at once, as with a broken connection.
    let root = h.spawn(3, &durable("sleep 1000", false, 0, 0)).unwrap();
    let start = assert_alive(root);
    h.send_empty(LEAVE, 3);
    assert_gone(root, start);
    assert!(h2.attach(3, 0).is_none_or(|a| a.end == 0));
}
