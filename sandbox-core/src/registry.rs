//! Drivers register themselves with [`register_driver!`]; engines look them up by name.
//!
//! Cargo links only crates that are used: a binary that wants a driver from the registry
//! must still depend on its crate and mention it, e.g. `use runcell_docker as _;`.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::future::BoxFuture;

use crate::error::{Error, ErrorKind, Result};
use crate::run::Driver;

/// A registered driver: a name and a constructor from a string config map.
pub struct DriverFactory {
    /// The registry name, lower-case (`docker`, `k8s`).
    pub name: &'static str,
    /// One line saying what the driver runs on.
    pub description: &'static str,
    /// Connects a driver from its config. Must fail with [`ErrorKind::Config`] on unknown
    /// keys and [`ErrorKind::Unavailable`] when the backend cannot be reached.
    pub connect: ConnectFn,
}

/// A driver constructor: config in, connected driver out.
pub type ConnectFn = fn(DriverConfig) -> BoxFuture<'static, Result<Arc<dyn Driver>>>;

inventory::collect!(DriverFactory);

/// Registers a driver with the registry, at item level of the driver's crate.
///
/// ```ignore
/// runcell_core::register_driver!("docker", "Docker Engine API", DockerDriver::from_config);
/// ```
/// where `DockerDriver::from_config` is an `async fn(DriverConfig) -> Result<Arc<dyn Driver>>`.
#[macro_export]
macro_rules! register_driver {
    ($name:expr, $description:expr, $connect:path) => {
        $crate::inventory::submit! {
            $crate::DriverFactory {
                name: $name,
                description: $description,
                connect: |config| ::std::boxed::Box::pin($connect(config)),
            }
        }
    };
}

/// Every registered driver, sorted by name. Two registrations of one name are an error.
pub fn drivers() -> Result<Vec<&'static DriverFactory>> {
    let mut all: Vec<&'static DriverFactory> =
        inventory::iter::<DriverFactory>.into_iter().collect();
    all.sort_by_key(|f| f.name);
    if let Some(w) = all.windows(2).find(|w| w[0].name == w[1].name) {
        return Err(Error::new(
            ErrorKind::Config,
            format!("two drivers are registered under the name {:?}", w[0].name),
        ));
    }
    Ok(all)
}

/// The names of the registered drivers.
pub fn driver_names() -> Result<Vec<&'static str>> {
    Ok(drivers()?.into_iter().map(|f| f.name).collect())
}

/// Connects the driver registered as `name`.
pub async fn connect(name: &str, config: DriverConfig) -> Result<Arc<dyn Driver>> {
    let all = drivers()?;
    match all.iter().find(|f| f.name == name) {
        Some(f) => (f.connect)(config).await,
        None => Err(Error::new(
            ErrorKind::NotFound,
            format!(
                "no driver named {name:?}; registered: [{}] (is the driver's crate linked? add `use <crate> as _;`)",
                all.iter().map(|f| f.name).collect::<Vec<_>>().join(", ")
            ),
        )),
    }
}

/// A driver's configuration as string pairs, read with typed getters. Drivers remove the
/// keys they know and call [`DriverConfig::finish`], which rejects the rest.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DriverConfig {
    driver: String,
    values: BTreeMap<String, String>,
}

impl DriverConfig {
    /// A config for `driver` from pairs.
    pub fn new<I, K, V>(driver: &str, pairs: I) -> DriverConfig
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<String>,
    {
        DriverConfig {
            driver: driver.to_string(),
            values: pairs
                .into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        }
    }

    /// Reads `SANDBOX_<DRIVER>_<KEY>` variables: `SANDBOX_DOCKER_HOST=x` gives `host = x`.
    pub fn from_env(driver: &str) -> DriverConfig {
        let prefix = format!("SANDBOX_{}_", driver.to_ascii_uppercase().replace('-', "_"));
        DriverConfig::new(
            driver,
            std::env::vars().filter_map(|(k, v)| {
                k.strip_prefix(&prefix)
                    .map(|key| (key.to_ascii_lowercase(), v))
            }),
        )
    }

    /// Takes a string value.
    pub fn take(&mut self, key: &str) -> Option<String> {
        self.values.remove(key)
    }

    /// Takes and parses a value, naming the key on error.
    pub fn take_parsed<T>(&mut self, key: &str) -> Result<Option<T>>
    where
        T: std::str::FromStr,
        T::Err: std::fmt::Display,
    {
        match self.values.remove(key) {
            None => Ok(None),
            Some(v) => v.parse().map(Some).map_err(|e| {
                Error::new(
                    ErrorKind::Config,
                    format!("{}: {key} = {v:?}: {e}", self.driver),
                )
            }),
        }
    }

    /// Rejects keys no one took (typos), naming them.
    pub fn finish(self) -> Result<()> {
        if self.values.is_empty() {
            Ok(())
        } else {
            Err(Error::new(
                ErrorKind::Config,
                format!(
                    "{}: unknown config keys: {}",
                    self.driver,
                    self.values.keys().cloned().collect::<Vec<_>>().join(", ")
                ),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_rejects_unknown_keys_and_bad_values() {
        let mut c = DriverConfig::new("x", [("a", "1"), ("b", "two"), ("typo", "")]);
        assert_eq!(c.take_parsed::<u32>("a").unwrap(), Some(1));
        assert!(
            c.take_parsed::<u32>("b")
                .unwrap_err()
                .to_string()
                .contains("b = \"two\"")
        );
        let e = c.finish().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.to_string().contains("typo"));
    }
}
