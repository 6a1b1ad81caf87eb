//! `cargo xtask <task>`: the project's development tasks. No bollard, no kube here: the
//! tasks drive `cargo`, the `docker` CLI and the test-cluster scripts.
#![forbid(unsafe_code)]

mod engine;
mod images;

use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "Development tasks of the sandbox workspace")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Start a run, exec into it several times, show workspace and env persisting, stop it.
    Demo,
    /// Build the local test images (no registry needed).
    TestImages,
    /// Run the shared conformance suite against a driver.
    Conformance {
        /// The registered driver name.
        #[arg(long, default_value = "docker")]
        driver: String,
        /// The package whose `conformance` test binary links the driver.
        #[arg(long, default_value = "sandbox-conformance")]
        package: String,
        /// Extra arguments for the test binary (a filter, --list, ...).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Everything: engine and images, unit and snapshot tests, the conformance suite, lints.
    Test,
}

fn main() -> Result<()> {
    match Cli::parse().task {
        Task::Demo => {
            engine::ensure_docker()?;
            images::build()?;
            cargo(
                &[
                    "run",
                    "--quiet",
                    "-p",
                    "sandbox-docker",
                    "--example",
                    "demo",
                ],
                &[],
            )
        }
        Task::TestImages => {
            engine::ensure_docker()?;
            images::build()
        }
        Task::Conformance {
            driver,
            package,
            args,
        } => {
            engine::ensure_docker()?;
            images::build()?;
            conformance(&driver, &package, &args)
        }
        Task::Test => {
            engine::ensure_docker()?;
            images::build()?;
            cargo(&["fmt", "--all", "--", "--check"], &[])?;
            cargo(
                &[
                    "clippy",
                    "--workspace",
                    "--all-targets",
                    "--quiet",
                    "--",
                    "-D",
                    "warnings",
                ],
                &[],
            )?;
            cargo(&["test", "--workspace", "--quiet"], &[])?;
            conformance("docker", "sandbox-conformance", &[])?;
            // The example third-party driver, from its own crate.
            conformance("audit", "sandbox-driver-audit", &[])?;
            engine::assert_no_leftovers()
        }
    }
}

fn conformance(driver: &str, package: &str, args: &[String]) -> Result<()> {
    let mut argv = vec!["test", "-p", package, "--test", "conformance", "--"];
    argv.extend(args.iter().map(String::as_str));
    cargo(&argv, &[("SANDBOX_TEST", driver)])
}

/// Runs cargo with the same toolchain as this xtask.
fn cargo(args: &[&str], env: &[(&str, &str)]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    eprintln!("$ cargo {}", args.join(" "));
    let status = Command::new(&cargo)
        .args(args)
        .envs(env.iter().copied())
        .status()
        .with_context(|| format!("running {cargo}"))?;
    if !status.success() {
        bail!("cargo {} failed: {status}", args.join(" "));
    }
    Ok(())
}
