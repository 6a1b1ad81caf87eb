//! Files in and out of a run.

use anyhow::{bail, ensure};
use runcell_core::{DriverExt, ErrorKind, RunExt};

use crate::{Context, sh_stdout};

/// A file put in is read back identical, with its mode; a missing path is `NotFound`.
pub async fn files_round_trip(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    let data: Vec<u8> = (0..200_000).map(|_| rand::random::<u8>()).collect();
    run.put_file("/workspace/blob.bin", &data, 0o750).await?;
    ensure!(run.get_file("/workspace/blob.bin").await? == data);
    ensure!(sh_stdout(&*run, "stat -c %a /workspace/blob.bin").await? == "750");
    sh_stdout(&*run, "printf made-inside > /workspace/inside.txt").await?;
    ensure!(run.get_file("/workspace/inside.txt").await? == b"made-inside");
    match run.get_file("/workspace/missing").await {
        Ok(_) => bail!("reading a missing file succeeded"),
        Err(e) => ensure!(e.kind() == ErrorKind::NotFound, "missing file: {e}"),
    }
    run.stop().await?;
    Ok(())
}
