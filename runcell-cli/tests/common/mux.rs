//! The run's mux as the CLI tests see it: a test's own runtime directory (its muxes and
//! sockets are its own), and cases every driver's CLI test runs.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use super::{Sandbox, code, run, signal, text};

/// A test's sandbox handle and its runtime directory.
pub struct Muxed {
    pub sb: Sandbox,
    pub runtime: tempfile::TempDir,
}

impl Muxed {
    /// `None` where `driver`'s backend does not answer and the run is not strict.
    pub fn new(driver: &str, case: &str) -> Option<Muxed> {
        Sandbox::new(driver, case).map(Muxed::with)
    }

    /// `sb` with a runtime directory of its own.
    pub fn with(sb: Sandbox) -> Muxed {
        let runtime = tempfile::tempdir().unwrap();
        std::fs::set_permissions(
            runtime.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o700),
        )
        .unwrap();
        Muxed { sb, runtime }
    }

    /// `sandbox ARGS` with this test's runtime directory and `RUNCELL_MUX=mode`.
    pub fn cmd(&self, mode: &str, args: &[&str]) -> Command {
        let mut c = self.sb.cmd(args);
        c.env("XDG_RUNTIME_DIR", self.runtime.path())
            .env("RUNCELL_MUX", mode);
        c
    }

    pub fn exec(&self, mode: &str, run: &str, args: &[&str], argv: &[&str]) -> Command {
        let mut all = vec!["exec", run];
        all.extend(args);
        all.push("--");
        all.extend(argv);
        self.cmd(mode, &all)
    }

    pub fn sockets(&self) -> Vec<PathBuf> {
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
    pub fn muxes(&self) -> Vec<u32> {
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
pub fn first_line(mut cmd: Command) -> (std::process::Child, String) {
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

/// The one exec of the run whose command line has `script`, and whether it runs.
pub fn exec_id_of(m: &Muxed, run_id: &str, script: &str) -> Option<(u64, bool)> {
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

/// A `sandbox exec` SIGKILLed mid-command, through the mux or not: the command runs on,
/// `sandbox ps` lists it running, and `sandbox logs -f --from 0` from another process
/// reads every byte and passes its status through. Stops the run and checks nothing is
/// left.
pub fn a_killed_exec_leaves_every_byte(m: &Muxed) {
    let id = m.sb.start(&[]);
    let expected: String = (1..=40).map(|i| format!("{i}\n")).collect();
    for mode in ["require", "off"] {
        let script = format!("for i in $(seq 1 40); do echo $i; sleep 0.1; done # {mode}");
        let (mut child, line) = first_line(m.exec(mode, &id, &[], &["sh", "-c", &script]));
        assert_eq!(line, "1\n");
        signal(child.id(), "KILL");
        child.wait().unwrap();
        // It runs on; another process reads all of it from 0 and gets its status.
        let (exec, running) = exec_id_of(m, &id, &script).expect("ps lists the command");
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
