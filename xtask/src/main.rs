//! `cargo xtask <task>`: the project's development tasks. No bollard, no kube here: the
//! tasks drive `cargo`, the `docker` CLI and the test-cluster scripts.
#![forbid(unsafe_code)]

mod engine;
mod images;
mod k8s;

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
    /// Measure exec into a long-lived run against a fresh container per call (ratio).
    Bench,
    /// Build the local test images (no registry needed).
    TestImages,
    /// Run the shared conformance suite against a driver.
    Conformance {
        /// The registered driver name.
        #[arg(long, default_value = "docker")]
        driver: String,
        /// The package whose `conformance` test binary links the driver.
        #[arg(long, default_value = "runcell-conformance")]
        package: String,
        /// Extra arguments for the test binary (a filter, --list, ...).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Everything: engine, images and test cluster; lints; unit and snapshot tests; the
    /// conformance suite on Docker, the example third-party driver and Kubernetes.
    Test {
        /// Leave the Kubernetes test cluster running afterwards.
        #[arg(long)]
        keep_cluster: bool,
    },
    /// The Kubernetes test cluster: `up` (prints the kubeconfig path), `down`, `status`.
    K8s {
        #[arg(value_parser = ["up", "down", "status"])]
        action: String,
    },
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
                    "runcell-docker",
                    "--example",
                    "demo",
                ],
                &[],
            )
        }
        Task::Bench => {
            engine::ensure_docker()?;
            images::build()?;
            cargo(
                &[
                    "run",
                    "--quiet",
                    "--release",
                    "-p",
                    "runcell-docker",
                    "--example",
                    "bench",
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
            let mut env = Vec::new();
            if driver == "k8s" && std::env::var_os("KUBECONFIG").is_none() {
                // No cluster named: use (and if needed start) the local test cluster.
                env.push(("KUBECONFIG", k8s::up()?.to_string_lossy().into_owned()));
            }
            conformance(&driver, &package, &args, &env)
        }
        Task::K8s { action } => {
            if action == "up" {
                engine::ensure_docker()?;
                images::build()?;
                let kubeconfig = k8s::up()?;
                eprintln!("export KUBECONFIG={}", kubeconfig.display());
                Ok(())
            } else {
                k8s::run(&action)
            }
        }
        Task::Test { keep_cluster } => {
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
            conformance("docker", "runcell-conformance", &[], &[])?;
            // The example third-party driver, from its own crate.
            conformance("audit", "sandbox-driver-audit", &[], &[])?;
            // The cluster goes down again whatever happened, unless asked to stay.
            let k8s_result = k8s::up().and_then(|kubeconfig| k8s_tests(&kubeconfig));
            let down = if keep_cluster {
                Ok(())
            } else {
                k8s::run("down")
            };
            k8s_result?;
            down?;
            engine::assert_no_leftovers()
        }
    }
}

/// The cluster smoke test, the suite on the `k8s` driver, and the leftover check.
fn k8s_tests(admin: &std::path::Path) -> Result<()> {
    k8s::smoke(admin)?;
    let restricted = k8s::restricted_kubeconfig(admin)?;
    let restricted = restricted.to_str().context("a UTF-8 kubeconfig path")?;
    conformance(
        "k8s",
        "runcell-conformance",
        &[],
        &[("KUBECONFIG", restricted.into())],
    )?;
    // Again on the exec path for API servers without v5.channel.k8s.io (before 1.30).
    eprintln!("the k8s suite again with exec_v4_compatible=true (stdin framed, never closed)");
    conformance(
        "k8s",
        "runcell-conformance",
        &[],
        &[
            ("KUBECONFIG", restricted.into()),
            ("SANDBOX_K8S_EXEC_V4_COMPATIBLE", "true".into()),
        ],
    )?;
    k8s::assert_no_leftovers(admin)
}

fn conformance(driver: &str, package: &str, args: &[String], env: &[(&str, String)]) -> Result<()> {
    let mut argv = vec!["test", "-p", package, "--test", "conformance", "--"];
    argv.extend(args.iter().map(String::as_str));
    let mut env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    env.push(("SANDBOX_TEST", driver));
    cargo(&argv, &env)
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
