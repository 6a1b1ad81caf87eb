//! The Docker engine the tests need: found, started, or reported missing exactly.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

fn docker_answers() -> bool {
    Command::new("docker")
        .args(["version", "--format", "{{.Server.Version}}"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn installed(package: &str) -> bool {
    Command::new("dpkg")
        .args(["-s", package])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn on_path(program: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A Debian package, and how to tell it is there.
type Package = (&'static str, fn() -> bool);

/// The Debian packages the tests need besides the demo's: the TLS and ssh transports'
/// tests (openssl, sshd, ssh), the loopback registry (docker-registry), and Podman's
/// rootful and rootless services (podman, catatonit, newuidmap), and the test cluster's
/// real node (containerd and runc, which docker.io also brings, and the CNI plugins).
const TEST_PACKAGES: [Package; 11] = [
    ("openssl", || on_path("openssl")),
    ("docker-registry", || installed("docker-registry")),
    ("podman", || on_path("podman")),
    ("catatonit", || installed("catatonit")),
    ("uidmap", || {
        std::path::Path::new("/usr/bin/newuidmap").exists()
    }),
    ("openssh-server", || {
        std::path::Path::new("/usr/sbin/sshd").exists()
    }),
    ("openssh-client", || on_path("ssh")),
    ("containerd", || on_path("containerd")),
    ("runc", || on_path("runc")),
    ("containernetworking-plugins", || {
        std::path::Path::new("/usr/lib/cni/bridge").exists()
    }),
    // The CLI's terminal test drives `sandbox exec -it` in a real terminal.
    ("tmux", || on_path("tmux")),
];

/// What the demo needs on the machine: the Docker engine and CLI, and a static busybox
/// for the test image; with `for_tests`, also [`TEST_PACKAGES`]. On Debian as root,
/// installs what is missing with apt-get (saying what); elsewhere says exactly what to
/// install.
pub fn ensure_packages(for_tests: bool) -> Result<()> {
    let has_docker = Command::new("docker").arg("--version").output().is_ok()
        && ["/usr/sbin/dockerd", "/usr/bin/dockerd"]
            .iter()
            .any(|p| std::path::Path::new(p).exists());
    let mut need = Vec::new();
    if !has_docker && !docker_answers() {
        need.push("docker.io");
    }
    // Debian's package where dpkg is; elsewhere a busybox at the path the image takes.
    let has_busybox = if std::path::Path::new("/usr/bin/dpkg").exists() {
        installed("busybox-static")
    } else {
        std::path::Path::new("/bin/busybox").exists()
    };
    if !has_busybox {
        need.push("busybox-static");
    }
    if for_tests {
        need.extend(
            TEST_PACKAGES
                .iter()
                .filter(|(_, present)| !present())
                .map(|(name, _)| *name),
        );
    }
    if need.is_empty() {
        return Ok(());
    }
    let apt = std::path::Path::new("/usr/bin/apt-get").exists();
    if !(apt && is_root()) {
        bail!(
            "missing: {}. Install them: `sudo apt-get install {}` on Debian or Ubuntu; elsewhere their equivalents (the Docker engine and CLI, a statically linked busybox at /bin/busybox, ...)",
            need.join(", "),
            need.join(" ")
        );
    }
    eprintln!("installing {} with apt-get", need.join(" "));
    let update = Command::new("apt-get").args(["update", "-qq"]).status()?;
    if !update.success() {
        bail!("apt-get update failed: {update}");
    }
    let install = Command::new("apt-get")
        .args(["install", "-y", "-qq"])
        .args(&need)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()?;
    if !install.success() {
        bail!("apt-get install {} failed: {install}", need.join(" "));
    }
    eprintln!("installed {}", need.join(" "));
    Ok(())
}

/// The launcher of an engine this task starts (`detached().arg(program)...`): in a
/// session of its own (a signal to this task's process group does not reach it), in `/`
/// with `PWD=/`, input closed. It outlives this task, and a later run from another
/// checkout reuses it, so it must hold no directory of this one: once the directory an
/// engine was started in is deleted, Podman's conmon fails every container start ("Failed
/// to get working directory"; rootless Podman re-enters it through `PWD`).
pub fn detached() -> Command {
    let mut command = Command::new("setsid");
    command
        .current_dir("/")
        .env("PWD", "/")
        .stdin(Stdio::null());
    command
}

/// Makes sure a Docker engine answers: starts `dockerd` if it is installed and we are
/// root, otherwise says exactly what is missing.
pub fn ensure_docker() -> Result<()> {
    if docker_answers() {
        return Ok(());
    }
    if Command::new("docker").arg("--version").output().is_err() {
        bail!("the docker CLI is missing: install Debian's docker.io (apt-get install docker.io)");
    }
    let dockerd = ["/usr/sbin/dockerd", "/usr/bin/dockerd"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists());
    let Some(dockerd) = dockerd else {
        bail!("no Docker engine answers and dockerd is not installed: apt-get install docker.io");
    };
    if std::env::var("DOCKER_HOST").is_ok_and(|h| !h.is_empty()) {
        bail!("DOCKER_HOST is set but no engine answers there");
    }
    eprintln!("starting {dockerd} (log: /var/log/sandbox-dockerd.log)");
    let log = std::fs::File::create("/var/log/sandbox-dockerd.log")
        .or_else(|_| std::fs::File::create(std::env::temp_dir().join("sandbox-dockerd.log")))?;
    detached()
        .arg(dockerd)
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()?;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(60) {
        if docker_answers() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    bail!(
        "started dockerd but it did not answer within 60 s; see /var/log/sandbox-dockerd.log (are you root?)"
    )
}

/// The label the conformance suite puts on every run of a session
/// (`runcell_conformance::SESSION_LABEL`).
pub const SESSION_LABEL: &str = "sandbox.conformance/session";

/// Fails if a container made by the library in this test session (label
/// `sandbox.conformance/session=<session>`) is left on the engine. Other containers,
/// a developer's own runs or a parallel job's, are not this session's business.
/// The engine's volumes that no container uses (`host`: another engine's address). An
/// anonymous volume carries no label: one the tests left is found as one more of these
/// at the end than at the start ([`assert_no_new_dangling_volumes`]).
pub fn dangling_volumes(host: Option<&str>) -> Result<std::collections::BTreeSet<String>> {
    let mut ls = Command::new("docker");
    if let Some(host) = host {
        ls.args(["-H", host]);
    }
    let out = ls
        .args(["volume", "ls", "-q", "--filter", "dangling=true"])
        .output()?;
    if !out.status.success() {
        bail!(
            "docker volume ls failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(String::from)
        .collect())
}

/// Fails when the engine has volumes no container uses that were not there `before`: a
/// run removed without its anonymous volumes (its workspace, its `/.runcell`).
pub fn assert_no_new_dangling_volumes(
    before: &std::collections::BTreeSet<String>,
    host: Option<&str>,
) -> Result<()> {
    let new: Vec<String> = dangling_volumes(host)?
        .difference(before)
        .cloned()
        .collect();
    let engine = host.unwrap_or("the Docker engine");
    if !new.is_empty() {
        bail!(
            "the tests left {} volume(s) no container uses on {engine}: {}",
            new.len(),
            new.join(" ")
        );
    }
    eprintln!("no volume was left on {engine}");
    Ok(())
}

pub fn assert_no_leftovers(session: &str, host: Option<&str>) -> Result<()> {
    let mut ps = Command::new("docker");
    if let Some(host) = host {
        ps.args(["-H", host]);
    }
    let out = ps
        .args(["ps", "-aq", "--filter", "label=sandbox.dev/managed-by"])
        .args(["--filter", &format!("label={SESSION_LABEL}={session}")])
        .output()?;
    if !out.status.success() {
        bail!(
            "docker ps failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let ids = String::from_utf8_lossy(&out.stdout);
    let ids: Vec<&str> = ids.split_whitespace().collect();
    if !ids.is_empty() {
        bail!(
            "the tests left {} container(s) of session {session} behind: {}",
            ids.len(),
            ids.join(" ")
        );
    }
    // A snapshot's commit carries the source container's labels: one left over is an
    // image of this session (a snapshot itself is checked by the suite's owner check).
    let mut images = Command::new("docker");
    if let Some(host) = host {
        images.args(["-H", host]);
    }
    let out = images
        .args([
            "images",
            "-aq",
            "--filter",
            &format!("label={SESSION_LABEL}={session}"),
        ])
        .output()?;
    let ids = String::from_utf8_lossy(&out.stdout);
    if out.status.success() && !ids.trim().is_empty() {
        bail!(
            "the tests left images of session {session} behind (a snapshot's commit?): {}",
            ids.split_whitespace().collect::<Vec<_>>().join(" ")
        );
    }
    let engine = host.unwrap_or("the Docker engine");
    eprintln!("no container or image of session {session} is left on {engine}");
    Ok(())
}
