//! A whole `harness = false` test binary for any registered driver:
//!
//! ```ignore
//! // tests/conformance.rs of a driver crate, with `harness = false` in Cargo.toml
//! use my_driver as _; // links the driver so that its registration is seen
//! fn main() { runcell_conformance::harness::main() }
//! ```
//!
//! `SANDBOX_TEST=<name>` picks the driver, `SANDBOX_<NAME>_<KEY>` its config.
//! Unset: the suite says so and runs nothing. A driver listed in `SANDBOX_REQUIRE`
//! (comma-separated) that cannot be connected is a failure instead of a skip.

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use libtest_mimic::{Arguments, Trial};
use runcell_core::{DriverConfig, ErrorKind, RunSpec};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::{CASE_LABEL, CASES, Context, DEFAULT_IMAGE, SESSION_LABEL, run_case};

const CHILD_ENV: &str = "SANDBOX_CONFORMANCE_OWNER_CHILD";

/// The entry point of a conformance test binary.
pub fn main() {
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
    let Ok(name) = std::env::var("SANDBOX_TEST") else {
        println!(
            "SANDBOX_TEST is not set: the conformance suite is skipped (e.g. SANDBOX_TEST=docker)"
        );
        libtest_mimic::run(&args, Vec::new()).exit();
    };
    let required = std::env::var("SANDBOX_REQUIRE")
        .unwrap_or_default()
        .split(',')
        .any(|d| d.trim() == name);
    let driver = match runtime.block_on(runcell_core::connect(&name, DriverConfig::from_env(&name)))
    {
        Ok(d) => d,
        Err(e) if e.kind() == ErrorKind::Unavailable && !required => {
            println!("driver {name} is unavailable, the conformance suite is skipped: {e}");
            libtest_mimic::run(&args, Vec::new()).exit();
        }
        Err(e) => {
            eprintln!("cannot connect driver {name}: {e}");
            std::process::exit(1);
        }
    };
    let image = std::env::var("SANDBOX_CONFORMANCE_IMAGE").unwrap_or_else(|_| DEFAULT_IMAGE.into());
    let cx = Context::new(driver, image);
    println!(
        "conformance: driver {name}, session {}, capabilities {:?}",
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

/// How the owner child holds its run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OwnerMode {
    /// A bare run, never stopped: only `reap` can find it after the child dies.
    Bare,
    /// A guarded run with [`runcell_core::stop_runs_on_signal`] installed.
    GuardedWithSignalHandler,
}

/// Starts this test binary again as an owner process that creates one run labelled for
/// `cx`'s case and then waits to be killed.
pub fn spawn_owner_child(cx: &Context, mode: OwnerMode) -> anyhow::Result<tokio::process::Child> {
    let exe = std::env::current_exe()?;
    let selector = cx.case_selector();
    tokio::process::Command::new(exe)
        .env(CHILD_ENV, format!("{mode:?}"))
        .env("SANDBOX_TEST", cx.driver.name())
        .env("SANDBOX_CONFORMANCE_IMAGE", &cx.image)
        .env("SANDBOX_CONFORMANCE_SESSION", &selector[SESSION_LABEL])
        .env("SANDBOX_CONFORMANCE_CASE", &selector[CASE_LABEL])
        .stdin(Stdio::null())
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
    let name = std::env::var("SANDBOX_TEST")?;
    let driver = runcell_core::connect(&name, DriverConfig::from_env(&name)).await?;
    let mut spec = RunSpec::new(std::env::var("SANDBOX_CONFORMANCE_IMAGE")?)
        .label(SESSION_LABEL, std::env::var("SANDBOX_CONFORMANCE_SESSION")?)
        .label(CASE_LABEL, std::env::var("SANDBOX_CONFORMANCE_CASE")?);
    if driver.capabilities().network_none {
        spec.network = runcell_core::Network::None;
    }
    if std::env::var(CHILD_ENV)? == format!("{:?}", OwnerMode::GuardedWithSignalHandler) {
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
