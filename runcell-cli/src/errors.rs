//! Exit codes and how failures are told: one line with the cause chain and the field,
//! where known the file and line, and a hint where one helps.

use std::fmt;

use runcell_core::{Error, ErrorKind};

use crate::spec::SpecSource;

/// The command's exit code passes through (0-255); these are sandbox's own.
pub mod code {
    /// The command timed out and its processes could not be killed: they may still run.
    pub const NOT_KILLED: i32 = 120;
    /// The run is gone: its container or pod was removed or stopped.
    pub const RUN_LOST: i32 = 121;
    /// The connection to the backend broke while the command ran; it may have run.
    pub const TRANSPORT_LOST: i32 = 122;
    /// The command did not start: the exec's working directory or user does not exist.
    pub const NOT_STARTED: i32 = 123;
    /// The command ran past --timeout; its processes were killed (as coreutils `timeout`).
    pub const TIMED_OUT: i32 = 124;
    /// sandbox itself failed (usage, config, spec, backend, ...) before or around the command.
    pub const FAILED: i32 = 125;
}

/// The exit-code table, for `--help` and the README.
pub const EXIT_CODES_HELP: &str = "\
Exit codes of `exec`, `run`, `wait` and `logs -f`: the command's own (0-255), 128+N when
a signal N killed it, and:
  120  the command timed out and its processes could not be killed; they may still run
       (`sandbox stop` ends them)
  121  the run is gone (its container or pod was removed or stopped)
  122  the connection to the backend was lost; the command may have run
  123  the command did not start (--workdir or --user does not exist in the run)
  124  the command timed out (--timeout); its processes were killed
  125  sandbox itself failed (usage, config, spec, driver unavailable, ...)
  130  interrupted (SIGINT); 143 on SIGTERM. `run` stops its run first
Other commands exit 0, or 121/125 as above.";

/// Why a command failed.
#[derive(Debug)]
pub enum Failure {
    /// An error of the library; `at` is `FILE:LINE` when it is about a spec file's field.
    Core {
        error: Box<Error>,
        at: Option<String>,
    },
    /// A mistake in the command line or a file, told as it is.
    Usage(String),
    /// A failure the run's mux met and told: its text, hint and exit code.
    Remote {
        message: String,
        hint: Option<String>,
        code: i32,
    },
}

impl Failure {
    pub fn usage(message: impl Into<String>) -> Failure {
        Failure::Usage(message.into())
    }

    /// A library error about a spec field, placed in the spec file when the file sets it.
    pub fn spec(error: Error, source: &SpecSource) -> Failure {
        let at = error.field().and_then(|f| source.locate(f));
        Failure::Core {
            error: Box::new(error),
            at,
        }
    }

    pub fn code(&self) -> i32 {
        match self {
            Failure::Core { error, .. } if error.kind() == ErrorKind::RunLost => code::RUN_LOST,
            Failure::Remote { code, .. } => *code,
            _ => code::FAILED,
        }
    }

    /// One line of advice for the errors people hit first.
    pub fn hint(&self, driver: &str) -> Option<String> {
        let error = match self {
            Failure::Core { error, .. } => error,
            Failure::Remote { hint, .. } => return hint.clone(),
            Failure::Usage(_) => return None,
        };
        let field = error.field().unwrap_or("");
        Some(match error.kind() {
            ErrorKind::Unavailable if driver == "docker" => "is the Docker engine running? try `docker version`; start it (`dockerd`, `systemctl start docker`) or point at it with --config host=unix:///path/docker.sock (RUNCELL_DOCKER_HOST)".into(),
            ErrorKind::Unavailable if driver == "k8s" => "is the cluster reachable? check KUBECONFIG (`kubectl get pods`), or --config namespace=NAME".into(),
            ErrorKind::Unavailable => format!("is the {driver} backend running and reachable?"),
            ErrorKind::NotFound if field == "image" || error.context_value("image").is_some() => "pull policy never? build or pull the image first, or check its name (`docker images`)".into(),
            ErrorKind::NotFound if field == "exec_id" => "`sandbox ps RUN` lists the run's execs".into(),
            ErrorKind::NotFound if error.context_value("run").is_some() || error.message().contains("managed run") => "`sandbox ls --all` lists the runs".into(),
            ErrorKind::NotFound if field == "working_dir" || field == "user" => format!("the run has no such {}; check --workdir / --user", field.replace('_', " ")),
            ErrorKind::RunLost => "the run's container or pod is gone or stopped; `sandbox gc` removes what is left of it".into(),
            ErrorKind::Config => format!("{driver} config comes from --config KEY=VALUE, the [{driver}] table of --config-file and RUNCELL_{}_* variables", driver.to_ascii_uppercase().replace('-', "_")),
            ErrorKind::Unsupported if matches!(field, "detach" | "exec_id" | "execs") => "exec records (`exec -d`, `logs`, `wait`, `kill`, `ps`, `rm-exec`) need the run's exec helper; this run takes the plain exec path (its spec sets exec_helper off, its image cannot run the helper, or this sandbox was built without one)".into(),
            ErrorKind::Unsupported => format!("the {driver} driver cannot honour {field}: leave it out, or use another driver (`sandbox drivers`)"),
            ErrorKind::StartFailed => "the image needs `sleep` that accepts `infinity` and a POSIX `sh` (busybox or coreutils)".into(),
            ErrorKind::LimitReached if error.context_value("limit").is_some_and(|l| l.starts_with("the run's")) => "the run is at its own limits: end some of its processes (`sandbox ps`, `sandbox kill`) or start it with higher ones".into(),
            ErrorKind::LimitReached => "stop runs you no longer need (`sandbox ls`, `sandbox stop`, `sandbox gc`) or raise the limit named above, then try again".into(),
            ErrorKind::Timeout => "the backend is slow: raise its timeout (docker: --config timeout_secs=N; k8s: --config ready_timeout_secs=N)".into(),
            _ => return None,
        })
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Usage(m) => f.write_str(m),
            // Relayed by the run's mux: as `Error`'s own Display, escaped.
            Failure::Remote { message: m, .. } => write!(f, "{}", runcell_core::Shown(m)),
            Failure::Core { error, at } => {
                if let Some(at) = at {
                    write!(f, "{at}: ")?;
                }
                // Display has kind, field, message, context and the first cause; add the
                // causes of that cause.
                write!(f, "{error}")?;
                let mut cause = std::error::Error::source(&**error).and_then(|s| s.source());
                while let Some(c) = cause {
                    write!(f, ": {}", runcell_core::Shown(c))?;
                    cause = c.source();
                }
                Ok(())
            }
        }
    }
}

impl From<Error> for Failure {
    fn from(error: Error) -> Failure {
        Failure::Core {
            error: Box::new(error),
            at: None,
        }
    }
}

/// Prints a failure (and its hint) to stderr.
pub fn report(failure: &Failure, driver: &str) {
    eprintln!("sandbox: error: {failure}");
    if let Some(hint) = failure.hint(driver) {
        eprintln!("sandbox: hint: {hint}");
    }
}
