//! Kubernetes snapshots against snapshot registries that fail (Debian's `docker-registry`
//! on loopback): one nobody listens on, one that refuses pushes (read-only), one killed
//! while the layer is pushed. Each snapshot is a typed error, and none is ever listed:
//! the manifest, which makes a snapshot, is pushed last. Once the killed registry is back,
//! a snapshot works, and its removal leaves no tag. The runs start from an image the node
//! pulls from a registry of the test's own (a snapshot's base must come from a registry).
//!
//! Runs when `RUNCELL_TEST` names `k8s` (or, with it unset, when `KUBECONFIG` is set);
//! `cargo xtask test` runs it in its Kubernetes phase. Selected but without the registry
//! binary: a failure when `CI` is set or `RUNCELL_REQUIRE` names `k8s`.

mod common;

use common::{pull_secret, selected, strict};

#[path = "../../runcell-docker/tests/common/registry.rs"]
mod registry;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use registry::{PASSWORD, REGISTRY, Registry, USER, push_test_image};
use runcell_core::{Driver, DriverExt, ErrorKind, ExecSpec, Run, RunExt, RunSpec, SnapshotOptions};
use runcell_k8s::{K8sConfig, K8sDriver, SnapshotRegistry};

const CASE: &str = "k8s-snapshot-registry";
const DELETES: &str = "  delete:\n    enabled: true\n";
const READ_ONLY: &str = "  maintenance:\n    readonly:\n      enabled: true\n";

/// Runs `script` in `run`; it must succeed.
async fn sh(run: &dyn Run, script: &str) {
    let out = run.exec(ExecSpec::new(["sh", "-c", script])).await.unwrap();
    assert!(out.status.success(), "{script}: {out:?}");
}

async fn driver_to(repository: String) -> K8sDriver {
    K8sDriver::connect(
        K8sConfig::default().snapshot_registry(SnapshotRegistry::new(repository).plain_http(true)),
    )
    .await
    .expect("a cluster (KUBECONFIG)")
}

/// The snapshot tags of `repo` in the registry on `port` (none when it has no such
/// repository).
async fn tags(port: u16, repo: &str) -> Vec<String> {
    tags_as(port, repo, None).await
}

/// [`tags`], logged in as `login` (user, password).
async fn tags_as(port: u16, repo: &str, login: Option<(&str, &str)>) -> Vec<String> {
    let url = format!("http://127.0.0.1:{port}/v2/{repo}/tags/list");
    let mut request = reqwest::Client::new().get(&url);
    if let Some((user, password)) = login {
        request = request.basic_auth(user, Some(password));
    }
    let answer = request.send().await.expect("the registry answers");
    if answer.status().as_u16() == 404 {
        return Vec::new();
    }
    let json: serde_json::Value = answer.json().await.expect("a tag list");
    json["tags"]
        .as_array()
        .map(|t| {
            t.iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// Whether test `name` runs (a failure when it is selected, strict, and the registry
/// binary is missing).
fn runs(name: &str) -> bool {
    if !selected() {
        eprintln!("*** SKIPPED {name}: not selected (RUNCELL_TEST=k8s)");
        return false;
    }
    if !std::path::Path::new(REGISTRY).exists() {
        assert!(
            !strict(),
            "{REGISTRY} is missing: apt-get install docker-registry"
        );
        eprintln!("*** SKIPPED {name}: {REGISTRY} is missing");
        return false;
    }
    // `RUST_LOG=runcell_k8s=debug` shows the snapshots' phases.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    true
}

/// Waits until no run of test case `case` is left (stopped pods go a moment after their
/// deletion), removes any that stays, and returns those.
async fn leftovers(case: &str) -> Vec<runcell_core::RunInfo> {
    let driver = K8sDriver::connect(K8sConfig::default()).await.unwrap();
    let selector = BTreeMap::from([("sandbox.test/case".to_string(), case.to_string())]);
    let deadline = Instant::now() + Duration::from_secs(60);
    let leftover = loop {
        let left = driver.list(&selector).await.unwrap();
        if left.is_empty() || Instant::now() > deadline {
            break left;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    for run in &leftover {
        let _ = driver.remove(&run.id).await;
    }
    leftover
}

/// A snapshot registry that wants a login: without one the snapshot is a `Config` error
/// and nothing is tagged; with `SnapshotRegistry::login` it is pushed, listed, a run from
/// it (pulled by the node with the pods' `image_pull_secrets`) has its files, and its
/// removal leaves no tag. The password is never in the driver's `Debug` or an error.
#[tokio::test]
async fn a_registry_that_wants_a_login_gets_it() {
    const CASE_LOGIN: &str = "k8s-snapshot-registry-login";
    if !runs("a_registry_that_wants_a_login_gets_it") {
        return;
    }
    let registry = Registry::login_with(DELETES);
    let host = format!("127.0.0.1:{}", registry.port);
    let (image, local) = push_test_image(&host, "snapbase");
    let (secrets, secret) = pull_secret(&host, USER, PASSWORD).await;
    let spec = RunSpec::new(image).label("sandbox.test/case", CASE_LOGIN);
    let result = tokio::spawn(check_login(spec, host, secret.clone(), registry.port)).await;
    let _ = secrets
        .delete(&secret, &kube::api::DeleteParams::default())
        .await;
    let leftover = leftovers(CASE_LOGIN).await;
    local.remove();
    drop(registry);
    if let Err(panic) = result {
        std::panic::resume_unwind(panic.into_panic());
    }
    assert!(leftover.is_empty(), "runs left: {leftover:?}");
}

async fn check_login(spec: RunSpec, host: String, secret: String, port: u16) {
    let repository = format!("{host}/snaps");
    let connect = |login: bool| {
        let mut registry = SnapshotRegistry::new(repository.clone()).plain_http(true);
        if login {
            registry = registry.login(USER, PASSWORD);
        }
        let config = K8sConfig::default()
            .image_pull_secrets([secret.clone()])
            .snapshot_registry(registry);
        async move {
            K8sDriver::connect(config)
                .await
                .expect("a cluster (KUBECONFIG)")
        }
    };
    let with = connect(true).await;
    assert!(!format!("{with:?}").contains(PASSWORD), "{with:?}");
    let run = with
        .start(&spec)
        .await
        .expect("a run from the pulled image");
    sh(&*run, "echo changed > /usr/local/changed").await;

    // Anonymous (no login given, and none in config.json for this host): refused.
    let anonymous = connect(false).await;
    let same = anonymous.attach(run.id()).await.unwrap();
    let e = same
        .snapshot(SnapshotOptions::default())
        .await
        .expect_err("an anonymous snapshot to a registry that wants a login");
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert_eq!(e.field(), Some("snapshot_registry"), "{e}");
    assert!(e.to_string().contains("not authorized"), "{e}");
    assert!(
        tags_as(port, "snaps", Some((USER, PASSWORD)))
            .await
            .is_empty()
    );
    eprintln!("snapshot_registry: anonymous refused: {e}");

    let made = run
        .snapshot(SnapshotOptions::default())
        .await
        .expect("a snapshot with the login");
    assert!(!format!("{made:?}").contains(PASSWORD));
    assert_eq!(
        tags_as(port, "snaps", Some((USER, PASSWORD))).await,
        vec![made.id.clone()]
    );
    let listed = with.snapshots().await.unwrap();
    assert_eq!(
        listed.iter().map(|s| s.id.clone()).collect::<Vec<_>>(),
        vec![made.id.clone()]
    );
    let from = with
        .start(&RunSpec::from_snapshot(&made).label(
            "sandbox.test/case",
            spec.labels["sandbox.test/case"].as_str(),
        ))
        .await
        .expect("a run from the snapshot, pulled with the Secret");
    let out = from
        .exec(ExecSpec::new(["cat", "/usr/local/changed"]))
        .await
        .unwrap();
    assert_eq!(out.stdout_str(), "changed\n", "{out:?}");
    from.stop().await.unwrap();
    run.stop().await.unwrap();
    with.remove_snapshot(&made.id).await.unwrap();
    assert!(
        tags_as(port, "snaps", Some((USER, PASSWORD)))
            .await
            .is_empty()
    );
    assert!(with.snapshots().await.unwrap().is_empty());
}

#[tokio::test]
async fn a_registry_that_refuses_or_dies_leaves_no_snapshot() {
    if !runs("a_registry_that_refuses_or_dies_leaves_no_snapshot") {
        return;
    }
    let bases = Registry::open_with(DELETES);
    let (image, local) = push_test_image(&format!("127.0.0.1:{}", bases.port), "snapbase");
    let spec = RunSpec::new(image).label("sandbox.test/case", CASE);
    let result = tokio::spawn(check(spec)).await;
    let leftover = leftovers(CASE).await;
    local.remove();
    drop(bases);
    if let Err(panic) = result {
        std::panic::resume_unwind(panic.into_panic());
    }
    assert!(leftover.is_empty(), "runs left: {leftover:?}");
}

async fn check(spec: RunSpec) {
    // Nobody listens: Unavailable, naming the registry.
    let nobody = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let driver = driver_to(format!("127.0.0.1:{nobody}/snaps")).await;
    let run = driver
        .start(&spec)
        .await
        .expect("a run from the pulled image");
    sh(&*run, "echo changed > /usr/local/changed").await;
    let e = run
        .snapshot(SnapshotOptions::default())
        .await
        .expect_err("a snapshot to a registry nobody listens on");
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(e.to_string().contains("snapshot registry"), "{e}");
    run.stop().await.unwrap();

    eprintln!("snapshot_registry: nobody listens: ok");
    // Pushes refused (read-only): an error, and nothing listed or tagged.
    let read_only = Registry::open_with(READ_ONLY);
    let driver = driver_to(format!("127.0.0.1:{}/snaps", read_only.port)).await;
    let run = driver.start(&spec).await.unwrap();
    sh(&*run, "echo changed > /usr/local/changed").await;
    let e = run
        .snapshot(SnapshotOptions::default())
        .await
        .expect_err("a snapshot to a read-only registry");
    assert!(e.to_string().contains("snapshot registry: pushing"), "{e}");
    assert!(driver.snapshots().await.unwrap().is_empty());
    assert!(tags(read_only.port, "snaps").await.is_empty());
    run.stop().await.unwrap();

    eprintln!("snapshot_registry: read-only: ok");
    // Killed while the layer is pushed: an error; back up, nothing was made; then a
    // snapshot works and its removal leaves no tag.
    let mut dying = Registry::open_with(DELETES);
    let driver = driver_to(format!("127.0.0.1:{}/snaps", dying.port)).await;
    let run = driver.start(&spec).await.unwrap();
    sh(&*run, "head -c 100000000 /dev/urandom > /usr/local/big").await;
    let uploads = dying
        .data_dir()
        .join("docker/registry/v2/repositories/snaps/_uploads");
    let taking = {
        let run_ref = &*run;
        async move { run_ref.snapshot(SnapshotOptions::default()).await }
    };
    let watch = async {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let started = std::fs::read_dir(&uploads).is_ok_and(|mut d| d.next().is_some());
            if started {
                break;
            }
            assert!(Instant::now() < deadline, "no upload began in 120 s");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::pin!(taking);
    let outcome = tokio::select! {
        made = &mut taking => Some(made),
        () = watch => None,
    };
    assert!(
        outcome.is_none(),
        "the snapshot ended before any upload: {outcome:?}"
    );
    eprintln!("snapshot_registry: an upload began");
    dying.kill();
    let e = taking
        .await
        .expect_err("a snapshot whose registry died while it pushed");
    assert!(e.to_string().contains("snapshot registry"), "{e}");
    eprintln!("snapshot_registry: killed midway: {e}");
    dying.restart();
    eprintln!("snapshot_registry: restarted");
    assert!(driver.snapshots().await.unwrap().is_empty());
    assert!(tags(dying.port, "snaps").await.is_empty());
    eprintln!("snapshot_registry: nothing listed");
    let made = run
        .snapshot(SnapshotOptions::default())
        .await
        .expect("a snapshot once the registry is back");
    eprintln!("snapshot_registry: made {}", made.id);
    assert_eq!(tags(dying.port, "snaps").await, vec![made.id.clone()]);
    run.stop().await.unwrap();
    driver.remove_snapshot(&made.id).await.unwrap();
    assert!(tags(dying.port, "snaps").await.is_empty());
    assert!(driver.snapshots().await.unwrap().is_empty());
}
