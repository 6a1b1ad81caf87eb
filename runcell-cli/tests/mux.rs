//! The run's mux against the Docker engine: `sandbox exec` through it behaves as a direct
//! one (output, stderr, stdin, exit codes, timeout, env, user, interrupt), its socket is
//! private, `stop` and idleness end it, and a `sandbox exec` killed mid-command (through
//! the mux or not) leaves the command to `sandbox logs -f`, which reads all of it.
//!
//! Each test has its own `XDG_RUNTIME_DIR`, so its muxes and sockets are its own.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{Sandbox, code, eventually, run, run_with_stdin, signal, text};

/// A test's sandbox handle and its runtime directory.
struct Muxed {
    sb: Sandbox,
    runtime: tempfile::TempDir,
}

impl Muxed {
    fn new(case: &str) -> Option<Muxed> {
        let sb = Sandbox::new("docker", case)?;
        let runtime = tempfile::tempdir().unwrap();
        std::fs::set_permissions(
            runtime.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o700),
        )
        .unwrap();
        Some(Muxed { sb, runtime })
    }

    /// `sandbox ARGS` with this test's runtime directory and `RUNCELL_MUX=mode`.
    fn cmd(&self, mode: &str, args: &[&str]) -> Command {
        let mut c = self.sb.cmd(args);
        c.env("XDG_RUNTIME_DIR", self.runtime.path())
            .env("RUNCELL_MUX", mode);
        c
    }

    fn exec(&self, mode: &str, run: &str, args: &[&str], argv: &[&str]) -> Command {
        let mut all = vec!["exec", run];
        all.extend(args);
        all.push("--");
        all.extend(argv);
        self.cmd(mode, &all)
    }

    fn sockets(&self) -> Vec<PathBuf> {
        let dir = self.runtime.path().join("runcell");
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return Vec::new();
        };
        entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "sock"))
            .collect()
    }

    /// The pids of this test's muxes.
    fn muxes(&self) -> Vec<u32> {
        let want = format!("XDG_RUNTIME_DIR={}", self.runtime.path().display());
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| {
                let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
                let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .is_ok_and(|s| s.rsplit(") ").next().is_some_and(|r| r.starts_with('Z')));
                !zombie
                    && cmdline.split(|&b| b == 0).any(|a| a == b"__mux")
                    && environ.split(|&b| b == 0).any(|v| v == want.as_bytes())
            })
            .collect()
    }
}

/// Starts `cmd` (stdout piped, stderr dropped) and reads the first line it prints.
fn first_line(mut cmd: Command) -> (std::process::Child, String) {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    (child, line)
}

fn mode_of(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().mode() & 0o7777
}

#[test]
fn exec_through_the_mux_is_a_direct_exec() {
    let Some(m) = Muxed::new("mux-exec") else {
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
    let Some(m) = Muxed::new("mux-dir") else {
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
    let Some(m) = Muxed::new("mux-idle") else {
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

/// The one exec of the run whose command line is `argv0`.
fn exec_id_of(m: &Muxed, run_id: &str, script: &str) -> Option<(u64, bool)> {
    let out = run(m.cmd("off", &["ps", "--json", run_id]));
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    rows.as_array()?
        .iter()
        .find(|r| {
            r["argv"]
                .as_array()
                .is_some_and(|a| a.iter().any(|x| x == script))
        })
        .map(|r| (r["id"].as_u64().unwrap(), r["running"] == true))
}

#[test]
fn a_killed_exec_leaves_its_command_to_logs_with_every_byte() {
    let Some(m) = Muxed::new("mux-sigkill") else {
        return;
    };
    let id = m.sb.start(&[]);
    let expected: String = (1..=40).map(|i| format!("{i}\n")).collect();
    for mode in ["require", "off"] {
        let script = format!("for i in $(seq 1 40); do echo $i; sleep 0.1; done # {mode}");
        let (mut child, line) = first_line(m.exec(mode, &id, &[], &["sh", "-c", &script]));
        assert_eq!(line, "1\n");
        signal(child.id(), "KILL");
        child.wait().unwrap();
        // It runs on; another process reads all of it from 0 and gets its status.
        let (exec, running) = exec_id_of(&m, &id, &script).expect("ps lists the command");
        assert!(running, "{mode}: the command did not outlive its client");
        let out = run(m.cmd(
            "off",
            &["logs", "-f", "--from", "0", &id, &exec.to_string()],
        ));
        assert_eq!(
            (code(&out), text(&out.stdout)),
            (0, expected.clone()),
            "{mode}: {}",
            text(&out.stderr)
        );
    }
    run(m.cmd("off", &["stop", &id]));
    m.sb.assert_nothing_left();
}

#[test]
fn a_mux_whose_run_was_removed_behind_its_back_exits() {
    let Some(m) = Muxed::new("mux-removed") else {
        return;
    };
    let id = m.sb.start(&[]);
    let out = run(m.exec("require", &id, &[], &["true"]));
    assert_eq!(code(&out), 0, "{}", text(&out.stderr));
    assert_eq!(m.muxes().len(), 1);
    let removed = Command::new("docker")
        .args(["rm", "-f", &id])
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
