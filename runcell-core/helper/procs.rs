//! Processes as `/proc` shows them: the parent links and sessions that a shepherd walks
//! to find an exec's processes, and start times that tell a reused pid apart.

use std::fs::{self, File};
use std::io::Read;
use std::os::unix::ffi::OsStrExt;

use crate::proto::DAEMON_ARG;

/// A process as `/proc/<pid>/stat` shows it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Proc {
    pub(crate) pid: i32,
    pub(crate) ppid: i32,
    /// Start time, clock ticks since boot (field 22): tells a reused pid apart.
    pub(crate) start: u64,
    pub(crate) zombie: bool,
}

/// Parses the contents of `/proc/<pid>/stat`.
fn parse_stat(pid: i32, b: &[u8]) -> Option<Proc> {
    let close = b.iter().rposition(|&c| c == b')')?;
    let rest = b.get(close + 2..)?;
    let mut it = rest.split(|&c| c == b' ');
    let state = *it.next()?.first()?;
    let num =
        |f: Option<&[u8]>| -> Option<i64> { std::str::from_utf8(f?).ok()?.trim().parse().ok() };
    let ppid = num(it.next())? as i32;
    // pgrp, session, then 15 more fields to the start time.
    let start = num(it.nth(17))? as u64;
    Some(Proc {
        pid,
        ppid,
        start,
        zombie: state == b'Z' || state == b'X',
    })
}

/// Reads one process (`buf` is scratch space).
pub(crate) fn read_stat(pid: i32, buf: &mut Vec<u8>) -> Option<Proc> {
    buf.clear();
    let mut f = File::open(format!("/proc/{pid}/stat")).ok()?;
    f.read_to_end(buf).ok()?;
    parse_stat(pid, buf)
}

/// Whether `pid` or one of its ancestors (by their parent links in `/proc`) is `ancestor`
/// or a helper daemon (of any build: see [`is_daemon`]); `None` when that cannot be
/// told (a process of the chain went while it was walked, or the chain is longer than
/// any real one). A pid of 0 (a peer in another pid namespace, above ours) descends from
/// nothing of ours.
pub(crate) fn below_a_daemon(pid: i32, ancestor: i32) -> Option<bool> {
    const MAX_DEPTH: usize = 4096;
    let mut buf = Vec::with_capacity(512);
    let mut p = pid;
    for _ in 0..MAX_DEPTH {
        if p <= 0 {
            return Some(false);
        }
        if p == ancestor || is_daemon(p, &mut buf) {
            return Some(true);
        }
        if p == 1 {
            return Some(false);
        }
        p = read_stat(p, &mut buf)?.ppid;
    }
    None
}

/// Whether process `pid` is a helper daemon: its command line is the daemon's (an
/// executable, [`DAEMON_ARG`] and the two descriptors it was given). A process of an
/// exec cannot change what its ancestors' command lines are.
fn is_daemon(pid: i32, buf: &mut Vec<u8>) -> bool {
    buf.clear();
    let read = File::open(format!("/proc/{pid}/cmdline")).and_then(|mut f| f.read_to_end(buf));
    if read.is_err() {
        return false;
    }
    let args: Vec<&[u8]> = buf.split(|&b| b == 0).collect();
    let number = |a: &[u8]| !a.is_empty() && a.iter().all(u8::is_ascii_digit);
    // `exe`, the argument, two descriptors, and the empty piece after the last NUL.
    args.len() == 5
        && args[1] == DAEMON_ARG.as_bytes()
        && number(args[2])
        && number(args[3])
        && args[4].is_empty()
}

/// Every process in `/proc`.
pub(crate) fn scan() -> Vec<Proc> {
    let mut v = Vec::new();
    let Ok(dir) = fs::read_dir("/proc") else {
        return v;
    };
    let mut buf = Vec::with_capacity(512);
    for e in dir.flatten() {
        let name = e.file_name();
        let Some(pid) = std::str::from_utf8(name.as_bytes())
            .ok()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        if let Some(p) = read_stat(pid, &mut buf) {
            v.push(p);
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use std::process::Command;
    use std::time::{Duration, Instant};

    use super::*;

    /// A `stat` line with `comm` and the given state, ppid, session and start time.
    fn line(comm: &str, state: char, ppid: i32, sid: i32, start: u64) -> Vec<u8> {
        // pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt
        // cmajflt utime stime cutime cstime priority nice threads itrealvalue starttime ...
        format!(
            "4242 ({comm}) {state} {ppid} 77 {sid} 0 -1 4194560 10 0 0 0 1 2 0 0 20 0 1 0 \
             {start} 1000 100 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 3 0 0 0 0 0\n"
        )
        .into_bytes()
    }

    #[test]
    fn parse_stat_reads_the_fields_after_the_last_parenthesis() {
        for comm in [
            "sh",
            "a b",
            "two  spaces",
            "x) (y",
            ") 1 2 3 4 5",
            "(",
            "((()))",
            "",
        ] {
            let p = parse_stat(4242, &line(comm, 'S', 17, 99, 123_456)).expect(comm);
            assert_eq!(
                (p.pid, p.ppid, p.start, p.zombie),
                (4242, 17, 123_456, false),
                "comm {comm:?}"
            );
        }
    }

    #[test]
    fn parse_stat_tells_zombies_and_dead_processes() {
        for (state, zombie) in [('R', false), ('S', false), ('D', false), ('T', false)] {
            let p = parse_stat(1, &line("c", state, 0, 1, 5)).unwrap();
            assert_eq!(p.zombie, zombie, "state {state}");
        }
        for state in ['Z', 'X'] {
            assert!(parse_stat(1, &line("c", state, 0, 1, 5)).unwrap().zombie);
        }
    }

    #[test]
    fn parse_stat_refuses_what_is_not_a_stat_line() {
        assert!(parse_stat(1, b"").is_none());
        assert!(parse_stat(1, b"1 (no closing parenthesis S 0 1 1").is_none());
        assert!(parse_stat(1, b"1 (short) S 0 1 1 0").is_none());
        assert!(parse_stat(1, b"1 (c)").is_none());
        let mut bad = line("c", 'S', 17, 99, 5);
        let text = String::from_utf8(bad.clone()).unwrap();
        bad = text.replacen(" 17 ", " seventeen ", 1).into_bytes();
        assert!(parse_stat(1, &bad).is_none());
    }

    #[test]
    fn read_stat_and_scan_see_this_process() {
        let me = std::process::id() as i32;
        let mut buf = Vec::new();
        let p = read_stat(me, &mut buf).unwrap();
        assert_eq!(p.pid, me);
        assert_eq!(p.ppid, std::os::unix::process::parent_id() as i32);
        assert!(!p.zombie);
        // The start time never changes.
        assert_eq!(read_stat(me, &mut buf).unwrap().start, p.start);
        let all = scan();
        let found = all
            .iter()
            .find(|q| q.pid == me)
            .expect("this process in /proc");
        assert_eq!((found.ppid, found.start), (p.ppid, p.start));
        assert!(all.iter().any(|q| q.pid == p.ppid));
        assert!(read_stat(i32::MAX, &mut buf).is_none());
    }

    #[test]
    fn an_exited_child_not_yet_reaped_is_a_zombie() {
        let mut child = Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        let mut buf = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let p = read_stat(pid, &mut buf).expect("a zombie stays until reaped");
            assert_eq!(p.ppid, std::process::id() as i32);
            if p.zombie {
                break;
            }
            assert!(Instant::now() < deadline, "the child did not exit");
            std::thread::sleep(Duration::from_millis(10));
        }
        child.wait().unwrap();
        assert!(read_stat(pid, &mut buf).is_none_or(|p| p.ppid != std::process::id() as i32));
    }
}
