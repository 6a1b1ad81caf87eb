//! `runcell-helper`: the exec helper that runs inside a run's container or pod.
//!
//! One long-lived exec starts it (as the container's user, in the run's working directory,
//! with the run's environment). It reads frames on stdin and writes frames on stdout (the
//! wire protocol is `proto.rs`, which documents the semantics implemented here) and runs
//! every tool call of the run as its own child: a fork+exec instead of a whole
//! `docker exec` per call.
//!
//! Std only, no crates: core's build script compiles this file with plain `rustc` into a
//! static binary. The few libc calls std lacks live in [`sys`], the only place with
//! `unsafe`.
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
//! nothing else; the helper only talks to the shepherds and reaps them.
//!
//! Lock order: registry, then an exec's state, then a flow, then the output queue (a
//! leaf: nothing is locked while holding it).

// Shared with core's client: not every item is used here, and its style is core's.
mod files;
#[allow(dead_code, clippy::type_complexity)]
mod proto;
mod shepherd;

use std::collections::{HashMap, VecDeque};
use std::env;
use std::ffi::{OsStr, OsString};
use std::fmt;
use std::fs::{self, File, Metadata, OpenOptions, Permissions};
use std::io::{self, ErrorKind, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use proto::{
    CHUNK, CREDIT, DISCARD, DONE, Dec, DecodeError, ENTRY, EXIT, EXITED, Enc, Entry, FILE_ERROR,
    FileError, Fnv, GET, HELLO, Hello, INITIAL_CREDIT, KILL, KILL_GRACE_MS, KILLED, PING, PONG,
    PROTOCOL_ERROR, PUT, SIGNALED, SPAWN, SPAWN_ERROR, STARTED, STDERR, STDIN, STDIN_ACK,
    STDIN_EOF, STDIN_WINDOW, STDOUT, Spawn, SpawnError, VERSION,
};

/// Stack of every thread the helper starts (they neither recurse nor keep big locals).
const THREAD_STACK: usize = 128 * 1024;
/// Bytes read from stdin at a time.
const READ_CHUNK: usize = 64 * 1024;
/// Queued stdin bytes of one exec beyond which the host broke the window rule.
const STDIN_QUEUE_LIMIT: usize = 4 * STDIN_WINDOW as usize;
/// The variable that marks every process of an exec.
const EXEC_ID_VAR: &[u8] = b"SANDBOX_EXEC_ID";
/// Header of a frame: length u32, kind u8, id u32.
const HEADER: usize = 9;
/// How long a shepherd may take to answer a plan (it starts the command and answers at
/// once; only a stopped one takes longer).
const SHEPHERD_ANSWER: Duration = Duration::from_secs(8);
/// How long a kill waits for the exec's shepherd to confirm that its processes are gone
/// (its graceful kill takes about `KILL_GRACE_MS`; the host waits 4 s for `KILLED`).
const KILL_CONFIRM: Duration = Duration::from_millis(KILL_GRACE_MS + 2500);
/// How long an exiting helper waits for the shepherds of live execs to kill them.
const SHUTDOWN_KILL: Duration = Duration::from_secs(3);
/// The writer's buffer: small frames are batched into one `write`.
const WRITE_BUFFER: usize = 128 * 1024;
/// How long an exiting helper lets the writer send what is queued (the host may not read).
const FLUSH_AT_EXIT: Duration = Duration::from_secs(1);

// errno values (x86_64 / generic Linux).
const EPERM: i32 = 1;
const ENOENT: i32 = 2;
const ENOEXEC: i32 = 8;
const ECHILD: i32 = 10;
const EAGAIN: i32 = 11;
const ENOMEM: i32 = 12;
const EACCES: i32 = 13;
const ENOTDIR: i32 = 20;
const EISDIR: i32 = 21;
const EINVAL: i32 = 22;
const ENFILE: i32 = 23;
const EMFILE: i32 = 24;
const ETXTBSY: i32 = 26;
const ENAMETOOLONG: i32 = 36;
const ENOSYS: i32 = 38;
const ELOOP: i32 = 40;

/// The few libc calls std lacks, each behind a safe wrapper. The only `unsafe` code.
mod sys {
    use std::ffi::{CStr, CString};
    use std::io;
    use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
    use std::os::raw::{c_char, c_int, c_long, c_short, c_uint, c_ulong};
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::process::CommandExt;
    use std::path::Path;
    use std::process::Command;

    /// `struct pollfd`.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default)]
    pub struct PollFd {
        /// The descriptor.
        pub fd: c_int,
        /// Requested events.
        pub events: c_short,
        /// Returned events.
        pub revents: c_short,
    }

    /// Data to read.
    pub const POLLIN: c_short = 0x1;
    /// Room to write.
    pub const POLLOUT: c_short = 0x4;
    /// Error (the read end of a pipe is gone).
    pub const POLLERR: c_short = 0x8;
    /// Hang-up (all writers of a pipe are gone).
    pub const POLLHUP: c_short = 0x10;
    /// Not an open descriptor.
    pub const POLLNVAL: c_short = 0x20;

    /// Signals used by a kill.
    pub const SIGKILL: c_int = 9;
    /// See [`SIGKILL`].
    pub const SIGTERM: c_int = 15;
    /// See [`SIGKILL`].
    pub const SIGCONT: c_int = 18;
    /// See [`SIGKILL`].
    pub const SIGSTOP: c_int = 19;

    /// `siginfo_t` (128 bytes on Linux); only `si_pid` is read.
    #[repr(C)]
    struct SigInfo {
        signo: c_int,
        errno: c_int,
        code: c_int,
        pad: c_int,
        pid: c_int,
        uid: c_uint,
        status: c_int,
        rest: [u8; 100],
    }

    const PR_SET_DUMPABLE: c_int = 4;
    const PR_SET_CHILD_SUBREAPER: c_int = 36;
    const P_ALL: c_int = 0;
    const WNOHANG: c_int = 1;
    const WEXITED: c_int = 4;
    const WNOWAIT: c_int = 0x0100_0000;
    const F_GETFL: c_int = 3;
    const F_SETFL: c_int = 4;
    const O_NONBLOCK: c_int = 0o4000;
    const FIONREAD: c_ulong = 0x541B;
    const X_OK: c_int = 1;
    const F_GETFD: c_int = 1;
    const F_SETFD: c_int = 2;
    const FD_CLOEXEC: c_int = 1;
    const SIG_BLOCK: c_int = 0;
    const SIGCHLD: c_int = 17;
    const SFD_NONBLOCK: c_int = 0o4000;
    const SFD_CLOEXEC: c_int = 0o2000000;
    const SYS_PIDFD_SEND_SIGNAL: c_long = 424;
    const SYS_PIDFD_OPEN: c_long = 434;

    /// glibc's `sigset_t` (1024 bits).
    #[repr(C)]
    struct SigSet([u64; 16]);

    unsafe extern "C" {
        fn prctl(
            option: c_int,
            arg2: c_ulong,
            arg3: c_ulong,
            arg4: c_ulong,
            arg5: c_ulong,
        ) -> c_int;
        fn waitid(idtype: c_int, id: c_uint, infop: *mut SigInfo, options: c_int) -> c_int;
        fn waitpid(pid: c_int, status: *mut c_int, options: c_int) -> c_int;
        safe fn kill(pid: c_int, sig: c_int) -> c_int;
        fn setgroups(size: usize, list: *const c_uint) -> c_int;
        fn setgid(gid: c_uint) -> c_int;
        fn setuid(uid: c_uint) -> c_int;
        fn poll(fds: *mut PollFd, nfds: c_ulong, timeout: c_int) -> c_int;
        fn fcntl(fd: c_int, cmd: c_int, ...) -> c_int;
        fn ioctl(fd: c_int, request: c_ulong, ...) -> c_int;
        safe fn getuid() -> c_uint;
        safe fn getgid() -> c_uint;
        safe fn geteuid() -> c_uint;
        safe fn setsid() -> c_int;
        fn access(path: *const c_char, mode: c_int) -> c_int;
        fn dup2(old: c_int, new: c_int) -> c_int;
        fn sigprocmask(how: c_int, set: *const SigSet, old: *mut SigSet) -> c_int;
        fn signalfd(fd: c_int, mask: *const SigSet, flags: c_int) -> c_int;
        fn syscall(num: c_long, ...) -> c_long;
        fn chdir(path: *const c_char) -> c_int;
    }

    /// A libc return value: negative means errno.
    fn check(r: c_int) -> io::Result<c_int> {
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(r)
        }
    }

    /// Makes the helper the reaper of every orphaned descendant.
    pub fn set_child_subreaper() -> io::Result<()> {
        // SAFETY: PR_SET_CHILD_SUBREAPER takes plain integers and touches no memory of ours.
        check(unsafe { prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) }).map(drop)
    }

    /// Makes the helper non-dumpable: its `/proc/<pid>` files belong to root and processes
    /// of its own uid cannot ptrace it or read its descriptors. Only the helper itself:
    /// a child gets dumpable back when it executes a normal program.
    pub fn set_not_dumpable() -> io::Result<()> {
        // SAFETY: PR_SET_DUMPABLE takes plain integers and touches no memory of ours.
        check(unsafe { prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) }).map(drop)
    }

    /// Blocks until some child has exited and returns its pid, leaving it a zombie.
    pub fn wait_exited() -> io::Result<i32> {
        let mut info = SigInfo {
            signo: 0,
            errno: 0,
            code: 0,
            pad: 0,
            pid: 0,
            uid: 0,
            status: 0,
            rest: [0; 100],
        };
        // SAFETY: `info` is a writable siginfo_t-sized buffer that outlives the call.
        check(unsafe { waitid(P_ALL, 0, &mut info, WEXITED | WNOWAIT) })?;
        Ok(info.pid)
    }

    /// Reaps `pid` if it is a zombie: its wait status.
    pub fn reap(pid: i32) -> io::Result<Option<i32>> {
        let mut status: c_int = 0;
        // SAFETY: `status` is a writable int that outlives the call.
        let r = check(unsafe { waitpid(pid, &mut status, WNOHANG) })?;
        Ok((r == pid).then_some(status))
    }

    /// Sends `sig` to `pid` (a negative pid: its process group); true if it was sent.
    pub fn signal(pid: i32, sig: i32) -> bool {
        kill(pid, sig) == 0
    }

    /// `poll(2)` over `fds`; `timeout_ms` < 0 waits for ever.
    pub fn poll_fds(fds: &mut [PollFd], timeout_ms: i32) -> io::Result<usize> {
        // SAFETY: pointer and length come from a live, exclusively borrowed slice.
        let r = check(unsafe { poll(fds.as_mut_ptr(), fds.len() as c_ulong, timeout_ms) })?;
        Ok(r as usize)
    }

    /// Sets `O_NONBLOCK` on `fd`.
    pub fn set_nonblocking(fd: RawFd) -> io::Result<()> {
        // SAFETY: F_GETFL takes no further argument; an invalid fd only yields EBADF.
        let flags = check(unsafe { fcntl(fd, F_GETFL) })?;
        // SAFETY: F_SETFL takes one int argument.
        check(unsafe { fcntl(fd, F_SETFL, flags | O_NONBLOCK) }).map(drop)
    }

    /// Bytes buffered in a pipe (0 on error).
    pub fn readable_bytes(fd: RawFd) -> usize {
        let mut n: c_int = 0;
        // SAFETY: FIONREAD writes one int through the pointer, which outlives the call.
        let r = unsafe { ioctl(fd, FIONREAD, &mut n as *mut c_int) };
        if r < 0 { 0 } else { n.max(0) as usize }
    }

    /// Whether the helper (real uid/gid) may search or execute `path`.
    pub fn can_execute(path: &Path) -> bool {
        let Ok(c) = CString::new(path.as_os_str().as_bytes()) else {
            return false;
        };
        // SAFETY: `c` is a NUL-terminated string that outlives the call.
        unsafe { access(c.as_ptr(), X_OK) == 0 }
    }

    /// Real uid, real gid, effective uid.
    pub fn ids() -> (u32, u32, u32) {
        (getuid(), getgid(), geteuid())
    }

    /// Starts a new session, of which the caller is the leader.
    pub fn new_session() -> io::Result<()> {
        check(setsid()).map(drop)
    }

    /// Sets or clears `FD_CLOEXEC` on `fd`.
    pub fn set_cloexec(fd: RawFd, on: bool) -> io::Result<()> {
        // SAFETY: F_GETFD takes no further argument; an invalid fd only yields EBADF.
        let flags = check(unsafe { fcntl(fd, F_GETFD) })?;
        let flags = if on {
            flags | FD_CLOEXEC
        } else {
            flags & !FD_CLOEXEC
        };
        // SAFETY: F_SETFD takes one int argument.
        check(unsafe { fcntl(fd, F_SETFD, flags) }).map(drop)
    }

    /// Takes an inherited descriptor (above stdio) named on the command line, if open.
    pub fn inherited_fd(fd: RawFd) -> Option<OwnedFd> {
        // SAFETY: F_GETFD only asks whether `fd` is open.
        if fd < 3 || unsafe { fcntl(fd, F_GETFD) } < 0 {
            return None;
        }
        // SAFETY: `fd` is open, and nothing else in this process owns it: it was
        // inherited and is taken once, at start.
        Some(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Points stdin, stdout and stderr at `/dev/null`.
    pub fn stdio_to_null() -> io::Result<()> {
        let null = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null")?;
        for fd in 0..3 {
            // SAFETY: both are open descriptors; dup2 replaces `fd` atomically.
            check(unsafe { dup2(null.as_raw_fd(), fd) })?;
        }
        Ok(())
    }

    /// Blocks SIGCHLD and returns a (non-blocking) descriptor that becomes readable
    /// when it is pending. Children started through std get an empty signal mask.
    pub fn sigchld_fd() -> io::Result<OwnedFd> {
        let mut set = SigSet([0; 16]);
        set.0[0] = 1 << (SIGCHLD - 1);
        // SAFETY: `set` is a valid sigset_t that outlives the call; no old set is asked.
        check(unsafe { sigprocmask(SIG_BLOCK, &set, std::ptr::null_mut()) })?;
        // SAFETY: as above; -1 asks for a new descriptor.
        let fd = check(unsafe { signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC) })?;
        // SAFETY: a new descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Reaps one exited child without blocking: its pid and wait status; `None` while
    /// children live but none exited; `Err` (ECHILD) with no child at all.
    pub fn reap_any() -> io::Result<Option<(i32, i32)>> {
        let mut status: c_int = 0;
        // SAFETY: `status` is a writable int that outlives the call.
        let r = check(unsafe { waitpid(-1, &mut status, WNOHANG) })?;
        Ok((r > 0).then_some((r, status)))
    }

    /// A pidfd of `pid` (ENOSYS before Linux 5.3).
    pub fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
        // SAFETY: pidfd_open takes a pid and flags, both plain integers.
        let r = unsafe { syscall(SYS_PIDFD_OPEN, pid as c_long, 0 as c_long) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a new descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(r as RawFd) })
    }

    /// Sends `sig` to the process of a pidfd; true if it was sent.
    pub fn pidfd_signal(fd: &OwnedFd, sig: i32) -> bool {
        let none: c_long = 0;
        // SAFETY: a live pidfd, a signal number, a null siginfo and no flags.
        unsafe {
            syscall(
                SYS_PIDFD_SEND_SIGNAL,
                fd.as_raw_fd() as c_long,
                sig as c_long,
                none,
                none,
            ) == 0
        }
    }

    /// Open for writing only.
    pub const O_WRONLY: c_int = 0o1;
    /// Create the file ...
    pub const O_CREAT: c_int = 0o100;
    /// ... and fail if it exists.
    pub const O_EXCL: c_int = 0o200;
    /// Fail unless a directory.
    #[cfg(any(target_arch = "aarch64", target_arch = "arm"))]
    pub const O_DIRECTORY: c_int = 0o40000;
    /// Fail (or, with `O_PATH`, open the link itself) if the last component is a
    /// symbolic link.
    #[cfg(any(target_arch = "aarch64", target_arch = "arm"))]
    pub const O_NOFOLLOW: c_int = 0o100000;
    /// See the other architectures' value.
    #[cfg(not(any(target_arch = "aarch64", target_arch = "arm")))]
    pub const O_DIRECTORY: c_int = 0o200000;
    /// See the other architectures' value.
    #[cfg(not(any(target_arch = "aarch64", target_arch = "arm")))]
    pub const O_NOFOLLOW: c_int = 0o400000;
    /// Close on exec.
    pub const O_CLOEXEC: c_int = 0o2000000;
    /// A handle that names a file without opening it for reading or writing.
    pub const O_PATH: c_int = 0o10000000;
    /// Non-blocking open (a fifo, a device).
    pub const O_NONBLOCK_OPEN: c_int = O_NONBLOCK;
    const AT_FDCWD: c_int = -100;
    const AT_SYMLINK_NOFOLLOW: c_int = 0x100;

    unsafe extern "C" {
        #[link_name = "openat"]
        fn c_openat(dir: c_int, path: *const c_char, flags: c_int, ...) -> c_int;
        #[link_name = "mkdirat"]
        fn c_mkdirat(dir: c_int, path: *const c_char, mode: c_uint) -> c_int;
        #[link_name = "symlinkat"]
        fn c_symlinkat(target: *const c_char, dir: c_int, path: *const c_char) -> c_int;
        #[link_name = "renameat"]
        fn c_renameat(
            from_dir: c_int,
            from: *const c_char,
            to_dir: c_int,
            to: *const c_char,
        ) -> c_int;
        #[link_name = "unlinkat"]
        fn c_unlinkat(dir: c_int, path: *const c_char, flags: c_int) -> c_int;
        #[link_name = "readlinkat"]
        fn c_readlinkat(dir: c_int, path: *const c_char, buf: *mut c_char, size: usize) -> isize;
        #[link_name = "fchownat"]
        fn c_fchownat(
            dir: c_int,
            path: *const c_char,
            uid: c_uint,
            gid: c_uint,
            flags: c_int,
        ) -> c_int;
    }

    fn dir_fd(dir: Option<BorrowedFd<'_>>) -> c_int {
        dir.map_or(AT_FDCWD, |d| d.as_raw_fd())
    }

    /// `openat(2)`: `name` relative to `dir` (the working directory if `None`).
    pub fn openat(
        dir: Option<BorrowedFd<'_>>,
        name: &CStr,
        flags: c_int,
        mode: u32,
    ) -> io::Result<OwnedFd> {
        // SAFETY: a NUL-terminated name that outlives the call; integer arguments.
        let fd = check(unsafe { c_openat(dir_fd(dir), name.as_ptr(), flags, mode as c_uint) })?;
        // SAFETY: a new descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// `mkdirat(2)`.
    pub fn mkdirat(dir: BorrowedFd<'_>, name: &CStr, mode: u32) -> io::Result<()> {
        // SAFETY: a NUL-terminated name that outlives the call; integer arguments.
        check(unsafe { c_mkdirat(dir.as_raw_fd(), name.as_ptr(), mode) }).map(drop)
    }

    /// `symlinkat(2)`: a link `name` in `dir` that points to `target`.
    pub fn symlinkat(target: &CStr, dir: BorrowedFd<'_>, name: &CStr) -> io::Result<()> {
        // SAFETY: NUL-terminated strings that outlive the call.
        check(unsafe { c_symlinkat(target.as_ptr(), dir.as_raw_fd(), name.as_ptr()) }).map(drop)
    }

    /// `renameat(2)` within one directory.
    pub fn renameat(dir: BorrowedFd<'_>, from: &CStr, to: &CStr) -> io::Result<()> {
        let d = dir.as_raw_fd();
        // SAFETY: NUL-terminated names that outlive the call.
        check(unsafe { c_renameat(d, from.as_ptr(), d, to.as_ptr()) }).map(drop)
    }

    /// `unlinkat(2)` of a non-directory.
    pub fn unlinkat(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<()> {
        // SAFETY: a NUL-terminated name that outlives the call.
        check(unsafe { c_unlinkat(dir.as_raw_fd(), name.as_ptr(), 0) }).map(drop)
    }

    /// The target of the symbolic link that `link` (opened `O_PATH | O_NOFOLLOW`) is.
    pub fn readlink_fd(link: BorrowedFd<'_>) -> io::Result<Vec<u8>> {
        let mut buf = vec![0u8; 4096];
        // SAFETY: an empty NUL-terminated name (the descriptor itself) and a writable
        // buffer of the given size, both outliving the call.
        let n = unsafe {
            c_readlinkat(
                link.as_raw_fd(),
                c"".as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        buf.truncate(n as usize);
        Ok(buf)
    }

    /// `fchownat(2)` of `name` in `dir` itself, never what it points to.
    pub fn lchownat(dir: BorrowedFd<'_>, name: &CStr, uid: u32, gid: u32) -> io::Result<()> {
        // SAFETY: a NUL-terminated name that outlives the call; integer arguments.
        check(unsafe {
            c_fchownat(
                dir.as_raw_fd(),
                name.as_ptr(),
                uid,
                gid,
                AT_SYMLINK_NOFOLLOW,
            )
        })
        .map(drop)
    }

    /// Runs in the forked child: supplementary groups, gid, uid, in that order, then the
    /// working directory as that user.
    fn become_user(uid: u32, gid: u32, groups: &[u32], cwd: Option<&CStr>) -> io::Result<()> {
        // SAFETY: pointer and length come from a live slice allocated before the fork.
        check(unsafe { setgroups(groups.len(), groups.as_ptr()) })?;
        // SAFETY: plain integer argument.
        check(unsafe { setgid(gid) })?;
        // SAFETY: plain integer argument.
        check(unsafe { setuid(uid) })?;
        if let Some(dir) = cwd {
            // SAFETY: a NUL-terminated path allocated before the fork.
            check(unsafe { chdir(dir.as_ptr()) })?;
        }
        Ok(())
    }

    /// Makes `cmd` switch to the user in the child, before exec, and only then enter `cwd`
    /// (std would enter it first, as root: a link the user swapped in would be followed
    /// with root's rights).
    pub fn switch_user(
        cmd: &mut Command,
        uid: u32,
        gid: u32,
        groups: Vec<u32>,
        cwd: Option<CString>,
    ) {
        // SAFETY: the closure runs in the forked child before exec. It only calls
        // async-signal-safe functions (setgroups, setgid, setuid, chdir, errno) and reads
        // `groups` and `cwd`, allocated before the fork; it allocates and locks nothing.
        unsafe {
            cmd.pre_exec(move || become_user(uid, gid, &groups, cwd.as_deref()));
        }
    }
}

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
    Conn {
        h,
        files: HashMap::new(),
    }
    .run()
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
    /// The run's environment, without an inherited `SANDBOX_EXEC_ID`.
    base_env: Vec<(OsString, OsString)>,
    /// Execs and their shepherds.
    reg: Mutex<Registry>,
    /// Signalled on every spawn (the reaper waits for one).
    reg_cv: Condvar,
}

/// The execs the helper knows.
#[derive(Default)]
struct Registry {
    /// By id, until forgotten: once its `EXIT` was sent and its shepherd exited (no
    /// process of it is left), or at once when its spawn failed.
    execs: HashMap<u32, Arc<Exec>>,
    /// Shepherds not reaped yet: pid → exec id.
    shepherds: HashMap<i32, u32>,
    /// Bumped on every spawn.
    spawned: u64,
}

/// A live exec.
struct Exec {
    id: u32,
    /// Its shepherd (the session leader of the exec's processes).
    shepherd: i32,
    /// The helper's end of the shepherd's control channel, for kill orders (the output
    /// thread reads a clone of it).
    ctl: Mutex<UnixStream>,
    /// Output credit.
    flow: Flow,
    st: Mutex<ExecState>,
    /// Signalled on any change of `st`.
    cv: Condvar,
    /// Written once the command's status is known, to wake the output thread's poll.
    wake: io::PipeWriter,
}

/// The mutable part of an exec.
#[derive(Default)]
struct ExecState {
    /// Wait status of the command, once its shepherd reported it.
    status: Option<i32>,
    /// Wait status of the shepherd, once reaped: none of the exec's processes is left.
    shepherd_status: Option<i32>,
    /// `STARTED` was sent: the threads may send frames.
    started: bool,
    /// `EXIT` was sent (or the spawn was abandoned): no more frames.
    done: bool,
    /// Stdin is a pipe (else `/dev/null`).
    piped: bool,
    /// `STDIN` data not written yet, and its size.
    queue: VecDeque<Vec<u8>>,
    queued: usize,
    /// `STDIN_EOF` received.
    eof: bool,
}

impl Exec {
    /// The command's status is known: record it and wake the output thread.
    fn reaped(&self, status: i32) {
        lock(&self.st).status = Some(status);
        self.cv.notify_all();
        let _ = (&self.wake).write(&[1]);
    }

    /// The command's wait status, once known.
    fn status(&self) -> Option<i32> {
        lock(&self.st).status
    }

    /// Orders the shepherd to kill the exec's processes (errors mean it is gone).
    fn order_kill(&self, immediate: bool) {
        let _ = lock(&self.ctl).write_all(&shepherd::kill_frame(immediate));
    }

    /// Waits until the shepherd was reaped, at most until `deadline`; true if it was.
    fn wait_shepherd(&self, deadline: Instant) -> bool {
        let mut st = lock(&self.st);
        while st.shepherd_status.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            st = self
                .cv
                .wait_timeout(st, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        true
    }

    /// `EXIT` was sent (or the spawn abandoned).
    fn is_done(&self) -> bool {
        lock(&self.st).done
    }

    /// Waits for `STARTED`; false if the exec was abandoned.
    fn wait_started(&self) -> bool {
        let mut st = lock(&self.st);
        while !st.started && !st.done {
            st = wait(&self.cv, st);
        }
        !st.done
    }
}

/// Output credit of an exec or a `GET`, and whether the host still reads it.
struct Flow {
    st: Mutex<FlowState>,
    cv: Condvar,
    /// A `GET` is over.
    finished: AtomicBool,
}

/// The mutable part of a [`Flow`].
struct FlowState {
    /// Payload bytes (`STDOUT`, `STDERR`, `ENTRY`) the helper may still send.
    credit: u64,
    /// `DISCARD` (or `KILL`): nothing more is sent under this flow.
    discarded: bool,
}

impl Flow {
    /// [`INITIAL_CREDIT`] to start with.
    fn new() -> Flow {
        Flow {
            st: Mutex::new(FlowState {
                credit: u64::from(INITIAL_CREDIT),
                discarded: false,
            }),
            cv: Condvar::new(),
            finished: AtomicBool::new(false),
        }
    }

    /// A `CREDIT` from the host.
    fn grant(&self, n: u32) {
        let mut st = lock(&self.st);
        st.credit = st.credit.saturating_add(u64::from(n));
        self.cv.notify_all();
    }

    /// `DISCARD`: wakes whoever waits for credit; nothing is sent under the flow any more.
    fn discard(&self) {
        lock(&self.st).discarded = true;
        self.cv.notify_all();
    }

    /// Blocks until at least `n` bytes of credit are left: the credit, or `None` once the
    /// flow is discarded.
    fn wait_credit(&self, n: u64) -> Option<u64> {
        let mut st = lock(&self.st);
        while !st.discarded && st.credit < n {
            st = wait(&self.cv, st);
        }
        (!st.discarded).then_some(st.credit)
    }

    /// Queues `frame` once `cost` bytes of credit are left and takes them; false (and
    /// nothing queued) once the flow is discarded. Checked and queued under the flow's
    /// lock: after [`Flow::discard`] returns, no frame of the flow is queued any more.
    fn send(&self, h: &Helper, frame: Vec<u8>, cost: u64) -> bool {
        let mut st = lock(&self.st);
        while !st.discarded && st.credit < cost {
            st = wait(&self.cv, st);
        }
        if st.discarded {
            return false;
        }
        st.credit -= cost;
        h.send(frame);
        true
    }
}

/// A process as `/proc/<pid>/stat` shows it.
#[derive(Debug, Clone, Copy)]
struct Proc {
    pid: i32,
    ppid: i32,
    sid: i32,
    /// Start time, clock ticks since boot (field 22): tells a reused pid apart.
    start: u64,
    zombie: bool,
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
    it.next()?; // pgrp
    let sid = num(it.next())? as i32;
    let start = num(it.nth(15))? as u64;
    Some(Proc {
        pid,
        ppid,
        sid,
        start,
        zombie: state == b'Z' || state == b'X',
    })
}

/// Reads one process (`buf` is scratch space).
fn read_stat(pid: i32, buf: &mut Vec<u8>) -> Option<Proc> {
    buf.clear();
    let mut f = File::open(format!("/proc/{pid}/stat")).ok()?;
    f.read_to_end(buf).ok()?;
    parse_stat(pid, buf)
}

/// Every process in `/proc`.
fn scan() -> Vec<Proc> {
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
            .filter(|(k, _)| k.as_bytes() != EXEC_ID_VAR)
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
                    while q.frames.is_empty() {
                        q = wait(&self.out_cv, q);
                    }
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

    /// An exec not forgotten yet.
    fn exec(&self, id: u32) -> Option<Arc<Exec>> {
        lock(&self.reg).execs.get(&id).cloned()
    }

    // ---- spawn -------------------------------------------------------------------------

    /// Spawns an exec (its shepherd, which starts the command) and its threads;
    /// `STARTED` is sent here.
    fn start_exec(&'static self, id: u32, sp: &Spawn) -> Result<(), (SpawnError, String)> {
        let plan = self.plan(sp)?;
        let order = shepherd::plan_frame(
            &plan.program,
            &sp.argv,
            &plan.env,
            plan.cwd.as_deref(),
            plan.switch.as_ref(),
        );
        drop(plan);
        let res = |e: io::Error| (spawn_error_kind(&e, false), e.to_string());
        let (mine, theirs) = UnixStream::pair().map_err(res)?;
        let (wake_r, wake_w) = io::pipe().map_err(res)?;
        let mut cmd = Command::new("/proc/self/exe");
        cmd.arg0(shepherd::NAME)
            .arg(shepherd::MODE_ARG)
            .arg(theirs.as_raw_fd().to_string())
            .env_clear()
            .stdin(if sp.stdin_piped {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let ctl = mine.try_clone().map_err(res)?;
        let (ex, mut child) = {
            // The registry stays locked from the spawn to the shepherd's registration, so
            // the reaper cannot reap it (or a child std waits for itself) before; and no
            // other spawn runs while the shepherd's end of the channel is inheritable.
            let mut r = lock(&self.reg);
            if self.stopping.load(Ordering::SeqCst) {
                return Err((SpawnError::Other, "the helper is exiting".into()));
            }
            sys::set_cloexec(theirs.as_raw_fd(), false).map_err(res)?;
            let spawned = cmd.spawn();
            drop(theirs);
            let child = spawned.map_err(|e| {
                (
                    spawn_error_kind(&e, false),
                    format!("cannot start the exec's shepherd: {e}"),
                )
            })?;
            let pid = child.id() as i32;
            let ex = Arc::new(Exec {
                id,
                shepherd: pid,
                ctl: Mutex::new(ctl),
                flow: Flow::new(),
                st: Mutex::new(ExecState {
                    piped: sp.stdin_piped,
                    ..ExecState::default()
                }),
                cv: Condvar::new(),
                wake: wake_w,
            });
            r.execs.insert(id, ex.clone());
            r.shepherds.insert(pid, id);
            r.spawned += 1;
            self.reg_cv.notify_all();
            (ex, child)
        };
        let stdin = child.stdin.take().map(|p| File::from(OwnedFd::from(p)));
        let pipes = [
            child.stdout.take().map(|p| File::from(OwnedFd::from(p))),
            child.stderr.take().map(|p| File::from(OwnedFd::from(p))),
        ];
        drop(child); // Never waited on: the reaper owns waiting.
        let mut reader = mine;
        let answer = reader
            .set_write_timeout(Some(SHEPHERD_ANSWER))
            .and_then(|()| reader.set_read_timeout(Some(SHEPHERD_ANSWER)))
            .and_then(|()| reader.write_all(&order))
            .and_then(|()| shepherd::read_frame(&mut reader));
        drop(order);
        let abandon = |kind: SpawnError, msg: String| {
            lock(&ex.st).done = true;
            ex.cv.notify_all();
            ex.order_kill(true);
            lock(&self.reg).execs.remove(&id);
            Err((kind, msg))
        };
        let root = match answer {
            Ok(Some((shepherd::STARTED, p))) if p.len() == 4 => {
                u32::from_le_bytes([p[0], p[1], p[2], p[3]])
            }
            Ok(Some((shepherd::FAILED, p))) => {
                let mut d = Dec::new(&p);
                let kind = d.u8().map_or(SpawnError::Other, SpawnError::from_u8);
                let msg = String::from_utf8_lossy(d.bytes().unwrap_or_default()).into_owned();
                return abandon(kind, msg);
            }
            Ok(_) => return abandon(SpawnError::Other, "the exec's shepherd failed".into()),
            Err(e) => {
                let msg = format!("the exec's shepherd did not answer: {e}");
                return abandon(SpawnError::Other, msg);
            }
        };
        let _ = reader.set_read_timeout(None);
        let _ = lock(&ex.ctl).set_write_timeout(Some(Duration::from_secs(1)));
        let h = self;
        let ex_out = ex.clone();
        let mut ok = start_thread("output", move || {
            h.output_thread(&ex_out, pipes, wake_r, reader)
        });
        if ok && let Some(p) = stdin {
            let ex_in = ex.clone();
            ok = start_thread("stdin", move || h.stdin_thread(&ex_in, p));
        }
        if !ok {
            return abandon(SpawnError::Resources, "cannot start a thread".into());
        }
        {
            let mut st = lock(&ex.st);
            self.send_u32(STARTED, id, root);
            st.started = true;
        }
        ex.cv.notify_all();
        Ok(())
    }

    /// Resolves user, environment, working directory and program of a `SPAWN`.
    fn plan(&self, sp: &Spawn) -> Result<Plan, (SpawnError, String)> {
        let Some(prog) = sp.argv.first() else {
            return Err((SpawnError::Other, "empty argv".into()));
        };
        if prog.is_empty() {
            return Err((SpawnError::NotFound, "empty program name".into()));
        }
        let creds = match &sp.user {
            Some(u) => Some(resolve_user(u)?),
            None => None,
        };
        let switch = match &creds {
            Some(c) if self.root => Some(c.clone()),
            Some(c) if c.uid == self.uid && c.gid == self.gid => None,
            Some(c) => {
                return Err((
                    SpawnError::UserDenied,
                    format!(
                        "the helper runs as {}:{} and cannot switch to {}:{}",
                        self.uid, self.gid, c.uid, c.gid
                    ),
                ));
            }
            None => None,
        };

        let mut env = self.base_env.clone();
        let mut home_set = false;
        for (k, v) in &sp.env {
            home_set |= k.as_slice() == b"HOME";
            set_env(&mut env, k, v);
        }
        if let (Some(c), false) = (&creds, home_set) {
            set_env(&mut env, b"HOME", &c.home);
        }

        let dir = match &sp.working_dir {
            Some(d) => self.cwd.join(OsStr::from_bytes(d)),
            None => self.cwd.clone(),
        };
        let mut cwd = None;
        if sp.working_dir.is_some() || switch.is_some() {
            let shown = dir.display();
            let m = fs::metadata(&dir).map_err(|e| {
                let kind = match e.raw_os_error() {
                    Some(ENOENT | ENOTDIR) => SpawnError::WorkingDirMissing,
                    Some(EACCES | EPERM) => SpawnError::WorkingDirDenied,
                    _ => SpawnError::Other,
                };
                (kind, format!("working directory {shown}: {e}"))
            })?;
            if !m.is_dir() {
                return Err((
                    SpawnError::WorkingDirMissing,
                    format!("working directory {shown}: not a directory"),
                ));
            }
            let enterable = match &switch {
                Some(c) => can_search_as(&dir, c),
                None => sys::can_execute(&dir),
            };
            if !enterable {
                return Err((
                    SpawnError::WorkingDirDenied,
                    format!("working directory {shown}: permission denied"),
                ));
            }
            if self.cwd_id != Some((m.dev(), m.ino())) {
                cwd = Some(dir.clone());
            }
        }

        // The program is resolved here, so std takes its posix_spawn path (it falls back to
        // fork+exec for a bare name with a PATH of its own) and PATH is the exec's.
        let program = if prog.contains(&b'/') {
            dir.join(OsStr::from_bytes(prog))
        } else {
            let path = env
                .iter()
                .find(|(k, _)| k.as_bytes() == b"PATH")
                .map(|(_, v)| v.as_bytes());
            find_program(prog, path, &dir, switch.as_ref())?
        };
        Ok(Plan {
            program,
            env,
            cwd,
            switch,
        })
    }

    // ---- exec threads ------------------------------------------------------------------

    /// Reads the exec's stdout and stderr under the credit rule (once the host discarded
    /// the exec: without credit, dropping the data) and the command's status from the
    /// shepherd's channel `ctl`, then sends `EXIT`.
    fn output_thread(
        &'static self,
        ex: &Exec,
        mut pipes: [Option<File>; 2],
        wake: io::PipeReader,
        mut ctl: UnixStream,
    ) {
        const KINDS: [u8; 2] = [STDOUT, STDERR];
        if !ex.wait_started() {
            return;
        }
        let mut wake = File::from(OwnedFd::from(wake));
        let mut ctl_open = true;
        let mut inbox = Vec::new();
        let mut buf = vec![0u8; HEADER + CHUNK];
        let mut reaped = false;
        // Once the root is reaped: what is still buffered in each pipe, the rest is dropped.
        let mut budget = [usize::MAX; 2];
        loop {
            if !reaped && ex.status().is_some() {
                reaped = true;
                for (i, p) in pipes.iter().enumerate() {
                    if let Some(f) = p {
                        budget[i] = sys::readable_bytes(f.as_raw_fd());
                    }
                }
            }
            if reaped {
                for (i, p) in pipes.iter_mut().enumerate() {
                    if budget[i] == 0 {
                        *p = None;
                    }
                }
            }
            if pipes.iter().all(Option::is_none) {
                break;
            }
            let mut fds = [sys::PollFd::default(); 4];
            let mut slots = [usize::MAX; 4];
            let mut n = 0;
            for (i, p) in pipes.iter().enumerate() {
                if let Some(f) = p {
                    fds[n] = sys::PollFd {
                        fd: f.as_raw_fd(),
                        events: sys::POLLIN,
                        revents: 0,
                    };
                    slots[n] = i;
                    n += 1;
                }
            }
            let wake_slot = (!reaped).then(|| {
                fds[n] = sys::PollFd {
                    fd: wake.as_raw_fd(),
                    events: sys::POLLIN,
                    revents: 0,
                };
                n += 1;
                n - 1
            });
            let ctl_slot = (!reaped && ctl_open).then(|| {
                fds[n] = sys::PollFd {
                    fd: ctl.as_raw_fd(),
                    events: sys::POLLIN,
                    revents: 0,
                };
                n += 1;
                n - 1
            });
            match sys::poll_fds(&mut fds[..n], if reaped { 0 } else { -1 }) {
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => {
                    thread::sleep(Duration::from_millis(20));
                    continue;
                }
            }
            let mut progress = false;
            for (k, fd) in fds[..n].iter().enumerate() {
                if Some(k) == wake_slot {
                    if fd.revents != 0 {
                        let mut b = [0u8; 16];
                        let _ = wake.read(&mut b);
                    }
                    continue;
                }
                if Some(k) == ctl_slot {
                    if fd.revents != 0 {
                        ctl_open = self.read_shepherd(ex, &mut ctl, &mut inbox);
                    }
                    continue;
                }
                let i = slots[k];
                if fd.revents & sys::POLLIN != 0 {
                    progress = true;
                    // None: discarded, the data is read and dropped.
                    let credit = ex.flow.wait_credit(1);
                    let want = (CHUNK as u64)
                        .min(credit.unwrap_or(u64::MAX))
                        .min(budget[i] as u64) as usize;
                    let Some(f) = pipes[i].as_mut() else { continue };
                    match f.read(&mut buf[HEADER..HEADER + want]) {
                        Ok(0) => pipes[i] = None,
                        Ok(m) => {
                            if credit.is_some() {
                                let frame = data_frame(&mut buf, KINDS[i], ex.id, m);
                                // Within the credit: never waits (only this thread takes).
                                ex.flow.send(self, frame, m as u64);
                            }
                            if reaped {
                                budget[i] = budget[i].saturating_sub(m);
                            }
                        }
                        Err(e)
                            if matches!(
                                e.kind(),
                                ErrorKind::Interrupted | ErrorKind::WouldBlock
                            ) => {}
                        Err(_) => pipes[i] = None,
                    }
                } else if fd.revents & (sys::POLLHUP | sys::POLLERR | sys::POLLNVAL) != 0 {
                    progress = true;
                    pipes[i] = None;
                }
            }
            if reaped && !progress {
                // Nothing buffered any more; a background process holds the pipe: stop.
                pipes = [None, None];
            }
        }
        // The pipes ended first: the status is still to come from the shepherd.
        while ctl_open && ex.status().is_none() {
            ctl_open = self.read_shepherd(ex, &mut ctl, &mut inbox);
        }
        let mut st = lock(&ex.st);
        while st.status.is_none() {
            st = wait(&ex.cv, st);
        }
        let status = st.status.unwrap_or(0);
        let (kind, value) = if status & 0x7f == 0 {
            (EXITED, (status >> 8) & 0xff)
        } else {
            (SIGNALED, status & 0x7f)
        };
        let mut e = Enc::frame(EXIT, ex.id);
        e.u8(kind).u32(value as u32);
        st.done = true;
        self.send(e.finish());
        drop(st);
        ex.cv.notify_all();
        self.exec_finished(ex.id);
    }

    /// Feeds the exec's stdin from its queue, acknowledging what was written or dropped.
    fn stdin_thread(&'static self, ex: &Exec, pipe: File) {
        let _ = sys::set_nonblocking(pipe.as_raw_fd());
        if !ex.wait_started() {
            return;
        }
        let mut broken = false;
        loop {
            let chunk = {
                let mut st = lock(&ex.st);
                loop {
                    if st.done {
                        return;
                    }
                    if let Some(c) = st.queue.pop_front() {
                        break c;
                    }
                    if st.eof {
                        return; // Closes the pipe: the process sees EOF.
                    }
                    st = wait(&ex.cv, st);
                }
            };
            if !broken {
                match write_nonblocking(ex, &pipe, &chunk) {
                    Written::All => {}
                    Written::Broken => broken = true,
                    Written::Done => return,
                }
            }
            let mut st = lock(&ex.st);
            if st.done {
                return;
            }
            st.queued = st.queued.saturating_sub(chunk.len());
            self.send_u32(STDIN_ACK, ex.id, chunk.len() as u32);
        }
    }

    /// Reads the exec's shepherd's channel: the command's status. False once it ended;
    /// when it ended without a status the shepherd was killed (only root or the
    /// helper's own user can), and [`Helper::shepherd_lost`] gives the exec an end.
    fn read_shepherd(&self, ex: &Exec, ctl: &mut UnixStream, inbox: &mut Vec<u8>) -> bool {
        let mut buf = [0u8; 256];
        let open = match ctl.read(&mut buf) {
            Ok(0) => false,
            Ok(n) => {
                inbox.extend_from_slice(&buf[..n]);
                true
            }
            Err(e) => e.kind() == ErrorKind::Interrupted || e.kind() == ErrorKind::WouldBlock,
        };
        for (kind, p) in shepherd::split_frames(inbox) {
            if kind == shepherd::STATUS && p.len() == 4 {
                ex.reaped(i32::from_le_bytes([p[0], p[1], p[2], p[3]]));
            }
        }
        if !open && ex.status().is_none() {
            self.shepherd_lost(ex);
        }
        open
    }

    /// The shepherd died before it sent the command's status (killed from inside the
    /// sandbox): the exec ends as killed by the signal that killed its shepherd (SIGKILL
    /// if it exited), and the processes still in its session, now re-parented to the
    /// helper, are killed. (One that left the session is beyond reach: only root or the
    /// helper's own user can do this, and either could kill it directly anyway.)
    fn shepherd_lost(&self, ex: &Exec) {
        ex.wait_shepherd(Instant::now() + Duration::from_secs(5));
        let ws = lock(&ex.st).shepherd_status.unwrap_or(sys::SIGKILL);
        let status = if ws & 0x7f != 0 && ws & 0x7f != 0x7f {
            ws & 0x7f
        } else {
            sys::SIGKILL
        };
        diag(format_args!(
            "exec {}: its shepherd {} died (wait status {ws:#x})",
            ex.id, ex.shepherd
        ));
        for _ in 0..10 {
            let left: Vec<Proc> = scan()
                .into_iter()
                .filter(|p| p.sid == ex.shepherd && p.pid != self.pid && !p.zombie)
                .collect();
            if left.is_empty() {
                break;
            }
            for p in left {
                shepherd::signal_checked(p.pid, p.start, sys::SIGKILL);
            }
            thread::sleep(Duration::from_millis(20));
        }
        ex.reaped(status);
    }

    /// After `EXIT`: forget the exec unless its shepherd (so some process of it) lives.
    fn exec_finished(&self, id: u32) {
        let mut r = lock(&self.reg);
        if r.execs
            .get(&id)
            .is_some_and(|ex| lock(&ex.st).shepherd_status.is_some())
        {
            r.execs.remove(&id);
        }
    }

    // ---- reaping and tracking ----------------------------------------------------------

    /// Waits for every child: shepherds are marked gone on their exec, anything else (an
    /// orphan of a shepherd that was killed) is just reaped.
    fn reaper(&'static self) {
        loop {
            let generation = lock(&self.reg).spawned;
            match sys::wait_exited() {
                Ok(pid) => self.reap(pid),
                Err(e) if e.raw_os_error() == Some(ECHILD) => {
                    let mut r = lock(&self.reg);
                    while r.spawned == generation {
                        r = wait(&self.reg_cv, r);
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    /// Reaps one exited child. A shepherd's exit means none of its exec's processes is
    /// left: its exec is forgotten if its `EXIT` went out, and a kill waiting for it ends.
    fn reap(&self, pid: i32) {
        let mut r = lock(&self.reg);
        // Under the lock: a spawn in progress finishes (and registers its shepherd) first,
        // and a child std reaped itself (failed exec) is simply gone.
        let Ok(Some(status)) = sys::reap(pid) else {
            return;
        };
        let Some(id) = r.shepherds.remove(&pid) else {
            return;
        };
        let Some(ex) = r.execs.get(&id).cloned() else {
            return;
        };
        let done = {
            let mut st = lock(&ex.st);
            st.shepherd_status = Some(status);
            st.done
        };
        ex.cv.notify_all();
        if done {
            r.execs.remove(&id);
        }
    }

    // ---- kill --------------------------------------------------------------------------

    /// `KILL`: the exec's shepherd kills its processes (stop, TERM + CONT, grace, KILL)
    /// and exits once none is left; then `KILLED`.
    fn kill_exec(&'static self, id: u32) {
        let mut all_gone = true;
        if let Some(ex) = self.exec(id) {
            // A shepherd stopped from inside (`kill -STOP $PPID`) would never kill: it is
            // this helper's child, so its pid is its own until reaped.
            sys::signal(ex.shepherd, sys::SIGCONT);
            ex.order_kill(false);
            if !ex.wait_shepherd(Instant::now() + KILL_CONFIRM) {
                diag(format_args!(
                    "exec {id}: its processes are not all gone {KILL_CONFIRM:?} after the kill"
                ));
                all_gone = false;
            }
        }
        // Never a kill that did not happen: the host then kills by the exec marker, and
        // reports the exec KillFailed if that fails too.
        let mut f = Enc::frame(KILLED, id);
        f.u8(u8::from(all_gone));
        self.send(f.finish());
    }

    /// Has the shepherd of every exec whose `EXIT` was not sent kill its processes at
    /// once (stdin ended, the stream or the protocol broke), and waits a little for them.
    /// Called with `stopping` set, so no exec starts any more.
    fn kill_live_execs(&self) {
        let live: Vec<Arc<Exec>> = {
            let r = lock(&self.reg);
            r.execs
                .values()
                .filter(|ex| !ex.is_done())
                .cloned()
                .collect()
        };
        for ex in &live {
            ex.order_kill(true);
        }
        let deadline = Instant::now() + SHUTDOWN_KILL;
        for ex in &live {
            ex.wait_shepherd(deadline);
        }
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

/// The resolved parts of a `SPAWN`.
struct Plan {
    program: PathBuf,
    env: Vec<(OsString, OsString)>,
    /// Set only when it differs from the helper's own (keeps std's posix_spawn path).
    cwd: Option<PathBuf>,
    /// The user to switch to in the child (the helper runs as root).
    switch: Option<Creds>,
}

/// How a stdin write ended.
enum Written {
    All,
    /// The process closed its stdin (EPIPE) or another error: drop from now on.
    Broken,
    /// The exec is over.
    Done,
}

/// Writes all of `data` to a non-blocking pipe, waking every 200 ms to notice the end of
/// the exec (a background process may hold the pipe without reading).
fn write_nonblocking(ex: &Exec, pipe: &File, data: &[u8]) -> Written {
    let mut off = 0;
    while off < data.len() {
        match (&*pipe).write(&data[off..]) {
            Ok(0) => return Written::Broken,
            Ok(n) => off += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                let mut fds = [sys::PollFd {
                    fd: pipe.as_raw_fd(),
                    events: sys::POLLOUT,
                    revents: 0,
                }];
                let _ = sys::poll_fds(&mut fds, 200);
                if ex.is_done() {
                    return Written::Done;
                }
            }
            Err(_) => return Written::Broken,
        }
    }
    Written::All
}

/// Sets (or replaces) a variable.
fn set_env(env: &mut Vec<(OsString, OsString)>, k: &[u8], v: &[u8]) {
    let k = OsStr::from_bytes(k);
    let v = OsString::from_vec(v.to_vec());
    match env.iter_mut().find(|(n, _)| n == k) {
        Some(e) => e.1 = v,
        None => env.push((k.to_os_string(), v)),
    }
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

// ---- users -----------------------------------------------------------------------------

/// A resolved per-exec user.
#[derive(Debug, Clone)]
struct Creds {
    uid: u32,
    gid: u32,
    /// Supplementary groups, the primary gid first.
    groups: Vec<u32>,
    home: Vec<u8>,
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
fn resolve_user(spec: &[u8]) -> Result<Creds, (SpawnError, String)> {
    let shown = String::from_utf8_lossy(spec);
    let unknown = |what: &str| (SpawnError::UnknownUser, format!("{what} in user {shown}"));
    let (u, g) = match spec.iter().position(|&b| b == b':') {
        Some(i) => (&spec[..i], Some(&spec[i + 1..])),
        None => (spec, None),
    };
    if u.is_empty() || g.is_some_and(<[u8]>::is_empty) {
        return Err(unknown("empty name"));
    }
    let passwd = read_db("/etc/passwd");
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
    let group = read_db("/etc/group");
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
fn can_search_as(dir: &Path, c: &Creds) -> bool {
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
fn find_program(
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

// ---- the reader loop -------------------------------------------------------------------

use files::{GetEnd, Put};

/// A `PUT` or `GET` in progress.
enum FileOp {
    Put(Put),
    Get(Arc<Flow>),
}

/// The main thread's state: reads frames and dispatches them.
struct Conn {
    h: &'static Helper,
    files: HashMap<u32, FileOp>,
}

impl Conn {
    /// Reads frames until stdin ends or breaks (then the trees of the execs still running
    /// are killed and the helper exits).
    fn run(mut self) -> ! {
        let h = self.h;
        let mut input = match io::stdin().as_fd().try_clone_to_owned() {
            Ok(fd) => File::from(fd),
            Err(_) => h.shutdown(1),
        };
        let mut buf: Vec<u8> = Vec::with_capacity(2 * READ_CHUNK);
        loop {
            let mut start = 0;
            loop {
                match proto::split_frame(&buf[start..]) {
                    Ok(Some((kind, id, payload, len))) => {
                        if let Err(msg) = self.handle(kind, id, payload) {
                            self.protocol_error(&msg);
                        }
                        start += len;
                    }
                    Ok(None) => break,
                    Err(_) => self.protocol_error("frame length out of range"),
                }
            }
            buf.drain(..start);
            if buf.capacity() > 4 * READ_CHUNK && buf.len() < READ_CHUNK {
                buf.shrink_to(2 * READ_CHUNK);
            }
            let old = buf.len();
            buf.resize(old + READ_CHUNK, 0);
            match input.read(&mut buf[old..]) {
                Ok(0) => self.end(0),
                Ok(n) => buf.truncate(old + n),
                Err(e) if e.kind() == ErrorKind::Interrupted => buf.truncate(old),
                Err(_) => self.end(0),
            }
        }
    }

    /// The connection is over: a `PUT` cut short leaves no temporary file, then
    /// [`Helper::shutdown`].
    fn end(&mut self, code: i32) -> ! {
        for (_, op) in self.files.drain() {
            if let FileOp::Put(mut p) = op
                && let Some(pf) = p.file.take()
            {
                pf.abandon();
            }
        }
        self.h.shutdown(code)
    }

    /// `PROTOCOL_ERROR`, kill the trees of the execs still running, exit 2.
    fn protocol_error(&mut self, msg: &str) -> ! {
        diag(format_args!("protocol error: {msg}"));
        self.h.send_protocol_error(msg);
        self.end(2)
    }

    /// Dispatches one frame; `Err` is a protocol error.
    fn handle(&mut self, kind: u8, id: u32, payload: &[u8]) -> Result<(), String> {
        let bad = |e: DecodeError| format!("frame kind {kind}: {e}");
        let mut d = Dec::new(payload);
        match kind {
            SPAWN => {
                let sp = Spawn::decode(&mut d).map_err(bad)?;
                self.spawn(id, &sp);
            }
            STDIN => self.stdin(id, payload)?,
            STDIN_EOF => self.stdin_eof(id),
            CREDIT => {
                let n = d.u32().map_err(bad)?;
                match self.files.get(&id) {
                    Some(FileOp::Get(flow)) => flow.grant(n),
                    _ => {
                        if let Some(ex) = self.h.exec(id) {
                            ex.flow.grant(n);
                        }
                    }
                }
            }
            DISCARD => self.discard(id),
            KILL => self.kill(id),
            PING => self.h.send_empty(PONG, id),
            PUT => {
                let path = d.bytes().map_err(bad)?.to_vec();
                self.put(id, path);
            }
            GET => {
                let path = d.bytes().map_err(bad)?.to_vec();
                self.get(id, path);
            }
            ENTRY => {
                let e = Entry::decode(&mut d).map_err(bad)?;
                self.entry(id, e);
            }
            _ => return Err(format!("unknown frame kind {kind}")),
        }
        Ok(())
    }

    /// Drops finished `GET`s.
    fn sweep(&mut self) {
        self.files
            .retain(|_, op| !matches!(op, FileOp::Get(f) if f.finished.load(Ordering::Acquire)));
    }

    /// Whether an id names a live exec or file operation.
    fn in_use(&self, id: u32) -> bool {
        self.files.contains_key(&id) || self.h.exec(id).is_some()
    }

    /// `SPAWN`.
    fn spawn(&mut self, id: u32, sp: &Spawn) {
        self.sweep();
        if self.in_use(id) {
            self.h
                .send_spawn_error(id, SpawnError::Other, "id already in use");
            return;
        }
        if let Err((kind, msg)) = self.h.start_exec(id, sp) {
            self.h.send_spawn_error(id, kind, &msg);
        }
    }

    /// `STDIN` for a `PUT` or an exec (queued for its stdin thread, never blocking here).
    fn stdin(&mut self, id: u32, data: &[u8]) -> Result<(), String> {
        let h = self.h;
        if let Some(FileOp::Put(p)) = self.files.get_mut(&id) {
            if !p.failed
                && let Err(e) = p.data(h.root, data)
            {
                p.fail(h, id, e);
            }
            h.send_u32(STDIN_ACK, id, data.len() as u32);
            return Ok(());
        }
        let Some(ex) = h.exec(id) else {
            return Ok(()); // Over (after EXIT nothing is sent): dropped.
        };
        let mut st = lock(&ex.st);
        if st.done {
            return Ok(());
        }
        if !st.piped || st.eof {
            h.send_u32(STDIN_ACK, id, data.len() as u32);
            return Ok(());
        }
        st.queued += data.len();
        if st.queued > STDIN_QUEUE_LIMIT {
            return Err(format!("exec {id}: stdin window exceeded"));
        }
        st.queue.push_back(data.to_vec());
        drop(st);
        ex.cv.notify_all();
        Ok(())
    }

    /// `STDIN_EOF`: the end of a `PUT` (`DONE`) or of an exec's stdin.
    fn stdin_eof(&mut self, id: u32) {
        let h = self.h;
        if matches!(self.files.get(&id), Some(FileOp::Put(_)))
            && let Some(FileOp::Put(mut p)) = self.files.remove(&id)
        {
            if p.failed {
                return;
            }
            match p.file.take() {
                Some(pf) => {
                    let rel = pf.rel.clone();
                    pf.abandon();
                    h.send_file_error(id, FileError::Invalid, &rel, "short data");
                }
                None => h.send_empty(DONE, id),
            }
            return;
        }
        if let Some(ex) = h.exec(id) {
            lock(&ex.st).eof = true;
            ex.cv.notify_all();
        }
    }

    /// `DISCARD`: an exec stops sending output (its pipes are drained, its `EXIT` still
    /// follows); a `GET` is abandoned without another frame. Unknown ids are ignored.
    fn discard(&mut self, id: u32) {
        if let Some(FileOp::Get(flow)) = self.files.get(&id) {
            flow.discard();
            self.files.remove(&id);
            return;
        }
        if let Some(ex) = self.h.exec(id) {
            ex.flow.discard();
        }
    }

    /// `KILL` (which implies `DISCARD`), on a thread of its own.
    fn kill(&mut self, id: u32) {
        let h = self.h;
        self.discard(id);
        if h.exec(id).is_none() {
            h.send_empty(KILLED, id);
            return;
        }
        if !start_thread("kill", move || h.kill_exec(id)) {
            h.kill_exec(id);
        }
    }

    /// `PUT`: the base directory must exist.
    fn put(&mut self, id: u32, path: Vec<u8>) {
        self.sweep();
        let h = self.h;
        if self.in_use(id) {
            h.send_file_error(id, FileError::Other, b"", "id already in use");
            return;
        }
        let put = match Put::start(&path) {
            Ok(put) => put,
            Err(failure) => {
                let mut put = Put::failed_with(None);
                put.fail(h, id, failure);
                put
            }
        };
        self.files.insert(id, FileOp::Put(put));
    }

    /// `ENTRY` of a `PUT`.
    fn entry(&mut self, id: u32, e: Entry) {
        let h = self.h;
        let Some(FileOp::Put(p)) = self.files.get_mut(&id) else {
            return;
        };
        if p.failed {
            return;
        }
        let r = match &p.file {
            Some(prev) => Err((FileError::Invalid, prev.rel.clone(), "short data".into())),
            None => p.apply(h.root, e),
        };
        if let Err(err) = r {
            p.fail(h, id, err);
        }
    }

    /// `GET`, on a thread of its own.
    fn get(&mut self, id: u32, path: Vec<u8>) {
        self.sweep();
        let h = self.h;
        if self.in_use(id) {
            h.send_file_error(id, FileError::Other, b"", "id already in use");
            return;
        }
        let flow = Arc::new(Flow::new());
        self.files.insert(id, FileOp::Get(flow.clone()));
        let f = flow.clone();
        let started = start_thread("get", move || {
            // The last frame, unless discarded meanwhile (it costs no credit).
            match files::get_tree(h, id, &path, &f) {
                Ok(()) => {
                    f.send(h, Enc::frame(DONE, id).finish(), 0);
                }
                Err(GetEnd::Failed(kind, rel, msg)) => {
                    f.send(h, file_error_frame(id, kind, &rel, &msg), 0);
                }
                Err(GetEnd::Discarded) => {}
            }
            f.finished.store(true, Ordering::Release);
        });
        if !started {
            self.files.remove(&id);
            h.send_file_error(id, FileError::Other, b"", "cannot start a thread");
        }
    }
}
