//! `sandbox cp` transfers that fail or are cancelled partway, against the Docker engine,
//! on both exec paths. A copy out of a directory with a file its reader cannot read fails
//! naming the file. A copy interrupted by SIGINT exits 130 and leaves no temporary file,
//! on the host (the temporary file or staging directory of a copy out) or in the run (the
//! exec helper's temporary file of a copy in). Skipped loudly without an engine, as the
//! other CLI tests.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Sandbox, code, run, signal, text};

const HELPER_ENV: &str = "RUNCELL_EXEC_HELPER";

/// Names in a host directory.
fn names(dir: &Path) -> Vec<String> {
    let mut n: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    n.sort();
    n
}

/// Bytes below a host path (files only).
fn bytes_below(path: &Path) -> u64 {
    let Ok(md) = std::fs::symlink_metadata(path) else {
        return 0;
    };
    if md.is_dir() {
        std::fs::read_dir(path)
            .map(|d| d.flatten().map(|e| bytes_below(&e.path())).sum())
            .unwrap_or(0)
    } else {
        md.len()
    }
}

/// Polls `f` every 20 ms for up to a minute; panics with `what` if it never holds, or if
/// the child exits first (the copy ended before it could be interrupted).
fn wait_for(child: &mut Child, what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("sandbox cp ended ({status}) before {what}");
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            let mut said = String::new();
            if let Some(mut err) = child.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut err, &mut said);
            }
            panic!("never: {what}; sandbox cp said {said}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Interrupts the copy and checks it says so with 130.
fn interrupt(child: Child, what: &str) {
    signal(child.id(), "INT");
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(130),
        "{what}: {}",
        text(&out.stderr)
    );
}

fn spawn(mut cmd: Command) -> Child {
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn a_cancelled_cp_leaves_no_temporary_file() {
    let Some(sb) = Sandbox::new("docker", "cp-cancel") else {
        return;
    };
    for mode in ["required", "off"] {
        let cmd = |args: &[&str]| {
            let mut c = sb.cmd(args);
            c.env(HELPER_ENV, mode);
            c
        };
        let image = common::image();
        let mut start = vec!["start", "--image", image.as_str()];
        let labels = sb.labels();
        start.extend(labels.iter().map(String::as_str));
        let out = run(cmd(&start));
        assert_eq!(code(&out), 0, "{mode}: start: {}", text(&out.stderr));
        let id = text(&out.stdout).trim().to_string();
        let sh = |script: &str| {
            let out = run(cmd(&["exec", &id, "--", "sh", "-c", script]));
            assert_eq!(code(&out), 0, "{mode}: {script}: {}", text(&out.stderr));
            text(&out.stdout)
        };
        // Sparse in the run: quick to make, slow enough to copy.
        sh("truncate -s 8G /tmp/big && mkdir -p /tmp/dir /tmp/in && truncate -s 8G /tmp/dir/big");

        // Out, one file: interrupted once its temporary file on the host exists (it
        // fills with holes: the file is all zeros).
        let host = tempfile::tempdir().unwrap();
        let target = host.path().join("big");
        let mut child = spawn(cmd(&[
            "cp",
            &format!("{id}:/tmp/big"),
            target.to_str().unwrap(),
        ]));
        wait_for(&mut child, "a temporary file", || {
            names(host.path())
                .iter()
                .any(|n| n.starts_with(".sandbox-cp-"))
        });
        std::thread::sleep(Duration::from_millis(300));
        interrupt(child, &format!("{mode}: cp out of a file"));
        assert_eq!(
            names(host.path()),
            Vec::<String>::new(),
            "{mode}: a cancelled copy of a file left these on the host"
        );

        // Out, a directory to a new name: its staging directory is removed.
        let target = host.path().join("copy");
        let mut child = spawn(cmd(&[
            "cp",
            &format!("{id}:/tmp/dir"),
            target.to_str().unwrap(),
        ]));
        wait_for(&mut child, "the staging directory fills", || {
            names(host.path())
                .iter()
                .any(|n| n.starts_with(".sandbox-cp-") && bytes_below(&host.path().join(n)) > 0)
        });
        interrupt(child, &format!("{mode}: cp out of a directory"));
        assert_eq!(
            names(host.path()),
            Vec::<String>::new(),
            "{mode}: a cancelled copy of a directory left these on the host"
        );

        // In: interrupted mid-upload, no temporary file is left in the run. Through the
        // helper its temporary file is watched for; on the plain path Docker's archive API
        // holds the container while it extracts (no exec can look), so a moment is given.
        let source = host.path().join("in.bin");
        std::fs::File::create(&source)
            .unwrap()
            .set_len(8 << 30)
            .unwrap();
        let mut child = spawn(cmd(&[
            "cp",
            source.to_str().unwrap(),
            &format!("{id}:/tmp/in/"),
        ]));
        if mode == "required" {
            wait_for(&mut child, "a temporary file in the run", || {
                let out = run(cmd(&["exec", &id, "--", "ls", "-A", "/tmp/in"]));
                text(&out.stdout).contains(".runcell-tmp")
            });
        } else {
            std::thread::sleep(Duration::from_millis(1500));
            assert!(
                child.try_wait().unwrap().is_none(),
                "{mode}: the copy in ended before it could be interrupted"
            );
        }
        interrupt(child, &format!("{mode}: cp in"));
        // The helper removes its temporary file when the upload ends short.
        let mut left = String::new();
        let gone = common::eventually(Duration::from_secs(30), || {
            left = sh("ls -A /tmp/in");
            !left.contains(".runcell-tmp")
        });
        assert!(gone, "{mode}: a cancelled copy in left {left:?} in the run");
        if mode == "required" {
            // Nothing of the cut file either: it never reached its name.
            assert_eq!(left.trim(), "", "{mode}: left in the run");
        }
        let out = run(cmd(&["stop", &id]));
        assert_eq!(code(&out), 0, "{mode}: stop: {}", text(&out.stderr));
    }
    sb.assert_nothing_left();
}

/// The issue this guards against: a directory copied out of a run with a file its reader
/// may not read exited 0 with the files before it. Now the copy fails naming the file,
/// on the helper path and on an engine path that cannot read it either; Docker's archive
/// API reads as root and copies the whole directory.
#[test]
fn a_directory_with_an_unreadable_file_fails_the_copy_naming_it() {
    let Some(sb) = Sandbox::new("docker", "cp-unreadable") else {
        return;
    };
    for mode in ["required", "off"] {
        let cmd = |args: &[&str]| {
            let mut c = sb.cmd(args);
            c.env(HELPER_ENV, mode);
            c
        };
        let image = common::image();
        let mut start = vec!["start", "--image", image.as_str(), "--user", "1000:1000"];
        let labels = sb.labels();
        start.extend(labels.iter().map(String::as_str));
        let out = run(cmd(&start));
        assert_eq!(code(&out), 0, "{mode}: start: {}", text(&out.stderr));
        let id = text(&out.stdout).trim().to_string();
        let out = run(cmd(&[
            "exec",
            &id,
            "--",
            "sh",
            "-c",
            "mkdir -p /tmp/d && cd /tmp/d && echo a > a.txt && echo b > unreadable.txt && \
             echo z > z.txt && chmod 000 unreadable.txt",
        ]));
        assert_eq!(code(&out), 0, "{mode}: {}", text(&out.stderr));
        let host = tempfile::tempdir().unwrap();
        let target = host.path().join("copy");
        let out = run(cmd(&[
            "cp",
            &format!("{id}:/tmp/d"),
            target.to_str().unwrap(),
        ]));
        if mode == "required" || code(&out) != 0 {
            assert_eq!(code(&out), 125, "{mode}: {}", text(&out.stderr));
            assert!(
                text(&out.stderr).contains("unreadable.txt"),
                "{mode}: the error does not name the file: {}",
                text(&out.stderr)
            );
            assert_eq!(
                names(host.path()),
                Vec::<String>::new(),
                "{mode}: a failed copy left these"
            );
        } else {
            // Read by the engine, as root: all of it.
            assert_eq!(
                names(&target),
                ["a.txt", "unreadable.txt", "z.txt"],
                "{mode}"
            );
        }
        let out = run(cmd(&["stop", &id]));
        assert_eq!(code(&out), 0, "{mode}: stop: {}", text(&out.stderr));
    }
    sb.assert_nothing_left();
}
