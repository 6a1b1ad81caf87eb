//! The relay and the daemon (protocol version 3; `proto.rs`, "Daemon, relay and durable
//! execs").
//!
//! The relay (the helper started with no argument) finds the run's daemon through the
//! directory [`DAEMON_DIR`] beside its executable: created 0700 if missing, opened
//! without following a link, used only when it is a directory of the helper's own user
//! (a wrong mode of its own is corrected; others cannot have added anything to it since,
//! and whatever they added before is not trusted: the lock file must be ours, and the
//! daemon behind the socket must run as our user, `SO_PEERCRED`). Per build (the
//! executable's digest, 16 hex digits) it holds a lock file and the daemon's socket; the
//! relay takes the lock (`flock`, bounded), connects, and only when that fails removes
//! the stale socket, starts a daemon (`/proc/self/exe` [`DAEMON_ARG`] with the
//! directory's descriptor and a readiness pipe, stdio on `/dev/null`, a session of its
//! own) and waits (bounded) until it listens; then connects and unlocks. Every path it
//! uses goes through the directory's descriptor (`/proc/self/fd/N/name`), never its
//! name again.
//!
//! Connected, the relay copies bytes both ways until either side ends: when its stdin
//! ends it shuts down the socket's sending side and copies the daemon's last frames for
//! at most [`RELAY_LINGER`]; when the daemon closes, it exits. Two threads, one fixed
//! buffer each, nothing queued. When the daemon cannot be used at all, the relay serves
//! its connection itself ([`crate::serve_stdio`]).
//!
//! The daemon accepts connections on its socket (mode 0600) from its own uid or root
//! only, never from its own descendants (the processes of its execs), at most [`MAX_CONNECTIONS`] at once; each gets a reader (this module's
//! [`serve`], then [`Conn`]) and a writer thread, and its own `HELLO`.

use std::ffi::{CString, OsString};
use std::fs::{self, File, Permissions};
use std::io::{self, ErrorKind, Read, Write};
use std::net::Shutdown;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread;
use std::time::{Duration, Instant};

use crate::conn::Conn;
use crate::exec::SHUTDOWN_KILL;
use crate::link::Link;
use crate::procs;
use crate::proto::{DAEMON_ARG, DAEMON_DIR, MAX_CONNECTIONS};
use crate::sys::{self, O_CLOEXEC, O_CREAT, O_DIRECTORY, O_NOFOLLOW, O_PATH, O_RDONLY, O_RDWR};
use crate::{FLUSH_AT_END, Helper, diag, harden, self_digest, serve_stdio, start_thread};

/// How long a relay waits for the lock (another relay may hold it while it starts the
/// daemon, which takes at most [`DAEMON_READY`]).
const LOCK_WAIT: Duration = Duration::from_secs(10);
/// The daemon this relay started (pid, start time), if it did.
static STARTED_DAEMON: std::sync::OnceLock<(i32, u64)> = std::sync::OnceLock::new();

/// The daemon this process started as a relay (pid, start time): a child of a relay that
/// serves its connection itself, and not one of its strays.
pub(crate) fn started_daemon() -> Option<(i32, u64)> {
    STARTED_DAEMON.get().copied()
}

/// How long a relay waits for the daemon it started to listen.
const DAEMON_READY: Duration = Duration::from_secs(3);
/// How long a relay whose stdin ended waits for the daemon to end the connection: the
/// daemon first kills the execs that have no grace (bounded by [`SHUTDOWN_KILL`]), then
/// sends what is queued (bounded by [`FLUSH_AT_END`]).
pub(crate) const RELAY_LINGER: Duration =
    Duration::from_secs(SHUTDOWN_KILL.as_secs() + FLUSH_AT_END.as_secs() + 1);
/// The relay's copy buffer, each way.
const COPY_BUFFER: usize = 64 * 1024;

/// The relay: reaches the daemon (starting it if need be) and copies bytes, or serves the
/// connection itself when no daemon can be used.
pub(crate) fn relay_main() -> ! {
    harden();
    let (size, digest) = self_digest();
    match reach_daemon(digest) {
        Ok(sock) => relay(sock),
        Err(e) => {
            diag(format_args!(
                "no daemon ({e}): serving the connection itself"
            ));
            serve_stdio(size, digest)
        }
    }
}

/// The path of the executable (for the daemon's command line) and its directory.
pub(crate) fn exe_and_dir() -> io::Result<(PathBuf, PathBuf)> {
    let exe = fs::read_link("/proc/self/exe")?;
    let dir = exe
        .parent()
        .map(Path::to_path_buf)
        .ok_or_else(|| io::Error::other("the executable has no directory"))?;
    Ok((exe, dir))
}

fn cstr(b: &[u8]) -> io::Result<CString> {
    CString::new(b).map_err(|_| io::Error::new(ErrorKind::InvalidInput, "a NUL in a path"))
}

/// The daemon's directory in `exe_dir`, created 0700 if missing; an error unless it is
/// a directory (not a link) of the helper's effective user. A directory of ours with
/// another mode is made 0700.
pub(crate) fn open_daemon_dir(exe_dir: &Path) -> io::Result<File> {
    let base = sys::openat(
        None,
        &cstr(exe_dir.as_os_str().as_bytes())?,
        O_PATH | O_DIRECTORY | O_CLOEXEC,
        0,
    )?;
    let name = cstr(DAEMON_DIR.as_bytes())?;
    match sys::mkdirat(base.as_fd(), &name, 0o700) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let flags = O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC;
    let dir = File::from(sys::openat(Some(base.as_fd()), &name, flags, 0)?);
    check_dir(dir)
}

/// `dir` if it is a directory of the helper's effective user with mode 0700 (made so
/// when it is ours).
fn check_dir(dir: File) -> io::Result<File> {
    let md = dir.metadata()?;
    let euid = sys::ids().2;
    if !md.is_dir() {
        return Err(io::Error::other("not a directory"));
    }
    if md.uid() != euid {
        return Err(io::Error::other(format!(
            "the daemon directory belongs to uid {}, not {euid}",
            md.uid()
        )));
    }
    if md.mode() & 0o7777 != 0o700 {
        dir.set_permissions(Permissions::from_mode(0o700))?;
        if dir.metadata()?.mode() & 0o7777 != 0o700 {
            return Err(io::Error::other(
                "the daemon directory's mode cannot be 0700",
            ));
        }
    }
    Ok(dir)
}

/// Name of the daemon's socket of this build.
fn sock_name(digest: u64) -> String {
    format!("{digest:016x}.sock")
}

/// The socket's path through the directory's descriptor (never its name again).
fn sock_path(dir: &File, digest: u64) -> PathBuf {
    PathBuf::from(format!(
        "/proc/self/fd/{}/{}",
        dir.as_raw_fd(),
        sock_name(digest)
    ))
}

/// Takes this build's lock in `dir` (created 0600 if missing; it must be a file of
/// ours), waiting at most `bound` for another relay to release it. Released when the
/// returned file is dropped.
fn take_lock(dir: &File, digest: u64, bound: Duration) -> io::Result<File> {
    let name = cstr(format!("{digest:016x}.lock").as_bytes())?;
    let flags = O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC | sys::O_NONBLOCK_OPEN;
    let f = File::from(sys::openat(Some(dir.as_fd()), &name, flags, 0o600)?);
    let md = f.metadata()?;
    if !md.is_file() || md.uid() != sys::ids().2 {
        return Err(io::Error::other("the lock file is not a file of ours"));
    }
    let deadline = Instant::now() + bound;
    while !sys::try_lock_exclusive(&f)? {
        if Instant::now() >= deadline {
            return Err(io::Error::new(
                ErrorKind::TimedOut,
                "another relay holds the lock",
            ));
        }
        thread::sleep(Duration::from_millis(20));
    }
    Ok(f)
}

/// Connects to the socket at `path`; an error unless the process that listens on it
/// runs as the helper's effective user.
fn connect_checked(path: &Path) -> io::Result<UnixStream> {
    let s = UnixStream::connect(path)?;
    let (_, uid, _) = sys::peer_cred(s.as_fd())?;
    let euid = sys::ids().2;
    if uid != euid {
        return Err(io::Error::new(
            ErrorKind::PermissionDenied,
            format!("the daemon socket is served by uid {uid}, not {euid}"),
        ));
    }
    Ok(s)
}

/// Connects to this build's daemon, starting it first if none listens.
fn reach_daemon(digest: u64) -> io::Result<UnixStream> {
    let (exe, exe_dir) = exe_and_dir()?;
    let dir = open_daemon_dir(&exe_dir)?;
    let _lock = take_lock(&dir, digest, LOCK_WAIT)?;
    let path = sock_path(&dir, digest);
    if let Ok(s) = connect_checked(&path) {
        return Ok(s);
    }
    // Nobody (of ours) listens: a stale socket, or none.
    match sys::unlinkat(dir.as_fd(), &cstr(sock_name(digest).as_bytes())?) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    start_daemon(&dir, &exe)?;
    connect_checked(&path)
}

/// Starts the daemon (its command line: `exe` [`DAEMON_ARG`] and two descriptors) and
/// waits (at most [`DAEMON_READY`]) until it listens. Called while the relay has no
/// other thread: the two descriptors made inheritable for it reach no other child.
fn start_daemon(dir: &File, exe: &Path) -> io::Result<()> {
    let (mut ready_r, ready_w) = io::pipe()?;
    let (dir_fd, ready_fd) = (dir.as_raw_fd(), ready_w.as_raw_fd());
    sys::set_cloexec(dir_fd, false)?;
    sys::set_cloexec(ready_fd, false)?;
    let spawned = Command::new("/proc/self/exe")
        .arg0(exe)
        .arg(DAEMON_ARG)
        .arg(dir_fd.to_string())
        .arg(ready_fd.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    sys::set_cloexec(dir_fd, true)?;
    drop(ready_w);
    // Never waited on: it outlives the relay. Should the relay serve its connection
    // itself after all, the daemon is its child but no stray of it.
    let child = spawned?;
    let pid = child.id() as i32;
    if let Some(p) = crate::procs::read_stat(pid, &mut Vec::new()) {
        let _ = STARTED_DAEMON.set((pid, p.start));
    }
    drop(child);
    let mut fds = [sys::PollFd {
        fd: ready_r.as_raw_fd(),
        events: sys::POLLIN,
        revents: 0,
    }];
    let deadline = Instant::now() + DAEMON_READY;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                ErrorKind::TimedOut,
                "the daemon did not listen in time",
            ));
        }
        match sys::poll_fds(&mut fds, left.as_millis() as i32 + 1) {
            Ok(0) => continue,
            Ok(_) => break,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    let mut b = [0u8; 1];
    match ready_r.read(&mut b) {
        Ok(1) => Ok(()),
        Ok(_) => Err(io::Error::other("the daemon ended before it listened")),
        Err(e) => Err(e),
    }
}

/// Copies `from` to `to` until `from` ends (true) or either fails (false).
fn copy(from: &mut impl Read, to: &mut impl Write) -> bool {
    let mut buf = vec![0u8; COPY_BUFFER];
    loop {
        match from.read(&mut buf) {
            Ok(0) => return true,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    return false;
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return false,
        }
    }
}

/// Copies stdin to the daemon and the daemon to stdout, then exits.
fn relay(mut sock: UnixStream) -> ! {
    let stdio = io::stdin()
        .as_fd()
        .try_clone_to_owned()
        .and_then(|i| Ok((i, io::stdout().as_fd().try_clone_to_owned()?)));
    let (up, (input, output)) = match sock.try_clone().and_then(|u| Ok((u, stdio?))) {
        Ok(x) => x,
        Err(e) => {
            diag(format_args!("cannot relay: {e}"));
            std::process::exit(1);
        }
    };
    let started = start_thread("stdin", move || {
        let (mut input, mut up) = (File::from(input), up);
        copy(&mut input, &mut up);
        // The host is done: the daemon ends the connection (killing what has no grace)
        // and closes it, which ends the other direction.
        let _ = up.shutdown(Shutdown::Write);
        thread::sleep(RELAY_LINGER);
        std::process::exit(0);
    });
    if !started {
        diag(format_args!("cannot start the relay's thread"));
        std::process::exit(1);
    }
    copy(&mut sock, &mut File::from(output));
    std::process::exit(0)
}

/// The daemon: listens on this build's socket, then serves connections until killed.
pub(crate) fn daemon_main(mut args: impl Iterator<Item = OsString>) -> ! {
    let _ = sys::new_session();
    harden();
    let mut inherited = || {
        let fd = args.next()?.to_str()?.parse().ok()?;
        let f = File::from(sys::inherited_fd(fd)?);
        // Never passed on to a child.
        let _ = sys::set_cloexec(f.as_raw_fd(), true);
        Some(f)
    };
    let (dir, ready) = (inherited(), inherited());
    let dir = match dir.map_or_else(|| open_daemon_dir(&exe_and_dir()?.1), check_dir) {
        Ok(d) => d,
        Err(e) => {
            diag(format_args!("daemon: no directory: {e}"));
            std::process::exit(1);
        }
    };
    let (size, digest) = self_digest();
    let listener = match listen(&dir, digest) {
        Ok(Some(l)) => l,
        Ok(None) => {
            // Another daemon of this build listens already: the relay connects to it.
            signal_ready(ready);
            std::process::exit(0);
        }
        Err(e) => {
            diag(format_args!("daemon: cannot listen: {e}"));
            std::process::exit(1);
        }
    };
    // Kept: `BASE` and `LAYER` keep the run's base listing in it.
    let h: &'static Helper = Box::leak(Box::new(Helper {
        daemon_dir: Some(dir),
        ..Helper::new(true, size, digest)
    }));
    if !start_thread("reaper", move || h.reaper()) || !start_thread("janitor", move || h.janitor())
    {
        diag(format_args!("daemon: cannot start its threads"));
        std::process::exit(1);
    }
    h.refill_spare();
    signal_ready(ready);
    loop {
        match listener.accept() {
            Ok((s, _)) => accept(h, s),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            // Out of descriptors, say: later.
            Err(_) => thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Tells the relay that started the daemon that it listens.
fn signal_ready(ready: Option<File>) {
    if let Some(mut r) = ready {
        let _ = r.write_all(&[1]);
    }
}

/// Binds and listens on this build's socket (mode 0600) in `dir`. `None`: a daemon of
/// ours listens there already.
fn listen(dir: &File, digest: u64) -> io::Result<Option<UnixListener>> {
    let path = sock_path(dir, digest);
    let listener = match UnixListener::bind(&path) {
        Ok(l) => l,
        Err(e) if e.kind() == ErrorKind::AddrInUse => {
            if connect_checked(&path).is_ok() {
                return Ok(None);
            }
            sys::unlinkat(dir.as_fd(), &cstr(sock_name(digest).as_bytes())?)?;
            UnixListener::bind(&path)?
        }
        Err(e) => return Err(e),
    };
    fs::set_permissions(&path, Permissions::from_mode(0o600))?;
    Ok(Some(listener))
}

/// Whether a peer of uid `peer` may use the daemon of effective uid `euid`.
fn peer_allowed(peer: u32, euid: u32) -> bool {
    peer == euid || peer == 0
}

/// Whether the peer of pid `pid` is neither this daemon's descendant nor any helper
/// daemon's (a process of an exec, of this build or another: see "Trust" in `proto.rs`).
/// Asked again when a process of the chain went while it was walked; refused when it
/// still cannot be told.
fn peer_not_ours(pid: i32) -> bool {
    let me = std::process::id() as i32;
    (0..3).any(|_| procs::below_a_daemon(pid, me) == Some(false))
}

/// A connection accepted: checked (the peer's uid, the number of connections), then
/// served on a thread of its own; closed at once otherwise.
fn accept(h: &'static Helper, sock: UnixStream) {
    let Ok((pid, uid, _)) = sys::peer_cred(sock.as_fd()) else {
        return;
    };
    if !peer_allowed(uid, sys::ids().2) {
        diag(format_args!("refused a connection from uid {uid}"));
        return;
    }
    if !peer_not_ours(pid) {
        diag(format_args!(
            "refused a connection from pid {pid}: a process of an exec"
        ));
        return;
    }
    if h.connections.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
        h.connections.fetch_sub(1, Ordering::SeqCst);
        diag(format_args!(
            "refused a connection: {MAX_CONNECTIONS} are served"
        ));
        return;
    }
    let relay = u32::try_from(pid).unwrap_or(0);
    if !start_thread("conn", move || {
        serve(h, sock, relay);
        h.connections.fetch_sub(1, Ordering::SeqCst);
    }) {
        h.connections.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Serves one connection (on its reader thread): `HELLO`, the writer thread, the frames
/// read until the connection ends; then the execs attached to it are unattached (see
/// [`Helper::connection_ended`]), what is queued goes out (bounded) and the socket is
/// closed.
fn serve(h: &'static Helper, sock: UnixStream, relay: u32) {
    let clones = sock.try_clone().and_then(|a| Ok((a, sock.try_clone()?)));
    let Ok((out, shut)) = clones else {
        return;
    };
    let link = Arc::new(Link::new(Some(shut)));
    link.send(h.hello(relay));
    let l = link.clone();
    if !start_thread("writer", move || {
        l.writer(File::from(OwnedFd::from(out)));
    }) {
        return;
    }
    Conn::new(h, link.clone()).run(File::from(OwnedFd::from(sock)));
    h.connection_ended(&link);
    link.flush(FLUSH_AT_END);
    link.close();
    sys::release_free_memory();
}

#[cfg(test)]
mod tests;
