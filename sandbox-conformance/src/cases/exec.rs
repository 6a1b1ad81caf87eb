//! Exit statuses, streams and stdin.

use anyhow::ensure;
use bytes::Bytes;
use runcell_core::{DriverExt, ExecSpec, ExitStatus, OutputChunk, RunExt};

use crate::{Context, sh_stdout};

/// 0, 1, 126, 127 and a signal death are reported distinctly.
pub async fn exit_codes_are_distinct(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    sh_stdout(
        &*run,
        "printf 'echo no' > /tmp/not-executable; chmod 644 /tmp/not-executable",
    )
    .await?;
    let cases: [(&[&str], ExitStatus); 6] = [
        (&["true"], ExitStatus::Exited(0)),
        (&["false"], ExitStatus::Exited(1)),
        (&["sh", "-c", "exit 3"], ExitStatus::Exited(3)),
        (&["/tmp/not-executable"], ExitStatus::Exited(126)),
        (&["no-such-binary-xyz"], ExitStatus::Exited(127)),
        (&["sh", "-c", "kill -9 $$"], ExitStatus::Signaled(9)),
    ];
    for (argv, want) in cases {
        let out = run.exec(ExecSpec::new(argv.iter().copied())).await?;
        ensure!(
            out.status == want,
            "{argv:?}: expected {want}, got {} (stderr {:?})",
            out.status,
            out.stderr_str()
        );
    }
    run.stop().await?;
    Ok(())
}

/// Random bytes with NULs and no trailing newline come back exactly, each on its stream.
pub async fn stdout_and_stderr_are_apart_and_binary_safe(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    let mut a: Vec<u8> = (0..70_000).map(|_| rand::random::<u8>()).collect();
    a.extend_from_slice(b"\0\0end-without-newline");
    let b: Vec<u8> = (0..5_000)
        .map(|_| rand::random::<u8>())
        .chain([0u8, 0, 7])
        .collect();
    run.put_file("/tmp/a.bin", &a, 0o644).await?;
    run.put_file("/tmp/b.bin", &b, 0o644).await?;
    let out = run
        .exec(ExecSpec::new([
            "sh",
            "-c",
            "cat /tmp/a.bin; cat /tmp/b.bin >&2",
        ]))
        .await?;
    ensure!(out.status.success(), "{}", out.status);
    ensure!(
        out.stdout == a,
        "stdout differs: {} bytes, want {}",
        out.stdout.len(),
        a.len()
    );
    ensure!(
        out.stderr == b,
        "stderr differs: {} bytes, want {}",
        out.stderr.len(),
        b.len()
    );
    run.stop().await?;
    Ok(())
}

/// Stdin given as bytes, and as a stream written in pieces, reaches the process, and
/// closing it delivers EOF.
pub async fn stdin_round_trips_with_eof(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    let out = run
        .exec(ExecSpec::new(["cat"]).stdin_bytes(data.clone()))
        .await?;
    ensure!(
        out.status.success() && out.stdout == data,
        "bytes stdin: {} bytes back, {}",
        out.stdout.len(),
        out.status
    );

    let out = run.exec(ExecSpec::new(["wc", "-c"])).await?;
    ensure!(
        out.stdout_str().trim() == "0",
        "no stdin should read as empty: {:?}",
        out.stdout_str()
    );
    if !cx.caps.stdin_streaming {
        let e = run
            .exec_stream(ExecSpec::new(["cat"]).stdin_piped())
            .await
            .map(|_| ())
            .unwrap_err();
        ensure!(
            e.kind() == runcell_core::ErrorKind::Unsupported && e.field() == Some("stdin"),
            "piped stdin without the capability: {e}"
        );
        run.stop().await?;
        return Ok(());
    }
    let mut stream = run
        .exec_stream(ExecSpec::new(["sh", "-c", "cat; echo EOF-SEEN >&2"]).stdin_piped())
        .await?;
    let mut stdin = stream.take_stdin().expect("a piped stdin");
    for piece in ["first ", "second ", "third"] {
        stdin.write(Bytes::from(piece)).await?;
    }
    stdin.close();
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    while let Some(chunk) = stream.next_chunk().await {
        match chunk {
            OutputChunk::Stdout(b) => stdout.extend_from_slice(&b),
            OutputChunk::Stderr(b) => stderr.extend_from_slice(&b),
        }
    }
    let status = stream.wait().await;
    ensure!(status.success(), "{status}");
    ensure!(
        stdout == b"first second third",
        "{:?}",
        String::from_utf8_lossy(&stdout)
    );
    ensure!(
        stderr == b"EOF-SEEN\n",
        "{:?}",
        String::from_utf8_lossy(&stderr)
    );
    run.stop().await?;
    Ok(())
}
