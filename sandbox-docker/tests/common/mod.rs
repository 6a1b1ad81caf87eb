//! Shared by the registry and TLS tests: strictness, and certificates made with
//! `openssl` in a test's directory.
#![allow(dead_code)]

pub mod registry;

use std::path::Path;
use std::process::Command;

/// `CI` or `SANDBOX_REQUIRE` naming docker: a missing tool fails instead of skipping.
pub fn strict() -> bool {
    let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0");
    ci || std::env::var("SANDBOX_REQUIRE")
        .unwrap_or_default()
        .split(',')
        .any(|d| d.trim() == "docker")
}

pub fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn new_ca(dir: &Path, name: &str) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}"),
            "-keyout",
            &format!("{name}-key.pem"),
            "-out",
            &format!("{name}-cert.pem"),
        ],
    );
}

/// A key and a certificate signed by `ca`, in `dir`: `<name>-key.pem`, `<name>-cert.pem`.
pub fn issue(dir: &Path, ca: &str, name: &str, ext: &str) {
    std::fs::write(dir.join(format!("{name}.ext")), ext).unwrap();
    openssl(dir, &["genrsa", "-out", &format!("{name}-key.pem"), "2048"]);
    openssl(
        dir,
        &[
            "req",
            "-new",
            "-subj",
            &format!("/CN={name}"),
            "-key",
            &format!("{name}-key.pem"),
            "-out",
            &format!("{name}.csr"),
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-days",
            "2",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{ca}-cert.pem"),
            "-CAkey",
            &format!("{ca}-key.pem"),
            "-CAcreateserial",
            "-out",
            &format!("{name}-cert.pem"),
            "-extfile",
            &format!("{name}.ext"),
        ],
    );
}
