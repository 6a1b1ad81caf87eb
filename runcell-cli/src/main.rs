//! `sandbox`: the runcell command line. Start a run (one long-lived container or pod),
//! exec commands into it, copy files, list, stop and garbage-collect runs, over any
//! registered driver (Docker and Kubernetes are built in).
#![forbid(unsafe_code)]
// The doc comments of the clap structs are `--help` text, written for a terminal.
#![allow(rustdoc::broken_intra_doc_links, rustdoc::invalid_html_tags)]

mod config;
mod cp;
mod doc;
mod errors;
mod exec;
mod execs;
mod mux;
mod progress;
mod snapshots;
mod spec;
mod tty;
mod units;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::{ArgAction, Args, Parser, Subcommand};
use runcell_core::labels::{self, Owner};
use runcell_core::{CreateOptions, Driver, ExecSpec, ReapReason, RunGuard, RunInfo};
// The built-in drivers: linked so that the registry finds them by name.
use runcell_docker as _;
use runcell_k8s as _;

use crate::cp::Place;
use crate::errors::{EXIT_CODES_HELP, Failure, code};
use crate::spec::{SpecArgs, SpecSource};

/// How long a run made by `sandbox start` lives unless told otherwise: it belongs to no
/// process, so only its TTL lets `sandbox gc` remove it once forgotten.
const START_DEFAULT_TTL: Duration = Duration::from_secs(24 * 3600);

#[derive(Parser)]
#[command(
    name = "sandbox",
    version,
    about = "Runs commands in a long-lived sandbox (a Docker container or a Kubernetes pod) per run",
    after_help = EXIT_CODES_HELP
)]
struct Cli {
    #[command(flatten)]
    global: Global,
    #[command(subcommand)]
    command: Command,
}

#[derive(Args)]
struct Global {
    /// The driver: docker (the default), k8s, or another registered one (`sandbox
    /// drivers`).
    #[arg(long = "driver", global = true, env = DRIVER_ENV, value_name = "DRIVER")]
    driver_given: Option<String>,
    /// The driver in use: `driver_given`, else the deprecated variable, else docker.
    #[arg(skip)]
    driver: String,
    /// A driver config key (`host`, `namespace`, ...): KEY=VALUE. Repeatable. Wins over
    /// --config-file, which wins over RUNCELL_<DRIVER>_<KEY> variables.
    #[arg(long = "config", global = true, value_name = "KEY=VALUE")]
    config: Vec<String>,
    /// A config file (.toml, .yaml, .json) with a table per driver: [docker] host = "...".
    #[arg(long, global = true, env = CONFIG_FILE_ENV, value_name = "FILE")]
    config_file: Option<PathBuf>,
    /// More log output on stderr (-v: the library's steps; -vv: everything). RUST_LOG,
    /// when set, decides instead.
    #[arg(short, long, global = true, action = ArgAction::Count)]
    verbose: u8,
    /// No progress output.
    #[arg(short, long, global = true)]
    quiet: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Start a run that outlives this command and print its id. It has a TTL (default
    /// 24h) after which `sandbox gc` removes it; `sandbox stop` removes it at once.
    Start {
        #[command(flatten)]
        spec: SpecArgs,
    },
    /// Run a command in a run, streaming its output; stdin is forwarded when it is not a
    /// terminal. Exits with the command's exit code. With -d, start it detached and print
    /// its exec id (for `logs`, `wait`, `kill`, `ps`, `rm-exec`).
    #[command(after_help = EXIT_CODES_HELP)]
    Exec(ExecArgs),
    /// Print an exec's output kept so far (stdout to stdout, stderr to stderr), from
    /// --from on; with -f follow it until the command ends and exit with its exit code.
    /// An exec has one reader: one that another stream reads (its `sandbox exec`, a
    /// `logs -f`) is refused. Without -f, only a detached exec (`exec -d`) or one that has
    /// ended: reading a running non-detached exec makes this process its reader, and
    /// stopping early would kill it (use -f for those).
    #[command(after_help = EXIT_CODES_HELP)]
    Logs(execs::LogsArgs),
    /// Wait until an exec ends and exit with its exit code (as `sandbox exec`). It only
    /// reads the run's exec records, so the exec's reader (if any) keeps it, and Ctrl-C
    /// leaves it running.
    #[command(after_help = EXIT_CODES_HELP)]
    Wait(execs::ExecRef),
    /// Kill an exec's processes (its whole process tree, TERM then KILL). Its record
    /// stays, with its status, until `rm-exec`; an exec that already ended is fine.
    Kill(execs::ExecRef),
    /// List a run's execs (running, and ended ones not released): ID, PID, STATE,
    /// DETACHED, ATTACHED (a stream reads it now), OUTPUT (bytes so far: the offset to
    /// `logs --from`), STARTED, COMMAND.
    Ps(execs::PsArgs),
    /// Forget ended execs' records (their kept output and status); a detached exec's
    /// record otherwise stays until the run stops. Prints each id.
    RmExec(execs::RmArgs),
    /// A shell on a terminal in a run: `sandbox exec -it RUN -- sh`.
    #[command(after_help = EXIT_CODES_HELP)]
    Shell {
        /// The run id.
        run: String,
    },
    /// Start a run, run one command in it, stop it. Ctrl-C stops the run too.
    #[command(after_help = EXIT_CODES_HELP)]
    Run {
        #[command(flatten)]
        spec: SpecArgs,
        #[command(flatten)]
        exec: RunExecArgs,
    },
    /// Stop (remove) runs, at once, with everything made for them.
    Stop {
        /// Run ids.
        #[arg(required = true, value_name = "RUN")]
        runs: Vec<String>,
    },
    /// List runs (those still running; --all for every one).
    Ls {
        /// Also runs whose target is no longer running.
        #[arg(short, long)]
        all: bool,
        /// Only runs with this label: KEY=VALUE. Repeatable.
        #[arg(short, long = "label", value_name = "KEY=VALUE")]
        label: Vec<String>,
        /// JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Remove runs nobody can use any more: TTL passed, owner process gone, or no longer
    /// running. Runs of live owners, of other hosts and detached runs within their TTL stay.
    Gc {
        /// Only list what would be removed.
        #[arg(long)]
        dry_run: bool,
        /// Only runs with this label: KEY=VALUE. Repeatable.
        #[arg(short, long = "label", value_name = "KEY=VALUE")]
        label: Vec<String>,
    },
    /// Copy a file or directory between the host and a run: `sandbox cp ./src RUN:/workspace/`
    /// or `sandbox cp RUN:/workspace/out ./out`. Into DST when it is a directory.
    Cp {
        /// A host path or RUN:/path.
        src: String,
        /// A host path or RUN:/path.
        dst: String,
    },
    /// Save a run's filesystem and workspace as a snapshot (its env, proxy, CA and labels
    /// are not in it) and print its id. The run keeps running. It has a TTL (default 7d)
    /// after which `sandbox gc` removes it.
    Snapshot(snapshots::SnapshotArgs),
    /// List snapshots: ID, NAME, SOURCE (the run), SIZE, CREATED, EXPIRES.
    Snapshots {
        /// JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Start N runs from a snapshot at once (all or none) and print their ids, as
    /// `sandbox start --from-snapshot SNAPSHOT` would each.
    Fork {
        /// The snapshot id.
        snapshot: String,
        /// How many runs.
        #[arg(short = 'n', long, default_value_t = 2)]
        count: usize,
        #[command(flatten)]
        spec: SpecArgs,
    },
    /// Remove snapshots (refused while a run started from one still exists).
    RmSnapshot {
        /// Snapshot ids.
        #[arg(required = true, value_name = "SNAPSHOT")]
        snapshots: Vec<String>,
    },
    /// Push a snapshot to a registry repository (`host[:port]/path`) as `REPOSITORY:ID`, for
    /// `sandbox pull-snapshot` on another machine (or a Kubernetes driver whose snapshot
    /// registry it is), and print that reference. Logins: the Docker CLI's config.json.
    PushSnapshot {
        /// The snapshot id.
        snapshot: String,
        /// host[:port]/path
        repository: String,
    },
    /// Pull a snapshot `sandbox push-snapshot` pushed (`host[:port]/path:ID`), make it one
    /// of this driver's snapshots, and print its id.
    PullSnapshot {
        /// host[:port]/path:snap-...
        reference: String,
    },
    /// List the registered drivers.
    Drivers,
    /// The run's mux (started by `exec`; its settings on stdin).
    #[command(name = "__mux", hide = true)]
    Mux,
}

#[derive(Args)]
struct ExecArgs {
    /// The run id.
    run: String,
    /// Extra environment: NAME=VALUE, or NAME to pass this shell's value. Repeatable.
    #[arg(short, long = "env", value_name = "NAME[=VALUE]")]
    env: Vec<String>,
    /// Working directory (default: the run's).
    #[arg(short = 'w', long, value_name = "DIR")]
    workdir: Option<String>,
    /// User: uid, uid:gid, or a name where the driver allows.
    #[arg(short, long)]
    user: Option<String>,
    /// Start the command detached, print its exec id and exit 0 at once (as `docker exec
    /// -d`): it runs on until it ends, `sandbox kill`, or the run stops; `sandbox logs`,
    /// `wait` and `ps` reach it. It gets no stdin; with -t, a terminal of this one's size.
    /// Needs the run's exec helper.
    #[arg(short = 'd', long)]
    detach: bool,
    /// How long the command runs on when this process's connection to it breaks (this
    /// process killed, the engine restarted): within it, `sandbox logs -f` picks it up;
    /// past it, it is killed. 0: killed with the connection. Default 10m, at most 24h.
    #[arg(long, value_name = "DURATION", value_parser = units::parse_duration)]
    grace: Option<Duration>,
    /// Output bytes (stdout and stderr together) the run keeps of the command for
    /// `sandbox logs`; older ones are dropped while nobody reads. 64k to 256m; default 4m.
    #[arg(long, value_name = "SIZE", value_parser = units::parse_size)]
    output_buffer: Option<u64>,
    #[command(flatten)]
    common: RunExecArgs,
}

#[derive(Args)]
struct RunExecArgs {
    /// Kill the command after this long: 90, 30s, 10m, 1h (exit code 124).
    #[arg(long, value_name = "DURATION", value_parser = units::parse_duration)]
    timeout: Option<Duration>,
    /// Do not forward stdin (the command reads EOF).
    #[arg(short = 'n', long, conflicts_with = "interactive")]
    no_stdin: bool,
    /// Forward stdin even when it is a terminal (with -t, in raw mode: every key goes to
    /// the command; restored on exit).
    #[arg(short = 'i', long)]
    interactive: bool,
    /// Run the command on a terminal in the run, sized as this one and resized with it
    /// (as `docker exec -t`); its output is one stream.
    #[arg(short = 't', long)]
    tty: bool,
    /// The command and its arguments, after `--`. Never run through a shell: use
    /// `-- sh -c '...'` for shell syntax.
    #[arg(last = true, required = true, value_name = "ARGV")]
    argv: Vec<String>,
}

/// The variable `--driver` defaults to.
const DRIVER_ENV: &str = "RUNCELL_DRIVER";
/// The variable `--config-file` defaults to.
const CONFIG_FILE_ENV: &str = "RUNCELL_CONFIG_FILE";
/// The driver without `--driver` or [`DRIVER_ENV`].
const DEFAULT_DRIVER: &str = "docker";

impl Global {
    /// Fills in what neither the command line nor a `RUNCELL_` variable gave (clap read
    /// those): the deprecated `SANDBOX_` variables, read with `var`
    /// ([`runcell_core::envvar::var_os`], which warns), then the defaults.
    fn resolve(&mut self, var: impl Fn(&str) -> Option<std::ffi::OsString>) {
        self.driver = self
            .driver_given
            .clone()
            .or_else(|| var(DRIVER_ENV).and_then(|d| d.into_string().ok()))
            .filter(|d| !d.is_empty())
            .unwrap_or_else(|| DEFAULT_DRIVER.to_string());
        if self.config_file.is_none() {
            self.config_file = var(CONFIG_FILE_ENV)
                .filter(|f| !f.is_empty())
                .map(PathBuf::from);
        }
    }
}

fn main() {
    let mut cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let exit = if e.use_stderr() { code::FAILED } else { 0 };
            let _ = e.print();
            std::process::exit(exit);
        }
    };
    init_tracing(cli.global.verbose);
    // After the tracing set-up, so that a deprecated variable's warning is shown.
    cli.global.resolve(runcell_core::envvar::var_os);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("sandbox: error: cannot start the async runtime: {e}");
            std::process::exit(code::FAILED);
        }
    };
    let driver = cli.global.driver.clone();
    let exit = runtime.block_on(async move {
        match run(cli).await {
            Ok(code) => code,
            Err(failure) => {
                errors::report(&failure, &driver);
                failure.code()
            }
        }
    });
    let _ = std::io::stdout().flush();
    // Not dropping the runtime: a blocking read of stdin may still be pending.
    std::process::exit(exit);
}

fn init_tracing(verbose: u8) {
    use tracing_subscriber::EnvFilter;
    let filter = match std::env::var("RUST_LOG") {
        Ok(f) if !f.is_empty() => EnvFilter::new(f),
        _ => EnvFilter::new(match verbose {
            0 => "warn",
            1 => "warn,runcell_core=debug,runcell_docker=debug,runcell_k8s=debug,runcell_cli=debug",
            _ => "debug",
        }),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    if verbose == 0 && std::env::var_os("RUST_LOG").is_none() {
        builder.without_time().with_target(false).init();
    } else {
        builder.init();
    }
}

async fn connect(global: &Global) -> Result<Arc<dyn Driver>, Failure> {
    let config = config::driver_config(
        &global.driver,
        &global.config,
        global.config_file.as_deref(),
    )?;
    Ok(runcell_core::connect(&global.driver, config).await?)
}

/// The socket of the run's mux for these settings, unless `RUNCELL_MUX` is `off`.
fn mux_socket(global: &Global, run: &str) -> Option<PathBuf> {
    if mux::mode() == mux::Mode::Off {
        return None;
    }
    mux::socket_path(
        &global.driver,
        &global.config,
        global.config_file.as_deref(),
        run,
    )
}

/// The launch settings of the run's mux.
fn mux_launch(global: &Global, run: &str, socket: PathBuf) -> mux::Launch {
    mux::Launch {
        driver: global.driver.clone(),
        config: global.config.clone(),
        config_file: global.config_file.clone(),
        run: run.to_string(),
        socket,
    }
}

/// A connection to the run's mux, when one serves it (with `RUNCELL_MUX=require`, one is
/// started and awaited; an error if none can be had).
async fn through_mux(global: &Global, run: &str) -> Result<Option<mux::Client>, Failure> {
    let require = mux::mode() == mux::Mode::Require;
    let Some(socket) = mux_socket(global, run) else {
        return if require {
            Err(Failure::usage(
                "RUNCELL_MUX=require, but no private directory for the mux's socket can be had",
            ))
        } else {
            Ok(None)
        };
    };
    let usable = |c: &mux::Client| c.stdin_streaming();
    if let Some(c) = mux::connect(&socket).await.filter(usable) {
        return Ok(Some(c));
    }
    if !require {
        return Ok(None);
    }
    mux::spawn(&mux_launch(global, run, socket.clone()));
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        if let Some(c) = mux::connect(&socket).await.filter(usable) {
            return Ok(Some(c));
        }
    }
    Err(Failure::usage(format!(
        "RUNCELL_MUX=require, but no mux for run {run} answered within 20s (its log: {})",
        socket.with_extension("log").display()
    )))
}

/// Starts the run's mux in the background for the next `exec` (unless `RUNCELL_MUX` is
/// `off`).
fn start_mux(global: &Global, run: &str) {
    if let Some(socket) = mux_socket(global, run) {
        mux::spawn(&mux_launch(global, run, socket));
    }
}

/// Has the run's mux (if any) exit.
async fn quit_mux(global: &Global, run: &str) {
    if let Some(socket) = mux::socket_path(
        &global.driver,
        &global.config,
        global.config_file.as_deref(),
        run,
    ) {
        mux::quit(&socket).await;
    }
}

/// A create error about a spec field, placed in the spec file where it sets the field.
fn placed(error: runcell_core::Error, source: &Option<SpecSource>) -> Failure {
    match source {
        Some(source) => Failure::spec(error, source),
        None => error.into(),
    }
}

fn exec_spec(args: &RunExecArgs) -> ExecSpec {
    let mut spec = ExecSpec::new(args.argv.iter().cloned());
    spec.timeout = args.timeout;
    spec
}

async fn run(cli: Cli) -> Result<i32, Failure> {
    let g = &cli.global;
    match &cli.command {
        Command::Mux => Ok(mux::serve(async |launch: &mux::Launch| {
            let global = Global {
                driver_given: Some(launch.driver.clone()),
                driver: launch.driver.clone(),
                config: launch.config.clone(),
                config_file: launch.config_file.clone(),
                verbose: 0,
                quiet: true,
            };
            let driver = connect(&global).await?;
            let streaming = driver.capabilities().stdin_streaming;
            Ok((driver.attach(&launch.run).await?, streaming))
        })
        .await),
        Command::Drivers => {
            for d in runcell_core::drivers()? {
                println!("{:<10} {}", d.name, d.description);
            }
            Ok(0)
        }
        Command::Snapshot(args) => snapshots::snapshot(&*connect(g).await?, args, g.quiet).await,
        Command::Snapshots { json } => snapshots::list(&*connect(g).await?, *json).await,
        Command::RmSnapshot { snapshots } => {
            snapshots::remove(&*connect(g).await?, snapshots).await
        }
        Command::PushSnapshot {
            snapshot,
            repository,
        } => {
            let driver = connect(g).await?;
            if !g.quiet {
                eprintln!("pushing {snapshot} to {repository}");
            }
            println!("{}", driver.push_snapshot(snapshot, repository).await?);
            Ok(0)
        }
        Command::PullSnapshot { reference } => {
            let driver = connect(g).await?;
            if !g.quiet {
                eprintln!("pulling {reference}");
            }
            println!("{}", driver.pull_snapshot(reference).await?.id);
            Ok(0)
        }
        Command::Fork {
            snapshot,
            count,
            spec,
        } => {
            if spec.from_snapshot.is_some() {
                return Err(Failure::usage("fork takes the snapshot as its argument"));
            }
            let mut args = spec.clone();
            args.from_snapshot = Some(snapshot.clone());
            let (spec, source) = spec::build(&args, Some(START_DEFAULT_TTL))?;
            let driver = connect(g).await?;
            let spec = snapshots::resolve(&*driver, spec, &args)
                .await
                .map_err(|e| placed(e, &source))?;
            snapshots::fork(&*driver, &spec, *count, g.quiet).await
        }
        Command::Start { spec: args } => {
            // The spec first: a bad one is reported before anything is contacted.
            let (spec, source) = spec::build(args, Some(START_DEFAULT_TTL))?;
            let driver = connect(g).await?;
            let spec = snapshots::resolve(&*driver, spec, args)
                .await
                .map_err(|e| placed(e, &source))?;
            let view = progress::View::new(g.quiet);
            let created = create(&*driver, spec, view.options().detached(true)).await?;
            view.finish();
            let run = match created {
                Created::Run(run) => run,
                Created::Interrupted(code) => return Ok(code),
                Created::Failed(e) => return Err(placed(e, &source)),
            };
            println!("{}", run.id());
            Ok(0)
        }
        Command::Exec(args) => {
            if args.detach {
                execs::check_detach(args.common.interactive, args.common.timeout, args.grace)?;
            }
            let mut spec = exec_spec(&args.common);
            for e in &args.env {
                spec.env.push(spec::env_pair(e)?);
            }
            spec.working_dir = args.workdir.clone();
            spec.user = args.user.clone();
            spec.grace = args.grace;
            spec.output_buffer = args.output_buffer;
            let options = exec::Options {
                forward_stdin: !args.common.no_stdin,
                interactive: args.common.interactive,
                tty: args.common.tty,
                interruptible: true,
            };
            if !args.detach
                && let Some(client) = through_mux(g, &args.run).await?
            {
                return exec::stream(exec::Target::Mux(client), spec, options).await;
            }
            let driver = connect(g).await?;
            let run = driver.attach(&args.run).await?;
            if args.detach {
                return execs::start_detached(&*run, spec, args.common.tty).await;
            }
            let target = exec::Target::Run {
                run: &*run,
                capabilities: &driver.capabilities(),
            };
            let code = exec::stream(target, spec, options).await;
            // After the command, so that its run saw nothing of the mux meanwhile.
            start_mux(g, &args.run);
            code
        }
        Command::Logs(args) => {
            let run = connect(g).await?.attach(&args.exec.run).await?;
            execs::logs(&*run, args).await
        }
        Command::Wait(args) => {
            let run = connect(g).await?.attach(&args.run).await?;
            execs::wait(&*run, args.exec).await
        }
        Command::Kill(args) => {
            let run = connect(g).await?.attach(&args.run).await?;
            execs::kill(&*run, args.exec).await
        }
        Command::Ps(args) => {
            let run = connect(g).await?.attach(&args.run).await?;
            execs::ps(&*run, args).await
        }
        Command::RmExec(args) => {
            let run = connect(g).await?.attach(&args.run).await?;
            execs::remove(&*run, args).await
        }
        Command::Shell { run } => {
            let options = exec::Options {
                forward_stdin: true,
                interactive: true,
                tty: true,
                interruptible: true,
            };
            let spec = runcell_core::ExecSpec::new(["sh"]);
            if let Some(client) = through_mux(g, run).await? {
                return exec::stream(exec::Target::Mux(client), spec, options).await;
            }
            let driver = connect(g).await?;
            let run_id = run;
            let run = driver.attach(run_id).await?;
            let target = exec::Target::Run {
                run: &*run,
                capabilities: &driver.capabilities(),
            };
            let code = exec::stream(target, spec, options).await;
            start_mux(g, run_id);
            code
        }
        Command::Run {
            spec: spec_args,
            exec: args,
        } => {
            let (spec, source) = spec::build(spec_args, None)?;
            let driver = connect(g).await?;
            let spec = snapshots::resolve(&*driver, spec, spec_args)
                .await
                .map_err(|e| placed(e, &source))?;
            let view = progress::View::new(g.quiet);
            let created = create(&*driver, spec, view.options()).await?;
            view.finish();
            let run = match created {
                Created::Run(run) => RunGuard::new(run),
                Created::Interrupted(code) => return Ok(code),
                Created::Failed(e) => return Err(placed(e, &source)),
            };
            // From here Ctrl-C or SIGTERM stops the guarded run, then exits 130/143.
            handle_signals()?;
            let options = exec::Options {
                forward_stdin: !args.no_stdin,
                interactive: args.interactive,
                tty: args.tty,
                interruptible: false,
            };
            let target = exec::Target::Run {
                run: &*run,
                capabilities: &driver.capabilities(),
            };
            let result = exec::stream(target, exec_spec(args), options).await;
            // The stop below ended the command? Then the signal handler is stopping the
            // run: let it finish and exit.
            yield_to_signal_handler().await;
            let stopped = run.stop().await;
            let exit = result?;
            stopped?;
            Ok(exit)
        }
        Command::Stop { runs } => {
            let driver = connect(g).await?;
            for id in runs {
                // Only runs the library manages: `remove` alone would take any container
                // of that name.
                let selector = BTreeMap::from([(labels::RUN_ID.to_string(), id.clone())]);
                if driver.list(&selector).await?.is_empty() {
                    eprintln!("sandbox: {id}: no such run (already stopped?)");
                    continue;
                }
                quit_mux(g, id).await;
                driver.remove(id).await?;
                println!("{id}");
            }
            Ok(0)
        }
        Command::Ls { all, label, json } => {
            let driver = connect(g).await?;
            let mut runs = driver.list(&selector(label)?).await?;
            if !all {
                runs.retain(|r| r.running);
            }
            runs.sort_by(|a, b| a.id.cmp(&b.id));
            if *json {
                let rows: Vec<serde_json::Value> = runs.iter().map(json_row).collect();
                println!(
                    "{}",
                    serde_json::to_string_pretty(&rows).unwrap_or_else(|_| "[]".into())
                );
            } else {
                print_table(&runs);
            }
            Ok(0)
        }
        Command::Gc { dry_run, label } => {
            let driver = connect(g).await?;
            let selector = selector(label)?;
            let mut any = false;
            if *dry_run {
                let now = now_secs();
                for run in driver.list(&selector).await? {
                    if let Some(reason) = ReapReason::of(&run, now) {
                        println!("would remove {} ({})", run.id, describe(&reason));
                        any = true;
                    }
                }
            } else {
                for (id, reason) in runcell_core::reap(&*driver, &selector).await? {
                    quit_mux(g, &id).await;
                    println!("removed {id} ({})", describe(&reason));
                    any = true;
                }
            }
            if !any {
                eprintln!("nothing to remove");
            }
            Ok(0)
        }
        Command::Cp { src, dst } => {
            let (src, dst) = (Place::parse(src), Place::parse(dst));
            match (src, dst) {
                (Place::Host(from), Place::Run { run, path }) => {
                    let driver = connect(g).await?;
                    let run = driver.attach(&run).await?;
                    let to = cp::copy_in(&*run, &from, &path).await?;
                    tracing::info!("copied {} to {}:{to}", from.display(), run.id());
                    Ok(0)
                }
                (Place::Run { run, path }, Place::Host(to)) => {
                    let driver = connect(g).await?;
                    let run = driver.attach(&run).await?;
                    let to = cp::copy_out(&*run, &path, &to).await?;
                    tracing::info!("copied {}:{path} to {}", run.id(), to.display());
                    Ok(0)
                }
                (Place::Run { .. }, Place::Run { .. }) => Err(Failure::usage(
                    "both sides are in runs: copy to the host and back",
                )),
                (Place::Host(_), Place::Host(_)) => Err(Failure::usage(
                    "one side must be in a run: RUN:/absolute/path",
                )),
            }
        }
    }
}

/// A label on every run this command line creates, unique to the invocation: after an
/// interrupted create, what a request still in flight made is found by it and removed.
const CREATE_LABEL: &str = "sandbox.cli/create";

/// How long an interrupted create looks for what a request in flight may still make.
const CREATE_SWEEP: Duration = Duration::from_secs(2);

enum Created {
    Run(Box<dyn runcell_core::Run>),
    /// SIGINT/SIGTERM arrived during the create; nothing is left. The exit code.
    Interrupted(i32),
    Failed(runcell_core::Error),
}

/// Creates a run; SIGINT or SIGTERM meanwhile cancels the create (its guard removes
/// what it made) and then removes, for a moment longer, whatever carries this
/// invocation's label (a create request already at the engine finishes after the
/// cancel).
async fn create(
    driver: &dyn Driver,
    mut spec: runcell_core::RunSpec,
    options: CreateOptions,
) -> Result<Created, Failure> {
    let token = format!("{:x}-{}", now_nanos(), std::process::id());
    spec.labels.insert(CREATE_LABEL.into(), token.clone());
    let mut signals = exec::Signals::new()?;
    let code = tokio::select! {
        created = driver.create_with(&spec, options) => {
            return Ok(match created {
                Ok(run) => Created::Run(run),
                Err(e) => Created::Failed(e),
            });
        }
        code = signals.recv() => code,
    };
    // The create future is dropped: its guard has removed what it knew of.
    eprintln!("sandbox: interrupted: removing what the create made");
    let selector = BTreeMap::from([(CREATE_LABEL.to_string(), token)]);
    let start = std::time::Instant::now();
    loop {
        if let Ok(runs) = driver.list(&selector).await {
            for run in runs {
                if let Err(e) = driver.remove(&run.id).await {
                    eprintln!("sandbox: could not remove {}: {e}", run.id);
                }
            }
        }
        if start.elapsed() >= CREATE_SWEEP {
            return Ok(Created::Interrupted(code));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn now_nanos() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

/// Set once SIGINT or SIGTERM arrived.
static SIGNALED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// On SIGINT/SIGTERM, `runcell_core::stop_runs_on_signal` stops every guarded run (and
/// removes every run being created), then exits 130/143. The command's own flow must not
/// exit first (that would cut the removal short): it checks [`yield_to_signal_handler`].
fn handle_signals() -> Result<(), Failure> {
    use tokio::signal::unix::{SignalKind, signal};
    let err = |e: std::io::Error| Failure::usage(format!("cannot handle signals: {e}"));
    let mut int = signal(SignalKind::interrupt()).map_err(err)?;
    let mut term = signal(SignalKind::terminate()).map_err(err)?;
    tokio::spawn(async move {
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
        SIGNALED.store(true, std::sync::atomic::Ordering::SeqCst);
    });
    runcell_core::stop_runs_on_signal()?;
    Ok(())
}

/// Never returns once a signal arrived: the handler stops the runs and exits.
async fn yield_to_signal_handler() {
    // Both handlers wake on the same signal; give ours a moment to record it.
    tokio::task::yield_now().await;
    if SIGNALED.load(std::sync::atomic::Ordering::SeqCst) {
        std::future::pending::<()>().await;
    }
}

fn selector(pairs: &[String]) -> Result<BTreeMap<String, String>, Failure> {
    pairs
        .iter()
        .map(|kv| spec::key_value(kv).map_err(|e| Failure::usage(format!("--label: {e}"))))
        .collect()
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn describe(reason: &ReapReason) -> &'static str {
    match reason {
        ReapReason::Expired => "its TTL passed",
        ReapReason::OwnerGone => "its owner process is gone",
        ReapReason::NotRunning => "no longer running",
        _ => "unusable",
    }
}

fn owner_text(run: &RunInfo) -> String {
    match Owner::from_labels(&run.labels) {
        None => "detached".into(),
        Some(o) => {
            let state = match o.is_alive() {
                Some(true) => "",
                Some(false) => " (gone)",
                None => " (?)",
            };
            format!("pid {}@{}{state}", o.pid, o.host)
        }
    }
}

fn expires_text(run: &RunInfo, now: u64) -> String {
    match run
        .labels
        .get(labels::EXPIRES_AT)
        .and_then(|v| v.parse::<u64>().ok())
    {
        None => "-".into(),
        Some(u64::MAX) => "never".into(),
        Some(at) if at <= now => "expired".into(),
        Some(at) => format!(
            "in {}",
            units::human_duration(Duration::from_secs(at - now))
        ),
    }
}

fn user_labels(run: &RunInfo) -> String {
    run.labels
        .iter()
        .filter(|(k, _)| !k.starts_with(labels::PREFIX) && k.as_str() != CREATE_LABEL)
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

fn print_table(runs: &[RunInfo]) {
    let now = now_secs();
    let mut rows = vec![[
        "RUN".to_string(),
        "STATE".into(),
        "OWNER".into(),
        "EXPIRES".into(),
        "LABELS".into(),
    ]];
    for run in runs {
        rows.push([
            run.id.clone(),
            if run.running { "running" } else { "exited" }.into(),
            owner_text(run),
            expires_text(run, now),
            user_labels(run),
        ]);
    }
    let mut widths = [0usize; 5];
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    for row in rows {
        let line = row
            .iter()
            .zip(widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect::<Vec<_>>()
            .join("  ");
        println!("{}", line.trim_end());
    }
}

fn json_row(run: &RunInfo) -> serde_json::Value {
    let owner = Owner::from_labels(&run.labels)
        .map(|o| serde_json::json!({ "host": o.host, "pid": o.pid, "alive": o.is_alive() }));
    let expires_at = run
        .labels
        .get(labels::EXPIRES_AT)
        .and_then(|v| v.parse::<u64>().ok());
    serde_json::json!({
        "id": run.id,
        "running": run.running,
        "owner": owner,
        "expires_at": expires_at,
        "labels": run.labels,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(labels: &[(&str, &str)], running: bool) -> RunInfo {
        RunInfo {
            id: "sbx-1".into(),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            running,
        }
    }

    #[test]
    fn dry_run_decides_as_reap_does() {
        let now = 1000;
        let me = Owner::current();
        let (pid, start) = (me.pid.to_string(), me.start.to_string());
        let live = [
            (labels::OWNER_HOST, me.host.as_str()),
            (labels::OWNER_PID, pid.as_str()),
            (labels::OWNER_START, start.as_str()),
        ];
        assert_eq!(ReapReason::of(&info(&live, true), now), None);
        assert_eq!(
            ReapReason::of(&info(&live, false), now),
            Some(ReapReason::NotRunning)
        );
        let dead = [
            (labels::OWNER_HOST, me.host.as_str()),
            (labels::OWNER_PID, "4294967294"),
            (labels::OWNER_START, "1"),
        ];
        assert_eq!(
            ReapReason::of(&info(&dead, true), now),
            Some(ReapReason::OwnerGone)
        );
        assert_eq!(
            ReapReason::of(&info(&[(labels::EXPIRES_AT, "999")], true), now),
            Some(ReapReason::Expired)
        );
        // Detached, within its TTL: kept.
        assert_eq!(
            ReapReason::of(&info(&[(labels::EXPIRES_AT, "1001")], true), now),
            None
        );
        assert_eq!(owner_text(&info(&[], true)), "detached");
        assert_eq!(
            expires_text(&info(&[(labels::EXPIRES_AT, "1060")], true), now),
            "in 1m00s"
        );
    }

    #[test]
    fn the_command_line_parses() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from([
            "sandbox",
            "exec",
            "sbx-1",
            "--env",
            "A=1",
            "--timeout",
            "5s",
            "--",
            "sh",
            "-c",
            "exit 3",
        ])
        .unwrap();
        let Command::Exec(args) = cli.command else {
            panic!("not exec")
        };
        assert_eq!(args.common.argv, ["sh", "-c", "exit 3"]);
        assert_eq!(args.common.timeout, Some(Duration::from_secs(5)));
    }

    #[test]
    fn driver_and_config_file_come_from_flags_then_the_environment_then_defaults() {
        use std::ffi::OsString;
        let unset = |_: &str| None;
        let deprecated = |name: &str| match name {
            DRIVER_ENV => Some(OsString::from("k8s")),
            CONFIG_FILE_ENV => Some(OsString::from("/etc/runcell.toml")),
            _ => None,
        };
        let flags = [
            "sandbox",
            "ls",
            "--driver",
            "my-driver",
            "--config-file",
            "/x.toml",
        ];
        let mut cli = Cli::try_parse_from(flags).unwrap();
        cli.global.resolve(deprecated);
        assert_eq!(cli.global.driver, "my-driver");
        assert_eq!(cli.global.config_file, Some(PathBuf::from("/x.toml")));

        // Without flags (and, in these tests, whatever clap read from RUNCELL_*
        // replaced by what the lookup gives): the lookup, then the defaults.
        let mut cli = Cli::try_parse_from(["sandbox", "ls"]).unwrap();
        cli.global.driver_given = None;
        cli.global.config_file = None;
        cli.global.resolve(deprecated);
        assert_eq!(cli.global.driver, "k8s");
        assert_eq!(
            cli.global.config_file,
            Some(PathBuf::from("/etc/runcell.toml"))
        );
        let mut cli = Cli::try_parse_from(["sandbox", "ls"]).unwrap();
        cli.global.driver_given = None;
        cli.global.config_file = None;
        cli.global.resolve(unset);
        assert_eq!(cli.global.driver, DEFAULT_DRIVER);
        assert_eq!(cli.global.config_file, None);
    }
}
