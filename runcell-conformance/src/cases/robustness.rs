//! Exec that cannot hang or lie, and runs that cannot leak.

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use runcell_core::{
    DriverExt, ErrorKind, ExecPath, ExecSpec, ExitStatus, OutputChunk, ReapReason, Run, RunExt,
};

use crate::harness::OwnerMode;
use crate::{Context, sh_stdout};

/// The command lines of the processes alive in the run (zombies have none).
pub(crate) async fn process_lines(run: &dyn Run) -> anyhow::Result<String> {
    sh_stdout(
        run,
        "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done",
    )
    .await
}

/// Waits until no process's command line contains `needle`.
pub(crate) async fn wait_gone(run: &dyn Run, needle: &str, within: Duration) -> anyhow::Result<()> {
    let start = Instant::now();
    loop {
        let procs = process_lines(run).await?;
        if !procs.contains(needle) {
            return Ok(());
        }
        if start.elapsed() > within {
            bail!("processes matching {needle:?} still run after {within:?}:\n{procs}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A timeout kills the whole tree (children, grandchildren in their own session) with
/// TERM → KILL, reports `TimedOut`, and the run stays usable.
pub async fn timeout_kills_the_process_tree(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    let script = "sleep 1201 & setsid sleep 1202 & trap '' TERM; sleep 1203; wait";
    let started = Instant::now();
    let out = run
        .exec(ExecSpec::new(["sh", "-c", script]).timeout(Duration::from_secs(1)))
        .await?;
    ensure!(
        out.status == ExitStatus::TimedOut,
        "expected timed out, got {}",
        out.status
    );
    ensure!(
        started.elapsed() < Duration::from_secs(15),
        "the timeout took {:?}",
        started.elapsed()
    );
    wait_gone(&*run, "sleep 120", Duration::from_secs(3)).await?;
    ensure!(sh_stdout(&*run, "echo still-usable").await? == "still-usable");
    run.stop().await?;
    Ok(())
}

/// A timeout also kills descendants that cleared their environment (so carry no exec
/// marker), also in a new session, while their parent lives.
pub async fn timeout_kills_descendants_that_cleared_their_env(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    let script = "env -i sleep 1301 & setsid env -i sleep 1302 & \
                  (env -i sh -c 'sleep 1303 & exec sleep 1304') & \
                  trap '' TERM; echo started; sleep 1305; wait";
    let out = run
        .exec(ExecSpec::new(["sh", "-c", script]).timeout(Duration::from_secs(2)))
        .await?;
    ensure!(
        out.status == ExitStatus::TimedOut,
        "expected timed out, got {}",
        out.status
    );
    wait_gone(&*run, "sleep 130", Duration::from_secs(3)).await?;
    run.stop().await?;
    Ok(())
}

/// Dropping a running exec kills its processes.
pub async fn cancellation_kills_the_process_tree(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    let mut stream = run
        .exec_stream(ExecSpec::new([
            "sh",
            "-c",
            "sleep 2301 & echo started; sleep 2302",
        ]))
        .await?;
    ensure!(
        matches!(stream.next_chunk().await, Some(OutputChunk::Stdout(_))),
        "no output before cancel"
    );
    ensure!(process_lines(&*run).await?.contains("sleep 2302"));
    drop(stream);
    wait_gone(&*run, "sleep 230", Duration::from_secs(10)).await?;

    // Cancelling the future of a buffered exec does the same.
    let exec = run.exec(ExecSpec::new(["sh", "-c", "sleep 2401 & sleep 2402"]));
    ensure!(
        tokio::time::timeout(Duration::from_millis(700), exec)
            .await
            .is_err()
    );
    wait_gone(&*run, "sleep 240", Duration::from_secs(10)).await?;
    run.stop().await?;
    Ok(())
}

/// The bound within which an exec returns after its command exited while a background
/// child still holds stdout open.
pub const BACKGROUND_HOLDER_BOUND: Duration = Duration::from_secs(5);

/// A command that leaves a background child holding stdout returns when it exits.
pub async fn background_stdout_holder_returns(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    let started = Instant::now();
    let out = run
        .exec(
            ExecSpec::new(["sh", "-c", "sleep 3001 & echo parent-done; exit 4"])
                .timeout(Duration::from_secs(30)),
        )
        .await?;
    let took = started.elapsed();
    ensure!(out.status == ExitStatus::Exited(4), "got {}", out.status);
    ensure!(
        out.stdout_str().starts_with("parent-done"),
        "{:?}",
        out.stdout_str()
    );
    ensure!(took < BACKGROUND_HOLDER_BOUND, "returned after {took:?}");
    run.stop().await?;
    Ok(())
}

/// The buffered exec keeps the head up to the limit and reports the total.
pub async fn buffered_output_is_capped(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    let out = run
        .exec(
            ExecSpec::new(["sh", "-c", "head -c 3000000 /dev/zero; printf abc >&2"])
                .output_limit(1000),
        )
        .await?;
    ensure!(out.status.success(), "{}", out.status);
    ensure!(
        out.stdout.len() == 1000 && out.stdout.iter().all(|b| *b == 0),
        "stdout {} bytes",
        out.stdout.len()
    );
    ensure!(out.stdout_total == 3_000_000 && out.stdout_truncated());
    ensure!(out.stderr == b"abc" && !out.stderr_truncated());
    run.stop().await?;
    Ok(())
}

use crate::rss_bytes;

/// 64 MiB streamed through a slow reader: every byte arrives, host memory stays bounded.
pub async fn large_output_streams_in_bounded_memory(cx: &Context) -> anyhow::Result<()> {
    const TOTAL: u64 = 64 << 20;
    let run = cx.driver.start(&cx.spec()).await?;
    let before = rss_bytes();
    let mut stream = run
        .exec_stream(ExecSpec::new([
            "head",
            "-c",
            &TOTAL.to_string(),
            "/dev/zero",
        ]))
        .await?;
    let (mut got, mut peak) = (0u64, 0u64);
    let mut chunks = 0u64;
    while let Some(chunk) = stream.next_chunk().await {
        if let OutputChunk::Stdout(b) = chunk {
            got += b.len() as u64;
        }
        chunks += 1;
        if chunks.is_multiple_of(64) {
            peak = peak.max(rss_bytes().unwrap_or(0));
            // A slow reader: the backend must wait rather than buffer.
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    let status = stream.wait().await;
    ensure!(status.success(), "{status}");
    ensure!(got == TOTAL, "received {got} of {TOTAL} bytes");
    if let Some(before) = before {
        let growth = peak.saturating_sub(before);
        ensure!(
            growth < 48 << 20,
            "host memory grew by {} MiB while streaming 64 MiB",
            growth >> 20
        );
    }
    run.stop().await?;
    Ok(())
}

/// 32 execs at once on one run, each with its own output and exit code.
pub async fn concurrent_execs_keep_their_output(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    let execs = (0..32).map(|i| {
        let run = &run;
        async move {
            let script = format!(
                "echo out-{i}; sleep 0.$((RANDOM % 3)) 2>/dev/null; echo err-{i} >&2; exit {}",
                i % 7
            );
            (i, run.exec(ExecSpec::new(["sh", "-c", &script])).await)
        }
    });
    for (i, out) in futures::future::join_all(execs).await {
        let out = out.with_context(|| format!("exec {i}"))?;
        ensure!(
            out.stdout_str() == format!("out-{i}\n"),
            "exec {i} stdout {:?}",
            out.stdout_str()
        );
        ensure!(
            out.stderr_str() == format!("err-{i}\n"),
            "exec {i} stderr {:?}",
            out.stderr_str()
        );
        ensure!(
            out.status == ExitStatus::Exited(i % 7),
            "exec {i}: {}",
            out.status
        );
    }
    run.stop().await?;
    Ok(())
}

/// 200 execs that orphan a child leave no zombies behind.
pub async fn orphans_do_not_become_zombies(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    for batch in 0..50 {
        let execs = (0..4).map(|_| run.exec(ExecSpec::new(["sh", "-c", "sleep 0.05 & exit 0"])));
        for out in futures::future::join_all(execs).await {
            ensure!(out?.status.success(), "batch {batch}");
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let zombies = sh_stdout(
        &*run,
        "n=0; for s in /proc/[0-9]*/stat; do case \"$(cat $s 2>/dev/null)\" in *') Z '*) n=$((n+1));; esac; done; echo $n",
    )
    .await?;
    ensure!(
        zombies.parse::<u32>()? <= 2,
        "{zombies} zombies after 200 orphaning execs"
    );
    run.stop().await?;
    Ok(())
}

/// Stop does not wait out a SIGTERM grace period (Docker's is 10 s, a pod's 30 s), even
/// with work running that ignores TERM. Unloaded it takes well under a second; the bound
/// is half the shortest grace period so that a loaded CI machine does not fail it.
pub async fn stop_is_fast(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    let _busy = run
        .exec_stream(ExecSpec::new(["sh", "-c", "trap '' TERM; sleep 600"]))
        .await?;
    let started = Instant::now();
    run.stop().await?;
    let took = started.elapsed();
    ensure!(
        took < Duration::from_secs(5),
        "stop took {took:?}: it waited for the work to end"
    );
    Ok(())
}

/// A run whose target was removed by someone else fails the next exec fast as run-lost;
/// an exec running at that moment never reports success.
pub async fn removed_target_is_run_lost(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    let running = run.exec_stream(ExecSpec::new(["sleep", "600"])).await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    cx.driver.remove(run.id()).await?;
    let status = tokio::time::timeout(Duration::from_secs(20), running.wait())
        .await
        .context("the running exec hung")?;
    // Never an exit status or a signal of the engine's making (137 on Docker, 126 on
    // Kubernetes): the target is gone, or at most the connection went with it.
    ensure!(
        matches!(
            status,
            ExitStatus::RunLost(_) | ExitStatus::TransportLost(_)
        ),
        "an exec whose target vanished reported {status}"
    );
    let started = Instant::now();
    match run.exec(ExecSpec::new(["true"])).await {
        Ok(out) => bail!("exec on a removed run returned {}", out.status),
        Err(e) => ensure!(e.kind() == ErrorKind::RunLost, "expected run lost, got {e}"),
    }
    ensure!(
        started.elapsed() < Duration::from_secs(5),
        "run-lost took {:?}",
        started.elapsed()
    );
    Ok(())
}

/// How long [`an_idle_run_answers_at_once_with_its_background_alive`] stays idle:
/// `RUNCELL_CONFORMANCE_IDLE_SECS` (`cargo xtask test` gives the Kubernetes suites twice
/// the test node's `streamingConnectionIdleTimeout`), 3 s by default.
pub const IDLE_SECS_ENV: &str = "RUNCELL_CONFORMANCE_IDLE_SECS";

/// A run left idle (no exec) for a while, longer than a node's idle-stream timeout where
/// the harness says so, answers its next exec on the same path, with a background
/// process started before the idle still alive and nothing reported lost. A command in
/// flight that says nothing for the whole idle then finishes: with durable execs its
/// output arrives whole with its exact status; without, whole or `TransportLost`, never a
/// made-up status.
pub async fn an_idle_run_answers_at_once_with_its_background_alive(
    cx: &Context,
) -> anyhow::Result<()> {
    let idle: u64 = match runcell_core::envvar::var(IDLE_SECS_ENV) {
        Some(v) => v
            .parse()
            .with_context(|| format!("{IDLE_SECS_ENV}={v:?}"))?,
        None => 3,
    };
    let run = cx.driver.start(&cx.spec()).await?;
    let path = run.exec_path();
    let out = run
        .exec(ExecSpec::new([
            "sh",
            "-c",
            "sleep 1779 >/dev/null 2>&1 </dev/null & echo $!",
        ]))
        .await?;
    ensure!(out.status.success(), "{}: {}", out.status, out.stderr_str());
    let pid = out.stdout_str().trim().to_string();
    ensure!(pid.parse::<u32>().is_ok(), "no pid: {:?}", out.stdout_str());
    // What an exec costs on this run before the idle, to judge the one after it.
    let before = Instant::now();
    run.exec(ExecSpec::new(["true"])).await?;
    let usual = before.elapsed();
    let silent = run
        .exec_stream(ExecSpec::new([
            "sh",
            "-c",
            &format!("echo before; sleep {idle}; echo after; exit 7"),
        ]))
        .await?;
    let silent = tokio::spawn(silent.collect(1 << 16));
    tokio::time::sleep(Duration::from_secs(idle)).await;
    let started = Instant::now();
    let out = run
        .exec(ExecSpec::new([
            "sh",
            "-c",
            &format!("kill -0 {pid} && echo alive"),
        ]))
        .await?;
    let took = started.elapsed();
    eprintln!("the first exec after {idle} s idle took {took:?}, before it {usual:?} ({path:?})");
    // "At once": no reconnect wait or stale-stream timeout; loose for a loaded machine.
    let bound = (usual * 3).max(Duration::from_secs(5));
    ensure!(
        took < bound,
        "the first exec after {idle} s idle took {took:?} (one before it: {usual:?})"
    );
    ensure!(
        out.status.success() && out.stdout_str() == "alive\n",
        "after {idle} s idle the background process {pid} is gone: {} {:?}",
        out.status,
        out.stderr_str()
    );
    ensure!(
        run.exec_path() == path,
        "the run changed its exec path over the idle: {path:?} -> {:?}",
        run.exec_path()
    );
    let out = tokio::time::timeout(Duration::from_secs(60), silent)
        .await
        .context("the command silent over the idle never ended")??;
    let durable = cx.caps.durable_execs && path == ExecPath::Helper;
    match &out.status {
        ExitStatus::TransportLost(_) if !durable => {}
        status => ensure!(
            *status == ExitStatus::Exited(7) && out.stdout_str() == "before\nafter\n",
            "a command silent over {idle} s idle ended {status} with {:?} ({path:?})",
            out.stdout_str()
        ),
    }
    run.stop().await?;
    Ok(())
}

/// A target whose keep-alive process dies (the container exits) ends the exec running in
/// it as `RunLost`, never as a lost transport, an exit status or success, and the next
/// exec is a `RunLost` error.
pub async fn a_target_whose_keepalive_dies_is_run_lost(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    let running = run.exec_stream(ExecSpec::new(["sleep", "600"])).await?;
    // The keep-alive: the oldest `sleep infinity` (PID 1 is an init or pause, which a
    // process of the same PID namespace cannot kill).
    let keepalive = sh_stdout(
        &*run,
        "for p in /proc/[0-9]*; do [ \"$(tr '\\0' ' ' < $p/cmdline 2>/dev/null)\" = 'sleep infinity ' ] && echo ${p#/proc/}; done | sort -n | head -n 1",
    )
    .await?;
    ensure!(
        keepalive.parse::<u32>().is_ok_and(|p| p > 1),
        "no keep-alive process other than PID 1 found: {keepalive:?}"
    );
    // Its exec may die with the target: only what follows is judged.
    let _ = tokio::time::timeout(
        Duration::from_secs(20),
        run.exec(ExecSpec::new(["kill", "-KILL", keepalive.as_str()])),
    )
    .await;
    let status = tokio::time::timeout(Duration::from_secs(30), running.wait())
        .await
        .context("the running exec hung after its target died")?;
    ensure!(
        matches!(status, ExitStatus::RunLost(_)),
        "an exec whose target died reported {status}"
    );
    match run.exec(ExecSpec::new(["true"])).await {
        Ok(out) => bail!("exec on a dead target returned {}", out.status),
        Err(e) => ensure!(e.kind() == ErrorKind::RunLost, "expected run lost, got {e}"),
    }
    run.stop().await?;
    Ok(())
}

/// A run created by a process that was then SIGKILLed is found and removed by reap.
pub async fn reap_removes_runs_of_a_killed_owner(cx: &Context) -> anyhow::Result<()> {
    let mut child = crate::harness::spawn_owner_child(cx, OwnerMode::Bare)?;
    let id = crate::harness::read_child_run_id(&mut child).await?;
    child.kill().await?;
    child.wait().await?;
    let live = cx.driver.list(&cx.case_selector()).await?;
    ensure!(
        live.iter().any(|r| r.id == id),
        "the killed owner's run {id} is not listed"
    );
    let reaped = runcell_core::reap(&*cx.driver, &cx.case_selector()).await?;
    ensure!(
        reaped.contains(&(id.clone(), ReapReason::OwnerGone)),
        "reap removed {reaped:?}, not {id}"
    );
    cx.assert_case_clean().await
}

/// SIGTERM to a process that uses `stop_runs_on_signal` stops its guarded runs before it
/// exits; no reap needed.
pub async fn signal_to_owner_stops_its_runs(cx: &Context) -> anyhow::Result<()> {
    let mut child = crate::harness::spawn_owner_child(cx, OwnerMode::GuardedWithSignalHandler)?;
    let id = crate::harness::read_child_run_id(&mut child).await?;
    ensure!(
        cx.driver
            .list(&cx.case_selector())
            .await?
            .iter()
            .any(|r| r.id == id),
        "{id} is not listed"
    );
    let pid = child.id().context("the child's pid")?;
    let sent = tokio::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .await?;
    ensure!(sent.success(), "kill -TERM failed");
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .context("the child did not exit")??;
    ensure!(status.code() == Some(143), "the child exited with {status}");
    cx.assert_case_clean().await
}

/// A run past its TTL is removed (by the backend or by reap); a live run is not.
pub async fn ttl_expired_runs_are_reaped(cx: &Context) -> anyhow::Result<()> {
    let mut spec = cx.spec();
    // Long enough for a slow backend to get the run ready before the deadline (a pod's
    // deadline counts from its start; 3 s was too short with three suites beside).
    spec.ttl = Some(Duration::from_secs(6));
    let expiring = cx.driver.start(&spec).await?;
    let keeper = cx.driver.start(&cx.spec()).await?;
    tokio::time::sleep(Duration::from_millis(7200)).await;
    let reaped = runcell_core::reap(&*cx.driver, &cx.case_selector()).await?;
    let listed = cx.driver.list(&cx.case_selector()).await?;
    ensure!(
        !listed.iter().any(|r| r.id == expiring.id()),
        "the expired run is still there (reaped {reaped:?})"
    );
    ensure!(
        listed.iter().any(|r| r.id == keeper.id()),
        "reap removed a live run without TTL"
    );
    ensure!(sh_stdout(&*keeper, "echo ok").await? == "ok");
    keeper.stop().await?;
    expiring.stop().await?;
    Ok(())
}
