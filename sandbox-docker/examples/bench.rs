//! Measures, side by side in one run, what the per-run design buys: the cost of a tool
//! call as an exec into the run's long-lived container, against a fresh container per
//! call (create + exec + remove), and the cost of stop; and what the library adds over
//! the raw Engine API (bollard's create/start/inspect exec into the same container).
//! Prints medians and the ratios.
//!
//! `cargo xtask bench` (or `cargo run --release -p runcell-docker --example bench -- [N]`).

use std::time::{Duration, Instant};

use bollard::exec::{CreateExecOptions, StartExecResults};
use futures::StreamExt;
use runcell_core::{Driver, DriverExt, ExecSpec, Network, RunExt, RunSpec};
use runcell_docker::{DockerConfig, DockerDriver};

/// One `true` through the raw Engine API, as a hand-written client would do it.
async fn raw_exec(
    docker: &bollard::Docker,
    container: &str,
) -> Result<(), Box<dyn std::error::Error>> {
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

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    runcell_core::stop_runs_on_signal()?;
    let rounds: usize = std::env::args()
        .nth(1)
        .map(|n| n.parse())
        .transpose()?
        .unwrap_or(10);
    let driver = DockerDriver::connect(DockerConfig::default()).await?;
    let mut spec = RunSpec::new("sandbox-test/busybox:latest").label("sandbox.example/bench", "1");
    spec.network = Network::None;

    let (mut in_run, mut fresh, mut stops, mut starts, mut raw) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let run = driver.start(&spec).await?;
    // Interleaved rounds, so that machine noise hits both sides alike.
    for _ in 0..rounds {
        for _ in 0..5 {
            let t = Instant::now();
            let out = run.exec(ExecSpec::new(["true"])).await?;
            assert!(out.status.success());
            in_run.push(t.elapsed());
            let t = Instant::now();
            raw_exec(driver.client(), run.id()).await?;
            raw.push(t.elapsed());
        }
        let t = Instant::now();
        let one = driver.create(&spec).await?;
        starts.push(t.elapsed());
        let out = one.exec(ExecSpec::new(["true"])).await?;
        assert!(out.status.success());
        let s = Instant::now();
        one.stop().await?;
        stops.push(s.elapsed());
        fresh.push(t.elapsed());
    }
    run.stop().await?;
    let (a, b, r) = (median(in_run), median(fresh), median(raw));
    println!(
        "tool call as exec into the run's container: median {:7.1} ms",
        ms(a)
    );
    println!(
        "same call through the raw Engine API (bollard):      median {:7.1} ms",
        ms(r)
    );
    println!(
        "library/raw: {:.2}x (the library adds validation, the exec marker, the pump)",
        a.as_secs_f64() / r.as_secs_f64()
    );
    println!(
        "tool call in a fresh container (create+exec+remove): median {:7.1} ms",
        ms(b)
    );
    println!(
        "  of which create+start {:.1} ms, stop {:.1} ms",
        ms(median(starts)),
        ms(median(stops))
    );
    println!(
        "ratio fresh/exec: {:.1}x ({} rounds, 5 execs each)",
        b.as_secs_f64() / a.as_secs_f64(),
        rounds
    );
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
