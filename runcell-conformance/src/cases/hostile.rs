//! Hostile input: every class of bad value a caller can pass through the public API gets
//! a typed error naming its field, promptly, without a panic, and leaves nothing behind.
//!
//! Classes covered: image references, env names (empty, `=`, control characters) and
//! sizes (one variable over the kernel's 128 KiB, the whole environment over 1 MiB),
//! argv (empty, NUL, one argument over 128 KiB), paths (relative, control characters,
//! reserved, `.`/`..`, NUL, empty, directories where a file is meant), users, CA bundles
//! (garbage, expired, not yet valid), resources (NaN, zero), TTLs and timeouts (zero and
//! `Duration::MAX`), labels.

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use runcell_core::{DriverExt, ErrorKind, ExecSpec, ExitStatus, RunExt, RunSpec};

use crate::{Context, sh_stdout};

/// How long a rejection may take: validation happens before anything is sent.
const PROMPT: Duration = Duration::from_secs(10);

/// Expired and not-yet-valid CA certificates (self-signed test CAs, keys thrown away).
const EXPIRED_CA: &str = include_str!("../../testdata/expired-ca.pem");
const FUTURE_CA: &str = include_str!("../../testdata/not-yet-valid-ca.pem");

fn big(n: usize) -> String {
    "x".repeat(n)
}

/// Run specs with one hostile field each: `InvalidSpec` naming it, quickly, nothing created.
pub async fn hostile_run_specs_are_typed_errors(cx: &Context) -> anyhow::Result<()> {
    let base = cx.spec();
    let with = |f: &dyn Fn(&mut RunSpec)| {
        let mut s = base.clone();
        f(&mut s);
        s
    };
    let mut many_env = base.clone();
    for i in 0..10 {
        many_env = many_env.env(format!("V{i}"), big(120 << 10));
    }
    let cases: Vec<(&str, RunSpec)> = vec![
        ("image", with(&|s| s.image = "Busybox".into())),
        ("image", with(&|s| s.image = "garbage:::".into())),
        ("image", with(&|s| s.image = "team/img:".into())),
        ("image", with(&|s| s.image = "img\nx".into())),
        // An image ID only whole: a prefix would pick any image whose ID begins so.
        ("image", with(&|s| s.image = "sha256:0123abcd".into())),
        ("image", with(&|s| s.image = "0".repeat(64))),
        // Below what engines take: refused before anything exists.
        (
            "resources.memory_bytes",
            with(&|s| s.resources.memory_bytes = Some(4 << 20)),
        ),
        ("env[0].name", base.clone().env("A\nB", "x")),
        ("env[0].name", base.clone().env("A\rB", "x")),
        ("env[0].value", base.clone().env("BIG", big(1 << 20))),
        ("env", many_env),
        (
            "post_create[0][1]",
            base.clone().post_create(["echo", &big(200 << 10)]),
        ),
        (
            "working_dir",
            with(&|s| s.working_dir = Some("/a\nb".into())),
        ),
        ("workspace.path", with(&|s| s.workspace.path = "/".into())),
        (
            "workspace.path",
            with(&|s| s.workspace.path = "/a/../b".into()),
        ),
        ("workspace.host_dir", {
            let mut s = base.clone();
            s.workspace.host_dir = Some("/no/such/dir/anywhere".into());
            s
        }),
        ("user", with(&|s| s.user = Some("a b".into()))),
        ("user", with(&|s| s.user = Some(String::new()))),
        ("ca_bundle", with(&|s| s.ca_bundle = Some("garbage".into()))),
        (
            "ca_bundle",
            with(&|s| s.ca_bundle = Some(EXPIRED_CA.into())),
        ),
        ("ca_bundle", with(&|s| s.ca_bundle = Some(FUTURE_CA.into()))),
        (
            "resources.cpus",
            with(&|s| s.resources.cpus = Some(f64::NAN)),
        ),
        (
            "resources.memory_bytes",
            with(&|s| s.resources.memory_bytes = Some(0)),
        ),
        ("ttl", with(&|s| s.ttl = Some(Duration::ZERO))),
        ("labels[\"k\"]", base.clone().label("k", "bad value!")),
    ];
    for (field, spec) in cases {
        let started = Instant::now();
        let result = tokio::time::timeout(PROMPT, cx.driver.create(&spec))
            .await
            .with_context(|| format!("a bad {field} hung creation"))?;
        match result {
            Ok(run) => {
                run.stop().await?;
                bail!("a spec with a bad {field} was accepted");
            }
            Err(e) => {
                ensure!(
                    e.kind() == ErrorKind::InvalidSpec && e.field() == Some(field),
                    "bad {field}: expected InvalidSpec naming it, got {e}"
                );
                ensure!(
                    started.elapsed() < PROMPT,
                    "bad {field} took {:?}",
                    started.elapsed()
                );
            }
        }
        cx.assert_case_clean()
            .await
            .with_context(|| format!("after the bad {field}"))?;
    }
    Ok(())
}

/// Exec specs with one hostile field each: `InvalidSpec` naming it, and the run stays usable.
pub async fn hostile_exec_specs_are_typed_errors(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    let ok = || ExecSpec::new(["true"]);
    let cases: Vec<(&str, ExecSpec)> = vec![
        ("argv", ExecSpec::new(Vec::<String>::new())),
        ("argv", ExecSpec::new([""])),
        ("argv[1]", ExecSpec::new(["echo", "a\0"])),
        ("argv[1]", ExecSpec::new(["echo", &big(200 << 10)])),
        ("env[0].name", ok().env("A\nB", "1")),
        ("env[0].name", ok().env("", "1")),
        ("env[0].value", ok().env("BIG", big(1 << 20))),
        ("working_dir", ok().working_dir("relative")),
        ("working_dir", ok().working_dir("/a\nb")),
        ("user", ok().user("")),
        ("timeout", ok().timeout(Duration::ZERO)),
    ];
    for (field, spec) in cases {
        let result = tokio::time::timeout(PROMPT, run.exec(spec))
            .await
            .with_context(|| format!("a bad exec {field} hung"))?;
        match result {
            Ok(out) => bail!("an exec with a bad {field} ran: {}", out.status),
            Err(e) => ensure!(
                e.kind() == ErrorKind::InvalidSpec && e.field() == Some(field),
                "bad exec {field}: expected InvalidSpec naming it, got {e}"
            ),
        }
    }
    ensure!(sh_stdout(&*run, "echo still-usable").await? == "still-usable");
    run.stop().await?;
    Ok(())
}

/// File paths that cannot name a file are `InvalidSpec` naming `path` for both directions.
pub async fn hostile_file_paths_are_typed_errors(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    for path in [
        "",
        "relative.txt",
        "/",
        "/tmp/",
        "/tmp//x",
        "/tmp/./x",
        "/tmp/../x",
        "/tmp/a\0b",
    ] {
        let put = tokio::time::timeout(PROMPT, run.put_file(path, b"x", 0o644))
            .await
            .with_context(|| format!("put_file({path:?}) hung"))?;
        let get = tokio::time::timeout(PROMPT, run.get_file(path))
            .await
            .with_context(|| format!("get_file({path:?}) hung"))?;
        for (op, result) in [("put_file", put.err()), ("get_file", get.err())] {
            let e = result.with_context(|| format!("{op}({path:?}) succeeded"))?;
            ensure!(
                e.kind() == ErrorKind::InvalidSpec && e.field() == Some("path"),
                "{op}({path:?}): expected InvalidSpec naming path, got {e}"
            );
        }
    }
    run.stop().await?;
    Ok(())
}

/// `Duration::MAX` as a TTL and as a timeout, and a 1 ns timeout: no panic, no overflow,
/// the run works, and a TTL too long to represent never expires.
pub async fn durations_at_the_extremes_are_safe(cx: &Context) -> anyhow::Result<()> {
    let mut spec = cx.spec();
    if cx.caps.ttl {
        spec.ttl = Some(Duration::MAX);
    }
    let run = cx.driver.start(&spec).await?;
    let out = run
        .exec(ExecSpec::new(["echo", "ok"]).timeout(Duration::MAX))
        .await?;
    ensure!(
        out.status.success() && out.stdout_str() == "ok\n",
        "{}",
        out.status
    );
    let out = run
        .exec(ExecSpec::new(["sleep", "5"]).timeout(Duration::from_nanos(1)))
        .await?;
    ensure!(
        matches!(out.status, ExitStatus::TimedOut),
        "a 1 ns timeout: {}",
        out.status
    );
    let stream = run
        .exec_stream(ExecSpec::new(["cat"]).timeout(Duration::MAX))
        .await?;
    ensure!(stream.wait().await.success());
    // A huge TTL must not make reap think the run expired.
    let reaped = runcell_core::reap(&*cx.driver, &cx.case_selector()).await?;
    ensure!(reaped.is_empty(), "reap removed {reaped:?}");
    ensure!(sh_stdout(&*run, "echo alive").await? == "alive");
    run.stop().await?;
    Ok(())
}
