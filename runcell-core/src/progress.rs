//! What a create is doing while the caller waits: image pulls, readiness, setup steps.
//!
//! Pass a callback in [`CreateOptions::progress`] (through [`crate::Driver::create_with`]
//! or [`crate::DriverExt::start_with`]); drivers report through
//! [`crate::raw::Plan::report`]. Events are information for a person or a log; nothing
//! depends on them.

use std::fmt;
use std::sync::Arc;

/// One step of a create.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Progress {
    /// A step of the library or the driver began (`pulling image`, `creating container`,
    /// `waiting for the pod`, `checking the sandbox answers`, `post-create 1/2`, ...).
    Step(String),
    /// Image pull progress for one layer, as the engine reports it.
    Pull {
        /// The image being pulled.
        image: String,
        /// The layer id (empty for messages about the whole image).
        layer: String,
        /// The engine's status text (`Downloading`, `Pull complete`, ...).
        status: String,
        /// Bytes done, when known.
        current: Option<u64>,
        /// Bytes in all, when known.
        total: Option<u64>,
    },
    /// The target is not ready yet: its phase and the latest reason the backend gives
    /// (a Kubernetes pod's phase, condition or event).
    Waiting {
        /// Phase or state (`Pending`, `ContainerCreating`, ...).
        phase: String,
        /// The latest reason or event message, when there is one.
        reason: Option<String>,
    },
}

impl fmt::Display for Progress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Progress::Step(s) => f.write_str(s),
            Progress::Pull {
                image,
                layer,
                status,
                current,
                total,
            } => {
                write!(f, "{image}: ")?;
                if !layer.is_empty() {
                    write!(f, "{layer}: ")?;
                }
                f.write_str(status)?;
                match (current, total) {
                    (Some(c), Some(t)) => write!(f, " {c}/{t} bytes"),
                    _ => Ok(()),
                }
            }
            Progress::Waiting { phase, reason } => match reason {
                Some(r) => write!(f, "waiting: {phase}: {r}"),
                None => write!(f, "waiting: {phase}"),
            },
        }
    }
}

/// A progress callback. Called inline: keep it quick.
pub type ProgressFn = Arc<dyn Fn(Progress) + Send + Sync>;

/// How to create a run, beyond its spec.
#[derive(Clone, Default)]
#[non_exhaustive]
pub struct CreateOptions {
    /// Called with each step of the create.
    pub progress: Option<ProgressFn>,
    /// The run belongs to no process: it carries no owner labels, so `reap` removes it
    /// only once its TTL passed or its target died (for runs started by a command-line
    /// tool that exits while the run lives on). Set a TTL with it.
    pub detached: bool,
}

impl CreateOptions {
    /// Reports each step to `f`.
    pub fn progress(mut self, f: impl Fn(Progress) + Send + Sync + 'static) -> Self {
        self.progress = Some(Arc::new(f));
        self
    }

    /// Creates a run that belongs to no process (see [`CreateOptions::detached`]).
    pub fn detached(mut self, on: bool) -> Self {
        self.detached = on;
        self
    }
}

impl fmt::Debug for CreateOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CreateOptions")
            .field("progress", &self.progress.is_some())
            .field("detached", &self.detached)
            .finish()
    }
}
