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
