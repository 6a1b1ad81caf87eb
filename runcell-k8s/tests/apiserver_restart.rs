//! The apiserver restarts while a command runs (the test cluster's `cluster.sh
//! restart-apiserver`: SIGTERM, which ends every stream it proxies, then up again). The
//! command's stream went through the apiserver and breaks; the library reconnects once
//! the apiserver answers again and the `ExecStream` goes on from the byte it reached:
//! every line once and in order, and the command's exact status. A detached command
//! started before the restart is reattached from another driver afterwards, whole.
//!
//! It restarts the cluster's apiserver, so nothing else may use the cluster meanwhile:
//! `cargo xtask test` runs it alone, after the suites (`RUNCELL_TEST=k8s`, and
//! `RUNCELL_TESTENV_CLUSTER_SH` names the script). Unless `RUNCELL_TEST` names `k8s` it is
//! skipped; then without the script's variable it says so and passes, unless `CI` is set
//! or `RUNCELL_REQUIRE` names `k8s`.

use std::time::{Duration, Instant};

use runcell_core::{
    DriverConfig, DriverExt, ExecHelper, ExecSpec, ExitStatus, OutputChunk, RunSpec, labels,
};

// Links the driver so that the registry finds it by name.
use runcell_k8s as _;

const IMAGE: &str = "sandbox-test/busybox:latest";
const SCRIPT_ENV: &str = "RUNCELL_TESTENV_CLUSTER_SH";

/// Selected when `RUNCELL_TEST` names `k8s` (`cargo xtask test` sets it for this step
/// alone).
fn selected() -> bool {
    runcell_core::envvar::var("RUNCELL_TEST")
        .unwrap_or_default()
        .split(',')
        .any(|d| d.trim() == "k8s")
}

fn strict() -> bool {
    let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0");
    ci || runcell_core::envvar::var("RUNCELL_REQUIRE")
        .unwrap_or_default()
        .split(',')
        .any(|d| d.trim() == "k8s")
}

/// `lines` numbered lines, `pause` apart, then exit `code`.
fn counter(lines: u32, pause: &str, code: i32) -> ExecSpec {
    ExecSpec::new([
        "sh",
        "-c",
        &format!(
            "i=0; while [ $i -lt {lines} ]; do echo line$i; i=$((i+1)); sleep {pause}; done; exit {code}"
        ),
    ])
}

fn counted(lines: u32) -> Vec<u8> {
    (0..lines)
        .flat_map(|i| format!("line{i}\n").into_bytes())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_outlives_an_apiserver_restart() {
    if !selected() {
        eprintln!("\n*** SKIPPED: RUNCELL_TEST does not name k8s");
        return;
    }
    let Some(script) = std::env::var_os(SCRIPT_ENV) else {
        assert!(
            !strict(),
            "{SCRIPT_ENV} must name the test cluster's cluster.sh here (CI or RUNCELL_REQUIRE)"
        );
        eprintln!("\n*** SKIPPED: {SCRIPT_ENV} is not set (cargo xtask test sets it)");
        return;
    };
    let driver = runcell_core::connect("k8s", DriverConfig::from_env("k8s"))
        .await
        .expect("the cluster answers");
    let mut spec = RunSpec::new(IMAGE)
        .exec_helper(ExecHelper::Required)
        .label("sandbox.test/case", "apiserver-restart");
    if let Some(session) = runcell_core::envvar::var("RUNCELL_CONFORMANCE_SESSION")
        && !session.is_empty()
    {
        spec = spec.label("sandbox.conformance/session", &session);
    }
    spec.pull = runcell_core::PullPolicy::Never;
    let run = driver.start(&spec).await.expect("start");
    let lines = 250;
    let mut stream = run
        .exec_stream(counter(lines, "0.1", 3))
        .await
        .expect("exec");
    let detached = run
        .exec_stream(counter(lines, "0.1", 4).detach())
        .await
        .expect("detached exec");
    let detached_id = detached.exec_id().expect("an exec id");
    drop(detached);
    let mut out = Vec::new();
    while out.len() < counted(20).len() {
        match stream.next_chunk().await {
            Some(OutputChunk::Stdout(b)) => out.extend_from_slice(&b),
            other => panic!("before the restart: {other:?}"),
        }
    }

    // The restart, while the stream is read on.
    let restart = tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        let status = std::process::Command::new("bash")
            .arg(script)
            .arg("restart-apiserver")
            .status()
            .expect("run cluster.sh");
        (status, started.elapsed())
    });
    let read = async {
        let mut lost = 0u64;
        while let Some(chunk) = stream.next_chunk().await {
            match chunk {
                OutputChunk::Stdout(b) => out.extend_from_slice(&b),
                OutputChunk::Stderr(b) => panic!("stderr: {}", String::from_utf8_lossy(&b)),
                OutputChunk::Lost(n) => lost += n,
            }
        }
        (lost, stream.wait().await)
    };
    let (lost, status) = tokio::time::timeout(Duration::from_secs(180), read)
        .await
        .expect("the stream ends");
    let (restarted, took) = restart.await.expect("the restart's thread");
    assert!(
        restarted.success(),
        "cluster.sh restart-apiserver: {restarted}"
    );
    eprintln!("the apiserver restart took {took:?}");
    assert!(
        took > Duration::from_secs(1),
        "did the apiserver restart at all?"
    );
    assert_eq!(lost, 0);
    assert!(
        out == counted(lines),
        "the output across the restart differs ({} bytes, {} expected)",
        out.len(),
        counted(lines).len()
    );
    assert_eq!(status, ExitStatus::Exited(3));

    // The detached one, from another driver (another process would do the same).
    let other = runcell_core::connect("k8s", DriverConfig::from_env("k8s"))
        .await
        .expect("the cluster answers again");
    let again = other.attach(run.id()).await.expect("attach");
    let all = again
        .reattach(detached_id, 0)
        .await
        .expect("reattach")
        .collect(1 << 20)
        .await;
    assert_eq!(all.stdout, counted(lines));
    assert_eq!(all.status, ExitStatus::Exited(4));
    run.stop().await.expect("stop");
    let left = driver
        .list(
            &[(labels::RUN_ID.to_string(), run.id().to_string())]
                .into_iter()
                .collect(),
        )
        .await
        .expect("list");
    assert!(left.is_empty(), "{left:?}");
}
