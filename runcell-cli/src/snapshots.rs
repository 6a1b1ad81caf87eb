//! `sandbox snapshot`, `snapshots`, `fork`, `rm-snapshot`, and `--from-snapshot`.

use std::time::Duration;

use clap::Args;
use runcell_core::{
    CreateOptions, Driver, DriverExt, Error, ErrorKind, RunSpec, Snapshot, SnapshotOptions,
};

use crate::errors::Failure;
use crate::spec::SpecArgs;
use crate::units;

/// A snapshot's default lifetime from the CLI (it belongs to no process).
const DEFAULT_TTL: Duration = Duration::from_secs(7 * 24 * 3600);

#[derive(Args)]
pub struct SnapshotArgs {
    /// The run id.
    run: String,
    /// A name to find it by (up to 63 of A-Z a-z 0-9 . _ -).
    #[arg(long)]
    name: Option<String>,
    /// How long it is kept; past it `sandbox gc` removes it. Default 7d.
    #[arg(long, value_name = "DURATION", value_parser = units::parse_duration)]
    ttl: Option<Duration>,
}

pub async fn snapshot(
    driver: &dyn Driver,
    args: &SnapshotArgs,
    quiet: bool,
) -> Result<i32, Failure> {
    let mut options = SnapshotOptions::default()
        .detached(true)
        .ttl(args.ttl.unwrap_or(DEFAULT_TTL));
    if let Some(name) = &args.name {
        options = options.name(name);
    }
    options.validate()?;
    let run = driver.attach(&args.run).await?;
    if !quiet {
        eprintln!("sandbox: saving {}'s filesystem and workspace...", run.id());
    }
    let started = std::time::Instant::now();
    let snapshot = run.snapshot(options).await?;
    if !quiet {
        eprintln!(
            "sandbox: {} ({}, {:.1} s)",
            snapshot.id,
            size(snapshot.size_bytes),
            started.elapsed().as_secs_f64()
        );
    }
    println!("{}", snapshot.id);
    Ok(0)
}

/// The spec a run from `args.from_snapshot` starts with: the snapshot's image (by ID) and
/// workspace path, the rest as built. `spec` unchanged without it.
pub async fn resolve(
    driver: &dyn Driver,
    spec: RunSpec,
    args: &SpecArgs,
) -> Result<RunSpec, Error> {
    let Some(id) = &args.from_snapshot else {
        return Ok(spec);
    };
    runcell_core::check_snapshot_id(id).map_err(|e| e.with_field("from_snapshot"))?;
    let snapshot = find(driver, id).await?;
    let from = RunSpec::from_snapshot(&snapshot);
    Ok(RunSpec {
        image: from.image,
        pull: from.pull,
        workspace: from.workspace,
        from_snapshot: from.from_snapshot,
        ..spec
    })
}

async fn find(driver: &dyn Driver, id: &str) -> Result<Snapshot, Error> {
    driver
        .snapshots()
        .await?
        .into_iter()
        .find(|s| s.id == id)
        .ok_or_else(|| {
            Error::new(ErrorKind::NotFound, format!("no snapshot {id}")).with_field("from_snapshot")
        })
}

/// Starts `n` detached runs of `spec` at once (8 in flight); all or none.
pub async fn fork(
    driver: &dyn Driver,
    spec: &RunSpec,
    n: usize,
    quiet: bool,
) -> Result<i32, Failure> {
    if n == 0 || n > 1000 {
        return Err(Failure::usage("-n: between 1 and 1000 runs"));
    }
    let started = std::time::Instant::now();
    let runs = driver
        .fork_with(spec, n, CreateOptions::default().detached(true))
        .await?;
    for run in &runs {
        println!("{}", run.id());
    }
    if !quiet {
        eprintln!(
            "sandbox: {n} runs from {} in {:.1} s",
            spec.from_snapshot.as_deref().unwrap_or_default(),
            started.elapsed().as_secs_f64()
        );
    }
    Ok(0)
}

pub async fn remove(driver: &dyn Driver, ids: &[String]) -> Result<i32, Failure> {
    for id in ids {
        driver.remove_snapshot(id).await?;
        println!("{id}");
    }
    Ok(0)
}

pub async fn list(driver: &dyn Driver, json: bool) -> Result<i32, Failure> {
    let mut all = driver.snapshots().await?;
    all.sort_by(|a, b| (a.created, &a.id).cmp(&(b.created, &b.id)));
    if json {
        let rows: Vec<serde_json::Value> = all
            .iter()
            .map(|s| {
                serde_json::json!({
                    "id": s.id, "name": s.name(), "source_run": s.source_run,
                    "base_image": s.base_image, "image": s.image,
                    "workspace_path": s.workspace_path, "size_bytes": s.size_bytes,
                    "created": s.created,
                    "expires_at": s.labels.get(runcell_core::snapshot_labels::SNAPSHOT_EXPIRES_AT)
                        .and_then(|v| v.parse::<u64>().ok()),
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&rows).unwrap_or_else(|_| "[]".into())
        );
        return Ok(0);
    }
    println!(
        "{:<22} {:<16} {:<18} {:>10} {:<12} EXPIRES",
        "ID", "NAME", "SOURCE", "SIZE", "CREATED"
    );
    let now = crate::now_secs();
    for s in &all {
        let expires = s
            .labels
            .get(runcell_core::snapshot_labels::SNAPSHOT_EXPIRES_AT)
            .and_then(|v| v.parse::<u64>().ok())
            .map_or("never".to_string(), |at| {
                if at <= now {
                    "expired".into()
                } else {
                    format!("in {}", ago(at - now))
                }
            });
        println!(
            "{:<22} {:<16} {:<18} {:>10} {:<12} {expires}",
            s.id,
            s.name().unwrap_or("-"),
            s.source_run,
            size(s.size_bytes),
            format!("{} ago", ago(now.saturating_sub(s.created))),
        );
    }
    Ok(0)
}

fn ago(secs: u64) -> String {
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86400),
    }
}

fn size(bytes: u64) -> String {
    match bytes {
        b if b < 10 << 10 => format!("{b} B"),
        b if b < 10 << 20 => format!("{} kB", b >> 10),
        b => format!("{} MB", b >> 20),
    }
}
