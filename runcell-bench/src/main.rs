//! Measures, side by side in one run, what the exec paths cost on one driver: a tool call
//! through the in-sandbox helper, through one engine exec (the plain path) and, on Docker,
//! through the raw Engine API; throughput at parallelism 8; run start with and without
//! the helper; a fresh container per call; and memory (host RSS over 10 000 helper execs
//! and 256 MiB each way through stdout, stdin and files; the helper's RSS in the
//! sandbox); run start cold vs claimed from a warm pool. On Kubernetes, the plain path and
//! the pooled start also on kube's own client (Nagle on), beside the driver's (TCP_NODELAY).
//! Arms are interleaved round by round so that machine noise hits all alike. Prints
//! medians and ratios.
//!
//! `cargo xtask bench` (Docker, then the Kubernetes test cluster), or
//! `cargo run --release -p runcell-bench --bin bench -- <docker|k8s> [rounds]`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bollard::exec::{CreateExecOptions, StartExecResults};
use futures::StreamExt;
use runcell_conformance::RssSampler;
use runcell_core::{
    Driver, DriverConfig, ExecHelper, ExecPath, ExecSpec, Network, OutputChunk, Run, RunExt,
    RunSpec,
};
use tokio::io::AsyncReadExt;
// Linked for its registration (runcell_k8s is named below).
use runcell_docker as _;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// One `true` through the raw Engine API, as a hand-written client would do it.
async fn raw_exec(docker: &bollard::Docker, container: &str) -> Res<()> {
    let created = docker
        .create_exec(
            container,
            CreateExecOptions::<String> {
                attach_stdout: Some(true),
                attach_stderr: Some(true),
                cmd: Some(vec!["true".into()]),
                ..Default::default()
            },
        )
        .await?;
    if let StartExecResults::Attached { mut output, .. } =
        docker.start_exec(&created.id, None).await?
    {
        while output.next().await.is_some() {}
    }
    let inspect = docker.inspect_exec(&created.id).await?;
    assert_eq!(inspect.exit_code, Some(0));
    Ok(())
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

async fn call(run: &dyn Run) -> Res<Duration> {
    let t = Instant::now();
    let out = run.exec(ExecSpec::new(["true"])).await?;
    assert!(out.status.success(), "true: {}", out.status);
    Ok(t.elapsed())
}

/// Execs of `true` per second on one run, `parallel` at a time, `total` in all.
async fn throughput(run: &Arc<dyn Run>, parallel: usize, total: usize) -> Res<f64> {
    let t = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..parallel {
        let run = run.clone();
        let n = total / parallel + usize::from(i < total % parallel);
        tasks.push(tokio::spawn(async move {
            for _ in 0..n {
                call(&*run).await?;
            }
            Res::Ok(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    Ok(total as f64 / t.elapsed().as_secs_f64())
}

/// The helper daemon's resident memory in the sandbox (kB), read from its `/proc` entry once it
/// has been idle for 2 s (it gives its free heap pages back after 1 s without traffic).
async fn helper_rss_kb(run: &dyn Run) -> Res<u64> {
    tokio::time::sleep(Duration::from_secs(2)).await;
    // The daemon (it owns every exec; each connection's relay is a small process apart).
    let script = "for d in /proc/[0-9]*; do case \"$(tr '\\0' ' ' < $d/cmdline 2>/dev/null)\" in \
                  '/.runcell/helper --daemon '*) grep VmRSS $d/status;; esac; done";
    let out = run.exec(ExecSpec::new(["sh", "-c", script])).await?;
    let kb = out
        .stdout_str()
        .split_whitespace()
        .nth(1)
        .ok_or("no helper process found")?
        .parse()?;
    Ok(kb)
}

const BIG: u64 = 256 << 20;

/// Host RSS growth while 256 MiB go through stdout, stdin, and a file each way.
async fn big_transfers(run: &dyn Run) -> Res<[(String, u64, f64); 4]> {
    let mut results = Vec::new();

    let rss = RssSampler::start();
    let t = Instant::now();
    let mut s = run
        .exec_stream(ExecSpec::new(["head", "-c", &BIG.to_string(), "/dev/zero"]))
        .await?;
    let mut n = 0u64;
    while let Some(chunk) = s.next_chunk().await {
        if let OutputChunk::Stdout(b) = chunk {
            n += b.len() as u64;
        }
    }
    assert!(s.wait().await.success());
    assert_eq!(n, BIG);
    results.push((
        "stdout".to_string(),
        rss.stop().await.unwrap_or(0),
        t.elapsed().as_secs_f64(),
    ));

    let rss = RssSampler::start();
    let t = Instant::now();
    let mut s = run
        .exec_stream(ExecSpec::new(["sh", "-c", "wc -c"]).stdin_piped())
        .await?;
    let mut w = s.take_stdin().ok_or("no stdin")?;
    let chunk = bytes::Bytes::from(vec![7u8; 1 << 20]);
    for _ in 0..(BIG >> 20) {
        w.write(chunk.clone()).await?;
    }
    w.close();
    let out = s.collect(1 << 10).await;
    assert_eq!(out.stdout_str().trim(), BIG.to_string());
    results.push((
        "stdin".to_string(),
        rss.stop().await.unwrap_or(0),
        t.elapsed().as_secs_f64(),
    ));

    let rss = RssSampler::start();
    let t = Instant::now();
    run.put_file_stream("/tmp/big.bin", tokio::io::repeat(3).take(BIG), BIG, 0o644)
        .await?;
    results.push((
        "file in".to_string(),
        rss.stop().await.unwrap_or(0),
        t.elapsed().as_secs_f64(),
    ));

    let rss = RssSampler::start();
    let t = Instant::now();
    let mut reader = run.get_file_stream("/tmp/big.bin").await?;
    let got = tokio::io::copy(&mut reader, &mut tokio::io::sink()).await?;
    assert_eq!(got, BIG);
    results.push((
        "file out".to_string(),
        rss.stop().await.unwrap_or(0),
        t.elapsed().as_secs_f64(),
    ));
    sh(run, "rm -f /tmp/big.bin").await?;
    Ok(results.try_into().expect("four transfers"))
}

async fn sh(run: &dyn Run, script: &str) -> Res<()> {
    let out = run.exec(ExecSpec::new(["sh", "-c", script])).await?;
    assert!(out.status.success(), "{script}: {}", out.status);
    Ok(())
}

/// `sandbox exec RUN -- true` as a shell runs it, one process per call: through the run's
/// mux (a `sandbox exec` before started it), without it (`RUNCELL_MUX=off`: the process
/// connects, attaches and opens its own exec), and, on Docker, `docker exec`; interleaved.
fn cli_calls(driver: &str, run: &str, rounds: usize) -> Res<()> {
    let sandbox = std::env::current_exe()?.with_file_name("sandbox");
    if !sandbox.exists() {
        return Err(format!(
            "{} is missing: `cargo build --release -p runcell-cli` (cargo xtask bench does)",
            sandbox.display()
        )
        .into());
    }
    let call = |mux: &str| -> Res<Duration> {
        let t = Instant::now();
        let out = std::process::Command::new(&sandbox)
            .args(["--driver", driver, "exec", run, "--", "true"])
            .env("RUNCELL_MUX", mux)
            .env("RUNCELL_MUX_IDLE", "10s")
            .stdin(std::process::Stdio::null())
            .output()?;
        let took = t.elapsed();
        if !out.status.success() {
            return Err(format!(
                "sandbox exec ({mux}): {}",
                String::from_utf8_lossy(&out.stderr)
            )
            .into());
        }
        Ok(took)
    };
    // Starts the mux (and waits for it).
    call("require")?;
    let docker_exec = || -> Res<Duration> {
        let t = Instant::now();
        let out = std::process::Command::new("docker")
            .args(["exec", run, "true"])
            .stdin(std::process::Stdio::null())
            .output()?;
        if !out.status.success() {
            return Err("docker exec failed".into());
        }
        Ok(t.elapsed())
    };
    let docker = driver == "docker";
    println!(
        "== {driver}: `sandbox exec RUN -- true` from a shell, {rounds} rounds of 5 per arm, interleaved"
    );
    let (mut m, mut o, mut d) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        for _ in 0..5 {
            m.push(call("require")?);
            o.push(call("off")?);
            if docker {
                d.push(docker_exec()?);
            }
        }
    }
    let (m, o) = (median(m), median(o));
    println!("through the run's mux   p50 {:8.2} ms", ms(m));
    println!("without it (own exec)   p50 {:8.2} ms", ms(o));
    println!("without/with mux {:6.1}x", ms(o) / ms(m));
    if !d.is_empty() {
        let d = median(d);
        println!("docker exec             p50 {:8.2} ms", ms(d));
        println!("docker exec/mux  {:6.1}x", ms(d) / ms(m));
    }
    Ok(())
}

/// Drains a stream: (time from `t` to its first output byte, bytes); fails unless it
/// ends in success.
async fn drain(t: Instant, mut stream: runcell_core::ExecStream) -> Res<(Duration, u64)> {
    let (mut first, mut bytes) = (None, 0u64);
    while let Some(chunk) = stream.next_chunk().await {
        if let OutputChunk::Stdout(b) = chunk {
            first.get_or_insert_with(|| t.elapsed());
            bytes += b.len() as u64;
        }
    }
    let status = stream.wait().await;
    if !status.success() {
        return Err(format!("reattached exec ended {status:?}").into());
    }
    Ok((first.unwrap_or_default(), bytes))
}

/// Reattach: to a finished detached exec whose 1 MiB of output the sandbox keeps, from
/// this process (the run's held stream) and as a new process would (a new driver, attach
/// the run, reattach); then the host's RSS over 1 000 reattaches, twice (the second
/// thousand must not grow it: nothing is kept per reattach).
async fn reattaches(
    driver: &Arc<dyn Driver>,
    name: &str,
    spec: &RunSpec,
    rounds: usize,
) -> Res<()> {
    if !driver.capabilities().durable_execs {
        return Ok(());
    }
    println!(
        "== {name}: reattach to a finished detached exec (1 MiB kept), {rounds} rounds, interleaved"
    );
    let run = driver.create(spec).await?;
    let script = "head -c 1048576 /dev/zero | tr '\\0' x";
    let stream = run
        .exec_stream(ExecSpec::new(["sh", "-c", script]).detach())
        .await?;
    let id = stream.exec_id().ok_or("a detached exec without an id")?;
    drop(stream);
    run.wait_exec(id).await?;
    let (mut same, mut same_all, mut fresh) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let t = Instant::now();
        let (first, bytes) = drain(t, run.reattach(id, 0).await?).await?;
        same_all.push(t.elapsed());
        same.push(first);
        assert_eq!(bytes, 1 << 20, "a reattach read the whole output");
        let t = Instant::now();
        let other = runcell_core::connect(name, DriverConfig::from_env(name)).await?;
        let attached = other.attach(run.id()).await?;
        let mut stream = attached.reattach(id, 0).await?;
        loop {
            match stream.next_chunk().await {
                Some(OutputChunk::Stdout(_)) => break,
                Some(_) => {}
                None => return Err("a reattach from a new driver read nothing".into()),
            }
        }
        fresh.push(t.elapsed());
        drop(stream);
    }
    println!(
        "this process: first byte p50 {:8.2} ms, all 1 MiB + status p50 {:8.2} ms",
        ms(median(same)),
        ms(median(same_all))
    );
    println!(
        "a new driver (connect, attach, reattach) to the first byte p50 {:8.2} ms",
        ms(median(fresh))
    );
    let mut after = Vec::new();
    let before = runcell_conformance::rss_bytes().unwrap_or(0);
    for _ in 0..2 {
        let t = Instant::now();
        for _ in 0..1000 {
            drain(Instant::now(), run.reattach(id, 1 << 19).await?).await?;
        }
        after.push((runcell_conformance::rss_bytes().unwrap_or(0), t.elapsed()));
    }
    println!(
        "host RSS over 1 000 reattaches (512 KiB each): {:+.1} MiB ({:.1} s); over the next 1 000: {:+.1} MiB ({:.1} s)",
        (after[0].0 as f64 - before as f64) / 1048576.0,
        after[0].1.as_secs_f64(),
        (after[1].0 as f64 - after[0].0 as f64) / 1048576.0,
        after[1].1.as_secs_f64(),
    );
    run.stop().await?;
    Ok(())
}

/// Snapshots, beside cold starts: a snapshot of a run with 50 MiB changed (half in the
/// image's filesystem, half in the workspace), a start from it, and a fork of 8.
async fn snapshots(driver: &Arc<dyn Driver>, name: &str, spec: &RunSpec, rounds: usize) -> Res<()> {
    let caps = driver.capabilities();
    if !(caps.snapshots || caps.snapshots_with_helper) {
        return Ok(());
    }
    let rounds = rounds.clamp(3, 5);
    println!(
        "== {name}: snapshots (50 MiB changed), {rounds} rounds, interleaved with cold starts"
    );
    let (mut snaps, mut froms, mut colds, mut forks) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        let source = driver.create(spec).await?;
        sh(
            &*source,
            "head -c 26214400 /dev/urandom > /usr/local/blob && head -c 26214400 /dev/urandom > blob",
        )
        .await?;
        let t = Instant::now();
        let snapshot = source
            .snapshot(runcell_core::SnapshotOptions::default())
            .await?;
        snaps.push(t.elapsed());
        let mut from = RunSpec::from_snapshot(&snapshot);
        from.labels = spec.labels.clone();
        from.network = spec.network;
        let t = Instant::now();
        let run = driver.create(&from).await?;
        call(&*run).await?;
        froms.push(t.elapsed());
        run.stop().await?;
        let t = Instant::now();
        let run = driver.create(spec).await?;
        call(&*run).await?;
        colds.push(t.elapsed());
        run.stop().await?;
        let t = Instant::now();
        let runs = runcell_core::DriverExt::fork(&**driver, &from, 8).await?;
        for run in &runs {
            call(&**run).await?;
        }
        forks.push(t.elapsed());
        for run in runs {
            run.stop().await?;
        }
        source.stop().await?;
        driver.remove_snapshot(&snapshot.id).await?;
    }
    let (s, f, c, k) = (median(snaps), median(froms), median(colds), median(forks));
    println!("snapshot (50 MiB changed)   p50 {:8.1} ms", ms(s));
    println!("start from the snapshot     p50 {:8.1} ms", ms(f));
    println!("cold start                  p50 {:8.1} ms", ms(c));
    println!("fork of 8 (all answered)    p50 {:8.1} ms", ms(k));
    println!(
        "from snapshot/cold {:5.2}x (goal <= 1.5); fork of 8/one start from it {:5.2}x (goal <= 3)",
        ms(f) / ms(c),
        ms(k) / ms(f)
    );
    Ok(())
}

#[tokio::main]
async fn main() -> Res<()> {
    // `RUST_LOG=runcell_core=debug` shows what the library does (and each span's time).
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
            .with_writer(std::io::stderr)
            .init();
    }
    runcell_core::stop_runs_on_signal()?;
    let mut args = std::env::args().skip(1);
    let name = args.next().unwrap_or_else(|| "docker".into());
    let rounds: usize = args.next().map(|n| n.parse()).transpose()?.unwrap_or(20);
    let driver: Arc<dyn Driver> =
        runcell_core::connect(&name, DriverConfig::from_env(&name)).await?;
    let docker = if name == "docker" {
        Some(bollard::Docker::connect_with_defaults()?)
    } else {
        None
    };
    // Snapshots on Kubernetes need an image from a registry (`RUNCELL_BENCH_IMAGE`).
    let image = std::env::var("RUNCELL_BENCH_IMAGE")
        .unwrap_or_else(|_| "sandbox-test/busybox:latest".into());
    let mut spec = RunSpec::new(image).label("sandbox.example/bench", "1");
    if driver.capabilities().network_none {
        spec = spec.network(Network::None);
    }
    // On Kubernetes, the same driver on kube's own client (Nagle's algorithm on:
    // kube-rs#2056), measured beside the driver's client (TCP_NODELAY).
    let kube_default: Option<Arc<dyn Driver>> = if name == "k8s" {
        let client = kube::Client::try_default().await?;
        let namespace = client.default_namespace().to_string();
        Some(Arc::new(runcell_k8s::K8sDriver::from_client(
            client,
            namespace,
            runcell_k8s::K8sConfig::default(),
        )?))
    } else {
        None
    };
    let helper_spec = spec.clone().exec_helper(ExecHelper::Required);
    let plain_spec = spec.clone().exec_helper(ExecHelper::Off);
    // One part alone (`RUNCELL_BENCH_ONLY=snapshots`), e.g. while working on it.
    if std::env::var("RUNCELL_BENCH_ONLY").as_deref() == Ok("snapshots") {
        return snapshots(&driver, &name, &spec, rounds).await;
    }

    println!("== {name}: one tool call (`true`), {rounds} rounds of 5 calls per arm, interleaved");
    let helper: Arc<dyn Run> = Arc::from(driver.create(&helper_spec).await?);
    let plain: Arc<dyn Run> = Arc::from(driver.create(&plain_spec).await?);
    assert_eq!(helper.exec_path(), ExecPath::Helper);
    assert_eq!(plain.exec_path(), ExecPath::Plain);
    let plain_kube: Option<Arc<dyn Run>> = match &kube_default {
        Some(d) => Some(Arc::from(d.create(&plain_spec).await?)),
        None => None,
    };
    let (mut h, mut p, mut r, mut pk) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        for _ in 0..5 {
            h.push(call(&*helper).await?);
            p.push(call(&*plain).await?);
            if let Some(run) = &plain_kube {
                pk.push(call(&**run).await?);
            }
            if let Some(docker) = &docker {
                let t = Instant::now();
                raw_exec(docker, plain.id()).await?;
                r.push(t.elapsed());
            }
        }
    }
    let (h, p) = (median(h), median(p));
    println!("helper path       p50 {:8.2} ms", ms(h));
    println!("plain path        p50 {:8.2} ms", ms(p));
    if !r.is_empty() {
        let r = median(r);
        println!("raw Engine API    p50 {:8.2} ms", ms(r));
        println!(
            "plain/raw  {:6.2}x (what the library adds on the plain path)",
            ms(p) / ms(r)
        );
        println!("raw/helper {:6.1}x", ms(r) / ms(h));
    }
    println!("plain/helper {:6.1}x", ms(p) / ms(h));
    if let Some(run) = plain_kube {
        let pk = median(pk);
        println!("plain path, kube's own client p50 {:8.2} ms", ms(pk));
        println!(
            "kube's own client/ours (plain) {:5.2}x; plain on kube's own client/helper {:5.1}x",
            ms(pk) / ms(p),
            ms(pk) / ms(h)
        );
        run.stop().await?;
    }

    cli_calls(&name, helper.id(), rounds)?;

    println!("== {name}: throughput on one run, parallelism 8 (helper, plain, helper, plain)");
    let mut hs = Vec::new();
    let mut ps = Vec::new();
    for _ in 0..2 {
        hs.push(throughput(&helper, 8, 2000).await?);
        ps.push(throughput(&plain, 8, 80).await?);
    }
    let (ht, pt) = (hs.iter().sum::<f64>() / 2.0, ps.iter().sum::<f64>() / 2.0);
    println!(
        "helper {ht:8.0} execs/s   plain {pt:6.1} execs/s   helper/plain {:5.1}x",
        ht / pt
    );

    println!("== {name}: memory");
    let rss = RssSampler::start();
    let t = Instant::now();
    throughput(&helper, 8, 10_000).await?;
    let growth = rss.stop().await.unwrap_or(0);
    println!(
        "host RSS growth over 10 000 helper execs: {:.1} MiB ({:.1} s)",
        mib(growth),
        t.elapsed().as_secs_f64()
    );
    for (path, run) in [("helper", &helper), ("plain", &plain)] {
        for (what, growth, secs) in big_transfers(&**run).await? {
            println!(
                "{path:6} 256 MiB {what:8}: host RSS growth {:5.1} MiB, {:5.1} s ({:6.0} MiB/s)",
                mib(growth),
                secs,
                256.0 / secs
            );
        }
    }
    println!(
        "helper RSS in the sandbox (idle): {} kB",
        helper_rss_kb(&*helper).await?
    );
    reattaches(&driver, &name, &helper_spec, rounds).await?;
    helper.stop().await?;
    plain.stop().await?;

    snapshots(&driver, &name, &spec, rounds).await?;

    let starts = rounds.min(10);
    println!("== {name}: run start → first exec answered, {starts} rounds, interleaved");
    let (mut hs, mut ps, mut fresh, mut stops) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..starts {
        let t = Instant::now();
        let run = driver.create(&helper_spec).await?;
        call(&*run).await?;
        hs.push(t.elapsed());
        let s = Instant::now();
        run.stop().await?;
        stops.push(s.elapsed());
        let t = Instant::now();
        let run = driver.create(&plain_spec).await?;
        call(&*run).await?;
        ps.push(t.elapsed());
        run.stop().await?;
        fresh.push(t.elapsed());
    }
    let (hs, ps, fresh) = (median(hs), median(ps), median(fresh));
    println!("with the helper   p50 {:8.1} ms", ms(hs));
    println!("plain             p50 {:8.1} ms", ms(ps));
    println!("helper/plain start {:5.2}x", ms(hs) / ms(ps));
    println!(
        "a fresh {} per call (create, exec, stop) p50 {:.1} ms = {:.0}x a helper call; stop p50 {:.1} ms",
        if name == "docker" { "container" } else { "pod" },
        ms(fresh),
        ms(fresh) / ms(h),
        ms(median(stops))
    );

    if driver.capabilities().pool {
        let rounds = rounds.max(10);
        println!(
            "== {name}: start → first exec answered, cold vs claimed from a warm pool, {rounds} rounds, interleaved"
        );
        // A run with a setting of its own, as an engine's would have.
        let run_spec = spec.clone().env("RUN_TOKEN", "per-run");
        let mut arms = vec![("from a warm pool", driver.clone())];
        if let Some(kube_default) = &kube_default {
            arms.push(("pooled, kube's own client", kube_default.clone()));
        }
        let mut pools = Vec::new();
        for (label, driver) in &arms {
            let config = runcell_core::PoolConfig::default().min_ready(1);
            pools.push((
                *label,
                runcell_core::Pool::new(driver.clone(), &spec, config)?,
            ));
        }
        let mut cold = Vec::new();
        let mut pooled = vec![Vec::new(); pools.len()];
        for _ in 0..rounds {
            let t = Instant::now();
            let run = driver.create(&run_spec).await?;
            call(&*run).await?;
            cold.push(t.elapsed());
            run.stop().await?;
            for ((_, pool), times) in pools.iter().zip(&mut pooled) {
                // Measured from a ready pool: what a claim costs, not a refill.
                pool.wait_ready(1, Duration::from_secs(120)).await?;
                let t = Instant::now();
                let run = pool.create(&run_spec, Default::default()).await?;
                call(&*run).await?;
                times.push(t.elapsed());
                run.stop().await?;
            }
        }
        let c = median(cold);
        println!("cold              p50 {:8.1} ms", ms(c));
        let mut medians = Vec::new();
        for ((label, pool), times) in pools.into_iter().zip(pooled) {
            let stats = pool.stats();
            assert_eq!(stats.hits as usize, rounds, "{stats:?}");
            pool.shutdown().await?;
            let w = median(times);
            println!("{label:17} p50 {:8.1} ms", ms(w));
            medians.push(w);
        }
        println!("cold/pooled {:6.1}x", ms(c) / ms(medians[0]));
        if let Some(kube_default) = medians.get(1) {
            println!(
                "kube's own client/ours (pooled) {:5.2}x",
                ms(*kube_default) / ms(medians[0])
            );
        }
    }

    // An idle run: on Kubernetes the node cuts idle exec streams (the test cluster's
    // kubelet after 30 s); the held helper stream must outlive that.
    let idle: u64 = match std::env::var("RUNCELL_BENCH_IDLE_SECS") {
        Ok(v) => v.parse()?,
        Err(_) if name == "k8s" => 65,
        Err(_) => 0,
    };
    if idle > 0 {
        println!("== {name}: first exec after {idle} s idle (the helper's held stream)");
        let run = driver.create(&helper_spec).await?;
        sh(&*run, "sleep 100000 >/dev/null 2>&1 & echo $! > /tmp/bg").await?;
        call(&*run).await?;
        let path = run.exec_path();
        tokio::time::sleep(Duration::from_secs(idle)).await;
        let first = call(&*run).await?;
        let alive = run
            .exec(ExecSpec::new([
                "sh",
                "-c",
                "kill -0 $(cat /tmp/bg) && echo alive",
            ]))
            .await?;
        println!(
            "first exec after the idle {:8.2} ms; background process {}; exec path {:?} -> {:?}",
            ms(first),
            if alive.stdout_str() == "alive\n" {
                "alive"
            } else {
                "GONE"
            },
            path,
            run.exec_path()
        );
        run.stop().await?;
    }

    let left = driver
        .list(
            &[("sandbox.example/bench".to_string(), "1".to_string())]
                .into_iter()
                .collect(),
        )
        .await?;
    assert!(left.is_empty(), "the benchmark leaked runs");
    Ok(())
}
