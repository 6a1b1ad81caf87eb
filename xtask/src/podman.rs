//! The Podman engines the suite also runs on, through their Docker-compatible API: a
//! rootful service and a rootless one (as [`ROOTLESS_USER`]), each on a socket of our own,
//! with the test images copied from Docker.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// The API socket of the test service (not Podman's own `/run/podman/podman.sock`, so
/// that a machine's Podman is left alone).
pub const SOCKET: &str = "/run/sandbox-podman/podman.sock";
const CATATONIT: &str = "/usr/libexec/podman/catatonit";
const LOG: &str = "/var/log/sandbox-podman.log";

/// The user the rootless service runs as (made if missing, with subordinate ids), and
/// the suite on it too: rootless setups run the library as the engine's user.
pub const ROOTLESS_USER: &str = "sbxrootless";
/// The rootless service's runtime directory (its `XDG_RUNTIME_DIR`, socket, and what
/// runs as [`ROOTLESS_USER`] reads: its configuration, the suite's binary).
pub const ROOTLESS_DIR: &str = "/run/sandbox-podman-rootless";

fn answers(socket: &str) -> bool {
    let ping = || -> std::io::Result<bool> {
        let mut stream = UnixStream::connect(socket)?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        stream.write_all(b"GET /_ping HTTP/1.0\r\nHost: podman\r\n\r\n")?;
        let mut answer = String::new();
        stream.read_to_string(&mut answer)?;
        Ok(answer.starts_with("HTTP/1.") && answer.ends_with("OK"))
    };
    ping().unwrap_or(false)
}

fn check_installed() -> Result<()> {
    if Command::new("podman").arg("--version").output().is_err() {
        bail!("podman is missing: apt-get install podman catatonit");
    }
    if !Path::new(CATATONIT).exists() {
        bail!(
            "{CATATONIT} is missing (Podman's init, used for `init: true`): apt-get install catatonit"
        );
    }
    Ok(())
}

/// Makes sure the test Podman service answers on [`SOCKET`] with the test images in its
/// store, starting it if needed; returns the address for `RUNCELL_DOCKER_HOST`. Says
/// exactly what is missing otherwise.
pub fn ensure(images: &[&str]) -> Result<String> {
    check_installed()?;
    if !answers(SOCKET) {
        let dir = Path::new(SOCKET)
            .parent()
            .context("the socket's directory")?;
        std::fs::create_dir_all(dir)?;
        let log = std::fs::File::create(LOG)
            .or_else(|_| std::fs::File::create(std::env::temp_dir().join("sandbox-podman.log")))?;
        start(SOCKET, crate::engine::detached(), log, LOG, None)?;
    }
    for image in images {
        copy_image(image, SOCKET)?;
    }
    Ok(format!("unix://{SOCKET}"))
}

/// The same for rootless Podman: the service runs as [`ROOTLESS_USER`] (made here if
/// missing, with subordinate uids and gids) on a socket in [`ROOTLESS_DIR`]. Needs root.
pub fn ensure_rootless(images: &[&str]) -> Result<String> {
    check_installed()?;
    if !Path::new("/usr/bin/newuidmap").exists() {
        bail!("newuidmap is missing (rootless Podman's id mapping): apt-get install uidmap");
    }
    let user = ROOTLESS_USER;
    if !run(Command::new("id").args(["-u", user]))? {
        eprintln!("adding the user {user} for rootless Podman");
        if !run(Command::new("useradd").args(["--create-home", "--shell", "/bin/sh", user]))? {
            bail!("useradd {user} failed (rootless Podman runs as this user; needs root)");
        }
    }
    for file in ["/etc/subuid", "/etc/subgid"] {
        let ids = std::fs::read_to_string(file).unwrap_or_default();
        if !ids.lines().any(|l| l.starts_with(&format!("{user}:"))) {
            let flag = if file.ends_with("uid") {
                "--add-subuids"
            } else {
                "--add-subgids"
            };
            if !run(Command::new("usermod").args([flag, "300000-365535", user]))? {
                bail!("usermod {flag} for {user} failed");
            }
        }
    }
    let socket = format!("{ROOTLESS_DIR}/podman.sock");
    if !answers(&socket) {
        std::fs::create_dir_all(ROOTLESS_DIR)?;
        if !run(Command::new("chown").args([user, ROOTLESS_DIR]))? {
            bail!("chown {user} {ROOTLESS_DIR} failed");
        }
        std::fs::set_permissions(
            ROOTLESS_DIR,
            std::os::unix::fs::PermissionsExt::from_mode(0o700),
        )?;
        let log_path = format!("{ROOTLESS_DIR}/service.log");
        let log = std::fs::File::create(&log_path)?;
        // Detached like the rootful one (not through runuser's session).
        let mut cmd = crate::engine::detached();
        cmd.args(["runuser", "-u", user, "--"])
            .env("XDG_RUNTIME_DIR", ROOTLESS_DIR)
            .env_remove("DBUS_SESSION_BUS_ADDRESS");
        start(&socket, cmd, log, &log_path, Some(user))?;
    }
    for image in images {
        copy_image(image, &socket)?;
    }
    Ok(format!("unix://{socket}"))
}

/// A copy of `file` in [`ROOTLESS_DIR`] owned by `user` (who may not read the checkout).
pub fn stage(file: &Path, user: &str) -> Result<std::path::PathBuf> {
    copy_into(file, Path::new(ROOTLESS_DIR), Some(user))
}

/// A copy of `file` in `dir`, owned by `owner` if given.
fn copy_into(file: &Path, dir: &Path, owner: Option<&str>) -> Result<std::path::PathBuf> {
    let name = file.file_name().context("a file name")?;
    let copy = dir.join(name);
    std::fs::copy(file, &copy).with_context(|| format!("copying {}", file.display()))?;
    if let Some(user) = owner
        && !run(Command::new("chown").arg(user).arg(&copy))?
    {
        bail!("chown {user} {} failed", copy.display());
    }
    Ok(copy)
}

fn run(cmd: &mut Command) -> Result<bool> {
    Ok(cmd
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()?
        .success())
}

/// Starts `podman system service` on `socket` through `launcher` ([`crate::engine::detached`],
/// with `runuser ...` for a `user`) and waits until it answers. It outlives the checkout,
/// so its configuration is copied beside the socket (readable by `user`, who may not read
/// a checkout under `/root`).
fn start(
    socket: &str,
    mut launcher: Command,
    log: std::fs::File,
    log_path: &str,
    user: Option<&str>,
) -> Result<()> {
    let _ = std::fs::remove_file(socket);
    let conf = copy_into(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("../testenv/podman/containers.conf"),
        Path::new(socket)
            .parent()
            .context("the socket's directory")?,
        user,
    )?;
    eprintln!("starting podman system service on {socket} (log: {log_path})");
    launcher
        .args(["podman", "system", "service", "--time=0"])
        .arg(format!("unix://{socket}"))
        .env("CONTAINERS_CONF", conf)
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()?;
    let start = Instant::now();
    while !answers(socket) {
        if start.elapsed() > Duration::from_secs(60) {
            bail!(
                "started podman system service but it did not answer within 60 s; see {log_path}"
            );
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    Ok(())
}

fn image_id(host: Option<&str>, image: &str) -> Result<String> {
    let mut cmd = Command::new("docker");
    if let Some(host) = host {
        cmd.args(["-H", host]);
    }
    let out = cmd
        .args(["image", "inspect", "--format", "{{.Id}}", image])
        .output()?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Copies `image` from the Docker engine into the store of the Podman service on
/// `socket` (through its API) unless it is there already.
fn copy_image(image: &str, socket: &str) -> Result<()> {
    let podman = format!("unix://{socket}");
    let want = image_id(None, image)?;
    if want.is_empty() {
        bail!("{image} is not on the Docker engine (cargo xtask test-images)");
    }
    if image_id(Some(&podman), image)? == want {
        return Ok(());
    }
    let mut save = Command::new("docker")
        .args(["save", image])
        .stdout(Stdio::piped())
        .spawn()?;
    let stdout = save.stdout.take().context("docker save's stdout")?;
    let load = Command::new("docker")
        .args(["-H", &podman, "load", "--quiet"])
        .stdin(stdout)
        .stdout(Stdio::null())
        .status()?;
    let saved = save.wait()?;
    if !(saved.success() && load.success()) {
        bail!(
            "copying {image} into Podman at {socket} failed (docker save: {saved}, load: {load})"
        );
    }
    eprintln!("copied {image} into Podman at {socket}");
    Ok(())
}
