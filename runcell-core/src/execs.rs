//! Durable execs: the id of one exec in its run and what the run's helper says about it
//! ([`crate::Run::execs`]). Commands started with [`crate::ExecSpec::detach`] (and, within
//! their grace, those whose connection broke) are reached by id from any process.

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, SystemTime};

use crate::error::{Error, Result};
use crate::exec::ExitStatus;

/// The id of one exec in its run: unique among the run's execs while its record lives.
/// Shown and parsed as a decimal number (never 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExecId(u32);

impl ExecId {
    /// From the wire (0 is never an exec's).
    pub(crate) fn new(id: u32) -> Option<ExecId> {
        (id != 0).then_some(ExecId(id))
    }

    /// The number.
    pub fn get(self) -> u32 {
        self.0
    }
}

impl fmt::Display for ExecId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl FromStr for ExecId {
    type Err = Error;

    /// A decimal number from 1 to 2^32 - 1; anything else is
    /// [`crate::ErrorKind::InvalidSpec`] naming `exec_id`.
    fn from_str(s: &str) -> Result<ExecId> {
        s.parse::<u32>()
            .ok()
            .filter(|_| s.bytes().all(|b| b.is_ascii_digit()))
            .and_then(ExecId::new)
            .ok_or_else(|| Error::invalid_spec("exec_id", "must be a number from 1 to 4294967295"))
    }
}

/// Where a reattach starts reading: only what the command prints from now on, and its
/// exit status ([`crate::Run::reattach`]).
pub const FROM_NOW: u64 = u64::MAX;

/// One exec of a run, as its helper keeps it. Offsets count output bytes, stdout and
/// stderr together, in the order the helper read them, from 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecInfo {
    /// Its id.
    pub id: ExecId,
    /// The command's pid in the sandbox (0 while starting).
    pub pid: u32,
    /// The command: at most 16 arguments, each cut to 256 bytes (lossy UTF-8).
    pub argv: Vec<String>,
    /// Started with [`crate::ExecSpec::detach`].
    pub detached: bool,
    /// A stream (of some process) reads its output now.
    pub attached: bool,
    /// How it ended; `None` while it runs.
    pub status: Option<ExitStatus>,
    /// Output bytes it produced so far.
    pub output_bytes: u64,
    /// The oldest offset the sandbox still keeps: a reattach from before it reports the
    /// bytes in between as lost.
    pub kept_from: u64,
    /// When it started (the sandbox's clock).
    pub started: SystemTime,
}

impl ExecInfo {
    /// From the helper's record; `None` for an id of 0 (never an exec's).
    pub(crate) fn from_wire(w: crate::helper::proto::ExecInfo) -> Option<ExecInfo> {
        Some(ExecInfo {
            id: ExecId::new(w.id)?,
            pid: w.pid,
            argv: w
                .argv
                .iter()
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect(),
            detached: w.detach,
            attached: w.attached,
            status: w.exit.map(|(kind, value)| exit_status(kind, value)),
            output_bytes: w.end,
            kept_from: w.kept_from.min(w.end),
            started: SystemTime::UNIX_EPOCH + Duration::from_millis(w.started_ms),
        })
    }
}

/// [`crate::ErrorKind::NotFound`] naming `exec_id`: run `run` has no record of exec `id`.
pub(crate) fn no_such_exec(id: ExecId, run: &str) -> Error {
    Error::new(
        crate::ErrorKind::NotFound,
        format!("the run has no exec {id} (never started here, or released)"),
    )
    .with_field("exec_id")
    .with("run", run)
}

/// An `EXIT` frame's status.
pub(crate) fn exit_status(kind: u8, value: i32) -> ExitStatus {
    if kind == crate::helper::proto::SIGNALED {
        ExitStatus::Signaled(value)
    } else {
        ExitStatus::Exited(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exec_ids_parse_as_positive_decimal_numbers_only() {
        assert_eq!("42".parse::<ExecId>().unwrap().get(), 42);
        assert_eq!("4294967295".parse::<ExecId>().unwrap().get(), u32::MAX);
        for bad in ["0", "", "-1", "+1", "4294967296", "1a", " 1", "0x10"] {
            let e = bad.parse::<ExecId>().unwrap_err();
            assert_eq!(e.field(), Some("exec_id"), "{bad:?}");
        }
        assert_eq!(ExecId::new(7).unwrap().to_string(), "7");
        assert!(ExecId::new(0).is_none());
    }
}
