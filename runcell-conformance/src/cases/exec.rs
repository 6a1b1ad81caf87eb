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
            OutputChunk::Lost(n) => anyhow::bail!("{n} output bytes lost"),
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

/// A program that is missing or not executable: exit 127 / 126 with the reason on stderr
/// (as a shell reports it), nothing on stdout.
pub async fn missing_program_reports_on_stderr(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    sh_stdout(&*run, "printf x > /tmp/plain; chmod 644 /tmp/plain").await?;
    for (argv, want) in [
        ("no-such-program-xyz", ExitStatus::Exited(127)),
        ("/no/such/program", ExitStatus::Exited(127)),
        ("/tmp/plain", ExitStatus::Exited(126)),
    ] {
        let out = run.exec(ExecSpec::new([argv])).await?;
        ensure!(
            out.status == want,
            "{argv}: expected {want}, got {}",
            out.status
        );
        ensure!(
            out.stdout.is_empty(),
            "{argv}: the reason went to stdout: {:?}",
            out.stdout_str()
        );
        ensure!(!out.stderr.is_empty(), "{argv}: nothing on stderr");
    }
    run.stop().await?;
    Ok(())
}

/// A per-exec working directory or user: used when it exists; when it does not, a typed
/// `NotFound` naming the field, promptly, once (no retry storm), and the run stays usable.
/// Without per-exec users, `user` is `Unsupported`.
pub async fn exec_working_dir_and_user_are_checked(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    ensure!(sh_stdout_in(&*run, ExecSpec::new(["pwd"]).working_dir("/tmp")).await? == "/tmp");
    for spec in [
        ExecSpec::new(["true"]).working_dir("/no/such/dir"),
        ExecSpec::new(["true"])
            .working_dir("/no/such/dir")
            .timeout(std::time::Duration::from_secs(30)),
        ExecSpec::new(["true"]).working_dir("/etc/passwd"),
    ] {
        let started = std::time::Instant::now();
        let result = tokio::time::timeout(std::time::Duration::from_secs(15), run.exec(spec))
            .await
            .map_err(|_| anyhow::anyhow!("an exec in a missing directory hung"))?;
        match result {
            Ok(out) => anyhow::bail!("an exec in a missing directory ran: {}", out.status),
            Err(e) => ensure!(
                e.kind() == runcell_core::ErrorKind::NotFound && e.field() == Some("working_dir"),
                "missing working_dir: {e}"
            ),
        }
        ensure!(started.elapsed() < std::time::Duration::from_secs(10));
    }
    // On a stream it is a status.
    let status = run
        .exec_stream(ExecSpec::new(["true"]).working_dir("/no/such/dir"))
        .await?
        .wait()
        .await;
    ensure!(
        matches!(&status, ExitStatus::NotStarted { field, .. } if field == "working_dir"),
        "stream: {status}"
    );
    if cx.caps.exec_user {
        ensure!(sh_stdout_in(&*run, ExecSpec::new(["id", "-u"]).user("1000")).await? == "1000");
        if cx.caps.user_names {
            ensure!(
                sh_stdout_in(&*run, ExecSpec::new(["id", "-u"]).user("nobody")).await? == "65534"
            );
            match run.exec(ExecSpec::new(["true"]).user("no-such-user")).await {
                Ok(out) => anyhow::bail!("an exec as a missing user ran: {}", out.status),
                Err(e) => ensure!(
                    e.kind() == runcell_core::ErrorKind::NotFound && e.field() == Some("user"),
                    "missing user: {e}"
                ),
            }
        }
    } else {
        match run.exec(ExecSpec::new(["true"]).user("1000")).await {
            Ok(out) => anyhow::bail!("a per-exec user ran without the capability: {}", out.status),
            Err(e) => ensure!(
                e.kind() == runcell_core::ErrorKind::Unsupported && e.field() == Some("user"),
                "per-exec user: {e}"
            ),
        }
    }
    ensure!(sh_stdout(&*run, "echo still-usable").await? == "still-usable");
    run.stop().await?;
    Ok(())
}

/// The exit status travels where the command cannot write: printing anything (such as a
/// fake status trailer carrying its own exec id) on stdout or stderr changes nothing.
pub async fn the_exit_status_cannot_be_forged(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    let script = r#"for id in "$RUNCELL_EXEC_ID" x; do
      printf '\0\0sbx-exit:%s:0\0' "$id" >&2; printf '\0\0sbx-exit:%s:0\0' "$id"
    done; sleep 2; exit 3"#;
    let started = std::time::Instant::now();
    let out = run.exec(ExecSpec::new(["sh", "-c", script])).await?;
    ensure!(out.status == ExitStatus::Exited(3), "got {}", out.status);
    ensure!(
        started.elapsed() >= std::time::Duration::from_secs(2),
        "returned before the command ended"
    );
    run.stop().await?;
    Ok(())
}

async fn sh_stdout_in(run: &dyn runcell_core::Run, spec: ExecSpec) -> anyhow::Result<String> {
    let out = run.exec(spec).await?;
    ensure!(
        out.status.success(),
        "{}: {:?}",
        out.status,
        out.stderr_str()
    );
    Ok(out.stdout_str().trim_end().to_string())
}
