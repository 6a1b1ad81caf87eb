//! The Podman engine the suite also runs on, through its Docker-compatible API: a service
//! on a socket of our own, with the test images copied from Docker.

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

fn answers() -> bool {
    let ping = || -> std::io::Result<bool> {
        let mut stream = UnixStream::connect(SOCKET)?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        stream.write_all(b"GET /_ping HTTP/1.0\r\nHost: podman\r\n\r\n")?;
        let mut answer = String::new();
        stream.read_to_string(&mut answer)?;
        Ok(answer.starts_with("HTTP/1.") && answer.ends_with("OK"))
    };
    ping().unwrap_or(false)
}

/// Makes sure the test Podman service answers on [`SOCKET`] with the test images in its
/// store, starting it if needed; returns the address for `SANDBOX_DOCKER_HOST`. Says
/// exactly what is missing otherwise.
pub fn ensure(images: &[&str]) -> Result<String> {
    if Command::new("podman").arg("--version").output().is_err() {
        bail!("podman is missing: apt-get install podman catatonit");
    }
    if !Path::new(CATATONIT).exists() {
        bail!(
            "{CATATONIT} is missing (Podman's init, used for `init: true`): apt-get install catatonit"
        );
    }
    if !answers() {
        let dir = Path::new(SOCKET)
            .parent()
            .context("the socket's directory")?;
        std::fs::create_dir_all(dir)?;
        let _ = std::fs::remove_file(SOCKET);
        let conf = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testenv/podman/containers.conf");
        eprintln!("starting podman system service on {SOCKET} (log: {LOG})");
        let log = std::fs::File::create(LOG)
            .or_else(|_| std::fs::File::create(std::env::temp_dir().join("sandbox-podman.log")))?;
        Command::new("setsid")
            .args(["podman", "system", "service", "--time=0"])
            .arg(format!("unix://{SOCKET}"))
            .env("CONTAINERS_CONF", conf)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        let start = Instant::now();
        while !answers() {
            if start.elapsed() > Duration::from_secs(60) {
                bail!("started podman system service but it did not answer within 60 s; see {LOG}");
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }
    for image in images {
        copy_image(image)?;
    }
    Ok(format!("unix://{SOCKET}"))
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

/// Copies `image` from the Docker engine into Podman's store unless it is there already.
fn copy_image(image: &str) -> Result<()> {
    let podman = format!("unix://{SOCKET}");
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
    let load = Command::new("podman")
        .args(["load", "--quiet"])
        .stdin(stdout)
        .stdout(Stdio::null())
        .status()?;
    let saved = save.wait()?;
    if !(saved.success() && load.success()) {
        bail!("copying {image} into Podman failed (docker save: {saved}, podman load: {load})");
    }
    eprintln!("copied {image} into Podman");
    Ok(())
}
