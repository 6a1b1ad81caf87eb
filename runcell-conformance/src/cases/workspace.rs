//! The workspace, the working directory and post-create commands.

use anyhow::ensure;
use runcell_core::{DriverExt, ErrorKind, ExecSpec, RunExt};

use crate::{Context, sh_stdout};

/// A file written by one exec is read by the next.
pub async fn workspace_persists_across_execs(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    sh_stdout(&*run, "echo one > state.txt").await?;
    sh_stdout(&*run, "echo two >> state.txt").await?;
    ensure!(sh_stdout(&*run, "cat /workspace/state.txt").await? == "one\ntwo");
    run.stop().await?;
    Ok(())
}

/// With a host directory: its files are in the run, and (when mounted) the run's writes
/// show on the host.
pub async fn workspace_host_dir_is_shared(cx: &Context) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("from-host.txt"), "seeded")?;
    let run = cx
        .driver
        .start(&cx.spec().workspace_dir(dir.path()))
        .await?;
    ensure!(sh_stdout(&*run, "cat from-host.txt").await? == "seeded");
    sh_stdout(&*run, "echo from-run > from-run.txt").await?;
    if cx.caps.workspace_mount {
        let on_host = std::fs::read_to_string(dir.path().join("from-run.txt"))?;
        ensure!(on_host == "from-run\n", "the host sees {on_host:?}");
    }
    run.stop().await?;
    Ok(())
}

/// Every exec starts in the same directory; a spec or exec override is honoured.
pub async fn working_dir_is_the_same_on_every_exec(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    for _ in 0..3 {
        ensure!(sh_stdout(&*run, "pwd").await? == "/workspace");
        sh_stdout(&*run, "cd /tmp").await?;
    }
    let out = run.exec(ExecSpec::new(["pwd"]).working_dir("/tmp")).await?;
    ensure!(
        out.stdout_str() == "/tmp\n",
        "exec override gave {:?}",
        out.stdout_str()
    );
    run.stop().await?;

    let mut spec = cx.spec().post_create(["mkdir", "-p", "/workspace/src"]);
    spec.working_dir = Some("/workspace/src".into());
    let run = cx.driver.start(&spec).await?;
    ensure!(sh_stdout(&*run, "pwd").await? == "/workspace/src");
    ensure!(sh_stdout(&*run, "pwd").await? == "/workspace/src");
    run.stop().await?;
    Ok(())
}

/// Post-create commands run once, in order, before the first exec.
pub async fn post_create_effects_are_visible(cx: &Context) -> anyhow::Result<()> {
    let spec = cx
        .spec()
        .post_create(["sh", "-c", "echo first >> /workspace/setup.log"])
        .post_create(["sh", "-c", "echo second >> /workspace/setup.log"]);
    let run = cx.driver.start(&spec).await?;
    ensure!(sh_stdout(&*run, "cat setup.log").await? == "first\nsecond");
    ensure!(sh_stdout(&*run, "cat setup.log").await? == "first\nsecond");
    run.stop().await?;
    Ok(())
}

/// A failing post-create command fails the start with its exit code and output, and the
/// run is removed.
pub async fn failing_post_create_leaves_nothing(cx: &Context) -> anyhow::Result<()> {
    let spec =
        cx.spec()
            .post_create(["true"])
            .post_create(["sh", "-c", "echo setup-broke >&2; exit 42"]);
    let e = match cx.driver.create(&spec).await {
        Ok(run) => {
            run.stop().await?;
            anyhow::bail!("a failing post-create command did not fail the start");
        }
        Err(e) => e,
    };
    ensure!(e.kind() == ErrorKind::PostCreateFailed, "{e}");
    ensure!(
        e.context_value("status") == Some("exited with code 42"),
        "{e}"
    );
    ensure!(
        e.context_value("stderr")
            .is_some_and(|s| s.contains("setup-broke")),
        "{e}"
    );
    ensure!(e.message().contains("post_create[1]"), "{e}");
    cx.assert_case_clean().await
}
