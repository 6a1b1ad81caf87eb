//! Integration tests of the exec helper's execs: spawns and their typed errors, the
//! environment and working directory, stdin, output under credit, the connection.
//!
//! They start the built helper on this host (as a child with piped stdin/stdout, no
//! container) and speak the protocol to it; the harness is `common/mod.rs`. Several tests
//! need root (per-exec users, owners); the crate's tests run as root here.

mod common;

use std::fs;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use common::*;

#[test]
fn hello_describes_the_helper() {
    let h = Helper::start();
    assert_eq!(h.hello.version, VERSION);
    // The daemon serves the connection, through the relay the test started.
    assert!(h.hello.durable);
    assert_eq!(h.hello.relay, h.child.id());
    assert_ne!(h.hello.pid, h.child.id());
    assert_eq!(h.inst.daemons(), [h.hello.pid]);
    let status = fs::read_to_string("/proc/self/status").unwrap();
    let field = |name: &str| -> u32 {
        let line = status.lines().find(|l| l.starts_with(name)).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    assert_eq!(h.hello.uid, field("Uid:"));
    assert_eq!(h.hello.gid, field("Gid:"));
    let (size, digest) = fnv_of_file(BIN);
    assert_eq!(h.hello.size, size);
    assert_eq!(h.hello.digest, digest);
}

#[test]
fn ping_pong() {
    let mut h = Helper::start();
    h.send_empty(PING, 77);
    let f = h.recv();
    assert_eq!((f.kind, f.id), (PONG, 77));
}

#[test]
fn exit_codes_and_signals() {
    let mut h = Helper::start();
    assert_eq!(h.run(1, &spawn_of(&["true"])).exit, (EXITED, 0));
    assert_eq!(h.run(2, &sh("exit 3")).exit, (EXITED, 3));
    assert_eq!(h.run(3, &sh("kill -9 $$")).exit, (SIGNALED, 9));
    assert_eq!(h.run(4, &sh("exit 137")).exit, (EXITED, 137));
    let o = h.run(5, &sh("echo out; echo err >&2; exit 1"));
    assert_eq!(o.exit, (EXITED, 1));
    assert_eq!(o.stdout, b"out\n");
    assert_eq!(o.stderr, b"err\n");
    // Without a piped stdin the process reads /dev/null.
    let o = h.run(6, &spawn_of(&["cat"]));
    assert_eq!((o.exit, o.stdout.len()), ((EXITED, 0), 0));
}

#[test]
fn environment() {
    let mut h = Helper::start_with(|c| {
        c.env("FOO_BASE", "base")
            .env("FOO", "old")
            .env("RUNCELL_EXEC_ID", "inherited")
            .env("SANDBOX_EXEC_ID", "inherited-old");
    });
    let mut sp = sh(r#"echo "$FOO|$FOO_BASE|$RUNCELL_EXEC_ID|${SANDBOX_EXEC_ID-unset}""#);
    let marker = String::from_utf8(sp.env[0].1.clone()).unwrap();
    sp.env.push((b"FOO".to_vec(), b"a".to_vec()));
    sp.env.push((b"FOO".to_vec(), b"b".to_vec()));
    let o = h.run(1, &sp);
    assert_eq!(o.text(), format!("b|base|{marker}|unset\n"));

    // The helper's own RUNCELL_EXEC_ID (or one under its old name, SANDBOX_EXEC_ID) is
    // never passed on.
    let mut sp = sh(r#"echo "${RUNCELL_EXEC_ID-unset}|${SANDBOX_EXEC_ID-unset}""#);
    sp.env.clear();
    assert_eq!(h.run(2, &sp).text(), "unset|unset\n");

    // The program is looked up on the exec's PATH.
    let dir = TempDir::new();
    let script = dir.path().join("hello-tool");
    fs::write(&script, "#!/bin/sh\necho from-path\n").unwrap();
    fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
    let mut sp = spawn_of(&["hello-tool"]);
    sp.env.push((
        b"PATH".to_vec(),
        format!("/nonexistent:{}:/usr/bin:/bin", dir.path().display()).into_bytes(),
    ));
    assert_eq!(h.run(3, &sp).text(), "from-path\n");
    let mut sp = spawn_of(&["true"]);
    sp.env.push((b"PATH".to_vec(), b"/nonexistent".to_vec()));
    assert_eq!(h.spawn(4, &sp).unwrap_err().0, SpawnError::NotFound);
}

#[test]
fn working_directory() {
    let default = TempDir::new();
    let other = TempDir::new();
    let d = default.path().to_path_buf();
    let mut h = Helper::start_with(|c| {
        c.current_dir(&d);
    });
    assert_eq!(
        h.run(1, &spawn_of(&["pwd"])).text(),
        format!("{}\n", d.display())
    );
    let mut sp = spawn_of(&["pwd"]);
    sp.working_dir = Some(other.path().as_os_str().as_encoded_bytes().to_vec());
    assert_eq!(
        h.run(2, &sp).text(),
        format!("{}\n", other.path().display())
    );
    // Relative to the helper's own directory.
    fs::create_dir(d.join("sub")).unwrap();
    let mut sp = spawn_of(&["pwd"]);
    sp.working_dir = Some(b"sub".to_vec());
    assert_eq!(h.run(3, &sp).text(), format!("{}/sub\n", d.display()));
}

#[test]
fn spawn_errors_are_typed() {
    let dir = TempDir::new();
    let mut h = Helper::start();
    let err = |h: &mut Helper, id, sp: &Spawn| h.spawn(id, sp).unwrap_err().0;

    assert_eq!(
        err(&mut h, 1, &spawn_of(&["no-such-program-runcell"])),
        SpawnError::NotFound
    );
    assert_eq!(
        err(&mut h, 2, &spawn_of(&["/nonexistent/program"])),
        SpawnError::NotFound
    );
    let plain = dir.path().join("plain");
    fs::write(&plain, "data").unwrap();
    fs::set_permissions(&plain, fs::Permissions::from_mode(0o644)).unwrap();
    assert_eq!(
        err(&mut h, 3, &spawn_of(&[plain.to_str().unwrap()])),
        SpawnError::NotExecutable
    );
    let mut sp = spawn_of(&["plain"]);
    sp.env.push((
        b"PATH".to_vec(),
        dir.path().as_os_str().as_encoded_bytes().to_vec(),
    ));
    assert_eq!(err(&mut h, 4, &sp), SpawnError::NotExecutable);

    let mut sp = spawn_of(&["true"]);
    sp.working_dir = Some(b"/nonexistent/dir".to_vec());
    assert_eq!(err(&mut h, 5, &sp), SpawnError::WorkingDirMissing);
    sp.working_dir = Some(plain.as_os_str().as_encoded_bytes().to_vec());
    assert_eq!(err(&mut h, 6, &sp), SpawnError::WorkingDirMissing);

    let mut sp = spawn_of(&["true"]);
    sp.user = Some(b"no-such-user-runcell".to_vec());
    assert_eq!(err(&mut h, 7, &sp), SpawnError::UnknownUser);
    sp.user = Some(b"root:no-such-group-runcell".to_vec());
    assert_eq!(err(&mut h, 8, &sp), SpawnError::UnknownUser);

    // Exists, but the user cannot enter it (switching users needs root).
    if !is_root() {
        return;
    }
    let closed = dir.path().join("closed");
    fs::create_dir(&closed).unwrap();
    fs::set_permissions(&closed, fs::Permissions::from_mode(0o700)).unwrap();
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let mut sp = spawn_of(&["true"]);
    sp.user = Some(b"65534".to_vec());
    sp.working_dir = Some(closed.as_os_str().as_encoded_bytes().to_vec());
    assert_eq!(err(&mut h, 9, &sp), SpawnError::WorkingDirDenied);

    // The helper still works after all that.
    assert_eq!(h.run(10, &spawn_of(&["true"])).exit, (EXITED, 0));
}

#[test]
fn stdin_round_trip_through_cat() {
    let mut h = Helper::start();
    let data = noise(5 * 1024 * 1024 + 123);
    let mut sp = spawn_of(&["cat"]);
    sp.stdin_piped = true;
    h.spawn(1, &sp).unwrap();
    let (mut sent, mut acked, mut out) = (0usize, 0usize, Vec::new());
    let mut eof_sent = false;
    loop {
        while sent < data.len() && sent - acked + CHUNK <= STDIN_WINDOW as usize {
            let n = CHUNK.min(data.len() - sent);
            h.send_data(STDIN, 1, &data[sent..sent + n]);
            sent += n;
        }
        if sent == data.len() && !eof_sent {
            h.send_empty(STDIN_EOF, 1);
            eof_sent = true;
        }
        let f = h.recv();
        assert_eq!(f.id, 1);
        match f.kind {
            STDIN_ACK => {
                acked += Dec::new(&f.payload).u32().unwrap() as usize;
                assert!(acked <= sent);
            }
            STDOUT => {
                out.extend_from_slice(&f.payload);
                h.send_u32(CREDIT, 1, f.payload.len() as u32);
            }
            EXIT => {
                assert_eq!(Dec::new(&f.payload).u8().unwrap(), EXITED);
                break;
            }
            k => panic!("unexpected frame kind {k}"),
        }
    }
    assert_eq!(acked, data.len());
    assert!(out == data, "cat's output differs from its input");
}

#[test]
fn stdin_closed_by_the_process_is_still_acked() {
    let mut h = Helper::start();
    let mut sp = sh("exec 0<&-; sleep 0.3; echo done");
    sp.stdin_piped = true;
    h.spawn(1, &sp).unwrap();
    let data = noise(STDIN_WINDOW as usize);
    for c in data.chunks(CHUNK) {
        h.send_data(STDIN, 1, c);
    }
    let mut acked = 0;
    let mut out = Vec::new();
    loop {
        let f = h.recv();
        match f.kind {
            STDIN_ACK => acked += Dec::new(&f.payload).u32().unwrap() as usize,
            STDOUT => out.extend_from_slice(&f.payload),
            EXIT => break,
            k => panic!("unexpected frame kind {k}"),
        }
    }
    assert_eq!(acked, data.len());
    assert_eq!(out, b"done\n");
}

#[test]
fn large_stdout_with_credit() {
    let mut h = Helper::start();
    let size = 8 * 1024 * 1024;
    let o = h.run(1, &sh(&format!("yes abcdefg | head -c {size}")));
    assert_eq!(o.exit, (EXITED, 0));
    assert_eq!(o.stdout.len(), size);
    assert!(o.stdout.chunks(8).all(|c| c == &b"abcdefg\n"[..c.len()]));
}

#[test]
fn no_credit_means_no_output() {
    let mut h = Helper::start();
    let total = 4 * INITIAL_CREDIT as usize;
    h.spawn(
        1,
        &spawn_of(&["head", "-c", &total.to_string(), "/dev/zero"]),
    )
    .unwrap();
    let mut got = 0usize;
    let until = Instant::now() + Duration::from_millis(1500);
    while let Some(f) = h.try_recv(until.saturating_duration_since(Instant::now())) {
        assert_eq!(f.kind, STDOUT, "only output before credit: {f:?}");
        got += f.payload.len();
        assert!(
            got <= INITIAL_CREDIT as usize,
            "more than the initial credit"
        );
    }
    assert!(got <= INITIAL_CREDIT as usize);
    h.send_u32(CREDIT, 1, total as u32);
    let o = h.wait_exit(1);
    assert_eq!(o.exit, (EXITED, 0));
    assert_eq!(got + o.stdout.len(), total);
}

#[test]
fn background_child_holding_stdout_does_not_delay_exit() {
    let mut h = Helper::start();
    let t = Instant::now();
    let o = h.run(1, &sh("sleep 30 & echo $!"));
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "EXIT took {:?}",
        t.elapsed()
    );
    assert_eq!(o.exit, (EXITED, 0));
    let pid: u32 = o.text().trim().parse().unwrap();
    let start = assert_alive(pid);
    // The exec is over, but its background process is still its own: KILL reaches it.
    h.send_empty(KILL, 1);
    let f = h.recv();
    assert_eq!((f.kind, f.id), (KILLED, 1));
    assert_gone(pid, start);
}

#[test]
fn malformed_frame_is_a_protocol_error() {
    let mut h = Helper::start();
    let root = h.spawn(1, &spawn_of(&["sleep", "1000"])).unwrap();
    let start = assert_alive(root);
    // A SPAWN whose payload ends early.
    let mut e = Enc::frame(SPAWN, 2);
    e.u32(5);
    h.send(e.finish());
    let f = h.recv();
    assert_eq!(f.kind, PROTOCOL_ERROR);
    let deadline = Instant::now() + PATIENCE;
    while h.child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "the helper did not exit");
        thread::sleep(Duration::from_millis(10));
    }
    assert_gone(root, start);
}

#[test]
fn discard_of_a_running_exec_drains_it_and_still_exits() {
    let mut h = Helper::start();
    let idle = idle_threads(&mut h);
    h.spawn(1, &sh("yes | head -c 64000000")).unwrap();
    // The host stops reading: no credit, then DISCARD.
    drain_initial_credit(&mut h, 1);
    h.send_empty(DISCARD, 1);
    // The output is drained and dropped, so `head` ends and EXIT arrives (nothing else).
    let f = h.recv();
    assert_eq!((f.kind, f.id), (EXIT, 1), "{f:?}");
    let mut d = Dec::new(&f.payload);
    assert_eq!((d.u8().unwrap(), d.i32().unwrap()), (EXITED, 0));
    // Its output thread is gone.
    assert_threads_back_to(&h, idle);
    // A DISCARD of an unknown id is ignored; credit for a discarded id too.
    h.send_empty(DISCARD, 77);
    h.send_u32(CREDIT, 1, 1 << 20);
    h.send_empty(PING, 2);
    let f = h.recv();
    assert_eq!((f.kind, f.id), (PONG, 2), "{f:?}");
    assert_eq!(h.run(3, &sh("echo ok")).text(), "ok\n");
}

#[test]
fn a_spawn_of_several_mebibytes() {
    // Exec's own limit on argv + env is a quarter of the stack limit (at most 6 MiB) and
    // 128 KiB per string: raise the former, keep under the latter.
    // The daemon, started by the relay, inherits the limit.
    let inst = Instance::new();
    let mut p = Command::new("sh");
    p.args(["-c", r#"ulimit -s 65536 && exec "$0""#])
        .arg(&inst.exe);
    let mut h = Helper::start_cmd(inst, p);
    let pieces = 14;
    let len = 120_000;
    let script = r#"n=0; for a in "$@"; do n=$((n + ${#a})); done; echo "$# $n ${#RUNCELL_BIG_0} ${#RUNCELL_BIG_13}""#;
    let mut sp = sh(script);
    sp.argv.push(b"sh".to_vec());
    for i in 0..pieces {
        sp.argv.push(vec![b'a' + i as u8; len]);
        sp.env.push((
            format!("RUNCELL_BIG_{i}").into_bytes(),
            vec![b'A' + i as u8; len],
        ));
    }
    let mut e = Enc::frame(SPAWN, 1);
    sp.encode(&mut e);
    assert!(e.finish().len() > 3 << 20, "a SPAWN over 3 MiB");
    let o = h.run(1, &sp);
    assert_eq!(o.exit, (EXITED, 0), "{o:?}");
    assert_eq!(o.text(), format!("{pieces} {} {len} {len}\n", pieces * len));
}

#[test]
fn root_makes_its_own_directory_and_executable_root_owned() {
    if !is_root() {
        eprintln!("skipped: needs root");
        return;
    }
    let dir = TempDir::new();
    let own = dir.path().join("runcell");
    fs::create_dir(&own).unwrap();
    let exe = own.join("helper");
    // Copied by another process: no write descriptor of ours can make the exec ETXTBSY.
    let copied = Command::new("cp").arg(BIN).arg(&exe).status().unwrap();
    assert!(copied.success());
    for p in [&own, &exe] {
        std::os::unix::fs::chown(p, Some(65534), Some(65534)).unwrap();
        fs::set_permissions(p, fs::Permissions::from_mode(0o777)).unwrap();
    }
    let h = Helper::start_cmd(Instance::at(&exe), Command::new(&exe));
    assert_eq!(h.hello.uid, 0);
    assert!(h.hello.durable);
    for p in [&own, &exe] {
        let m = fs::metadata(p).unwrap();
        assert_eq!(
            (m.uid(), m.gid(), m.mode() & 0o7777),
            (0, 0, 0o755),
            "{}",
            p.display()
        );
    }
}

#[test]
fn stdin_is_read_while_stdout_is_blocked() {
    let dir = TempDir::new();
    let marker = dir.path().join("spawned");
    let inst = Instance::new();
    let mut child = inst
        .command()
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    // Nobody reads the helper's stdout: `yes` fills the pipe within its initial credit.
    let _unread = child.stdout.take().unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let spawn = |id: u32, sp: &Spawn| {
        let mut e = Enc::frame(SPAWN, id);
        sp.encode(&mut e);
        e.finish()
    };
    stdin.write_all(&spawn(1, &spawn_of(&["yes"]))).unwrap();
    thread::sleep(Duration::from_millis(300));
    // The helper still reads and handles frames (its answers wait in its queue).
    for id in 2..50 {
        stdin.write_all(&Enc::frame(PING, id).finish()).unwrap();
    }
    let touch = format!("touch '{}'", marker.display());
    stdin.write_all(&spawn(50, &sh(&touch))).unwrap();
    let deadline = Instant::now() + PATIENCE;
    while !marker.exists() {
        assert!(
            Instant::now() < deadline,
            "the helper stopped reading its stdin"
        );
        thread::sleep(Duration::from_millis(20));
    }
    // And the relay exits when its stdin ends, even though its stdout is still blocked
    // (the daemon's last frames wait for nobody).
    drop(stdin);
    let deadline = Instant::now() + PATIENCE;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the helper did not exit");
        }
        thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}");
}

#[test]
fn a_terminal_exec_runs_on_a_private_terminal_of_its_size() {
    let mut h = Helper::start();
    let mut sp = sh("for fd in 0 1 2; do [ -t $fd ] || echo no-tty-$fd; done; \
                     stty size; stat -c '%a %u' $(tty); echo err >&2; exit 3");
    sp.tty = Some((33, 101));
    h.spawn(1, &sp).unwrap();
    let out = h.wait_exit(1);
    let text = out.text();
    assert_eq!(out.exit, (EXITED, 3), "{text:?}");
    assert!(out.stderr.is_empty(), "a terminal has one stream: {out:?}");
    let uid = my_uid();
    assert_eq!(
        text,
        format!("33 101\r\n600 {uid}\r\nerr\r\n"),
        "the terminal's size, mode and owner, and stderr on it"
    );
    // A resize of an exec that ended is ignored.
    let mut e = Enc::frame(RESIZE, 1);
    e.u32(10).u32(10);
    h.send(e.finish());
    h.send_empty(PING, 2);
    assert_eq!(h.recv().kind, PONG);
}

/// This process's uid, as `stat` prints a file's owner.
fn my_uid() -> u32 {
    fs::metadata("/proc/self").unwrap().uid()
}

#[test]
fn a_terminal_exec_delivers_all_it_printed_before_exiting() {
    let mut h = Helper::start();
    for i in 1..=20u32 {
        let mut sp = sh("head -c 200000 /dev/zero | tr '\\0' x");
        sp.tty = Some((24, 80));
        h.spawn(i, &sp).unwrap();
        let out = h.wait_exit(i);
        assert_eq!(out.exit, (EXITED, 0));
        assert_eq!(out.stdout.len(), 200_000, "round {i}");
    }
}

#[test]
fn a_terminal_exec_whose_shepherd_is_killed_leaves_nothing() {
    let mut h = Helper::start();
    // They ignore the hangup that closing the terminal sends: only the kill ends them.
    // The shepherd is killed once the exec started (a shepherd killed before it answered
    // is a spawn error, a case of its own).
    let mut sp = sh("trap '' HUP; sleep 98765 & sleep 98766 & sleep 0.5; kill -9 $PPID; wait");
    sp.tty = Some((24, 80));
    h.spawn(1, &sp).unwrap();
    let out = h.wait_exit(1);
    assert_eq!(out.exit, (SIGNALED, 9), "{out:?}");
    eventually("the terminal exec's processes are gone", || {
        fs::read_dir("/proc").unwrap().flatten().all(|d| {
            let cmdline = fs::read(d.path().join("cmdline")).unwrap_or_default();
            !cmdline.starts_with(b"sleep\x0098765") && !cmdline.starts_with(b"sleep\x0098766")
        })
    });
}
