//! Durable execs from the command line: `exec -d`, `logs`, `wait`, `kill`, `ps` and
//! `rm-exec`, over the run's exec records (`Run::execs`, `Run::reattach`, ...), which
//! the exec helper keeps; on the plain exec path they are `Unsupported`.
//!
//! One rule shapes them: an exec has at most one *reader* (the stream attached to it),
//! and a reattach takes the exec over from the reader it had, whose stream then ends
//! (and a non-detached exec's reader kills the command when its stream ends that way).
//! So nothing here attaches to an exec another stream reads: `wait` and `ps` only read
//! the records, and `logs` refuses an exec that is being read.

use std::io::{IsTerminal, Write as _};
use std::time::{Duration, SystemTime};

use clap::Args;
use runcell_core::{Error, ErrorKind, ExecId, ExecInfo, ExecSpec, ExitStatus, OutputChunk, Run};
use tokio::io::AsyncWriteExt;

use crate::errors::Failure;
use crate::{exec, units};

/// How long an exec that another stream reads is given to let go (the stream of a
/// `sandbox exec -d` that just exited, a reader taking its last bytes) before it counts
/// as being read.
const LET_GO: Duration = Duration::from_secs(2);
/// How long `logs` waits for the next chunk of output the record already has.
const STALL: Duration = Duration::from_secs(30);
/// `wait` reads the records this often at most (it starts faster).
const WAIT_POLL_MAX: Duration = Duration::from_millis(500);
/// `wait` gives up after this many failed reads of the records in a row.
const WAIT_FAILURES: u32 = 5;
/// How long `rm-exec --force` waits for a killed exec to end.
const KILL_WAIT: Duration = Duration::from_secs(15);
/// The width of the COMMAND column of `ps` when stdout is not a terminal.
const COMMAND_WIDTH: usize = 60;

/// A run and one of its execs.
#[derive(Args)]
pub struct ExecRef {
    /// The run id.
    pub run: String,
    /// The exec id, as `sandbox exec -d` printed it (`sandbox ps RUN` lists them).
    #[arg(value_name = "EXEC", value_parser = parse_exec_id)]
    pub exec: ExecId,
}

#[derive(Args)]
pub struct LogsArgs {
    #[command(flatten)]
    pub exec: ExecRef,
    /// Follow the output until the command ends, then exit with its exit code (as `sandbox
    /// exec`). Ctrl-C stops following: a detached command runs on; a command started
    /// without -d then runs on for its grace (--grace of `sandbox exec`) and is killed
    /// unless it is followed again.
    #[arg(short, long)]
    pub follow: bool,
    /// Start at this output offset (bytes of stdout and stderr together, from 0; `sandbox
    /// ps` shows where the output is now).
    #[arg(long, value_name = "OFFSET", default_value_t = 0)]
    pub from: u64,
}

#[derive(Args)]
pub struct PsArgs {
    /// The run id.
    pub run: String,
    /// JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Show the whole command, however long.
    #[arg(long)]
    pub no_trunc: bool,
}

#[derive(Args)]
pub struct RmArgs {
    /// The run id.
    pub run: String,
    /// Exec ids.
    #[arg(required = true, value_name = "EXEC", value_parser = parse_exec_id)]
    pub execs: Vec<ExecId>,
    /// Kill an exec that still runs first.
    #[arg(short, long)]
    pub force: bool,
}

fn parse_exec_id(text: &str) -> Result<ExecId, String> {
    text.parse().map_err(|_| {
        format!("{text:?} is not an exec id (a number from 1; `sandbox ps RUN` lists them)")
    })
}

/// What `exec -d` refuses, with the reason (clap would only say that two flags conflict).
pub fn check_detach(
    interactive: bool,
    timeout: Option<Duration>,
    grace: Option<Duration>,
) -> Result<(), Failure> {
    if interactive {
        return Err(Failure::usage(
            "--detach with --interactive: a detached command gets no stdin (this process \
             exits at once); feed it a file instead (`sandbox cp`, then `-- sh -c 'cmd < file'`)",
        ));
    }
    if timeout.is_some() {
        return Err(Failure::usage(
            "--detach with --timeout: a detached command outlives this process, which could \
             not enforce it; run it under `timeout` (`-- timeout 60 CMD...`) or end it with \
             `sandbox kill RUN EXEC`",
        ));
    }
    if grace.is_some() {
        return Err(Failure::usage(
            "--detach with --grace: a detached command has no grace, it runs on until it \
             ends, `sandbox kill RUN EXEC`, or the run stops",
        ));
    }
    Ok(())
}

/// `exec -d`: starts `spec` detached (no stdin) and prints its id.
pub async fn start_detached(run: &dyn Run, spec: ExecSpec, tty: bool) -> Result<i32, Failure> {
    let mut spec = spec.detach();
    if tty {
        let (rows, cols) = crate::tty::size().unwrap_or((24, 80));
        spec = spec.tty(rows, cols);
    }
    let stream = run.exec_stream(spec).await?;
    let Some(id) = stream.exec_id() else {
        // The library refuses `detach` where execs have no records; never seen.
        return Err(Failure::usage(
            "the run started the command without giving it an exec id",
        ));
    };
    // Dropping the stream of a detached exec lets go of it; it runs on.
    drop(stream);
    println!("{id}");
    let _ = std::io::stdout().flush();
    // Wait until the helper saw this process let go, so that a `logs -f` or `ps` right
    // after finds the exec unread (the exit would also do it, a moment later).
    let start = std::time::Instant::now();
    while start.elapsed() < LET_GO {
        match run.execs().await {
            Ok(list) if list.iter().any(|e| e.id == id && e.attached) => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            _ => break,
        }
    }
    Ok(0)
}

/// [`ErrorKind::NotFound`] naming `exec_id`, as the library says it.
fn no_such_exec(run: &dyn Run, id: ExecId) -> Failure {
    Error::new(
        ErrorKind::NotFound,
        format!("the run has no exec {id} (never started here, or released)"),
    )
    .with_field("exec_id")
    .with("run", run.id())
    .into()
}

/// Exec `id`'s record.
async fn record(run: &dyn Run, id: ExecId) -> Result<ExecInfo, Failure> {
    run.execs()
        .await?
        .into_iter()
        .find(|e| e.id == id)
        .ok_or_else(|| no_such_exec(run, id))
}

/// Exec `id`'s record once no stream reads it (after [`LET_GO`] at most); an exec still
/// read then is refused: attaching would take it over from its reader.
async fn unread(run: &dyn Run, id: ExecId) -> Result<ExecInfo, Failure> {
    let start = std::time::Instant::now();
    loop {
        let info = record(run, id).await?;
        if !info.attached {
            return Ok(info);
        }
        if start.elapsed() >= LET_GO {
            let reader = if info.detached {
                "a `sandbox logs -f` or a library caller"
            } else {
                "the `sandbox exec` that started it, or a `sandbox logs -f`"
            };
            return Err(Failure::usage(format!(
                "exec {id} is being read by another stream ({reader}): an exec has one \
                 reader, and reading it here would end that one{}; `sandbox wait` waits \
                 without reading it",
                if info.detached {
                    ""
                } else {
                    " and kill the command"
                }
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `logs`: the output kept from `from` on, stdout to stdout and stderr to stderr; up to
/// what there is now (0), or to the command's end with `follow` (its exit code).
pub async fn logs(run: &dyn Run, args: &LogsArgs) -> Result<i32, Failure> {
    let id = args.exec.exec;
    let info = unread(run, id).await?;
    let ended = info.status.is_some();
    if !args.follow && !ended && !info.detached {
        return Err(Failure::usage(format!(
            "exec {id} was started without --detach and still runs: reading its output makes \
             this process its reader, and a reader that stops before the end kills such a \
             command; `sandbox logs -f` follows it to its end"
        )));
    }
    if !args.follow && args.from >= info.output_bytes {
        return Ok(0);
    }
    // Without --follow, a running (detached) exec is read up to its size now; an ended
    // one to its end (its size is final).
    let until = (!args.follow && !ended).then_some(info.output_bytes);
    let mut stream = run.reattach(id, args.from).await?;
    let mut offset = stream.start_offset();
    let mut stdout = tokio::io::stdout();
    let mut stderr = tokio::io::stderr();
    loop {
        if until.is_some_and(|u| offset >= u) {
            // A detached exec: dropping the stream lets go of it.
            return Ok(0);
        }
        let chunk = match until {
            Some(_) => tokio::time::timeout(STALL, stream.next_chunk())
                .await
                .map_err(|_| {
                    Failure::usage(format!(
                        "exec {id}: the run's helper sent no output for {STALL:?} at offset \
                         {offset} of {}",
                        info.output_bytes
                    ))
                })?,
            None => stream.next_chunk().await,
        };
        match chunk {
            None => break,
            Some(OutputChunk::Stdout(b)) => {
                offset += b.len() as u64;
                let written = async {
                    stdout.write_all(&b).await?;
                    stdout.flush().await
                };
                if let Err(e) = written.await {
                    // Not dropped: a non-detached exec's stream kills the command when
                    // dropped; the process exits right after.
                    std::mem::forget(stream);
                    if e.kind() == std::io::ErrorKind::BrokenPipe {
                        return Ok(128 + 13);
                    }
                    return Err(Failure::usage(format!("writing stdout: {e}")));
                }
            }
            Some(OutputChunk::Stderr(b)) => {
                offset += b.len() as u64;
                let _ = stderr.write_all(&b).await;
                let _ = stderr.flush().await;
            }
            Some(OutputChunk::Lost(n)) => {
                offset = offset.saturating_add(n);
                let line = format!("sandbox: {n} bytes of output were lost here\n");
                let _ = stderr.write_all(line.as_bytes()).await;
            }
        }
    }
    let status = stream.wait().await;
    if args.follow {
        return Ok(exec::exit_code(&status, None));
    }
    match status {
        ExitStatus::Exited(_) | ExitStatus::Signaled(_) => Ok(0),
        // The read was cut short (the connection, another reader): say why.
        other => Ok(exec::exit_code(&other, None)),
    }
}

/// `wait`: the command's exit code once it ended, read from the records (never
/// attaching, so that its reader, if any, keeps it).
pub async fn wait(run: &dyn Run, id: ExecId) -> Result<i32, Failure> {
    let mut pause = Duration::from_millis(50);
    let mut failures = 0;
    let mut seen = false;
    loop {
        match run.execs().await {
            Ok(list) => {
                failures = 0;
                match list.into_iter().find(|e| e.id == id) {
                    Some(ExecInfo {
                        status: Some(status),
                        ..
                    }) => return Ok(exec::exit_code(&status, None)),
                    Some(_) => seen = true,
                    None if seen => {
                        return Err(Error::new(
                            ErrorKind::NotFound,
                            format!(
                                "exec {id} ended and its record was released meanwhile \
                                 (its exit status went to whoever read it)"
                            ),
                        )
                        .with_field("exec_id")
                        .with("run", run.id())
                        .into());
                    }
                    None => return Err(no_such_exec(run, id)),
                }
            }
            // A read that failed after the exec was seen may be the connection: a few
            // more tries. The run gone (121) or anything else is the answer.
            Err(e) if !seen || (!e.is_temporary() && e.kind() != ErrorKind::Backend) => {
                return Err(e.into());
            }
            Err(e) => {
                failures += 1;
                if failures >= WAIT_FAILURES {
                    let why = format!("reading exec {id}'s record: {e}");
                    return Ok(exec::exit_code(&ExitStatus::TransportLost(why), None));
                }
                tracing::debug!("reading the exec records failed ({e}); trying again");
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 3 / 2).min(WAIT_POLL_MAX);
    }
}

/// `kill`: kills exec `id`'s process tree (fine when it already ended).
pub async fn kill(run: &dyn Run, id: ExecId) -> Result<i32, Failure> {
    run.kill_exec(id).await?;
    Ok(0)
}

/// `rm-exec`: forgets ended execs' records (with `force`, kills running ones first),
/// printing each id.
pub async fn remove(run: &dyn Run, args: &RmArgs) -> Result<i32, Failure> {
    for &id in &args.execs {
        let mut info = record(run, id).await?;
        if info.status.is_none() {
            if !args.force {
                return Err(Failure::usage(format!(
                    "exec {id} still runs: `sandbox kill {} {id}` first, or rm-exec --force",
                    run.id()
                )));
            }
            run.kill_exec(id).await?;
            let start = std::time::Instant::now();
            while info.status.is_none() {
                if start.elapsed() >= KILL_WAIT {
                    return Err(Failure::usage(format!(
                        "exec {id} was killed but had not ended after {KILL_WAIT:?}"
                    )));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                info = record(run, id).await?;
            }
        }
        run.release_exec(id).await?;
        // The release is a message the helper does not answer: read the records until
        // it is gone (which also makes sure that it went out before this process exits).
        let start = std::time::Instant::now();
        while run.execs().await?.iter().any(|e| e.id == id) {
            if start.elapsed() >= LET_GO {
                return Err(Failure::usage(format!(
                    "exec {id} ended but the run's helper still lists it after {LET_GO:?}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        println!("{id}");
    }
    Ok(0)
}

/// `ps`: the run's exec records, as a table or JSON.
pub async fn ps(run: &dyn Run, args: &PsArgs) -> Result<i32, Failure> {
    let mut list = run.execs().await?;
    list.sort_by_key(|e| e.id);
    let now = SystemTime::now();
    if args.json {
        let rows: Vec<serde_json::Value> = list.iter().map(json_row).collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&rows).unwrap_or_else(|_| "[]".into())
        );
        return Ok(0);
    }
    let width = if args.no_trunc {
        None
    } else if std::io::stdout().is_terminal() {
        Some(crate::tty::size().map_or(80, |(_, cols)| usize::from(cols)))
    } else {
        None
    };
    print!("{}", table(&list, now, width, args.no_trunc));
    Ok(0)
}

/// The table `ps` prints: the COMMAND column cut so that a line fits `terminal` columns,
/// or to [`COMMAND_WIDTH`] without one; whole with `no_trunc`.
fn table(list: &[ExecInfo], now: SystemTime, terminal: Option<usize>, no_trunc: bool) -> String {
    const HEADER: [&str; 7] = [
        "ID", "PID", "STATE", "DETACHED", "ATTACHED", "OUTPUT", "STARTED",
    ];
    let yes_no = |b: bool| if b { "yes" } else { "no" }.to_string();
    let rows: Vec<([String; 7], String)> = list
        .iter()
        .map(|e| {
            let age = now.duration_since(e.started).unwrap_or_default();
            (
                [
                    e.id.to_string(),
                    if e.pid == 0 {
                        "-".into()
                    } else {
                        e.pid.to_string()
                    },
                    state(e.status.as_ref()),
                    yes_no(e.detached),
                    yes_no(e.attached),
                    e.output_bytes.to_string(),
                    format!("{} ago", units::human_duration(age)),
                ],
                command_line(&e.argv),
            )
        })
        .collect();
    let mut widths = HEADER.map(str::len);
    for (cells, _) in &rows {
        for (w, cell) in widths.iter_mut().zip(cells) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let before: usize = widths.iter().map(|w| w + 2).sum();
    let command_width = match (no_trunc, terminal) {
        (true, _) => usize::MAX,
        (false, Some(cols)) => cols.saturating_sub(before).max(12),
        (false, None) => COMMAND_WIDTH,
    };
    let line = |cells: &[String], command: &str| {
        let mut line = String::new();
        for (cell, w) in cells.iter().zip(widths) {
            line.push_str(&format!("{cell:<w$}  "));
        }
        line.push_str(&cut(command, command_width));
        line.trim_end().to_string() + "\n"
    };
    let header = HEADER.map(String::from);
    let mut out = line(&header, "COMMAND");
    for (cells, command) in &rows {
        out.push_str(&line(cells, command));
    }
    out
}

/// `running`, `exited N`, `signaled N`, ...
fn state(status: Option<&ExitStatus>) -> String {
    match status {
        None => "running".into(),
        Some(ExitStatus::Exited(n)) => format!("exited {n}"),
        Some(ExitStatus::Signaled(n)) => format!("signaled {n}"),
        Some(ExitStatus::TimedOut) => "timed out".into(),
        Some(other) => format!("ended: {other}"),
    }
}

/// The command as a shell would read it, control characters escaped (one line).
fn command_line(argv: &[String]) -> String {
    runcell_core::Shown(shell_words::join(argv)).to_string()
}

/// `text` cut to `width` characters, `...` marking the cut.
fn cut(text: &str, width: usize) -> String {
    if text.chars().count() <= width {
        return text.to_string();
    }
    let keep = width.saturating_sub(3);
    text.chars().take(keep).collect::<String>() + "..."
}

fn json_row(e: &ExecInfo) -> serde_json::Value {
    let started_at = e
        .started
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (exit_code, signal) = match e.status {
        Some(ExitStatus::Exited(n)) => (Some(n), None),
        Some(ExitStatus::Signaled(n)) => (None, Some(n)),
        _ => (None, None),
    };
    serde_json::json!({
        "id": e.id.get(),
        "pid": (e.pid != 0).then_some(e.pid),
        "state": state(e.status.as_ref()),
        "running": e.status.is_none(),
        "exit_code": exit_code,
        "signal": signal,
        "detached": e.detached,
        "attached": e.attached,
        "output_bytes": e.output_bytes,
        "kept_from": e.kept_from,
        "started_at": started_at,
        "argv": e.argv,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(id: u32, status: Option<ExitStatus>, argv: &[&str]) -> ExecInfo {
        ExecInfo {
            id: id.to_string().parse().unwrap(),
            pid: 40 + id,
            argv: argv.iter().map(|a| a.to_string()).collect(),
            detached: id % 2 == 1,
            attached: false,
            status,
            output_bytes: 1234,
            kept_from: 0,
            started: SystemTime::UNIX_EPOCH + Duration::from_secs(1000),
        }
    }

    #[test]
    fn the_table_has_every_column_and_cuts_the_command() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1065);
        let long = "x".repeat(200);
        let list = [
            info(1, None, &["sh", "-c", "echo a b\nexit 3"]),
            info(2, Some(ExitStatus::Exited(3)), &["echo", &long]),
            info(3, Some(ExitStatus::Signaled(9)), &["sleep", "1000"]),
        ];
        let out = table(&list, now, None, false);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 4, "{out}");
        assert_eq!(
            lines[0].split_whitespace().collect::<Vec<_>>(),
            [
                "ID", "PID", "STATE", "DETACHED", "ATTACHED", "OUTPUT", "STARTED", "COMMAND"
            ],
            "{out}"
        );
        assert!(
            lines[1].contains("running") && lines[1].contains("yes"),
            "{out}"
        );
        assert!(lines[1].contains("1m05s ago"), "{out}");
        assert!(lines[1].ends_with(r"sh -c 'echo a b\nexit 3'"), "{out}");
        assert!(
            lines[2].contains("exited 3") && lines[2].contains("1234"),
            "{out}"
        );
        let command = lines[2].split("ago  ").nth(1).unwrap();
        assert_eq!(command.chars().count(), COMMAND_WIDTH, "{command}");
        assert!(command.ends_with("..."), "{command}");
        assert!(lines[3].contains("signaled 9"), "{out}");
        // On a terminal the line fits its width; --no-trunc keeps all.
        let out = table(&list, now, Some(100), false);
        assert!(out.lines().all(|l| l.chars().count() <= 100), "{out}");
        let out = table(&list, now, Some(100), true);
        assert!(out.contains(&long), "{out}");
    }

    #[test]
    fn json_rows_carry_the_same_fields() {
        let row = json_row(&info(2, Some(ExitStatus::Exited(3)), &["true"]));
        assert_eq!(row["id"], 2);
        assert_eq!(row["pid"], 42);
        assert_eq!(row["state"], "exited 3");
        assert_eq!(row["exit_code"], 3);
        assert!(row["signal"].is_null());
        assert_eq!(row["detached"], false);
        assert_eq!(row["output_bytes"], 1234);
        assert_eq!(row["started_at"], 1000);
        assert_eq!(row["argv"][0], "true");
        let row = json_row(&info(1, None, &["true"]));
        assert_eq!(
            (row["state"].clone(), row["running"].clone()),
            ("running".into(), true.into())
        );
    }

    #[test]
    fn exec_ids_and_detach_combinations() {
        assert_eq!(parse_exec_id("7").unwrap().get(), 7);
        for bad in ["0", "x", "-1", ""] {
            assert!(parse_exec_id(bad).is_err(), "{bad}");
        }
        check_detach(false, None, None).unwrap();
        assert!(check_detach(true, None, None).is_err());
        assert!(check_detach(false, Some(Duration::from_secs(1)), None).is_err());
        assert!(check_detach(false, None, Some(Duration::ZERO)).is_err());
    }
}
