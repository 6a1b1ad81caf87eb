//! The environment variables runcell reads. Every one starts with `RUNCELL_`
//! (`RUNCELL_DOCKER_HOST`, `RUNCELL_EXEC_HELPER`, ...). For this release the old
//! spelling with `SANDBOX_` in its place (`SANDBOX_DOCKER_HOST`) still works: it is read
//! when the `RUNCELL_` one is not set, and logs one deprecation warning per name and
//! process.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::sync::{Mutex, PoisonError};

/// The prefix of every environment variable runcell reads.
pub const PREFIX: &str = "RUNCELL_";

/// The deprecated prefix, still read (with a warning) for this release.
pub const DEPRECATED_PREFIX: &str = "SANDBOX_";

/// The variable `name` (a `RUNCELL_` name), or else its deprecated spelling `SANDBOX_…`
/// with a deprecation warning; `None` when neither is set or the value is not Unicode.
/// A name without the `RUNCELL_` prefix is read as it is, with no fallback.
pub fn var(name: &str) -> Option<String> {
    var_os(name).and_then(|v| v.into_string().ok())
}

/// [`var`] for a value that need not be Unicode (a path).
pub fn var_os(name: &str) -> Option<OsString> {
    let (value, deprecated) = lookup(name, |n| std::env::var_os(n))?;
    if let Some(old) = deprecated {
        warn_deprecated(&old, name);
    }
    Some(value)
}

/// The deprecated spelling of `name`: `SANDBOX_X` for `RUNCELL_X`; `None` for a name
/// without the `RUNCELL_` prefix.
pub fn deprecated_name(name: &str) -> Option<String> {
    name.strip_prefix(PREFIX)
        .map(|rest| format!("{DEPRECATED_PREFIX}{rest}"))
}

/// The variables among `vars` whose names start with `prefix` (a `RUNCELL_` prefix such
/// as `RUNCELL_DOCKER_`) or with its deprecated spelling (`SANDBOX_DOCKER_`), keyed by the
/// rest of the name in lower case: each is the name as written and the value. Where both spellings
/// give the same rest, the `RUNCELL_` one wins. Every deprecated name taken logs a
/// deprecation warning (once per name and process). A prefix without `RUNCELL_` has no
/// deprecated spelling.
pub fn prefixed<I, K, V>(prefix: &str, vars: I) -> BTreeMap<String, (String, String)>
where
    I: IntoIterator<Item = (K, V)>,
    K: Into<String>,
    V: Into<String>,
{
    let found = select_prefixed(prefix, vars);
    let old_prefix = deprecated_name(prefix);
    for (name, _) in found.values() {
        if let Some(rest) = old_prefix.as_deref().and_then(|p| name.strip_prefix(p)) {
            warn_deprecated(name, &format!("{prefix}{rest}"));
        }
    }
    found
}

/// `Some((value, None))` for `name`, else `Some((value, Some(old name)))` for its
/// deprecated spelling, else `None`; `get` reads one variable.
fn lookup<T>(name: &str, mut get: impl FnMut(&str) -> Option<T>) -> Option<(T, Option<String>)> {
    if let Some(value) = get(name) {
        return Some((value, None));
    }
    let old = deprecated_name(name)?;
    get(&old).map(|value| (value, Some(old)))
}

/// [`prefixed`] without the warnings.
fn select_prefixed<I, K, V>(prefix: &str, vars: I) -> BTreeMap<String, (String, String)>
where
    I: IntoIterator<Item = (K, V)>,
    K: Into<String>,
    V: Into<String>,
{
    let old_prefix = deprecated_name(prefix);
    let mut found: BTreeMap<String, (String, String)> = BTreeMap::new();
    for (name, value) in vars {
        let name = name.into();
        let (rest, current) = if let Some(rest) = name.strip_prefix(prefix) {
            (rest.to_string(), true)
        } else if let Some(rest) = old_prefix.as_deref().and_then(|p| name.strip_prefix(p)) {
            (rest.to_string(), false)
        } else {
            continue;
        };
        // Keys are read case-blind (`DriverConfig` lowercases them): so is the shadowing.
        let key = rest.to_ascii_lowercase();
        let shadowed = !current
            && found
                .get(&key)
                .is_some_and(|(written, _)| written.starts_with(prefix));
        if !shadowed {
            found.insert(key, (name, value.into()));
        }
    }
    found
}

/// Logs that `old` is deprecated in favour of `new`, the first time only.
fn warn_deprecated(old: &str, new: &str) {
    if first_use(old) {
        tracing::warn!("{old} is deprecated and will stop working in the next release; use {new}");
    }
}

/// Whether `old` is seen here for the first time in this process.
fn first_use(old: &str) -> bool {
    static WARNED: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());
    WARNED
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(old.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from<'a>(vars: &'a [(&'a str, &'a str)]) -> impl FnMut(&str) -> Option<String> + 'a {
        |name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn the_new_name_wins_and_the_old_one_is_a_fallback() {
        let both = [("RUNCELL_T1_X", "new"), ("SANDBOX_T1_X", "old")];
        assert_eq!(
            lookup("RUNCELL_T1_X", from(&both)),
            Some(("new".to_string(), None))
        );
        let old = [("SANDBOX_T1_X", "old")];
        assert_eq!(
            lookup("RUNCELL_T1_X", from(&old)),
            Some(("old".to_string(), Some("SANDBOX_T1_X".to_string())))
        );
        assert_eq!(lookup("RUNCELL_T1_X", from(&[])), None);
        // Set but empty is set.
        let empty = [("RUNCELL_T1_X", ""), ("SANDBOX_T1_X", "old")];
        assert_eq!(
            lookup("RUNCELL_T1_X", from(&empty)),
            Some((String::new(), None))
        );
    }

    #[test]
    fn a_name_without_the_prefix_is_read_as_it_is() {
        let vars = [("OTHER_T2_X", "x"), ("SANDBOX_T2_X", "old")];
        assert_eq!(
            lookup("OTHER_T2_X", from(&vars)),
            Some(("x".to_string(), None))
        );
        assert_eq!(lookup("T2_X", from(&vars)), None);
    }

    #[test]
    fn deprecated_names() {
        assert_eq!(
            deprecated_name("RUNCELL_DRIVER").as_deref(),
            Some("SANDBOX_DRIVER")
        );
        assert_eq!(
            deprecated_name("RUNCELL_K8S_").as_deref(),
            Some("SANDBOX_K8S_")
        );
        assert_eq!(deprecated_name("HOME"), None);
    }

    #[test]
    fn prefixed_takes_both_spellings_and_the_new_one_wins() {
        for vars in [
            [
                ("SANDBOX_T3_A", "old a"),
                ("RUNCELL_T3_A", "new a"),
                ("SANDBOX_T3_B", "old b"),
                ("RUNCELL_T3_C", "new c"),
                ("RUNCELL_T30_D", "other prefix"),
                ("PATH", "/bin"),
                ("RUNCELL_T3_E", "new e"),
                ("SANDBOX_T3_e", "old e"),
            ],
            [
                ("SANDBOX_T3_e", "old e"),
                ("RUNCELL_T3_E", "new e"),
                ("PATH", "/bin"),
                ("RUNCELL_T30_D", "other prefix"),
                ("RUNCELL_T3_C", "new c"),
                ("SANDBOX_T3_B", "old b"),
                ("RUNCELL_T3_A", "new a"),
                ("SANDBOX_T3_A", "old a"),
            ],
        ] {
            let found = select_prefixed("RUNCELL_T3_", vars);
            let found: Vec<(&str, &str, &str)> = found
                .iter()
                .map(|(rest, (name, value))| (rest.as_str(), name.as_str(), value.as_str()))
                .collect();
            assert_eq!(
                found,
                [
                    ("a", "RUNCELL_T3_A", "new a"),
                    ("b", "SANDBOX_T3_B", "old b"),
                    ("c", "RUNCELL_T3_C", "new c"),
                    ("e", "RUNCELL_T3_E", "new e"),
                ]
            );
        }
    }

    #[test]
    fn the_warning_comes_once_per_name() {
        assert!(first_use("SANDBOX_T4_ONCE"));
        assert!(!first_use("SANDBOX_T4_ONCE"));
        assert!(first_use("SANDBOX_T4_OTHER"));
        // And through the public entry points, which must not panic on a repeat.
        let vars = [("SANDBOX_T4_P_A", "1")];
        assert_eq!(prefixed("RUNCELL_T4_P_", vars).len(), 1);
        assert_eq!(prefixed("RUNCELL_T4_P_", vars).len(), 1);
        assert!(!first_use("SANDBOX_T4_P_A"));
    }
}
