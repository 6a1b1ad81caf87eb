//! A snapshot moved between engines through a registry (Debian's `docker-registry` on
//! loopback with basic auth): `push_snapshot` without a login is a `Config` error naming
//! `repository`; with one it pushes `repository:<id>` and leaves no extra name; once the
//! local snapshot is removed, `pull_snapshot` brings it back as the same snapshot, and a
//! run from it has the source's files. What is not a pushed snapshot is refused, and
//! nothing is left. Skipped without an engine or the registry binary, unless `CI` is set
//! or `RUNCELL_REQUIRE` names docker: then it fails. No outside registry is contacted.

use std::process::{Command, Stdio};

use runcell_core::{
    Driver, DriverExt, ErrorKind, ExecSpec, Network, RunExt, RunSpec, SnapshotOptions,
};
use runcell_docker::{DockerConfig, DockerDriver};

mod common;
use common::registry::{PASSWORD, REGISTRY, Registry, USER};
use common::strict;

const CASE: &str = "snapshot-move";

/// Whether the engine the driver speaks to (`DOCKER_HOST`'s, as the CLI's) has an image
/// of that name.
fn engine_has(name: &str) -> bool {
    Command::new("docker")
        .args(["image", "inspect", name])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_move_through_a_registry() {
    let empty = tempfile::tempdir().unwrap();
    let base = DockerConfig::default().docker_config_dir(empty.path());
    if let Err(e) = DockerDriver::connect(base.clone()).await {
        assert!(!strict(), "CI or RUNCELL_REQUIRE names docker, but: {e}");
        eprintln!("no Docker engine, test skipped: {e}");
        return;
    }
    if !std::path::Path::new(REGISTRY).exists() {
        assert!(
            !strict(),
            "{REGISTRY} is missing: apt-get install docker-registry"
        );
        eprintln!("\n*** SKIPPED snapshots_move_through_a_registry: {REGISTRY} is missing");
        return;
    }
    let registry = Registry::start(None);
    let host = format!("127.0.0.1:{}", registry.port);
    // Whatever happens in the check, nothing of this process is left: its runs and
    // snapshots.
    let result = tokio::spawn(check(base.clone(), host)).await;
    let driver = DockerDriver::connect(base).await.unwrap();
    let me = Some(runcell_core::labels::Owner::current());
    for snapshot in driver.snapshots().await.unwrap() {
        if snapshot.owner() == me {
            let _ = driver.remove_snapshot(&snapshot.id).await;
        }
    }
    let selector =
        std::collections::BTreeMap::from([("sandbox.test/case".to_string(), CASE.to_string())]);
    for run in driver.list(&selector).await.unwrap() {
        let _ = driver.remove(&run.id).await;
    }
    drop(registry);
    if let Err(panic) = result {
        std::panic::resume_unwind(panic.into_panic());
    }
}

async fn check(base: DockerConfig, host: String) {
    let repository = format!("{host}/snaps");
    let anonymous = DockerDriver::connect(base.clone()).await.unwrap();
    let driver = DockerDriver::connect(base.clone().credentials(&host, USER, PASSWORD))
        .await
        .unwrap();
    let image = runcell_core::envvar::var("RUNCELL_CONFORMANCE_IMAGE")
        .unwrap_or_else(|| "sandbox-test/busybox:latest".into());
    let mut spec = RunSpec::new(image).label("sandbox.test/case", CASE);
    spec.network = Network::None;

    let source = driver.start(&spec).await.unwrap();
    let out = source
        .exec(ExecSpec::new([
            "sh",
            "-c",
            "mkdir -p /usr/local && echo moved > /usr/local/moved && echo ws > in-workspace",
        ]))
        .await
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let snapshot = source.snapshot(SnapshotOptions::default()).await.unwrap();
    source.stop().await.unwrap();
    let pushed_name = format!("{repository}:{}", snapshot.id);

    // Bad input first: typed, naming the field, nothing sent.
    let e = driver
        .push_snapshot(&snapshot.id, "snaps")
        .await
        .unwrap_err();
    assert_eq!(
        (e.kind(), e.field()),
        (ErrorKind::InvalidSpec, Some("repository")),
        "{e}"
    );
    let e = driver.pull_snapshot(&repository).await.unwrap_err();
    assert_eq!(
        (e.kind(), e.field()),
        (ErrorKind::InvalidSpec, Some("reference")),
        "{e}"
    );

    // Without a login: refused, typed; no name of the push is left.
    let e = anonymous
        .push_snapshot(&snapshot.id, &repository)
        .await
        .unwrap_err();
    eprintln!("anonymous push: {e}");
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(!format!("{e:?}").contains(PASSWORD));
    assert!(!engine_has(&pushed_name), "{pushed_name} left");

    // With it: pushed; the push's own name goes.
    let reference = driver
        .push_snapshot(&snapshot.id, &repository)
        .await
        .unwrap();
    assert_eq!(reference, pushed_name);
    assert!(!engine_has(&pushed_name), "{pushed_name} left");

    // Gone here, then pulled back: the same snapshot, and a run from it has the files.
    driver.remove_snapshot(&snapshot.id).await.unwrap();
    assert!(
        !driver
            .snapshots()
            .await
            .unwrap()
            .iter()
            .any(|s| s.id == snapshot.id)
    );
    let e = anonymous.pull_snapshot(&reference).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    let pulled = driver.pull_snapshot(&reference).await.unwrap();
    assert_eq!(
        (&pulled.id, &pulled.workspace_path),
        (&snapshot.id, &snapshot.workspace_path)
    );
    assert!(
        !engine_has(&pushed_name),
        "{pushed_name} left after the pull"
    );
    assert!(
        driver
            .snapshots()
            .await
            .unwrap()
            .iter()
            .any(|s| s.id == snapshot.id)
    );
    let mut from = RunSpec::from_snapshot(&pulled).label("sandbox.test/case", CASE);
    from.network = Network::None;
    let run = driver.start(&from).await.unwrap();
    let out = run
        .exec(ExecSpec::new([
            "sh",
            "-c",
            "cat /usr/local/moved in-workspace",
        ]))
        .await
        .unwrap();
    run.stop().await.unwrap();
    assert_eq!(out.stdout_str(), "moved\nws\n", "{out:?}");

    // An image that carries only some of a snapshot's labels (as a registry anyone can
    // push to may serve): refused, and no snapshot tag is left where nothing lists it.
    let crafted_id = runcell_core::new_snapshot_id();
    let crafted = format!("{repository}:{crafted_id}");
    push_crafted(&host, &crafted, &crafted_id);
    let e = driver.pull_snapshot(&crafted).await.unwrap_err();
    eprintln!("pulling a crafted image: {e}");
    assert_eq!(
        (e.kind(), e.field()),
        (ErrorKind::InvalidSpec, Some("reference")),
        "{e}"
    );
    assert!(!engine_has(&crafted));
    assert!(!engine_has(&format!("runcell-snapshot:{crafted_id}")));

    // A pushed name that is no snapshot of ours: refused, and nothing kept.
    let other = format!("{repository}:{}", runcell_core::new_snapshot_id());
    let e = driver.pull_snapshot(&other).await.unwrap_err();
    eprintln!("pulling nothing: {e}");
    assert!(!engine_has(&other));

    driver.remove_snapshot(&snapshot.id).await.unwrap();
    assert!(
        !driver
            .snapshots()
            .await
            .unwrap()
            .iter()
            .any(|s| s.id == snapshot.id)
    );
}

/// Pushes, as `name`, the suite's image labelled as managed and as snapshot `id`, and
/// nothing else a snapshot has (with a login of its own; the local copy removed).
fn push_crafted(host: &str, name: &str, id: &str) {
    let image = runcell_core::envvar::var("RUNCELL_CONFORMANCE_IMAGE")
        .unwrap_or_else(|| "sandbox-test/busybox:latest".into());
    let container = format!("runcell-crafted-{}", std::process::id());
    common::registry::docker(&["create", "--name", &container, &image, "true"], None);
    let labels = format!(
        "LABEL {}={} {}={id}",
        runcell_core::labels::MANAGED_BY,
        runcell_core::labels::MANAGED_BY_VALUE,
        runcell_core::snapshot_labels::SNAPSHOT_ID
    );
    common::registry::docker(&["commit", "--change", &labels, &container, name], None);
    common::registry::docker(&["rm", "-f", "-v", &container], None);
    let login = tempfile::tempdir().unwrap();
    let dir = login.path().to_str().unwrap();
    common::registry::docker(
        &[
            "--config",
            dir,
            "login",
            "-u",
            USER,
            "--password-stdin",
            host,
        ],
        Some(PASSWORD),
    );
    common::registry::docker(&["--config", dir, "push", name], None);
    common::registry::docker(&["rmi", name], None);
}
