//! Unit tests of the daemon's directory, lock and socket, and of the relay's copy. (The
//! relay and the daemon as processes are tested by the integration tests:
//! `runcell-helper/tests/durable.rs`.)

use std::os::unix::fs::{FileTypeExt, symlink};
use std::sync::mpsc::channel;

use super::*;
use crate::testing::TempDir;

fn mode(p: &Path) -> u32 {
    fs::symlink_metadata(p).unwrap().mode() & 0o7777
}

#[test]
fn the_daemon_directory_is_made_private_and_reused() {
    let tmp = TempDir::new();
    let d = tmp.join(DAEMON_DIR);
    let first = open_daemon_dir(tmp.path()).unwrap();
    assert!(first.metadata().unwrap().is_dir());
    assert_eq!(mode(&d), 0o700);
    // Again: the same directory.
    let again = open_daemon_dir(tmp.path()).unwrap();
    let ino = |f: &File| f.metadata().unwrap().ino();
    assert_eq!(ino(&first), ino(&again));
    // Ours with another mode: corrected.
    fs::set_permissions(&d, Permissions::from_mode(0o755)).unwrap();
    open_daemon_dir(tmp.path()).unwrap();
    assert_eq!(mode(&d), 0o700);
}

#[test]
fn a_daemon_directory_that_is_not_ours_is_refused() {
    let tmp = TempDir::new();
    let d = tmp.join(DAEMON_DIR);
    // A file.
    fs::write(&d, "").unwrap();
    assert!(open_daemon_dir(tmp.path()).is_err());
    fs::remove_file(&d).unwrap();
    // A link to a directory of ours: never followed.
    let target = tmp.join("target");
    fs::create_dir(&target).unwrap();
    fs::set_permissions(&target, Permissions::from_mode(0o700)).unwrap();
    symlink(&target, &d).unwrap();
    assert!(open_daemon_dir(tmp.path()).is_err());
    fs::remove_file(&d).unwrap();
    // Another user's.
    if sys::ids().2 == 0 {
        fs::create_dir(&d).unwrap();
        fs::set_permissions(&d, Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::chown(&d, Some(65534), None).unwrap();
        let e = open_daemon_dir(tmp.path()).unwrap_err();
        assert!(e.to_string().contains("65534"), "{e}");
        assert_eq!(mode(&d), 0o700);
    }
    // No directory to make it in.
    assert!(open_daemon_dir(&tmp.join("missing")).is_err());
}

#[test]
fn the_lock_is_exclusive_bounded_and_released_with_its_file() {
    let tmp = TempDir::new();
    let dir = open_daemon_dir(tmp.path()).unwrap();
    let held = take_lock(&dir, 0xabc, Duration::from_secs(1)).unwrap();
    let name = tmp.join(DAEMON_DIR).join("0000000000000abc.lock");
    assert_eq!(mode(&name), 0o600);
    let started = Instant::now();
    let e = take_lock(&dir, 0xabc, Duration::from_millis(200)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::TimedOut);
    assert!(started.elapsed() >= Duration::from_millis(200));
    // Another build's lock is another file.
    drop(take_lock(&dir, 0xdef, Duration::from_millis(200)).unwrap());
    // Released: a waiter gets it.
    let (tx, rx) = channel();
    let d2 = dir.try_clone().unwrap();
    thread::spawn(move || tx.send(take_lock(&d2, 0xabc, Duration::from_secs(10)).is_ok()));
    thread::sleep(Duration::from_millis(100));
    drop(held);
    assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap());
}

#[test]
fn a_lock_that_is_not_a_file_of_ours_is_refused() {
    let tmp = TempDir::new();
    let dir = open_daemon_dir(tmp.path()).unwrap();
    let d = tmp.join(DAEMON_DIR);
    // A link where the lock goes: not followed.
    fs::write(tmp.join("elsewhere"), "").unwrap();
    symlink(tmp.join("elsewhere"), d.join("0000000000000001.lock")).unwrap();
    assert!(take_lock(&dir, 1, Duration::from_millis(100)).is_err());
    // A directory.
    fs::create_dir(d.join("0000000000000002.lock")).unwrap();
    assert!(take_lock(&dir, 2, Duration::from_millis(100)).is_err());
    if sys::ids().2 == 0 {
        let other = d.join("0000000000000003.lock");
        fs::write(&other, "").unwrap();
        std::os::unix::fs::chown(&other, Some(65534), None).unwrap();
        assert!(take_lock(&dir, 3, Duration::from_millis(100)).is_err());
    }
}

#[test]
fn the_socket_is_reached_through_the_directory_descriptor() {
    let tmp = TempDir::new();
    let dir = open_daemon_dir(tmp.path()).unwrap();
    let path = sock_path(&dir, 0x0123_4567_89ab_cdef);
    assert!(path.as_os_str().len() < 100, "{}", path.display());
    assert!(path.starts_with("/proc/self/fd/"));
    assert!(path.ends_with("0123456789abcdef.sock"));
    // Nothing listens yet.
    assert!(connect_checked(&path).is_err());
    let listener = listen(&dir, 0x0123_4567_89ab_cdef)
        .unwrap()
        .expect("a listener");
    let sock = tmp.join(DAEMON_DIR).join("0123456789abcdef.sock");
    assert!(fs::symlink_metadata(&sock).unwrap().file_type().is_socket());
    assert_eq!(mode(&sock), 0o600);
    // A peer of ours, in either direction.
    let client = connect_checked(&path).unwrap();
    let (server, _) = listener.accept().unwrap();
    let (pid, uid, _) = sys::peer_cred(server.as_fd()).unwrap();
    assert_eq!((pid as u32, uid), (std::process::id(), sys::ids().2));
    assert!(peer_allowed(uid, sys::ids().2));
    drop((client, server));
    // A second daemon finds the first listening and stands down.
    assert!(listen(&dir, 0x0123_4567_89ab_cdef).unwrap().is_none());
    // Once it is gone its socket is stale: taken over.
    drop(listener);
    assert!(connect_checked(&path).is_err());
    let again = listen(&dir, 0x0123_4567_89ab_cdef).unwrap();
    assert!(again.is_some());
}

#[test]
fn only_the_daemons_own_user_and_root_are_served() {
    assert!(peer_allowed(1000, 1000));
    assert!(peer_allowed(0, 1000));
    assert!(peer_allowed(0, 0));
    assert!(!peer_allowed(1001, 1000));
    assert!(!peer_allowed(1000, 0));
}

#[test]
fn copy_moves_every_byte_until_the_end() {
    let data: Vec<u8> = (0..3 * COPY_BUFFER + 17).map(|i| (i % 253) as u8).collect();
    let (mut r, mut w) = io::pipe().unwrap();
    let d = data.clone();
    let t = thread::spawn(move || {
        for c in d.chunks(1000) {
            w.write_all(c).unwrap();
        }
    });
    let mut out = Vec::new();
    assert!(copy(&mut r, &mut out));
    t.join().unwrap();
    assert!(out == data);
    // A destination that fails.
    let (mut r, mut w) = io::pipe().unwrap();
    w.write_all(b"x").unwrap();
    drop(w);
    let (pr, mut pw) = io::pipe().unwrap();
    drop(pr);
    assert!(!copy(&mut r, &mut pw));
}

#[test]
fn the_relay_lingers_long_enough_for_the_daemon_to_end_the_connection() {
    assert!(RELAY_LINGER > SHUTDOWN_KILL + FLUSH_AT_END);
    assert!(RELAY_LINGER <= Duration::from_secs(10));
}
