//! The run's mux against the Docker engine: `sandbox exec` through it behaves as a direct
//! one (output, stderr, stdin, exit codes, timeout, env, user, interrupt), its socket is
//! private, `stop` and idleness end it, and a `sandbox exec` killed mid-command (through
//! the mux or not) leaves the command to `sandbox logs -f`, which reads all of it.
//!
//! Each test has its own `XDG_RUNTIME_DIR`, so its muxes and sockets are its own.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::mux::{Muxed, a_killed_exec_leaves_every_byte, first_line};
use common::{code, eventually, run, run_with_stdin, signal, text};

fn mode_of(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().mode() & 0o7777
}

#[test]
fn exec_through_the_mux_is_a_direct_exec() {
    let Some(m) = Muxed::new("docker", "mux-exec") else {
        return;
    };
    let id = m.sb.start(&[]);
    // Every case the same through the mux (required: started and awaited) and without.
    let stdin: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
    for mode in ["require", "off"] {
        let out = run(m.exec(
            mode,
            &id,
            &[],
            &["sh", "-c", "echo out; echo err >&2; exit 7"],
        ));
        assert_eq!(
            (code(&out), text(&out.stdout), text(&out.stderr)),
            (7, "out\n".into(), "err\n".into()),
            "{mode}"
        );
        let out = run_with_stdin(
            m.exec(mode, &id, &[], &["sh", "-c", "cat | md5sum"]),
            &stdin,
        );
        let direct = Command::new("md5sum")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .and_then(|mut c| {
                use std::io::Write;
                c.stdin.take().unwrap().write_all(&stdin)?;
                c.wait_with_output()
            })
            .unwrap();
        assert_eq!(
            text(&out.stdout).split_whitespace().next(),
            text(&direct.stdout).split_whitespace().next(),
            "{mode}: stdin arrived changed: {}",
            text(&out.stderr)
        );
        let out = run(m.exec(
            mode,
            &id,
            &["--env", "A=b c", "--workdir", "/tmp", "--user", "65534"],
            &["sh", "-c", "echo \"$A\" $(pwd) $(id -u)"],
        ));
        assert_eq!(text(&out.stdout), "b c /tmp 65534\n", "{mode}");
        let out = run(m.exec(mode, &id, &["--timeout", "1s"], &["sleep", "30"]));
        assert_eq!(code(&out), 124, "{mode}");
        assert!(
            text(&out.stderr).contains("timed out after 1s"),
            "{mode}: {}",
            text(&out.stderr)
        );
        let out = run(m.exec(mode, &id, &["--workdir", "/nope"], &["true"]));
        assert_eq!(code(&out), 123, "{mode}: {}", text(&out.stderr));
    }
    // One mux, its socket and directory this user's alone.
    let muxes = m.muxes();
    assert_eq!(muxes.len(), 1, "{muxes:?}");
    let sockets = m.sockets();
    assert_eq!(sockets.len(), 1, "{sockets:?}");
    assert_eq!(mode_of(&sockets[0]), 0o600);
    assert_eq!(mode_of(sockets[0].parent().unwrap()), 0o700);
    // Stop ends it and removes its socket; an exec after is told the run is gone.
    let out = run(m.cmd("on", &["stop", &id]));
    assert_eq!(code(&out), 0, "{}", text(&out.stderr));
    assert!(
        eventually(Duration::from_secs(10), || m.muxes().is_empty()),
        "the mux outlived stop: {:?}",
        m.muxes()
    );
    assert!(m.sockets().is_empty(), "{:?}", m.sockets());
    let out = run(m.exec("on", &id, &[], &["true"]));
    assert_ne!(code(&out), 0);
    m.sb.assert_nothing_left();
}

#[test]
fn a_private_directory_of_another_shape_is_not_used() {
    let Some(m) = Muxed::new("docker", "mux-dir") else {
        return;
    };
    let id = m.sb.start(&[]);
    // Open to others: not used (and `require` says so), the exec still runs without.
    let dir = m.runtime.path().join("runcell");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let out = run(m.exec("on", &id, &[], &["echo", "direct"]));
    assert_eq!((code(&out), text(&out.stdout)), (0, "direct\n".into()));
    let out = run(m.exec("require", &id, &[], &["true"]));
    assert_eq!(code(&out), 125);
    assert!(
        text(&out.stderr).contains("private directory"),
        "{}",
        text(&out.stderr)
    );
    assert!(m.muxes().is_empty());
    std::fs::remove_dir(&dir).unwrap();
    // A link there is not followed either.
    let elsewhere = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(elsewhere.path(), &dir).unwrap();
    let out = run(m.exec("require", &id, &[], &["true"]));
    assert_eq!(code(&out), 125, "{}", text(&out.stderr));
    assert_eq!(std::fs::read_dir(elsewhere.path()).unwrap().count(), 0);
    run(m.cmd("off", &["stop", &id]));
    m.sb.assert_nothing_left();
}

#[test]
fn an_idle_mux_exits_and_an_interrupt_through_it_kills_the_command() {
    let Some(m) = Muxed::new("docker", "mux-idle") else {
        return;
    };
    let id = m.sb.start(&[]);
    let mut cmd = m.exec(
        "require",
        &id,
        &[],
        &["sh", "-c", "echo started; sleep 1000"],
    );
    cmd.env("RUNCELL_MUX_IDLE", "2s");
    let (mut child, line) = first_line(cmd);
    assert_eq!(line, "started\n");
    signal(child.id(), "INT");
    assert_eq!(child.wait().unwrap().code(), Some(130));
    let out = run(m.exec(
        "off",
        &id,
        &[],
        &["sh", "-c", "ps | grep -c '[s]leep 1000'"],
    ));
    assert_eq!(text(&out.stdout).trim(), "0", "{}", text(&out.stderr));
    // Idle: gone after its 2 s, its socket with it.
    assert!(
        eventually(Duration::from_secs(15), || m.muxes().is_empty()),
        "the idle mux stayed"
    );
    assert!(m.sockets().is_empty(), "{:?}", m.sockets());
    run(m.cmd("off", &["stop", &id]));
    m.sb.assert_nothing_left();
}

#[test]
fn a_killed_exec_leaves_its_command_to_logs_with_every_byte() {
    if let Some(m) = Muxed::new("docker", "mux-sigkill") {
        a_killed_exec_leaves_every_byte(&m);
    }
}

#[test]
fn a_mux_whose_run_was_removed_behind_its_back_exits() {
    let Some(m) = Muxed::new("docker", "mux-removed") else {
        return;
    };
    let id = m.sb.start(&[]);
    let out = run(m.exec("require", &id, &[], &["true"]));
    assert_eq!(code(&out), 0, "{}", text(&out.stderr));
    assert_eq!(m.muxes().len(), 1);
    let removed = Command::new("docker")
        .args(["rm", "-f", "-v", &id])
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(removed.success());
    // It checks every 15 s while idle.
    assert!(
        eventually(Duration::from_secs(40), || m.muxes().is_empty()),
        "the mux outlived its run"
    );
    assert!(m.sockets().is_empty(), "{:?}", m.sockets());
    m.sb.assert_nothing_left();
}
