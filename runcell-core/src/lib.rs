//! The run-lifecycle contract of runcell: one long-lived container or pod per agent run,
//! entered by exec for every tool call, so each call sees the same workspace, environment,
//! proxy and CA settings and working directory.
//!
//! Start here:
//! - [`Driver`] creates runs ([`DriverExt::start`] returns a [`RunGuard`] that stops the
//!   run when dropped); [`Run`] execs ([`RunExt::exec`] buffered, [`Run::exec_stream`]
//!   streaming), moves files ([`RunExt::put_file`], [`RunExt::get_file_stream`]) and stops.
//! - [`RunSpec`] and [`ExecSpec`] are plain data, validated before anything is created;
//!   every failure is one [`Error`] with a [`ErrorKind`] and the offending
//!   [`Error::field`].
//! - [`Capabilities`] says what a driver supports; a field it cannot honour is
//!   [`ErrorKind::Unsupported`], never silently ignored.
//! - Drivers: [`runcell-docker`](https://docs.rs/runcell-docker) and
//!   [`runcell-k8s`](https://docs.rs/runcell-k8s), found by name with [`connect`] or built
//!   directly. Writing one: implement [`raw::Backend`]; core does everything shared.
//!
//! ```no_run
//! use runcell_core::prelude::*;
//!
//! # async fn demo(driver: &dyn Driver) -> runcell_core::Result<()> {
//! let spec = RunSpec::new("python:3.12-slim")
//!     .env("PIP_INDEX_URL", "https://pypi.internal/simple")
//!     .post_create(["pip", "install", "pytest"]);
//! let run = driver.start(&spec).await?; // stopped when `run` is dropped
//! let out = run.exec(ExecSpec::new(["python", "-c", "print(6 * 7)"])).await?;
//! assert_eq!(out.stdout_str(), "42\n");
//! run.stop().await?;
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]

pub mod ca;
mod capabilities;
mod cleanup;
pub mod credentials;
pub mod envvar;
mod error;
mod exec;
mod execs;
pub mod files;
mod guard;
mod helper;
pub mod labels;
mod lifecycle;
mod pool;
mod progress;
pub mod raw;
mod reap;
mod registry;
mod run;
mod snapshot;
mod spec;
mod warm;

pub use capabilities::{Capabilities, is_numeric_user};
pub use error::{Error, ErrorKind, Result, Shown};
pub use exec::{
    DEFAULT_OUTPUT_LIMIT, EXEC_ID_ENV, ExecOutput, ExecStream, ExitStatus, KILL_BOUND, OutputChunk,
    StdinWriter,
};
pub use execs::{ExecId, ExecInfo, FROM_NOW};
pub use files::{ByteStream, FileReader};
pub use guard::{DriverExt, RunGuard, stop_guarded_runs, stop_runs_on_signal};
pub use helper::{EXEC_HELPER_ENV, ExecHelper, ExecPath, HELPER_DIR};
pub use lifecycle::exec_in;
pub use pool::{CLOSE_WAIT, OnEmpty, OnMismatch, Pool, PoolConfig, PoolStats, Warm};
pub use progress::{CreateOptions, Progress, ProgressFn};
pub use raw::RunInfo;
pub use reap::{ReapReason, reap};
pub use registry::{
    ConnectFn, DriverConfig, DriverFactory, RESERVED_DRIVER_NAMES, connect, driver_names, drivers,
};
pub use run::{Driver, PoolProtocol, Run, RunExt};
pub use snapshot::{
    Snapshot, SnapshotOptions, check_repository, check_snapshot_id, check_snapshot_reference,
    new_snapshot_id, split_snapshot_reference,
};
/// The label keys of snapshots ([`Snapshot`]).
pub mod snapshot_labels {
    pub use crate::snapshot::{
        SNAPSHOT_CREATED, SNAPSHOT_EXPIRES_AT, SNAPSHOT_ID, SNAPSHOT_NAME, SNAPSHOT_OF,
        SNAPSHOT_OWNER_HOST, SNAPSHOT_OWNER_PID, SNAPSHOT_OWNER_START, SNAPSHOT_WORKSPACE,
    };
}
pub use spec::{
    DEFAULT_GRACE, DEFAULT_OUTPUT_BUFFER, DEFAULT_WORKSPACE_PATH, ExecSpec, MAX_GRACE,
    MAX_OUTPUT_BUFFER, MIN_DISK_BYTES, MIN_MEMORY_BYTES, MIN_OUTPUT_BUFFER, Network, Proxy,
    PullPolicy, Resources, RunSpec, Security, Stdin, TerminalSize, Workspace, could_be_id_prefix,
    normalize_registry, qualified_name, registry_of,
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
