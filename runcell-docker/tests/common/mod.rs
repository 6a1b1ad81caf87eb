//! Shared by the registry, TLS and ssh tests: strictness, certificates made with
//! `openssl` in a test's directory, and a whole run through a transport.
#![allow(dead_code)]

pub mod registry;

#[allow(unused_imports)]
pub use registry::{issue, new_ca, openssl};

use runcell_core::{
    DriverConfig, DriverExt, ExecHelper, ExecPath, ExecSpec, Network, PullPolicy, RunExt, RunSpec,
};
use runcell_docker::DockerDriver;

/// `CI` or `RUNCELL_REQUIRE` naming docker: a missing tool fails instead of skipping.
pub fn strict() -> bool {
    let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0");
    ci || runcell_core::envvar::var("RUNCELL_REQUIRE")
        .unwrap_or_default()
        .split(',')
        .any(|d| d.trim() == "docker")
}

/// Whether a test can run, given what it misses: a skip says why, except under
/// [`strict`], where it fails.
pub fn can_run(test: &str, missing: Option<String>) -> bool {
    let Some(why) = missing else { return true };
    assert!(!strict(), "{test} cannot run: {why}");
    eprintln!("skipped: {why}");
    false
}

/// The Docker engine of `config`; `None` when there is none (a skip that says why, except
/// under [`strict`], where it fails).
pub async fn docker_or_skip(
    test: &str,
    config: runcell_docker::DockerConfig,
) -> Option<DockerDriver> {
    match DockerDriver::connect(config).await {
        Ok(driver) => Some(driver),
        Err(e) => {
            can_run(test, Some(format!("no Docker engine: {e}")));
            None
        }
    }
}

/// A whole run through `driver` (on the exec helper path): exec, a file there and back,
/// stop; then, connected again through the registry with `keys`, nothing of the run is
/// left. `how` names the transport in the output and the case label.
pub async fn whole_run(driver: &DockerDriver, how: &str, keys: Vec<(&str, String)>) {
    let spec = RunSpec::new("sandbox-test/busybox:latest")
        .pull(PullPolicy::Never)
        .network(Network::None)
        .exec_helper(ExecHelper::Required)
        .label("sandbox.test/case", how);
    let run = driver.start(&spec).await.expect("a run");
    assert_eq!(run.exec_path(), ExecPath::Helper);
    let out = run
        .exec(ExecSpec::new([
            "sh",
            "-c",
            &format!("echo over-{how}; id -u"),
        ]))
        .await
        .unwrap();
    assert_eq!(out.stdout_str(), format!("over-{how}\n0\n"));
    let bytes = format!("through {how}").into_bytes();
    run.put_file("/tmp/f", &bytes, 0o600).await.unwrap();
    assert_eq!(run.get_file("/tmp/f").await.unwrap(), bytes);
    run.stop().await.unwrap();

    let config = DriverConfig::new("docker", keys);
    let driver = runcell_core::connect("docker", config).await.unwrap();
    let left = driver
        .list(&[("sandbox.test/case".to_string(), how.to_string())].into())
        .await
        .unwrap();
    assert!(left.is_empty(), "left: {left:?}");
}
