//! `cargo xtask <task>`: the project's development tasks. No bollard, no kube here: the
//! tasks drive `cargo`, the `docker` CLI and the test-cluster scripts.
#![forbid(unsafe_code)]

mod demo;
mod engine;
mod images;
mod k8s;
mod podman;
mod registry;
mod suites;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail, ensure};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "Development tasks of the sandbox workspace")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// The main job through the `sandbox` CLI: start a run, exec into it several times
    /// (workspace and env persist), pipe stdin, exit codes, cp, stop, a one-shot run.
    /// Installs docker.io and busybox-static first when missing (Debian, as root).
    Demo,
    /// Measure the exec paths side by side (helper, plain, raw Engine API), throughput,
    /// run start and memory, on Docker and then on the Kubernetes test cluster; or, with
    /// `scale [N,N,...] [busy secs]`, what each of many runs costs on Docker.
    Bench {
        /// `scale`: the scale ladder (default 50,200,500, busy 60 s).
        #[arg(value_parser = ["scale"])]
        what: Option<String>,
        /// The ladder's N, comma-separated.
        ladder: Option<String>,
        /// Seconds each N is kept busy.
        busy_secs: Option<u64>,
    },
    /// Build the local test images (no registry needed).
    TestImages,
    /// Start the test Podman services (Docker-compatible API; rootful, and rootless as
    /// `sbxrootless`) with the test images, and print the rootful one's address:
    /// `RUNCELL_DOCKER_HOST=... cargo xtask conformance` runs the suite on Podman.
    Podman,
    /// Run the shared conformance suite against a driver.
    Conformance {
        /// The registered driver name.
        #[arg(long, default_value = "docker")]
        driver: String,
        /// The package whose `conformance` test binary links the driver (default:
        /// runcell-conformance, or the package of --manifest-path).
        #[arg(long)]
        package: Option<String>,
        /// The Cargo.toml of a driver crate outside this workspace (passed to cargo test).
        #[arg(long, value_name = "PATH")]
        manifest_path: Option<PathBuf>,
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
    /// The Kubernetes test cluster: `up` (prints the kubeconfig path), `down`, `status`,
    /// or `test`: up, then only the Kubernetes phase of `cargo xtask test` (smoke test,
    /// the k8s suites, private pulls, the CLI), leaving the cluster up.
    K8s {
        #[arg(value_parser = ["up", "down", "status", "test"])]
        action: String,
    },
}

/// Errors end the output as one line with their causes, without a backtrace (even under
/// RUST_BACKTRACE): what a failed suite printed just before stays the last thing shown.
fn main() -> std::process::ExitCode {
    let result = run(Cli::parse().task);
    // Last, where a truncated CI log still shows them: every failed suite's failures
    // (suites of several phases may have failed; each is printed, not only the first).
    for (label, failures) in FAILED_SUITES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
    {
        eprintln!("==== failures of suite {label} ====\n{failures}");
    }
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The suites that failed in this process, with their failures sections: printed last.
static FAILED_SUITES: std::sync::Mutex<Vec<(String, String)>> = std::sync::Mutex::new(Vec::new());

fn run(task: Task) -> Result<()> {
    match task {
        Task::Demo => {
            engine::ensure_packages(false)?;
            engine::ensure_docker()?;
            images::build()?;
            cargo(&["build", "--quiet", "-p", "runcell-cli"], &[])?;
            demo::run()
        }
        Task::Bench {
            what: Some(_),
            ladder,
            busy_secs,
        } => {
            engine::ensure_docker()?;
            images::build()?;
            let ladder = ladder.unwrap_or_else(|| "50,200,500".into());
            let busy = busy_secs.unwrap_or(60).to_string();
            let scale = [
                "run",
                "--quiet",
                "--release",
                "-p",
                "runcell-bench",
                "--bin",
                "scale",
                "--",
                "docker",
            ];
            cargo(
                &[&scale[..], &[ladder.as_str(), busy.as_str()]].concat(),
                &[],
            )
        }
        Task::Bench { what: None, .. } => {
            engine::ensure_docker()?;
            images::build()?;
            // The CLI arm runs the release `sandbox` beside the bench binary.
            cargo(&["build", "--quiet", "--release", "-p", "runcell-cli"], &[])?;
            let bench = [
                "run",
                "--quiet",
                "--release",
                "-p",
                "runcell-bench",
                "--bin",
                "bench",
                "--",
            ];
            cargo(&[&bench[..], &["docker"]].concat(), &[])?;
            let kubeconfig = k8s::up()?;
            let kubeconfig = kubeconfig.to_str().context("a UTF-8 kubeconfig path")?;
            let result = cargo(
                &[&bench[..], &["k8s"]].concat(),
                &[("KUBECONFIG", kubeconfig)],
            );
            k8s::run("down")?;
            result
        }
        Task::TestImages => {
            engine::ensure_docker()?;
            images::build()
        }
        Task::Podman => {
            engine::ensure_docker()?;
            images::build()?;
            let host = podman::ensure(&images::ALL)?;
            let rootless = podman::ensure_rootless(&images::ALL)?;
            println!("export RUNCELL_DOCKER_HOST={host}");
            eprintln!(
                "rootless Podman (run the suite as {}): RUNCELL_DOCKER_HOST={rootless}",
                podman::ROOTLESS_USER
            );
            Ok(())
        }
        Task::Conformance {
            driver,
            package,
            manifest_path,
            args,
        } => {
            engine::ensure_docker()?;
            images::build()?;
            let mut env = Vec::new();
            if driver == "k8s" && std::env::var_os("KUBECONFIG").is_none() {
                // No cluster named: use (and if needed start) the local test cluster.
                env.push(("KUBECONFIG", k8s::up()?.to_string_lossy().into_owned()));
            }
            let target = match (manifest_path, package) {
                (Some(manifest), package) => SuiteTarget::Manifest(manifest, package),
                (None, package) => {
                    SuiteTarget::Package(package.unwrap_or_else(|| "runcell-conformance".into()))
                }
            };
            conformance(&driver, &target, &args, &env)
        }
        Task::K8s { action } => {
            if action == "up" || action == "test" {
                engine::ensure_packages(true)?;
                engine::ensure_docker()?;
                images::build()?;
                let kubeconfig = k8s::up()?;
                eprintln!("export KUBECONFIG={}", kubeconfig.display());
                if action == "test" {
                    let session = test_session();
                    eprintln!("conformance session {session} ({SESSION_ENV})");
                    k8s_tests(&kubeconfig, &session)?;
                }
                Ok(())
            } else {
                k8s::run(&action)
            }
        }
        Task::Test { keep_cluster } => {
            check_required_drivers()?;
            check_free_space()?;
            // A fresh machine: what the tests need is installed first, as for the demo.
            engine::ensure_packages(true)?;
            // Every run the suite creates carries this session label value, so the
            // leftover checks at the end see this test session's runs and no one else's.
            let session = test_session();
            eprintln!("conformance session {session} ({SESSION_ENV})");
            let session_env = [(SESSION_ENV, session.clone())];
            engine::ensure_docker()?;
            images::build()?;
            // The suite also runs on Podman, through its Docker-compatible API.
            let podman_host = podman::ensure(&images::ALL)?;
            let rootless_host = podman::ensure_rootless(&images::ALL)?;
            // Each engine's volumes that no container uses, before any test ran.
            let engines = [
                None,
                Some(podman_host.as_str()),
                Some(rootless_host.as_str()),
            ];
            let dangling = engines
                .iter()
                .map(|host| engine::dangling_volumes(*host))
                .collect::<Result<Vec<_>>>()?;
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
            // The API docs: broken links and examples fail here, not on docs.rs.
            cargo(
                &["doc", "--workspace", "--no-deps", "--quiet"],
                &[("RUSTDOCFLAGS", "-D warnings")],
            )?;
            // The suite runs per driver below; its binaries only say so here. The CLI's
            // Docker tests run here (their runs carry the session label).
            cargo(
                &["test", "--workspace", "--quiet"],
                &[(TEST_ENV, "none"), (SESSION_ENV, session.as_str())],
            )?;
            // The suites of `suites.rs`: Docker's side by side, then Podman's beside the
            // cluster's start-up and suites (its engine is idle then).
            let targets = suite_targets();
            let value = |v: suites::Value| match v {
                suites::Value::Lit(s) => s.to_string(),
                suites::Value::PodmanHost => podman_host.clone(),
                suites::Value::RootlessHost => rootless_host.clone(),
                other @ (suites::Value::Kubeconfig
                | suites::Value::SnapshotRegistry
                | suites::Value::RegistryImage) => {
                    unreachable!("{other:?} outside the cluster's phases")
                }
            };
            let docker_sessions = suites_side_by_side(&suites_of(
                suites::Phase::Docker,
                &targets,
                &session_env,
                &value,
            ))?;
            // The scale bench at a small N (its numbers in the log; the full ladder is
            // `cargo xtask bench scale`): it fails on a failed start or stop, or a run left.
            cargo(
                &[
                    "run",
                    "--quiet",
                    "-p",
                    "runcell-bench",
                    "--bin",
                    "scale",
                    "--",
                    "docker",
                    "30",
                    "15",
                ],
                &[],
            )?;
            let podman_suite = suites_of(suites::Phase::Podman, &targets, &session_env, &value);
            // The cluster goes down again whatever happened, unless asked to stay.
            let (podman_result, k8s_result) = std::thread::scope(|scope| {
                let podman = scope.spawn(|| suites_side_by_side(&podman_suite));
                let k8s = k8s::up().and_then(|kubeconfig| k8s_tests(&kubeconfig, &session));
                let podman = podman
                    .join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("the Podman suite panicked")));
                (podman, k8s)
            });
            let down = if keep_cluster {
                Ok(())
            } else {
                k8s::run("down")
            };
            // Every phase's failure is reported, not only the first one's.
            let errors: Vec<String> = [
                podman_result.as_ref().err(),
                k8s_result.as_ref().err(),
                down.as_ref().err(),
            ]
            .into_iter()
            .flatten()
            .map(|e| format!("{e:#}"))
            .collect();
            if !errors.is_empty() {
                bail!("{}", errors.join("; "));
            }
            let podman_sessions = podman_result?;
            for (session, host) in podman_sessions.iter().zip([&podman_host, &rootless_host]) {
                engine::assert_no_leftovers(session, Some(host))?;
            }
            engine::assert_no_leftovers(&session, None)?;
            for session in docker_sessions {
                engine::assert_no_leftovers(&session, None)?;
            }
            for (host, before) in engines.iter().zip(&dangling) {
                engine::assert_no_new_dangling_volumes(before, *host)?;
            }
            Ok(())
        }
    }
}

/// The cluster smoke test, the suite on the `k8s` driver, and the leftover check.
fn k8s_tests(admin: &Path, session: &str) -> Result<()> {
    k8s::smoke(admin)?;
    let restricted = k8s::restricted_kubeconfig(admin)?;
    let restricted = restricted.to_str().context("a UTF-8 kubeconfig path")?;
    let targets = suite_targets();
    let session_env = [(SESSION_ENV, session.to_string())];
    let registry = registry::Registry::start(images::BUSYBOX)?;
    let value = |v: suites::Value| match v {
        suites::Value::Lit(s) => s.to_string(),
        suites::Value::Kubeconfig => restricted.to_string(),
        suites::Value::SnapshotRegistry => registry.snapshots(),
        suites::Value::RegistryImage => registry.base.clone(),
        other => unreachable!("{other:?} in a cluster phase"),
    };
    let mut sessions = suites_side_by_side(&suites_of(
        suites::Phase::K8s,
        &targets,
        &session_env,
        &value,
    ))?;
    sessions.extend(suites_side_by_side(&suites_of(
        suites::Phase::K8sLater,
        &targets,
        &session_env,
        &value,
    ))?);
    for sub in sessions {
        k8s::assert_no_leftovers(admin, &sub)?;
    }
    let tags = registry.snapshot_tags()?;
    ensure!(tags.is_empty(), "snapshots left in the registry: {tags:?}");
    drop(registry);
    // The `sandbox` CLI on the cluster, as the same restricted ServiceAccount.
    cargo(
        &["test", "--quiet", "-p", "runcell-cli", "--test", "k8s"],
        &[
            ("KUBECONFIG", restricted),
            (TEST_ENV, "k8s"),
            (SESSION_ENV, session),
        ],
    )?;
    // Private pulls through imagePullSecrets from registries on loopback, HTTP and HTTPS
    // with a CA of their own that the test makes the node trust in its registry hosts
    // directory; snapshots to registries that refuse or die. (Each pushes an image ID of its own: pulling the suite image's ID under
    // another name made containerd 1.6's CRI image store lose the imported
    // sandbox-test/busybox:latest.)
    let hosts = k8s::registry_hosts_dir();
    cargo(
        &[
            "test",
            "--quiet",
            "-p",
            "runcell-k8s",
            "--test",
            "private_pull",
            "--test",
            "snapshot_registry",
        ],
        &[
            ("KUBECONFIG", restricted),
            (TEST_ENV, "k8s"),
            (
                "RUNCELL_TESTENV_REGISTRY_HOSTS",
                hosts.to_str().context("a UTF-8 state directory")?,
            ),
        ],
    )?;
    // The workspace on PersistentVolumeClaims (StorageClass runcell-hostpath); a pod no
    // node has room for.
    cargo(
        &[
            "test",
            "--quiet",
            "-p",
            "runcell-k8s",
            "--test",
            "workspace_claim",
            "--test",
            "limits",
        ],
        &[("KUBECONFIG", restricted), (TEST_ENV, "k8s")],
    )?;
    // A command that outlives an apiserver restart: last and alone (it restarts the
    // cluster's apiserver).
    let cluster_sh = k8s::cluster_script();
    let state = k8s::state_dir();
    cargo(
        &[
            "test",
            "--quiet",
            "-p",
            "runcell-k8s",
            "--test",
            "apiserver_restart",
        ],
        &[
            ("KUBECONFIG", restricted),
            (TEST_ENV, "k8s"),
            (SESSION_ENV, session),
            (
                "RUNCELL_TESTENV_CLUSTER_SH",
                cluster_sh.to_str().context("a UTF-8 repository path")?,
            ),
            (
                k8s::STATE_ENV,
                state.to_str().context("a UTF-8 state directory")?,
            ),
        ],
    )?;
    k8s::assert_no_leftovers(admin, session)
}

/// The driver the conformance harness tests (`runcell_conformance::harness::TEST_ENV`;
/// `none`: not in this step).
const TEST_ENV: &str = "RUNCELL_TEST";

/// Drivers whose absence fails the tests (`runcell_conformance::harness::REQUIRE_ENV`).
const REQUIRE_ENV: &str = "RUNCELL_REQUIRE";

/// The variable the conformance harness takes its session label value from
/// (`runcell_conformance::harness::SESSION_ENV`; xtask does not link the suite).
const SESSION_ENV: &str = "RUNCELL_CONFORMANCE_SESSION";

/// The full ID (`sha256:...`) of the suite's image (`runcell_conformance::IMAGE_ID_ENV`).
const IMAGE_ID_ENV: &str = "RUNCELL_CONFORMANCE_IMAGE_ID";

/// Non-empty: the harness takes every run of the suite from a warm pool
/// (`runcell_conformance::harness::POOLED_ENV`).
const POOLED_ENV: &str = "RUNCELL_CONFORMANCE_POOLED";

/// The variable `name` (`RUNCELL_...`), or else, deprecated and with a warning, its old
/// spelling `SANDBOX_...` (as `runcell_core::envvar::var` reads it; xtask does not link
/// core).
fn env_var(name: &str) -> Option<String> {
    if let Ok(value) = std::env::var(name) {
        return Some(value);
    }
    let old = format!("SANDBOX_{}", name.strip_prefix("RUNCELL_")?);
    let value = std::env::var(&old).ok()?;
    eprintln!(
        "xtask: warning: {old} is deprecated and will stop working in the next release; use {name}"
    );
    Some(value)
}

/// The exec path variable of core (`runcell_core::EXEC_HELPER_ENV`): `required` puts
/// every run through the in-sandbox helper, `off` on one engine exec per command.
const HELPER_ENV: &str = "RUNCELL_EXEC_HELPER";

/// The test targets of the packages [`suites::SUITES`] names.
fn suite_targets() -> Vec<(&'static str, SuiteTarget)> {
    let mut targets: Vec<(&'static str, SuiteTarget)> = Vec::new();
    for s in suites::SUITES {
        if !targets.iter().any(|(p, _)| *p == s.package) {
            targets.push((s.package, SuiteTarget::Package(s.package.into())));
        }
    }
    targets
}

/// The suites of `phase`, each with `base` (the session label) and its own environment,
/// whose values `value` resolves.
fn suites_of<'a>(
    phase: suites::Phase,
    targets: &'a [(&'static str, SuiteTarget)],
    base: &[(&'static str, String)],
    value: &dyn Fn(suites::Value) -> String,
) -> Vec<Suite<'a>> {
    suites::of(phase)
        .map(|def| {
            let target = &targets
                .iter()
                .find(|(p, _)| *p == def.package)
                .expect("suite_targets covers every package")
                .1;
            let mut env = base.to_vec();
            env.extend(def.env.iter().map(|(k, v)| (*k, value(*v))));
            let suite = Suite::new(def.label, def.driver, target, env);
            match def.user {
                Some(user) => suite.run_as(user),
                None => suite,
            }
        })
        .collect()
}

/// One suite invocation of a group run side by side.
struct Suite<'a> {
    label: &'a str,
    driver: &'a str,
    target: &'a SuiteTarget,
    env: Vec<(&'a str, String)>,
    /// Runs the suite's test binary as this user (the rootless engine's) instead of
    /// through cargo as the caller.
    user: Option<&'a str>,
}

impl<'a> Suite<'a> {
    fn new(
        label: &'a str,
        driver: &'a str,
        target: &'a SuiteTarget,
        env: Vec<(&'a str, String)>,
    ) -> Suite<'a> {
        Suite {
            label,
            driver,
            target,
            env,
            user: None,
        }
    }

    /// Runs it as `user`.
    fn run_as(mut self, user: &'a str) -> Suite<'a> {
        self.user = Some(user);
        self
    }
}

/// The cargo of this xtask's toolchain.
fn cargo_bin() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

/// The test binary `cargo test <args> --no-run` builds.
fn test_binary(args: &[String]) -> Result<PathBuf> {
    eprintln!("$ cargo test --no-run {}", args.join(" "));
    let out = Command::new(cargo_bin())
        .args(["test", "--no-run", "--quiet", "--message-format=json"])
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .context("building the suite's test binary")?;
    if !out.status.success() {
        bail!("cargo test --no-run {} failed", args.join(" "));
    }
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if let Some(exe) = message["executable"].as_str() {
            return Ok(exe.into());
        }
    }
    bail!(
        "cargo test --no-run {} named no test binary",
        args.join(" ")
    )
}

/// Runs suites at the same time (their test binaries built first, once), each into its
/// own log; prints every log when all ended; fails if any failed. Each suite gets its own
/// session label value (the given one and its label), since a case checks that nothing
/// with its session and case labels remains; returns those values for the leftover checks.
fn suites_side_by_side(suites: &[Suite<'_>]) -> Result<Vec<String>> {
    let mut sessions = Vec::new();
    let logs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/xtask-logs");
    std::fs::create_dir_all(&logs)?;
    // Each target's binary once (suites may share a target).
    let mut binaries: BTreeMap<Vec<String>, PathBuf> = BTreeMap::new();
    for suite in suites {
        if let std::collections::btree_map::Entry::Vacant(entry) =
            binaries.entry(suite.target.cargo_args()?)
        {
            let binary = test_binary(entry.key())?;
            entry.insert(binary);
        }
    }
    // The suite's image ID, for the case that an image name never matches an ID prefix
    // (the Podman engines and the cluster's node hold the same image, loaded from Docker's).
    let image_id = images::id(images::BUSYBOX)?;
    let mut children = Vec::new();
    for suite in suites {
        let log_path = logs.join(format!("{}.log", suite.label.replace('/', "-")));
        let log = std::fs::File::create(&log_path)?;
        eprintln!("$ suite {} (log: {})", suite.label, log_path.display());
        let args = suite.target.cargo_args()?;
        let mut env = suite.env.clone();
        for (k, v) in &mut env {
            if *k == SESSION_ENV {
                *v = format!("{v}-{}", suite.label.replace('/', "-"));
                sessions.push(v.clone());
            }
        }
        let mut staged = None;
        let mut command = match suite.user {
            None => {
                let mut command = Command::new(cargo_bin());
                command.arg("test").args(&args);
                command
            }
            Some(user) => {
                // A copy the user can run (a checkout under /root is closed to it); the
                // suite reads nothing of the package at run time.
                // Removed when the suite ended (it is ~140 MiB in a tmpfs).
                let binary = podman::stage(&binaries[&args], user)?;
                let mut command = Command::new("runuser");
                command
                    .args(["-u", user, "--"])
                    .arg(staged.insert(binary))
                    .current_dir(podman::ROOTLESS_DIR);
                command
            }
        };
        let child = command
            // What a failing pool case needs to be understood: claims lost and why.
            // Warnings and errors of the library too (a cleanup that failed).
            .env(
                "RUST_LOG",
                "warn,runcell_k8s=debug,runcell_core::pool=debug",
            )
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .env(TEST_ENV, suite.driver)
            .env(IMAGE_ID_ENV, &image_id)
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("running cargo test")?;
        children.push((
            suite.label,
            log_path,
            child,
            staged,
            std::time::Instant::now(),
        ));
    }
    let mut failed = Vec::new();
    for (label, log_path, mut child, staged, started) in children {
        let status = child.wait()?;
        if let Some(binary) = staged {
            let _ = std::fs::remove_file(binary);
        }
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        eprintln!(
            "==== suite {label}: {status} in {:.0} s ====\n{log}",
            started.elapsed().as_secs_f64()
        );
        if !status.success() {
            failed.push((label, log));
        }
    }
    if !failed.is_empty() {
        // What failed and why, printed last by `main`.
        FAILED_SUITES
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(
                failed
                    .iter()
                    .map(|(label, log)| (label.to_string(), failures(log))),
            );
        let labels: Vec<&str> = failed.iter().map(|(label, _)| *label).collect();
        bail!("suites failed: {}", labels.join(", "));
    }
    Ok(sessions)
}

/// The failures section of a libtest log (each failed case's output and the list),
/// without backtrace frames and at most 200 lines.
fn failures(log: &str) -> String {
    let Some(start) = log.find("\nfailures:\n") else {
        return "(no failures section: see the log above)".into();
    };
    let frame = |line: &str| {
        let t = line.trim_start();
        t.starts_with("at ")
            || t.split_once(": ")
                .is_some_and(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    let lines: Vec<&str> = log[start + 1..].lines().filter(|l| !frame(l)).collect();
    let mut out = lines
        .iter()
        .take(200)
        .copied()
        .collect::<Vec<_>>()
        .join("\n");
    if lines.len() > 200 {
        out.push_str("\n[… cut: see target/xtask-logs]");
    }
    out
}

/// The drivers `cargo xtask test` runs the suite on.
const TESTED_DRIVERS: [&str; 3] = ["docker", "audit", "k8s"];

/// The session label value of this `cargo xtask test`: the caller's
/// `RUNCELL_CONFORMANCE_SESSION` (a CI job id, say), else one made from pid and time.
fn test_session() -> String {
    match env_var(SESSION_ENV) {
        Some(s) if !s.is_empty() => s,
        _ => {
            let secs = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            format!("xtask-{secs}-{}", std::process::id())
        }
    }
}

/// A driver in `RUNCELL_REQUIRE` that this task never tests would pass unnoticed.
fn check_required_drivers() -> Result<()> {
    let required = env_var(REQUIRE_ENV).unwrap_or_default();
    let untested: Vec<&str> = required
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty() && !TESTED_DRIVERS.contains(d))
        .collect();
    if !untested.is_empty() {
        bail!(
            "{REQUIRE_ENV} names {}, which cargo xtask test does not test (it tests {}); \
             run `cargo xtask conformance --driver <name> --package <pkg>` (or --manifest-path) for it",
            untested.join(", "),
            TESTED_DRIVERS.join(", ")
        );
    }
    Ok(())
}

/// What `cargo xtask test` writes on a fresh clone, measured (`df` every 15 s through
/// `CI=true .ci/run`): 4.8 GiB more in use at the peak, 4.7 of it under target/ (build
/// output without incremental caches, as CI builds; about twice that with them, and the
/// test cluster's binaries), the rest images, containers and the cluster's data.
const NEEDED_FREE_GIB: u64 = 6;

/// A full disk fails the build halfway, with an error about a temp dir: say it first.
fn check_free_space() -> Result<()> {
    let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target");
    let at = std::fs::canonicalize(&target).unwrap_or_else(|_| ".".into());
    let fs = rustix::fs::statvfs(&at).with_context(|| format!("statvfs {}", at.display()))?;
    let free_gib = fs.f_bavail.saturating_mul(fs.f_frsize) >> 30;
    if free_gib < NEEDED_FREE_GIB {
        bail!(
            "{} GiB free on the file system of {}; the tests need about {NEEDED_FREE_GIB} GiB \
             (build output, the test cluster, images): free some (e.g. `cargo clean`, old clones)",
            free_gib,
            at.display()
        );
    }
    Ok(())
}

/// Where the `conformance` test binary that links the driver lives.
enum SuiteTarget {
    /// A package of this workspace.
    Package(String),
    /// A crate's manifest, anywhere (a third-party driver), and optionally the package
    /// within its workspace.
    Manifest(PathBuf, Option<String>),
}

impl SuiteTarget {
    /// The arguments of `cargo test` that select the suite's test binary.
    fn cargo_args(&self) -> Result<Vec<String>> {
        let mut argv = Vec::new();
        match self {
            SuiteTarget::Package(package) => argv.extend(["-p".into(), package.clone()]),
            SuiteTarget::Manifest(path, package) => {
                if !path.is_file() {
                    bail!("--manifest-path {}: no such file", path.display());
                }
                let manifest = path.to_str().context("a UTF-8 manifest path")?;
                argv.extend(["--manifest-path".into(), manifest.into()]);
                if let Some(package) = package {
                    argv.extend(["-p".into(), package.clone()]);
                }
            }
        }
        argv.extend(["--test".into(), "conformance".into()]);
        Ok(argv)
    }
}

fn conformance(
    driver: &str,
    target: &SuiteTarget,
    args: &[String],
    env: &[(&str, String)],
) -> Result<()> {
    let mut argv = vec!["test".to_string()];
    argv.extend(target.cargo_args()?);
    argv.push("--".into());
    argv.extend(args.iter().cloned());
    let mut env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    env.push((TEST_ENV, driver));
    cargo(&argv.iter().map(String::as_str).collect::<Vec<_>>(), &env)
}

/// Runs cargo with the same toolchain as this xtask.
fn cargo(args: &[&str], env: &[(&str, &str)]) -> Result<()> {
    let cargo = cargo_bin();
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

#[cfg(test)]
mod tests {
    #[test]
    fn failures_keep_messages_and_drop_frames() {
        let log = "test a ... ok\ntest b ... FAILED\n\nfailures:\n\n---- k8s::b stdout ----\n\
                   Error: cancelled creates left [\"sbx-1\"]\nstack backtrace:\n   0: main\n\
                   \x20            at ./src/main.rs:3:5\n\nfailures:\n    k8s::b\n";
        let out = super::failures(log);
        assert!(out.contains("cancelled creates left"), "{out}");
        assert!(out.contains("    k8s::b"), "{out}");
        assert!(
            !out.contains("main.rs") && !out.contains("0: main"),
            "{out}"
        );
        assert!(super::failures("test a ... ok\n").contains("no failures section"));
    }
}
