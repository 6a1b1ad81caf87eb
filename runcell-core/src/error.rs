//! One error type for every driver: a [`ErrorKind`] to match on, a message, the spec
//! field at fault (for invalid specs), the operation that failed, context pairs, the
//! underlying source, and whether a retry may help.

use std::fmt;

/// What went wrong, coarse enough to match on and stable across drivers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The spec (or an argument: a run id, a selector) was rejected before anything was
    /// created or asked of a backend. [`Error::field`] names the field.
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
    /// A limit of the engine, the cluster or the host was reached (a node's pod count or
    /// resources, a quota, the host's file descriptors): the context's `limit` names it.
    /// Nothing was left half-made and runs already started keep working; temporary: the
    /// same call may succeed once other runs stopped.
    LimitReached,
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
            ErrorKind::LimitReached => "limit reached",
        })
    }
}

type Source = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Text shown as it is, except what could move a terminal's cursor or reorder what a
/// reader sees: control characters (a newline too: `Display` of an error is one line)
/// and Unicode's invisible direction and width marks are shown escaped (`\u{1b}`,
/// `\n`). Messages hold text the sandbox wrote (a helper's message, a container's
/// termination message, a command's stderr): it must not reach a terminal raw.
pub struct Shown<T>(pub T);

impl<T: fmt::Display> fmt::Display for Shown<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        struct Escaping<'a, 'b>(&'a mut fmt::Formatter<'b>);
        impl fmt::Write for Escaping<'_, '_> {
            fn write_str(&mut self, s: &str) -> fmt::Result {
                let mut plain = 0;
                for (i, c) in s.char_indices() {
                    if is_unsafe_char(c) {
                        self.0.write_str(&s[plain..i])?;
                        match c {
                            '\n' | '\r' | '\t' => write!(self.0, "{}", c.escape_default())?,
                            _ => write!(self.0, "{}", c.escape_unicode())?,
                        }
                        plain = i + c.len_utf8();
                    }
                }
                self.0.write_str(&s[plain..])
            }
        }
        fmt::write(&mut Escaping(f), format_args!("{}", self.0))
    }
}

/// A character [`Shown`] escapes: controls (Unicode's Cc), the invisible format
/// characters (Cf: direction marks and overrides, joiners, the soft hyphen, tags), line
/// and paragraph separators, and variation selectors.
fn is_unsafe_char(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{ad}'
                | '\u{34f}'
                | '\u{600}'..='\u{605}'
                | '\u{61c}'
                | '\u{6dd}'
                | '\u{70f}'
                | '\u{890}'..='\u{891}'
                | '\u{8e2}'
                | '\u{180b}'..='\u{180f}'
                | '\u{200b}'..='\u{200f}'
                | '\u{2028}'..='\u{202e}'
                | '\u{2060}'..='\u{206f}'
                | '\u{fe00}'..='\u{fe0f}'
                | '\u{feff}'
                | '\u{fff9}'..='\u{fffb}'
                | '\u{110bd}'
                | '\u{110cd}'
                | '\u{13430}'..='\u{1343f}'
                | '\u{1bca0}'..='\u{1bca3}'
                | '\u{1d173}'..='\u{1d17a}'
                | '\u{e0000}'..='\u{e0fff}'
        )
}

/// The host limit a cause reports, where it is one: an [`std::io::Error`] of `EMFILE` or
/// `ENFILE` in its chain (through the errors an `io::Error` wraps too).
fn host_limit(source: &(dyn std::error::Error + 'static)) -> Option<&'static str> {
    let mut next = Some(source);
    // A chain is short; a cycle must not hold the caller.
    for _ in 0..64 {
        let e = next?;
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            match io.raw_os_error() {
                Some(libc::EMFILE) => {
                    return Some("the open files of this process (RLIMIT_NOFILE, ulimit -n)");
                }
                Some(libc::ENFILE) => return Some("the open files of the host (fs.file-max)"),
                _ => {}
            }
            if let Some(inner) = io.get_ref() {
                next = Some(inner);
                continue;
            }
        }
        next = e.source();
    }
    None
}

/// The error of every fallible operation in this library.
///
/// `Display` is one line (kind, field, message, context, source). `Debug` spreads the
/// same over several lines, adds the operation and the whole chain of causes, and prints
/// nothing else: no value `Display` would not show.
pub struct Error {
    kind: ErrorKind,
    message: String,
    field: Option<String>,
    operation: Option<&'static str>,
    context: Vec<(&'static str, String)>,
    source: Option<Source>,
    temporary: bool,
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A new error of `kind` with a human message. It is temporary (see
    /// [`Error::is_temporary`]) when `kind` is [`ErrorKind::Unavailable`],
    /// [`ErrorKind::Timeout`] or [`ErrorKind::LimitReached`].
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
            field: None,
            operation: None,
            context: Vec::new(),
            source: None,
            temporary: matches!(
                kind,
                ErrorKind::Unavailable | ErrorKind::Timeout | ErrorKind::LimitReached
            ),
        }
    }

    /// An [`ErrorKind::InvalidSpec`] error naming the field at fault (e.g. `env[2].name`).
    pub fn invalid_spec(field: impl Into<String>, message: impl Into<String>) -> Self {
        Error::new(ErrorKind::InvalidSpec, message).with_field(field)
    }

    /// An [`ErrorKind::Unsupported`] error naming the spec field the driver cannot honour.
    pub fn unsupported(field: impl Into<String>, message: impl Into<String>) -> Self {
        Error::new(ErrorKind::Unsupported, message).with_field(field)
    }

    /// Names the spec field at fault, for any kind (e.g. an exec's `working_dir` that does
    /// not exist in the run: [`ErrorKind::NotFound`] naming `working_dir`).
    pub fn with_field(mut self, field: impl Into<String>) -> Self {
        self.field = Some(field.into());
        self
    }

    /// Names the operation that failed (`create container`, `exec`, `delete pod`...). The
    /// message is left as it is, so it may say the same in words.
    pub fn with_operation(mut self, operation: &'static str) -> Self {
        self.operation = Some(operation);
        self
    }

    /// Adds what more is known to the message (`"{message}: {detail}"`), keeping the
    /// kind, field, operation, context and source.
    pub fn with_detail(mut self, detail: impl fmt::Display) -> Self {
        self.message = format!("{}: {detail}", self.message);
        self
    }

    /// Adds a context pair (run id, image, address, path...).
    pub fn with(mut self, key: &'static str, value: impl fmt::Display) -> Self {
        self.context.push((key, value.to_string()));
        self
    }

    /// Sets the underlying cause. A cause that is the host running out of file
    /// descriptors (`EMFILE`, `ENFILE`, anywhere in its chain) makes the error
    /// [`ErrorKind::LimitReached`] naming that limit, whatever it was made as: the
    /// operation did not fail for its own reasons, and may succeed once descriptors are
    /// free again.
    pub fn with_source(mut self, source: impl Into<Source>) -> Self {
        let source = source.into();
        if let Some(limit) = host_limit(&*source)
            && self.kind != ErrorKind::LimitReached
        {
            self.kind = ErrorKind::LimitReached;
            self.temporary = true;
            self.context.push(("limit", limit.to_string()));
        }
        self.source = Some(source);
        self
    }

    /// Marks the error temporary: the same call, repeated later, may succeed.
    pub fn temporary(mut self) -> Self {
        self.temporary = true;
        self
    }

    /// Sets whether a retry may help, overriding the default of the kind (e.g. `false`
    /// for an [`ErrorKind::Unavailable`] error that a retry cannot fix).
    pub fn set_temporary(&mut self, temporary: bool) {
        self.temporary = temporary;
    }

    /// The kind to match on.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The message, without kind or context, as it was made: it may hold text the
    /// sandbox wrote (control characters too); show it through [`Shown`], as `Display`
    /// does.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The spec field at fault: always for [`ErrorKind::InvalidSpec`] and
    /// [`ErrorKind::Unsupported`], and for errors caused by one field's value (a missing
    /// working directory, an unknown user, a missing image).
    pub fn field(&self) -> Option<&str> {
        self.field.as_deref()
    }

    /// The operation that failed, where the error was given one.
    pub fn operation(&self) -> Option<&str> {
        self.operation
    }

    /// Whether the same call, repeated later, may succeed. True by default for
    /// [`ErrorKind::Unavailable`] and [`ErrorKind::Timeout`], false for other kinds;
    /// [`Error::temporary`] and [`Error::set_temporary`] override it. The library itself
    /// never retries.
    pub fn is_temporary(&self) -> bool {
        self.temporary
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
            write!(f, " ({})", Shown(field))?;
        }
        write!(f, ": {}", Shown(&self.message))?;
        for (k, v) in &self.context {
            write!(f, ", {k}: {}", Shown(v))?;
        }
        if let Some(source) = &self.source {
            write!(f, ": {}", Shown(source))?;
        }
        Ok(())
    }
}

/// One line per part, present parts only, then every cause:
///
/// ```text
/// backend unavailable (temporary)
///     operation: create container
///     message: docker: create container failed
///     image: busybox
///     caused by: error trying to connect: No such file or directory
/// ```
impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.kind)?;
        if self.temporary {
            f.write_str(" (temporary)")?;
        }
        if let Some(field) = &self.field {
            write!(f, "\n    field: {}", Shown(field))?;
        }
        if let Some(operation) = self.operation {
            write!(f, "\n    operation: {operation}")?;
        }
        write!(f, "\n    message: {}", Shown(&self.message))?;
        for (k, v) in &self.context {
            write!(f, "\n    {k}: {}", Shown(v))?;
        }
        let mut cause = std::error::Error::source(self);
        while let Some(e) = cause {
            write!(f, "\n    caused by: {}", Shown(e))?;
            cause = e.source();
        }
        Ok(())
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
    fn a_cause_that_is_out_of_descriptors_is_a_limit_reached() {
        #[derive(Debug)]
        struct Wrapper(std::io::Error);
        impl fmt::Display for Wrapper {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("connect failed")
            }
        }
        impl std::error::Error for Wrapper {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let emfile = || std::io::Error::from_raw_os_error(libc::EMFILE);
        for source in [
            Box::new(emfile()) as Source,
            Box::new(Wrapper(emfile())),
            // An io::Error that wraps another error (hyper and tokio make those).
            Box::new(std::io::Error::other(Wrapper(emfile()))),
        ] {
            let e = Error::new(ErrorKind::Unavailable, "docker: create failed").with_source(source);
            assert_eq!(e.kind(), ErrorKind::LimitReached, "{e:?}");
            assert!(e.is_temporary());
            assert!(e.context_value("limit").unwrap().contains("RLIMIT_NOFILE"));
        }
        let e = Error::new(ErrorKind::Backend, "x")
            .with_source(std::io::Error::from_raw_os_error(libc::ENFILE));
        assert!(e.context_value("limit").unwrap().contains("host"));
        let other = Error::new(ErrorKind::Unavailable, "x")
            .with_source(std::io::Error::from_raw_os_error(libc::ECONNREFUSED));
        assert_eq!(other.kind(), ErrorKind::Unavailable);
        assert_eq!(other.context_value("limit"), None);
    }

    #[test]
    fn text_from_the_sandbox_is_shown_escaped_on_one_line() {
        let hostile = "a\x1b]0;owned\x07b\r\nc\u{202e}d\u{9b}31m\te\u{200b}f";
        let shown = r"a\u{1b}]0;owned\u{7}b\r\nc\u{202e}d\u{9b}31m\te\u{200b}f";
        assert_eq!(Shown(hostile).to_string(), shown);
        for c in [
            '\u{61c}',
            '\u{206a}',
            '\u{180e}',
            '\u{ad}',
            '\u{e0041}',
            '\u{fe0f}',
        ] {
            assert_eq!(
                Shown(c).to_string(),
                c.escape_unicode().to_string(),
                "{c:?}"
            );
        }
        // Plain text, quotes and backslashes as they are.
        assert_eq!(Shown("é \"q\" \\ ok").to_string(), "é \"q\" \\ ok");
        let e = Error::new(ErrorKind::RunLost, hostile)
            .with_field(hostile)
            .with("run", hostile)
            .with_source(std::io::Error::other(hostile));
        for text in [e.to_string(), format!("{e:?}")] {
            assert!(
                !text.chars().any(|c| c != '\n' && is_unsafe_char(c)),
                "{text:?}"
            );
            assert_eq!(text.matches(shown).count(), 4, "{text}");
        }
        assert!(!e.to_string().contains('\n'));
        let status = crate::ExitStatus::KillFailed(hostile.into()).to_string();
        assert!(
            status.contains(shown) && !status.chars().any(is_unsafe_char),
            "{status}"
        );
    }

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

    #[test]
    fn operation_is_a_field_and_the_message_stays() {
        let e = Error::new(ErrorKind::Backend, "docker: create container failed")
            .with_operation("create container")
            .with("image", "busybox");
        assert_eq!(e.operation(), Some("create container"));
        assert_eq!(e.message(), "docker: create container failed");
        assert_eq!(
            e.to_string(),
            "backend error: docker: create container failed, image: busybox"
        );
        assert_eq!(Error::new(ErrorKind::Backend, "x").operation(), None);
    }

    #[test]
    fn unavailable_and_timeout_are_temporary_by_default() {
        for kind in [ErrorKind::Unavailable, ErrorKind::Timeout] {
            assert!(Error::new(kind, "x").is_temporary(), "{kind}");
        }
        for kind in [
            ErrorKind::InvalidSpec,
            ErrorKind::Unsupported,
            ErrorKind::NotFound,
            ErrorKind::RunLost,
            ErrorKind::PostCreateFailed,
            ErrorKind::StartFailed,
            ErrorKind::Config,
            ErrorKind::Backend,
        ] {
            assert!(!Error::new(kind, "x").is_temporary(), "{kind}");
        }
        assert!(!Error::invalid_spec("image", "x").is_temporary());
        assert!(!Error::unsupported("ttl", "x").is_temporary());
    }

    #[test]
    fn temporary_can_be_set_either_way() {
        let e = Error::new(ErrorKind::Backend, "429 too many requests").temporary();
        assert!(e.is_temporary());
        let mut e = Error::new(ErrorKind::Unavailable, "no such socket");
        e.set_temporary(false);
        assert!(!e.is_temporary());
        e.set_temporary(true);
        assert!(e.is_temporary());
    }

    #[derive(Debug)]
    struct Layer(&'static str, Option<Box<Layer>>);

    impl fmt::Display for Layer {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Layer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|l| l as _)
        }
    }

    #[test]
    fn debug_puts_each_part_on_its_line_with_the_whole_chain() {
        let chain = Layer(
            "client error",
            Some(Box::new(Layer("connection refused", None))),
        );
        let e = Error::new(ErrorKind::Unavailable, "docker: create container failed")
            .with_operation("create container")
            .with_field("image")
            .with("image", "busybox")
            .with("address", "unix:///var/run/docker.sock")
            .with_source(chain);
        assert_eq!(
            format!("{e:?}"),
            "backend unavailable (temporary)\n    \
             field: image\n    \
             operation: create container\n    \
             message: docker: create container failed\n    \
             image: busybox\n    \
             address: unix:///var/run/docker.sock\n    \
             caused by: client error\n    \
             caused by: connection refused"
        );
        assert!(!e.to_string().contains('\n'));
        assert_eq!(
            format!("{:?}", Error::new(ErrorKind::NotFound, "no run sbx-1")),
            "not found\n    message: no run sbx-1"
        );
    }

    #[test]
    fn debug_shows_no_value_display_hides() {
        // Everything in Debug but the operation, the temporary mark and the causes past
        // the first must already be in Display.
        let e = Error::invalid_spec("env[0].value", "the value of TOKEN must not contain NUL")
            .with("run", "r1")
            .with_source(std::io::Error::other("inner"));
        let display = e.to_string();
        for line in format!("{e:?}").lines() {
            let value = line.trim().split_once(": ").map_or(line.trim(), |(_, v)| v);
            assert!(display.contains(value), "{line:?} not in {display:?}");
        }
    }
}
