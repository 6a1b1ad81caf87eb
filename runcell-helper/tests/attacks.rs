//! Attacks on the daemon from a peer of the helper's own uid: processes of execs that
//! try to reach it (after killing their shepherd, through another build's daemon, from
//! deep process chains), peers that grant credit and never read, stdin queued from many
//! connections, GETs that never finish, and a well-behaved host with many execs in
//! flight that the backlog gate must not stall.

mod common;

use std::fs;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::thread;
use std::time::{Duration, Instant};

use common::*;

/// argv: daemon pid, a shell command. Kills its shepherd (same uid as the daemon, as
/// every exec by default), waits to be re-parented to the daemon (a child subreaper),
/// then clones with CLONE_PARENT (the clone's parent is the daemon, not the process
/// that made it) and runs the command in the clone.
const ESCAPE_C: &str = r#"
#define _GNU_SOURCE
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(int argc, char **argv) {
    pid_t daemon = atoi(argv[1]);
    pid_t shepherd = getppid();
    pid_t c = fork();
    if (c < 0) return 1;
    if (c > 0) { pause(); return 0; }
    setsid();
    kill(shepherd, SIGKILL);
    for (int i = 0; i < 1000 && getppid() != daemon; i++) usleep(10000);
    if (getppid() != daemon) return 2;
    long g = syscall(SYS_clone, CLONE_PARENT | SIGCHLD, 0, 0, 0, 0);
    if (g == 0) {
        execl("/bin/sh", "sh", "-c", argv[2], (char *)0);
        _exit(127);
    }
    return 0;
}
"#;

#[test]
fn an_exec_that_kills_its_shepherd_and_clones_a_sibling_is_refused() {
    let mut h = Helper::start();
    let Some(esc) = cc(&h.inst.dir, "esc", ESCAPE_C) else {
        eprintln!("no cc: skipped");
        return;
    };
    let exe = h.inst.exe.display().to_string();
    let out = h.inst.dir.join("escaped");
    // What the escaped process runs: a relay; a refused connection gets 0 bytes.
    let g = h.inst.dir.join("g.sh");
    fs::write(
        &g,
        format!(
            "p=$$; while [ \"$p\" -gt 1 ]; do echo \"$p $(tr '\\0' ' ' </proc/$p/cmdline)\" >> '{0}.chain'; p=$(awk '{{print $4}}' /proc/$p/stat); done; '{exe}' </dev/null 2>>'{0}.err' | wc -c > '{0}.tmp'; mv '{0}.tmp' '{0}'\n",
            out.display()
        ),
    )
    .unwrap();
    // Control: the same relay run plainly from an exec is refused.
    let relay = format!("'{exe}' </dev/null 2>/dev/null | wc -c");
    assert_eq!(h.run(1, &sh(&relay)).text().trim(), "0");

    let script = format!(
        "exec '{}' {} \"sh '{}'\"",
        esc.display(),
        h.hello.pid,
        g.display()
    );
    h.spawn(2, &sh(&script)).unwrap();
    let _ = h.wait_exit(2);
    // Its shepherd killed, the exec's processes are the daemon's strays, and it kills
    // them: the clone mostly never runs its relay. One that got there first is refused.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !out.exists() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(50));
    }
    if !out.exists() {
        let g = g.display().to_string();
        let alive = fs::read_dir("/proc").unwrap().flatten().any(|d| {
            fs::read(d.path().join("cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&g))
        });
        assert!(
            !alive,
            "the escaped process neither ran its relay nor was killed"
        );
        eprintln!("the escaped process was killed before it connected");
        return;
    }
    eprintln!(
        "daemon {} chain:\n{}err: {}",
        h.hello.pid,
        fs::read_to_string(out.with_extension("chain")).unwrap_or_default(),
        fs::read_to_string(out.with_extension("err")).unwrap_or_default()
    );
    let n: u64 = fs::read_to_string(&out).unwrap().trim().parse().unwrap();
    assert_eq!(
        n, 0,
        "a process of exec 2 got a served connection ({n} bytes: HELLO came)"
    );
}

/// Resident memory of `pid`, kB.
fn rss_kb(pid: u32) -> u64 {
    let s = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// A raw connection to the install's daemon (from the test: not a descendant).
fn raw(h: &Helper) -> UnixStream {
    let sock = h
        .inst
        .daemon_dir()
        .join(format!("{:016x}.sock", h.hello.digest));
    UnixStream::connect(sock).unwrap()
}

fn spawn_frame(id: u32, sp: &Spawn) -> Vec<u8> {
    let mut e = Enc::frame(SPAWN, id);
    sp.encode(&mut e);
    e.finish()
}

fn u32_frame(kind: u8, id: u32, v: u32) -> Vec<u8> {
    let mut e = Enc::frame(kind, id);
    e.u32(v);
    e.finish()
}

/// Output queued under a credit is not gated by the reader, so the credit is capped
/// (`MAX_CREDIT`): a peer that grants u32::MAX again and again and never reads cannot
/// have the daemon queue more than that per exec.
#[test]
fn a_huge_credit_never_read_is_capped() {
    let h = Helper::start();
    let daemon = h.hello.pid;
    let before = rss_kb(daemon);
    let mut s = raw(&h);
    s.write_all(&spawn_frame(1, &sh("exec cat /dev/zero")))
        .unwrap();
    for _ in 0..4 {
        s.write_all(&u32_frame(CREDIT, 1, u32::MAX)).unwrap();
    }
    // Never read. Stop at 1 GiB of growth (or 30 s).
    let limit_kb = 1024 * 1024;
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut grown = 0;
    while Instant::now() < deadline {
        grown = rss_kb(daemon).saturating_sub(before);
        if grown > limit_kb {
            break;
        }
        thread::sleep(Duration::from_millis(100));
    }
    // The connection's end kills the exec (no grace).
    drop(s);
    eprintln!("daemon grew by {} MiB", grown / 1024);
    assert!(
        grown < 400 * 1024,
        "a non-reading peer grew the daemon by {} MiB (gate: 64 MiB, total 256 MiB)",
        grown / 1024
    );
}

/// A host whose transport cannot read while a write blocks (Kubernetes: one task for
/// both directions). With far more output in flight than the answer backlog's bound (90
/// execs at the initial 1 MiB credit each: within every rule), its STDIN within its
/// window still goes through: output never holds the reader up.
#[test]
fn many_execs_in_flight_never_stall_a_host_s_stdin() {
    stdin_goes_through_with_producers(90);
}

/// Control: the same with 40 producers (40 MiB in flight) goes through.
#[test]
fn fewer_execs_in_flight_let_stdin_through() {
    stdin_goes_through_with_producers(40);
}

fn stdin_goes_through_with_producers(n: u32) {
    let h = Helper::start();
    let mut s = raw(&h);
    let cat = Spawn {
        stdin_piped: true,
        ..sh("cat >/dev/null")
    };
    s.write_all(&spawn_frame(1, &cat)).unwrap();
    for id in 2..2 + n {
        s.write_all(&spawn_frame(id, &sh("head -c 1100000 /dev/zero")))
            .unwrap();
    }
    // The host's task is busy for a moment (it does not read meanwhile).
    thread::sleep(Duration::from_secs(8));
    // 1 MiB of stdin: exactly the window of exec 1.
    let mut e = Enc::frame(STDIN, 1);
    e.raw(&vec![b'x'; STDIN_WINDOW as usize]);
    let stdin = e.finish();
    s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
    let r = s.write_all(&stdin);
    assert!(
        r.is_ok(),
        "a 1 MiB STDIN within its window did not go through in 10 s ({r:?}): \
         the daemon stopped reading while the host's output (credited) was in flight"
    );
}

/// Stdin is bounded per (exec, connection) and per exec: what a connection queued stays
/// queued after it ends, and any connection may send STDIN to any exec by id, so one
/// connection after another queuing 4 MiB for an exec that does not read its stdin is
/// cut once all of them together hold 16 MiB.
#[test]
fn stdin_queued_from_many_connections_is_bounded_per_exec() {
    let mut h = Helper::start();
    let daemon = h.hello.pid;
    // Durable enough; stdin piped and never read.
    let sp = Spawn {
        stdin_piped: true,
        ..sh("exec sleep 1000")
    };
    h.spawn(1, &sp).unwrap();
    let before = rss_kb(daemon);
    let mut e = Enc::frame(STDIN, 1);
    e.raw(&vec![b'x'; STDIN_WINDOW as usize]);
    let chunk = e.finish();
    let mut cut = 0;
    for _ in 0..100 {
        let mut s = raw(&h);
        // 4 windows: the most one connection may queue. Once all of them together are
        // over the exec's bound, the connection that sends more is cut.
        let sent = (0..4).all(|_| s.write_all(&chunk).is_ok())
            && s.write_all(&Enc::frame(PING, 9).finish()).is_ok();
        let mut buf = Vec::new();
        let mut b = [0u8; 4096];
        s.set_read_timeout(Some(PATIENCE)).unwrap();
        let mut answered = false;
        while sent && !answered {
            match std::io::Read::read(&mut s, &mut b) {
                Ok(0) | Err(_) => break,
                Ok(n) => buf.extend_from_slice(&b[..n]),
            }
            answered = buf
                .windows(5)
                .any(|w| w[0] == PONG && w[1..5] == 9u32.to_le_bytes());
        }
        if !answered {
            cut += 1;
        }
    }
    let grown = rss_kb(daemon).saturating_sub(before);
    eprintln!("daemon grew by {} MiB; {cut} connections cut", grown / 1024);
    let _ = kill_and_wait(&mut h, 1);
    assert!(cut > 90, "only {cut} of 100 connections were cut");
    assert!(
        grown < 64 * 1024,
        "100 connections queued {} MiB of stdin for one exec",
        grown / 1024
    );
}

/// Two builds of the helper in one directory (a helper upgraded in place while durable
/// execs of the old one run; each build has its daemon, socket `<digest>.sock` in the
/// same `d/`): a process of an exec of daemon A is refused by daemon B too (any daemon
/// among a peer's ancestors refuses it).
#[test]
fn an_exec_of_one_build_cannot_reach_another_build_s_daemon() {
    let mut a = Helper::start();
    // Build B: the same program, one byte longer (another digest), beside it.
    let exe_b = a.inst.dir.join("helper-b");
    let mut bytes = fs::read(&a.inst.exe).unwrap();
    bytes.push(0);
    fs::write(&exe_b, &bytes).unwrap();
    fs::set_permissions(&exe_b, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    // The engine (the test) starts B's daemon through a relay of B.
    let inst_b = Instance::at(&exe_b);
    let mut b = Helper::start_cmd(inst_b.clone(), inst_b.command());
    assert_ne!(b.hello.pid, a.hello.pid);
    b.spawn(
        1,
        &Spawn {
            grace_ms: 60_000,
            ..sh("sleep 1000")
        },
    )
    .unwrap();
    // A process of an exec of daemon A runs B's relay and asks for B's LIST.
    let list = Enc::frame(LIST, 7).finish();
    let req = a.inst.dir.join("list.bin");
    fs::write(&req, &list).unwrap();
    let script = format!(
        "'{}' <'{}' 2>/dev/null | wc -c",
        exe_b.display(),
        req.display()
    );
    let got: u64 = a.run(2, &sh(&script)).text().trim().parse().unwrap();
    let _ = kill_and_wait(&mut b, 1);
    inst_b.kill_daemons();
    assert_eq!(
        got, 0,
        "a process of an exec of daemon A was served by daemon B ({got} bytes: HELLO and EXECS)"
    );
}

/// Every GET has a thread of its own while it runs: a peer that reads everything and
/// grants no credit beyond the initial 1 MiB leaves one blocked thread per GET, at most
/// `MAX_GETS` per connection (the rest are refused).
#[test]
fn gets_without_credit_hold_at_most_max_gets_threads() {
    let h = Helper::start();
    let daemon = h.hello.pid;
    let file = h.inst.dir.join("big");
    fs::write(&file, vec![7u8; 2 << 20]).unwrap();
    let before = threads(daemon);
    let mut s = raw(&h);
    let mut r = s.try_clone().unwrap();
    // Reads (and drops) everything: the daemon's backlog stays small.
    thread::spawn(move || {
        let mut b = vec![0u8; 1 << 20];
        while std::io::Read::read(&mut r, &mut b).is_ok_and(|n| n > 0) {}
    });
    let n = 600u32;
    for id in 1..=n {
        let mut e = Enc::frame(GET, id);
        e.bytes(file.as_os_str().as_encoded_bytes());
        s.write_all(&e.finish()).unwrap();
    }
    // Until the count stops rising for 2 s.
    let deadline = Instant::now() + Duration::from_secs(60);
    let (mut most, mut since) = (0, Instant::now());
    while Instant::now() < deadline && since.elapsed() < Duration::from_secs(2) {
        let now = threads(daemon);
        if now > most {
            most = now;
            since = Instant::now();
        }
        thread::sleep(Duration::from_millis(100));
    }
    drop(s);
    eprintln!("{before} threads before, {most} with {n} GETs waiting for credit");
    assert!(
        most <= before + MAX_GETS + 4,
        "{n} GETs left {} threads blocked in the daemon",
        most - before
    );
}

/// argv: socket path, depth, seconds. Builds a chain of `depth` processes, then the
/// deepest (8 of them) connect and close in a loop: each connection costs the daemon's
/// single accept thread a walk of `depth` /proc reads before it is refused.
const FLOOD_C: &str = r#"
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
int main(int argc, char **argv) {
    int depth = atoi(argv[2]);
    time_t end = time(0) + atoi(argv[3]);
    for (int d = 0; d < depth; d++) {
        pid_t c = fork();
        if (c < 0) break;
        if (c > 0) { waitpid(c, 0, 0); _exit(0); }
    }
    for (int i = 0; i < 7; i++) if (fork() == 0) break;
    struct sockaddr_un a; memset(&a, 0, sizeof a);
    a.sun_family = AF_UNIX; strncpy(a.sun_path, argv[1], sizeof a.sun_path - 1);
    while (time(0) < end) {
        int s = socket(AF_UNIX, SOCK_STREAM, 0);
        if (s < 0) continue;
        connect(s, (struct sockaddr *)&a, sizeof a);
        close(s);
    }
    while (wait(0) > 0) {}
    return 0;
}
"#;

/// Processes of an exec are refused, but each refusal costs the daemon's one accept
/// thread a /proc walk as long as the peer's ancestry (up to 4096 levels, 3 tries when
/// the chain changes). An exec that floods connects from deep in a process chain keeps
/// the listen queue full of such peers: the host's next relay waits behind them
/// (its greeting bound is 8 s).
#[test]
fn a_deep_chain_s_connect_flood_does_not_delay_the_host_s_relays() {
    let mut h = Helper::start();
    let Some(flood) = cc(&h.inst.dir, "flood", FLOOD_C) else {
        eprintln!("no cc: skipped");
        return;
    };
    let sock = h
        .inst
        .daemon_dir()
        .join(format!("{:016x}.sock", h.hello.digest));
    let script = format!("exec '{}' '{}' 1500 40", flood.display(), sock.display());
    h.spawn(
        1,
        &Spawn {
            grace_ms: 60_000,
            ..sh(&script)
        },
    )
    .unwrap();
    thread::sleep(Duration::from_secs(8));
    let started = Instant::now();
    let h2 = h.connect();
    let took = started.elapsed();
    drop(h2);
    let _ = kill_and_wait(&mut h, 1);
    eprintln!("a relay's HELLO took {took:?} under the flood");
    assert!(
        took < Duration::from_secs(8),
        "the host's relay waited {took:?} for HELLO"
    );
}
