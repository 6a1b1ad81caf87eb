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
}

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
}
