//! Builds `probe/probe.rs`, the hostile process the isolation cases upload into a run
//! (std only, a static executable for the build's own target, as core builds its exec
//! helper), and embeds it. Without a Linux glibc target or a static C library the probe
//! is left out with a warning, and the cases that need it fail saying so.

use std::env;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=probe");
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let target = env::var("TARGET").expect("cargo sets TARGET");
    let exe = out.join("runcell-probe");
    let built = if target.contains("-linux-gnu") {
        let rustc = env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
        Command::new(rustc)
            .args(["--edition", "2024", "--crate-type", "bin"])
            .args(["--crate-name", "runcell_probe", "-C", "opt-level=s"])
            .args(["-C", "panic=abort", "-C", "strip=symbols"])
            .args(["-C", "target-feature=+crt-static", "--target", &target])
            .args(["--cap-lints", "warn"])
            .arg("probe/probe.rs")
            .arg("-o")
            .arg(&exe)
            .output()
            .map_err(|e| format!("cannot run rustc: {e}"))
            .and_then(|o| {
                if o.status.success() {
                    Ok(())
                } else {
                    Err(String::from_utf8_lossy(&o.stderr).into_owned())
                }
            })
    } else {
        Err(format!("{target} is not a Linux glibc target"))
    };
    let code = match built {
        Ok(()) => format!("pub(crate) const PROBE: &[u8] = include_bytes!({exe:?});\n"),
        Err(why) => {
            println!("cargo:warning=the isolation probe could not be built: {why}");
            "pub(crate) const PROBE: &[u8] = &[];\n".to_string()
        }
    };
    std::fs::write(out.join("probe_bin.rs"), code).expect("write probe_bin.rs");
}
