//! The run-lifecycle contract of `sandbox`: one long-lived container or pod per run,
//! entered by exec for every tool call.
//!
//! - [`Driver`] creates, lists, re-attaches and removes runs; [`Run`] execs, moves files
//!   and stops. Buffered exec and single-file helpers live in [`RunExt`].
//! - [`RunSpec`] and [`ExecSpec`] are validated before anything is created.
//! - [`Capabilities`] says what a driver supports; a field it cannot honour is an
//!   [`ErrorKind::Unsupported`] error, never silently ignored.
//! - Drivers register with [`register_driver!`] and are found with [`connect`].
#![forbid(unsafe_code)]

pub mod ca;
mod capabilities;
mod error;
mod exec;
pub mod files;
mod guard;
pub mod labels;
pub mod raw;
mod reap;
mod registry;
mod run;
mod spec;

pub use capabilities::{Capabilities, is_numeric_user};
pub use error::{Error, ErrorKind, Result};
pub use exec::{
    DEFAULT_OUTPUT_LIMIT, EXEC_ID_ENV, ExecControl, ExecOutput, ExecStream, ExitStatus,
    KILL_SCRIPT, OutputChunk, StdinWriter,
};
pub use files::{ByteStream, FileReader};
pub use guard::{CreateGuard, RunGuard, stop_guarded_runs, stop_runs_on_signal};
pub use reap::{ReapReason, reap};
pub use registry::{ConnectFn, DriverConfig, DriverFactory, connect, driver_names, drivers};
pub use run::{Driver, DriverExt, Run, RunExt, RunInfo, new_run_id, prepare, run_post_create};
pub use spec::{
    DEFAULT_WORKSPACE_PATH, ExecSpec, Network, Proxy, PullPolicy, Resources, RunSpec, Security,
    Stdin, Workspace,
};

/// The names most programs need: `use runcell_core::prelude::*;`.
pub mod prelude {
    pub use crate::{
        Driver, DriverExt, Error, ErrorKind, ExecOutput, ExecSpec, ExecStream, ExitStatus, Network,
        OutputChunk, Run, RunExt, RunGuard, RunSpec, Stdin,
    };
}

pub use async_trait::async_trait;
pub use bytes::Bytes;
#[doc(hidden)]
pub use inventory;
