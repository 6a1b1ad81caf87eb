//! The few libc calls std lacks, each behind a safe wrapper. The only `unsafe` code.
//!
//! Also the errno values the helper tells apart.

// errno values (x86_64 / generic Linux).
pub(crate) const EPERM: i32 = 1;
pub(crate) const ENOENT: i32 = 2;
pub(crate) const ENOEXEC: i32 = 8;
pub(crate) const ECHILD: i32 = 10;
pub(crate) const EAGAIN: i32 = 11;
pub(crate) const ENOMEM: i32 = 12;
pub(crate) const EACCES: i32 = 13;
pub(crate) const ENOTDIR: i32 = 20;
pub(crate) const EISDIR: i32 = 21;
pub(crate) const EINVAL: i32 = 22;
pub(crate) const ENFILE: i32 = 23;
pub(crate) const EMFILE: i32 = 24;
pub(crate) const ETXTBSY: i32 = 26;
pub(crate) const ENAMETOOLONG: i32 = 36;
pub(crate) const ENOSYS: i32 = 38;
pub(crate) const ELOOP: i32 = 40;

use std::ffi::{CStr, CString};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::raw::{c_char, c_int, c_long, c_short, c_uint, c_ulong};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
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
/// The peer of a stream socket shut its writing down (Linux).
pub const POLLRDHUP: c_short = 0x2000;

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
const PR_GET_CHILD_SUBREAPER: c_int = 37;
const P_ALL: c_int = 0;
const P_PID: c_int = 1;
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

const LOCK_EX: c_int = 2;
const LOCK_NB: c_int = 4;
const SOL_SOCKET: c_int = 1;
const SO_PEERCRED: c_int = 17;

/// `struct ucred`.
#[repr(C)]
#[derive(Default)]
struct UCred {
    pid: c_int,
    uid: c_uint,
    gid: c_uint,
}

/// glibc's `sigset_t` (1024 bits).
#[repr(C)]
struct SigSet([u64; 16]);

unsafe extern "C" {
    fn prctl(option: c_int, arg2: c_ulong, arg3: c_ulong, arg4: c_ulong, arg5: c_ulong) -> c_int;
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
    safe fn flock(fd: c_int, op: c_int) -> c_int;
    fn getsockopt(
        fd: c_int,
        level: c_int,
        name: c_int,
        value: *mut UCred,
        len: *mut c_uint,
    ) -> c_int;
}

#[cfg(target_env = "gnu")]
unsafe extern "C" {
    safe fn mallopt(param: c_int, value: c_int) -> c_int;
    safe fn malloc_trim(pad: usize) -> c_int;
}

/// `mallopt`'s `M_ARENA_MAX` (glibc).
#[cfg(target_env = "gnu")]
const M_ARENA_MAX: c_int = -8;

/// One malloc arena for every thread: the helper's threads come and go with execs, and
/// with an arena per thread (glibc's default, up to 8 per core) each keeps what it once
/// held (5.3 MB of RSS after the benchmark's load, 4.3 MB with one arena); the helper
/// allocates little and rarely, so one arena costs it nothing. musl has one already.
pub fn one_malloc_arena() {
    #[cfg(target_env = "gnu")]
    let _ = mallopt(M_ARENA_MAX, 1);
}

/// Gives the free pages of the malloc heap back to the kernel. glibc keeps what the
/// helper freed (its heap only shrinks from the top): after the benchmark's 10 000 execs
/// the heap held 2 to 3 MB, almost all of it free. musl returns memory by itself.
pub fn release_free_memory() {
    #[cfg(target_env = "gnu")]
    let _ = malloc_trim(0);
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

/// Whether this process is a child subreaper (the helper is; a unit test's is not).
pub fn is_child_subreaper() -> bool {
    let mut on: c_int = 0;
    // SAFETY: PR_GET_CHILD_SUBREAPER writes one int through the pointer, which outlives
    // the call.
    let r = unsafe {
        prctl(
            PR_GET_CHILD_SUBREAPER,
            &mut on as *mut c_int as c_ulong,
            0,
            0,
            0,
        )
    };
    r == 0 && on != 0
}

/// Makes the helper non-dumpable: its `/proc/<pid>` files belong to root and processes
/// of its own uid cannot ptrace it or read its descriptors. Only the helper itself:
/// a child gets dumpable back when it executes a normal program.
pub fn set_not_dumpable() -> io::Result<()> {
    // SAFETY: PR_SET_DUMPABLE takes plain integers and touches no memory of ours.
    check(unsafe { prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) }).map(drop)
}

/// `waitid` without reaping (`WNOWAIT` is always added): the pid of the child it found
/// (0 with `WNOHANG` when none has exited).
fn wait_id(idtype: c_int, id: c_uint, options: c_int) -> io::Result<i32> {
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
    check(unsafe { waitid(idtype, id, &mut info, options | WNOWAIT) })?;
    Ok(info.pid)
}

/// Blocks until some child has exited and returns its pid, leaving it a zombie.
pub fn wait_exited() -> io::Result<i32> {
    wait_id(P_ALL, 0, WEXITED)
}

/// Some child that has exited, without blocking or reaping it: its pid, or `None`.
pub fn exited_now() -> io::Result<Option<i32>> {
    wait_id(P_ALL, 0, WEXITED | WNOHANG).map(|pid| (pid > 0).then_some(pid))
}

/// Whether the child `pid` has exited (a zombie not reaped yet), without reaping it.
pub fn has_exited(pid: i32) -> bool {
    wait_id(P_PID, pid as c_uint, WEXITED | WNOHANG).is_ok_and(|p| p == pid)
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

/// Whether the writer of `fd` (a pipe or a stream socket) is gone or shut its writing
/// down, even with bytes still to read: nothing more will come.
pub fn hung_up(fd: RawFd) -> bool {
    let mut fds = [PollFd {
        fd,
        events: POLLRDHUP,
        revents: 0,
    }];
    poll_fds(&mut fds, 0).is_ok_and(|n| n > 0)
        && fds[0].revents & (POLLRDHUP | POLLHUP | POLLERR) != 0
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

/// Takes an exclusive `flock` on `f` without waiting: true if taken, false if another
/// open file holds it. Released when every descriptor of that open file is closed.
pub fn try_lock_exclusive(f: &File) -> io::Result<bool> {
    match check(flock(f.as_raw_fd(), LOCK_EX | LOCK_NB)) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(EAGAIN) => Ok(false),
        Err(e) => Err(e),
    }
}

/// The process at the other end of a connected unix socket, as the kernel recorded it
/// when the connection was made (`SO_PEERCRED`): pid, uid, gid.
pub fn peer_cred(sock: BorrowedFd<'_>) -> io::Result<(i32, u32, u32)> {
    let mut cred = UCred::default();
    let mut len = std::mem::size_of::<UCred>() as c_uint;
    // SAFETY: `cred` and `len` are writable and outlive the call; `len` is the size of
    // the buffer `cred` is.
    check(unsafe {
        getsockopt(
            sock.as_raw_fd(),
            SOL_SOCKET,
            SO_PEERCRED,
            &mut cred,
            &mut len,
        )
    })?;
    Ok((cred.pid, cred.uid, cred.gid))
}

/// Open for reading only.
pub const O_RDONLY: c_int = 0;
/// Open for reading and writing.
pub const O_RDWR: c_int = 0o2;
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
const AT_EMPTY_PATH: c_int = 0x1000;
const AT_SYMLINK_FOLLOW: c_int = 0x400;
const AT_REMOVEDIR: c_int = 0x200;

unsafe extern "C" {
    #[link_name = "openat"]
    fn c_openat(dir: c_int, path: *const c_char, flags: c_int, ...) -> c_int;
    #[link_name = "mkdirat"]
    fn c_mkdirat(dir: c_int, path: *const c_char, mode: c_uint) -> c_int;
    #[link_name = "symlinkat"]
    fn c_symlinkat(target: *const c_char, dir: c_int, path: *const c_char) -> c_int;
    #[link_name = "renameat"]
    fn c_renameat(from_dir: c_int, from: *const c_char, to_dir: c_int, to: *const c_char) -> c_int;
    #[link_name = "linkat"]
    fn c_linkat(
        from_dir: c_int,
        from: *const c_char,
        to_dir: c_int,
        to: *const c_char,
        flags: c_int,
    ) -> c_int;
    #[link_name = "mkfifoat"]
    fn c_mkfifoat(dir: c_int, path: *const c_char, mode: c_uint) -> c_int;
    #[link_name = "unlinkat"]
    fn c_unlinkat(dir: c_int, path: *const c_char, flags: c_int) -> c_int;
    #[link_name = "readlinkat"]
    fn c_readlinkat(dir: c_int, path: *const c_char, buf: *mut c_char, size: usize) -> isize;
    #[link_name = "fchownat"]
    fn c_fchownat(dir: c_int, path: *const c_char, uid: c_uint, gid: c_uint, flags: c_int)
    -> c_int;
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
    rename_between(dir, from, dir, to)
}

/// `linkat(2)` without `AT_SYMLINK_FOLLOW`: `to` in `to_dir` becomes another name of
/// what `from` in `from_dir` is (a symbolic link there is linked itself, never followed).
pub fn linkat(
    from_dir: BorrowedFd<'_>,
    from: &CStr,
    to_dir: BorrowedFd<'_>,
    to: &CStr,
) -> io::Result<()> {
    link(from_dir.as_raw_fd(), from, to_dir, to, 0)
}

/// `linkat(2)` with `flags`.
fn link(
    from_dir: c_int,
    from: &CStr,
    to_dir: BorrowedFd<'_>,
    to: &CStr,
    flags: c_int,
) -> io::Result<()> {
    // SAFETY: NUL-terminated names that outlive the call; integer arguments.
    check(unsafe {
        c_linkat(
            from_dir,
            from.as_ptr(),
            to_dir.as_raw_fd(),
            to.as_ptr(),
            flags,
        )
    })
    .map(drop)
}

/// `linkat(2)` of the file descriptor `f` names (through `/proc/self/fd`, followed):
/// `to` in `to_dir` becomes another name of that very inode.
pub fn link_fd(f: BorrowedFd<'_>, to_dir: BorrowedFd<'_>, to: &CStr) -> io::Result<()> {
    let from = CString::new(format!("/proc/self/fd/{}", f.as_raw_fd()))
        .map_err(|_| io::Error::from_raw_os_error(EINVAL))?;
    link(AT_FDCWD, &from, to_dir, to, AT_SYMLINK_FOLLOW)
}

/// `mkfifoat(3)`: a named pipe `name` in `dir` (the mode less the umask).
pub fn mkfifoat(dir: BorrowedFd<'_>, name: &CStr, mode: u32) -> io::Result<()> {
    // SAFETY: a NUL-terminated name that outlives the call; integer arguments.
    check(unsafe { c_mkfifoat(dir.as_raw_fd(), name.as_ptr(), mode) }).map(drop)
}

/// `renameat(2)` from one directory to another.
pub fn rename_between(
    from_dir: BorrowedFd<'_>,
    from: &CStr,
    to_dir: BorrowedFd<'_>,
    to: &CStr,
) -> io::Result<()> {
    // SAFETY: NUL-terminated names that outlive the call.
    check(unsafe {
        c_renameat(
            from_dir.as_raw_fd(),
            from.as_ptr(),
            to_dir.as_raw_fd(),
            to.as_ptr(),
        )
    })
    .map(drop)
}

/// `unlinkat(2)` of an (empty) directory.
pub fn rmdirat(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<()> {
    // SAFETY: a NUL-terminated name that outlives the call.
    check(unsafe { c_unlinkat(dir.as_raw_fd(), name.as_ptr(), AT_REMOVEDIR) }).map(drop)
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

/// `fchownat(2)` of what descriptor `f` (`O_PATH` allowed) names itself: a symbolic
/// link's own owner, never what it points to; no name is looked up.
pub fn fchown_fd(f: BorrowedFd<'_>, uid: u32, gid: u32) -> io::Result<()> {
    // SAFETY: an empty NUL-terminated name (the descriptor itself); integer arguments.
    check(unsafe {
        c_fchownat(
            f.as_raw_fd(),
            c"".as_ptr(),
            uid,
            gid,
            AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW,
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

/// `ioctl`s of terminals (asm-generic numbers: x86_64 and aarch64 alike).
const TIOCSPTLCK: c_ulong = 0x4004_5431;
const TIOCGPTN: c_ulong = 0x8004_5430;
const TIOCSWINSZ: c_ulong = 0x5414;
const TIOCSCTTY: c_ulong = 0x540E;
/// `O_NOCTTY` (asm-generic).
const O_NOCTTY: c_int = 0o400;

/// `struct winsize`.
#[repr(C)]
struct WinSize {
    rows: u16,
    cols: u16,
    xpixel: u16,
    ypixel: u16,
}

/// A new pseudo-terminal of `rows` x `cols`: its master (close-on-exec) and the path of
/// its terminal side (`/dev/pts/N`, on the root-owned devpts: no other user can swap
/// it), for the exec's shepherd to open. devpts makes the terminal side 0620, group
/// `tty`, where a user of that group could write into this exec's terminal (and so into
/// its output): it is made 0600 and given to `owner` (the exec's user, when it switches;
/// else it stays the helper's) while still locked, so nobody opened it before.
pub fn open_pty(rows: u16, cols: u16, owner: Option<u32>) -> io::Result<(File, PathBuf)> {
    let master = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(O_NOCTTY)
        .open("/dev/ptmx")?;
    let fd = master.as_raw_fd();
    let mut n: c_uint = 0;
    // SAFETY: TIOCGPTN writes one unsigned int through the pointer.
    check(unsafe { ioctl(fd, TIOCGPTN, &mut n as *mut c_uint) })?;
    let path = PathBuf::from(format!("/dev/pts/{n}"));
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    if let Some(uid) = owner {
        std::os::unix::fs::chown(&path, Some(uid), None)?;
    }
    set_window_size(&master, rows, cols)?;
    let unlock: c_int = 0;
    // SAFETY: TIOCSPTLCK reads one int through the pointer, which outlives the call.
    check(unsafe { ioctl(fd, TIOCSPTLCK, &unlock as *const c_int) })?;
    Ok((master, path))
}

/// Sets a terminal's size (the kernel signals `SIGWINCH` to its foreground group).
pub fn set_window_size(tty: &File, rows: u16, cols: u16) -> io::Result<()> {
    let size = WinSize {
        rows,
        cols,
        xpixel: 0,
        ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one `struct winsize` through the pointer.
    check(unsafe { ioctl(tty.as_raw_fd(), TIOCSWINSZ, &size as *const WinSize) }).map(drop)
}

/// Opens a pseudo-terminal's terminal side without making it the caller's controlling
/// terminal.
pub fn open_tty(path: &Path) -> io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(O_NOCTTY | O_NOFOLLOW)
        .open(path)
}

/// Has the command lead a new session whose controlling terminal is its stdin (a
/// terminal), so that the terminal's signals (Ctrl-C) reach its foreground group.
pub fn lead_session_on_tty(cmd: &mut Command) {
    // SAFETY: the closure runs in the forked child before exec and only makes two
    // async-signal-safe system calls (setsid, ioctl); it allocates and locks nothing.
    unsafe {
        cmd.pre_exec(|| {
            check(setsid())?;
            check(ioctl(0, TIOCSCTTY, 0 as c_ulong)).map(drop)
        });
    }
}

/// Makes `cmd` switch to the user in the child, before exec, and only then enter `cwd`
/// (std would enter it first, as root: a link the user swapped in would be followed
/// with root's rights).
pub fn switch_user(cmd: &mut Command, uid: u32, gid: u32, groups: Vec<u32>, cwd: Option<CString>) {
    // SAFETY: the closure runs in the forked child before exec. It only calls
    // async-signal-safe functions (setgroups, setgid, setuid, chdir, errno) and reads
    // `groups` and `cwd`, allocated before the fork; it allocates and locks nothing.
    unsafe {
        cmd.pre_exec(move || become_user(uid, gid, &groups, cwd.as_deref()));
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::CString;
    use std::fs::{self, File, Permissions};
    use std::io::{ErrorKind, Read, Write};
    use std::os::fd::AsFd;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    use std::os::unix::process::ExitStatusExt;
    use std::process::Command;
    use std::time::{Duration, Instant};

    use super::*;
    use crate::testing::TempDir;

    fn c(s: &str) -> CString {
        CString::new(s).unwrap()
    }

    /// The `flags:` of a descriptor in `/proc/self/fdinfo` (octal).
    fn fd_flags(fd: RawFd) -> u32 {
        let info = fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).unwrap();
        let line = info.lines().find(|l| l.starts_with("flags:")).unwrap();
        u32::from_str_radix(line["flags:".len()..].trim(), 8).unwrap()
    }

    #[test]
    fn errno_values_are_the_kernels() {
        let kind = |e: i32| io::Error::from_raw_os_error(e).kind();
        assert_eq!(kind(EPERM), ErrorKind::PermissionDenied);
        assert_eq!(kind(EACCES), ErrorKind::PermissionDenied);
        assert_eq!(kind(ENOENT), ErrorKind::NotFound);
        assert_eq!(kind(EAGAIN), ErrorKind::WouldBlock);
        assert_eq!(kind(ENOMEM), ErrorKind::OutOfMemory);
        assert_eq!(kind(ENOTDIR), ErrorKind::NotADirectory);
        assert_eq!(kind(EISDIR), ErrorKind::IsADirectory);
        assert_eq!(kind(EINVAL), ErrorKind::InvalidInput);
        assert_eq!(kind(ETXTBSY), ErrorKind::ExecutableFileBusy);
        assert_eq!(kind(ENAMETOOLONG), ErrorKind::InvalidFilename);
        assert_eq!(kind(ENOSYS), ErrorKind::Unsupported);
        // The ones std has no kind for, by the kernel's own message.
        let msg = |e: i32| io::Error::from_raw_os_error(e).to_string();
        assert!(
            msg(ENOEXEC).contains("Exec format error"),
            "{}",
            msg(ENOEXEC)
        );
        assert!(
            msg(ECHILD).contains("No child processes"),
            "{}",
            msg(ECHILD)
        );
        assert!(msg(ENFILE).contains("Too many open files in system"));
        assert!(
            msg(EMFILE).contains("Too many open files"),
            "{}",
            msg(EMFILE)
        );
        assert!(msg(ELOOP).contains("symbolic links"), "{}", msg(ELOOP));
    }

    #[test]
    fn a_writer_gone_or_shut_down_is_a_hang_up_even_with_bytes_to_read() {
        let (r, mut w) = io::pipe().unwrap();
        w.write_all(b"frame").unwrap();
        assert!(!hung_up(r.as_raw_fd()));
        drop(w);
        assert!(hung_up(r.as_raw_fd()));
        let (a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        b.write_all(b"frame").unwrap();
        assert!(!hung_up(a.as_raw_fd()));
        b.shutdown(std::net::Shutdown::Write).unwrap();
        assert!(hung_up(a.as_raw_fd()));
    }

    #[test]
    fn poll_readable_bytes_and_nonblocking_reads_on_a_pipe() {
        let (mut r, mut w) = io::pipe().unwrap();
        let mut fds = [PollFd {
            fd: r.as_raw_fd(),
            events: POLLIN,
            revents: 0,
        }];
        assert_eq!(poll_fds(&mut fds, 0).unwrap(), 0);
        assert_eq!(readable_bytes(r.as_raw_fd()), 0);
        set_nonblocking(r.as_raw_fd()).unwrap();
        let mut buf = [0u8; 16];
        assert_eq!(r.read(&mut buf).unwrap_err().kind(), ErrorKind::WouldBlock);

        w.write_all(b"12345").unwrap();
        assert_eq!(poll_fds(&mut fds, 1000).unwrap(), 1);
        assert_ne!(fds[0].revents & POLLIN, 0);
        assert_eq!(readable_bytes(r.as_raw_fd()), 5);
        assert_eq!(r.read(&mut buf).unwrap(), 5);
        assert_eq!(readable_bytes(r.as_raw_fd()), 0);

        drop(w);
        fds[0].revents = 0;
        assert_eq!(poll_fds(&mut fds, 1000).unwrap(), 1);
        assert_ne!(fds[0].revents & POLLHUP, 0);
        // Room to write on a fresh pipe; an error once its reader is gone.
        let (r2, w2) = io::pipe().unwrap();
        let mut out = [PollFd {
            fd: w2.as_raw_fd(),
            events: POLLOUT,
            revents: 0,
        }];
        assert_eq!(poll_fds(&mut out, 0).unwrap(), 1);
        assert_ne!(out[0].revents & POLLOUT, 0);
        drop(r2);
        assert_eq!(poll_fds(&mut out, 0).unwrap(), 1);
        assert_ne!(out[0].revents & POLLERR, 0);
        // Not an open descriptor.
        let mut bad = [PollFd {
            fd: 1 << 29,
            events: POLLIN,
            revents: 0,
        }];
        assert_eq!(poll_fds(&mut bad, 0).unwrap(), 1);
        assert_ne!(bad[0].revents & POLLNVAL, 0);
    }

    #[test]
    fn cloexec_is_set_and_cleared() {
        const KERNEL_O_CLOEXEC: u32 = 0o2000000;
        let f = File::open("/dev/null").unwrap(); // std opens with O_CLOEXEC.
        let fd = f.as_raw_fd();
        assert_ne!(fd_flags(fd) & KERNEL_O_CLOEXEC, 0);
        set_cloexec(fd, false).unwrap();
        assert_eq!(fd_flags(fd) & KERNEL_O_CLOEXEC, 0);
        set_cloexec(fd, true).unwrap();
        assert_ne!(fd_flags(fd) & KERNEL_O_CLOEXEC, 0);
        assert!(set_cloexec(1 << 29, true).is_err());
        assert_eq!(O_CLOEXEC as u32, KERNEL_O_CLOEXEC);
    }

    #[test]
    fn only_open_descriptors_above_stdio_are_inherited() {
        for fd in [-1, 0, 1, 2] {
            assert!(inherited_fd(fd).is_none(), "fd {fd}");
        }
        assert!(inherited_fd(1 << 29).is_none());
    }

    #[test]
    fn ids_are_the_processes_own() {
        let status = fs::read_to_string("/proc/self/status").unwrap();
        let field = |name: &str, i: usize| -> u32 {
            let l = status.lines().find(|l| l.starts_with(name)).unwrap();
            l.split_whitespace().nth(i).unwrap().parse().unwrap()
        };
        // Uid: real effective saved fs.
        assert_eq!(
            ids(),
            (field("Uid:", 1), field("Gid:", 1), field("Uid:", 2))
        );
    }

    #[test]
    fn can_execute_follows_the_mode_bits() {
        let dir = TempDir::new();
        let exe = dir.join("exe");
        let plain = dir.join("plain");
        fs::write(&exe, "#!/bin/sh\n").unwrap();
        fs::write(&plain, "data").unwrap();
        fs::set_permissions(&exe, Permissions::from_mode(0o755)).unwrap();
        fs::set_permissions(&plain, Permissions::from_mode(0o644)).unwrap();
        assert!(can_execute(dir.path()));
        assert!(can_execute(&exe));
        // Not even root may execute a file without any execute bit.
        assert!(!can_execute(&plain));
        assert!(!can_execute(&dir.join("missing")));
        assert!(!can_execute(Path::new("bad\0name")));
    }

    #[test]
    fn a_signal_to_a_pid_that_cannot_exist_is_not_sent() {
        // Above any pid_max (4194304 at most).
        assert!(!signal(i32::MAX, 0));
        assert!(signal(std::process::id() as i32, 0));
    }

    #[test]
    fn a_pidfd_signals_its_process() {
        let me = match pidfd_open(std::process::id() as i32) {
            Err(e) if e.raw_os_error() == Some(ENOSYS) => return, // Before Linux 5.3.
            r => r.unwrap(),
        };
        assert!(pidfd_signal(&me, 0));
        assert!(pidfd_open(i32::MAX).is_err());
        // A child killed through its pidfd.
        let mut child = Command::new("sleep").arg("1000").spawn().unwrap();
        let fd = pidfd_open(child.id() as i32).unwrap();
        assert!(pidfd_signal(&fd, SIGKILL));
        let status = child.wait().unwrap();
        assert_eq!(status.signal(), Some(SIGKILL));
    }

    #[test]
    fn reap_takes_the_wait_status_of_an_exited_child_only() {
        let child = Command::new("sh").args(["-c", "exit 3"]).spawn().unwrap();
        let pid = child.id() as i32;
        drop(child); // Not waited on by std.
        let deadline = Instant::now() + Duration::from_secs(10);
        let status = loop {
            match reap(pid).unwrap() {
                Some(s) => break s,
                None => {
                    assert!(Instant::now() < deadline, "the child did not exit");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        };
        assert_eq!((status & 0x7f, (status >> 8) & 0xff), (0, 3));
        // Gone now: no such child.
        assert_eq!(reap(pid).unwrap_err().raw_os_error(), Some(ECHILD));
    }

    #[test]
    fn an_exclusive_lock_is_held_by_one_open_file_at_a_time() {
        let tmp = TempDir::new();
        let path = tmp.join("lock");
        let a = File::create(&path).unwrap();
        let b = File::open(&path).unwrap();
        assert!(try_lock_exclusive(&a).unwrap());
        // Again through the same open file: still its own.
        assert!(try_lock_exclusive(&a).unwrap());
        assert!(!try_lock_exclusive(&b).unwrap());
        drop(a);
        assert!(try_lock_exclusive(&b).unwrap());
    }

    #[test]
    fn the_peer_of_a_unix_socket_is_known() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let (pid, uid, gid) = peer_cred(a.as_fd()).unwrap();
        let (_, _, euid) = ids();
        assert_eq!((pid as u32, uid), (std::process::id(), euid));
        let egid = fs::metadata("/proc/self").unwrap().gid();
        assert_eq!(gid, egid);
        // Not a socket.
        let f = File::open("/dev/null").unwrap();
        assert!(peer_cred(f.as_fd()).is_err());
    }

    #[test]
    fn at_calls_work_relative_to_a_directory_and_never_follow_the_last_link() {
        let tmp = TempDir::new();
        let dir = File::open(tmp.path()).unwrap();
        let d = dir.as_fd();

        mkdirat(d, &c("sub"), 0o700).unwrap();
        assert!(tmp.join("sub").is_dir());
        assert_eq!(
            mkdirat(d, &c("sub"), 0o700).unwrap_err().kind(),
            ErrorKind::AlreadyExists
        );

        let flags = O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC;
        let f = openat(Some(d), &c("f"), flags, 0o600).unwrap();
        File::from(f).write_all(b"data").unwrap();
        assert_eq!(fs::read(tmp.join("f")).unwrap(), b"data");
        let again = openat(Some(d), &c("f"), flags, 0o600).unwrap_err();
        assert_eq!(again.kind(), ErrorKind::AlreadyExists);
        // O_DIRECTORY on a file.
        let e = openat(Some(d), &c("f"), O_DIRECTORY | O_CLOEXEC, 0).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(ENOTDIR));

        symlinkat(&c("f"), d, &c("link")).unwrap();
        assert_eq!(fs::read_link(tmp.join("link")).unwrap(), Path::new("f"));
        // O_NOFOLLOW refuses the link; with O_PATH it opens the link itself.
        let e = openat(Some(d), &c("link"), O_NOFOLLOW | O_CLOEXEC, 0).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(ELOOP));
        let link = openat(Some(d), &c("link"), O_PATH | O_NOFOLLOW | O_CLOEXEC, 0).unwrap();
        assert_eq!(readlink_fd(link.as_fd()).unwrap(), b"f");
        let target = openat(Some(d), &c("f"), O_PATH | O_NOFOLLOW | O_CLOEXEC, 0).unwrap();
        assert!(readlink_fd(target.as_fd()).is_err());

        // The link's own owner changes through its O_PATH descriptor, not its target's.
        let (uid, _, _) = ids();
        let other = if uid == 0 { 1234 } else { uid };
        fchown_fd(link.as_fd(), other, other).unwrap();
        assert_eq!(fs::symlink_metadata(tmp.join("link")).unwrap().uid(), other);
        assert_eq!(fs::metadata(tmp.join("f")).unwrap().uid(), uid);

        renameat(d, &c("f"), &c("g")).unwrap();
        assert!(!tmp.join("f").exists());
        assert_eq!(fs::read(tmp.join("g")).unwrap(), b"data");
        unlinkat(d, &c("g")).unwrap();
        assert!(!tmp.join("g").exists());
        // unlinkat of a directory (without AT_REMOVEDIR) fails.
        assert!(unlinkat(d, &c("sub")).is_err());
        assert!(tmp.join("sub").is_dir());

        // No directory: relative to the working directory.
        let abs = c(tmp.join("sub").to_str().unwrap());
        assert!(openat(None, &abs, O_PATH | O_DIRECTORY | O_CLOEXEC, 0).is_ok());
    }
}
