//! What the CLI tests share: the real `sandbox` binary, a unique label per test, and the
//! check that nothing with it is left.
#![allow(dead_code)]

use std::io::Write;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The label key every run of these tests carries, with a value unique per test.
pub const TEST_LABEL: &str = "sandbox.cli-test/case";
/// The conformance session label (`cargo xtask test` checks none is left at its end).
pub const SESSION_LABEL: &str = "sandbox.conformance/session";

pub fn image() -> String {
    runcell_core::envvar::var("RUNCELL_CONFORMANCE_IMAGE")
        .unwrap_or_else(|| "sandbox-test/busybox:latest".into())
}

/// Whether a missing backend must fail the test instead of skipping it.
pub fn strict(driver: &str) -> bool {
    let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0");
    let required = runcell_core::envvar::var("RUNCELL_REQUIRE")
        .unwrap_or_default()
        .split(',')
        .any(|d| d.trim() == driver);
    ci || required
}

/// One test's view of the CLI: a driver, its flags, and the test's label.
pub struct Sandbox {
    pub driver: String,
    pub label_value: String,
    /// Flags before the subcommand (driver and config).
    pub global: Vec<String>,
}

impl Sandbox {
    /// A handle for test `case` on `driver`, or `None` (after saying so loudly) when the
    /// backend does not answer and the run is not strict. Strict: panics.
    pub fn new(driver: &str, case: &str) -> Option<Sandbox> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let sandbox = Sandbox {
            driver: driver.into(),
            label_value: format!("{case}-{}-{nanos:08x}", std::process::id()).replace('_', "-"),
            global: vec!["--driver".into(), driver.into()],
        };
        let out = sandbox.cmd(&["ls", "--all"]).output().expect("run sandbox");
        if !out.status.success() {
            let why = String::from_utf8_lossy(&out.stderr).into_owned();
            if strict(driver) {
                panic!(
                    "the {driver} backend must be reachable here (CI or RUNCELL_REQUIRE): {why}"
                );
            }
            eprintln!(
                "\n*** SKIPPED {case}: the {driver} backend does not answer (set RUNCELL_REQUIRE={driver} to make this a failure):\n{why}"
            );
            return None;
        }
        Some(sandbox)
    }

    /// `sandbox <global flags> ARGS`.
    pub fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_sandbox"));
        c.args(&self.global).args(args).stdin(Stdio::null());
        c.env_remove("RUST_LOG");
        c
    }

    /// The labels to give every run of this test.
    pub fn labels(&self) -> Vec<String> {
        let mut labels = vec![
            "--label".into(),
            format!("{TEST_LABEL}={}", self.label_value),
        ];
        if let Some(session) = runcell_core::envvar::var("RUNCELL_CONFORMANCE_SESSION")
            && !session.is_empty()
        {
            labels.extend(["--label".into(), format!("{SESSION_LABEL}={session}")]);
        }
        labels
    }

    pub fn selector(&self) -> String {
        format!("{TEST_LABEL}={}", self.label_value)
    }

    /// `sandbox start` with the test's labels and image (local: never pulled, so that no
    /// test reaches for a registry), plus `args`; the run id.
    pub fn start(&self, args: &[&str]) -> String {
        let image = image();
        let mut all = vec!["start", "--image", image.as_str(), "--pull", "never"];
        let labels = self.labels();
        all.extend(labels.iter().map(String::as_str));
        all.extend(args);
        let out = run(self.cmd(&all));
        assert!(out.status.success(), "start failed: {}", text(&out.stderr));
        let id = text(&out.stdout).trim().to_string();
        assert!(id.starts_with("sbx-"), "not a run id: {id:?}");
        id
    }

    /// `sandbox run` with the test's labels and image: `run [args] -- argv`.
    pub fn run_cmd(&self, args: &[&str], argv: &[&str]) -> Command {
        let image = image();
        let mut all = vec!["run", "--image", image.as_str(), "--pull", "never"];
        let labels = self.labels();
        all.extend(labels.iter().map(String::as_str));
        all.extend(args);
        all.push("--");
        all.extend(argv);
        self.cmd(&all)
    }

    /// `sandbox exec RUN [args] -- argv`.
    pub fn exec_cmd(&self, run: &str, args: &[&str], argv: &[&str]) -> Command {
        let mut all = vec!["exec", run];
        all.extend(args);
        all.push("--");
        all.extend(argv);
        self.cmd(&all)
    }

    /// The ids of this test's runs (all states).
    pub fn runs(&self) -> Vec<String> {
        let out = run(self.cmd(&["ls", "--all", "--json", "--label", &self.selector()]));
        assert!(out.status.success(), "ls failed: {}", text(&out.stderr));
        let rows: serde_json::Value = serde_json::from_slice(&out.stdout).expect("ls --json");
        rows.as_array()
            .expect("an array")
            .iter()
            .map(|r| r["id"].as_str().expect("an id").to_string())
            .collect()
    }

    /// Fails when a run of this test is left (after removing them, so a failure leaks
    /// nothing).
    pub fn assert_nothing_left(&self) {
        let left = self.runs();
        self.cleanup();
        assert!(left.is_empty(), "runs left behind: {left:?}");
    }

    fn cleanup(&self) {
        let ids = self.runs();
        if !ids.is_empty() {
            let mut args = vec!["stop"];
            args.extend(ids.iter().map(String::as_str));
            let _ = run(self.cmd(&args));
        }
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.cleanup();
        }
    }
}

/// Runs a command to its end, with a generous bound.
pub fn run(mut cmd: Command) -> Output {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn sandbox");
    wait_bounded(child, Duration::from_secs(180))
}

/// Runs a command with `input` on its stdin.
pub fn run_with_stdin(mut cmd: Command, input: &[u8]) -> Output {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn sandbox");
    let mut stdin = child.stdin.take().expect("stdin");
    let input = input.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(&input);
    });
    let out = wait_bounded(child, Duration::from_secs(180));
    writer.join().expect("stdin writer");
    out
}

fn wait_bounded(child: std::process::Child, limit: Duration) -> Output {
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => out.expect("wait for sandbox"),
        Err(_) => {
            signal(pid, "KILL");
            panic!("sandbox (pid {pid}) did not finish within {limit:?}");
        }
    }
}

/// Sends a signal (`INT`, `KILL`, ...) to a process.
pub fn signal(pid: u32, name: &str) {
    let status = Command::new("kill")
        .args([format!("-{name}"), pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{name} {pid} failed");
}

/// Waits until `f` is true, polling, for at most `limit`.
pub fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    false
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

pub fn code(out: &Output) -> i32 {
    out.status.code().unwrap_or(-1)
}
pub mod mux;
