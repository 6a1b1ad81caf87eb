//! Warm pools: claims, exclusivity across processes, exhaustion, shape mismatches, and
//! cleanup (drop, shutdown, idle expiry, a killed owner). That a pooled run behaves like
//! a cold one is shown by the whole suite on pooled runs (`RUNCELL_CONFORMANCE_POOLED`);
//! the first case here checks it once more on a run with every run-specific setting.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Context as _, ensure};
use runcell_core::{
    ErrorKind, ExecSpec, OnEmpty, OnMismatch, Pool, PoolConfig, Proxy, ReapReason, RunExt,
};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::harness::{CLAIMS_ENV, OwnerMode};
use crate::{Context, TEST_CA, sh_stdout};

const READY: Duration = Duration::from_secs(180);

fn pool(cx: &Context, config: PoolConfig) -> anyhow::Result<Pool> {
    Ok(Pool::new(cx.driver.clone(), &cx.spec(), config)?)
}

/// The ids of what the backend holds with the case's labels.
async fn case_ids(cx: &Context) -> anyhow::Result<BTreeSet<String>> {
    let runs = cx.driver.list(&cx.case_selector()).await?;
    Ok(runs.into_iter().map(|r| r.id).collect())
}

/// A run claimed from a pool has everything run-specific the spec asks for (env, proxy,
/// CA files, working directory, host workspace, post-create) though its target was
/// created without any of it; the pool refills; the stats count the hit.
pub async fn a_pooled_run_gets_its_own_settings(cx: &Context) -> anyhow::Result<()> {
    let pool = pool(cx, PoolConfig::default().min_ready(1))?;
    pool.wait_ready(1, READY).await?;
    let host = tempfile::tempdir()?;
    std::fs::write(host.path().join("from-host.txt"), "seeded")?;
    let spec = cx
        .spec()
        .env("RUN_SETTING", "pooled value")
        .proxy(Proxy {
            http: Some("http://proxy.invalid:3128".into()),
            ..Default::default()
        })
        .ca_bundle(TEST_CA)
        .workspace_dir(host.path())
        .working_dir("/workspace/sub/dir")
        .post_create([
            "sh",
            "-c",
            "echo made-by-post-create > /workspace/setup.txt",
        ]);
    let run = pool.start(&spec).await?;
    let stats = pool.stats();
    ensure!(stats.hits == 1 && stats.misses == 0, "{stats:?}");
    ensure!(sh_stdout(&*run, "echo $RUN_SETTING").await? == "pooled value");
    ensure!(
        sh_stdout(&*run, "echo $HTTP_PROXY $http_proxy").await?
            == "http://proxy.invalid:3128 http://proxy.invalid:3128"
    );
    ensure!(sh_stdout(&*run, "pwd").await? == "/workspace/sub/dir");
    ensure!(sh_stdout(&*run, "cat /workspace/from-host.txt").await? == "seeded");
    ensure!(sh_stdout(&*run, "cat /workspace/setup.txt").await? == "made-by-post-create");
    let ca = sh_stdout(&*run, "cat $SSL_CERT_FILE").await?;
    ensure!(
        ca.contains(TEST_CA.lines().nth(1).unwrap_or_default()),
        "the bundle lacks the CA"
    );
    // An exec's own env and directory still win over the run's.
    let out = run
        .exec(
            ExecSpec::new(["sh", "-c", "echo $RUN_SETTING; pwd"])
                .env("RUN_SETTING", "exec")
                .working_dir("/tmp"),
        )
        .await?;
    ensure!(out.stdout_str() == "exec\n/tmp\n", "{:?}", out.stdout_str());
    // Attached from elsewhere, the run execs the same way.
    let attached = cx.driver.attach(run.id()).await?;
    ensure!(
        sh_stdout(&*attached, "echo $RUN_SETTING; pwd").await?
            == "pooled value\n/workspace/sub/dir"
    );
    if let Some(wanted) = super::helper::wanted_path() {
        ensure!(
            run.exec_path() == wanted,
            "a pooled run takes {:?}",
            run.exec_path()
        );
    }
    sh_stdout(&*run, "echo from-run > /workspace/from-run.txt").await?;
    run.stop().await?;
    if cx.caps.workspace_mount {
        // Where a cold run mounts the workspace, a pooled one copies it back at stop.
        let back = std::fs::read_to_string(host.path().join("from-run.txt"))?;
        ensure!(back == "from-run\n", "the host has {back:?}");
    }
    pool.wait_ready(1, READY)
        .await
        .context("the pool did not refill")?;
    pool.shutdown().await?;
    cx.assert_case_clean().await
}

/// Two processes claiming from one pool at once never get the same target, and each
/// run has its own settings.
pub async fn concurrent_claims_from_two_processes_never_share(cx: &Context) -> anyhow::Result<()> {
    const EACH: usize = 3;
    let pool = pool(cx, PoolConfig::default().min_ready(2 * EACH).parallel(3))?;
    pool.wait_ready(2 * EACH, READY).await?;
    let mut child = crate::harness::spawn_child(
        cx,
        OwnerMode::PoolClaimer,
        &[(CLAIMS_ENV, &EACH.to_string())],
    )?;
    let stdout = child.stdout.take().context("the child's stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let first = tokio::time::timeout(Duration::from_secs(60), lines.next_line()).await??;
    ensure!(
        first.as_deref() == Some("READY"),
        "the child said {first:?}"
    );
    let mut stdin = child.stdin.take().context("the child's stdin")?;
    stdin.write_all(b"go\n").await?;
    let spec = cx.spec().env("WHO", "parent");
    let ours = futures::future::join_all((0..EACH).map(|_| pool.start(&spec))).await;
    let mut theirs = BTreeSet::new();
    loop {
        let line = tokio::time::timeout(Duration::from_secs(120), lines.next_line())
            .await
            .context("the child did not finish")??;
        match line.as_deref() {
            Some("DONE") => break,
            Some(l) if l.starts_with("RUN ") => {
                theirs.insert(l[4..].to_string());
            }
            other => anyhow::bail!(
                "the child said {other:?} (exit {:?}); this side's pool: {:?}",
                child.wait().await,
                pool.stats()
            ),
        }
    }
    ensure!(child.wait().await?.success(), "the child failed");
    let mut runs = Vec::new();
    for run in ours {
        runs.push(run?);
    }
    let ids: BTreeSet<String> = runs.iter().map(|r| r.id().to_string()).collect();
    ensure!(
        ids.len() == EACH && theirs.len() == EACH,
        "ours {ids:?}, theirs {theirs:?}"
    );
    ensure!(
        ids.is_disjoint(&theirs),
        "shared targets: ours {ids:?}, theirs {theirs:?}"
    );
    // The child stopped its runs; ours live on with their own settings.
    for run in &runs {
        ensure!(sh_stdout(&**run, "echo $WHO").await? == "parent");
    }
    let listed: BTreeSet<String> = case_ids(cx).await?;
    ensure!(
        listed.is_disjoint(&theirs),
        "the child's runs are still there: {listed:?}"
    );
    for run in runs {
        run.stop().await?;
    }
    pool.shutdown().await?;
    cx.assert_case_clean().await
}

/// With nothing ready, a pool errors (`on_empty: fail`, naming `pool`, creating nothing)
/// or starts the run cold (`on_empty: create`, counted as a miss).
pub async fn an_exhausted_pool_errors_or_falls_back(cx: &Context) -> anyhow::Result<()> {
    let strict = pool(
        cx,
        PoolConfig::default()
            .min_ready(0)
            .max(0)
            .on_empty(OnEmpty::Fail),
    )?;
    let e = match strict.start(&cx.spec()).await {
        Ok(run) => {
            run.stop().await?;
            anyhow::bail!("an empty pool with on_empty: fail started a run");
        }
        Err(e) => e,
    };
    ensure!(
        e.kind() == ErrorKind::Unavailable && e.field() == Some("pool"),
        "{e}"
    );
    cx.assert_case_clean().await?;
    strict.shutdown().await?;
    let lenient = pool(cx, PoolConfig::default().min_ready(0).max(0))?;
    let run = lenient.start(&cx.spec().env("K", "v")).await?;
    ensure!(sh_stdout(&*run, "echo $K").await? == "v");
    let stats = lenient.stats();
    ensure!(stats.misses == 1 && stats.hits == 0, "{stats:?}");
    run.stop().await?;
    lenient.shutdown().await?;
    cx.assert_case_clean().await
}

/// A spec of another shape is refused naming the field that differs (before anything is
/// claimed or created), or started cold when the pool says so.
pub async fn a_spec_of_another_shape_is_refused_or_cold(cx: &Context) -> anyhow::Result<()> {
    let strict = pool(cx, PoolConfig::default().min_ready(0).max(0))?;
    let other = cx.spec_with_image(&crate::no_tar_image());
    let e = strict
        .create(&other, Default::default())
        .await
        .err()
        .context("a spec of another image was accepted")?;
    ensure!(
        e.kind() == ErrorKind::InvalidSpec && e.field() == Some("image"),
        "{e}"
    );
    let bigger = cx.spec().pids(4096);
    if cx.caps.pids_limit {
        let e = strict
            .create(&bigger, Default::default())
            .await
            .err()
            .context("other resources were accepted")?;
        ensure!(e.field() == Some("resources"), "{e}");
    }
    if !cx.caps.pool_relabel {
        let e = strict
            .create(&cx.spec().label("extra", "x"), Default::default())
            .await
            .err()
            .context("other labels were accepted")?;
        ensure!(e.field() == Some("labels"), "{e}");
    }
    ensure!(strict.stats().misses == 0, "{:?}", strict.stats());
    cx.assert_case_clean().await?;
    strict.shutdown().await?;
    let lenient = pool(
        cx,
        PoolConfig::default()
            .min_ready(0)
            .max(0)
            .on_mismatch(OnMismatch::Cold),
    )?;
    let run = lenient.start(&other).await?;
    ensure!(sh_stdout(&*run, "echo ok").await? == "ok");
    ensure!(lenient.stats().mismatches == 1, "{:?}", lenient.stats());
    run.stop().await?;
    lenient.shutdown().await?;
    cx.assert_case_clean().await
}

/// Dropping a pool removes its ready targets and the ones being created; shutting one down
/// does too; runs it handed out live on.
pub async fn dropping_a_pool_leaves_nothing(cx: &Context) -> anyhow::Result<()> {
    let filled = pool(cx, PoolConfig::default().min_ready(2))?;
    filled.wait_ready(2, READY).await?;
    let run = filled.start(&cx.spec()).await?;
    drop(filled);
    let left = case_ids(cx).await?;
    ensure!(
        left == BTreeSet::from([run.id().to_string()]),
        "after the drop: {left:?}"
    );
    ensure!(sh_stdout(&*run, "echo alive").await? == "alive");
    run.stop().await?;
    // Dropped while its first targets are still being created.
    let creating = pool(cx, PoolConfig::default().min_ready(2))?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(creating);
    // A cancelled create is removed again shortly after, for a request in flight.
    tokio::time::sleep(Duration::from_secs(3)).await;
    cx.assert_case_clean().await?;
    let shut = pool(cx, PoolConfig::default().min_ready(1))?;
    shut.wait_ready(1, READY).await?;
    shut.shutdown().await?;
    cx.assert_case_clean().await
}

/// A ready target unclaimed past the idle TTL is replaced.
pub async fn idle_pooled_targets_are_replaced(cx: &Context) -> anyhow::Result<()> {
    let pool = pool(
        cx,
        PoolConfig::default()
            .min_ready(1)
            .idle_ttl(Duration::from_secs(2)),
    )?;
    pool.wait_ready(1, READY).await?;
    let first: BTreeSet<String> = case_ids(cx).await?;
    let deadline = std::time::Instant::now() + READY;
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let stats = pool.stats();
        if stats.expired >= 1 && stats.ready >= 1 {
            break;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "no replacement: {stats:?}"
        );
    }
    let now: BTreeSet<String> = case_ids(cx).await?;
    ensure!(
        first.is_disjoint(&now),
        "the idle target is still there: before {first:?}, now {now:?}"
    );
    pool.shutdown().await?;
    cx.assert_case_clean().await
}

/// The targets of a pool whose process was SIGKILLed are removed by reap.
pub async fn reap_removes_the_pool_of_a_killed_owner(cx: &Context) -> anyhow::Result<()> {
    let mut child = crate::harness::spawn_owner_child(cx, OwnerMode::Pool)?;
    crate::harness::read_child_run_id(&mut child).await?;
    child.kill().await?;
    child.wait().await?;
    let live = cx.driver.list(&cx.case_selector()).await?;
    ensure!(
        live.len() >= 2,
        "the killed pool's targets are not listed: {live:?}"
    );
    let reaped = runcell_core::reap(&*cx.driver, &cx.case_selector()).await?;
    ensure!(
        reaped.len() == live.len() && reaped.iter().all(|(_, why)| *why == ReapReason::OwnerGone),
        "reap removed {reaped:?} of {live:?}"
    );
    cx.assert_case_clean().await
}
