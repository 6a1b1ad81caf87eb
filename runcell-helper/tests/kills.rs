//! Integration tests of kills and shepherds: a kill takes an exec's whole tree (escaped
//! descendants included), the end of stdin kills what still runs, and every exec runs
//! under a shepherd of its own.
//!
//! They start the built helper on this host (as a child with piped stdin/stdout, no
//! container) and speak the protocol to it; the harness is `common/mod.rs`. Several tests
//! need root (per-exec users, owners); the crate's tests run as root here.

mod common;

use std::fs;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use common::*;

#[test]
fn kill_takes_the_whole_tree() {
    let mut h = Helper::start();
    let root = h.spawn(1, &sh("sleep 1000 & echo $!; wait")).unwrap();
    let pid: u32 = h.read_lines(1, 1)[0].parse().unwrap();
    let (root_start, start) = (assert_alive(root), assert_alive(pid));
    h.send_empty(KILL, 1);
    let (mut killed, mut exit) = (false, None);
    while !killed || exit.is_none() {
        let f = h.recv();
        assert_eq!(f.id, 1);
        match f.kind {
            KILLED => killed = true,
            EXIT => exit = Some(Dec::new(&f.payload).u8().unwrap()),
            STDOUT | STDERR => {}
            k => panic!("unexpected frame kind {k}"),
        }
    }
    assert_eq!(exit, Some(SIGNALED));
    assert_gone(root, root_start);
    assert_gone(pid, start);
    // KILL of an id that is over: KILLED at once.
    h.send_empty(KILL, 99);
    assert_eq!(h.recv().kind, KILLED);
}

/// A descendant that left the session, cleared its environment and lost its parent is
/// still killed: `wait_before_orphaning` lets the tracker see it with its parent first.
fn kill_escaped_descendant(wait_before_orphaning: bool) {
    let mut h = Helper::start();
    let pause = if wait_before_orphaning {
        "sleep 0.5"
    } else {
        "true"
    };
    let script = format!(
        r#"( setsid sh -c 'echo $$; exec env -i sleep 1000' & {pause} ); echo orphaned; sleep 1000"#
    );
    let root = h.spawn(1, &sh(&script)).unwrap();
    let shepherd = stat_fields(root).unwrap().ppid;
    // Both lines, in either order.
    let lines = h.read_lines(1, 2);
    assert!(lines.iter().any(|l| l == "orphaned"), "{lines:?}");
    let pid: u32 = lines.iter().find_map(|l| l.parse().ok()).unwrap();
    // Wait until it runs `sleep` with an empty environment, re-parented to the helper.
    let deadline = Instant::now() + PATIENCE;
    while fs::read(format!("/proc/{pid}/environ")).is_ok_and(|e| !e.is_empty())
        || fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() != "sleep")
    {
        assert!(Instant::now() < deadline);
        thread::sleep(Duration::from_millis(10));
    }
    let start = assert_alive(pid);
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let ppid: u32 = stat[stat.rfind(')').unwrap() + 2..]
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(ppid, shepherd, "re-parented to the exec's shepherd");
    assert_ne!(shepherd, h.hello.pid);
    h.send_empty(KILL, 1);
    let mut killed = false;
    let mut exited = false;
    while !killed || !exited {
        let f = h.recv();
        killed |= f.kind == KILLED;
        exited |= f.kind == EXIT;
    }
    assert_gone(pid, start);
}

#[test]
fn kill_reaches_a_tracked_escaped_descendant() {
    kill_escaped_descendant(true);
}

#[test]
fn kill_reaches_an_escaped_descendant_orphaned_at_once() {
    kill_escaped_descendant(false);
}

#[test]
fn end_of_stdin_kills_every_tree() {
    let mut h = Helper::start();
    let root = h.spawn(1, &sh("sleep 1000 & echo $!; sleep 1000")).unwrap();
    let pid: u32 = h.read_lines(1, 1)[0].parse().unwrap();
    let root2 = h.spawn(2, &spawn_of(&["sleep", "1000"])).unwrap();
    let starts = [assert_alive(root), assert_alive(pid), assert_alive(root2)];
    let status = h.close();
    assert!(status.success(), "{status:?}");
    assert_gone(root, starts[0]);
    assert_gone(pid, starts[1]);
    assert_gone(root2, starts[2]);
}

#[test]
fn kill_without_credit_ends_the_exec() {
    let mut h = Helper::start();
    let idle = idle_threads(&mut h);
    let root = h.spawn(1, &spawn_of(&["yes"])).unwrap();
    let start = assert_alive(root);
    drain_initial_credit(&mut h, 1);
    // Timed out: KILL, still without granting anything.
    h.send_empty(KILL, 1);
    let (mut killed, mut exit) = (false, None);
    while !killed || exit.is_none() {
        let f = h.recv();
        assert_eq!(f.id, 1, "{f:?}");
        match f.kind {
            KILLED => killed = true,
            EXIT => exit = Some(Dec::new(&f.payload).u8().unwrap()),
            k => panic!("unexpected frame kind {k} (no credit was granted)"),
        }
    }
    assert_eq!(exit, Some(SIGNALED));
    assert_gone(root, start);
    assert_threads_back_to(&h, idle);
}

/// SIGKILLs a process on drop (one the helper left running on purpose).
struct KillOnDrop(u32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-9", &self.0.to_string()])
            .stderr(Stdio::null())
            .status();
    }
}

#[test]
fn end_of_stdin_spares_background_processes_of_ended_execs() {
    let mut h = Helper::start();
    // Ended (EXIT sent), its background process lives on: like after a plain exec.
    let o = h.run(1, &sh("sleep 1234 >/dev/null 2>&1 & echo $!"));
    assert_eq!(o.exit, (EXITED, 0));
    let bg: u32 = o.text().trim().parse().unwrap();
    let _guard = KillOnDrop(bg);
    let bg_start = assert_alive(bg);
    // In flight: its whole tree goes.
    let root = h.spawn(2, &sh("sleep 1000 & echo $!; sleep 1000")).unwrap();
    let pid: u32 = h.read_lines(2, 1)[0].parse().unwrap();
    let starts = [assert_alive(root), assert_alive(pid)];
    thread::sleep(Duration::from_millis(300));
    let status = h.close();
    assert!(status.success(), "{status:?}");
    assert_gone(root, starts[0]);
    assert_gone(pid, starts[1]);
    thread::sleep(Duration::from_millis(200));
    assert_eq!(
        assert_alive(bg),
        bg_start,
        "the background sleep was killed"
    );
}

/// A process's command line, arguments separated by spaces.
fn cmdline(pid: u32) -> String {
    fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

#[test]
fn every_exec_runs_under_a_shepherd_in_a_session_of_its_own() {
    let mut h = Helper::start();
    let helper = stat_fields(h.hello.pid).unwrap();
    let a = h.spawn(1, &spawn_of(&["sleep", "1000"])).unwrap();
    let b = h.spawn(2, &spawn_of(&["sleep", "1000"])).unwrap();
    let (sa, sb) = (stat_fields(a).unwrap(), stat_fields(b).unwrap());
    for (root, st) in [(a, sa), (b, sb)] {
        let shepherd = stat_fields(st.ppid).unwrap();
        assert_ne!(
            st.ppid, h.hello.pid,
            "the command is not the helper's child"
        );
        assert_eq!(
            shepherd.ppid, h.hello.pid,
            "the shepherd is the helper's child"
        );
        assert_eq!(shepherd.sid, st.ppid, "the shepherd leads a session");
        assert_eq!(st.sid, st.ppid, "the command is in its shepherd's session");
        assert_eq!(st.pgrp, root, "the command leads a process group");
        assert_ne!(st.sid, helper.sid);
        let line = cmdline(st.ppid);
        assert!(line.starts_with("runcell-shepherd "), "{line}");
    }
    assert_ne!(sa.sid, sb.sid, "two execs share a session");
    // The command starts with no signal blocked (the shepherd blocks SIGCHLD for itself).
    let o = h.run(3, &sh("grep SigBlk /proc/self/status"));
    assert_eq!(
        o.text().split_whitespace().nth(1),
        Some("0000000000000000"),
        "{}",
        o.text()
    );
    assert_eq!(kill_and_wait(&mut h, 1).0, SIGNALED);
    assert_eq!(kill_and_wait(&mut h, 2).0, SIGNALED);
}

#[test]
fn an_escaped_daemon_is_killed_while_another_exec_runs() {
    let mut h = Helper::start();
    // Another exec runs all along: one subreaper for every exec could not tell whose
    // orphan the daemon is.
    let other = h.spawn(1, &spawn_of(&["sleep", "1000"])).unwrap();
    let other_start = assert_alive(other);
    // Double fork, a new session, an empty environment, its parent gone.
    let root = h
        .spawn(
            2,
            &sh("(setsid sh -c 'echo $$; exec env -i sleep 1001' &); echo forked; exec sleep 1002"),
        )
        .unwrap();
    let shepherd = stat_fields(root).unwrap().ppid;
    let shepherd_start = assert_alive(shepherd);
    let lines = h.read_lines(2, 2);
    let daemon: u32 = lines.iter().find_map(|l| l.parse().ok()).unwrap();
    eventually(
        "the daemon runs, orphaned, with an empty environment",
        || {
            stat_fields(daemon).is_some_and(|s| s.ppid == shepherd && s.sid == daemon)
                && fs::read(format!("/proc/{daemon}/environ")).is_ok_and(|e| e.is_empty())
                && cmdline(daemon).starts_with("sleep 1001")
        },
    );
    let start = assert_alive(daemon);
    assert_eq!(kill_and_wait(&mut h, 2).0, SIGNALED);
    assert_gone(daemon, start);
    assert_gone(shepherd, shepherd_start);
    assert_eq!(
        assert_alive(other),
        other_start,
        "the other exec was killed"
    );
    assert_eq!(kill_and_wait(&mut h, 1).0, SIGNALED);
}

#[test]
fn a_shepherd_stays_while_background_processes_live_then_exits() {
    let mut h = Helper::start();
    let o = h.run(1, &sh("sleep 1 >/dev/null 2>&1 & echo $!"));
    assert_eq!(o.exit, (EXITED, 0));
    let bg: u32 = o.text().trim().parse().unwrap();
    // Its parent exited: the background process is its shepherd's now.
    let shepherd = stat_fields(bg).unwrap().ppid;
    assert!(cmdline(shepherd).starts_with("runcell-shepherd "));
    assert_eq!(stat_fields(shepherd).unwrap().ppid, h.hello.pid);
    let start = assert_alive(shepherd);
    // Gone once the last process of its exec is, and the helper forgot the exec.
    assert_gone(shepherd, start);
    eventually("the shepherd was reaped", || proc_stat(shepherd).is_none());
    h.send_empty(KILL, 1);
    let f = h.recv();
    assert_eq!((f.kind, f.id), (KILLED, 1));
}

#[test]
fn a_killed_shepherd_ends_its_exec_as_signaled_and_takes_its_session() {
    let mut h = Helper::start();
    let root = h.spawn(1, &sh("sleep 1000 & echo $!; wait")).unwrap();
    let bg: u32 = h.read_lines(1, 1)[0].parse().unwrap();
    let shepherd = stat_fields(root).unwrap().ppid;
    let starts = (assert_alive(root), assert_alive(bg));
    let killed = Command::new("kill")
        .args(["-9", &shepherd.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let o = h.wait_exit(1);
    assert_eq!(o.exit, (SIGNALED, 9));
    assert_gone(root, starts.0);
    assert_gone(bg, starts.1);
    assert_eq!(h.run(2, &sh("echo ok")).text(), "ok\n");
}

/// A command that kills its shepherd at once (a root exec may: same uid as the helper),
/// after starting one process in the shepherd's session and one that made a session of
/// its own: whether the shepherd died before it answered (a spawn error) or after (the
/// exec ends killed by SIGKILL), both processes are gone, and the helper serves on.
/// Before, a shepherd killed before it answered left everything its command started,
/// and one killed later left what had made a session of its own.
#[test]
fn an_exec_that_kills_its_shepherd_leaves_nothing_whenever_it_does() {
    let mut h = Helper::start();
    let (mut before, mut after) = (0, 0);
    for round in 0..16 {
        let id = 1 + round;
        let script = "setsid sleep 98772 & sleep 98773 & kill -9 $PPID; wait";
        match h.spawn(id, &sh(script)) {
            Ok(_) => {
                after += 1;
                let out = h.wait_exit(id);
                assert_eq!(out.exit, (SIGNALED, 9), "round {round}: {out:?}");
            }
            Err((kind, msg)) => {
                before += 1;
                assert_eq!(kind, SpawnError::Other, "round {round}: {msg}");
            }
        }
        // Gone by the answer: the error or the exec's end.
        for pid in [&b"sleep\x0098772\x00"[..], b"sleep\x0098773\x00"] {
            let live = live_pids_of(pid);
            assert!(live.is_empty(), "round {round}: {live:?} live");
        }
        assert_eq!(h.run(100 + round, &sh("echo ok")).text(), "ok\n");
    }
    eprintln!("shepherd killed before its answer {before} times, after it {after} times");
}

/// A background process of an exec that ended kills the shepherd (still there for it):
/// no status is awaited any more, yet the helper reaps a killed shepherd and sweeps
/// what it left. Before, it lived on as the helper's stray until another exec lost
/// its shepherd.
#[test]
fn a_shepherd_killed_after_its_command_ended_leaves_no_stray() {
    let mut h = Helper::start();
    let script = "S=$PPID; (sleep 0.5; kill -9 $S; exec sleep 98781) >/dev/null 2>&1 & exit 0";
    assert_eq!(h.run(1, &sh(script)).exit, (EXITED, 0));
    thread::sleep(Duration::from_secs(1));
    eventually("the background process is gone", || {
        live_pids_of(b"sleep\x0098781\x00").is_empty()
    });
    assert_eq!(h.run(2, &sh("echo ok")).text(), "ok\n");
}

/// Forks, and the parent exits, over and over for `argv[2]` seconds (each walk of the
/// helper's sweep finds a pid that is gone by the time it is signalled), then writes its
/// pid to `argv[1]` and becomes `sleep 98782`. Its first parent kills the shepherd.
const HOP_C: &str = r#"
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }
int main(int argc, char **argv) {
    pid_t shepherd = getppid();
    double hop = atof(argv[2]);
    if (fork() == 0) {
        double t0 = now();
        while (now() - t0 < hop) {
            pid_t c = fork();
            if (c > 0) _exit(0);
        }
        FILE *f = fopen(argv[1], "w"); fprintf(f, "%d\n", getpid()); fclose(f);
        execlp("sleep", "sleep", "98782", (char *)0);
        _exit(1);
    }
    usleep(100000);
    kill(shepherd, SIGKILL);
    pause();
    return 0;
}
"#;

/// A stray that changes its pid faster than a sweep walks is chased by a sweep on every
/// reap of its former selves, and dies once it stops (before, it outlived the one
/// bounded sweep in 3 of 5 rounds).
#[test]
fn a_stray_that_keeps_changing_its_pid_dies_when_it_stops() {
    let dir = TempDir::new();
    let Some(exe) = cc(dir.path(), "hop", HOP_C) else {
        eprintln!("no cc: skipped");
        return;
    };
    let mut h = Helper::start();
    for round in 0..3 {
        let out = dir.path().join(format!("out{round}"));
        let sp = spawn_of(&[exe.to_str().unwrap(), out.to_str().unwrap(), "3"]);
        if h.spawn(10 + round, &sp).is_ok() {
            assert_eq!(h.wait_exit(10 + round).exit, (SIGNALED, 9), "round {round}");
        }
        thread::sleep(Duration::from_secs(3));
        eventually("the hopper is gone", || {
            live_pids_of(b"sleep\x0098782\x00").is_empty()
        });
    }
    assert_eq!(h.run(1, &sh("echo ok")).text(), "ok\n");
}

/// A relay whose daemon did not listen in time serves its connection itself, with that
/// daemon as its child: a lost shepherd there sweeps its strays, never the daemon (nor
/// the execs other connections run through it).
#[test]
fn a_relay_serving_itself_never_sweeps_the_daemon_it_started() {
    let inst = Instance::new();
    let watcher = inst.clone();
    // The new daemon is stopped until the relay gives up on it (3 s), then let go.
    let stopper = thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(&d) = watcher.daemons().first() {
                let _ = Command::new("kill")
                    .args(["-STOP", &d.to_string()])
                    .status();
                return Some(d);
            }
        }
        None
    });
    let mut relay = Helper::start_cmd(inst.clone(), inst.command());
    let daemon = stopper.join().unwrap().expect("the relay started a daemon");
    assert!(!relay.hello.durable, "the relay did not serve itself");
    let _ = Command::new("kill")
        .args(["-CONT", &daemon.to_string()])
        .status();
    let daemon_start = assert_alive(daemon);
    let mut other = Helper::start_cmd(inst.clone(), inst.command());
    assert!(other.hello.durable);
    let victim = other.spawn(1, &sh("exec sleep 98783")).unwrap();
    let victim_start = assert_alive(victim);
    // An exec of the self-serving relay kills its shepherd: a sweep.
    if relay.spawn(1, &sh("kill -9 $PPID; sleep 1")).is_ok() {
        relay.wait_exit(1);
    }
    assert_eq!(assert_alive(daemon), daemon_start, "the daemon was swept");
    assert_eq!(
        assert_alive(victim),
        victim_start,
        "another connection's exec was swept"
    );
    other.send_empty(KILL, 1);
    let _ = other.wait_exit(1);
    inst.kill_daemons();
}
