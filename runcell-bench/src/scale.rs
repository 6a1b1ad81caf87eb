//! What each run costs at scale (#24), on one driver: for each N of a ladder, N runs are
//! started cold (each with its helper stream held), kept busy (one small exec per second
//! each, a few printing 1 MiB), then runs are claimed from a warm pool beside them, and
//! all are stopped. Then another process starts N runs and holds them: a reap from this
//! process beside them (their owner alive) must remove none; the holder is SIGKILLed and
//! a reap must remove all N. Printed for each N: start throughput cold and pooled, exec
//! p50/p99 while all are busy, what the host process holds per run (RSS, threads,
//! descriptors, sockets), what the engine side holds per run (the container's memory
//! cgroup: helper and keep-alive; the runtime shims), the time to stop all, the two
//! reaps' times, and what is left (must be nothing).
//!
//! `cargo xtask bench scale [N,N,...]`, or
//! `cargo run --release -p runcell-bench --bin scale -- <docker|k8s> [N,N,...] [busy secs] [pooled M]`
//! (Kubernetes: the cluster of `KUBECONFIG`, as `cargo xtask k8s up` leaves it).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use runcell_core::{Driver, DriverConfig, ExecHelper, ExecSpec, Network, Run, RunExt, RunSpec};
use runcell_docker as _;
use runcell_k8s as _;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The label on every run of this benchmark (and the key of its leftover check).
const LABEL: (&str, &str) = ("sandbox.example/scale", "1");
/// Creates and stops in flight at once.
const PARALLEL: usize = 16;
/// Runs (of every N) that print 1 MiB on each of their busy calls.
const LOUD: usize = 4;

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// What this process holds: RSS (kB), threads, descriptors, sockets among them.
#[derive(Debug, Clone, Copy, Default)]
struct Held {
    rss_kb: u64,
    threads: u64,
    fds: u64,
    sockets: u64,
}

/// What this process holds now.
fn held() -> Held {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    let (mut fds, mut sockets) = (0, 0);
    if let Ok(dir) = std::fs::read_dir("/proc/self/fd") {
        for e in dir.flatten() {
            fds += 1;
            if std::fs::read_link(e.path())
                .is_ok_and(|l| l.to_string_lossy().starts_with("socket:"))
            {
                sockets += 1;
            }
        }
    }
    Held {
        rss_kb: field("VmRSS:"),
        threads: field("Threads:"),
        fds,
        sockets,
    }
}

/// Resident memory (kB) of every process whose name starts with `prefix`, and their count.
fn processes_rss_kb(prefix: &str) -> (u64, u64) {
    let (mut kb, mut n) = (0, 0);
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return (0, 0);
    };
    for e in dir.flatten() {
        let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
        if !comm.starts_with(prefix) {
            continue;
        }
        let status = std::fs::read_to_string(e.path().join("status")).unwrap_or_default();
        if let Some(v) = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        {
            kb += v;
            n += 1;
        }
    }
    (kb, n)
}

/// The memory cgroup usage (bytes) of Docker container `id` (cgroup v1 or v2), if found.
fn container_memory(id: &str) -> Option<u64> {
    for path in [
        format!("/sys/fs/cgroup/memory/docker/{id}/memory.usage_in_bytes"),
        format!("/sys/fs/cgroup/system.slice/docker-{id}.scope/memory.current"),
    ] {
        if let Some(v) = std::fs::read_to_string(path)
            .ok()
            .and_then(|s| s.trim().parse().ok())
        {
            return Some(v);
        }
    }
    None
}

/// The engine's full container ID of run `run` (Docker names the container after it).
async fn container_id(docker: &bollard::Docker, run: &str) -> Option<String> {
    docker.inspect_container(run, None).await.ok()?.id
}

async fn scale(
    driver: &Arc<dyn Driver>,
    spec: &RunSpec,
    n: usize,
    busy: Duration,
    pooled: Option<usize>,
) -> Res<()> {
    println!("== N = {n}");
    let before = held();
    let shims_before = processes_rss_kb("containerd-shim");

    // Cold starts, PARALLEL at a time, each answered one exec (its helper stream held),
    // in two halves: what the second half adds is what a run keeps (the first one also
    // raises the allocator's high-water mark of creates in flight).
    let t = Instant::now();
    let (mut runs, mut failed) = start_runs(driver, spec, n / 2).await;
    let half = held();
    let (more, more_failed) = start_runs(driver, spec, n - n / 2).await;
    runs.extend(more);
    failed.extend(more_failed);
    let cold = t.elapsed();
    println!(
        "cold start: {} runs in {:.1} s = {:.1} runs/s{}",
        runs.len(),
        cold.as_secs_f64(),
        runs.len() as f64 / cold.as_secs_f64(),
        if failed.is_empty() {
            String::new()
        } else {
            format!("; {} failed, first: {}", failed.len(), failed[0])
        }
    );
    let live = runs.len().max(1) as f64;
    let after = held();
    let second = (n - n / 2).max(1) as f64;
    println!(
        "host process per run (what the second half of the starts added): RSS {:.0} kB, threads {:.2}, descriptors {:.2}, sockets {:.2}; totals {} kB ({} kB before the first run), {} threads, {} fds, {} sockets",
        (after.rss_kb as f64 - half.rss_kb as f64) / second,
        (after.threads as f64 - half.threads as f64) / second,
        (after.fds as f64 - half.fds as f64) / second,
        (after.sockets as f64 - half.sockets as f64) / second,
        after.rss_kb,
        before.rss_kb,
        after.threads,
        after.fds,
        after.sockets
    );
    if let Ok(docker) = bollard::Docker::connect_with_defaults() {
        let mut total = 0u64;
        let mut counted = 0u64;
        for run in &runs {
            if let Some(id) = container_id(&docker, run.id()).await
                && let Some(bytes) = container_memory(&id)
            {
                total += bytes;
                counted += 1;
            }
        }
        let shims = processes_rss_kb("containerd-shim");
        println!(
            "engine side per run: container memory {:.0} kB ({counted} cgroups read), shim RSS {:.0} kB ({} shims)",
            total as f64 / 1024.0 / counted.max(1) as f64,
            (shims.0 as f64 - shims_before.0 as f64) / live,
            shims.1 - shims_before.1
        );
    }

    // Busy: every run one `true` a second; LOUD of them print 1 MiB each time.
    let started = Instant::now();
    let latencies: Vec<Vec<Duration>> = futures::stream::iter(runs.iter().cloned().enumerate())
        .map(|(i, run)| async move {
            let mut times = Vec::new();
            // Spread over the second.
            tokio::time::sleep(Duration::from_millis((i as u64 * 997) % 1000)).await;
            let mut next = Instant::now();
            while started.elapsed() < busy {
                let spec = if i < LOUD {
                    ExecSpec::new(["head", "-c", "1048576", "/dev/zero"])
                } else {
                    ExecSpec::new(["true"])
                };
                let t = Instant::now();
                let ok = run.exec(spec).await.is_ok_and(|o| o.status.success());
                if ok && i >= LOUD {
                    times.push(t.elapsed());
                }
                next += Duration::from_secs(1);
                tokio::time::sleep_until(next.into()).await;
            }
            times
        })
        .buffer_unordered(runs.len().max(1))
        .collect()
        .await;
    let mut all: Vec<Duration> = latencies.into_iter().flatten().collect();
    all.sort();
    let expected = (runs.len().saturating_sub(LOUD)) as f64 * busy.as_secs_f64();
    println!(
        "busy {:.0} s: {} small execs ({:.0}% of one a second each), p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        busy.as_secs_f64(),
        all.len(),
        100.0 * all.len() as f64 / expected.max(1.0),
        ms(percentile(&all, 0.5)),
        ms(percentile(&all, 0.99)),
        ms(percentile(&all, 1.0))
    );

    // Pooled, beside the N live runs: M claims from a pool warmed to M.
    if driver.capabilities().pool {
        let m = pooled.unwrap_or(n.min(50));
        let config = runcell_core::PoolConfig::default().min_ready(m);
        let pool = runcell_core::Pool::new(driver.clone(), spec, config)?;
        pool.wait_ready(m, Duration::from_secs(600)).await?;
        let t = Instant::now();
        let claimed: Vec<Res<(Box<dyn Run>, Duration)>> = futures::stream::iter(0..m)
            .map(|_| async {
                let t = Instant::now();
                let run = pool.create(spec, Default::default()).await?;
                run.exec(ExecSpec::new(["true"])).await?;
                Ok((run, t.elapsed()))
            })
            .buffer_unordered(m)
            .collect()
            .await;
        let took = t.elapsed();
        let stats = pool.stats();
        let mut each = Vec::new();
        for (run, claim) in claimed.into_iter().flatten() {
            each.push(claim);
            run.stop().await?;
        }
        pool.shutdown().await?;
        each.sort();
        // All M at once: a claim's time includes its wait behind the others.
        println!(
            "pooled start: {} of {m} claimed (+ first exec) in {:.0} ms = {:.1} runs/s ({} hits); each claim p50 {:.0} ms, p99 {:.0} ms",
            each.len(),
            ms(took),
            each.len() as f64 / took.as_secs_f64(),
            stats.hits,
            ms(percentile(&each, 0.5)),
            ms(percentile(&each, 0.99))
        );
    }

    // Stop all, PARALLEL at a time.
    let t = Instant::now();
    let stopped: Vec<Res<()>> = futures::stream::iter(runs)
        .map(|run| async move { Ok(run.stop().await?) })
        .buffer_unordered(PARALLEL)
        .collect()
        .await;
    let errors = stopped.iter().filter(|r| r.is_err()).count();
    println!(
        "stop all: {:.1} s{}",
        t.elapsed().as_secs_f64(),
        if errors == 0 {
            String::new()
        } else {
            format!(" ({errors} failed)")
        }
    );
    let selector: BTreeMap<String, String> = [(LABEL.0.to_string(), LABEL.1.to_string())].into();
    let left = driver.list(&selector).await?;
    println!("left: {} runs", left.len());
    if !left.is_empty() || !failed.is_empty() || errors > 0 {
        return Err(format!(
            "N = {n}: {} left, {} starts failed, {errors} stops failed",
            left.len(),
            failed.len()
        )
        .into());
    }
    Ok(())
}

/// Starts `n` runs of `spec` (PARALLEL at a time, each answered one exec), the runs
/// that started and the first error of those that did not.
async fn start_runs(
    driver: &Arc<dyn Driver>,
    spec: &RunSpec,
    n: usize,
) -> (Vec<Arc<dyn Run>>, Vec<String>) {
    let results: Vec<Res<Arc<dyn Run>>> = futures::stream::iter(0..n)
        .map(|_| async {
            let run: Arc<dyn Run> = Arc::from(driver.create(spec).await?);
            run.exec(ExecSpec::new(["true"])).await?;
            Ok(run)
        })
        .buffer_unordered(PARALLEL)
        .collect()
        .await;
    let (mut runs, mut failed) = (Vec::new(), Vec::new());
    for r in results {
        match r {
            Ok(run) => runs.push(run),
            Err(e) => failed.push(e.to_string()),
        }
    }
    (runs, failed)
}

/// The holder (`scale --hold DRIVER N`): starts N runs, says `held K` on stdout, and keeps
/// them (their helper streams held) until it is killed.
async fn hold(driver: &Arc<dyn Driver>, spec: &RunSpec, n: usize) -> Res<()> {
    let (runs, failed) = start_runs(driver, spec, n).await;
    if let Some(first) = failed.first() {
        eprintln!("holder: {} starts failed, first: {first}", failed.len());
    }
    println!("held {}", runs.len());
    std::future::pending::<()>().await;
    drop(runs);
    Ok(())
}

/// Cleanup at scale: another process holds N runs; a reap beside them removes none of
/// theirs (their owner lives); once it is SIGKILLed, a reap removes them all.
async fn kill_and_reap(driver: &Arc<dyn Driver>, name: &str, n: usize) -> Res<()> {
    use tokio::io::AsyncBufReadExt;
    let selector: BTreeMap<String, String> = [(LABEL.0.to_string(), LABEL.1.to_string())].into();
    let mut holder = tokio::process::Command::new(std::env::current_exe()?)
        .args(["--hold", name, &n.to_string()])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let stdout = holder.stdout.take().ok_or("the holder has no stdout")?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let said = tokio::time::timeout(Duration::from_secs(900), lines.next_line())
        .await
        .map_err(|_| "the holder started nothing in 900 s")??
        .unwrap_or_default();
    let held: usize = said
        .strip_prefix("held ")
        .and_then(|k| k.parse().ok())
        .ok_or_else(|| format!("the holder said {said:?}"))?;
    let t = Instant::now();
    let beside = runcell_core::reap(&**driver, &selector).await?;
    let beside_took = t.elapsed();
    let theirs = driver.list(&selector).await?.len();
    holder.start_kill()?;
    holder.wait().await?;
    let t = Instant::now();
    let reaped = runcell_core::reap(&**driver, &selector).await?;
    let took = t.elapsed();
    let left = driver.list(&selector).await?.len();
    println!(
        "another process held {held} runs: a reap beside them removed {} in {:.1} s ({theirs} still listed); after its SIGKILL a reap removed {} in {:.1} s ({:.0} ms a run); left: {left} runs",
        beside.len(),
        beside_took.as_secs_f64(),
        reaped.len(),
        took.as_secs_f64(),
        ms(took) / reaped.len().max(1) as f64
    );
    if held != n || !beside.is_empty() || theirs != held || reaped.len() != held || left != 0 {
        return Err(format!(
            "N = {n}: held {held}, reaped beside a live owner {}, listed {theirs}, reaped after SIGKILL {}, left {left}",
            beside.len(),
            reaped.len()
        )
        .into());
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Res<()> {
    let mut args = std::env::args().skip(1).peekable();
    let holding = args.next_if(|a| a == "--hold").is_some();
    if !holding {
        runcell_core::stop_runs_on_signal()?;
    }
    let name = args.next().unwrap_or_else(|| "docker".into());
    let ladder: Vec<usize> = args
        .next()
        .unwrap_or_else(|| "50,200,500".into())
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let busy = Duration::from_secs(args.next().map(|s| s.parse()).transpose()?.unwrap_or(60));
    // Runs claimed from a pool beside the N (default: N, at most 50; a node's pod limit
    // may leave room for fewer).
    let pooled: Option<usize> = args.next().map(|s| s.parse()).transpose()?;
    let driver: Arc<dyn Driver> =
        runcell_core::connect(&name, DriverConfig::from_env(&name)).await?;
    let mut spec = RunSpec::new("sandbox-test/busybox:latest")
        .label(LABEL.0, LABEL.1)
        .exec_helper(ExecHelper::Required);
    spec.pull = runcell_core::PullPolicy::Never;
    if driver.capabilities().network_none {
        spec = spec.network(Network::None);
    }
    if holding {
        return hold(&driver, &spec, ladder.first().copied().unwrap_or(0)).await;
    }
    println!(
        "== {name}: scale ladder {ladder:?}, busy {} s, {} cores",
        busy.as_secs(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    for n in ladder {
        scale(&driver, &spec, n, busy, pooled).await?;
        kill_and_reap(&driver, &name, n).await?;
    }
    Ok(())
}
