//! `runcell-helper`: the exec helper that runs inside a run's container or pod.
//!
//! One executable, four modes (`proto.rs` documents the wire protocol and the semantics
//! implemented here; "Daemon, relay and durable execs" there is the big picture):
//!
//! - *relay* (no argument; what the host starts through the engine, as the container's
//!   user, in the run's working directory, with the run's environment): makes sure the
//!   run's daemon is up and copies bytes between its stdin/stdout and a connection to
//!   it ([`daemon`]). When no daemon can be used it *serves its connection itself*, as
//!   version 2 did: the helper below with one connection on stdin/stdout, which kills
//!   every exec and exits when the stream ends.
//! - *daemon* ([`proto::DAEMON_ARG`], started by a relay): the helper proper. It owns
//!   every exec of the run and outlives any one connection; it accepts connections on a
//!   Unix socket and runs until the container goes.
//! - *shepherd* ([`shepherd::MODE_ARG`]): one per exec, tracks, reaps and kills that
//!   exec's processes ([`shepherd`]).
//!
//! The helper runs every tool call of the run as its own child: a fork+exec instead of
//! a whole `docker exec` per call.
//!
//! Std only, no crates: core's build script compiles this file (and the modules beside
//! it) with plain `rustc` into a static binary (`panic=abort`: a panic anywhere ends
//! the daemon and with it every exec). The few libc calls std lacks live in [`sys`], the
//! only place with `unsafe`.
//!
//! Threads of the helper proper: the daemon's main thread accepts connections (the
//! relay serving itself has one connection, on stdin/stdout); per connection a reader
//! ([`conn`]: reads frames and dispatches them, never blocking on one exec nor on the
//! stream) and a writer ([`link`]: owns the stream and writes what every other thread
//! queues, batched, flushed when the queue is empty); a reaper waits for every child
//! (`waitid` with `WNOWAIT`, then reaps under the registry lock, so std's own
//! spawn-failure `waitpid` is never raced); the daemon's janitor ([`durable`]) kills
//! execs whose grace passed and forgets expired records; per exec one output thread
//! (reads the command's output into the exec's record and sends it within the attached
//! connection's credit; it also reads the command's status from the exec's shepherd)
//! and, when stdin is piped, one stdin writer; a spawn's answer, a kill, a `GET`, `BASE` or
//! `LAYER` runs on a thread of its own.
//!
//! Processes: every exec runs under a shepherd of its own (`shepherd.rs`, the same
//! executable in another mode), which tracks, reaps and kills that exec's processes and
//! nothing else; the helper only talks to the shepherds and reaps them. One shepherd is
//! started ahead (the spare, with the pipes its command will get) and waits for its
//! plan, so that starting a shepherd is on no exec's way (about half of an exec's time
//! at the helper).
//!
//! Lock order: the registry, then an exec's state (its record), then a `GET`'s flow,
//! then a connection's output queue. The queue, and an exec's control channel (taken
//! only to write a kill order, with nothing else held), are leaves: nothing is locked
//! while holding them. A thread that holds an exec's state may queue frames on any
//! connection (that is how an exec's frames follow its attached connection); a thread
//! that holds the registry may lock any exec's state, never the reverse.
//!
//! Modules, by concern: [`daemon`] (relay and daemon: the daemon's directory, lock and
//! socket, starting it, accepting connections, the relay's copy), [`conn`] (a
//! connection's reader: frames in, dispatched), [`link`] (a connection's writer: frames
//! out), [`exec`] (the registry of execs, spawning under shepherds, reaping, kills),
//! [`plan`] (a `SPAWN` resolved: user, environment, directory, program), [`record`] (an
//! exec's retained output, offsets and credit), [`durable`] (records across
//! connections: `ATTACH`, `RELEASE`, `LIST`, `DISCARD`, the end of a connection, the
//! janitor), [`streams`] (an exec's output and stdin threads), [`flow`] (a `GET`'s
//! credit), [`files`] (`PUT` and `GET`; the walk `GET`, `BASE` and `LAYER`
//! share), [`layer`] (`BASE` and `LAYER`: snapshot layers), [`users`] (per-exec users and permission
//! checks), [`procs`] (`/proc` scans), [`shepherd`] (the per-exec shepherd mode), [`sys`]
//! (the libc calls) and [`proto`] (the wire protocol). This file holds what they share:
//! the [`Helper`] state, the `HELLO`, the one-connection mode, error kinds, and `main`.

mod conn;
mod daemon;
mod durable;
mod exec;
mod files;
mod flow;
mod layer;
mod link;
mod plan;
mod procs;
// Shared with core's client: not every item is used here, and its style is core's.
#[allow(dead_code, clippy::type_complexity)]
mod proto;
mod record;
mod shepherd;
mod streams;
mod sys;
#[cfg(test)]
mod testing;
mod users;

use std::env;
use std::ffi::OsString;
use std::fmt;
use std::fs::{self, File, OpenOptions, Permissions};
use std::io::{self, ErrorKind, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::Duration;

use conn::Conn;
use exec::Registry;
use link::Link;
use proto::{DAEMON_ARG, Enc, FileError, Fnv, HELLO, Hello, SpawnError, VERSION};
use sys::{
    EACCES, EAGAIN, EISDIR, ELOOP, EMFILE, ENAMETOOLONG, ENFILE, ENOENT, ENOEXEC, ENOMEM, ENOTDIR,
    EPERM, ETXTBSY,
};

/// Stack of every thread the helper starts (they neither recurse nor keep big locals).
const THREAD_STACK: usize = 128 * 1024;
/// The variable that marks every process of an exec.
const EXEC_ID_VAR: &[u8] = b"RUNCELL_EXEC_ID";
/// Its old name, still stripped from the helper's own environment so that an inherited
/// one never reaches an exec.
const OLD_EXEC_ID_VAR: &[u8] = b"SANDBOX_EXEC_ID";
/// Header of a frame: length u32, kind u8, id u32.
const HEADER: usize = 9;
/// How long an ending connection lets the writer send what is queued (the peer may not
/// read).
const FLUSH_AT_END: Duration = Duration::from_secs(1);

/// Locks, ignoring poisoning: a panic elsewhere must not stop the helper.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Waits on a condition variable, ignoring poisoning.
fn wait<'a, T>(cv: &Condvar, g: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    cv.wait(g).unwrap_or_else(PoisonError::into_inner)
}

/// A diagnostic line on stderr (never stdout); errors writing it are ignored.
fn diag(args: fmt::Arguments<'_>) {
    let _ = writeln!(io::stderr(), "runcell-helper: {args}");
}

/// Starts a named thread; false when the kernel refuses one (pids limit).
fn start_thread(name: &str, f: impl FnOnce() + Send + 'static) -> bool {
    thread::Builder::new()
        .name(name.into())
        .stack_size(THREAD_STACK)
        .spawn(f)
        .is_ok()
}

fn main() {
    let mut args = env::args_os().skip(1);
    match args.next() {
        Some(a) if a == shepherd::MODE_ARG => shepherd::main(args.next()),
        Some(a) if a == DAEMON_ARG => daemon::daemon_main(args),
        _ => daemon::relay_main(),
    }
}

/// What the helper proper does first, in either mode: one malloc arena, not dumpable,
/// and, as root, its own files made root's.
fn harden() {
    sys::one_malloc_arena();
    if let Err(e) = sys::set_not_dumpable() {
        diag(format_args!("cannot make itself non-dumpable: {e}"));
    }
    if sys::ids().2 == 0 {
        secure_own_files();
    }
}

/// Serves one connection on stdin/stdout and exits when it ends, killing every exec
/// still running (version 2's helper; the relay's fallback when no daemon can be used).
fn serve_stdio(size: u64, digest: u64) -> ! {
    let h: &'static Helper = Box::leak(Box::new(Helper::new(false, size, digest)));
    let streams = io::stdout()
        .as_fd()
        .try_clone_to_owned()
        .and_then(|o| Ok((o, io::stdin().as_fd().try_clone_to_owned()?)));
    let (out, input) = match streams {
        Ok((o, i)) => (File::from(o), File::from(i)),
        Err(e) => {
            diag(format_args!("cannot start: {e}"));
            std::process::exit(1);
        }
    };
    let link = Arc::new(Link::new(None));
    link.send(h.hello(0));
    let l = link.clone();
    if !start_thread("writer", move || {
        if !l.writer(out) {
            // The host is gone.
            h.shutdown(&l, 0);
        }
    }) {
        diag(format_args!("cannot start its writer thread"));
        std::process::exit(1);
    }
    if !start_thread("reaper", move || h.reaper()) {
        diag(format_args!("cannot start its threads"));
        link.send_protocol_error("the helper cannot start its threads");
        h.shutdown(&link, 1);
    }
    h.refill_spare();
    let code = Conn::new(h, link.clone()).run(input);
    h.shutdown(&link, code)
}

/// As root: makes the helper's directory (normally `/.runcell`) and its executable
/// `root:root` 0755, so that an unprivileged per-exec user cannot replace the program a
/// later attach runs as root. Errors are ignored (a read-only file system is fine). A
/// root-owned sticky directory (`/tmp`) is left as it is: it is shared, and its sticky bit
/// already keeps others from replacing a root-owned file in it.
fn secure_own_files() {
    use sys::{O_DIRECTORY, O_NOFOLLOW};
    const STICKY: u32 = 0o1000;
    let mode = || Permissions::from_mode(0o755);
    if let Ok(exe) = fs::read_link("/proc/self/exe")
        && let Some(dir) = exe.parent()
        && let Ok(d) = OpenOptions::new()
            .read(true)
            .custom_flags(O_DIRECTORY | O_NOFOLLOW)
            .open(dir)
        && let Ok(md) = d.metadata()
        && !(md.uid() == 0 && md.mode() & STICKY != 0)
    {
        let _ = std::os::unix::fs::fchown(&d, Some(0), Some(0));
        let _ = d.set_permissions(mode());
    }
    // The running executable itself (not whatever its path names by now).
    if let Ok(f) = File::open("/proc/self/exe") {
        let _ = std::os::unix::fs::fchown(&f, Some(0), Some(0));
        let _ = f.set_permissions(mode());
    }
}

/// Size and FNV-1a digest of the helper's own executable.
fn self_digest() -> (u64, u64) {
    let mut fnv = Fnv::default();
    let mut size = 0u64;
    if let Ok(mut f) = File::open("/proc/self/exe") {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match f.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    fnv.update(&buf[..n]);
                    size += n as u64;
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
    }
    (size, fnv.0)
}

/// Everything the threads share.
struct Helper {
    /// Set by the first thread that shuts the one-connection helper down.
    stopping: AtomicBool,
    /// The daemon: execs outlive the connections (false: the relay serves its one
    /// connection itself, and everything ends with it).
    durable: bool,
    /// The helper's pid.
    pid: i32,
    /// Real uid and gid.
    uid: u32,
    gid: u32,
    /// Effective uid 0: may switch users and set owners.
    root: bool,
    /// Size and digest of its executable, for the `HELLO`.
    size: u64,
    digest: u64,
    /// Default working directory, and its (device, inode).
    cwd: PathBuf,
    cwd_id: Option<(u64, u64)>,
    /// The run's environment, without an inherited exec marker (`RUNCELL_EXEC_ID`, or
    /// the old `SANDBOX_EXEC_ID`).
    base_env: Vec<(OsString, OsString)>,
    /// Execs and their shepherds.
    reg: Mutex<Registry>,
    /// Signalled on every spawn (the reaper waits for one).
    reg_cv: Condvar,
    /// Signalled when a deadline is set (the janitor waits for the nearest).
    janitor_cv: Condvar,
    /// Connections being served.
    connections: AtomicUsize,
    /// The daemon's directory (the daemon's own descriptor; `None`: the relay serves its
    /// connection itself, or a test).
    daemon_dir: Option<File>,
}

impl Helper {
    /// Records what every spawn starts from: ids, working directory, environment; and
    /// becomes the subreaper of its execs' shepherds' orphans.
    fn new(durable: bool, size: u64, digest: u64) -> Helper {
        if let Err(e) = sys::set_child_subreaper() {
            diag(format_args!("cannot become a child subreaper: {e}"));
        }
        let (uid, gid, euid) = sys::ids();
        let cwd = env::current_dir().unwrap_or_else(|_| PathBuf::from("/"));
        let cwd_id = fs::metadata(".").ok().map(|m| (m.dev(), m.ino()));
        let base_env = env::vars_os()
            .filter(|(k, _)| ![EXEC_ID_VAR, OLD_EXEC_ID_VAR].contains(&k.as_bytes()))
            .collect();
        Helper {
            stopping: AtomicBool::new(false),
            durable,
            pid: std::process::id() as i32,
            uid,
            gid,
            root: euid == 0,
            size,
            digest,
            cwd,
            cwd_id,
            base_env,
            reg: Mutex::new(Registry::default()),
            reg_cv: Condvar::new(),
            janitor_cv: Condvar::new(),
            connections: AtomicUsize::new(0),
            daemon_dir: None,
        }
    }

    /// The `HELLO` of a connection that came through the relay `relay` (0: none).
    fn hello(&self, relay: u32) -> Vec<u8> {
        let mut e = Enc::frame(HELLO, 0);
        Hello {
            version: VERSION,
            pid: self.pid as u32,
            uid: self.uid,
            gid: self.gid,
            size: self.size,
            digest: self.digest,
            relay,
            durable: self.durable,
        }
        .encode(&mut e);
        e.finish()
    }

    /// Ends the one-connection helper: kills the tree of every exec still running
    /// (SIGKILL at once), lets the writer send what is queued, and exits. Background
    /// processes of execs that already ended are left alone.
    fn shutdown(&'static self, link: &Link, code: i32) -> ! {
        if self.stopping.swap(true, Ordering::SeqCst) {
            // Another thread is already shutting down and will exit the process.
            loop {
                thread::park();
            }
        }
        self.kill_live_execs();
        link.flush(FLUSH_AT_END);
        std::process::exit(code)
    }
}

/// `buf[HEADER..HEADER + len]` as a data frame of `kind` (the header is written in place).
fn data_frame(buf: &mut [u8], kind: u8, id: u32, len: usize) -> Vec<u8> {
    buf[..4].copy_from_slice(&((len + 5) as u32).to_le_bytes());
    buf[4] = kind;
    buf[5..HEADER].copy_from_slice(&id.to_le_bytes());
    buf[..HEADER + len].to_vec()
}

/// A spawn failure's kind.
fn spawn_error_kind(e: &io::Error, switching: bool) -> SpawnError {
    match e.raw_os_error() {
        Some(ENOENT | ENOTDIR) => SpawnError::NotFound,
        Some(EACCES | ENOEXEC | EISDIR | ETXTBSY | ELOOP | ENAMETOOLONG) => {
            SpawnError::NotExecutable
        }
        Some(EPERM) if switching => SpawnError::UserDenied,
        Some(EPERM) => SpawnError::NotExecutable,
        Some(EAGAIN | ENOMEM | EMFILE | ENFILE) => SpawnError::Resources,
        _ => SpawnError::Other,
    }
}

/// A file operation failure's kind.
fn file_error_kind(e: &io::Error) -> FileError {
    match e.raw_os_error() {
        Some(ENOENT) => FileError::NotFound,
        Some(ENOTDIR) => FileError::NotDir,
        Some(EISDIR) => FileError::IsDir,
        Some(EACCES | EPERM) => FileError::Denied,
        _ => FileError::Other,
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::proto::{CHUNK, Dec, STDERR, STDOUT};
    use crate::sys::{EINVAL, ENOSYS};
    use crate::testing::{Frame, TempDir};

    fn os(errno: i32) -> io::Error {
        io::Error::from_raw_os_error(errno)
    }

    #[test]
    fn a_data_frame_is_written_around_its_payload_in_place() {
        let mut buf = vec![0xaa; HEADER + CHUNK];
        buf[HEADER..HEADER + 5].copy_from_slice(b"hello");
        let frame = data_frame(&mut buf, STDERR, 0x0102_0304, 5);
        assert_eq!(frame.len(), HEADER + 5);
        let (kind, id, payload, len) = proto::split_frame(&frame).unwrap().unwrap();
        assert_eq!(
            (kind, id, payload, len),
            (STDERR, 0x0102_0304, &b"hello"[..], 14)
        );
        // An empty payload is a whole frame too.
        let frame = data_frame(&mut buf, STDOUT, 7, 0);
        assert_eq!(Frame::parse(&frame).payload, b"");
    }

    #[test]
    fn spawn_errors_are_typed_by_errno() {
        let kind = |errno, switching| spawn_error_kind(&os(errno), switching);
        assert_eq!(kind(ENOENT, false), SpawnError::NotFound);
        assert_eq!(kind(ENOTDIR, true), SpawnError::NotFound);
        for e in [EACCES, ENOEXEC, EISDIR, ETXTBSY, ELOOP, ENAMETOOLONG] {
            assert_eq!(kind(e, false), SpawnError::NotExecutable, "errno {e}");
        }
        // EPERM is the user switch's failure only while switching.
        assert_eq!(kind(EPERM, true), SpawnError::UserDenied);
        assert_eq!(kind(EPERM, false), SpawnError::NotExecutable);
        for e in [EAGAIN, ENOMEM, EMFILE, ENFILE] {
            assert_eq!(kind(e, true), SpawnError::Resources, "errno {e}");
        }
        assert_eq!(kind(EINVAL, false), SpawnError::Other);
        assert_eq!(kind(ENOSYS, false), SpawnError::Other);
        let no_errno = io::Error::other("no errno");
        assert_eq!(spawn_error_kind(&no_errno, false), SpawnError::Other);
    }

    #[test]
    fn file_errors_are_typed_by_errno() {
        assert_eq!(file_error_kind(&os(ENOENT)), FileError::NotFound);
        assert_eq!(file_error_kind(&os(ENOTDIR)), FileError::NotDir);
        assert_eq!(file_error_kind(&os(EISDIR)), FileError::IsDir);
        assert_eq!(file_error_kind(&os(EACCES)), FileError::Denied);
        assert_eq!(file_error_kind(&os(EPERM)), FileError::Denied);
        assert_eq!(file_error_kind(&os(ELOOP)), FileError::Other);
        assert_eq!(file_error_kind(&io::Error::other("x")), FileError::Other);
    }

    #[test]
    fn hello_says_who_serves_the_connection() {
        let dir = TempDir::new();
        let h = Helper::for_tests(false, dir.path());
        let f = Frame::parse(&h.hello(4321));
        assert_eq!((f.kind, f.id), (HELLO, 0));
        let hello = Hello::decode(&mut Dec::new(&f.payload)).unwrap();
        let (uid, gid, _) = sys::ids();
        assert_eq!(
            hello,
            Hello {
                version: VERSION,
                pid: std::process::id(),
                uid,
                gid,
                size: h.size,
                digest: h.digest,
                relay: 4321,
                durable: true,
            }
        );
        let mut single = Helper::for_tests(false, dir.path());
        single.durable = false;
        let f = Frame::parse(&single.hello(0));
        let hello = Hello::decode(&mut Dec::new(&f.payload)).unwrap();
        assert_eq!((hello.relay, hello.durable), (0, false));
    }

    #[test]
    fn self_digest_is_the_size_and_fnv_of_the_running_executable() {
        let mut bytes = Vec::new();
        File::open("/proc/self/exe")
            .unwrap()
            .read_to_end(&mut bytes)
            .unwrap();
        let mut fnv = Fnv::default();
        fnv.update(&bytes);
        assert_eq!(self_digest(), (bytes.len() as u64, fnv.0));
        assert_ne!(fnv.0, Fnv::default().0);
    }

    #[test]
    fn start_thread_runs_a_named_thread() {
        let (tx, rx) = std::sync::mpsc::channel();
        assert!(start_thread("named", move || {
            let name = thread::current().name().map(str::to_string);
            tx.send(name).unwrap();
        }));
        let name = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(name.as_deref(), Some("named"));
        let _ = Instant::now();
    }
}
