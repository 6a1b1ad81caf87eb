//! Dev Container configurations: a spec from `devcontainer.json` starts and is what the
//! run is made of.

use anyhow::{Context as _, ensure};
use runcell_core::{DriverExt, RunSpec};
use runcell_devcontainer::FromDevcontainer as _;

use crate::{Context, sh_stdout};

/// A project's `.devcontainer/devcontainer.json` (the suite's image, `containerEnv`,
/// `remoteEnv`, lifecycle commands in their three forms, `workspaceFolder`), loaded with
/// [`RunSpec::from_devcontainer`](runcell_devcontainer::FromDevcontainer::from_devcontainer)
/// and given the case's labels and network: the run has the env, the lifecycle commands
/// ran in their order in the workspace, which holds the project's files, and execs start
/// in the workspace folder.
pub async fn devcontainer_spec_starts_and_is_used(cx: &Context) -> anyhow::Result<()> {
    let project = tempfile::tempdir()?;
    std::fs::create_dir(project.path().join(".devcontainer"))?;
    std::fs::write(project.path().join("from-host.txt"), "project file")?;
    let image = serde_escape(&cx.image);
    std::fs::write(
        project.path().join(".devcontainer/devcontainer.json"),
        format!(
            r#"// written by the conformance suite
{{
    "name": "conformance",
    "image": "{image}",
    "workspaceFolder": "/workspace",
    "containerEnv": {{
        "DC_VAR": "from devcontainer",
        "DC_FOLDER": "${{containerWorkspaceFolder}}",
        "DC_DEFAULT": "${{localEnv:RUNCELL_CONFORMANCE_SURELY_UNSET:fallback}}",
    }},
    "remoteEnv": {{ "DC_REMOTE": "${{containerEnv:DC_VAR}} too" }},
    "onCreateCommand": ["sh", "-c", "echo on-create >> order.log"],
    "postCreateCommand": {{
        "first": "cat from-host.txt > post-create.txt && echo post-create-1 >> order.log",
        "second": ["sh", "-c", "echo post-create-2 >> order.log"],
    }},
    "postStartCommand": "echo post-start >> ${{containerWorkspaceFolder}}/order.log",
    "forwardPorts": [8080],
    "customizations": {{ "vscode": {{ "extensions": [] }} }},
}}
"#
        ),
    )?;
    let base = cx.spec();
    let mut spec = RunSpec::from_devcontainer(project.path()).context("loading the file")?;
    spec.labels.extend(base.labels);
    spec.network = base.network;

    let run = cx.driver.start(&spec).await?;
    let env = sh_stdout(
        &*run,
        r#"printf '%s|%s|%s|%s' "$DC_VAR" "$DC_FOLDER" "$DC_DEFAULT" "$DC_REMOTE""#,
    )
    .await?;
    ensure!(
        env == "from devcontainer|/workspace|fallback|from devcontainer too",
        "the run's env: {env:?}"
    );
    ensure!(sh_stdout(&*run, "pwd").await? == "/workspace");
    ensure!(sh_stdout(&*run, "cat post-create.txt").await? == "project file");
    let order = sh_stdout(&*run, "cat /workspace/order.log").await?;
    ensure!(
        order == "on-create\npost-create-1\npost-create-2\npost-start",
        "lifecycle commands ran as {order:?}"
    );
    if cx.caps.workspace_mount {
        let on_host = std::fs::read_to_string(project.path().join("post-create.txt"))?;
        ensure!(on_host == "project file", "the host sees {on_host:?}");
    }
    run.stop().await?;
    Ok(())
}

/// The image reference as the inside of a JSON string.
fn serde_escape(s: &str) -> String {
    s.chars()
        .flat_map(|c| match c {
            '"' | '\\' => vec!['\\', c],
            c => vec![c],
        })
        .collect()
}
