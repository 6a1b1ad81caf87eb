//! The Docker driver is found through the registry, and bad config or an unreachable
//! daemon give typed errors naming what was wrong. No daemon needed.

use runcell_core::{DriverConfig, ErrorKind};
use runcell_docker as _;

#[test]
fn docker_is_registered() {
    assert!(runcell_core::driver_names().unwrap().contains(&"docker"));
}

#[tokio::test]
async fn unknown_name_lists_the_registered_ones() {
    let e = runcell_core::connect("dockr", DriverConfig::default())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    assert!(
        e.message().contains("\"dockr\"") && e.message().contains("docker"),
        "{e}"
    );
}

#[tokio::test]
async fn unknown_config_keys_are_rejected() {
    let config = DriverConfig::new("docker", [("hots", "unix:///x.sock")]);
    let e = runcell_core::connect("docker", config).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(e.to_string().contains("hots"), "{e}");
}

#[tokio::test]
async fn unreachable_daemon_is_unavailable_naming_the_address() {
    let dir = tempfile::tempdir().unwrap();
    let address = format!("unix://{}/no-daemon.sock", dir.path().display());
    let config = DriverConfig::new("docker", [("host", address.as_str())]);
    let e = runcell_core::connect("docker", config).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(e.message().contains(&address), "{e}");
}
