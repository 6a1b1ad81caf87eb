//! The driver's config, merged from three places. Highest first:
//! `--config KEY=VALUE` flags, the `[DRIVER]` table of `--config-file` (or
//! `RUNCELL_CONFIG_FILE`), then `RUNCELL_<DRIVER>_<KEY>` variables (or, deprecated and
//! with a warning, `SANDBOX_<DRIVER>_<KEY>`; the `RUNCELL_` one wins where both are set).

use std::collections::BTreeMap;
use std::path::Path;

use runcell_core::DriverConfig;

use crate::doc::{self, Format, Kind};
use crate::errors::Failure;
use crate::spec::key_value;

pub fn driver_config(
    driver: &str,
    flags: &[String],
    file: Option<&Path>,
) -> Result<DriverConfig, Failure> {
    let mut given = BTreeMap::new();
    if let Some(file) = file {
        given.extend(read_file(file, driver)?);
    }
    for kv in flags {
        let (k, v) = key_value(kv).map_err(|e| Failure::usage(format!("--config: {e}")))?;
        given.insert(k, v);
    }
    if given.is_empty() {
        // Errors then name the variables (`RUNCELL_DOCKER_HOSTT`).
        return Ok(DriverConfig::from_env(driver));
    }
    let prefix = DriverConfig::env_prefix(driver);
    let mut merged: BTreeMap<String, String> = runcell_core::envvar::prefixed(
        &prefix,
        std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?))),
    )
    .into_iter()
    .map(|(rest, (_, value))| (rest.to_ascii_lowercase(), value))
    .collect();
    merged.extend(given);
    Ok(DriverConfig::new(driver, merged))
}

/// The `[driver]` table of a config file (tables of other drivers are left alone).
fn read_file(path: &Path, driver: &str) -> Result<BTreeMap<String, String>, Failure> {
    let at = |line: usize| format!("{}:{line}", path.display());
    let format = Format::of(path).map_err(Failure::usage)?;
    let text = doc::read(path).map_err(|e| Failure::usage(format!("--config-file {e}")))?;
    let root = doc::parse(&text, format)
        .map_err(|e| Failure::usage(format!("{}: {}", at(e.line.unwrap_or(0)), e.message)))?;
    let Kind::Map(tables) = &root.kind else {
        return Err(Failure::usage(format!(
            "{}: expected a table per driver, e.g. [docker] host = \"unix:///var/run/docker.sock\"",
            at(root.line)
        )));
    };
    let mut out = BTreeMap::new();
    for (name, table) in tables {
        let Kind::Map(entries) = &table.kind else {
            return Err(Failure::usage(format!(
                "{}: {:?} must be a table of one driver's keys, e.g. [docker] host = \"...\"",
                at(name.line),
                name.text().unwrap_or("?")
            )));
        };
        if name.text() != Some(driver) {
            continue;
        }
        for (k, v) in entries {
            let (Some(k), Some(v)) = (k.text(), v.text()) else {
                return Err(Failure::usage(format!(
                    "{}: [{driver}] values must be strings, numbers or booleans",
                    at(v.line)
                )));
            };
            out.insert(k.to_string(), v.to_string());
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_gives_its_driver_table_and_flags_win() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(
            &path,
            "[docker]\nhost = \"unix:///x.sock\"\ntimeout_secs = 5\n\n[k8s]\nnamespace = \"a\"\n",
        )
        .unwrap();
        let read = read_file(&path, "docker").unwrap();
        assert_eq!(read["host"], "unix:///x.sock");
        assert_eq!(read["timeout_secs"], "5");
        assert!(!read.contains_key("namespace"));
        let mut config = driver_config("docker", &["timeout_secs=9".into()], Some(&path)).unwrap();
        assert_eq!(config.take("host").as_deref(), Some("unix:///x.sock"));
        assert_eq!(config.take_parsed::<u64>("timeout_secs").unwrap(), Some(9));
        std::fs::write(&path, "host = \"x\"\n").unwrap();
        let e = read_file(&path, "docker").unwrap_err().to_string();
        assert!(e.contains("c.toml:1: \"host\" must be a table"), "{e}");
    }
}
