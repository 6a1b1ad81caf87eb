//! The conformance suite every `sandbox` driver must pass: ours and third parties'.
//!
//! Each case is a public `async fn(&Context) -> anyhow::Result<()>`, so a driver's own
//! tests can call them one by one. [`CASES`] lists them with the capabilities they need;
//! [`run_case`] runs one and then asserts that the backend holds nothing labelled with
//! the case; [`harness::main`] is a whole `harness = false` test binary that picks the
//! driver from `RUNCELL_TEST=<name>` and its config from `RUNCELL_<NAME>_*`.
//!
//! The suite's image (`RUNCELL_CONFORMANCE_IMAGE`, default `sandbox-test/busybox:latest`,
//! built by `cargo xtask test-images`) must have a POSIX shell with BusyBox-like tools,
//! and an ENTRYPOINT that would create `/entrypoint-ran` (the suite proves it never runs).
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::{Context as _, bail, ensure};
use futures::future::BoxFuture;
use runcell_core::{Capabilities, Driver, ExecOutput, ExecSpec, Network, Run, RunExt, RunSpec};

pub mod cases;
pub mod harness;
pub mod pooled;

pub use cases::CASES;

/// The label that marks everything one suite session creates.
pub const SESSION_LABEL: &str = "sandbox.conformance/session";
/// The label that marks everything one case creates.
pub const CASE_LABEL: &str = "sandbox.conformance/case";
/// The default image of the suite.
pub const DEFAULT_IMAGE: &str = "sandbox-test/busybox:latest";
/// The default image without `sleep` (`RUNCELL_CONFORMANCE_NO_SLEEP_IMAGE`).
pub const DEFAULT_NO_SLEEP_IMAGE: &str = "sandbox-test/no-sleep:latest";
/// The default image whose `sleep` exits at once (`RUNCELL_CONFORMANCE_SLEEP_EXITS_IMAGE`).
pub const DEFAULT_SLEEP_EXITS_IMAGE: &str = "sandbox-test/sleep-exits:latest";

/// The default image without `tar` (`RUNCELL_CONFORMANCE_NO_TAR_IMAGE`).
pub const DEFAULT_NO_TAR_IMAGE: &str = "sandbox-test/no-tar:latest";

/// The image without `tar` the file cases of the exec helper use.
pub fn no_tar_image() -> String {
    runcell_core::envvar::var("RUNCELL_CONFORMANCE_NO_TAR_IMAGE")
        .unwrap_or_else(|| DEFAULT_NO_TAR_IMAGE.into())
}

/// The image without `sleep` the keep-alive case uses.
pub fn no_sleep_image() -> String {
    runcell_core::envvar::var("RUNCELL_CONFORMANCE_NO_SLEEP_IMAGE")
        .unwrap_or_else(|| DEFAULT_NO_SLEEP_IMAGE.into())
}

/// The image whose `sleep` exits at once the keep-alive case uses.
pub fn sleep_exits_image() -> String {
    runcell_core::envvar::var("RUNCELL_CONFORMANCE_SLEEP_EXITS_IMAGE")
        .unwrap_or_else(|| DEFAULT_SLEEP_EXITS_IMAGE.into())
}

/// A self-signed test CA (its key was thrown away).
pub const TEST_CA: &str = include_str!("../testdata/test-ca.pem");

/// What a case runs against: the driver, its capabilities, the image and the labels that
/// mark what the case creates.
#[derive(Debug, Clone)]
pub struct Context {
    /// The driver under test.
    pub driver: Arc<dyn Driver>,
    /// Its capabilities, read once.
    pub caps: Capabilities,
    /// The suite image.
    pub image: String,
    session: String,
    case: String,
}

impl Context {
    /// A context for a new suite session.
    pub fn new(driver: Arc<dyn Driver>, image: impl Into<String>) -> Context {
        let caps = driver.capabilities();
        Context {
            driver,
            caps,
            image: image.into(),
            session: format!("s{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff),
            case: "none".into(),
        }
    }

    /// The same session, marked for one case.
    pub fn for_case(&self, case: &str) -> Context {
        Context {
            case: case.replace('_', "-"),
            ..self.clone()
        }
    }

    /// The session id (label value).
    pub fn session(&self) -> &str {
        &self.session
    }

    /// A spec of the suite image with the case's labels and no network.
    pub fn spec(&self) -> RunSpec {
        let mut spec = RunSpec::new(&self.image)
            .label(SESSION_LABEL, &self.session)
            .label(CASE_LABEL, &self.case);
        if self.caps.network_none {
            spec.network = Network::None;
        }
        spec
    }

    /// [`Context::spec`] with another image.
    pub fn spec_with_image(&self, image: &str) -> RunSpec {
        RunSpec {
            image: image.into(),
            ..self.spec()
        }
    }

    /// The labels of this case.
    pub fn case_selector(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            (SESSION_LABEL.to_string(), self.session.clone()),
            (CASE_LABEL.to_string(), self.case.clone()),
        ])
    }

    /// The labels of the whole session.
    pub fn session_selector(&self) -> BTreeMap<String, String> {
        BTreeMap::from([(SESSION_LABEL.to_string(), self.session.clone())])
    }

    /// Fails if the backend holds anything labelled with this case.
    pub async fn assert_case_clean(&self) -> anyhow::Result<()> {
        let left = self.driver.list(&self.case_selector()).await?;
        ensure!(
            left.is_empty(),
            "runs left behind: {:?}",
            left.iter().map(|r| &r.id).collect::<Vec<_>>()
        );
        Ok(())
    }

    /// Fails if the backend holds anything labelled with this session, or a snapshot this
    /// process took (removed, then reported).
    pub async fn assert_session_clean(&self) -> anyhow::Result<()> {
        let left = self.driver.list(&self.session_selector()).await?;
        let me = Some(runcell_core::labels::Owner::current());
        let mut snapshots = Vec::new();
        for snapshot in self.driver.snapshots().await? {
            if snapshot.owner() == me {
                if let Err(e) = self.driver.remove_snapshot(&snapshot.id).await {
                    eprintln!("removing a left snapshot {}: {e}", snapshot.id);
                }
                snapshots.push(snapshot.id);
            }
        }
        ensure!(
            left.is_empty() && snapshots.is_empty(),
            "runs left behind by the session: {:?}; snapshots: {snapshots:?}",
            left.iter().map(|r| &r.id).collect::<Vec<_>>()
        );
        Ok(())
    }

    /// A context for a suite session with a given id (a label value), e.g. one the caller
    /// chose so that it can look for leftovers of exactly this session afterwards.
    pub fn with_session(
        driver: Arc<dyn Driver>,
        image: impl Into<String>,
        session: impl Into<String>,
    ) -> Context {
        Context {
            session: session.into(),
            ..Context::new(driver, image)
        }
    }
}

/// One case of the suite.
pub struct Case {
    /// Its name, as the test is called.
    pub name: &'static str,
    /// Whether it applies to a driver with these capabilities.
    pub applies: fn(&Capabilities) -> bool,
    /// The case itself.
    pub run: for<'a> fn(&'a Context) -> BoxFuture<'a, anyhow::Result<()>>,
}

/// Cases that measure this process's memory: they run alone, so that other cases running
/// in parallel do not count against their bound.
pub const MEMORY_CASES: &[&str] = &[
    "large_output_streams_in_bounded_memory",
    "large_files_stream_in_bounded_memory",
    "garbage_on_the_helpers_streams_costs_only_its_session",
    "a_hostile_helper_binary_cannot_stall_or_bloat_the_host",
];

static EXCLUSIVE: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// Runs one case, then asserts that nothing labelled with it remains (also when it failed).
/// Cases in [`MEMORY_CASES`] wait until no other case runs, and hold the others off.
pub async fn run_case(cx: &Context, case: &Case) -> anyhow::Result<()> {
    let alone = MEMORY_CASES.contains(&case.name);
    let _alone = if alone {
        Some(EXCLUSIVE.write().await)
    } else {
        None
    };
    let _shared = if alone {
        None
    } else {
        Some(EXCLUSIVE.read().await)
    };
    let cx = cx.for_case(case.name);
    let result = (case.run)(&cx).await;
    let clean = cx.assert_case_clean().await;
    result?;
    clean
}

/// Runs every case that the driver's capabilities allow, in order; returns the failures.
pub async fn run_all(cx: &Context) -> Vec<(&'static str, anyhow::Error)> {
    let mut failures = Vec::new();
    for case in CASES.iter().filter(|c| (c.applies)(&cx.caps)) {
        if let Err(e) = run_case(cx, case).await {
            failures.push((case.name, e));
        }
    }
    failures
}

/// Runs `argv` and returns its output, failing on anything but exit 0.
pub async fn sh_ok(run: &dyn Run, script: &str) -> anyhow::Result<ExecOutput> {
    let out = run.exec(ExecSpec::new(["sh", "-c", script])).await?;
    if !out.status.success() {
        bail!(
            "`{script}` {}; stdout {:?}; stderr {:?}",
            out.status,
            out.stdout_str(),
            out.stderr_str()
        );
    }
    Ok(out)
}

/// Runs a shell script and returns its trimmed stdout.
pub async fn sh_stdout(run: &dyn Run, script: &str) -> anyhow::Result<String> {
    let out = sh_ok(run, script)
        .await
        .with_context(|| format!("running {script:?}"))?;
    Ok(out.stdout_str().trim_end().to_string())
}

/// Samples this process's resident memory in the background, for bounded-memory cases.
pub struct RssSampler {
    before: Option<u64>,
    stop: tokio::sync::oneshot::Sender<()>,
    peak: tokio::task::JoinHandle<u64>,
}

impl RssSampler {
    /// Starts sampling every 20 ms.
    pub fn start() -> RssSampler {
        let before = rss_bytes();
        let (stop, mut stopped) = tokio::sync::oneshot::channel();
        let peak = tokio::spawn(async move {
            let mut peak = 0;
            loop {
                peak = peak.max(rss_bytes().unwrap_or(0));
                tokio::select! {
                    _ = &mut stopped => return peak,
                    _ = tokio::time::sleep(std::time::Duration::from_millis(20)) => {}
                }
            }
        });
        RssSampler { before, stop, peak }
    }

    /// The peak growth over the start, `None` where `/proc` cannot tell.
    pub async fn stop(self) -> Option<u64> {
        let before = self.before?;
        let _ = self.stop.send(());
        let peak = self.peak.await.ok()?.max(rss_bytes()?);
        Some(peak.saturating_sub(before))
    }
}

/// This process's resident set size, from `/proc/self/status`.
pub fn rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}
