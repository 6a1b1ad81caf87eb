//! A pull from a registry on loopback that wants basic auth (Debian's `docker-registry`),
//! on Kubernetes: without `image_pull_secrets` the create is a typed error naming the
//! image and the registry, and nothing is left; with a `kubernetes.io/dockerconfigjson`
//! Secret named in the config, the run starts from the pulled image. On the test cluster
//! the pull is the node's own: the upstream kubelet and containerd, with the pod's
//! imagePullSecrets.
//!
//! Runs when `RUNCELL_TEST` names `k8s`, or, with `RUNCELL_TEST` unset, when `KUBECONFIG`
//! is set. `cargo xtask test` runs it in its Kubernetes phase (restricted
//! ServiceAccount). Selected but without the registry binary: a failure when `CI` is set
//! or `RUNCELL_REQUIRE` names `k8s`.

#[path = "../../runcell-docker/tests/common/registry.rs"]
mod registry;

use std::collections::BTreeMap;

use base64::Engine;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams};
use registry::{PASSWORD, REGISTRY, Registry, USER, push_test_image};
use runcell_core::{Driver, ErrorKind, ExecSpec, RunExt, RunSpec};
use runcell_k8s::{K8sConfig, K8sDriver};

const CASE: &str = "k8s-private-pull";

fn strict() -> bool {
    let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0");
    ci || runcell_core::envvar::var("RUNCELL_REQUIRE")
        .unwrap_or_default()
        .split(',')
        .any(|d| d.trim() == "k8s")
}

fn selected() -> bool {
    match runcell_core::envvar::var("RUNCELL_TEST") {
        Some(t) if !t.is_empty() => t.split(',').any(|d| d.trim() == "k8s"),
        _ => std::env::var_os("KUBECONFIG").is_some(),
    }
}

#[tokio::test]
async fn pulls_with_image_pull_secrets() {
    if !selected() {
        eprintln!("*** SKIPPED pulls_with_image_pull_secrets: not selected (RUNCELL_TEST=k8s)");
        return;
    }
    if !std::path::Path::new(REGISTRY).exists() {
        assert!(
            !strict(),
            "{REGISTRY} is missing: apt-get install docker-registry"
        );
        eprintln!("*** SKIPPED pulls_with_image_pull_secrets: {REGISTRY} is missing");
        return;
    }
    let registry = Registry::start(None);
    let host = format!("127.0.0.1:{}", registry.port);
    let (image, local) = push_test_image(&host, "k8s");
    let without = K8sDriver::connect(K8sConfig::default())
        .await
        .expect("a cluster (KUBECONFIG)");
    let client = kube::Client::try_default().await.unwrap();
    let namespace = client.default_namespace().to_string();
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &namespace);
    let name = format!("sandbox-pull-{}", registry::rand_suffix());
    let auth = base64::engine::general_purpose::STANDARD.encode(format!("{USER}:{PASSWORD}"));
    let config = serde_json::json!({ "auths": { (host.clone()): { "auth": auth } } });
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            ..ObjectMeta::default()
        },
        type_: Some("kubernetes.io/dockerconfigjson".into()),
        data: Some(BTreeMap::from([(
            ".dockerconfigjson".to_string(),
            ByteString(serde_json::to_vec(&config).unwrap()),
        )])),
        ..Secret::default()
    };
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    // The Secret, the registry and the pulled copy go whatever happens in between.
    let result = tokio::spawn({
        let (image, host, name) = (image.clone(), host.clone(), name.clone());
        async move { check(without, &image, &host, &name).await }
    })
    .await;
    let _ = secrets.delete(&name, &DeleteParams::default()).await;
    local.remove();
    drop(registry);
    if let Err(panic) = result {
        std::panic::resume_unwind(panic.into_panic());
    }
}

async fn check(without: K8sDriver, image: &str, host: &str, secret: &str) {
    let spec = RunSpec::new(image).label("sandbox.test/case", CASE);
    let selector = BTreeMap::from([("sandbox.test/case".to_string(), CASE.to_string())]);

    // No credentials: refused by the registry, a typed error naming image and registry.
    let e = match without.create(&spec).await {
        Ok(run) => {
            run.stop().await.unwrap();
            panic!("{image} was pulled without credentials");
        }
        Err(e) => e,
    };
    eprintln!("without credentials: {e}");
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e:?}");
    assert_eq!(e.field(), Some("image"), "{e:?}");
    let text = format!("{e} {e:?}");
    assert!(
        text.contains(image) && text.contains(&format!("registry: {host}")),
        "{text}"
    );
    assert!(!text.contains(PASSWORD), "{text}");
    assert!(without.list(&selector).await.unwrap().is_empty());

    // The Secret named in the config: pulled, started, used.
    let with = K8sDriver::connect(K8sConfig::default().image_pull_secrets([secret]))
        .await
        .unwrap();
    let run = with.create(&spec).await.unwrap();
    let out = run
        .exec(ExecSpec::new(["sh", "-c", "echo pulled"]))
        .await
        .unwrap();
    assert_eq!(out.stdout_str(), "pulled\n");
    run.stop().await.unwrap();
    assert!(with.list(&selector).await.unwrap().is_empty());
}
