//! `runcell-helper`: the exec helper that runs inside a run's container or pod.
//!
//! One long-lived exec starts it (as the container's user, in the run's working directory,
//! with the run's environment). It reads frames on stdin and writes frames on stdout (the
//! wire protocol is `proto.rs`, which documents the semantics implemented here) and runs
//! every tool call of the run as its own child: a fork+exec instead of a whole
//! `docker exec` per call.
//!
//! Std only, no crates: core's build script compiles this file (and the modules beside
//! it) with plain `rustc` into a static binary. The few libc calls std lacks live in
//! [`sys`], the only place with `unsafe`.
//!
//! Threads: the main thread reads frames and never blocks on one exec nor on stdout; one
//! writer thread owns stdout and writes what every other thread queues (batched, flushed
//! when the queue is empty; the queue is bounded by the credits: output and `ENTRY` frames
//! are queued only within an id's credit); a reaper waits for every child (`waitid` with
//! `WNOWAIT`, then reaps under the registry lock, so std's own spawn-failure `waitpid` is
//! never raced); per exec one output thread (credit-gated, or draining and dropping once
//! the host discarded the exec; it also reads the command's status from the exec's
//! shepherd) and, when stdin is piped, one stdin writer; a kill or a `GET` runs on its own
//! thread.
//!
//! Processes: every exec runs under a shepherd of its own (`shepherd.rs`, the same
//! executable in another mode), which tracks, reaps and kills that exec's processes and
//! nothing else; the helper only talks to the shepherds and reaps them. One shepherd is
//! started ahead (the spare, with the pipes its command will get) and waits for its
//! plan, so that starting a shepherd is on no exec's way (about half of an exec's time
//! at the helper).
//!
//! Lock order: registry, then an exec's state, then a flow, then the output queue (a
//! leaf: nothing is locked while holding it).
//!
//! Modules, by concern: [`conn`] (the main thread: reads frames and dispatches them),
//! [`exec`] (the registry of execs, spawning under shepherds, reaping, kills),
//! [`streams`] (an exec's output and stdin threads), [`flow`] (output credit),
//! [`files`] (`PUT` and `GET`), [`users`] (per-exec users and permission checks),
//! [`procs`] (`/proc` scans), [`shepherd`] (the per-exec shepherd mode), [`sys`] (the libc
//! calls) and [`proto`] (the wire protocol). This file holds what they share: the
//! [`Helper`] state, the writer thread, error kinds, and `main`.

mod conn;
mod exec;
mod files;
mod flow;
mod procs;
// Shared with core's client: not every item is used here, and its style is core's.
#[allow(dead_code, clippy::type_complexity)]
mod proto;
mod shepherd;
mod streams;
mod sys;
#[cfg(test)]
mod testing;
mod users;

use std::collections::VecDeque;
use std::env;
use std::ffi::OsString;
use std::fmt;
use std::fs::{self, File, OpenOptions, Permissions};
use std::io::{self, ErrorKind, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use conn::Conn;
use exec::Registry;
use proto::{
    Enc, FILE_ERROR, FileError, Fnv, HELLO, Hello, PROTOCOL_ERROR, SPAWN_ERROR, SpawnError, VERSION,
};
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
/// The writer's buffer: small frames are batched into one `write`.
const WRITE_BUFFER: usize = 128 * 1024;
/// How long an exiting helper lets the writer send what is queued (the host may not read).
const FLUSH_AT_EXIT: Duration = Duration::from_secs(1);
/// Quiet time after which the writer gives the heap's free pages back to the kernel.
const TRIM_AFTER: Duration = Duration::from_secs(1);

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
    if args.next().is_some_and(|a| a == shepherd::MODE_ARG) {
        shepherd::main(args.next());
    }
    sys::one_malloc_arena();
    if let Err(e) = sys::set_not_dumpable() {
        diag(format_args!("cannot make itself non-dumpable: {e}"));
    }
    if sys::ids().2 == 0 {
        secure_own_files();
    }
    let (h, out): (&'static Helper, File) = match Helper::new() {
        Ok((h, out)) => (Box::leak(Box::new(h)), out),
        Err(e) => {
            diag(format_args!("cannot start: {e}"));
            std::process::exit(1);
        }
    };
    let (size, digest) = self_digest();
    let mut e = Enc::frame(HELLO, 0);
    Hello {
        version: VERSION,
        pid: h.pid as u32,
        uid: h.uid,
        gid: h.gid,
        size,
        digest,
    }
    .encode(&mut e);
    h.send(e.finish());
    if !start_thread("writer", move || h.writer(out)) {
        diag(format_args!("cannot start its writer thread"));
        std::process::exit(1);
    }
    if !start_thread("reaper", move || h.reaper()) {
        diag(format_args!("cannot start its threads"));
        h.send_protocol_error("the helper cannot start its threads");
        h.flush_at_exit();
        std::process::exit(1);
    }
    h.refill_spare();
    Conn::new(h).run()
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

/// Frames waiting for the writer thread.
#[derive(Default)]
struct OutQueue {
    frames: VecDeque<Vec<u8>>,
    /// The writer wrote and flushed everything and waits for more.
    idle: bool,
}

/// Everything the threads share.
struct Helper {
    /// Frames for the writer thread, which owns the frame stream (a duplicate of fd 1).
    out: Mutex<OutQueue>,
    /// Signalled when a frame is queued (the writer waits on it).
    out_cv: Condvar,
    /// Signalled when the writer becomes idle or the stream breaks.
    idle_cv: Condvar,
    /// Set once writing a frame failed: the host is gone (frames are dropped from then).
    out_broken: AtomicBool,
    /// Set by the first thread that shuts the helper down.
    stopping: AtomicBool,
    /// The helper's pid.
    pid: i32,
    /// Real uid and gid.
    uid: u32,
    gid: u32,
    /// Effective uid 0: may switch users and set owners.
    root: bool,
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
}

impl Helper {
    /// Records what every spawn starts from: ids, working directory, environment. Also
    /// returns the frame stream, for the writer thread.
    fn new() -> io::Result<(Helper, File)> {
        if let Err(e) = sys::set_child_subreaper() {
            diag(format_args!("cannot become a child subreaper: {e}"));
        }
        let out = File::from(io::stdout().as_fd().try_clone_to_owned()?);
        let (uid, gid, euid) = sys::ids();
        let cwd = env::current_dir().unwrap_or_else(|_| PathBuf::from("/"));
        let cwd_id = fs::metadata(".").ok().map(|m| (m.dev(), m.ino()));
        let base_env = env::vars_os()
            .filter(|(k, _)| ![EXEC_ID_VAR, OLD_EXEC_ID_VAR].contains(&k.as_bytes()))
            .collect();
        let h = Helper {
            out: Mutex::new(OutQueue::default()),
            out_cv: Condvar::new(),
            idle_cv: Condvar::new(),
            out_broken: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            pid: std::process::id() as i32,
            uid,
            gid,
            root: euid == 0,
            cwd,
            cwd_id,
            base_env,
            reg: Mutex::new(Registry::default()),
            reg_cv: Condvar::new(),
        };
        Ok((h, out))
    }

    // ---- frames out -------------------------------------------------------------------

    /// Queues one whole frame for the writer thread; never blocks on stdout. Dropped once
    /// the stream broke.
    fn send(&self, frame: Vec<u8>) {
        if self.out_broken.load(Ordering::Relaxed) {
            return;
        }
        lock(&self.out).frames.push_back(frame);
        self.out_cv.notify_one();
    }

    /// The writer thread: writes queued frames in batches, flushing whenever the queue is
    /// empty. A failed write means the host is gone: shut down.
    fn writer(&'static self, out: File) {
        let mut w = io::BufWriter::with_capacity(WRITE_BUFFER, out);
        let mut batch: VecDeque<Vec<u8>> = VecDeque::new();
        loop {
            let mut q = lock(&self.out);
            if q.frames.is_empty() {
                drop(q);
                if w.flush().is_err() {
                    self.stream_broken();
                }
                q = lock(&self.out);
                if q.frames.is_empty() {
                    q.idle = true;
                    self.idle_cv.notify_all();
                    q = self.idle_wait(q);
                    q.idle = false;
                }
            }
            std::mem::swap(&mut q.frames, &mut batch);
            drop(q);
            for f in batch.drain(..) {
                if w.write_all(&f).is_err() {
                    self.stream_broken();
                }
            }
        }
    }

    /// The idle writer waits for a frame. After [`TRIM_AFTER`] without one it gives the
    /// heap's free pages back (once per quiet spell: the work since the last spell freed
    /// what it allocated, and glibc would keep it).
    fn idle_wait<'a>(&'a self, mut q: MutexGuard<'a, OutQueue>) -> MutexGuard<'a, OutQueue> {
        let mut trimmed = false;
        while q.frames.is_empty() {
            if trimmed {
                q = wait(&self.out_cv, q);
                continue;
            }
            let (g, timeout) = self
                .out_cv
                .wait_timeout(q, TRIM_AFTER)
                .unwrap_or_else(PoisonError::into_inner);
            q = g;
            if timeout.timed_out() && q.frames.is_empty() {
                drop(q);
                sys::release_free_memory();
                trimmed = true;
                q = lock(&self.out);
            }
        }
        q
    }

    /// Writing to stdout failed: drop what is queued and shut down (on the writer thread).
    fn stream_broken(&'static self) -> ! {
        self.out_broken.store(true, Ordering::SeqCst);
        lock(&self.out).frames.clear();
        self.idle_cv.notify_all();
        self.shutdown(0)
    }

    /// Lets the writer send what is queued, for at most [`FLUSH_AT_EXIT`].
    fn flush_at_exit(&self) {
        let deadline = Instant::now() + FLUSH_AT_EXIT;
        let mut q = lock(&self.out);
        loop {
            let flushed = q.idle && q.frames.is_empty();
            if flushed || self.out_broken.load(Ordering::SeqCst) {
                return;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            q = self
                .idle_cv
                .wait_timeout(q, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// A frame without payload.
    fn send_empty(&self, kind: u8, id: u32) {
        self.send(Enc::frame(kind, id).finish());
    }

    /// A frame whose payload is one u32.
    fn send_u32(&self, kind: u8, id: u32, v: u32) {
        let mut e = Enc::frame(kind, id);
        e.u32(v);
        self.send(e.finish());
    }

    /// `SPAWN_ERROR`.
    fn send_spawn_error(&self, id: u32, kind: SpawnError, msg: &str) {
        let mut e = Enc::frame(SPAWN_ERROR, id);
        e.u8(kind as u8).bytes(msg.as_bytes());
        self.send(e.finish());
    }

    /// `FILE_ERROR`.
    fn send_file_error(&self, id: u32, kind: FileError, path: &[u8], msg: &str) {
        self.send(file_error_frame(id, kind, path, msg));
    }

    /// `PROTOCOL_ERROR` (id 0: the connection).
    fn send_protocol_error(&self, msg: &str) {
        let mut e = Enc::frame(PROTOCOL_ERROR, 0);
        e.bytes(msg.as_bytes());
        self.send(e.finish());
    }

    /// Kills the tree of every exec whose `EXIT` was not sent (SIGKILL at once), lets the
    /// writer send what is queued, and exits. Background processes of execs that already
    /// ended are left alone.
    fn shutdown(&'static self, code: i32) -> ! {
        if self.stopping.swap(true, Ordering::SeqCst) {
            // Another thread is already shutting down and will exit the process.
            loop {
                thread::park();
            }
        }
        self.kill_live_execs();
        self.flush_at_exit();
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

/// A `FILE_ERROR` frame.
fn file_error_frame(id: u32, kind: FileError, path: &[u8], msg: &str) -> Vec<u8> {
    let mut e = Enc::frame(FILE_ERROR, id);
    e.u8(kind as u8).bytes(path).bytes(msg.as_bytes());
    e.finish()
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
    use std::io::Read;
    use std::time::{Duration, Instant};

    use super::*;
    use crate::proto::{CHUNK, KILLED, PONG, STDERR, STDOUT};
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
    fn a_file_error_frame_carries_kind_path_and_message() {
        let f = Frame::parse(&file_error_frame(9, FileError::IsDir, b"a/b", "in the way"));
        assert_eq!((f.kind, f.id), (FILE_ERROR, 9));
        let mut d = f.dec();
        assert_eq!(FileError::from_u8(d.u8().unwrap()), FileError::IsDir);
        assert_eq!(d.bytes().unwrap(), b"a/b");
        assert_eq!(d.bytes().unwrap(), b"in the way");
        assert!(d.rest().is_empty());
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
    fn frames_are_queued_in_order_and_dropped_once_the_stream_broke() {
        let dir = TempDir::new();
        let h = Helper::for_tests(false, dir.path());
        h.send_empty(PONG, 1);
        h.send_u32(KILLED, 2, 1);
        h.send_spawn_error(3, SpawnError::UserDenied, "no");
        h.send_file_error(4, FileError::Untrusted, b"d", "link");
        h.send_protocol_error("bad");
        let frames = h.take_frames();
        let heads: Vec<(u8, u32)> = frames.iter().map(|f| (f.kind, f.id)).collect();
        assert_eq!(
            heads,
            [
                (PONG, 1),
                (KILLED, 2),
                (SPAWN_ERROR, 3),
                (FILE_ERROR, 4),
                (PROTOCOL_ERROR, 0)
            ]
        );
        assert!(frames[0].payload.is_empty());
        assert_eq!(frames[1].u32(), 1);
        let mut d = frames[2].dec();
        assert_eq!(SpawnError::from_u8(d.u8().unwrap()), SpawnError::UserDenied);
        assert_eq!(d.bytes().unwrap(), b"no");
        assert_eq!(frames[4].dec().bytes().unwrap(), b"bad");

        h.out_broken.store(true, Ordering::SeqCst);
        h.send_empty(PONG, 5);
        assert!(h.take_frames().is_empty());
    }

    #[test]
    fn the_writer_sends_every_frame_in_order_and_goes_idle() {
        let dir = TempDir::new();
        let h = Helper::leaked(false, dir.path());
        let (mut reader, writer) = io::pipe().unwrap();
        assert!(start_thread("writer", move || h
            .writer(File::from(std::os::fd::OwnedFd::from(writer)))));
        let mut expected = Vec::new();
        for id in 0..200u32 {
            let mut e = Enc::frame(STDOUT, id);
            e.raw(&vec![id as u8; id as usize * 7]);
            let f = e.finish();
            expected.extend_from_slice(&f);
            h.send(f);
        }
        let mut got = vec![0u8; expected.len()];
        reader.read_exact(&mut got).unwrap();
        assert!(got == expected, "the frames arrived changed or reordered");
        // Everything written: the writer is idle, and an exit would not wait.
        let started = Instant::now();
        h.flush_at_exit();
        assert!(started.elapsed() < FLUSH_AT_EXIT);
        assert!(lock(&h.out).idle);
        // The writer lives on with the test process; a closed pipe would make it exit the
        // process, so its reader is never closed.
        std::mem::forget(reader);
    }

    #[test]
    fn a_writer_that_trimmed_the_heap_while_idle_still_sends() {
        let dir = TempDir::new();
        let h = Helper::leaked(false, dir.path());
        let (mut reader, writer) = io::pipe().unwrap();
        assert!(start_thread("writer", move || h
            .writer(File::from(std::os::fd::OwnedFd::from(writer)))));
        for round in 0..2u32 {
            let mut e = Enc::frame(STDOUT, round);
            e.raw(&vec![round as u8; 100_000]);
            let f = e.finish();
            h.send(f.clone());
            let mut got = vec![0u8; f.len()];
            reader.read_exact(&mut got).unwrap();
            assert!(got == f, "round {round}: the frame arrived changed");
            // Quiet for longer than TRIM_AFTER: the writer trims, then waits again.
            thread::sleep(TRIM_AFTER + Duration::from_millis(300));
            assert!(lock(&h.out).idle);
        }
        std::mem::forget(reader);
    }

    #[test]
    fn flush_at_exit_gives_up_on_a_writer_that_cannot_write() {
        let dir = TempDir::new();
        let h = Helper::for_tests(false, dir.path());
        // No writer runs: the queue never empties.
        h.send_empty(PONG, 1);
        let started = Instant::now();
        h.flush_at_exit();
        let waited = started.elapsed();
        assert!(waited >= FLUSH_AT_EXIT, "{waited:?}");
        assert!(
            waited < FLUSH_AT_EXIT + Duration::from_secs(5),
            "{waited:?}"
        );
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
    }
}
