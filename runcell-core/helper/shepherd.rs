//! The shepherd: one tiny process per exec, the only thing that tracks and kills that
//! exec's processes.
//!
//! The helper starts it for every `SPAWN` by running its own executable again
//! (`/proc/self/exe`, argv `runcell-shepherd --runcell-shepherd <fd>`): a fresh,
//! single-threaded process, so nothing of the multithreaded helper is inherited and no
//! code runs between a fork and an exec there. Its stdin, stdout and stderr are the exec's
//! (a pipe or `/dev/null`, and the two output pipes); `<fd>` is its end of a unix socket
//! pair, the control channel to the helper.
//!
//! The shepherd makes itself non-dumpable and a child subreaper, and starts a session of
//! its own. It then reads one [`PLAN`] (program, argv, environment, working directory,
//! user: resolved by the helper), starts the command as its child in its own process
//! group (so in the shepherd's session) with the user switch, answers [`STARTED`] (the
//! command's pid) or [`FAILED`] (a typed spawn error), and lets go of the exec's pipes.
//! From then on it reaps every child: the command's real wait status goes to the helper
//! as [`STATUS`]; orphans of the exec (a daemon that double-forked, left the session,
//! cleared its environment) are re-parented to the shepherd, since it is their nearest
//! subreaper, and reaped by it. It stays while any of them lives (background processes
//! outlive their exec's root) and exits once it has no child left.
//!
//! So the exec's processes are exactly the shepherd's descendants, which none of them
//! can leave: a kill ([`KILL_TREE`], or the end of the control channel before the
//! command's status was sent, i.e. the helper died) walks `/proc` parent links from the
//! shepherd's pid, SIGSTOPs every process found, walks again until nothing new appears,
//! then (a graceful kill) sends SIGTERM and SIGCONT and waits [`KILL_GRACE_MS`], and
//! finally stops and SIGKILLs whatever is left until nothing is. A process is signalled
//! through a pidfd opened and then checked against the start time the walk saw, so a pid
//! reused meanwhile by another exec's process is never signalled. Process groups,
//! sessions and environment markers play no part: a process of another exec is never
//! this shepherd's descendant, whatever it does (its own session already keeps it out of
//! this exec's process groups), and a process of this exec cannot stop being one.
//!
//! A kill needs no new process or thread (the shepherd exists from the exec's start), so
//! it works under a pids limit exhausted by a fork bomb.

use std::collections::HashMap;
use std::ffi::{CString, OsStr, OsString};
use std::fs::File;
use std::io::{self, ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use crate::procs::{Proc, read_stat, scan};
use crate::proto::{Dec, Enc, KILL_GRACE_MS, SpawnError};
use crate::sys::{ECHILD, ENOSYS};
use crate::users::Creds;
use crate::{diag, spawn_error_kind, sys};

/// `argv[1]` that starts the helper's executable as a shepherd (`argv[2]`: the fd).
pub const MODE_ARG: &str = "--runcell-shepherd";
/// `argv[0]` of a shepherd (what `ps` shows).
pub const NAME: &str = "runcell-shepherd";

// Control frames (the helper protocol's framing, id 0), helper → shepherd.
/// What to start: [`plan_frame`].
pub const PLAN: u8 = 1;
/// Kill every descendant; u8: 0 graceful (TERM, grace, KILL), 1 at once (KILL).
pub const KILL_TREE: u8 = 2;
// Shepherd → helper.
/// u32: the command's pid.
pub const STARTED: u8 = 65;
/// `SpawnError` u8 + message: the command did not start (the shepherd exits).
pub const FAILED: u8 = 66;
/// i32: the command's raw wait status.
pub const STATUS: u8 = 69;

/// Largest control frame accepted (a `PLAN` of the largest `SPAWN` plus the run's env).
const MAX_CONTROL: usize = 64 << 20;
/// Rounds of stop-and-walk before a set is taken as complete (a process forks at most
/// once per round before it is stopped).
const FREEZE_ROUNDS: usize = 64;
/// How long the final SIGKILL phase keeps trying.
const KILL_PHASE: Duration = Duration::from_millis(1500);

/// The `PLAN` frame for a command.
pub fn plan_frame(
    program: &Path,
    argv: &[Vec<u8>],
    env: &[(OsString, OsString)],
    cwd: Option<&Path>,
    user: Option<&Creds>,
    stdin_piped: bool,
    tty: Option<&Path>,
) -> Vec<u8> {
    let mut e = Enc::frame(PLAN, 0);
    e.bytes(program.as_os_str().as_bytes()).list(argv);
    e.u32(env.len() as u32);
    for (k, v) in env {
        e.bytes(k.as_bytes()).bytes(v.as_bytes());
    }
    e.opt(cwd.map(|d| d.as_os_str().as_bytes()));
    match user {
        Some(c) => {
            e.u8(1).u32(c.uid).u32(c.gid).u32(c.groups.len() as u32);
            for g in &c.groups {
                e.u32(*g);
            }
        }
        None => {
            e.u8(0);
        }
    }
    e.u8(u8::from(stdin_piped));
    e.opt(tty.map(|t| t.as_os_str().as_bytes()));
    e.finish()
}

/// A `KILL_TREE` frame.
pub fn kill_frame(immediate: bool) -> Vec<u8> {
    let mut e = Enc::frame(KILL_TREE, 0);
    e.u8(u8::from(immediate));
    e.finish()
}

/// Reads one whole control frame (blocking; the stream's timeouts apply): kind and
/// payload. `Ok(None)` at a clean end of the stream.
pub fn read_frame(s: &mut UnixStream) -> io::Result<Option<(u8, Vec<u8>)>> {
    let mut len = [0u8; 4];
    match s.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_le_bytes(len) as usize;
    if !(5..=MAX_CONTROL).contains(&len) {
        return Err(io::Error::new(ErrorKind::InvalidData, "bad control frame"));
    }
    let mut rest = vec![0u8; len];
    s.read_exact(&mut rest)?;
    let kind = rest[0];
    rest.drain(..5);
    Ok(Some((kind, rest)))
}

/// Splits whole frames off `buf` (what the helper's output thread read so far).
pub fn split_frames(buf: &mut Vec<u8>) -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    let mut at = 0;
    while buf.len() - at >= 4 {
        let len = u32::from_le_bytes(buf[at..at + 4].try_into().unwrap_or([0; 4])) as usize;
        if len < 5 || buf.len() - at < 4 + len {
            break;
        }
        out.push((buf[at + 4], buf[at + 9..at + 4 + len].to_vec()));
        at += 4 + len;
    }
    buf.drain(..at);
    out
}

/// Signals one process found by a walk, unless its pid now names another process:
/// through a pidfd opened first and then checked against the start time the walk saw
/// (`kill` after the same check where the kernel has no pidfds). True if sent.
pub fn signal_checked(pid: i32, start: u64, sig: i32) -> bool {
    if pid <= 1 {
        return false;
    }
    let mut buf = Vec::with_capacity(512);
    let same = |buf: &mut Vec<u8>| read_stat(pid, buf).is_some_and(|p| p.start == start);
    match sys::pidfd_open(pid) {
        Ok(fd) => same(&mut buf) && sys::pidfd_signal(&fd, sig),
        Err(e) if e.raw_os_error() == Some(ENOSYS) => same(&mut buf) && sys::signal(pid, sig),
        Err(_) => false,
    }
}

/// SIGSTOPs every process `walk` finds, walking again until a walk finds nothing new
/// (a process forks at most once a round before it is stopped); adds them to `set`.
pub(crate) fn freeze(walk: &mut dyn FnMut() -> HashMap<i32, u64>, set: &mut HashMap<i32, u64>) {
    for _ in 0..FREEZE_ROUNDS {
        let mut new = false;
        for (pid, start) in walk() {
            if set.insert(pid, start).is_none() {
                new = true;
                signal_checked(pid, start, sys::SIGSTOP);
            }
        }
        if !new {
            return;
        }
    }
}

/// Freezes and SIGKILLs what `walk` finds until a walk finds nothing, for at most the
/// kill phase; the number left (0: all gone).
pub(crate) fn kill_all(walk: &mut dyn FnMut() -> HashMap<i32, u64>) -> usize {
    let until = Instant::now() + KILL_PHASE;
    loop {
        let mut set = HashMap::new();
        freeze(walk, &mut set);
        if set.is_empty() {
            return 0;
        }
        for (&pid, &start) in &set {
            signal_checked(pid, start, sys::SIGKILL);
        }
        if Instant::now() >= until {
            return set.len();
        }
        thread::sleep(Duration::from_millis(5));
    }
}

/// A helper's strays in `procs`: its descendants that nothing `kept` (its live
/// shepherds, by pid and start time) leads to: its other children, and all below them.
/// Only the orphans of a shepherd killed from inside the run are such: re-parented to
/// the helper, their subreaper, whatever session or group they made.
pub fn strays(procs: &[Proc], helper: i32, kept: &dyn Fn(i32, u64) -> bool) -> HashMap<i32, u64> {
    let mut children: HashMap<i32, Vec<&Proc>> = HashMap::new();
    for p in procs {
        children.entry(p.ppid).or_default().push(p);
    }
    let mut found = HashMap::new();
    let mut stack: Vec<&Proc> = children
        .get(&helper)
        .map_or(&[][..], Vec::as_slice)
        .iter()
        .copied()
        .filter(|p| p.pid > 1 && p.pid != helper && !kept(p.pid, p.start))
        .collect();
    while let Some(p) = stack.pop() {
        if p.zombie {
            continue;
        }
        if found.insert(p.pid, p.start).is_some() {
            continue;
        }
        for c in children.get(&p.pid).map_or(&[][..], Vec::as_slice) {
            if c.pid > 1 && c.pid != helper {
                stack.push(c);
            }
        }
    }
    found
}

/// The live (non-zombie) descendants of `root` in `procs`: pid → start time.
pub fn descendants(procs: &[Proc], root: i32) -> HashMap<i32, u64> {
    let mut children: HashMap<i32, Vec<&Proc>> = HashMap::new();
    for p in procs {
        children.entry(p.ppid).or_default().push(p);
    }
    let mut found = HashMap::new();
    let mut stack = vec![root];
    while let Some(pid) = stack.pop() {
        for c in children.get(&pid).map_or(&[][..], Vec::as_slice) {
            if c.pid == root || c.pid <= 1 {
                continue;
            }
            stack.push(c.pid);
            if !c.zombie {
                found.insert(c.pid, c.start);
            }
        }
    }
    found
}

/// What the helper asked for.
struct Order {
    program: PathBuf,
    argv: Vec<Vec<u8>>,
    env: Vec<(OsString, OsString)>,
    cwd: Option<PathBuf>,
    user: Option<(u32, u32, Vec<u32>)>,
    /// The command reads the shepherd's stdin (the exec's pipe), else `/dev/null`.
    stdin_piped: bool,
    /// The terminal the command gets as stdin, stdout, stderr and controlling terminal
    /// of the session it leads, instead of the pipes.
    tty: Option<PathBuf>,
}

impl Order {
    fn decode(payload: &[u8]) -> Option<Order> {
        let mut d = Dec::new(payload);
        let program = PathBuf::from(OsStr::from_bytes(d.bytes().ok()?));
        let argv = d.list().ok()?;
        let n = d.u32().ok()? as usize;
        let mut env = Vec::with_capacity(n.min(4096));
        for _ in 0..n {
            let k = OsString::from_vec(d.bytes().ok()?.to_vec());
            let v = OsString::from_vec(d.bytes().ok()?.to_vec());
            env.push((k, v));
        }
        let cwd = d.opt().ok()?.map(|c| PathBuf::from(OsString::from_vec(c)));
        let user = match d.u8().ok()? {
            0 => None,
            _ => {
                let (uid, gid) = (d.u32().ok()?, d.u32().ok()?);
                let n = d.u32().ok()? as usize;
                let groups = (0..n.min(65536))
                    .map(|_| d.u32())
                    .collect::<Result<Vec<u32>, _>>()
                    .ok()?;
                Some((uid, gid, groups))
            }
        };
        let stdin_piped = d.u8().ok()? != 0;
        let tty = d.opt().ok()?.map(|t| PathBuf::from(OsString::from_vec(t)));
        (!argv.is_empty()).then_some(Order {
            program,
            argv,
            env,
            cwd,
            user,
            stdin_piped,
            tty,
        })
    }
}

/// The shepherd's entry point (`fd`: `argv[2]`). Never returns.
pub fn main(fd: Option<OsString>) -> ! {
    let fd: Option<RawFd> = fd.and_then(|f| f.to_str().and_then(|s| s.parse().ok()));
    let Some(ctl) = fd.and_then(sys::inherited_fd) else {
        diag(format_args!("shepherd: no control descriptor"));
        std::process::exit(2);
    };
    match start(ctl) {
        Ok(Some(mut s)) => s.run(),
        Ok(None) => std::process::exit(0),
        Err(e) => {
            diag(format_args!("shepherd: {e}"));
            std::process::exit(1);
        }
    }
}

/// Sets the shepherd up, reads the plan, starts the command. `None`: it did not start
/// (the helper was told why).
fn start(ctl: OwnedFd) -> io::Result<Option<Shepherd>> {
    sys::set_cloexec(ctl.as_raw_fd(), true)?;
    let mut ctl = UnixStream::from(ctl);
    let _ = sys::set_not_dumpable();
    sys::set_child_subreaper()?;
    sys::new_session()?;
    // Before any child exists: no exit can be missed.
    let sigchld = sys::sigchld_fd()?;
    let Some((PLAN, payload)) = read_frame(&mut ctl)? else {
        return Ok(None);
    };
    let Some(mut order) = Order::decode(&payload) else {
        return Err(io::Error::new(ErrorKind::InvalidData, "bad plan"));
    };
    drop(payload);
    let mut cmd = Command::new(&order.program);
    cmd.arg0(OsStr::from_bytes(&order.argv[0]))
        .args(order.argv[1..].iter().map(|a| OsStr::from_bytes(a)))
        .env_clear()
        .envs(order.env.iter().map(|(k, v)| (k, v)));
    match &order.tty {
        // A session of its own on the terminal (a session leader cannot also be made a
        // group leader first): still this shepherd's descendant, so its kill is the same.
        Some(path) => {
            let tty = sys::open_tty(path).and_then(|t| Ok((t.try_clone()?, t.try_clone()?, t)));
            let (i, o, e) = match tty {
                Ok(t) => t,
                Err(e) => {
                    let mut f = Enc::frame(FAILED, 0);
                    let msg = format!("cannot open the terminal {}: {e}", path.display());
                    f.u8(SpawnError::Other as u8).bytes(msg.as_bytes());
                    let _ = ctl.write_all(&f.finish());
                    return Ok(None);
                }
            };
            cmd.stdin(i).stdout(o).stderr(e);
            sys::lead_session_on_tty(&mut cmd);
        }
        None => {
            cmd.process_group(0);
            if !order.stdin_piped {
                cmd.stdin(std::process::Stdio::null());
            }
        }
    }
    let switching = order.user.is_some();
    match order.user.take() {
        // The directory is entered as the user, after the switch.
        Some((uid, gid, groups)) => {
            let cwd = match order
                .cwd
                .as_ref()
                .map(|d| CString::new(d.as_os_str().as_bytes()))
            {
                Some(Err(_)) => return Err(io::Error::new(ErrorKind::InvalidData, "bad plan")),
                Some(Ok(c)) => Some(c),
                None => None,
            };
            sys::switch_user(&mut cmd, uid, gid, groups, cwd);
        }
        None => {
            if let Some(d) = &order.cwd {
                cmd.current_dir(d);
            }
        }
    }
    let root = match cmd.spawn() {
        Ok(child) => child.id() as i32, // Never waited on by std: reaped below.
        Err(e) => {
            let mut f = Enc::frame(FAILED, 0);
            let msg = format!("{}: {e}", String::from_utf8_lossy(&order.argv[0]));
            f.u8(spawn_error_kind(&e, switching) as u8)
                .bytes(msg.as_bytes());
            let _ = ctl.write_all(&f.finish());
            return Ok(None);
        }
    };
    drop(cmd);
    drop(order);
    let mut f = Enc::frame(STARTED, 0);
    f.u32(root as u32);
    let told = ctl.write_all(&f.finish()).is_ok();
    // The exec's pipes are the command's alone from now on: their EOF is its business.
    let _ = sys::stdio_to_null();
    let _ = sys::set_nonblocking(ctl.as_raw_fd());
    let mut shepherd = Shepherd {
        pid: std::process::id() as i32,
        ctl,
        ctl_open: told,
        sigchld: File::from(sigchld),
        root,
        reported: false,
        inbox: Vec::with_capacity(64),
    };
    if !told {
        // The helper gave up on this spawn (it answered the host that the command did
        // not start): nothing may run that nobody can kill.
        shepherd.kill_tree(true);
    }
    Ok(Some(shepherd))
}

/// A running shepherd.
struct Shepherd {
    pid: i32,
    ctl: UnixStream,
    /// The helper's end is still open.
    ctl_open: bool,
    /// Readable when a child changed state (SIGCHLD, blocked).
    sigchld: File,
    /// The command.
    root: i32,
    /// `STATUS` was sent (or could not be: the helper is gone).
    reported: bool,
    /// Control bytes read, not yet a whole frame.
    inbox: Vec<u8>,
}

impl Shepherd {
    /// Reaps, obeys, and exits once no descendant is left.
    fn run(&mut self) -> ! {
        loop {
            if !self.reap_all() {
                std::process::exit(0);
            }
            let mut fds = [
                sys::PollFd {
                    fd: self.sigchld.as_raw_fd(),
                    events: sys::POLLIN,
                    revents: 0,
                },
                sys::PollFd {
                    fd: self.ctl.as_raw_fd(),
                    events: sys::POLLIN,
                    revents: 0,
                },
            ];
            let n = if self.ctl_open { 2 } else { 1 };
            // The timeout only guards against a lost wake-up.
            if sys::poll_fds(&mut fds[..n], 5000).is_err() {
                thread::sleep(Duration::from_millis(10));
            }
            if fds[0].revents != 0 {
                let mut b = [0u8; 128 * 4];
                let _ = self.sigchld.read(&mut b);
            }
            if n == 2 && fds[1].revents != 0 {
                self.read_control();
            }
        }
    }

    /// Reaps every exited child, sending the command's status. False once the shepherd
    /// has no child at all (and the command's status went out).
    fn reap_all(&mut self) -> bool {
        loop {
            match sys::reap_any() {
                Ok(Some((pid, status))) => {
                    if pid == self.root && !self.reported {
                        self.reported = true;
                        let mut f = Enc::frame(STATUS, 0);
                        f.u32(status as u32);
                        self.send(&f.finish());
                    }
                }
                Ok(None) => return true,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.raw_os_error() == Some(ECHILD) => return !self.reported,
                Err(_) => return true,
            }
        }
    }

    /// Writes a small frame to the helper (the socket is non-blocking: a helper that
    /// reads nothing any more loses it).
    fn send(&mut self, frame: &[u8]) {
        if self.ctl_open && (&self.ctl).write_all(frame).is_err() {
            // Gone, or not reading: either way nobody waits for it.
        }
    }

    /// Reads what the helper sent; its end of the channel closing before the command's
    /// status went out means the helper died: the exec's processes are killed at once.
    fn read_control(&mut self) {
        let mut buf = [0u8; 256];
        loop {
            match (&self.ctl).read(&mut buf) {
                Ok(0) => {
                    self.ctl_open = false;
                    if !self.reported {
                        self.kill_tree(true);
                    }
                    return;
                }
                Ok(n) => self.inbox.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(_) => {
                    // A reset is a close with data unread: the same as EOF.
                    self.ctl_open = false;
                    if !self.reported {
                        self.kill_tree(true);
                    }
                    return;
                }
            }
        }
        for (kind, payload) in split_frames(&mut self.inbox) {
            if kind == KILL_TREE {
                self.kill_tree(payload.first().is_some_and(|&m| m != 0));
            }
        }
    }

    /// The live descendants, now.
    fn tree(&self) -> HashMap<i32, u64> {
        descendants(&scan(), self.pid)
    }

    /// SIGSTOPs every descendant, walking again until a walk finds nothing new; adds
    /// them to `set`.
    fn freeze(&self, set: &mut HashMap<i32, u64>) {
        freeze(&mut || self.tree(), set);
    }

    /// Kills every descendant: stopped first (nothing forks meanwhile), then, unless
    /// `immediate`, TERM + CONT and up to [`KILL_GRACE_MS`] to exit; then KILL until none
    /// is left (bounded: a process the shepherd may not signal stays).
    fn kill_tree(&mut self, immediate: bool) {
        let mut set = HashMap::new();
        self.freeze(&mut set);
        if !immediate && !set.is_empty() {
            for (&pid, &start) in &set {
                signal_checked(pid, start, sys::SIGTERM);
            }
            for (&pid, &start) in &set {
                signal_checked(pid, start, sys::SIGCONT);
            }
            let grace = Instant::now() + Duration::from_millis(KILL_GRACE_MS);
            while Instant::now() < grace {
                self.reap_all();
                if self.tree().is_empty() {
                    return;
                }
                thread::sleep(Duration::from_millis(20));
            }
        }
        let left = kill_all(&mut || {
            self.reap_all();
            self.tree()
        });
        self.reap_all();
        if left > 0 {
            diag(format_args!("shepherd: {left} processes survived the kill"));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;

    use super::*;

    fn proc(pid: i32, ppid: i32, zombie: bool) -> Proc {
        Proc {
            pid,
            ppid,
            start: pid as u64 * 10,
            zombie,
        }
    }

    #[test]
    fn a_plan_decodes_to_what_was_encoded() {
        let argv = vec![
            b"prog".to_vec(),
            b"-x".to_vec(),
            Vec::new(),
            b"a b".to_vec(),
        ];
        let env: Vec<(OsString, OsString)> =
            vec![("A".into(), "1".into()), ("EMPTY".into(), "".into())];
        let user = Creds {
            uid: 1000,
            gid: 100,
            groups: vec![100, 27, 4],
            home: b"/home/u".to_vec(),
        };
        let frame = plan_frame(
            Path::new("/usr/bin/prog"),
            &argv,
            &env,
            Some(Path::new("/work dir")),
            Some(&user),
            true,
            Some(Path::new("/dev/pts/3")),
        );
        let mut buf = frame.clone();
        let frames = split_frames(&mut buf);
        assert!(buf.is_empty());
        let [(kind, payload)] = &frames[..] else {
            panic!("{frames:?}");
        };
        assert_eq!(*kind, PLAN);
        let o = Order::decode(payload).unwrap();
        assert_eq!(o.program, Path::new("/usr/bin/prog"));
        assert_eq!(o.argv, argv);
        assert_eq!(o.env, env);
        assert_eq!(o.cwd.as_deref(), Some(Path::new("/work dir")));
        assert_eq!(o.user, Some((1000, 100, vec![100, 27, 4])));
        assert!(o.stdin_piped);
        assert_eq!(o.tty.as_deref(), Some(Path::new("/dev/pts/3")));

        // No directory, no user.
        let frame = plan_frame(
            Path::new("/bin/true"),
            &argv[..1],
            &[],
            None,
            None,
            false,
            None,
        );
        let o = Order::decode(&frame[9..]).unwrap();
        assert_eq!(
            (o.cwd, o.user, o.env.len(), o.stdin_piped, o.tty),
            (None, None, 0, false, None)
        );
    }

    #[test]
    fn a_plan_without_argv_or_cut_short_is_refused() {
        let frame = plan_frame(Path::new("/bin/true"), &[], &[], None, None, true, None);
        assert!(Order::decode(&frame[9..]).is_none());
        let frame = plan_frame(
            Path::new("/bin/true"),
            &[b"true".to_vec()],
            &[],
            None,
            None,
            true,
            None,
        );
        for cut in 0..frame.len() - 9 {
            assert!(Order::decode(&frame[9..9 + cut]).is_none(), "cut at {cut}");
        }
    }

    #[test]
    fn split_frames_keeps_a_partial_frame_for_later() {
        let mut buf = kill_frame(true);
        buf.extend_from_slice(&kill_frame(false));
        let mut status = Enc::frame(STATUS, 0);
        status.u32(0x0100);
        let status = status.finish();
        buf.extend_from_slice(&status[..6]);
        let got = split_frames(&mut buf);
        assert_eq!(got, [(KILL_TREE, vec![1]), (KILL_TREE, vec![0])]);
        assert_eq!(buf, &status[..6]);
        buf.extend_from_slice(&status[6..]);
        assert_eq!(split_frames(&mut buf), [(STATUS, vec![0, 1, 0, 0])]);
        assert!(buf.is_empty());
        // A length under the header stops the split (never a panic or a loop).
        let mut bad = vec![1, 0, 0, 0, 9];
        assert!(split_frames(&mut bad).is_empty());
        assert_eq!(bad.len(), 5);
    }

    #[test]
    fn read_frame_reads_whole_frames_and_refuses_bad_lengths() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let mut started = Enc::frame(STARTED, 0);
        started.u32(4242);
        b.write_all(&started.finish()).unwrap();
        b.write_all(&kill_frame(false)).unwrap();
        assert_eq!(
            read_frame(&mut a).unwrap(),
            Some((STARTED, 4242u32.to_le_bytes().to_vec()))
        );
        assert_eq!(read_frame(&mut a).unwrap(), Some((KILL_TREE, vec![0])));
        b.write_all(&[4, 0, 0, 0, 1, 0, 0, 0]).unwrap();
        let e = read_frame(&mut a).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidData);
        let (mut a, b) = UnixStream::pair().unwrap();
        drop(b);
        assert_eq!(read_frame(&mut a).unwrap(), None);
        // Cut inside a frame: an error, not a clean end.
        let (mut a, mut b) = UnixStream::pair().unwrap();
        b.write_all(&kill_frame(true)[..7]).unwrap();
        drop(b);
        assert!(read_frame(&mut a).is_err());
    }

    #[test]
    fn strays_are_what_no_kept_child_of_the_helper_leads_to() {
        // helper 10 ─┬─ 11 (shepherd) ─── 12
        //            ├─ 13 (stray) ─── 14 ─── 15
        //            ├─ 16 (zombie)
        //            └─ 17 (the daemon a relay started) ─── 18
        // 1 ─── 10; 20 (another tree) ─── 21
        let procs = [
            proc(1, 0, false),
            proc(10, 1, false),
            proc(11, 10, false),
            proc(12, 11, false),
            proc(13, 10, false),
            proc(14, 13, false),
            proc(15, 14, false),
            proc(16, 10, true),
            proc(17, 10, false),
            proc(18, 17, false),
            proc(20, 1, false),
            proc(21, 20, false),
        ];
        let kept = |pid: i32, start: u64| pid == 11 || (pid, start) == (17, 170);
        let mut found: Vec<i32> = strays(&procs, 10, &kept).into_keys().collect();
        found.sort_unstable();
        assert_eq!(found, [13, 14, 15]);
        // The daemon only by its start time too: a pid reused is a stray.
        let mut found: Vec<i32> = strays(&procs, 10, &|pid, start| {
            pid == 11 || (pid, start) == (17, 1)
        })
        .into_keys()
        .collect();
        found.sort_unstable();
        assert_eq!(found, [13, 14, 15, 17, 18]);
        assert!(strays(&procs, 99, &kept).is_empty());
    }

    #[test]
    fn descendants_are_found_through_parent_links() {
        // 10 ─┬─ 11 ─── 12 ─── 13
        //     └─ 14 (zombie) ─── 15
        // 20 ─── 21 (another tree); 1 ─── 10 (init above the root)
        let procs = [
            proc(1, 0, false),
            proc(10, 1, false),
            proc(11, 10, false),
            proc(12, 11, false),
            proc(13, 12, false),
            proc(14, 10, true),
            proc(15, 14, false),
            proc(20, 1, false),
            proc(21, 20, false),
        ];
        let found = descendants(&procs, 10);
        let mut pids: Vec<i32> = found.keys().copied().collect();
        pids.sort_unstable();
        assert_eq!(pids, [11, 12, 13, 15]);
        assert_eq!(found[&13], 130);
        assert!(descendants(&procs, 13).is_empty());
        assert!(descendants(&procs, 99).is_empty());
        let mut all: Vec<i32> = descendants(&procs, 0).into_keys().collect();
        all.sort_unstable();
        // pid 1 is never a target, nor is anything reached only through it.
        assert!(all.is_empty(), "{all:?}");
    }

    #[test]
    fn a_signal_is_checked_against_the_start_time() {
        let mut child = Command::new("sleep").arg("1000").spawn().unwrap();
        let pid = child.id() as i32;
        let mut buf = Vec::new();
        let start = read_stat(pid, &mut buf).unwrap().start;
        // Another start time: another process, never signalled.
        assert!(!signal_checked(pid, start + 1, 0));
        assert!(!signal_checked(1, 0, 0));
        assert!(!signal_checked(0, 0, 0));
        assert!(signal_checked(pid, start, sys::SIGKILL));
        assert_eq!(child.wait().unwrap().signal(), Some(sys::SIGKILL));
    }
}
