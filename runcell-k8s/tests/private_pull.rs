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

mod common;

use common::{selected, strict};

#[path = "../../runcell-docker/tests/common/registry.rs"]
mod registry;

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams};
use registry::{PASSWORD, REGISTRY, Registry, USER, push_test_image};
use runcell_core::{Driver, ErrorKind, ExecSpec, RunExt, RunSpec};
use runcell_k8s::{K8sConfig, K8sDriver};

const CASE: &str = "k8s-private-pull";

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
    let (secrets, name) = pull_secret(&host).await;
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

/// A `kubernetes.io/dockerconfigjson` Secret with the test login for `host`, in the
/// client's namespace: the Secrets API and the Secret's name.
async fn pull_secret(host: &str) -> (Api<Secret>, String) {
    common::pull_secret(host, USER, PASSWORD).await
}

/// The node's registry hosts directory (containerd's `config_path`), where a test may
/// trust a registry's CA: `cargo xtask test` passes it.
const HOSTS_ENV: &str = "RUNCELL_TESTENV_REGISTRY_HOSTS";

/// A registry that speaks only HTTPS with a CA of its own, with basic auth, pulled by the
/// node's containerd with the pod's imagePullSecrets: while the node does not trust the
/// CA the create fails with the kubelet's reason, naming the image; with the CA in the
/// node's registry hosts directory (`<host>/hosts.toml`) the run starts.
#[tokio::test]
async fn pulls_over_https_trusting_the_registrys_own_ca() {
    const TEST: &str = "pulls_over_https_trusting_the_registrys_own_ca";
    if !selected() {
        eprintln!("*** SKIPPED {TEST}: not selected (RUNCELL_TEST=k8s)");
        return;
    }
    let missing = if !std::path::Path::new(REGISTRY).exists() {
        Some(format!(
            "{REGISTRY} is missing: apt-get install docker-registry"
        ))
    } else if runcell_core::envvar::var(HOSTS_ENV).is_none() {
        Some(format!(
            "{HOSTS_ENV} (the node's registry hosts directory) is not set"
        ))
    } else {
        None
    };
    if let Some(why) = missing {
        assert!(!strict(), "{TEST}: {why}");
        eprintln!("*** SKIPPED {TEST}: {why}");
        return;
    }
    let hosts = std::path::PathBuf::from(runcell_core::envvar::var(HOSTS_ENV).unwrap());
    let certs = tempfile::tempdir().unwrap();
    registry::new_ca(certs.path(), "ca");
    registry::issue(
        certs.path(),
        "ca",
        "server",
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    );
    let registry = Registry::start(Some(certs.path()));
    let host = format!("127.0.0.1:{}", registry.port);
    let (image, local) = push_test_image(&host, "k8s-tls");
    let (secrets, name) = pull_secret(&host).await;
    let trust = hosts.join(&host);
    let result = tokio::spawn({
        let (image, trust, ca) = (
            image.clone(),
            trust.clone(),
            certs.path().join("ca-cert.pem"),
        );
        let name = name.clone();
        async move { check_tls(&image, &name, &trust, &ca).await }
    })
    .await;
    let _ = std::fs::remove_dir_all(&trust);
    let _ = secrets.delete(&name, &DeleteParams::default()).await;
    local.remove();
    drop(registry);
    if let Err(panic) = result {
        std::panic::resume_unwind(panic.into_panic());
    }
}

async fn check_tls(image: &str, secret: &str, trust: &std::path::Path, ca: &std::path::Path) {
    const CASE_TLS: &str = "k8s-private-pull-tls";
    let spec = RunSpec::new(image).label("sandbox.test/case", CASE_TLS);
    let selector = BTreeMap::from([("sandbox.test/case".to_string(), CASE_TLS.to_string())]);
    let driver = K8sDriver::connect(K8sConfig::default().image_pull_secrets([secret]))
        .await
        .expect("a cluster (KUBECONFIG)");

    // The node's hosts directory says HTTPS for this registry (on loopback containerd
    // would otherwise speak plain HTTP), first without the CA: the certificate is
    // refused, and the create fails with the kubelet's reason, naming the image.
    std::fs::create_dir_all(trust).unwrap();
    let host = trust.file_name().unwrap().to_str().unwrap();
    let hosts_toml = |ca: Option<&std::path::Path>| {
        let mut text = format!(
            "server = \"https://{host}\"\n[host.\"https://{host}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"
        );
        if let Some(ca) = ca {
            text.push_str(&format!("  ca = \"{}\"\n", ca.display()));
        }
        std::fs::write(trust.join("hosts.toml"), text).unwrap();
    };
    hosts_toml(None);
    let e = match driver.create(&spec).await {
        Ok(run) => {
            run.stop().await.unwrap();
            panic!("{image} was pulled from a registry whose CA the node does not trust");
        }
        Err(e) => e,
    };
    eprintln!("untrusted CA: {e}");
    assert_eq!(e.field(), Some("image"), "{e:?}");
    let text = format!("{e} {e:?}");
    assert!(
        text.contains(image) && text.contains("certificate"),
        "{text}"
    );
    assert!(!text.contains(PASSWORD), "{text}");
    assert!(driver.list(&selector).await.unwrap().is_empty());

    // With the CA: pulled over HTTPS, started, used.
    hosts_toml(Some(ca));
    let run = driver.create(&spec).await.unwrap();
    let out = run
        .exec(ExecSpec::new(["sh", "-c", "echo pulled over https"]))
        .await
        .unwrap();
    assert_eq!(out.stdout_str(), "pulled over https\n");
    run.stop().await.unwrap();
    assert!(driver.list(&selector).await.unwrap().is_empty());
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
