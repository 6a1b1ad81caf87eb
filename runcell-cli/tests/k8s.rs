//! The `sandbox` binary against Kubernetes (`--driver k8s`): the cluster of `KUBECONFIG`,
//! the namespace of `RUNCELL_K8S_NAMESPACE` or the kubeconfig's.
//!
//! Runs when `RUNCELL_TEST` names `k8s`, or, with `RUNCELL_TEST` unset, when `KUBECONFIG`
//! is set or `RUNCELL_REQUIRE` names `k8s`. `cargo xtask test` runs it in its Kubernetes
//! phase (restricted ServiceAccount); its plain `cargo test --workspace` step sets
//! `RUNCELL_TEST=none`, so this binary passes there without a cluster. Selected but
//! unreachable: a failure when `CI` is set or `RUNCELL_REQUIRE` names `k8s`.

mod common;

use std::time::{Duration, Instant};

use common::{Sandbox, code, run, run_with_stdin, text};

fn sandbox(case: &str) -> Option<Sandbox> {
    let selected = match runcell_core::envvar::var("RUNCELL_TEST") {
        Some(t) if !t.is_empty() => t.split(',').any(|d| d.trim() == "k8s"),
        _ => std::env::var_os("KUBECONFIG").is_some() || common::strict("k8s"),
    };
    if !selected {
        eprintln!(
            "*** SKIPPED {case}: not selected (RUNCELL_TEST=k8s, or KUBECONFIG, selects the Kubernetes CLI tests)"
        );
        return None;
    }
    Sandbox::new("k8s", case)
}

#[test]
fn start_exec_stop_on_kubernetes() {
    let Some(sb) = sandbox("k8s-start-exec-stop") else {
        return;
    };
    let id = sb.start(&["--env", "GREETING=hello from k8s", "--ttl", "10m"]);
    let exec = |args: &[&str], argv: &[&str]| run(sb.exec_cmd(&id, args, argv));
    let out = exec(&[], &["sh", "-c", "echo $GREETING; pwd"]);
    assert_eq!(
        text(&out.stdout),
        "hello from k8s\n/workspace\n",
        "{}",
        text(&out.stderr)
    );
    let out = exec(&[], &["sh", "-c", "echo kept > state.txt"]);
    assert_eq!(code(&out), 0, "{}", text(&out.stderr));
    let out = exec(&["--env", "X=1"], &["sh", "-c", "cat state.txt; echo X=$X"]);
    assert_eq!(text(&out.stdout), "kept\nX=1\n");
    assert_eq!(code(&exec(&[], &["sh", "-c", "exit 3"])), 3);
    assert_eq!(code(&exec(&[], &["sh", "-c", "kill -9 $$"])), 137);
    let started = Instant::now();
    assert_eq!(code(&exec(&["--timeout", "1s"], &["sleep", "30"])), 124);
    assert!(started.elapsed() < Duration::from_secs(30));
    let out = run_with_stdin(sb.exec_cmd(&id, &[], &["cat"]), b"piped in\n");
    assert_eq!(text(&out.stdout), "piped in\n", "{}", text(&out.stderr));
    // Files both ways.
    let host = tempfile::tempdir().unwrap();
    let file = host.path().join("in.txt");
    std::fs::write(&file, "from the host\n").unwrap();
    let out = run(sb.cmd(&["cp", file.to_str().unwrap(), &format!("{id}:/workspace/")]));
    assert_eq!(code(&out), 0, "{}", text(&out.stderr));
    let back = host.path().join("back.txt");
    let out = run(sb.cmd(&[
        "cp",
        &format!("{id}:/workspace/in.txt"),
        back.to_str().unwrap(),
    ]));
    assert_eq!(code(&out), 0, "{}", text(&out.stderr));
    assert_eq!(std::fs::read_to_string(&back).unwrap(), "from the host\n");

    let out = run(sb.cmd(&["ls", "--label", &sb.selector()]));
    assert!(text(&out.stdout).contains(&id), "{}", text(&out.stdout));
    let out = run(sb.cmd(&["stop", &id]));
    assert_eq!(code(&out), 0, "{}", text(&out.stderr));
    sb.assert_nothing_left();
}

#[test]
fn a_killed_exec_leaves_its_command_to_logs_on_kubernetes() {
    if let Some(sb) = sandbox("k8s-mux-sigkill") {
        common::mux::a_killed_exec_leaves_every_byte(&common::mux::Muxed::with(sb));
    }
}

#[test]
fn run_passes_exit_codes_on_kubernetes() {
    let Some(sb) = sandbox("k8s-run") else { return };
    let out = run(sb.run_cmd(
        &["--env", "X=42"],
        &["sh", "-c", "echo x=$X; echo e >&2; exit 5"],
    ));
    assert_eq!(code(&out), 5, "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "x=42\n");
    assert!(text(&out.stderr).ends_with("e\n"), "{}", text(&out.stderr));
    assert_eq!(code(&run(sb.run_cmd(&["-q"], &["true"]))), 0);
    assert_eq!(
        code(&run(sb.run_cmd(&["-q"], &["sh", "-c", "kill -9 $$"]))),
        137
    );
    sb.assert_nothing_left();
}

#[test]
fn an_unschedulable_pod_shows_why_while_waiting() {
    let Some(sb) = sandbox("k8s-unschedulable") else {
        return;
    };
    let image = common::image();
    let labels = sb.labels();
    let mut args = vec![
        "--config",
        "node_selector=runcell.test/no-such-node=1",
        "--config",
        "ready_timeout_secs=6",
        "start",
        "--image",
        image.as_str(),
        "--pull",
        "never",
    ];
    args.extend(labels.iter().map(String::as_str));
    let started = Instant::now();
    let out = run(sb.cmd(&args));
    let stderr = text(&out.stderr);
    assert_ne!(code(&out), 0, "an unschedulable pod started: {stderr}");
    assert!(
        stderr.contains("Unschedulable"),
        "no word of why while waiting: {stderr}"
    );
    assert!(started.elapsed() < Duration::from_secs(60));
    sb.assert_nothing_left();
}
