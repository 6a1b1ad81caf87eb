//! The driver is found by name next to the built-in one, with no central list.

use runcell_core::{DriverConfig, ErrorKind};
use sandbox_driver_audit as _;

#[test]
fn found_by_name_next_to_docker() {
    let names = runcell_core::driver_names().unwrap();
    assert!(
        names.contains(&"audit") && names.contains(&"docker"),
        "{names:?}"
    );
}

#[tokio::test]
async fn its_config_is_checked() {
    let e = runcell_core::connect("audit", DriverConfig::new("audit", [("bogus", "1")]))
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
}
