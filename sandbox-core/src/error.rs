//! One error type for every driver: a [`ErrorKind`] to match on, a message, the spec
//! field at fault (for invalid specs), context pairs and the underlying source.

use std::fmt;

/// What went wrong, coarse enough to match on and stable across drivers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The spec was rejected before anything was created. [`Error::field`] names the field.
    InvalidSpec,
    /// The driver cannot honour a field or operation (see [`crate::Capabilities`]).
    Unsupported,
    /// Something named does not exist: an image, a run id, a driver name, a path.
    NotFound,
    /// The backend could not be reached (daemon down, API server unreachable).
    Unavailable,
    /// The run's container or pod is gone (removed, killed, engine restarted).
    RunLost,
    /// An operation of the library itself (start, readiness, stop) ran out of time.
    Timeout,
    /// A post-create command failed; the run was removed. Context holds its exit code and output.
    PostCreateFailed,
    /// The target was created but did not stay running or did not answer an exec (no
    /// `sleep` or `sh` in the image, a keep-alive that exits, limits too small to start);
    /// the run was removed. Context holds the exit code and the log tail where known.
    StartFailed,
    /// The driver configuration given to the registry or constructor is wrong.
    Config,
    /// The backend answered with an error that fits no other kind.
    Backend,
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ErrorKind::InvalidSpec => "invalid spec",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::NotFound => "not found",
            ErrorKind::Unavailable => "backend unavailable",
            ErrorKind::RunLost => "run lost",
            ErrorKind::Timeout => "timed out",
            ErrorKind::PostCreateFailed => "post-create command failed",
            ErrorKind::StartFailed => "the sandbox did not start",
            ErrorKind::Config => "invalid driver config",
            ErrorKind::Backend => "backend error",
        })
    }
}

type Source = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The error of every fallible operation in this library.
pub struct Error {
    kind: ErrorKind,
    message: String,
    field: Option<String>,
    context: Vec<(&'static str, String)>,
    source: Option<Source>,
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A new error of `kind` with a human message.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
            field: None,
            context: Vec::new(),
            source: None,
        }
    }

    /// An [`ErrorKind::InvalidSpec`] error naming the field at fault (e.g. `env[2].name`).
    pub fn invalid_spec(field: impl Into<String>, message: impl Into<String>) -> Self {
        let mut e = Error::new(ErrorKind::InvalidSpec, message);
        e.field = Some(field.into());
        e
    }

    /// An [`ErrorKind::Unsupported`] error naming the spec field the driver cannot honour.
    pub fn unsupported(field: impl Into<String>, message: impl Into<String>) -> Self {
        let mut e = Error::new(ErrorKind::Unsupported, message);
        e.field = Some(field.into());
        e
    }

    /// Names the spec field at fault, for any kind (e.g. an exec's `working_dir` that does
    /// not exist in the run: [`ErrorKind::NotFound`] naming `working_dir`).
    pub fn with_field(mut self, field: impl Into<String>) -> Self {
        self.field = Some(field.into());
        self
    }

    /// Adds a context pair (operation, run id, image, address...).
    pub fn with(mut self, key: &'static str, value: impl fmt::Display) -> Self {
        self.context.push((key, value.to_string()));
        self
    }

    /// Sets the underlying cause.
    pub fn with_source(mut self, source: impl Into<Source>) -> Self {
        self.source = Some(source.into());
        self
    }

    /// The kind to match on.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The message, without kind or context.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The spec field at fault: always for [`ErrorKind::InvalidSpec`] and
    /// [`ErrorKind::Unsupported`], and for errors caused by one field's value (a missing
    /// working directory, an unknown user, a missing image).
    pub fn field(&self) -> Option<&str> {
        self.field.as_deref()
    }

    /// The context pairs, in the order they were added.
    pub fn context(&self) -> &[(&'static str, String)] {
        &self.context
    }

    /// The value of one context key.
    pub fn context_value(&self, key: &str) -> Option<&str> {
        self.context
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.as_str())
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.kind)?;
        if let Some(field) = &self.field {
            write!(f, " ({field})")?;
        }
        write!(f, ": {}", self.message)?;
        for (k, v) in &self.context {
            write!(f, ", {k}: {v}")?;
        }
        if let Some(source) = &self.source {
            write!(f, ": {source}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|s| s as &(dyn std::error::Error + 'static))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_kind_field_context_and_source() {
        let io = std::io::Error::other("boom");
        let e = Error::invalid_spec("env[0].name", "must not contain '='")
            .with("run", "r1")
            .with_source(io);
        assert_eq!(
            e.to_string(),
            "invalid spec (env[0].name): must not contain '=', run: r1: boom"
        );
        assert_eq!(e.kind(), ErrorKind::InvalidSpec);
        assert_eq!(e.field(), Some("env[0].name"));
        assert_eq!(e.context_value("run"), Some("r1"));
        assert!(std::error::Error::source(&e).is_some());
    }
}
