//! Integration tests of `PUT` and `GET`: trees, refusals, credit, holes, and links that
//! another user swaps in.
//!
//! They start the built helper on this host (as a child with piped stdin/stdout, no
//! container) and speak the protocol to it; the harness is `common/mod.rs`. Several tests
//! need root (per-exec users, owners); the crate's tests run as root here.

mod common;

use std::collections::HashSet;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering;
use std::thread;
use std::time::Duration;

use common::*;

fn entry(path: &str, kind: u8, mode: u32, size: u64, link: &str) -> Entry {
    Entry {
        path: path.as_bytes().to_vec(),
        kind,
        mode,
        uid: 0,
        gid: 0,
        mtime: 1_700_000_000,
        size,
        link: link.as_bytes().to_vec(),
    }
}

/// Reads frames of a PUT until DONE or FILE_ERROR; returns the last frame and acked bytes.
fn put_result(h: &mut Helper, id: u32) -> (Frame, usize) {
    let mut acked = 0;
    loop {
        let f = h.recv();
        assert_eq!(f.id, id);
        match f.kind {
            STDIN_ACK => acked += Dec::new(&f.payload).u32().unwrap() as usize,
            DONE | FILE_ERROR => return (f, acked),
            k => panic!("unexpected frame kind {k}"),
        }
    }
}

#[test]
fn put_then_get_a_tree() {
    let dir = TempDir::new();
    let mut h = Helper::start();
    let data = noise(150_000);
    h.send_path(PUT, 1, dir.path());
    h.send_entry(1, &entry("d", DIRECTORY, 0o750, 0, ""));
    h.send_entry(1, &entry("d/f", REGULAR, 0o640, data.len() as u64, ""));
    for c in data.chunks(CHUNK) {
        h.send_data(STDIN, 1, c);
    }
    h.send_entry(1, &entry("d/l", SYMLINK, 0o777, 0, "f"));
    h.send_entry(1, &entry("d/e", REGULAR, 0o600, 0, ""));
    h.send_empty(STDIN_EOF, 1);
    let (f, acked) = put_result(&mut h, 1);
    assert_eq!(f.kind, DONE, "{f:?}");
    assert_eq!(acked, data.len());

    let d = dir.path().join("d");
    assert_eq!(fs::metadata(&d).unwrap().mode() & 0o7777, 0o750);
    assert_eq!(fs::read(d.join("f")).unwrap(), data);
    let fm = fs::metadata(d.join("f")).unwrap();
    assert_eq!(fm.mode() & 0o7777, 0o640);
    assert_eq!(fm.mtime(), 1_700_000_000);
    assert_eq!(fs::read_link(d.join("l")).unwrap(), Path::new("f"));
    assert_eq!(fs::read(d.join("e")).unwrap(), b"");
    // No temporary files left behind.
    let names: HashSet<String> = fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(
        names,
        ["e", "f", "l"].iter().map(|s| s.to_string()).collect()
    );

    h.send_path(GET, 2, &d);
    let mut entries = Vec::new();
    let mut contents: Vec<u8> = Vec::new();
    loop {
        let f = h.recv();
        assert_eq!(f.id, 2);
        match f.kind {
            ENTRY => entries.push(Entry::decode(&mut Dec::new(&f.payload)).unwrap()),
            STDOUT => {
                contents.extend_from_slice(&f.payload);
                h.send_u32(CREDIT, 2, f.payload.len() as u32);
            }
            DONE => break,
            k => panic!("unexpected frame kind {k}: {f:?}"),
        }
    }
    let summary: Vec<(String, u8, u32, u64, String)> = entries
        .iter()
        .map(|e| {
            (
                String::from_utf8(e.path.clone()).unwrap(),
                e.kind,
                if e.kind == SYMLINK { 0 } else { e.mode },
                e.size,
                String::from_utf8(e.link.clone()).unwrap(),
            )
        })
        .collect();
    let s = |x: &str| x.to_string();
    assert_eq!(
        summary,
        vec![
            (s("d"), DIRECTORY, 0o750, 0, s("")),
            (s("d/e"), REGULAR, 0o600, 0, s("")),
            (s("d/f"), REGULAR, 0o640, data.len() as u64, s("")),
            (s("d/l"), SYMLINK, 0, 0, s("f")),
        ]
    );
    assert_eq!(contents, data);

    // A second PUT replaces the file and the symlink.
    h.send_path(PUT, 3, dir.path());
    h.send_entry(3, &entry("d/f", REGULAR, 0o644, 3, ""));
    h.send_data(STDIN, 3, b"new");
    h.send_entry(3, &entry("d/l", REGULAR, 0o644, 0, ""));
    h.send_empty(STDIN_EOF, 3);
    assert_eq!(put_result(&mut h, 3).0.kind, DONE);
    assert_eq!(fs::read(d.join("f")).unwrap(), b"new");
    assert!(fs::symlink_metadata(d.join("l")).unwrap().is_file());
}

/// A `PUT` makes hard links and fifos: a hard link becomes another name of a regular
/// file the same `PUT` wrote (owner and mode are that file's), a fifo gets its mode. A
/// hard link to anything else (a directory, a missing path, a path out of the tree or
/// through a symbolic link, a file that was there before or that another `PUT` wrote)
/// is refused, and nothing is left of it; a link to the name it is at leaves no
/// temporary name.
#[test]
fn put_makes_hard_links_and_fifos_and_refuses_bad_targets() {
    let dir = TempDir::new();
    let mut h = Helper::start();
    h.send_path(PUT, 1, dir.path());
    h.send_entry(1, &entry("d", DIRECTORY, 0o755, 0, ""));
    h.send_entry(1, &entry("d/f", REGULAR, 0o640, 3, ""));
    h.send_data(STDIN, 1, b"abc");
    h.send_entry(1, &entry("d/sub", DIRECTORY, 0o755, 0, ""));
    h.send_entry(1, &entry("d/sub/h", HARDLINK, 0o777, 0, "d/f"));
    h.send_entry(1, &entry("d/p", FIFO, 0o620, 0, ""));
    h.send_entry(1, &entry("d/f", HARDLINK, 0, 0, "d/f"));
    h.send_entry(1, &entry("d/sub/h", HARDLINK, 0, 0, "d/f"));
    h.send_empty(STDIN_EOF, 1);
    let (f, _) = put_result(&mut h, 1);
    assert_eq!(f.kind, DONE, "{f:?}");
    let d = dir.path().join("d");
    let (fm, hm) = (
        fs::metadata(d.join("f")).unwrap(),
        fs::metadata(d.join("sub/h")).unwrap(),
    );
    assert_eq!((hm.ino(), hm.mode() & 0o7777), (fm.ino(), 0o640));
    let pm = fs::symlink_metadata(d.join("p")).unwrap();
    assert!(std::os::unix::fs::FileTypeExt::is_fifo(&pm.file_type()));
    assert_eq!(pm.mode() & 0o7777, 0o620);

    std::os::unix::fs::symlink("f", d.join("soft")).unwrap();
    std::os::unix::fs::symlink(&d, dir.path().join("via")).unwrap();
    fs::write(d.join("before"), "the user's").unwrap();
    // Each in a PUT of its own: none of these paths is a file that PUT wrote.
    let bad = [
        ("d/x1", "d/sub", FileError::Invalid),
        ("d/x2", "d/missing", FileError::Invalid),
        ("d/x3", "d/../d/f", FileError::Invalid),
        ("d/x4", "/d/f", FileError::Invalid),
        ("d/x5", "d/soft", FileError::Invalid),
        ("d/x6", "via/f", FileError::Invalid),
        ("d/x7", "d/before", FileError::Invalid),
        ("d/x8", "d/f", FileError::Invalid),
    ];
    for (i, (name, target, kind)) in bad.iter().enumerate() {
        let id = 10 + i as u32;
        h.send_path(PUT, id, dir.path());
        h.send_entry(id, &entry(name, HARDLINK, 0o644, 0, target));
        h.send_empty(STDIN_EOF, id);
        let (f, _) = put_result(&mut h, id);
        assert_eq!(f.kind, FILE_ERROR, "{name} -> {target}: {f:?}");
        assert_eq!(file_error(&f).0, *kind, "{name} -> {target}: {f:?}");
        assert!(!d.join(&name[2..]).exists(), "{name} was made");
    }
    let names: Vec<String> = fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with(".runcell-tmp"))
        .collect();
    assert!(names.is_empty(), "{names:?}");
}

/// Another user replaces, between a `PUT`'s file and a hard link to it, the file with
/// one of its own, in a directory it owns (its inode number may even be the freed one
/// of the file written): the root helper links only the file it wrote, through its
/// descriptor, never that user's file into a directory only root can change.
#[test]
fn a_hard_link_to_a_file_another_user_replaced_is_refused() {
    if !is_root() {
        eprintln!("skipped: needs root");
        return;
    }
    let dir = TempDir::new();
    let base = dir.path();
    fs::set_permissions(base, fs::Permissions::from_mode(0o755)).unwrap();
    let mut h = Helper::start();
    h.send_path(PUT, 1, base);
    h.send_entry(1, &entry("pub", DIRECTORY, 0o755, 0, ""));
    h.send_entry(1, &entry("priv", DIRECTORY, 0o755, 0, ""));
    h.send_entry(1, &entry("pub/a", REGULAR, 0o644, 8, ""));
    h.send_data(STDIN, 1, b"official");
    // The PUT goes on only once pub/a is whole (a PING is answered in order).
    h.send_empty(PING, 2);
    while h.recv().kind != PONG {}
    std::os::unix::fs::chown(base.join("pub"), Some(65534), Some(65534)).unwrap();
    // Deleted first: the new file may get the freed inode number.
    fs::remove_file(base.join("pub/a")).unwrap();
    let own = base.join("pub/x");
    fs::write(&own, "evil").unwrap();
    std::os::unix::fs::chown(&own, Some(65534), Some(65534)).unwrap();
    fs::rename(&own, base.join("pub/a")).unwrap();
    h.send_entry(1, &entry("priv/b", HARDLINK, 0o644, 0, "pub/a"));
    h.send_empty(STDIN_EOF, 1);
    let (f, _) = put_result(&mut h, 1);
    // The file written has no name left: nothing to link.
    assert_eq!(file_error(&f).1, "priv/b", "{f:?}");
    assert!(!base.join("priv/b").exists());
    let names: Vec<_> = fs::read_dir(base.join("priv")).unwrap().collect();
    assert!(names.is_empty(), "{names:?}");
}

/// In a directory another user can change, a `PUT`'s directory entry does not change
/// the owner or mode of a directory already there (that user may have moved a private
/// directory of root's to the name); a directory it makes gets them.
#[test]
fn a_directory_another_user_moved_in_keeps_its_owner_and_mode() {
    if !is_root() {
        eprintln!("skipped: needs root");
        return;
    }
    let dir = TempDir::new();
    let home = dir.path().join("home");
    fs::create_dir_all(home.join("rootonly")).unwrap();
    fs::write(home.join("rootonly/secret"), "secret").unwrap();
    fs::set_permissions(home.join("rootonly"), fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::chown(&home, Some(65534), Some(65534)).unwrap();
    // The user moves root's directory to the name a PUT is about to write.
    fs::rename(home.join("rootonly"), home.join("proj")).unwrap();
    let mut h = Helper::start();
    let mut proj = entry("proj", DIRECTORY, 0o755, 0, "");
    proj.uid = 65534;
    let mut new = entry("new", DIRECTORY, 0o750, 0, "");
    new.uid = 65534;
    assert!(put_ok(&mut h, 1, &home, &[proj, new], b""));
    let md = fs::metadata(home.join("proj")).unwrap();
    assert_eq!((md.uid(), md.mode() & 0o7777), (0, 0o700));
    let md = fs::metadata(home.join("new")).unwrap();
    assert_eq!((md.uid(), md.mode() & 0o7777), (65534, 0o750));
}

/// Replaces every temporary name the helper makes in `dir` with a hard link to `evil`
/// (a file of another user), told of each by inotify, until `stop` (then a file made in
/// `dir` wakes it).
fn swap_temporaries_for(
    dir: PathBuf,
    evil: PathBuf,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> thread::JoinHandle<u64> {
    use rustix::fs::inotify;
    let watch = inotify::init(inotify::CreateFlags::CLOEXEC).unwrap();
    inotify::add_watch(&watch, &dir, inotify::WatchFlags::CREATE).unwrap();
    thread::spawn(move || {
        let mut swapped = 0;
        let aside = dir.join(".aside");
        let mut buf = vec![std::mem::MaybeUninit::<u8>::uninit(); 1 << 16];
        let mut events = inotify::Reader::new(&watch, &mut buf);
        while !stop.load(Ordering::Relaxed) {
            let Ok(event) = events.next() else { break };
            let Some(name) = event.file_name() else {
                continue;
            };
            let name = name.to_string_lossy().into_owned();
            if name.starts_with(".runcell-tmp-") && fs::hard_link(&evil, &aside).is_ok() {
                if fs::rename(&aside, dir.join(&name)).is_ok() {
                    swapped += 1;
                } else {
                    let _ = fs::remove_file(&aside);
                }
            }
        }
        swapped
    })
}

/// A fifo or symbolic link a root `PUT` makes gets its owner and mode through a
/// descriptor of what it made: another user who swaps the temporary name for a link to
/// a file of its own (outside the `PUT`'s directory) never gets that file chowned or
/// chmodded by root.
#[test]
fn owners_and_modes_never_reach_what_another_user_swapped_in() {
    if !is_root() {
        eprintln!("skipped: needs root");
        return;
    }
    let dir = TempDir::new();
    let (ws, outside) = (dir.path().join("ws"), dir.path().join("outside"));
    fs::create_dir_all(&ws).unwrap();
    fs::create_dir_all(&outside).unwrap();
    let evil_fifo = outside.join("fifo");
    assert!(
        Command::new("mkfifo")
            .arg(&evil_fifo)
            .status()
            .unwrap()
            .success()
    );
    let evil_file = outside.join("file");
    fs::write(&evil_file, "x").unwrap();
    for p in [&evil_fifo, &evil_file] {
        fs::set_permissions(p, fs::Permissions::from_mode(0o600)).unwrap();
        std::os::unix::fs::chown(p, Some(65534), Some(65534)).unwrap();
    }
    let mut h = Helper::start();
    let mut swaps = 0;
    for (evil, kind) in [(&evil_fifo, FIFO), (&evil_file, SYMLINK)] {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let swapper = swap_temporaries_for(ws.clone(), evil.clone(), stop.clone());
        for round in 0..40u32 {
            let id = 10 + round + 100 * u32::from(kind);
            h.send_path(PUT, id, &ws);
            for i in 0..200 {
                let link = if kind == SYMLINK { "target" } else { "" };
                h.send_entry(
                    id,
                    &entry(&format!("n{kind}-{round}-{i}"), kind, 0o666, 0, link),
                );
            }
            h.send_empty(STDIN_EOF, id);
            let _ = put_result(&mut h, id);
        }
        stop.store(true, Ordering::Relaxed);
        fs::write(ws.join(format!("wake-{kind}")), "").unwrap();
        swaps += swapper.join().unwrap();
        let md = fs::symlink_metadata(evil).unwrap();
        assert_eq!(
            (md.uid(), md.mode() & 0o7777),
            (65534, 0o600),
            "{} changed by the PUT",
            evil.display()
        );
    }
    eprintln!("{swaps} temporary names swapped");
    assert!(swaps > 0, "the race never ran");
}

/// A file whose every name went while a `GET` ran can give its inode to a new file (here
/// with two names): that file goes as itself, never as a hard link to the gone file's
/// path.
#[test]
fn a_reused_inode_is_not_a_hard_link() {
    let dir = TempDir::new();
    let d = dir.path().join("d");
    fs::create_dir_all(&d).unwrap();
    fs::write(d.join("a"), "OLD-A").unwrap();
    fs::hard_link(d.join("a"), d.join("a2")).unwrap();
    fs::write(d.join("m"), vec![7u8; 3 << 20]).unwrap();
    fs::write(d.join("z"), "placeholder").unwrap();
    fs::write(d.join("zz"), "placeholder").unwrap();
    let was = fs::metadata(d.join("a")).unwrap().ino();
    let mut h = Helper::start();
    h.send_path(GET, 1, &d);
    let (mut entries, mut held, mut swapped) = (Vec::new(), 0usize, false);
    loop {
        let Some(f) = h.try_recv(Duration::from_millis(500)) else {
            // Waiting for credit inside m: a and a2 went; z comes after m.
            assert!(!swapped, "the GET stalled");
            fs::remove_file(d.join("a")).unwrap();
            fs::remove_file(d.join("a2")).unwrap();
            fs::write(d.join("new"), "NEW-Z").unwrap();
            fs::hard_link(d.join("new"), d.join("new2")).unwrap();
            fs::rename(d.join("new"), d.join("z")).unwrap();
            fs::rename(d.join("new2"), d.join("zz")).unwrap();
            let now = fs::metadata(d.join("z")).unwrap().ino();
            eprintln!("inode of a: {was}, of the new z: {now}");
            swapped = true;
            h.send_u32(CREDIT, 1, held as u32);
            continue;
        };
        match f.kind {
            ENTRY => {
                let e = Entry::decode(&mut Dec::new(&f.payload)).unwrap();
                entries.push((String::from_utf8(e.path).unwrap(), e.kind));
            }
            STDOUT if swapped => h.send_u32(CREDIT, 1, f.payload.len() as u32),
            STDOUT => held += f.payload.len(),
            DONE => break,
            k => panic!("unexpected frame kind {k}: {f:?}"),
        }
    }
    assert!(
        entries.contains(&("d/a2".to_string(), HARDLINK)),
        "{entries:?}"
    );
    assert!(
        entries.contains(&("d/z".to_string(), REGULAR)),
        "{entries:?}"
    );
    assert!(
        entries.contains(&("d/zz".to_string(), HARDLINK)),
        "{entries:?}"
    );
}

#[test]
fn put_never_replaces_a_directory() {
    let dir = TempDir::new();
    let x = dir.path().join("x");
    fs::create_dir(&x).unwrap();
    fs::write(x.join("keep"), "kept").unwrap();
    let mut h = Helper::start();
    h.send_path(PUT, 1, dir.path());
    h.send_entry(1, &entry("x", REGULAR, 0o644, 5, ""));
    h.send_data(STDIN, 1, b"hello");
    h.send_entry(1, &entry("y", REGULAR, 0o644, 0, ""));
    h.send_empty(STDIN_EOF, 1);
    let f = h.recv();
    assert_eq!(file_error(&f), (FileError::IsDir, "x".to_string()));
    // The rest is discarded, its data still acknowledged; nothing else follows.
    let f = h.recv();
    assert_eq!(
        (f.kind, Dec::new(&f.payload).u32().unwrap()),
        (STDIN_ACK, 5)
    );
    h.send_empty(PING, 2);
    assert_eq!(h.recv().kind, PONG);
    assert_eq!(fs::read_to_string(x.join("keep")).unwrap(), "kept");
    assert!(!dir.path().join("y").exists());
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);

    // A file where a directory goes.
    fs::write(dir.path().join("file"), "").unwrap();
    h.send_path(PUT, 3, dir.path());
    h.send_entry(3, &entry("file", DIRECTORY, 0o755, 0, ""));
    h.send_empty(STDIN_EOF, 3);
    assert_eq!(file_error(&h.recv()).0, FileError::NotDir);
}

#[test]
fn put_rejects_bad_paths_and_bases() {
    let dir = TempDir::new();
    let mut h = Helper::start();
    for (id, path) in [(1, "../escape"), (2, "/abs"), (3, "a//b"), (4, "")] {
        h.send_path(PUT, id, dir.path());
        h.send_entry(id, &entry(path, REGULAR, 0o644, 0, ""));
        h.send_empty(STDIN_EOF, id);
        assert_eq!(file_error(&h.recv()).0, FileError::Invalid, "{path}");
    }
    h.send_path(PUT, 5, &dir.path().join("missing"));
    h.send_empty(STDIN_EOF, 5);
    assert_eq!(file_error(&h.recv()), (FileError::NotFound, String::new()));
    fs::write(dir.path().join("file"), "").unwrap();
    h.send_path(PUT, 6, &dir.path().join("file"));
    h.send_empty(STDIN_EOF, 6);
    assert_eq!(file_error(&h.recv()), (FileError::NotDir, String::new()));
}

#[test]
fn get_of_a_missing_path() {
    let dir = TempDir::new();
    let mut h = Helper::start();
    h.send_path(GET, 1, &dir.path().join("missing"));
    assert_eq!(file_error(&h.recv()).0, FileError::NotFound);
    // Under a non-directory (ENOTDIR): not found either.
    fs::write(dir.path().join("file"), "").unwrap();
    h.send_path(GET, 2, &dir.path().join("file").join("x"));
    assert_eq!(file_error(&h.recv()).0, FileError::NotFound);
}

#[test]
fn discard_abandons_a_get() {
    let dir = TempDir::new();
    let path = dir.path().join("big");
    fs::write(&path, noise(8 * INITIAL_CREDIT as usize)).unwrap();
    let mut h = Helper::start();
    let idle = idle_threads(&mut h);
    h.send_path(GET, 1, &path);
    // ENTRY and STDOUT up to the initial credit.
    let mut got = 0usize;
    while got < INITIAL_CREDIT as usize {
        let f = h.recv();
        assert_eq!(f.id, 1, "{f:?}");
        assert!(matches!(f.kind, ENTRY | STDOUT), "{f:?}");
        got += f.payload.len();
    }
    assert_eq!(got, INITIAL_CREDIT as usize);
    h.send_empty(DISCARD, 1);
    h.send_u32(CREDIT, 1, 1 << 20);
    h.send_empty(PING, 2);
    let f = h.recv();
    assert_eq!(
        (f.kind, f.id),
        (PONG, 2),
        "no frame of a discarded GET: {f:?}"
    );
    if let Some(f) = h.try_recv(Duration::from_millis(300)) {
        panic!("a frame after DISCARD: {f:?}");
    }
    // Its thread is gone and the file is closed.
    assert_threads_back_to(&h, idle);
    let open = fs::read_dir(format!("/proc/{}/fd", h.hello.pid))
        .unwrap()
        .filter_map(|e| fs::read_link(e.unwrap().path()).ok())
        .any(|target| target == path);
    assert!(!open, "the helper still has the file open");
    h.send_empty(PING, 3);
    assert_eq!(h.recv().kind, PONG);
}

#[test]
fn get_entries_count_against_the_credit() {
    let dir = TempDir::new();
    let tree = dir.path().join("many");
    fs::create_dir(&tree).unwrap();
    let count = 6000;
    for i in 0..count {
        fs::write(tree.join(format!("{i:06}-{}", "n".repeat(200))), "").unwrap();
    }
    let mut h = Helper::start();
    h.send_path(GET, 1, &tree);
    // Entries up to the initial credit (the next one, a few hundred bytes, does not fit),
    // then nothing.
    let mut got = 0usize;
    let mut entries = 0;
    loop {
        let f = if got <= INITIAL_CREDIT as usize - 1024 {
            h.recv()
        } else {
            match h.try_recv(Duration::from_millis(500)) {
                Some(f) => f,
                None => break,
            }
        };
        assert_eq!((f.kind, f.id), (ENTRY, 1), "{f:?}");
        got += f.payload.len();
        entries += 1;
        assert!(got <= INITIAL_CREDIT as usize, "{got} bytes without credit");
    }
    assert!(entries < count, "all entries without credit");
    // With credit, the rest.
    h.send_u32(CREDIT, 1, got as u32);
    loop {
        let f = h.recv();
        assert_eq!(f.id, 1, "{f:?}");
        match f.kind {
            ENTRY => {
                entries += 1;
                h.send_u32(CREDIT, 1, f.payload.len() as u32);
            }
            DONE => break,
            k => panic!("unexpected frame kind {k}"),
        }
    }
    assert_eq!(entries, count + 1);
}

#[test]
fn a_file_that_shrinks_while_it_is_read_fails_the_get_naming_it() {
    let dir = TempDir::new();
    let d = dir.path().join("d");
    fs::create_dir(&d).unwrap();
    fs::write(d.join("a"), "first").unwrap();
    fs::write(d.join("big"), noise(8 * INITIAL_CREDIT as usize)).unwrap();
    fs::write(d.join("z"), "last").unwrap();
    let mut h = Helper::start();
    h.send_path(GET, 1, &d);
    // Everything the initial credit allows, without granting more: the helper is in the
    // middle of `big`.
    let mut got = 0usize;
    while got < INITIAL_CREDIT as usize {
        let f = h.recv();
        assert!(matches!(f.kind, ENTRY | STDOUT), "{f:?}");
        got += f.payload.len();
    }
    fs::OpenOptions::new()
        .write(true)
        .open(d.join("big"))
        .unwrap()
        .set_len(1000)
        .unwrap();
    h.send_u32(CREDIT, 1, INITIAL_CREDIT);
    let (entries, last) = get_entries(&mut h, 1);
    let paths: Vec<&str> = entries.iter().map(|e| e.path.as_str()).collect();
    assert!(paths.is_empty(), "entries after the cut file: {paths:?}");
    assert_eq!(file_error(&last), (FileError::Other, "d/big".to_string()));
    let msg = String::from_utf8_lossy(&last.payload).into_owned();
    assert!(msg.contains("shrank"), "{msg}");
}

#[test]
fn a_fifo_asked_for_is_an_error_and_an_entry_below_a_directory() {
    let dir = TempDir::new();
    let d = dir.path().join("d");
    fs::create_dir(&d).unwrap();
    fs::write(d.join("file"), "x").unwrap();
    let fifo = d.join("fifo");
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    let mut h = Helper::start();
    h.send_path(GET, 1, &fifo);
    assert_eq!(
        file_error(&h.recv()),
        (FileError::Invalid, "fifo".to_string())
    );
    h.send_path(GET, 2, &d);
    let (entries, last) = get_entries(&mut h, 2);
    assert_eq!(last.kind, DONE, "{last:?}");
    let seen: Vec<(String, u8)> = entries.iter().map(|e| (e.path.clone(), e.kind)).collect();
    assert_eq!(
        seen,
        [
            ("d".to_string(), DIRECTORY),
            ("d/fifo".to_string(), FIFO),
            ("d/file".to_string(), REGULAR)
        ]
    );
}

/// One entry of a `GET`, as [`get_entries`] reads it.
struct Got {
    path: String,
    kind: u8,
    link: String,
    size: u64,
}

/// Reads a GET's frames until its last one (`DONE` or `FILE_ERROR`), granting credit
/// for its data: the entries and the last frame.
fn get_entries(h: &mut Helper, id: u32) -> (Vec<Got>, Frame) {
    let mut entries = Vec::new();
    loop {
        let f = h.recv();
        assert_eq!(f.id, id, "{f:?}");
        match f.kind {
            ENTRY => {
                let e = Entry::decode(&mut Dec::new(&f.payload)).unwrap();
                entries.push(Got {
                    path: String::from_utf8(e.path).unwrap(),
                    kind: e.kind,
                    link: String::from_utf8(e.link).unwrap(),
                    size: e.size,
                });
            }
            STDOUT => h.send_u32(CREDIT, id, f.payload.len() as u32),
            DONE | FILE_ERROR => return (entries, f),
            k => panic!("unexpected frame kind {k}: {f:?}"),
        }
    }
}

/// A file with other names is sent once; each later name is a `HARDLINK` to the path
/// it was sent under (data once), also across directories; a file with one name, or
/// linked only from outside the tree, is a plain file.
#[test]
fn hard_links_are_sent_once_and_named_after() {
    let dir = TempDir::new();
    let d = dir.path().join("d");
    fs::create_dir_all(d.join("sub")).unwrap();
    fs::write(d.join("a"), "12345").unwrap();
    fs::hard_link(d.join("a"), d.join("b")).unwrap();
    fs::hard_link(d.join("a"), d.join("sub/c")).unwrap();
    fs::write(dir.path().join("outside"), "xy").unwrap();
    fs::hard_link(dir.path().join("outside"), d.join("only")).unwrap();
    let mut h = Helper::start();
    h.send_path(GET, 1, &d);
    let (entries, last) = get_entries(&mut h, 1);
    assert_eq!(last.kind, DONE, "{last:?}");
    let seen: Vec<(&str, u8, &str, u64)> = entries
        .iter()
        .map(|e| (e.path.as_str(), e.kind, e.link.as_str(), e.size))
        .collect();
    assert_eq!(
        seen,
        [
            ("d", DIRECTORY, "", 0),
            ("d/a", REGULAR, "", 5),
            ("d/b", HARDLINK, "d/a", 0),
            ("d/only", REGULAR, "", 2),
            ("d/sub", DIRECTORY, "", 0),
            ("d/sub/c", HARDLINK, "d/a", 0),
        ]
    );
}

#[test]
fn a_put_leaves_blocks_of_zeros_as_holes() {
    let dir = TempDir::new();
    let size = 8usize << 20;
    let mut data = vec![0u8; size];
    data[..5].copy_from_slice(b"start");
    data[3 << 20..(3 << 20) + 3].copy_from_slice(b"mid");
    // Unaligned data around a block boundary, then zeros to the end (a hole at the end).
    data[(4 << 20) - 2..(4 << 20) + 2].copy_from_slice(b"edge");
    let mut h = Helper::start();
    h.send_path(PUT, 1, dir.path());
    h.send_entry(1, &entry("sparse", REGULAR, 0o644, size as u64, ""));
    // Chunks that do not line up with the hole blocks.
    for c in data.chunks(CHUNK - 100) {
        h.send_data(STDIN, 1, c);
    }
    h.send_empty(STDIN_EOF, 1);
    assert_eq!(put_result(&mut h, 1).0.kind, DONE);
    let path = dir.path().join("sparse");
    assert_eq!(fs::read(&path).unwrap(), data);
    let md = fs::metadata(&path).unwrap();
    assert_eq!(md.len(), size as u64);
    // A few blocks of data, not 8 MiB.
    assert!(
        md.blocks() * 512 < 1 << 20,
        "{} bytes allocated for {size} bytes, mostly zeros",
        md.blocks() * 512
    );
}

#[test]
fn a_put_cut_by_the_end_of_the_connection_leaves_no_temporary_file() {
    let dir = TempDir::new();
    let mut h = Helper::start();
    h.send_path(PUT, 1, dir.path());
    h.send_entry(1, &entry("whole", REGULAR, 0o644, 3, ""));
    h.send_data(STDIN, 1, b"abc");
    h.send_entry(1, &entry("cut", REGULAR, 0o644, 100_000, ""));
    h.send_data(STDIN, 1, &noise(1000));
    // Both acked: the temporary file of `cut` exists now.
    let mut acked = 0;
    while acked < 1003 {
        let f = h.recv();
        assert_eq!(f.kind, STDIN_ACK, "{f:?}");
        acked += Dec::new(&f.payload).u32().unwrap() as usize;
    }
    let names = || -> Vec<String> {
        let mut n: Vec<String> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        n.sort();
        n
    };
    assert_eq!(names().len(), 2, "{:?}", names());
    assert!(h.close().success());
    assert_eq!(names(), ["whole"]);
}

unsafe extern "C" {
    fn renameat2(
        from_dir: i32,
        from: *const std::ffi::c_char,
        to_dir: i32,
        to: *const std::ffi::c_char,
        flags: u32,
    ) -> i32;
}

/// Exchanges two names atomically (`RENAME_EXCHANGE`); false if refused.
fn exchange(a: &std::ffi::CStr, b: &std::ffi::CStr) -> bool {
    // SAFETY: NUL-terminated names that outlive the call; AT_FDCWD and RENAME_EXCHANGE.
    unsafe { renameat2(-100, a.as_ptr(), -100, b.as_ptr(), 2) == 0 }
}

/// Runs a PUT of `entries` (regular files get `data`) into `base`: true if `DONE`, false
/// if a refusal (a link not followed, a non-directory in the way, a name missing).
fn put_ok(h: &mut Helper, id: u32, base: &Path, entries: &[Entry], data: &[u8]) -> bool {
    h.send_path(PUT, id, base);
    for e in entries {
        h.send_entry(id, e);
        if e.kind == REGULAR && e.size > 0 {
            h.send_data(STDIN, id, data);
        }
    }
    h.send_empty(STDIN_EOF, id);
    let (f, _) = put_result(h, id);
    if f.kind == DONE {
        return true;
    }
    let (kind, _) = file_error(&f);
    assert!(
        matches!(
            kind,
            FileError::Untrusted | FileError::NotDir | FileError::NotFound
        ),
        "{f:?}"
    );
    // The data after the failure is still acknowledged: drain to a PONG.
    h.send_empty(PING, id);
    while h.recv().kind != PONG {}
    false
}

/// A directory of another user whose `d` keeps trading places with a link to a root-only
/// directory: PUTs through it, PUTs of a directory entry at it and GETs of it never touch
/// or read the root-only directory, and a path through a link in it is refused.
#[test]
fn a_link_another_user_swaps_in_is_never_followed() {
    use std::os::unix::ffi::OsStrExt;
    if !is_root() {
        eprintln!("skipped: needs root");
        return;
    }
    let dir = TempDir::new();
    let canary = dir.path().join("canary");
    fs::create_dir(&canary).unwrap();
    fs::set_permissions(&canary, fs::Permissions::from_mode(0o700)).unwrap();
    fs::write(canary.join("secret"), "secret").unwrap();
    let race = dir.path().join("race");
    fs::create_dir_all(race.join("d")).unwrap();
    std::os::unix::fs::symlink(&canary, race.join("l")).unwrap();
    std::os::unix::fs::chown(&race, Some(65534), Some(65534)).unwrap();
    let c = |p: PathBuf| std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    let (d, l) = (c(race.join("d")), c(race.join("l")));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let swapper = {
        let stop = stop.clone();
        thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                assert!(exchange(&d, &l), "{}", std::io::Error::last_os_error());
                n += 1;
            }
            n
        })
    };
    let mut h = Helper::start();
    let (mut done, mut refused) = (0, 0);
    let mut tally = |ok: bool| if ok { done += 1 } else { refused += 1 };
    let mut id = 0;
    for _ in 0..300 {
        id += 3;
        let planted = entry("planted", REGULAR, 0o4777, 3, "");
        tally(put_ok(&mut h, id, &race.join("d"), &[planted], b"pwn"));
        let at_d = entry("d", DIRECTORY, 0o777, 0, "");
        let below = entry("d/planted", REGULAR, 0o4777, 3, "");
        tally(put_ok(&mut h, id + 1, &race, &[at_d, below], b"pwn"));
        h.send_path(GET, id + 2, &race.join("d"));
        loop {
            let f = h.recv();
            match f.kind {
                STDOUT => {
                    assert!(!f.payload.windows(6).any(|w| w == b"secret"));
                    h.send_u32(CREDIT, id + 2, f.payload.len() as u32);
                }
                ENTRY => {}
                DONE => break,
                FILE_ERROR => break,
                k => panic!("unexpected frame kind {k}"),
            }
        }
    }
    id += 3;
    h.send_path(GET, id, &race.join("l").join("secret"));
    let (kind, _) = file_error(&h.recv());
    assert!(matches!(kind, FileError::Untrusted | FileError::NotFound));
    stop.store(true, Ordering::Relaxed);
    let swaps = swapper.join().unwrap();
    let md = fs::metadata(&canary).unwrap();
    assert_eq!((md.mode() & 0o7777, md.uid()), (0o700, 0));
    let names: Vec<_> = fs::read_dir(&canary)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("secret")]);
    assert_eq!(fs::read_to_string(canary.join("secret")).unwrap(), "secret");
    assert!(
        done > 0 && refused > 0,
        "{done} done, {refused} refused, {swaps} swaps"
    );
}
