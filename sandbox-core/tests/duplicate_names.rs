//! Two drivers registered under one name are detected, not silently shadowed.
//! (A test binary of its own: the duplicate would break every other registry test.)

use std::sync::Arc;

use runcell_core::{Driver, DriverConfig, Error, ErrorKind, Result};

async fn never(_: DriverConfig) -> Result<Arc<dyn Driver>> {
    Err(Error::new(ErrorKind::Unavailable, "test driver"))
}

runcell_core::register_driver!("twin", "first", never);
runcell_core::register_driver!("twin", "second", never);
runcell_core::register_driver!("single", "only", never);

#[tokio::test]
async fn duplicate_names_are_an_error() {
    let e = runcell_core::drivers().map(|_| ()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(e.message().contains("\"twin\""), "{e}");
    let e = runcell_core::connect("single", DriverConfig::default())
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
}
