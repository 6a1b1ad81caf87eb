//! Compiles the in-sandbox exec helper (`helper/main.rs`, std only) into a static
//! executable and embeds it, so that a user of any driver crate gets it with no step of
//! their own and the build stays offline: plain `rustc` (the same compiler cargo runs),
//! glibc `crt-static` (a static-pie that runs in any Linux image of the same
//! architecture, `FROM scratch` included). Without a Linux target or a static C library
//! the helper is left out with a warning, and runs use the plain exec path (set
//! `RUNCELL_HELPER_REQUIRED=1` to make that a build error instead).

use std::env;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Command;

#[path = "helper/proto.rs"]
#[allow(dead_code)]
mod proto;

fn main() {
    println!("cargo:rerun-if-changed=helper");
    println!("cargo:rerun-if-env-changed=RUNCELL_HELPER_REQUIRED");
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let target = env::var("TARGET").expect("cargo sets TARGET");
    let exe = out.join("runcell-helper");
    let built = if target.contains("-linux-gnu") {
        compile(&target, &exe)
    } else {
        Err(format!("{target} is not a Linux glibc target"))
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
            if env::var_os("RUNCELL_HELPER_REQUIRED").is_some_and(|v| v != "0") {
                panic!("the exec helper could not be built: {why}");
            }
            println!(
                "cargo:warning=the exec helper could not be built ({why}); runs will use the plain exec path"
            );
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
