//! Mapping bollard's errors into the library's kinds.

use bollard::errors::Error as BollardError;
use runcell_core::{Error, ErrorKind};

use crate::DockerDriver;

/// Maps a bollard error; `op` says what was attempted.
pub fn map(op: &'static str, e: BollardError) -> Error {
    let kind = match &e {
        BollardError::DockerResponseServerError {
            status_code: 404, ..
        } => ErrorKind::NotFound,
        BollardError::RequestTimeoutError => ErrorKind::Timeout,
        BollardError::SocketNotFoundError(_)
        | BollardError::IOError { .. }
        | BollardError::HyperResponseError { .. }
        | BollardError::HyperLegacyError { .. } => ErrorKind::Unavailable,
        _ => ErrorKind::Backend,
    };
    Error::new(kind, format!("docker: {op} failed"))
        .with_operation(op)
        .with_source(e)
}

/// The HTTP status of a daemon answer, if it was one.
pub fn status(e: &BollardError) -> Option<u16> {
    match e {
        BollardError::DockerResponseServerError { status_code, .. } => Some(*status_code),
        _ => None,
    }
}

/// The daemon's message of an error answer (empty otherwise).
pub fn message(e: &BollardError) -> &str {
    match e {
        BollardError::DockerResponseServerError { message, .. } => message,
        _ => "",
    }
}

impl DockerDriver {
    /// Names the daemon address in errors that say it could not be reached.
    pub(crate) fn locate(&self, e: Error) -> Error {
        if e.kind() == ErrorKind::Unavailable {
            e.with("address", &self.address)
        } else {
            e
        }
    }
}
