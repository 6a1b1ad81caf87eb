//! Test images built without any registry: a root filesystem made here, `docker import`ed.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

/// The busybox test image. Its ENTRYPOINT would leave a mark and exit 3: the suite proves
/// the library never runs it.
pub const BUSYBOX: &str = "sandbox-test/busybox:latest";
const BUSYBOX_BIN: &str = "/bin/busybox";
const ENTRYPOINT: &str = r#"ENTRYPOINT ["/bin/sh", "-c", "touch /entrypoint-ran; exit 3"]"#;

/// An image whose keep-alive cannot start: no `sleep` at all.
pub const NO_SLEEP: &str = "sandbox-test/no-sleep:latest";
/// An image whose `sleep` exits at once with an error.
pub const SLEEP_EXITS: &str = "sandbox-test/sleep-exits:latest";
/// An image without `tar` (files then move through the exec helper).
pub const NO_TAR: &str = "sandbox-test/no-tar:latest";

/// Every test image.
pub const ALL: [&str; 4] = [BUSYBOX, NO_SLEEP, SLEEP_EXITS, NO_TAR];

/// What differs between the test images.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum Variant {
    Full,
    NoSleep,
    SleepExits,
    NoTar,
}

/// The full ID (`sha256:...`) of a local image on Docker.
pub fn id(image: &str) -> Result<String> {
    let out = std::process::Command::new("docker")
        .args(["image", "inspect", "--format", "{{.Id}}", image])
        .output()
        .with_context(|| format!("docker image inspect {image}"))?;
    let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() || !id.starts_with("sha256:") {
        bail!(
            "docker image inspect {image} gave no image ID: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(id)
}

/// Builds the test images (cheap to repeat: a rebuild only retags).
pub fn build() -> Result<()> {
    if !Path::new(BUSYBOX_BIN).exists() {
        bail!(
            "{BUSYBOX_BIN} is missing: install Debian's busybox-static (apt-get install busybox-static)"
        );
    }
    if !is_static_elf(Path::new(BUSYBOX_BIN))? {
        bail!(
            "{BUSYBOX_BIN} is dynamically linked: install Debian's busybox-static (apt-get install busybox-static)"
        );
    }
    for (name, variant) in [
        (BUSYBOX, Variant::Full),
        (NO_SLEEP, Variant::NoSleep),
        (SLEEP_EXITS, Variant::SleepExits),
        (NO_TAR, Variant::NoTar),
    ] {
        let rootfs = match variant {
            // BusyBox's shell runs its applets by name whether or not a link exists, so
            // an image truly without `tar` is made of dash and the host's coreutils.
            Variant::NoTar => host_tools_rootfs(),
            _ => busybox_rootfs(variant),
        }
        .with_context(|| format!("building the root filesystem of {name}"))?;
        import(name, &rootfs)?;
    }
    Ok(())
}

/// `docker import`s a root filesystem as `name`, unless the image already holds it.
fn import(name: &str, rootfs: &[u8]) -> Result<()> {
    let hash = {
        use std::hash::{Hash, Hasher};
        let mut h = std::hash::DefaultHasher::new();
        (rootfs, ENTRYPOINT).hash(&mut h);
        format!("{:016x}", h.finish())
    };
    let current = Command::new("docker")
        .args([
            "image",
            "inspect",
            "--format",
            "{{index .Config.Labels \"sandbox.test/content\"}}",
            name,
        ])
        .output()?;
    if String::from_utf8_lossy(&current.stdout).trim() == hash {
        eprintln!("{name} is up to date");
        return Ok(());
    }
    let label = format!("LABEL sandbox.test/content={hash}");
    let mut child = Command::new("docker")
        .args([
            "import", "--change", ENTRYPOINT, "--change", "CMD []", "--change", &label, "-", name,
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .context("running docker import")?;
    child.stdin.take().expect("piped stdin").write_all(rootfs)?;
    let status = child.wait()?;
    if !status.success() {
        bail!("docker import of {name} failed: {status}");
    }
    eprintln!("built {name}");
    Ok(())
}

fn busybox_rootfs(variant: Variant) -> Result<Vec<u8>> {
    let busybox = std::fs::read(BUSYBOX_BIN)?;
    let applets = Command::new(BUSYBOX_BIN).arg("--list").output()?;
    let applets = String::from_utf8(applets.stdout)?;
    let mut tar = tar::Builder::new(Vec::new());
    for dir in [
        "bin",
        "etc",
        "etc/ssl",
        "etc/ssl/certs",
        "root",
        "proc",
        "sys",
        "dev",
        "usr",
        "usr/local",
        "usr/local/share",
        "usr/local/share/ca-certificates",
    ] {
        append_dir(&mut tar, dir, 0o755, 0)?;
    }
    append_dir(&mut tar, "tmp", 0o1777, 0)?;
    append_dir(&mut tar, "home", 0o755, 0)?;
    append_dir(&mut tar, "home/sandbox", 0o755, 1000)?;
    append_file(&mut tar, "bin/busybox", &busybox, 0o755)?;
    match variant {
        Variant::Full | Variant::NoSleep | Variant::NoTar => {}
        Variant::SleepExits => append_file(
            &mut tar,
            "bin/sleep",
            b"#!/bin/sh\necho \"sleep: the sleep of this test image always fails\" >&2\nexit 3\n",
            0o755,
        )?,
    }
    let skip_sleep = variant != Variant::Full;
    for applet in applets
        .lines()
        .filter(|a| !a.is_empty() && *a != "busybox" && !(skip_sleep && *a == "sleep"))
    {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Symlink);
        header.set_mode(0o777);
        header.set_size(0);
        tar.append_link(&mut header, format!("bin/{applet}"), "busybox")?;
    }
    append_file(&mut tar, "etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nsandbox:x:1000:1000:sandbox:/home/sandbox:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n", 0o644)?;
    append_file(
        &mut tar,
        "etc/group",
        b"root:x:0:\nsandbox:x:1000:\nnogroup:x:65534:\n",
        0o644,
    )?;
    // A system trust store (the host's roots), so the suite can check the full CA bundle.
    let roots = std::fs::read("/etc/ssl/certs/ca-certificates.crt").unwrap_or_default();
    append_file(&mut tar, "etc/ssl/certs/ca-certificates.crt", &roots, 0o644)?;
    Ok(tar.into_inner()?)
}

/// The host's tools the no-tar image holds (`/bin/sh` is dash): what the plain exec path,
/// the Kubernetes wrapper and the suite's file case need, and no `tar`.
const HOST_TOOLS: [&str; 17] = [
    "dash", "sleep", "cat", "chmod", "mv", "dd", "mkdir", "stat", "rm", "head", "tr", "ls", "env",
    "id", "wc", "grep", "touch",
];

/// A root filesystem of host binaries and the shared libraries `ldd` names for them.
fn host_tools_rootfs() -> Result<Vec<u8>> {
    let mut tar = tar::Builder::new(Vec::new());
    for dir in [
        "bin", "etc", "tmp", "root", "proc", "sys", "dev", "lib", "lib64", "usr",
    ] {
        append_dir(&mut tar, dir, if dir == "tmp" { 0o1777 } else { 0o755 }, 0)?;
    }
    append_dir(&mut tar, "lib/x86_64-linux-gnu", 0o755, 0)?;
    let mut libs = std::collections::BTreeSet::new();
    for tool in HOST_TOOLS {
        let path = Path::new("/usr/bin").join(tool);
        let name = if tool == "dash" { "sh" } else { tool };
        append_file(
            &mut tar,
            &format!("bin/{name}"),
            &std::fs::read(&path)?,
            0o755,
        )?;
        let ldd = Command::new("ldd")
            .arg(&path)
            .output()
            .context("running ldd")?;
        for line in String::from_utf8_lossy(&ldd.stdout).lines() {
            // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or "/lib64/ld-linux-x86-64.so.2 (0x...)"
            let lib = line.split("=>").last().unwrap_or("").trim();
            if let Some(lib) = lib.split_whitespace().next().filter(|l| l.starts_with('/')) {
                libs.insert(lib.to_string());
            }
        }
    }
    for lib in libs {
        append_file(
            &mut tar,
            lib.trim_start_matches('/'),
            &std::fs::read(&lib)?,
            0o755,
        )?;
    }
    append_file(
        &mut tar,
        "etc/passwd",
        b"root:x:0:0:root:/root:/bin/sh
nobody:x:65534:65534:nobody:/:/bin/false
",
        0o644,
    )?;
    append_file(
        &mut tar,
        "etc/group",
        b"root:x:0:
nogroup:x:65534:
",
        0o644,
    )?;
    Ok(tar.into_inner()?)
}

/// True for a 64-bit little-endian ELF without a program interpreter (PT_INTERP).
fn is_static_elf(path: &Path) -> Result<bool> {
    let elf = std::fs::read(path)?;
    let u16_at = |o: usize| u16::from_le_bytes([elf[o], elf[o + 1]]) as usize;
    if elf.len() < 64 || &elf[..4] != b"\x7fELF" || elf[4] != 2 || elf[5] != 1 {
        bail!(
            "{} is not a 64-bit little-endian ELF binary",
            path.display()
        );
    }
    let phoff = u64::from_le_bytes(elf[0x20..0x28].try_into()?) as usize;
    let (phentsize, phnum) = (u16_at(0x36), u16_at(0x38));
    const PT_INTERP: u32 = 3;
    Ok((0..phnum).all(|i| {
        let o = phoff + i * phentsize;
        elf.get(o..o + 4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
            != Some(PT_INTERP)
    }))
}

fn append_dir(tar: &mut tar::Builder<Vec<u8>>, path: &str, mode: u32, uid: u64) -> Result<()> {
    let mut header = tar::Header::new_gnu();
    header.set_entry_type(tar::EntryType::Directory);
    header.set_mode(mode);
    header.set_uid(uid);
    header.set_gid(uid);
    header.set_size(0);
    tar.append_data(&mut header, path, std::io::empty())?;
    Ok(())
}

fn append_file(tar: &mut tar::Builder<Vec<u8>>, path: &str, data: &[u8], mode: u32) -> Result<()> {
    let mut header = tar::Header::new_gnu();
    header.set_entry_type(tar::EntryType::Regular);
    header.set_mode(mode);
    header.set_size(data.len() as u64);
    tar.append_data(&mut header, path, data)?;
    Ok(())
}
