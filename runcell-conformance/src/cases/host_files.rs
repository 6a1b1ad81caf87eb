//! The host's files stay the host's: code in a run may be root and write anything it can
//! reach, but nothing it writes chooses what the host reads or writes, gains privileges
//! on the host, or reaches host folders the caller did not hand over.

use std::collections::BTreeSet;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, ensure};
use runcell_core::{Capabilities, DriverExt, ErrorKind, Pool, PoolConfig, Run, RunSpec};
use runcell_devcontainer::FromDevcontainer as _;

use crate::{Context, sh_stdout};

const READY: Duration = Duration::from_secs(180);

/// The driver takes a host workspace (mounted or seeded).
pub(crate) fn host_dir(c: &Capabilities) -> bool {
    c.workspace_mount || c.workspace_seed
}

/// [`host_dir`], and runs can be attached by id.
pub(crate) fn attach_and_host_dir(c: &Capabilities) -> bool {
    c.attach && host_dir(c)
}

/// The names in host directory `dir`.
fn names_in(dir: &Path) -> anyhow::Result<BTreeSet<String>> {
    let mut names = BTreeSet::new();
    for entry in std::fs::read_dir(dir)? {
        names.insert(entry?.file_name().to_string_lossy().into_owned());
    }
    Ok(names)
}

/// Inside `run`, as its (root) user: a settings file naming host folder `victim` as the
/// workspace to copy back, and workspace files that would overwrite and add to it.
async fn forge_settings(run: &dyn Run, victim: &Path) -> anyhow::Result<()> {
    ensure!(
        sh_stdout(run, "id -u").await? == "0",
        "the suite image must run as root for this case"
    );
    let victim = victim.display().to_string();
    ensure!(
        !victim.contains(['"', '\'', '\\']),
        "an odd temp path: {victim}"
    );
    let forged = format!(
        r#"{{"env":[["FORGED","1"]],"working_dir":null,"sync_back":["{victim}","/workspace"]}}"#
    );
    sh_stdout(
        run,
        &format!(
            "mkdir -p /.runcell && printf '%s' '{forged}' > /.runcell/run.json && \
             echo from-sandbox > /workspace/secret.txt && echo planted > /workspace/planted.txt"
        ),
    )
    .await?;
    ensure!(
        sh_stdout(run, "cat /.runcell/run.json").await? == forged,
        "the settings file could not be forged"
    );
    Ok(())
}

/// Attaches to `id`, execs once (which reads the run's settings), and stops through the
/// attached handle.
async fn attach_and_stop(cx: &Context, id: &str) -> anyhow::Result<()> {
    let attached = cx.driver.attach(id).await?;
    sh_stdout(&*attached, "true").await?;
    attached.stop().await?;
    Ok(())
}

/// A root process in a run (created cold, and claimed from a warm pool where the driver
/// has pools) rewrites the run's settings file to name another host folder as its
/// workspace; attaching to the run by id and stopping it writes nothing there.
pub async fn a_forged_settings_file_never_chooses_a_host_path(cx: &Context) -> anyhow::Result<()> {
    let victim = tempfile::tempdir()?;
    std::fs::write(victim.path().join("secret.txt"), "host content")?;
    let check_victim = |how: &str| -> anyhow::Result<()> {
        let names = names_in(victim.path())?;
        ensure!(
            names == BTreeSet::from(["secret.txt".to_string()]),
            "{how}: the host folder holds {names:?}"
        );
        let secret = std::fs::read_to_string(victim.path().join("secret.txt"))?;
        ensure!(
            secret == "host content",
            "{how}: overwritten with {secret:?}"
        );
        Ok(())
    };

    let ws = tempfile::tempdir()?;
    let spec = cx.spec().workspace_dir(ws.path());
    let run = cx.driver.start(&spec).await?;
    forge_settings(&*run, victim.path()).await?;
    attach_and_stop(cx, run.id()).await?;
    run.stop().await?;
    check_victim("a run started by the driver")?;

    if cx.caps.pool {
        let pool = Pool::new(
            cx.driver.clone(),
            &cx.spec(),
            PoolConfig::default().min_ready(1),
        )?;
        pool.wait_ready(1, READY).await?;
        let ws = tempfile::tempdir()?;
        let run = pool.start(&cx.spec().workspace_dir(ws.path())).await?;
        ensure!(pool.stats().hits == 1, "not claimed: {:?}", pool.stats());
        forge_settings(&*run, victim.path()).await?;
        attach_and_stop(cx, run.id()).await?;
        run.stop().await?;
        pool.shutdown().await?;
        check_victim("a pooled run")?;
    }
    cx.assert_case_clean().await
}

/// A setuid-root program, a setgid one and a device node made by root in the run's
/// workspace: once the run stopped, what the host has of them (a bind mount shows it
/// live; a copy comes back at stop) is neither setuid nor setgid nor a device.
pub async fn setuid_files_from_the_run_land_on_the_host_without_it(
    cx: &Context,
) -> anyhow::Result<()> {
    let ws = tempfile::tempdir()?;
    let run = cx.driver.start(&cx.spec().workspace_dir(ws.path())).await?;
    ensure!(
        sh_stdout(&*run, "id -u").await? == "0",
        "the suite image must run as root"
    );
    let modes = sh_stdout(
        &*run,
        "cd /workspace && cp /bin/sh suid && chmod 4755 suid && cp /bin/sh sgid && \
         chmod 2755 sgid && mkdir -p sub && cp /bin/sh sub/nested && chmod 6755 sub/nested && \
         (mknod dev c 1 3 2>/dev/null || true) && stat -c %a suid sgid sub/nested",
    )
    .await?;
    // The bits are set inside: the case can fail.
    ensure!(modes == "4755\n2755\n6755", "inside the run: {modes:?}");
    run.stop().await?;

    let mut seen = 0;
    for name in ["suid", "sgid", "sub/nested"] {
        let path = ws.path().join(name);
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        seen += 1;
        let mode = meta.permissions().mode() & 0o7777;
        ensure!(
            mode & 0o6000 == 0,
            "{name} is on the host with mode {mode:o}"
        );
    }
    if let Ok(meta) = std::fs::symlink_metadata(ws.path().join("dev")) {
        let kind = meta.file_type();
        ensure!(
            !kind.is_char_device() && !kind.is_block_device(),
            "a device node reached the host"
        );
    }
    if cx.caps.workspace_mount {
        // Mounted live (or copied back at stop, pooled): the files are there.
        ensure!(seen == 3, "only {seen} of the files reached the host");
    }
    cx.assert_case_clean().await
}

/// A workspace whose host folder is `/` or a system folder is `InvalidSpec` naming
/// `workspace.host_dir`, and nothing is created.
pub async fn a_system_folder_as_workspace_is_refused_before_anything_exists(
    cx: &Context,
) -> anyhow::Result<()> {
    for dir in ["/", "/etc", "/usr/bin", "/proc"] {
        let e = match cx.driver.start(&cx.spec().workspace_dir(dir)).await {
            Ok(run) => {
                run.stop().await?;
                anyhow::bail!("a run started with its workspace at {dir}");
            }
            Err(e) => e,
        };
        ensure!(
            e.kind() == ErrorKind::InvalidSpec && e.field() == Some("workspace.host_dir"),
            "{dir}: {e}"
        );
    }
    // `/` through a symlink is `/`.
    let tmp = tempfile::tempdir()?;
    let link = tmp.path().join("root");
    std::os::unix::fs::symlink("/", &link)?;
    let e = match cx.driver.start(&cx.spec().workspace_dir(&link)).await {
        Ok(run) => {
            run.stop().await?;
            anyhow::bail!("a run started with its workspace at a link to /");
        }
        Err(e) => e,
    };
    ensure!(e.field() == Some("workspace.host_dir"), "{e}");
    cx.assert_case_clean().await
}

/// A project's `devcontainer.json` whose `workspaceMount` binds a host folder outside the
/// project is refused, naming the property, unless the caller opts in; opted in, the run
/// has that folder as its workspace.
pub async fn a_devcontainer_mount_outside_the_project_needs_an_opt_in(
    cx: &Context,
) -> anyhow::Result<()> {
    let project = tempfile::tempdir()?;
    let outside = tempfile::tempdir()?;
    std::fs::write(outside.path().join("beside.txt"), "outside the project")?;
    std::fs::create_dir(project.path().join(".devcontainer"))?;
    let source = std::fs::canonicalize(outside.path())?.display().to_string();
    ensure!(
        !source.contains(['"', '\\', ',']),
        "an odd temp path: {source}"
    );
    let image = cx.image.replace('\\', "\\\\").replace('"', "\\\"");
    std::fs::write(
        project.path().join(".devcontainer/devcontainer.json"),
        format!(
            r#"{{
    "image": "{image}",
    "workspaceMount": "type=bind,source={source},target=/workspace",
    "workspaceFolder": "/workspace",
}}"#
        ),
    )?;
    let e = RunSpec::from_devcontainer(project.path())
        .err()
        .context("a mount outside the project was accepted")?;
    ensure!(
        e.kind() == ErrorKind::InvalidSpec && e.field() == Some("devcontainer.workspaceMount"),
        "{e}"
    );
    // `/` is refused even when opted in.
    let root_project = tempfile::tempdir()?;
    std::fs::create_dir(root_project.path().join(".devcontainer"))?;
    std::fs::write(
        root_project.path().join(".devcontainer/devcontainer.json"),
        format!(r#"{{"image": "{image}", "workspaceMount": "type=bind,source=/,target=/w"}}"#),
    )?;
    let e = runcell_devcontainer::load_with(root_project.path(), |c| {
        c.allow_mounts_outside_project(true)
    })
    .err()
    .context("/ was accepted as a workspace")?;
    ensure!(e.field() == Some("devcontainer.workspaceMount"), "{e}");

    let mut spec =
        runcell_devcontainer::load_with(project.path(), |c| c.allow_mounts_outside_project(true))?;
    let base = cx.spec();
    spec.labels.extend(base.labels);
    spec.network = base.network;
    let run = cx.driver.start(&spec).await?;
    let seen = sh_stdout(&*run, "cat /workspace/beside.txt").await?;
    run.stop().await?;
    ensure!(seen == "outside the project", "the run sees {seen:?}");
    cx.assert_case_clean().await
}
