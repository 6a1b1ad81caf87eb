//! Mapping kube's errors into the library's kinds.

use runcell_core::{Error, ErrorKind};

/// Maps a kube error; `op` says what was attempted.
pub fn map(op: &'static str, e: kube::Error) -> Error {
    let kind = match &e {
        kube::Error::Api(s) if s.code == 404 => ErrorKind::NotFound,
        kube::Error::Api(_) => ErrorKind::Backend,
        kube::Error::HyperError(_) | kube::Error::Service(_) => ErrorKind::Unavailable,
        _ => ErrorKind::Backend,
    };
    Error::new(kind, format!("kubernetes: {op} failed"))
        .with_operation(op)
        .with_source(e)
}

/// The HTTP status of an API answer, if it was one.
pub fn code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(s) => Some(s.code),
        _ => None,
    }
}
