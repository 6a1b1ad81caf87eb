//! Two drivers registered under one name make lookups of that name fail, naming both;
//! every other name, and the listing, keep working.
//! (A test binary of its own: the duplicate must not leak into other registry tests.)

use std::sync::Arc;

use runcell_core::{Driver, DriverConfig, Error, ErrorKind, Result};

async fn never(_: DriverConfig) -> Result<Arc<dyn Driver>> {
    Err(Error::new(ErrorKind::Unavailable, "test driver"))
}

runcell_core::register_driver!("twin", "first", never);
runcell_core::register_driver!("twin", "second", never);
runcell_core::register_driver!("single", "only", never);
runcell_core::register_driver!("Helper", "a reserved name", never);
runcell_core::register_driver!("conformance-image", "a reserved prefix", never);

#[tokio::test]
async fn a_duplicate_name_fails_its_lookups_naming_both() {
    let e = runcell_core::connect("twin", DriverConfig::default())
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(e.message().contains("\"twin\""), "{e}");
    assert!(
        e.message().contains("\"first\"") && e.message().contains("\"second\""),
        "{e}"
    );
}

#[tokio::test]
async fn other_names_still_connect() {
    // `never` is reached: the lookup of "single" succeeded.
    let e = runcell_core::connect("single", DriverConfig::default())
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert_eq!(e.message(), "test driver");
}

#[tokio::test]
async fn unknown_names_are_still_not_found() {
    let e = runcell_core::connect("triplet", DriverConfig::default())
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    assert!(
        e.message()
            .contains("[Helper, conformance-image, single, twin]"),
        "{e}"
    );
}

#[test]
fn listing_still_works_and_shows_both() {
    let all = runcell_core::drivers().unwrap();
    let twins: Vec<&str> = all
        .iter()
        .filter(|f| f.name == "twin")
        .map(|f| f.description)
        .collect();
    assert_eq!(twins.len(), 2, "{twins:?}");
    assert!(twins.contains(&"first") && twins.contains(&"second"));
    assert_eq!(
        runcell_core::driver_names().unwrap(),
        ["Helper", "conformance-image", "single", "twin"]
    );
}

#[tokio::test]
async fn a_reserved_name_is_refused_naming_the_clash() {
    let e = runcell_core::connect("Helper", DriverConfig::default())
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(e.message().contains("RUNCELL_HELPER_"), "{e}");
    // A name that only starts with a reserved one clashes too
    // (RUNCELL_CONFORMANCE_IMAGE_ID would be its config).
    let e = runcell_core::connect("conformance-image", DriverConfig::default())
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(e.message().contains("RUNCELL_CONFORMANCE_IMAGE_"), "{e}");
}
