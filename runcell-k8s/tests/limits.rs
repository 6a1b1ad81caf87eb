//! A cluster's limits are typed errors, not waits to the ready timeout: a pod that no node
//! has room for (here: more memory than the node has) fails the create at once with
//! `LimitReached` naming the limit, leaving nothing, while a run already started keeps
//! working; with `wait_unschedulable` the create waits (an autoscaler may add a node)
//! and ends at the ready timeout.
//!
//! Runs when `RUNCELL_TEST` names `k8s`, or, with `RUNCELL_TEST` unset, when `KUBECONFIG`
//! is set; `cargo xtask test` runs it in its Kubernetes phase (restricted ServiceAccount).
//! The image is the local `sandbox-test/busybox:latest` (never pulled).

mod common;

use common::selected;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use runcell_core::{Driver, DriverExt, ErrorKind, PullPolicy, RunExt, RunSpec};
use runcell_k8s::{K8sConfig, K8sDriver};

const IMAGE: &str = "sandbox-test/busybox:latest";
const CASE: &str = "sandbox.test/case";
/// More memory than any test node has (1 TiB).
const TOO_MUCH: u64 = 1 << 40;

fn spec(case: &str) -> RunSpec {
    RunSpec::new(IMAGE)
        .pull(PullPolicy::Never)
        .label(CASE, case)
}

/// The create of a run with more memory than any node has: its error (a run that
/// started anyway is stopped, and the test fails).
async fn create_too_big(driver: &K8sDriver, case: &str) -> runcell_core::Error {
    match driver.create(&spec(case).memory_bytes(TOO_MUCH)).await {
        Ok(run) => {
            let _ = run.stop().await;
            panic!("a pod with {TOO_MUCH} bytes of memory ran");
        }
        Err(e) => e,
    }
}

async fn runs_of(driver: &K8sDriver, case: &str) -> Vec<String> {
    let selector = BTreeMap::from([(CASE.to_string(), case.to_string())]);
    driver
        .list(&selector)
        .await
        .expect("list")
        .into_iter()
        .map(|r| r.id)
        .collect()
}

#[tokio::test]
async fn a_pod_no_node_has_room_for_is_limit_reached_at_once() {
    const CASE_ID: &str = "k8s-limit-memory";
    if !selected() {
        eprintln!("*** SKIPPED: not selected (RUNCELL_TEST=k8s)");
        return;
    }
    // Well above how long the scheduler takes to say so: a wait would show.
    let ready_timeout = Duration::from_secs(60);
    let driver = K8sDriver::connect(K8sConfig::default().ready_timeout(ready_timeout))
        .await
        .expect("a cluster (KUBECONFIG)");
    let running = driver.start(&spec(CASE_ID)).await.expect("a run");

    let started = Instant::now();
    let e = create_too_big(&driver, CASE_ID).await;
    let took = started.elapsed();
    let left = runs_of(&driver, CASE_ID).await;
    let still = running
        .exec(runcell_core::ExecSpec::new(["echo", "on"]))
        .await;
    running.stop().await.expect("stop");
    assert_eq!(e.kind(), ErrorKind::LimitReached, "{e}");
    assert!(e.is_temporary(), "{e}");
    let limit = e.context_value("limit").unwrap_or_default();
    assert!(limit.contains("memory"), "limit {limit:?} of {e}");
    assert!(
        took < Duration::from_secs(30),
        "refused after {took:?} (ready timeout {ready_timeout:?})"
    );
    // Nothing of the refused create is left; the run started before kept working.
    assert_eq!(left, [running.id().to_string()]);
    assert_eq!(still.expect("exec").stdout_str(), "on\n");
    assert!(runs_of(&driver, CASE_ID).await.is_empty());
}

#[tokio::test]
async fn with_wait_unschedulable_the_create_waits_to_the_ready_timeout() {
    const CASE_ID: &str = "k8s-limit-wait";
    if !selected() {
        eprintln!("*** SKIPPED: not selected (RUNCELL_TEST=k8s)");
        return;
    }
    let ready_timeout = Duration::from_secs(8);
    let driver = K8sDriver::connect(
        K8sConfig::default()
            .ready_timeout(ready_timeout)
            .wait_unschedulable(true),
    )
    .await
    .expect("a cluster (KUBECONFIG)");
    let started = Instant::now();
    let e = create_too_big(&driver, CASE_ID).await;
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(
        started.elapsed() >= ready_timeout,
        "{:?}",
        started.elapsed()
    );
    assert!(e.to_string().contains("Insufficient memory"), "{e}");
    assert!(runs_of(&driver, CASE_ID).await.is_empty());
}
