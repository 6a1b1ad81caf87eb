//! Compiles the in-sandbox exec helper (`helper/main.rs`, std only) into a static
//! executable and embeds it, so that a user of any driver crate gets it with no step of
//! their own and the build stays offline: plain `rustc` (the same compiler cargo runs),
//! glibc `crt-static` (a static-pie that runs in any Linux image of the same
//! architecture, `FROM scratch` included); on a `-linux-musl` target, musl's static
//! libc.
//!
//! The helper is never silently missing: a build that cannot make it fails, saying why
//! and how to go on. `RUNCELL_HELPER_PATH=/path/to/runcell-helper` embeds a prebuilt
//! helper instead (a static Linux executable for the targets' architecture, e.g. built on
//! a Linux machine: it is this crate's `helper/main.rs` compiled as above); and
//! `RUNCELL_HELPER_PATH=none` builds without one, on purpose: every run then takes the
//! plain exec path (no per-exec users on Kubernetes, one engine exec per command), and
//! the first such run logs it at warn level. docs.rs builds without one.

use std::env;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Command;

/// Where a prebuilt helper is, or `none`.
const PATH_ENV: &str = "RUNCELL_HELPER_PATH";

#[path = "helper/proto.rs"]
#[allow(dead_code)]
mod proto;

fn main() {
    println!("cargo:rerun-if-changed=helper");
    println!("cargo:rerun-if-env-changed={PATH_ENV}");
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let target = env::var("TARGET").expect("cargo sets TARGET");
    let given = env::var_os(PATH_ENV);
    let none = given.as_deref().is_some_and(|p| p == "none") || env::var_os("DOCS_RS").is_some();
    let exe = match &given {
        Some(path) if !none => {
            println!("cargo:rerun-if-changed={}", PathBuf::from(path).display());
            PathBuf::from(path)
        }
        _ => out.join("runcell-helper"),
    };
    let built = if none {
        Err(String::new())
    } else if given.is_some() {
        Ok(())
    } else if target.contains("-linux-gnu") || target.contains("-linux-musl") {
        compile(&target, &exe)
    } else {
        Err(format!("{target} is not a Linux target"))
    };
    let mut code = String::new();
    match built.and_then(|()| std::fs::read(&exe).map_err(|e| e.to_string())) {
        Ok(bytes) => {
            let mut digest = proto::Fnv::default();
            digest.update(&bytes);
            writeln!(
                code,
                "pub(crate) const BYTES: &[u8] = include_bytes!({exe:?});"
            )
            .unwrap();
            writeln!(code, "pub(crate) const DIGEST: u64 = {:#x};", digest.0).unwrap();
        }
        Err(why) => {
            if !none {
                panic!(
                    "the exec helper (the static program runcell runs inside every sandbox) could \
                     not be built: {why}\n\
                     Either make it buildable (a Linux target with a static C library: on Debian \
                     or Ubuntu `apt-get install libc6-dev`; for musl `rustup target add \
                     <arch>-unknown-linux-musl`), or set {PATH_ENV}=/path/to/runcell-helper (a \
                     prebuilt helper for the sandboxes' architecture), or set {PATH_ENV}=none to \
                     build without it (every run then takes the plain exec path)."
                );
            }
            code.push_str("pub(crate) const BYTES: &[u8] = &[];\n");
            code.push_str("pub(crate) const DIGEST: u64 = 0;\n");
        }
    }
    std::fs::write(out.join("helper_bin.rs"), code).expect("write helper_bin.rs");
}

fn compile(target: &str, exe: &PathBuf) -> Result<(), String> {
    let rustc = env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let output = Command::new(rustc)
        .args([
            "--edition",
            "2024",
            "--crate-type",
            "bin",
            "--crate-name",
            "runcell_helper",
        ])
        .args([
            "-C",
            "opt-level=s",
            "-C",
            "panic=abort",
            "-C",
            "codegen-units=1",
        ])
        .args(["-C", "strip=symbols", "-C", "target-feature=+crt-static"])
        .args(["--target", target, "--cap-lints", "warn"])
        .arg("helper/main.rs")
        .arg("-o")
        .arg(exe)
        .output()
        .map_err(|e| format!("cannot run rustc: {e}"))?;
    if output.status.success() {
        Ok(())
    } else {
        let stderr = String::from_utf8_lossy(&output.stderr);
        Err(format!(
            "rustc failed: {}",
            stderr
                .lines()
                .rev()
                .take(12)
                .collect::<Vec<_>>()
                .join(" | ")
        ))
    }
}
