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

/// A file operation never destroys what it was not asked to replace: `put_file` onto a
/// directory (the workspace itself, a non-empty or an empty subdirectory) is `InvalidSpec`
/// naming `path` and leaves the directory and its content as they were (on the host too,
/// where the workspace is mounted); `get_file` of a directory is `InvalidSpec` too.
pub async fn file_operations_never_replace_directories(cx: &Context) -> anyhow::Result<()> {
    let host = tempfile::tempdir()?;
    std::fs::write(host.path().join("keep.txt"), b"precious\n")?;
    let mut spec = cx.spec();
    let mounted = cx.caps.workspace_mount || cx.caps.workspace_seed;
    if mounted {
        spec = spec.workspace_dir(host.path());
    } else {
        spec = spec.post_create(["sh", "-c", "echo precious > /workspace/keep.txt"]);
    }
    let run = cx.driver.start(&spec).await?;
    sh_stdout(
        &*run,
        "mkdir -p /workspace/full /workspace/empty && echo x > /workspace/full/f",
    )
    .await?;
    for path in ["/workspace", "/workspace/full", "/workspace/empty"] {
        match run.put_file(path, b"clobber", 0o644).await {
            Ok(()) => bail!("put_file({path}) replaced a directory"),
            Err(e) => ensure!(
                e.kind() == ErrorKind::InvalidSpec && e.field() == Some("path"),
                "put_file({path}): expected InvalidSpec naming path, got {e}"
            ),
        }
        match run.get_file(path).await {
            Ok(_) => bail!("get_file({path}) read a directory as a file"),
            Err(e) => ensure!(
                e.kind() == ErrorKind::InvalidSpec && e.field() == Some("path"),
                "get_file({path}): expected InvalidSpec naming path, got {e}"
            ),
        }
    }
    let listing = sh_stdout(
        &*run,
        "cat /workspace/keep.txt /workspace/full/f; [ -d /workspace/empty ] && echo empty-dir",
    )
    .await?;
    ensure!(
        listing == "precious\nx\nempty-dir",
        "the workspace changed: {listing:?}"
    );
    if cx.caps.workspace_mount {
        ensure!(std::fs::read(host.path().join("keep.txt"))? == b"precious\n");
    }
    // A regular file is still replaced as asked.
    run.put_file("/workspace/keep.txt", b"replaced", 0o644)
        .await?;
    ensure!(run.get_file("/workspace/keep.txt").await? == b"replaced");
    run.stop().await?;
    Ok(())
}

/// 256 MiB into the run and back, streamed: every byte arrives and the host process grows
/// by at most 32 MiB. The upload half needs streaming stdin where files travel over exec.
pub async fn large_files_stream_in_bounded_memory(cx: &Context) -> anyhow::Result<()> {
    use tokio::io::AsyncReadExt;
    const SIZE: u64 = 256 << 20;
    const BOUND: u64 = 32 << 20;
    let run = cx.driver.start(&cx.spec()).await?;
    let sampler = crate::RssSampler::start();
    if cx.caps.stdin_streaming {
        let source = tokio::io::repeat(0xab).take(SIZE);
        run.put_file_stream("/tmp/big.bin", source, SIZE, 0o644)
            .await?;
    } else {
        sh_stdout(
            &*run,
            "head -c 268435456 /dev/zero | tr '\\0' '\\253' > /tmp/big.bin",
        )
        .await?;
    }
    let check = sh_stdout(
        &*run,
        "wc -c < /tmp/big.bin; tr -d '\\253' < /tmp/big.bin | wc -c",
    )
    .await?;
    ensure!(
        check.split_whitespace().collect::<Vec<_>>() == [SIZE.to_string(), "0".to_string()],
        "the file in the run: {check:?}"
    );
    let mut reader = run.get_file_stream("/tmp/big.bin").await?;
    ensure!(reader.size() == SIZE, "size {}", reader.size());
    let mut buf = vec![0u8; 64 << 10];
    let mut got = 0u64;
    loop {
        let n = reader.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        ensure!(
            buf[..n].iter().all(|b| *b == 0xab),
            "corrupt bytes near {got}"
        );
        got += n as u64;
    }
    ensure!(got == SIZE, "read {got} of {SIZE} bytes");
    if let Some(growth) = sampler.stop().await {
        ensure!(
            growth <= BOUND,
            "host memory grew by {} MiB moving 256 MiB",
            growth >> 20
        );
    }
    run.stop().await?;
    Ok(())
}
