//! A whole `harness = false` test binary for any registered driver:
//!
//! ```ignore
//! // tests/conformance.rs of a driver crate, with `harness = false` in Cargo.toml
//! use my_driver as _; // links the driver so that its registration is seen
//! fn main() { runcell_conformance::harness::main() }
//! ```
//!
//! The environment decides what it does:
//!
//! | variable | meaning |
//! |---|---|
//! | `RUNCELL_TEST=<name>` | the driver to test; its config comes from `RUNCELL_<NAME>_<KEY>` |
//! | `RUNCELL_TEST=none` | the suite deliberately does not run here (`cargo xtask test` sets it for its `cargo test --workspace` step and runs the suite per driver afterwards) |
//! | `RUNCELL_REQUIRE=a,b` | strict: every skip is a failure, and so is a listed driver that cannot be connected |
//! | `CI` (non-empty, not `false`/`0`) | strict, as above |
//! | `RUNCELL_CONFORMANCE_SESSION` | the session label value to put on every run (default: a random one), so that the caller can check for leftovers of exactly this session |
//! | `RUNCELL_CONFORMANCE_IMAGE` | the suite's image |
//! | `RUNCELL_CONFORMANCE_POOLED` | non-empty: every run comes from a warm pool ([`crate::pooled::PooledDriver`]) |
//!
//! Their deprecated spellings still work for this release, with a warning (see
//! [`runcell_core::envvar`]).
//!
//! With `RUNCELL_TEST` unset, a strict binary fails, saying what to set; otherwise it
//! prints a `skipped` line and shows one ignored test, so `cargo test --workspace` on a
//! developer's machine passes without a backend but never silently. A tested driver
//! whose backend is unreachable ([`ErrorKind::Unavailable`]) is skipped the same way, or
//! a failure when strict.

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use libtest_mimic::{Arguments, Trial};
use runcell_core::{DriverConfig, ErrorKind, RunSpec, envvar};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::{CASE_LABEL, CASES, Context, DEFAULT_IMAGE, SESSION_LABEL, run_case};

const CHILD_ENV: &str = "RUNCELL_CONFORMANCE_OWNER_CHILD";
/// The case label value of an owner child's run.
const CASE_ENV: &str = "RUNCELL_CONFORMANCE_CASE";
/// The variable that picks the driver under test (`none`: deliberately not run here).
pub const TEST_ENV: &str = "RUNCELL_TEST";
/// Comma-separated driver names whose absence is a failure; non-empty makes every skip one.
pub const REQUIRE_ENV: &str = "RUNCELL_REQUIRE";
/// The session label value for every run of this invocation (default: random).
pub const SESSION_ENV: &str = "RUNCELL_CONFORMANCE_SESSION";
/// The suite's image (default [`DEFAULT_IMAGE`]).
pub const IMAGE_ENV: &str = "RUNCELL_CONFORMANCE_IMAGE";

/// The entry point of a conformance test binary.
pub fn main() {
    // `RUST_LOG=runcell_core=debug` shows what the library does, on stderr.
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let runtime = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .expect("a Tokio runtime"),
    );
    if std::env::var_os(CHILD_ENV).is_some() {
        std::process::exit(match runtime.block_on(owner_child()) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("owner child: {e:#}");
                1
            }
        });
    }
    let args = Arguments::from_args();
    let strict = Strictness::from_env();
    let registered = runcell_core::driver_names().unwrap_or_default();
    let name = match Plan::new(envvar::var(TEST_ENV).as_deref(), &strict, &registered) {
        Plan::Test(name) => name,
        Plan::NotHere => {
            println!("conformance: not run here ({TEST_ENV}=none)");
            libtest_mimic::run(&args, Vec::new()).exit();
        }
        Plan::Skip { why, shown_as } => skip(&args, &why, &shown_as),
        Plan::Fail(message) => fail(&message),
    };
    let config = DriverConfig::from_env(&name);
    let driver = match runtime.block_on(runcell_core::connect(&name, config)) {
        Ok(d) => d,
        Err(e) if e.kind() == ErrorKind::Unavailable => {
            match Plan::unavailable(&name, &e.to_string(), &strict) {
                Plan::Skip { why, shown_as } => skip(&args, &why, &shown_as),
                Plan::Fail(message) => fail(&message),
                other => unreachable!("{other:?}"),
            }
        }
        Err(e) => fail(&format!("cannot connect driver {name}: {e}")),
    };
    let pooled = envvar::var(POOLED_ENV).is_some_and(|v| !v.is_empty() && v != "0");
    let driver: Arc<dyn runcell_core::Driver> = if pooled {
        match crate::pooled::PooledDriver::new(driver) {
            Ok(d) => Arc::new(d),
            Err(e) => fail(&format!("{POOLED_ENV}: {e:#}")),
        }
    } else {
        driver
    };
    let image = envvar::var(IMAGE_ENV).unwrap_or_else(|| DEFAULT_IMAGE.into());
    let cx = match envvar::var(SESSION_ENV) {
        Some(session) if !session.is_empty() => {
            if let Err(why) = runcell_core::labels::validate_value(&session) {
                fail(&format!("{SESSION_ENV}: {why}"));
            }
            Context::with_session(driver, image, session)
        }
        _ => Context::new(driver, image),
    };
    println!(
        "conformance: driver {name}{}, session {}, capabilities {:?}",
        if pooled {
            " (every run from a warm pool)"
        } else {
            ""
        },
        cx.session(),
        cx.caps
    );
    let trials = CASES
        .iter()
        .map(|case| {
            let (runtime, cx) = (runtime.clone(), cx.clone());
            let applies = (case.applies)(&cx.caps);
            Trial::test(format!("{name}::{}", case.name), move || {
                runtime
                    .block_on(run_case(&cx, case))
                    .map_err(|e| format!("{e:#}").into())
            })
            .with_ignored_flag(!applies)
        })
        .collect();
    let conclusion = libtest_mimic::run(&args, trials);
    if let Err(e) = runtime.block_on(cx.assert_session_clean()) {
        eprintln!("after the suite: {e:#}");
        std::process::exit(1);
    }
    conclusion.exit()
}

/// Whether a skip is allowed: not when `CI` is set or `RUNCELL_REQUIRE` names anything.
#[derive(Debug, Default)]
struct Strictness {
    ci: Option<String>,
    required: Vec<String>,
}

impl Strictness {
    fn from_env() -> Strictness {
        Strictness::new(
            std::env::var("CI").ok().as_deref(),
            envvar::var(REQUIRE_ENV).as_deref(),
        )
    }

    fn new(ci: Option<&str>, require: Option<&str>) -> Strictness {
        Strictness {
            ci: ci
                .filter(|v| !v.is_empty() && *v != "false" && *v != "0")
                .map(str::to_string),
            required: require
                .unwrap_or_default()
                .split(',')
                .map(|d| d.trim().to_string())
                .filter(|d| !d.is_empty())
                .collect(),
        }
    }

    /// Why skipping is a failure here, if it is.
    fn reason(&self) -> Option<String> {
        if !self.required.is_empty() {
            Some(format!("{REQUIRE_ENV}={}", self.required.join(",")))
        } else {
            self.ci.as_ref().map(|ci| format!("CI={ci}"))
        }
    }
}

/// What this binary does, decided from the environment before anything connects.
#[derive(Debug, PartialEq, Eq)]
enum Plan {
    /// Test the driver of this name.
    Test(String),
    /// `RUNCELL_TEST=none`: the suite runs in another step.
    NotHere,
    /// Nothing is tested, and that is allowed here: say why, show one ignored test.
    Skip { why: String, shown_as: String },
    /// Nothing is tested, but the environment requires the suite.
    Fail(String),
}

impl Plan {
    fn new(test: Option<&str>, strict: &Strictness, registered: &[&str]) -> Plan {
        let registered = registered.join(", ");
        match test.map(str::trim) {
            Some("none") => Plan::NotHere,
            Some(name) if !name.is_empty() => Plan::Test(name.to_string()),
            _ => match strict.reason() {
                Some(reason) => Plan::Fail(format!(
                    "{TEST_ENV} is not set, so no driver is tested, but {reason} requires the \
                     suite: set {TEST_ENV}=<driver> (registered in this binary: {registered}), \
                     or {TEST_ENV}=none where the suite runs in a separate step"
                )),
                None => Plan::Skip {
                    why: format!(
                        "set {TEST_ENV}=<driver> to run the suite (registered in this binary: {registered})"
                    ),
                    shown_as: format!("skipped (set {TEST_ENV}=<driver>)"),
                },
            },
        }
    }

    /// The driver picked could not reach its backend.
    fn unavailable(name: &str, error: &str, strict: &Strictness) -> Plan {
        match strict.reason() {
            Some(reason) => Plan::Fail(format!(
                "driver {name} is unavailable, and with {reason} a skip is a failure: {error}"
            )),
            None => Plan::Skip {
                why: format!(
                    "driver {name} is unavailable: {error} ({REQUIRE_ENV}={name} makes this a failure)"
                ),
                shown_as: format!("{name}::skipped (unavailable)"),
            },
        }
    }
}

/// Prints why nothing runs and shows it as one ignored test, then exits 0.
fn skip(args: &Arguments, why: &str, trial: &str) -> ! {
    eprintln!("conformance: skipped: {why}");
    let shown = Trial::test(trial, || Ok(())).with_ignored_flag(true);
    libtest_mimic::run(args, vec![shown]).exit()
}

/// Prints what is wrong and what to set, then exits 1.
fn fail(message: &str) -> ! {
    eprintln!("conformance: error: {message}");
    std::process::exit(1)
}

/// How the owner child holds its run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OwnerMode {
    /// A bare run, never stopped: only `reap` can find it after the child dies.
    Bare,
    /// A guarded run with [`runcell_core::stop_runs_on_signal`] installed.
    GuardedWithSignalHandler,
    /// A warm pool of the case's spec with two targets ready (it prints `RUN <key>` once
    /// they are), never shut down.
    Pool,
    /// Claims [`CLAIMS_ENV`] runs from the pool of the case's spec (it never creates one):
    /// prints `READY`, waits for a line on stdin, claims, prints `RUN <id>` for each (after
    /// checking that the run has its env `WHO=child`), stops them, prints `DONE`.
    PoolClaimer,
    /// Attaches the run [`RUN_ENV`] names, starts [`EXEC_CHILD_SCRIPT`] in it, reads its
    /// output until [`EXEC_CHILD_READS`] bytes came, checks them, prints `EXEC <id> <bytes
    /// read>` and waits to be killed.
    ExecReader,
}

/// The run an [`OwnerMode::ExecReader`] child attaches.
pub const RUN_ENV: &str = "RUNCELL_CONFORMANCE_RUN";
/// What an [`OwnerMode::ExecReader`] child runs: 200 numbered lines 50 ms apart, exit 6.
pub const EXEC_CHILD_SCRIPT: &str =
    "i=0; while [ $i -lt 200 ]; do echo line$i; i=$((i+1)); sleep 0.05; done; exit 6";
/// How many bytes an [`OwnerMode::ExecReader`] child reads at least before it reports.
pub const EXEC_CHILD_READS: usize = 200;

/// What [`EXEC_CHILD_SCRIPT`] prints.
pub fn exec_child_output() -> Vec<u8> {
    (0..200)
        .flat_map(|i| format!("line{i}\n").into_bytes())
        .collect()
}

/// How many runs a [`OwnerMode::PoolClaimer`] child claims.
pub const CLAIMS_ENV: &str = "RUNCELL_CONFORMANCE_CLAIMS";
/// Non-empty: the suite runs on pooled runs ([`crate::pooled::PooledDriver`]).
pub const POOLED_ENV: &str = "RUNCELL_CONFORMANCE_POOLED";

/// Starts this test binary again as an owner process that creates one run labelled for
/// `cx`'s case and then waits to be killed.
pub fn spawn_owner_child(cx: &Context, mode: OwnerMode) -> anyhow::Result<tokio::process::Child> {
    spawn_child(cx, mode, &[])
}

/// Starts this test binary again as a child in `mode` for `cx`'s case, with `env` added.
pub fn spawn_child(
    cx: &Context,
    mode: OwnerMode,
    env: &[(&str, &str)],
) -> anyhow::Result<tokio::process::Child> {
    let exe = std::env::current_exe()?;
    let selector = cx.case_selector();
    tokio::process::Command::new(exe)
        .env(CHILD_ENV, format!("{mode:?}"))
        .env(TEST_ENV, cx.driver.name())
        .env(IMAGE_ENV, &cx.image)
        .env(SESSION_ENV, &selector[SESSION_LABEL])
        .env(CASE_ENV, &selector[CASE_LABEL])
        .envs(env.iter().copied())
        .stdin(if mode == OwnerMode::PoolClaimer {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context(
            "spawning the owner child (is this case run from runcell_conformance::harness::main?)",
        )
}

/// Reads the `RUN <id>` line the owner child prints once its run exists.
pub async fn read_child_run_id(child: &mut tokio::process::Child) -> anyhow::Result<String> {
    let stdout = child.stdout.take().context("the child's stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(120), lines.next_line())
        .await
        .context("the owner child did not start a run in time")??;
    match line.as_deref().and_then(|l| l.strip_prefix("RUN ")) {
        Some(id) => Ok(id.to_string()),
        None => bail!("the owner child printed {line:?} instead of its run id"),
    }
}

async fn owner_child() -> anyhow::Result<()> {
    let name = std::env::var(TEST_ENV)?;
    let driver = runcell_core::connect(&name, DriverConfig::from_env(&name)).await?;
    let mut spec = RunSpec::new(std::env::var(IMAGE_ENV)?)
        .label(SESSION_LABEL, std::env::var(SESSION_ENV)?)
        .label(CASE_LABEL, std::env::var(CASE_ENV)?);
    if driver.capabilities().network_none {
        spec.network = runcell_core::Network::None;
    }
    let mode = std::env::var(CHILD_ENV)?;
    if mode == format!("{:?}", OwnerMode::Pool) {
        let pool = runcell_core::Pool::new(
            driver.clone(),
            &spec,
            runcell_core::PoolConfig::default().min_ready(2),
        )?;
        pool.wait_ready(2, Duration::from_secs(120)).await?;
        println!("RUN {}", pool.key());
        // Wait for SIGKILL; never shut the pool down.
        std::future::pending::<()>().await;
    }
    if mode == format!("{:?}", OwnerMode::PoolClaimer) {
        let claims: usize = std::env::var(CLAIMS_ENV)?.parse()?;
        let pool = runcell_core::Pool::new(
            driver.clone(),
            &spec,
            runcell_core::PoolConfig::default()
                .min_ready(0)
                .on_empty(runcell_core::OnEmpty::Fail),
        )?;
        println!("READY");
        // A blocking read of one line: the parent's go.
        tokio::task::spawn_blocking(|| std::io::stdin().read_line(&mut String::new())).await??;
        let spec = spec.env("WHO", "child");
        let claimed = futures::future::join_all((0..claims).map(|_| pool.start(&spec))).await;
        let failed: Vec<String> = claimed
            .iter()
            .filter_map(|r| r.as_ref().err().map(|e| e.to_string()))
            .collect();
        anyhow::ensure!(
            failed.is_empty(),
            "{} of {claims} claims failed: {failed:?}; pool: {:?}",
            failed.len(),
            pool.stats()
        );
        let mut runs = Vec::new();
        for run in claimed {
            let run = run?;
            let out = runcell_core::RunExt::exec(
                &*run,
                runcell_core::ExecSpec::new(["sh", "-c", "echo $WHO"]),
            )
            .await?;
            anyhow::ensure!(
                out.stdout_str() == "child\n",
                "the child's run has {:?}",
                out.stdout_str()
            );
            println!("RUN {}", run.id());
            runs.push(run);
        }
        for run in runs {
            run.stop().await?;
        }
        pool.shutdown().await?;
        println!("DONE");
        return Ok(());
    }
    if mode == format!("{:?}", OwnerMode::ExecReader) {
        let run = driver.attach(&std::env::var(RUN_ENV)?).await?;
        let mut stream = run
            .exec_stream(runcell_core::ExecSpec::new(["sh", "-c", EXEC_CHILD_SCRIPT]))
            .await?;
        let id = stream.exec_id().context("a durable exec has an id")?;
        let mut read = Vec::new();
        while read.len() < EXEC_CHILD_READS {
            match stream.next_chunk().await {
                Some(runcell_core::OutputChunk::Stdout(b)) => read.extend_from_slice(&b),
                other => bail!("the exec child read {other:?}"),
            }
        }
        anyhow::ensure!(
            exec_child_output().starts_with(&read),
            "the exec child read other bytes than the command printed"
        );
        println!("EXEC {id} {}", read.len());
        // Wait for SIGKILL, the stream held.
        std::future::pending::<()>().await;
    }
    if mode == format!("{:?}", OwnerMode::GuardedWithSignalHandler) {
        runcell_core::stop_runs_on_signal()?;
        let run = runcell_core::DriverExt::start(&*driver, &spec).await?;
        println!("RUN {}", run.id());
        std::future::pending::<()>().await;
    } else {
        let run = driver.create(&spec).await?;
        println!("RUN {}", run.id());
        // Wait for SIGKILL; never stop the run.
        std::future::pending::<()>().await;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const REGISTERED: &[&str] = &["docker", "k8s"];

    #[test]
    fn a_driver_named_is_tested() {
        let plan = Plan::new(Some(" docker "), &Strictness::default(), REGISTERED);
        assert_eq!(plan, Plan::Test("docker".into()));
    }

    #[test]
    fn nothing_named_skips_loudly_on_a_developer_machine() {
        for test in [None, Some(""), Some("  ")] {
            let strict = Strictness::new(Some("false"), Some(" , "));
            let Plan::Skip { why, shown_as } = Plan::new(test, &strict, REGISTERED) else {
                panic!("{test:?} should skip");
            };
            assert!(why.contains("set RUNCELL_TEST=<driver>"), "{why}");
            assert!(why.contains("docker, k8s"), "{why}");
            assert_eq!(shown_as, "skipped (set RUNCELL_TEST=<driver>)");
        }
    }

    #[test]
    fn nothing_named_fails_when_required_or_in_ci() {
        for (ci, require, reason) in [
            (None, Some("audit"), "RUNCELL_REQUIRE=audit"),
            (Some("true"), None, "CI=true"),
            (Some("1"), Some("docker,k8s"), "RUNCELL_REQUIRE=docker,k8s"),
        ] {
            let strict = Strictness::new(ci, require);
            let Plan::Fail(message) = Plan::new(None, &strict, REGISTERED) else {
                panic!("{ci:?} {require:?} should fail");
            };
            assert!(message.contains(reason), "{message}");
            assert!(message.contains("set RUNCELL_TEST=<driver>"), "{message}");
            assert!(message.contains("RUNCELL_TEST=none"), "{message}");
        }
    }

    #[test]
    fn none_means_not_here_even_when_required() {
        let strict = Strictness::new(Some("true"), Some("docker"));
        assert_eq!(Plan::new(Some("none"), &strict, REGISTERED), Plan::NotHere);
    }

    #[test]
    fn an_unavailable_driver_skips_only_when_nothing_is_required() {
        let lax = Plan::unavailable("docker", "no daemon", &Strictness::default());
        assert!(matches!(lax, Plan::Skip { ref why, .. } if why.contains("no daemon")));
        let strict = Strictness::new(None, Some("docker"));
        let Plan::Fail(message) = Plan::unavailable("docker", "no daemon", &strict) else {
            panic!("should fail");
        };
        assert!(message.contains("RUNCELL_REQUIRE=docker"), "{message}");
    }
}
