//! One command run inside a run.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;

use super::env::{
    EnvNames, MAX_ENV_TOTAL, validate_abs_path, validate_argv, validate_env, validate_user,
};
use crate::error::{Error, Result};

/// What the exec'd process reads on stdin. `Debug` shows sizes, not bytes.
#[derive(Clone, Default)]
pub enum Stdin {
    /// Nothing: stdin is closed at once (EOF).
    #[default]
    Null,
    /// These bytes, then EOF.
    Bytes(Bytes),
    /// A writer handed out by [`crate::ExecStream::take_stdin`]; EOF when it is closed or dropped.
    Piped,
}

/// One command to run inside a run. `Debug` shows env names but not their values.
#[derive(Clone, Default)]
pub struct ExecSpec {
    /// The program and its arguments. Never passed through a shell.
    pub argv: Vec<String>,
    /// Extra environment; wins over the run's environment.
    pub env: Vec<(String, String)>,
    /// Overrides the run's working directory.
    pub working_dir: Option<String>,
    /// Overrides the run's user, where the driver supports it.
    pub user: Option<String>,
    /// What the process reads on stdin.
    pub stdin: Stdin,
    /// Past this, the whole process tree of the exec is killed (TERM, then KILL) and the
    /// status is [`crate::ExitStatus::TimedOut`].
    pub timeout: Option<Duration>,
    /// Per-stream cap of a buffered exec's output, in bytes (default 16 MiB).
    pub output_limit: Option<usize>,
    /// Run the command on a new pseudo-terminal of this size (see [`ExecSpec::tty`]).
    pub tty: Option<TerminalSize>,
    /// Keep running after the stream is dropped (see [`ExecSpec::detach`]).
    pub detach: bool,
    /// Output bytes the sandbox keeps for a reattach (see [`ExecSpec::output_buffer`]).
    pub output_buffer: Option<u64>,
    /// How long the command outlives a broken connection (see [`ExecSpec::grace`]).
    pub grace: Option<Duration>,
}

/// Output bytes an exec's record keeps in the sandbox unless [`ExecSpec::output_buffer`]
/// says otherwise (4 MiB).
pub const DEFAULT_OUTPUT_BUFFER: u64 = 4 << 20;
/// The smallest [`ExecSpec::output_buffer`] (64 KiB).
pub const MIN_OUTPUT_BUFFER: u64 = 64 << 10;
/// The largest [`ExecSpec::output_buffer`] (256 MiB).
pub const MAX_OUTPUT_BUFFER: u64 = 256 << 20;
/// How long a command outlives a broken connection unless [`ExecSpec::grace`] says
/// otherwise (10 minutes).
pub const DEFAULT_GRACE: Duration = Duration::from_secs(600);
/// The longest [`ExecSpec::grace`] (24 hours).
pub const MAX_GRACE: Duration = Duration::from_secs(24 * 3600);

/// The size of an exec's terminal, in character cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TerminalSize {
    /// Rows, from 1.
    pub rows: u16,
    /// Columns, from 1.
    pub cols: u16,
}

impl TerminalSize {
    /// `rows` x `cols`.
    pub fn new(rows: u16, cols: u16) -> Self {
        TerminalSize { rows, cols }
    }

    /// Both from 1, naming `tty.rows` or `tty.cols`.
    pub fn validate(&self) -> Result<()> {
        if self.rows == 0 {
            return Err(Error::invalid_spec("tty.rows", "must be from 1"));
        }
        if self.cols == 0 {
            return Err(Error::invalid_spec("tty.cols", "must be from 1"));
        }
        Ok(())
    }
}

impl ExecSpec {
    /// An exec of `argv`.
    pub fn new<I, S>(argv: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        ExecSpec {
            argv: argv.into_iter().map(Into::into).collect(),
            ..Default::default()
        }
    }

    /// Adds an environment variable.
    pub fn env(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((name.into(), value.into()));
        self
    }

    /// Sets the working directory.
    pub fn working_dir(mut self, dir: impl Into<String>) -> Self {
        self.working_dir = Some(dir.into());
        self
    }

    /// Sets the user (`uid[:gid]` or a name, where the driver supports it).
    pub fn user(mut self, user: impl Into<String>) -> Self {
        self.user = Some(user.into());
        self
    }

    /// Feeds these bytes on stdin, then EOF.
    pub fn stdin_bytes(mut self, bytes: impl Into<Bytes>) -> Self {
        self.stdin = Stdin::Bytes(bytes.into());
        self
    }

    /// Hands out a stdin writer on the stream.
    pub fn stdin_piped(mut self) -> Self {
        self.stdin = Stdin::Piped;
        self
    }

    /// Sets the timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Sets the per-stream output cap of buffered execs.
    pub fn output_limit(mut self, bytes: usize) -> Self {
        self.output_limit = Some(bytes);
        self
    }

    /// Runs the command on a new pseudo-terminal of `rows` x `cols`, as `docker exec -t`
    /// does: its stdin, stdout and stderr are the terminal (so `isatty` is true and its
    /// output is one stream, stdout, with the terminal's line endings), and it leads a
    /// session whose controlling terminal that is. Bytes written to its stdin are typed
    /// (`\x03`, Ctrl-C, interrupts the foreground process group; a terminal has no end of
    /// input, so closing stdin is not one: type `\x04`);
    /// [`crate::ExecStream::resize`] changes the size. Needs the capability `tty` (the
    /// exec helper gives it on every driver).
    pub fn tty(mut self, rows: u16, cols: u16) -> Self {
        self.tty = Some(TerminalSize::new(rows, cols));
        self
    }

    /// Starts the command detached: it keeps running when its [`crate::ExecStream`] is
    /// dropped, when the connection breaks and when this process exits, until it ends,
    /// [`crate::Run::kill_exec`], or the run stops. Its id
    /// ([`crate::ExecStream::exec_id`]) is known as soon as it started; any process may
    /// list it ([`crate::Run::execs`]), read its output from any offset
    /// ([`crate::Run::reattach`]), wait for it and kill it. Needs the capability
    /// `durable_execs` (the exec helper gives it on every driver).
    pub fn detach(mut self) -> Self {
        self.detach = true;
        self
    }

    /// Output bytes (stdout and stderr together) the sandbox keeps of this exec for a
    /// later [`crate::Run::reattach`]; older bytes are dropped once nobody is attached,
    /// and a reattach from before them reports how many ([`OutputChunk::Lost`]).
    /// [`MIN_OUTPUT_BUFFER`] to [`MAX_OUTPUT_BUFFER`]; default [`DEFAULT_OUTPUT_BUFFER`].
    /// It is memory of the sandbox's (the helper's), counted against the run's limit.
    ///
    /// [`OutputChunk::Lost`]: crate::OutputChunk::Lost
    pub fn output_buffer(mut self, bytes: u64) -> Self {
        self.output_buffer = Some(bytes);
        self
    }

    /// How long the command keeps running when the connection to the sandbox breaks
    /// (the host process died, the engine or a proxy cut the stream) with nobody
    /// reattaching: within it, the library reconnects and the stream resumes where it
    /// was, or another process reattaches; past it, the command is killed. Zero: killed
    /// as soon as the connection breaks. At most [`MAX_GRACE`]; default
    /// [`DEFAULT_GRACE`]. A detached exec has no grace: it runs on.
    pub fn grace(mut self, grace: Duration) -> Self {
        self.grace = Some(grace);
        self
    }

    /// Checks every field; the first problem is returned naming its field.
    pub fn validate(&self) -> Result<()> {
        validate_argv("argv", &self.argv)?;
        validate_env("env", &self.env)?;
        if let Some(dir) = &self.working_dir {
            validate_abs_path("working_dir", dir)?;
        }
        if let Some(user) = &self.user {
            validate_user(user)?;
        }
        let total: usize = self.env.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
        if total > MAX_ENV_TOTAL {
            return Err(Error::invalid_spec(
                "env",
                format!(
                    "is {total} bytes in all, over {MAX_ENV_TOTAL}: pass large data on stdin or as a file"
                ),
            ));
        }
        if self.timeout == Some(Duration::ZERO) {
            return Err(Error::invalid_spec("timeout", "must be positive"));
        }
        if let Some(tty) = &self.tty {
            tty.validate()?;
        }
        if let Some(n) = self.output_buffer
            && !(MIN_OUTPUT_BUFFER..=MAX_OUTPUT_BUFFER).contains(&n)
        {
            return Err(Error::invalid_spec(
                "output_buffer",
                format!("must be from {MIN_OUTPUT_BUFFER} to {MAX_OUTPUT_BUFFER} bytes, not {n}"),
            ));
        }
        if self.detach && self.timeout.is_some() {
            return Err(Error::invalid_spec(
                "timeout",
                "a detached command outlives this process, which could not enforce it: \
                 run it under `timeout` in argv, or kill it with Run::kill_exec",
            ));
        }
        if let Some(g) = self.grace
            && g > MAX_GRACE
        {
            return Err(Error::invalid_spec(
                "grace",
                format!("must be at most {MAX_GRACE:?}, not {g:?}"),
            ));
        }
        Ok(())
    }
}

impl fmt::Debug for Stdin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Stdin::Null => f.write_str("Null"),
            Stdin::Bytes(b) => write!(f, "Bytes(<{} bytes>)", b.len()),
            Stdin::Piped => f.write_str("Piped"),
        }
    }
}

impl fmt::Debug for ExecSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExecSpec")
            .field("argv", &self.argv)
            .field("env", &EnvNames(&self.env))
            .field("working_dir", &self.working_dir)
            .field("user", &self.user)
            .field("stdin", &self.stdin)
            .field("timeout", &self.timeout)
            .field("output_limit", &self.output_limit)
            .field("tty", &self.tty)
            .field("detach", &self.detach)
            .field("output_buffer", &self.output_buffer)
            .field("grace", &self.grace)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exec_spec_validation() {
        let e = ExecSpec::new(Vec::<String>::new()).validate().unwrap_err();
        assert_eq!(e.field(), Some("argv"));
        let e = ExecSpec::new(["echo", "a\0"]).validate().unwrap_err();
        assert_eq!(e.field(), Some("argv[1]"));
        let e = ExecSpec::new(["true"])
            .working_dir("tmp")
            .validate()
            .unwrap_err();
        assert_eq!(e.field(), Some("working_dir"));
        let e = ExecSpec::new(["true"]).env("=", "").validate().unwrap_err();
        assert_eq!(e.field(), Some("env[0].name"));
        ExecSpec::new(["true"]).validate().unwrap();
        let e = ExecSpec::new(["sh"]).tty(0, 80).validate().unwrap_err();
        assert_eq!(e.field(), Some("tty.rows"));
        let e = ExecSpec::new(["sh"]).tty(24, 0).validate().unwrap_err();
        assert_eq!(e.field(), Some("tty.cols"));
        ExecSpec::new(["sh"]).tty(24, 80).validate().unwrap();
    }

    #[test]
    fn output_buffer_and_grace_are_bounded_and_named() {
        let spec = || ExecSpec::new(["sh"]);
        for n in [0, MIN_OUTPUT_BUFFER - 1, MAX_OUTPUT_BUFFER + 1] {
            let e = spec().output_buffer(n).validate().unwrap_err();
            assert_eq!(e.field(), Some("output_buffer"), "{n}");
        }
        for n in [MIN_OUTPUT_BUFFER, DEFAULT_OUTPUT_BUFFER, MAX_OUTPUT_BUFFER] {
            spec().output_buffer(n).validate().unwrap();
        }
        let e = spec()
            .grace(MAX_GRACE + Duration::from_secs(1))
            .validate()
            .unwrap_err();
        assert_eq!(e.field(), Some("grace"));
        spec().grace(Duration::ZERO).detach().validate().unwrap();
        spec().grace(MAX_GRACE).validate().unwrap();
    }
}
