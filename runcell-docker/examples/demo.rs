//! The main job: start a run, exec several commands into it, show that the workspace and
//! environment persist across execs, stop it, and show that nothing is left.
//!
//! The same job as `cargo xtask demo` (which goes through the `sandbox` CLI), written
//! against the library: `cargo run -p runcell-docker --example demo -- [IMAGE]` after
//! `cargo xtask test-images`; `RUST_LOG=debug` shows the library's spans.

use std::collections::BTreeMap;

use runcell_core::{Driver, DriverExt, ExecSpec, Network, RunExt, RunSpec, labels};
use runcell_docker::{DockerConfig, DockerDriver};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let image = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "sandbox-test/busybox:latest".into());
    // RUST_LOG=debug shows a span per run and per exec (program names, never arguments).
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    // Ctrl-C or SIGTERM while the demo runs: stop the run before exiting.
    runcell_core::stop_runs_on_signal()?;
    let driver = DockerDriver::connect(DockerConfig::default()).await?;
    let host_dir = tempfile::tempdir()?;
    let demo_label = format!("demo-{}", std::process::id());

    let mut spec = RunSpec::new(&image)
        .workspace_dir(host_dir.path())
        .env("GREETING", "hello from the run env")
        .label("sandbox.example/demo", &demo_label)
        .post_create(["sh", "-c", "echo prepared-by-post-create > setup.txt"]);
    spec.network = Network::None;

    let started = std::time::Instant::now();
    let run = driver.start(&spec).await?;
    println!("run {} started in {:?}", run.id(), started.elapsed());

    let steps: [&[&str]; 5] = [
        &["pwd"],
        &["sh", "-c", "echo $GREETING"],
        &[
            "sh",
            "-c",
            "echo 'written by exec 3' > notes.txt; export LOCAL=gone",
        ],
        &[
            "sh",
            "-c",
            "cat setup.txt notes.txt; echo LOCAL=${LOCAL:-unset}",
        ],
        &["sh", "-c", "echo to stderr >&2; exit 7"],
    ];
    for argv in steps {
        let t = std::time::Instant::now();
        let out = run.exec(ExecSpec::new(argv.iter().copied())).await?;
        println!(
            "$ {:<55} -> {} in {:?}\n  stdout: {:?}\n  stderr: {:?}",
            argv.join(" "),
            out.status,
            t.elapsed(),
            out.stdout_str(),
            out.stderr_str()
        );
    }
    let on_host = std::fs::read_to_string(host_dir.path().join("notes.txt"))?;
    println!("host side of the workspace, notes.txt: {on_host:?}");

    let id = run.id().to_string();
    let t = std::time::Instant::now();
    run.stop().await?;
    println!("run {id} stopped in {:?}", t.elapsed());
    let left = driver
        .list(&BTreeMap::from([(
            "sandbox.example/demo".to_string(),
            demo_label,
        )]))
        .await?;
    println!("runs left with the demo's label: {}", left.len());
    let all_managed = driver
        .list(&BTreeMap::from([(labels::RUN_ID.to_string(), id)]))
        .await?;
    assert!(
        left.is_empty() && all_managed.is_empty(),
        "the demo leaked a run"
    );
    Ok(())
}
