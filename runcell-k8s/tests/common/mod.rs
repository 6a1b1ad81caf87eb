//! What the Kubernetes driver's tests share: whether they run, and whether a missing
//! piece is a failure.
#![allow(dead_code)]

/// A missing engine or tool fails the test (CI, or `RUNCELL_REQUIRE` naming `k8s`).
pub fn strict() -> bool {
    let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0");
    ci || runcell_core::envvar::var("RUNCELL_REQUIRE")
        .unwrap_or_default()
        .split(',')
        .any(|d| d.trim() == "k8s")
}

/// The test runs: `RUNCELL_TEST` names `k8s`, or, with it unset, `KUBECONFIG` is set.
pub fn selected() -> bool {
    match runcell_core::envvar::var("RUNCELL_TEST") {
        Some(t) if !t.is_empty() => t.split(',').any(|d| d.trim() == "k8s"),
        _ => std::env::var_os("KUBECONFIG").is_some(),
    }
}

/// A `kubernetes.io/dockerconfigjson` Secret with the login `user`/`password` for `host`,
/// in the client's namespace: the Secrets API and the Secret's name.
pub async fn pull_secret(
    host: &str,
    user: &str,
    password: &str,
) -> (kube::Api<k8s_openapi::api::core::v1::Secret>, String) {
    use base64::Engine;
    use k8s_openapi::api::core::v1::Secret;
    let client = kube::Client::try_default().await.unwrap();
    let namespace = client.default_namespace().to_string();
    let secrets: kube::Api<Secret> = kube::Api::namespaced(client.clone(), &namespace);
    let suffix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .subsec_nanos();
    let name = format!("sandbox-pull-{}-{suffix}", std::process::id());
    let auth = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    let config = serde_json::json!({ "auths": { host: { "auth": auth } } });
    let secret = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(name.clone()),
            ..Default::default()
        },
        type_: Some("kubernetes.io/dockerconfigjson".into()),
        data: Some(std::collections::BTreeMap::from([(
            ".dockerconfigjson".to_string(),
            k8s_openapi::ByteString(serde_json::to_vec(&config).unwrap()),
        )])),
        ..Secret::default()
    };
    secrets
        .create(&kube::api::PostParams::default(), &secret)
        .await
        .unwrap();
    (secrets, name)
}
