//! One exec's processes belong to it alone: several execs at once (as different users
//! where the driver has per-exec users), one of them hostile. Its timeout kills what is
//! its own and nothing else, whatever it did to get into another exec's process group or
//! session, and whatever another exec did to get into its own.
//!
//! The hostile parts are a small static program (`probe/probe.rs`, built by the suite's
//! build script) uploaded into the run: BusyBox has no tool to join a process group.
//!
//! On the helper path each exec runs under a shepherd of its own, in a session of its
//! own, and its kill reaches exactly the shepherd's descendants. On the plain path each
//! engine exec is a session of its own too (so no process group of another exec can be
//! joined), and the kill script finds an exec's processes by its marker, their groups
//! and sessions, and their descendants; what it cannot find is a daemon that cleared its
//! environment and left the exec's session after its parent exited (it is re-parented to
//! the target's PID 1, and nothing in it says which exec it came from): the plain path
//! does not promise that such a daemon dies with its exec (see
//! [`a_daemon_that_escaped_its_exec_dies_with_it_while_another_runs`]).

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use runcell_core::{
    DriverExt, ExecPath, ExecSpec, ExecStream, ExitStatus, OutputChunk, Run, RunExt,
};

use super::robustness::wait_gone;
use crate::{Context, sh_ok, sh_stdout};

include!(concat!(env!("OUT_DIR"), "/probe_bin.rs"));

/// Where the probe is placed in the run.
pub(crate) const PROBE_PATH: &str = "/tmp/runcell-probe";

/// Uploads the probe (executable by every user).
pub(crate) async fn upload_probe(run: &dyn Run) -> anyhow::Result<()> {
    ensure!(
        !PROBE.is_empty(),
        "the isolation probe was not built (see the build script's warning)"
    );
    run.put_file(PROBE_PATH, PROBE, 0o755)
        .await
        .context("uploading the isolation probe")
}

/// The user of the unprivileged side: `65534` where the driver runs execs as another
/// user, else the run's own.
fn unprivileged(cx: &Context, spec: ExecSpec) -> ExecSpec {
    if cx.caps.exec_user {
        spec.user("65534")
    } else {
        spec
    }
}

/// Reads stdout of `stream` until it holds `n` lines: those.
async fn lines(stream: &mut ExecStream, n: usize) -> anyhow::Result<Vec<String>> {
    let mut text = Vec::new();
    let read = async {
        while text.iter().filter(|&&b| b == b'\n').count() < n {
            match stream.next_chunk().await {
                Some(OutputChunk::Stdout(b)) => text.extend_from_slice(&b),
                Some(_) => {}
                None => bail!("the exec ended before {n} lines"),
            }
        }
        Ok(())
    };
    tokio::time::timeout(Duration::from_secs(30), read)
        .await
        .context("no output within 30 s")??;
    let s = String::from_utf8_lossy(&text);
    Ok(s.lines().take(n).map(str::to_string).collect())
}

/// Reads stdout of `stream` until its first line: that line.
async fn first_line(stream: &mut ExecStream) -> anyhow::Result<String> {
    Ok(lines(stream, 1).await?.remove(0))
}

/// Whether process `pid` lives (not a zombie) in the run.
async fn alive(run: &dyn Run, pid: &str) -> anyhow::Result<bool> {
    let state = sh_stdout(
        run,
        &format!("s=$(cat /proc/{pid}/stat 2>/dev/null) && echo \"${{s##*) }}\" | cut -c1"),
    )
    .await
    .unwrap_or_default();
    Ok(!state.is_empty() && state != "Z")
}

/// An unprivileged exec (`65534` where per-exec users exist) tries every way to get
/// into the process group and session of another (root) exec, then times out: the other
/// exec finishes with its own status, never killed by the first one's kill.
pub async fn an_exec_that_joins_another_execs_group_cannot_take_it_down(
    cx: &Context,
) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    upload_probe(&*run).await?;
    let mut victim = run
        .exec_stream(
            ExecSpec::new(["sh", "-c", "echo $$; sleep 5; exit 7"])
                .timeout(Duration::from_secs(60)),
        )
        .await?;
    let pid = first_line(&mut victim).await?;
    let attacker = run
        .exec(unprivileged(
            cx,
            ExecSpec::new([PROBE_PATH, "join", &pid]).timeout(Duration::from_secs(2)),
        ))
        .await?;
    let told = attacker.stdout_str();
    ensure!(
        attacker.status == ExitStatus::TimedOut && told.contains("setpgid-into-group"),
        "the joining exec: {} ({told})",
        attacker.status
    );
    let status = tokio::time::timeout(Duration::from_secs(30), victim.wait())
        .await
        .context("the victim exec did not end")?;
    ensure!(
        status == ExitStatus::Exited(7),
        "an exec ended {status} (expected its own exit 7) after another exec that tried to \
         join its process group timed out; the joining exec reported:\n{told}"
    );
    run.stop().await?;
    Ok(())
}

/// A daemon that double-forks, calls `setsid`, clears its environment and changes its
/// name, while another exec runs: the other exec ends with its own status, and, on the
/// helper path, the daemon is gone after its exec's timeout. The plain path cannot find
/// such a daemon once its parent exited (re-parented to the target's PID 1, in a
/// session of its own, with no marker), so there only the first part is checked.
pub async fn a_daemon_that_escaped_its_exec_dies_with_it_while_another_runs(
    cx: &Context,
) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    upload_probe(&*run).await?;
    let mut bystander = run
        .exec_stream(
            ExecSpec::new(["sh", "-c", "echo $$; sleep 8; exit 5"])
                .timeout(Duration::from_secs(60)),
        )
        .await?;
    first_line(&mut bystander).await?;
    let name = "hiddend-4417";
    let script = format!(
        "echo $$; {PROBE_PATH} daemon /tmp/isolation-daemon.pid {name} && echo started; sleep 1000"
    );
    let started = Instant::now();
    let mut hostile = run
        .exec_stream(unprivileged(
            cx,
            ExecSpec::new(["sh", "-c", &script]).timeout(Duration::from_secs(4)),
        ))
        .await?;
    let said = lines(&mut hostile, 2).await?;
    ensure!(said[1] == "started", "the daemonising exec said {said:?}");
    let root = &said[0];
    // Before the timeout: the daemon runs under its new name, with an empty environment,
    // in a session of its own.
    // The daemon's grandchild writes its pid file; "started" may come first (CI's
    // rootless Podman once read no file yet): waited for, bounded.
    let daemon = sh_stdout(
        &*run,
        "for i in $(seq 100); do [ -s /tmp/isolation-daemon.pid ] && break; sleep 0.1; done; \
         cat /tmp/isolation-daemon.pid",
    )
    .await?;
    // As the daemon's user: another user may not read its environment.
    let check = format!(
        "cd /proc/{daemon} && cat comm && wc -c < environ && \
             s=$(cat stat) && set -- ${{s##*) }} && echo $4 && \
             s=$(cat /proc/{root}/stat) && set -- ${{s##*) }} && echo $4"
    );
    let seen = run
        .exec(unprivileged(cx, ExecSpec::new(["sh", "-c", &check])))
        .await?;
    ensure!(
        seen.status.success(),
        "looking at the daemon {daemon}: {}, {:?}",
        seen.status,
        seen.stderr_str()
    );
    let seen = seen.stdout_str();
    let fields: Vec<&str> = seen.split_whitespace().collect();
    ensure!(
        fields.len() == 4
            && fields[0] == name
            && fields[1] == "0"
            && fields[2] != fields[3]
            && started.elapsed() < Duration::from_secs(4),
        "the daemon {daemon} is not what the case needs before its exec's timeout \
         (comm, environ bytes, its session, its exec's session): {seen:?}"
    );
    let status = tokio::time::timeout(Duration::from_secs(30), hostile.wait())
        .await
        .context("the daemonising exec did not end")?;
    ensure!(
        status == ExitStatus::TimedOut,
        "the daemonising exec: {status}"
    );
    if run.exec_path() == ExecPath::Helper {
        wait_gone(&*run, name, Duration::from_secs(5))
            .await
            .with_context(|| format!("the daemon {daemon} outlived its exec's timeout"))?;
    }
    // Not promised on the plain path (see above): the daemon may live on there.
    let status = tokio::time::timeout(Duration::from_secs(30), bystander.wait())
        .await
        .context("the other exec did not end")?;
    ensure!(
        status == ExitStatus::Exited(5),
        "an exec that ran beside a daemonising one ended {status}, not with its own exit 5"
    );
    run.stop().await?;
    Ok(())
}

/// Exec B (same user as A: the uid does not matter) tries to get a process of its own
/// into exec A's process group and session; A then times out. A's kill never reaches
/// B's processes: B's probe is still alive after it, and B ends with its own status.
pub async fn one_execs_kill_never_reaches_another_execs_processes(
    cx: &Context,
) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    upload_probe(&*run).await?;
    let mut a = run
        .exec_stream(
            ExecSpec::new(["sh", "-c", "echo $$; sleep 1000"]).timeout(Duration::from_secs(3)),
        )
        .await?;
    let a_pid = first_line(&mut a).await?;
    // Exec B keeps its probe until the case has looked at it (at most 60 s): a fixed
    // wait raced exec A's kill on a loaded machine, and B's own kill then looked like A's.
    let script = format!(
        "{PROBE_PATH} join {a_pid} > /tmp/isolation-join.txt & p=$!; echo $p; i=0; \
         while [ ! -e /tmp/isolation-checked ] && [ $i -lt 300 ]; do sleep 0.2; i=$((i+1)); done; \
         kill -0 $p && echo probe-alive; kill $p; exit 6"
    );
    let b = run.exec_stream(ExecSpec::new(["sh", "-c", &script]).timeout(Duration::from_secs(60)));
    let mut b = b.await?;
    let probe = first_line(&mut b).await?;
    let a_status = tokio::time::timeout(Duration::from_secs(30), a.wait())
        .await
        .context("exec A did not end")?;
    ensure!(a_status == ExitStatus::TimedOut, "exec A: {a_status}");
    let joined = sh_stdout(&*run, "cat /tmp/isolation-join.txt")
        .await
        .unwrap_or_default();
    ensure!(
        joined.contains("setpgid-into-group"),
        "exec B's probe did not try to join exec A's group: {joined:?}"
    );
    ensure!(
        alive(&*run, &probe).await?,
        "exec A's kill reached exec B's process {probe}; it had tried:\n{joined}"
    );
    sh_ok(&*run, "touch /tmp/isolation-checked").await?;
    let mut rest = Vec::new();
    while let Some(chunk) = b.next_chunk().await {
        if let OutputChunk::Stdout(d) = chunk {
            rest.extend_from_slice(&d);
        }
    }
    let b_status = b.wait().await;
    let rest = String::from_utf8_lossy(&rest);
    ensure!(
        b_status == ExitStatus::Exited(6) && rest.contains("probe-alive"),
        "exec B ended {b_status} with {rest:?} after exec A's kill; its probe had tried:\n{joined}"
    );
    run.stop().await?;
    Ok(())
}
