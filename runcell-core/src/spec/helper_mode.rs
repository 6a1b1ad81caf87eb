//! The exec helper mode of a run ([`RunSpec::exec_helper`](super::RunSpec::exec_helper)):
//! a setting of the spec, read by the lifecycle; the helper itself is `crate::helper`.

use serde::{Deserialize, Serialize};

/// The environment variable that sets the default [`ExecHelper`] mode of runs whose spec
/// leaves it at `auto` (and of attached runs): `auto`, `required` or `off`.
pub const EXEC_HELPER_ENV: &str = "RUNCELL_EXEC_HELPER";

/// Whether a run's execs go through the in-sandbox helper.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum ExecHelper {
    /// The helper where it can run (an image of the host's architecture with a writable
    /// helper directory), the plain exec path otherwise. [`EXEC_HELPER_ENV`] may change
    /// this default.
    #[default]
    Auto,
    /// The helper or nothing: a run whose helper cannot start fails with
    /// [`crate::ErrorKind::StartFailed`].
    Required,
    /// Always the plain exec path (one engine exec per command).
    Off,
}

impl ExecHelper {
    /// The mode to use: `Auto` defers to [`EXEC_HELPER_ENV`] when it is set.
    pub(crate) fn effective(self) -> ExecHelper {
        match self {
            ExecHelper::Auto => match std::env::var(EXEC_HELPER_ENV).as_deref() {
                Ok("off" | "plain") => ExecHelper::Off,
                Ok("required" | "helper") => ExecHelper::Required,
                _ => ExecHelper::Auto,
            },
            other => other,
        }
    }
}
