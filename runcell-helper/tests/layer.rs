//! Integration test of `BASE` and `LAYER` against a real daemon.
//!
//! Both walk the root filesystem from `/`, so the helper runs with a tree of the test's
//! own as its root: `unshare --mount` (a private mount namespace, so nothing is mounted
//! on the host) and `chroot`, with the host's `/usr` (the helper's libraries), `/proc`
//! and `/dev` bound in. Those are mount points there, skipped by both walks; so is the
//! helper's own directory (`/.runcell`). Needs root, `unshare` and `chroot`. The walks'
//! finer cases (hard links, fifos, links to directories, malformed listings) are unit
//! tests in `runcell-core/helper/layer.rs`.

mod common;

use std::fs;
use std::os::unix::fs::{MetadataExt, symlink};
use std::path::Path;
use std::process::{Command, Stdio};
use std::thread;
use std::time::Duration;

use common::*;

/// Kills the chrooted daemon (its pid, from its `HELLO`) however the test ends: the
/// harness finds daemons by their path on the host, which this one does not have.
struct KillDaemon(u32);

impl Drop for KillDaemon {
    fn drop(&mut self) {
        if let Some((_, start)) = proc_stat(self.0) {
            let _ = Command::new("kill")
                .args(["-9", &self.0.to_string()])
                .stderr(Stdio::null())
                .status();
            assert_gone(self.0, start);
        }
    }
}

/// Entries of a `LAYER` (path, kind, data) until its last frame, granting credit.
fn layer(h: &mut Helper, id: u32, workspace: &str) -> (Vec<(String, u8, String)>, Frame) {
    let mut e = Enc::frame(LAYER, id);
    e.bytes(workspace.as_bytes());
    h.send(e.finish());
    let mut entries: Vec<(String, u8, String)> = Vec::new();
    loop {
        let f = h.recv();
        assert_eq!(f.id, id, "{f:?}");
        match f.kind {
            ENTRY => {
                let e = Entry::decode(&mut Dec::new(&f.payload)).unwrap();
                let path = String::from_utf8(e.path).unwrap();
                entries.push((path, e.kind, String::new()));
                h.send_u32(CREDIT, id, f.payload.len() as u32);
            }
            STDOUT => {
                let last = entries.last_mut().unwrap();
                last.2.push_str(std::str::from_utf8(&f.payload).unwrap());
                h.send_u32(CREDIT, id, f.payload.len() as u32);
            }
            DONE | FILE_ERROR => return (entries, f),
            k => panic!("unexpected frame kind {k}: {f:?}"),
        }
    }
}

fn have(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
}

#[test]
fn base_then_layer_in_a_chrooted_daemon() {
    if !is_root() || !have("unshare") || !have("chroot") {
        eprintln!("skipped: needs root, unshare and chroot");
        return;
    }
    let tmp = TempDir::new();
    let root = tmp.path().join("root");
    for d in ["usr", "proc", "dev", ".runcell", "etc", "var", "ws/sub"] {
        fs::create_dir_all(root.join(d)).unwrap();
    }
    for (link, target) in [
        ("bin", "usr/bin"),
        ("lib", "usr/lib"),
        ("lib64", "usr/lib64"),
    ] {
        symlink(target, root.join(link)).unwrap();
    }
    let copied = Command::new("cp")
        .arg(BIN)
        .arg(root.join(".runcell/helper"))
        .status()
        .unwrap();
    assert!(copied.success());
    fs::write(root.join("etc/conf"), "old").unwrap();
    fs::write(root.join("etc/same"), "same").unwrap();
    fs::write(root.join("var/x"), "x").unwrap();
    fs::write(root.join("ws/sub/inner"), "in").unwrap();
    // Past the base's margin: nothing made above counts as changed.
    thread::sleep(Duration::from_millis(2500));

    let mut cmd = Command::new("unshare");
    cmd.args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg(
            "set -e; r=$1; \
             mount --rbind /usr \"$r/usr\"; mount --rbind /proc \"$r/proc\"; \
             mount --rbind /dev \"$r/dev\"; mount --bind \"$r/ws\" \"$r/ws\"; \
             exec chroot \"$r\" /.runcell/helper",
        )
        .arg("sh")
        .arg(&root);
    let inst = Instance::at(&root.join(".runcell/helper"));
    let mut h = Helper::start_cmd(inst, cmd);
    assert!(h.hello.durable, "{:?}", h.hello);
    let _daemon = KillDaemon(h.hello.pid);

    // No base yet: a layer fails, naming why.
    let (entries, last) = layer(&mut h, 1, "");
    assert!(entries.is_empty());
    assert_eq!(file_error(&last).0, FileError::Other);
    let msg = String::from_utf8_lossy(&last.payload).into_owned();
    assert!(msg.contains("the run has no base listing"), "{msg}");

    h.send_empty(BASE, 2);
    let f = h.recv();
    assert_eq!((f.kind, f.id), (DONE, 2), "{f:?}");
    let listing = root.join(".runcell/d/base");
    let first = fs::read(&listing).unwrap();
    assert!(first.starts_with(b"runcell-base 2 "));
    // Mount points and the helper's directory are no names of `/`; everything else is.
    let body = &first[first.iter().position(|&b| b == b'\n').unwrap() + 1..];
    let md = fs::metadata(&root).unwrap();
    let names = format!("\0{} {}\0bin\0etc\0lib\0lib64\0var\0\0", md.dev(), md.ino());
    assert!(
        body.starts_with(names.as_bytes()),
        "{}",
        String::from_utf8_lossy(body)
    );

    // Nothing changed: an empty layer; with the workspace (a mount point), it whole.
    let (entries, last) = layer(&mut h, 3, "");
    assert_eq!(
        (last.kind, entries.len()),
        (DONE, 0),
        "{entries:?} {last:?}"
    );
    let (entries, last) = layer(&mut h, 4, "/ws");
    assert_eq!(last.kind, DONE, "{last:?}");
    let ws = [
        ("ws".to_string(), DIRECTORY, String::new()),
        ("ws/.wh..wh..opq".into(), REGULAR, String::new()),
        ("ws/sub".into(), DIRECTORY, String::new()),
        ("ws/sub/inner".into(), REGULAR, "in".into()),
    ];
    assert_eq!(entries, ws);

    // What the run's code does, then.
    fs::write(root.join("etc/conf"), "new").unwrap();
    fs::remove_file(root.join("var/x")).unwrap();
    fs::write(root.join("added"), "+").unwrap();
    fs::write(root.join("added2"), "").unwrap();
    // A second BASE keeps the first listing.
    h.send_empty(BASE, 5);
    assert_eq!(h.recv().kind, DONE);
    assert_eq!(fs::read(&listing).unwrap(), first);

    let changed = vec![
        ("added".to_string(), REGULAR, "+".to_string()),
        ("added2".into(), REGULAR, String::new()),
        ("etc/conf".into(), REGULAR, "new".into()),
        ("var".into(), DIRECTORY, String::new()),
        ("var/.wh.x".into(), REGULAR, String::new()),
    ];
    let (entries, last) = layer(&mut h, 6, "");
    assert_eq!(last.kind, DONE, "{last:?}");
    assert_eq!(entries, changed);
    let (entries, _) = layer(&mut h, 7, "/ws");
    assert_eq!(entries, [changed, ws.to_vec()].concat());

    // A base listing the run's code broke: the layer fails.
    fs::write(&listing, "runcell-base 2 0 0\n\x001 2\0a/b\0\0").unwrap();
    let (_, last) = layer(&mut h, 8, "");
    let msg = String::from_utf8_lossy(&last.payload).into_owned();
    assert!(msg.contains("malformed"), "{msg}");
    assert!(Path::new(&listing).exists());
}
