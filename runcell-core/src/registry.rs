//! Drivers register themselves with [`register_driver!`]; engines look them up by name.
//!
//! Cargo links only crates that are used: a binary that wants a driver from the registry
//! must still depend on its crate and mention it, e.g. `use runcell_docker as _;`.

use std::collections::{BTreeMap, BTreeSet};
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

/// Registers a driver with the registry, at item level of the driver's crate. The name is
/// the backend's [`crate::raw::Backend::NAME`], so it is written once:
///
/// ```ignore
/// runcell_core::register_driver!(DockerDriver, "Docker Engine API", DockerDriver::from_config);
/// ```
/// where `DockerDriver::from_config` is an `async fn(DriverConfig) -> Result<Arc<dyn Driver>>`.
/// (`register_driver!("name", "description", constructor)` registers under an explicit
/// name, e.g. a second configuration of one backend.)
#[macro_export]
macro_rules! register_driver {
    ($name:literal, $description:expr, $connect:path) => {
        $crate::inventory::submit! {
            $crate::DriverFactory {
                name: $name,
                description: $description,
                connect: |config| ::std::boxed::Box::pin($connect(config)),
            }
        }
    };
    ($backend:ty, $description:expr, $connect:path) => {
        $crate::inventory::submit! {
            $crate::DriverFactory {
                name: <$backend as $crate::raw::Backend>::NAME,
                description: $description,
                connect: |config| ::std::boxed::Box::pin($connect(config)),
            }
        }
    };
}

/// Every registration, sorted by name. A name registered twice (two linked crates chose
/// the same one) appears twice here; only [`connect`] of that name fails. The `Result`
/// is part of the signature for callers that report registry errors; listing never fails.
pub fn drivers() -> Result<Vec<&'static DriverFactory>> {
    let mut all: Vec<&'static DriverFactory> =
        inventory::iter::<DriverFactory>.into_iter().collect();
    all.sort_by_key(|f| f.name);
    Ok(all)
}

/// The registered names, sorted, each once.
pub fn driver_names() -> Result<Vec<&'static str>> {
    let mut names: Vec<&'static str> = drivers()?.into_iter().map(|f| f.name).collect();
    names.dedup();
    Ok(names)
}

/// Driver names that cannot be used, nor names that start with one of them and `-` or
/// `_`: their config variables (`RUNCELL_<NAME>_*`) would take runcell's own variables
/// (`RUNCELL_EXEC_HELPER`, `RUNCELL_TEST_CHILD_IMAGE`, ...) as config.
pub const RESERVED_DRIVER_NAMES: &[&str] = &[
    "cli",
    "config",
    "conformance",
    "driver",
    "exec",
    "helper",
    "realnode",
    "require",
    "test",
    "testenv",
];

/// The one registration of `name`: [`ErrorKind::NotFound`] listing the registered names
/// when there is none, [`ErrorKind::Config`] naming both when there are two, or naming
/// the clash for a reserved name ([`RESERVED_DRIVER_NAMES`]).
fn lookup(name: &str) -> Result<&'static DriverFactory> {
    let normal = name.to_ascii_lowercase().replace('-', "_");
    // `conformance_image` would take RUNCELL_CONFORMANCE_IMAGE_ID: a prefix clashes too.
    if RESERVED_DRIVER_NAMES
        .iter()
        .any(|r| normal == *r || normal.starts_with(&format!("{r}_")))
    {
        return Err(Error::new(
            ErrorKind::Config,
            format!(
                "the driver name {name:?} is reserved: its config variables ({}*) would clash with runcell's own; register the driver under another name",
                DriverConfig::env_prefix(name)
            ),
        ));
    }
    let all = drivers()?;
    let matching: Vec<&'static DriverFactory> =
        all.iter().copied().filter(|f| f.name == name).collect();
    match matching.as_slice() {
        [one] => Ok(one),
        [] => Err(Error::new(
            ErrorKind::NotFound,
            format!(
                "no driver named {name:?}; registered: [{}] (is the driver's crate linked? add `use <crate> as _;`)",
                driver_names()?.join(", ")
            ),
        )),
        several => Err(Error::new(
            ErrorKind::Config,
            format!(
                "{} drivers are registered under the name {name:?} ({}): the binary links two crates that chose the same name; link only one of them",
                several.len(),
                several
                    .iter()
                    .map(|f| format!("{:?}", f.description))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )),
    }
}

/// Connects the driver registered as `name`.
pub async fn connect(name: &str, config: DriverConfig) -> Result<Arc<dyn Driver>> {
    let factory = lookup(name)?;
    (factory.connect)(config).await
}

/// A driver's configuration as string pairs, read with typed getters. Drivers take the
/// keys they know with [`take`](DriverConfig::take) or
/// [`take_parsed`](DriverConfig::take_parsed) and then call
/// [`finish`](DriverConfig::finish), which rejects the rest.
///
/// Every key a driver asks for is recorded, so the unknown-key error lists the valid keys
/// (and, for a config read by [`from_env`](DriverConfig::from_env), names the variables)
/// without extra work in the driver. A key read only under some condition can be declared
/// with [`accept`](DriverConfig::accept).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct DriverConfig {
    driver: String,
    values: BTreeMap<String, String>,
    /// `Some(prefix)` when the pairs came from `<prefix><KEY>` environment variables.
    prefix: Option<String>,
    /// For a config from the environment: key -> the exact variable it came from.
    env_names: BTreeMap<String, String>,
    /// Every key the driver took or declared.
    known: BTreeSet<String>,
}

/// Keys only: values may be secrets (registry passwords, tokens).
impl std::fmt::Debug for DriverConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DriverConfig")
            .field("driver", &self.driver)
            .field("keys", &self.values.keys().collect::<Vec<_>>())
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
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
            ..DriverConfig::default()
        }
    }

    /// The environment-variable prefix of `driver`'s config: `RUNCELL_<DRIVER>_`, with
    /// the name upper-cased and `-` as `_`.
    pub fn env_prefix(driver: &str) -> String {
        format!(
            "{}{}_",
            crate::envvar::PREFIX,
            driver.to_ascii_uppercase().replace('-', "_")
        )
    }

    /// Reads `RUNCELL_<DRIVER>_<KEY>` variables: `RUNCELL_DOCKER_HOST=x` gives `host = x`.
    /// Every such variable must be a key of the driver: errors name the variable.
    ///
    /// The deprecated spelling `SANDBOX_<DRIVER>_<KEY>` is still read for this release,
    /// with a deprecation warning (see [`crate::envvar`]); when both spellings of one key
    /// are set, the `RUNCELL_` one wins.
    pub fn from_env(driver: &str) -> DriverConfig {
        DriverConfig::from_vars(
            driver,
            std::env::vars_os()
                .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?))),
        )
    }

    /// [`from_env`](DriverConfig::from_env) over the given variables instead of the
    /// process environment.
    pub fn from_vars<I, K, V>(driver: &str, vars: I) -> DriverConfig
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<String>,
    {
        let prefix = DriverConfig::env_prefix(driver);
        let mut config = DriverConfig::new(driver, std::iter::empty::<(String, String)>());
        for (rest, (name, value)) in crate::envvar::prefixed(&prefix, vars) {
            let key = rest.to_ascii_lowercase();
            config.values.insert(key.clone(), value);
            config.env_names.insert(key, name);
        }
        config.prefix = Some(prefix);
        config
    }

    /// Takes a string value.
    pub fn take(&mut self, key: &str) -> Option<String> {
        self.known.insert(key.to_string());
        self.values.remove(key)
    }

    /// Takes and parses a value, naming the key (or its variable) on error.
    pub fn take_parsed<T>(&mut self, key: &str) -> Result<Option<T>>
    where
        T: std::str::FromStr,
        T::Err: std::fmt::Display,
    {
        let source = self.source_of(key);
        match self.take(key) {
            None => Ok(None),
            Some(v) => v.parse().map(Some).map_err(|e| {
                Error::new(
                    ErrorKind::Config,
                    format!("{}: {source} = {v:?}: {e}", self.driver),
                )
                .with_field(key)
            }),
        }
    }

    /// Declares keys the driver accepts without taking them now (read only under some
    /// condition), so that the unknown-key error still lists them as valid.
    pub fn accept<'a>(&mut self, keys: impl IntoIterator<Item = &'a str>) -> &mut Self {
        self.known.extend(keys.into_iter().map(str::to_string));
        self
    }

    /// Where `key` comes from, as a user would write it: the variable, or the key.
    fn source_of(&self, key: &str) -> String {
        match self.env_names.get(key) {
            Some(var) => var.clone(),
            None => self.documented_name(key),
        }
    }

    /// How to give `key`: its `RUNCELL_` variable for a config from the environment,
    /// else the key.
    fn documented_name(&self, key: &str) -> String {
        match &self.prefix {
            Some(prefix) => format!("{prefix}{}", key.to_ascii_uppercase()),
            None => key.to_string(),
        }
    }

    /// Rejects keys no one took (typos), naming each (as the environment variable it came
    /// from, for a config from [`from_env`](DriverConfig::from_env)) and listing the
    /// valid ones: those the driver took or declared before calling this.
    pub fn finish(self) -> Result<()> {
        if self.values.is_empty() {
            return Ok(());
        }
        let unknown: Vec<String> = self.values.keys().map(|k| self.source_of(k)).collect();
        let what = match (self.prefix.is_some(), unknown.len()) {
            (true, 1) => "unknown config variable",
            (true, _) => "unknown config variables",
            (false, 1) => "unknown config key",
            (false, _) => "unknown config keys",
        };
        let valid = if self.known.is_empty() {
            format!("the {} driver takes no config", self.driver)
        } else {
            let valid: Vec<String> = self.known.iter().map(|k| self.documented_name(k)).collect();
            format!("valid: {}", valid.join(", "))
        };
        let mut error = Error::new(
            ErrorKind::Config,
            format!("{}: {what} {}; {valid}", self.driver, unknown.join(", ")),
        );
        if let [one] = unknown.as_slice() {
            error = error.with_field(one.clone());
        }
        Err(error)
    }
}

#[cfg(test)]
mod debug_tests {
    use super::DriverConfig;

    #[test]
    fn debug_shows_keys_not_values() {
        let config = DriverConfig::new("docker", [("registry_password", "s3cr3t")]);
        let text = format!("{config:?}");
        assert!(
            text.contains("registry_password") && !text.contains("s3cr3t"),
            "{text}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_rejects_unknown_keys_and_bad_values() {
        let mut c = DriverConfig::new("x", [("a", "1"), ("b", "two"), ("typo", "")]);
        assert_eq!(c.take_parsed::<u32>("a").unwrap(), Some(1));
        let e = c.take_parsed::<u32>("b").unwrap_err();
        assert!(e.to_string().contains("b = \"two\""), "{e}");
        assert_eq!(e.field(), Some("b"));
        let e = c.finish().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert_eq!(e.field(), Some("typo"));
        assert_eq!(e.message(), "x: unknown config key typo; valid: a, b");
    }

    #[test]
    fn unknown_variable_is_named_with_the_valid_ones() {
        // The deprecated prefix too: the unknown variable as written, the valid ones as
        // documented.
        for (old, new) in [("RUNCELL", "RUNCELL"), ("SANDBOX", "RUNCELL")] {
            let vars = [
                (format!("{old}_DOCKER_HOSTT"), "unix:///x.sock"),
                (format!("{old}_DOCKER_TIMEOUT_SECS"), "5"),
                (format!("{old}_K8S_NAMESPACE"), "not ours"),
                ("PATH".to_string(), "/bin"),
            ];
            let mut c = DriverConfig::from_vars("docker", vars);
            assert_eq!(c.take("host"), None);
            assert_eq!(c.take_parsed::<u64>("timeout_secs").unwrap(), Some(5));
            let e = c.finish().unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Config);
            assert_eq!(e.field(), Some(format!("{old}_DOCKER_HOSTT").as_str()));
            assert_eq!(
                e.message(),
                format!(
                    "docker: unknown config variable {old}_DOCKER_HOSTT; \
                     valid: {new}_DOCKER_HOST, {new}_DOCKER_TIMEOUT_SECS"
                )
            );
        }
    }

    #[test]
    fn the_runcell_prefix_wins_over_the_deprecated_one() {
        for vars in [
            [
                ("SANDBOX_DOCKER_HOST", "old"),
                ("RUNCELL_DOCKER_HOST", "new"),
            ],
            [
                ("RUNCELL_DOCKER_HOST", "new"),
                ("SANDBOX_DOCKER_HOST", "old"),
            ],
        ] {
            let mut c = DriverConfig::from_vars("docker", vars);
            assert_eq!(c.take("host").as_deref(), Some("new"));
            c.finish().unwrap();
        }
    }

    #[test]
    fn bad_value_from_the_environment_names_the_variable() {
        for name in ["RUNCELL_MY_DRIVER_PORT", "SANDBOX_MY_DRIVER_PORT"] {
            let mut c = DriverConfig::from_vars("my-driver", [(name, "x")]);
            let e = c.take_parsed::<u16>("port").unwrap_err();
            assert!(
                e.message()
                    .starts_with(&format!("my-driver: {name} = \"x\": ")),
                "{e}"
            );
        }
    }

    #[test]
    fn declared_keys_count_as_valid() {
        let mut c = DriverConfig::new("x", [("a", "1"), ("b", "2")]);
        c.accept(["tls_cert", "tls_key"]);
        c.take("a");
        let e = c.finish().unwrap_err();
        assert_eq!(
            e.message(),
            "x: unknown config key b; valid: a, tls_cert, tls_key"
        );
    }

    #[test]
    fn a_driver_without_config_says_so() {
        let c = DriverConfig::new("x", [("a", "1"), ("b", "2")]);
        assert_eq!(
            c.finish().unwrap_err().message(),
            "x: unknown config keys a, b; the x driver takes no config"
        );
    }

    #[test]
    fn a_clean_config_finishes() {
        let mut c = DriverConfig::from_vars("x", [("RUNCELL_X_A", "1"), ("SANDBOX_X_B", "2")]);
        c.take("a");
        c.take("b");
        c.finish().unwrap();
        DriverConfig::default().finish().unwrap();
    }
}
