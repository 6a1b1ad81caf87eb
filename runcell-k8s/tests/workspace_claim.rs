//! The workspace on a PersistentVolumeClaim (`K8sConfig::workspace_volume`), on a real
//! cluster with a StorageClass `runcell-hostpath` (the test cluster's: the controller
//! manager's hostPath provisioner, `testenv/k8s/cluster.sh`):
//!
//! - an existing claim keeps what one run wrote for the next, and stop leaves it alone;
//! - a per-run claim (`<run id>-ws`, from the driver's config keys) is bound, owned by the
//!   pod and holds the workspace while the run lives, and is gone after stop;
//! - a kept per-run claim stays after stop, labelled kept, with the run's files;
//! - a StorageClass that does not exist, or an existing claim that does not, fails the
//!   create with a typed error naming the claim within the ready timeout, leaving nothing.
//!
//! Every case checks that no pod or claim of it is left, and deletes what it made
//! whatever happens. Runs when `RUNCELL_TEST` names `k8s`, or, with `RUNCELL_TEST` unset,
//! when `KUBECONFIG` is set; `cargo xtask test` runs it in its Kubernetes phase
//! (restricted ServiceAccount, `deploy/rbac.yaml`). The image is the local
//! `sandbox-test/busybox:latest` (never pulled).

mod common;

use common::{selected, strict};

use std::collections::BTreeMap;
use std::future::Future;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{
    PersistentVolumeClaim, PersistentVolumeClaimSpec, Pod, VolumeResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, PostParams};
use runcell_core::{
    DEFAULT_WORKSPACE_PATH, Driver, DriverConfig, ErrorKind, ExecSpec, PullPolicy, Run, RunExt,
    RunSpec, labels,
};
use runcell_k8s::{
    K8sConfig, K8sDriver, WORKSPACE_KEPT_LABEL, WorkspaceVolume, workspace_claim_name,
};

const IMAGE: &str = "sandbox-test/busybox:latest";
/// The test cluster's StorageClass (dynamic hostPath volumes).
const CLASS: &str = "runcell-hostpath";
const CASE: &str = "sandbox.test/case";
/// How long a claim may take to go after its run stopped.
const GONE_BOUND: Duration = Duration::from_secs(30);

/// The claims API of the client's namespace (the driver's too: both from `KUBECONFIG`).
/// `None` (skip) when no cluster answers and the test is not required.
async fn claims_api(test: &str) -> Option<Api<PersistentVolumeClaim>> {
    match kube::Client::try_default().await {
        Ok(client) => {
            let namespace = client.default_namespace().to_string();
            Some(Api::namespaced(client, &namespace))
        }
        Err(e) => {
            assert!(!strict(), "{test}: no cluster: {e}");
            eprintln!("*** SKIPPED {test}: no cluster: {e}");
            None
        }
    }
}

/// The pods of the same client and namespace.
fn pods_api(claims: &Api<PersistentVolumeClaim>) -> Api<Pod> {
    Api::default_namespaced(claims.clone().into_client())
}

fn spec(case: &str) -> RunSpec {
    RunSpec::new(IMAGE)
        .pull(PullPolicy::Never)
        .label(CASE, case)
}

fn selector(case: &str) -> BTreeMap<String, String> {
    BTreeMap::from([(CASE.to_string(), case.to_string())])
}

async fn connect(volume: WorkspaceVolume, ready_timeout: Duration) -> K8sDriver {
    K8sDriver::connect(
        K8sConfig::default()
            .workspace_volume(volume)
            .ready_timeout(ready_timeout),
    )
    .await
    .expect("a cluster (KUBECONFIG)")
}

/// Runs `body`, then, whatever happened, removes the case's runs and claims (waiting for
/// the claims to go), then fails if the body failed or anything of the case was left.
async fn with_cleanup<F>(case: &str, claims: &Api<PersistentVolumeClaim>, body: F)
where
    F: Future<Output = ()> + Send + 'static,
{
    let result = tokio::spawn(body).await;
    let driver = K8sDriver::connect(K8sConfig::default()).await.unwrap();
    let runs = driver.list(&selector(case)).await.unwrap_or_default();
    for run in &runs {
        let _ = driver.remove(&run.id).await;
    }
    let params = ListParams::default().labels(&format!("{CASE}={case}"));
    let left = claims
        .list(&params)
        .await
        .map(|l| l.items)
        .unwrap_or_default();
    for claim in &left {
        if let Some(name) = &claim.metadata.name {
            let _ = claims.delete(name, &DeleteParams::default()).await;
        }
    }
    let deadline = Instant::now() + GONE_BOUND;
    let mut still = Vec::new();
    while Instant::now() < deadline {
        still = claim_names(claims, case).await;
        if still.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    if let Err(panic) = result {
        std::panic::resume_unwind(panic.into_panic());
    }
    assert!(runs.is_empty(), "{case}: runs left behind: {runs:?}");
    assert!(left.is_empty(), "{case}: claims left behind: {left:?}");
    assert!(
        still.is_empty(),
        "{case}: claims that would not go: {still:?}"
    );
}

async fn claim_names(claims: &Api<PersistentVolumeClaim>, case: &str) -> Vec<String> {
    let params = ListParams::default().labels(&format!("{CASE}={case}"));
    claims
        .list(&params)
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|c| c.metadata.name)
        .collect()
}

/// Waits up to [`GONE_BOUND`] for claim `name` to be gone (not only being deleted).
async fn wait_gone(claims: &Api<PersistentVolumeClaim>, name: &str) -> Result<Duration, String> {
    let start = Instant::now();
    loop {
        match claims.get_opt(name).await.unwrap() {
            None => return Ok(start.elapsed()),
            Some(c) if start.elapsed() > GONE_BOUND => {
                return Err(format!(
                    "claim {name} still there {GONE_BOUND:?} after stop (deleting: {})",
                    c.metadata.deletion_timestamp.is_some()
                ));
            }
            Some(_) => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
}

async fn sh(run: &dyn Run, script: &str) -> String {
    let out = run.exec(ExecSpec::new(["sh", "-c", script])).await.unwrap();
    assert!(
        out.status.success(),
        "{script}: {} {}",
        out.status,
        out.stderr_str()
    );
    out.stdout_str()
}

fn phase(claim: &PersistentVolumeClaim) -> Option<&str> {
    claim.status.as_ref()?.phase.as_deref()
}

/// (1) A claim made beforehand: run A writes, stops; run B on the same claim reads it.
/// Stop leaves the user's claim alone.
#[tokio::test]
async fn an_existing_claim_keeps_the_workspace_across_runs() {
    const TEST: &str = "an_existing_claim_keeps_the_workspace_across_runs";
    const CASE_ID: &str = "k8s-ws-existing";
    if !selected() {
        eprintln!("*** SKIPPED {TEST}: not selected (RUNCELL_TEST=k8s)");
        return;
    }
    let Some(claims) = claims_api(TEST).await else {
        return;
    };
    let name = format!("runcell-test-ws-{:08x}", rand::random::<u32>());
    let claim = PersistentVolumeClaim {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            labels: Some(BTreeMap::from([(CASE.to_string(), CASE_ID.to_string())])),
            ..ObjectMeta::default()
        },
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec!["ReadWriteOnce".into()]),
            storage_class_name: Some(CLASS.into()),
            resources: Some(VolumeResourceRequirements {
                requests: Some(BTreeMap::from([(
                    "storage".to_string(),
                    Quantity("16Mi".into()),
                )])),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    claims.create(&PostParams::default(), &claim).await.unwrap();
    let body = {
        let (claims, name) = (claims.clone(), name.clone());
        async move {
            let driver = connect(WorkspaceVolume::claim(&name), Duration::from_secs(90)).await;
            let file = format!("{DEFAULT_WORKSPACE_PATH}/note.txt");
            let a = driver.create(&spec(CASE_ID)).await.unwrap();
            sh(&*a, &format!("echo written-by-{} > {file} && sync", a.id())).await;
            let writer = a.id().to_string();
            a.stop().await.unwrap();
            assert!(driver.list(&selector(CASE_ID)).await.unwrap().is_empty());

            let b = driver.create(&spec(CASE_ID)).await.unwrap();
            assert_ne!(b.id(), writer);
            assert_eq!(
                sh(&*b, &format!("cat {file}")).await,
                format!("written-by-{writer}\n")
            );
            b.stop().await.unwrap();
            assert!(driver.list(&selector(CASE_ID)).await.unwrap().is_empty());
            // The user's claim is not the run's: still there, not being deleted.
            let still = claims.get(&name).await.unwrap();
            assert!(still.metadata.deletion_timestamp.is_none());
            assert_eq!(phase(&still), Some("Bound"));
            // Deleted here, so that the cleanup's check sees nothing left.
            claims
                .delete(&name, &DeleteParams::default())
                .await
                .unwrap();
            wait_gone(&claims, &name).await.unwrap();
        }
    };
    with_cleanup(CASE_ID, &claims, body).await;
}

/// (2) A per-run claim, configured by the registry's keys: bound, owned by the pod, the
/// workspace's mount while the run lives; gone after stop.
#[tokio::test]
async fn a_per_run_claim_lives_and_goes_with_its_run() {
    const TEST: &str = "a_per_run_claim_lives_and_goes_with_its_run";
    const CASE_ID: &str = "k8s-ws-per-run";
    if !selected() {
        eprintln!("*** SKIPPED {TEST}: not selected (RUNCELL_TEST=k8s)");
        return;
    }
    let Some(claims) = claims_api(TEST).await else {
        return;
    };
    let body = {
        let claims = claims.clone();
        async move {
            let driver = K8sDriver::from_config(DriverConfig::new(
                "k8s",
                [
                    ("workspace_storage_class", CLASS),
                    ("workspace_size", "16Mi"),
                    ("ready_timeout_secs", "90"),
                ],
            ))
            .await
            .unwrap();
            let run = driver.create(&spec(CASE_ID)).await.unwrap();
            let id = run.id().to_string();
            let name = workspace_claim_name(&id);
            assert_eq!(name, format!("{id}-ws"));

            let claim = claims.get(&name).await.unwrap();
            assert_eq!(phase(&claim), Some("Bound"), "{claim:?}");
            let labels = claim.metadata.labels.clone().unwrap_or_default();
            assert_eq!(
                labels.get(labels::MANAGED_BY).map(String::as_str),
                Some(labels::MANAGED_BY_VALUE)
            );
            assert_eq!(labels.get(labels::RUN_ID), Some(&id));
            assert_eq!(labels.get(CASE).map(String::as_str), Some(CASE_ID));
            assert!(!labels.contains_key(WORKSPACE_KEPT_LABEL));
            let owners = claim.metadata.owner_references.clone().unwrap_or_default();
            let pod = pods_api(&claims).get(&id).await.unwrap();
            assert_eq!(owners.len(), 1, "{owners:?}");
            assert_eq!(
                (owners[0].kind.as_str(), owners[0].name.as_str()),
                ("Pod", id.as_str())
            );
            assert_eq!(Some(&owners[0].uid), pod.metadata.uid.as_ref());
            assert_eq!(owners[0].block_owner_deletion, Some(false));
            let volume = pod
                .spec
                .iter()
                .flat_map(|s| s.volumes.iter().flatten())
                .find(|v| v.name == "workspace")
                .and_then(|v| v.persistent_volume_claim.clone())
                .expect("the workspace volume is a claim");
            assert_eq!(volume.claim_name, name);

            // The workspace is the claim's volume (a hostPath PV of the provisioner), and
            // what is written there is there for the next exec.
            let mount = sh(
                &*run,
                &format!("grep ' {DEFAULT_WORKSPACE_PATH} ' /proc/self/mountinfo"),
            )
            .await;
            assert!(mount.contains("hostpath_pv"), "{mount}");
            sh(
                &*run,
                &format!("echo kept-between-execs > {DEFAULT_WORKSPACE_PATH}/f"),
            )
            .await;
            assert_eq!(
                sh(&*run, &format!("cat {DEFAULT_WORKSPACE_PATH}/f")).await,
                "kept-between-execs\n"
            );

            run.stop().await.unwrap();
            let took = wait_gone(&claims, &name).await.unwrap();
            eprintln!("{TEST}: the claim was gone {took:?} after stop");
            assert!(driver.list(&selector(CASE_ID)).await.unwrap().is_empty());
            assert!(pods_api(&claims).get_opt(&id).await.unwrap().is_none());
        }
    };
    with_cleanup(CASE_ID, &claims, body).await;
}

/// (3) `keep`: after stop the claim stays, labelled kept and owned by no one, with the
/// run's files (read back by a run on it as an existing claim); the test deletes it.
#[tokio::test]
async fn a_kept_claim_stays_after_its_run() {
    const TEST: &str = "a_kept_claim_stays_after_its_run";
    const CASE_ID: &str = "k8s-ws-kept";
    if !selected() {
        eprintln!("*** SKIPPED {TEST}: not selected (RUNCELL_TEST=k8s)");
        return;
    }
    let Some(claims) = claims_api(TEST).await else {
        return;
    };
    let body = {
        let claims = claims.clone();
        async move {
            let driver = connect(
                WorkspaceVolume::PerRun {
                    storage_class: Some(CLASS.into()),
                    size: "16Mi".into(),
                    keep: true,
                },
                Duration::from_secs(90),
            )
            .await;
            let run = driver.create(&spec(CASE_ID)).await.unwrap();
            let name = workspace_claim_name(run.id());
            sh(
                &*run,
                &format!("echo survives > {DEFAULT_WORKSPACE_PATH}/result && sync"),
            )
            .await;
            run.stop().await.unwrap();
            assert!(driver.list(&selector(CASE_ID)).await.unwrap().is_empty());
            // Give a deletion (garbage collection, or stop's own) time to show.
            tokio::time::sleep(Duration::from_secs(3)).await;
            let claim = claims
                .get_opt(&name)
                .await
                .unwrap()
                .expect("the kept claim");
            assert!(claim.metadata.deletion_timestamp.is_none());
            assert_eq!(phase(&claim), Some("Bound"));
            assert_eq!(claim.metadata.owner_references, None);
            let labels = claim.metadata.labels.clone().unwrap_or_default();
            assert_eq!(
                labels.get(WORKSPACE_KEPT_LABEL).map(String::as_str),
                Some("true")
            );

            // What the run left is there for a run on it as an existing claim.
            let reader = connect(WorkspaceVolume::claim(&name), Duration::from_secs(90)).await;
            let next = reader.create(&spec(CASE_ID)).await.unwrap();
            assert_eq!(
                sh(&*next, &format!("cat {DEFAULT_WORKSPACE_PATH}/result")).await,
                "survives\n"
            );
            next.stop().await.unwrap();
            assert!(claims.get_opt(&name).await.unwrap().is_some());

            claims
                .delete(&name, &DeleteParams::default())
                .await
                .unwrap();
            wait_gone(&claims, &name).await.unwrap();
        }
    };
    with_cleanup(CASE_ID, &claims, body).await;
}

/// (4) A StorageClass that does not exist: the create fails within the ready timeout with
/// a typed error naming the claim and the class, and leaves no pod and no claim. A claim
/// with no class and no volume to bind to: a timeout naming the claim and why. An
/// existing claim that does not exist: refused before anything is created.
#[tokio::test]
async fn claims_that_cannot_bind_fail_the_create_naming_them() {
    const TEST: &str = "claims_that_cannot_bind_fail_the_create_naming_them";
    const CASE_ID: &str = "k8s-ws-unbindable";
    if !selected() {
        eprintln!("*** SKIPPED {TEST}: not selected (RUNCELL_TEST=k8s)");
        return;
    }
    let Some(claims) = claims_api(TEST).await else {
        return;
    };
    let body = {
        let claims = claims.clone();
        async move {
            const READY: Duration = Duration::from_secs(20);
            let class = format!("runcell-no-such-class-{:08x}", rand::random::<u32>());
            let driver =
                connect(WorkspaceVolume::per_run(Some(class.clone()), "16Mi"), READY).await;
            let start = Instant::now();
            let e = match driver.create(&spec(CASE_ID)).await {
                Ok(run) => {
                    run.stop().await.unwrap();
                    panic!("a run started on a claim of StorageClass {class}");
                }
                Err(e) => e,
            };
            let took = start.elapsed();
            eprintln!("{TEST}: unknown class after {took:?}: {e}");
            assert!(took < READY + Duration::from_secs(10), "{took:?}");
            assert_eq!(e.kind(), ErrorKind::NotFound, "{e:?}");
            assert_eq!(e.field(), Some("workspace_storage_class"), "{e:?}");
            let claim = e.context_value("claim").expect("the claim in the context");
            let run = e.context_value("run").expect("the run in the context");
            assert_eq!(claim, workspace_claim_name(run));
            let text = e.to_string();
            assert!(text.contains(claim) && text.contains(&class), "{text}");
            assert!(driver.list(&selector(CASE_ID)).await.unwrap().is_empty());
            wait_gone(&claims, claim).await.unwrap();

            // Kept or not: a claim whose pod never ran goes with the failed create.
            let driver = connect(
                WorkspaceVolume::PerRun {
                    storage_class: Some(class.clone()),
                    size: "16Mi".into(),
                    keep: true,
                },
                READY,
            )
            .await;
            let e = match driver.create(&spec(CASE_ID)).await {
                Ok(run) => {
                    run.stop().await.unwrap();
                    panic!("a run started on a kept claim of StorageClass {class}");
                }
                Err(e) => e,
            };
            assert_eq!(e.field(), Some("workspace_storage_class"), "{e:?}");
            let claim = e.context_value("claim").expect("the claim in the context");
            assert!(driver.list(&selector(CASE_ID)).await.unwrap().is_empty());
            wait_gone(&claims, claim).await.unwrap();

            // No class and no PersistentVolume to bind to: still unbound at the ready
            // timeout, a Timeout that says why, naming the claim.
            const SHORT: Duration = Duration::from_secs(6);
            let driver =
                connect(WorkspaceVolume::per_run(Some(String::new()), "16Mi"), SHORT).await;
            let start = Instant::now();
            let e = match driver.create(&spec(CASE_ID)).await {
                Ok(run) => {
                    run.stop().await.unwrap();
                    panic!("a run started on a claim without class or volume");
                }
                Err(e) => e,
            };
            let took = start.elapsed();
            eprintln!("{TEST}: unbound at the timeout after {took:?}: {e}");
            assert!(took < SHORT + Duration::from_secs(10), "{took:?}");
            assert_eq!(e.kind(), ErrorKind::Timeout, "{e:?}");
            let claim = e.context_value("claim").expect("the claim in the context");
            let text = e.to_string();
            assert!(
                text.contains(&format!("{claim} (no StorageClass) is not bound")),
                "{text}"
            );
            assert!(driver.list(&selector(CASE_ID)).await.unwrap().is_empty());
            wait_gone(&claims, claim).await.unwrap();

            let missing = format!("runcell-no-such-claim-{:08x}", rand::random::<u32>());
            let driver = connect(WorkspaceVolume::claim(&missing), READY).await;
            let start = Instant::now();
            let e = match driver.create(&spec(CASE_ID)).await {
                Ok(run) => {
                    run.stop().await.unwrap();
                    panic!("a run started on the missing claim {missing}");
                }
                Err(e) => e,
            };
            eprintln!("{TEST}: missing claim after {:?}: {e}", start.elapsed());
            assert_eq!(e.kind(), ErrorKind::NotFound, "{e:?}");
            assert_eq!(e.field(), Some("workspace_claim"), "{e:?}");
            assert!(e.to_string().contains(&missing), "{e}");
            assert!(start.elapsed() < Duration::from_secs(5));
            assert!(driver.list(&selector(CASE_ID)).await.unwrap().is_empty());
        }
    };
    with_cleanup(CASE_ID, &claims, body).await;
}
