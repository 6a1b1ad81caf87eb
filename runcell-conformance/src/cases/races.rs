//! File operations race a hostile user: an unprivileged exec that owns a directory keeps
//! trading a real directory in it for a symbolic link to a root-only directory, while the
//! host writes into it, sets modes in it and reads from it as the run's (root) user.
//! Nothing may ever land in, change or come out of the root-only directory.
//!
//! The guarantee is the helper's (it resolves every path through held descriptors and
//! follows no link that such a user could have placed). The plain path uses the engine's
//! own file operations (Docker's archive API, `tar` through exec on Kubernetes), which
//! follow such links; the README says so, and the helper is the default. These cases run
//! where file operations go through the helper and execs can run as another user.

use std::time::Duration;

use anyhow::{Context as _, bail, ensure};
use futures::StreamExt;
use runcell_core::files::{byte_stream, tar_of_dirs, tar_of_files};
use runcell_core::{DriverExt, ErrorKind, ExecPath, ExecSpec, Run, RunExt};

use super::isolation::{PROBE_PATH, upload_probe};
use crate::{Context, sh_ok, sh_stdout};

/// Rounds of the three operations, each while the names keep trading places.
const ROUNDS: usize = 200;

/// Where an exec user racing file operations cannot make them touch what it cannot.
pub async fn file_operations_never_follow_a_link_another_user_swaps_in(
    cx: &Context,
) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    if run.exec_path() != ExecPath::Helper || !cx.caps.exec_user {
        // The plain path's file operations are the engine's (module docs).
        run.stop().await?;
        return Ok(());
    }
    let result = race(&*run).await;
    run.stop().await?;
    result
}

async fn race(run: &dyn Run) -> anyhow::Result<()> {
    upload_probe(run).await?;
    // `/canary` is root's alone; `/tmp/race` belongs to the attacker, with `d` a directory
    // and `l` a link to `/canary`, which it keeps exchanging.
    sh_ok(
        run,
        "mkdir -m 700 /canary && echo secret > /canary/secret && chmod 600 /canary/secret \
         && mkdir -m 755 /tmp/race /tmp/race/d && ln -s /canary /tmp/race/l \
         && chown 65534:65534 /tmp/race /tmp/race/d && chown -h 65534:65534 /tmp/race/l",
    )
    .await?;
    let mut attacker = run
        .exec_stream(
            ExecSpec::new([PROBE_PATH, "swap", "/tmp/race/d", "/tmp/race/l"])
                .user("65534")
                .timeout(Duration::from_secs(600)),
        )
        .await?;
    let started = attacker.next_chunk().await;
    ensure!(
        matches!(&started, Some(runcell_core::OutputChunk::Stdout(b)) if b.starts_with(b"swapping")),
        "the swapping exec did not start: {started:?}"
    );
    let (mut done, mut refused) = (0, 0);
    let mut tally = |what: &str, r: runcell_core::Result<()>| -> anyhow::Result<()> {
        if refusal(what, r)? {
            refused += 1;
        } else {
            done += 1;
        }
        Ok(())
    };
    let dir_tar = tar_of_dirs(&["d"])?;
    let file_tar = tar_of_files(&[("d/planted", b"pwn", 0o4777)])?;
    for round in 0..ROUNDS {
        // A file written through the racing name.
        let r = run.put_file("/tmp/race/d/planted", b"pwn", 0o4777).await;
        tally("put_file", r)?;
        // A directory entry at the racing name: its mode and owner are set.
        let r = run
            .put_archive("/tmp/race", byte_stream(dir_tar.clone()))
            .await;
        tally("put_archive of a directory", r)?;
        let r = run
            .put_archive("/tmp/race", byte_stream(file_tar.clone()))
            .await;
        tally("put_archive of a file below it", r)?;
        // A read through the racing name.
        match run.get_archive("/tmp/race/d").await {
            Ok(mut tar) => {
                let mut got = Vec::new();
                while let Some(chunk) = tar.next().await {
                    match chunk {
                        Ok(c) => got.extend_from_slice(&c),
                        // A name that vanished under the read.
                        Err(_) => break,
                    }
                }
                ensure!(
                    !got.windows(6).any(|w| w == b"secret"),
                    "round {round}: a read through a swapped link shipped root's file out"
                );
                tally("get_archive", Ok(()))?;
            }
            Err(e) => tally("get_archive", Err(e))?,
        }
        // A path through the link itself is never followed.
        if let Ok(data) = run.get_file("/tmp/race/l/secret").await {
            bail!("round {round}: read {data:?} through another user's link");
        }
    }
    drop(attacker);
    let canary = sh_stdout(
        run,
        "stat -c '%a %u' /canary /canary/secret && ls -A /canary && cat /canary/secret",
    )
    .await
    .context("reading the canary")?;
    ensure!(
        canary == "700 0\n600 0\nsecret\nsecret",
        "the root-only directory changed while another user raced file operations \
         ({done} done, {refused} refused):\n{canary}"
    );
    // Both sides of the race were met: the operations worked, and the link was refused.
    ensure!(
        done > 0 && refused > 0,
        "the race was not run: {done} operations done, {refused} refused"
    );
    Ok(())
}

/// Whether `r` is a refusal (a link not followed, a non-directory in the way, a name
/// missing for a moment); `Ok(false)` if it worked; any other error fails the case.
fn refusal(what: &str, r: runcell_core::Result<()>) -> anyhow::Result<bool> {
    match r {
        Ok(()) => Ok(false),
        Err(e) if matches!(e.kind(), ErrorKind::InvalidSpec | ErrorKind::NotFound) => Ok(true),
        Err(e) => bail!("{what}: {e}"),
    }
}
