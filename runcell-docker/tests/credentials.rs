//! Pulls from a registry on loopback that wants basic auth (Debian's `docker-registry`
//! with an htpasswd file): explicit credentials, a `config.json` `auths` entry and a
//! credential helper (`credsStore` and `credHelpers`, a script on the PATH of a child
//! process) work, none or wrong
//! ones are a typed error naming the image and the registry, never the password, and
//! nothing is created. Skipped without an engine or the registry binary, unless `CI` is
//! set or `RUNCELL_REQUIRE` names docker: then it fails. No outside registry is contacted.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};

use base64::Engine;
use runcell_core::{Driver, ErrorKind, ExecSpec, Network, RunExt, RunSpec};
use runcell_docker::{DockerConfig, DockerDriver};

mod common;
use common::registry::{LocalTag, PASSWORD, REGISTRY, Registry, USER, push_test_image};
use common::strict;

const WRONG: &str = "wrong-Hh4nT9pQ";
const CASE: &str = "registry-credentials";

/// The whole text of an error: message, context and every source.
fn all_text(e: &runcell_core::Error) -> String {
    let mut text = format!("{e} {e:?}");
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(&format!(" {s} {s:?}"));
        source = s.source();
    }
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulls_use_registry_credentials() {
    let base = DockerConfig::default();
    if let Err(e) = DockerDriver::connect(base.clone()).await {
        assert!(!strict(), "CI or RUNCELL_REQUIRE names docker, but: {e}");
        eprintln!("no Docker engine, test skipped: {e}");
        return;
    }
    if !std::path::Path::new(REGISTRY).exists() {
        assert!(
            !strict(),
            "{REGISTRY} is missing: apt-get install docker-registry"
        );
        eprintln!("\n*** SKIPPED pulls_use_registry_credentials: {REGISTRY} is missing");
        return;
    }
    let registry = Registry::start(None);
    let host = format!("127.0.0.1:{}", registry.port);
    // Pushed with a login kept in a directory of the test's own.
    let (tag, local) = push_test_image(&host, "t");

    let empty = tempfile::tempdir().unwrap();
    let mut spec = RunSpec::new(&tag).label("sandbox.test/case", CASE);
    spec.network = Network::None;
    let selector = BTreeMap::from([("sandbox.test/case".to_string(), CASE.to_string())]);

    // No credentials: a typed error naming the image and the registry; nothing created.
    let anonymous = DockerDriver::connect(base.clone().docker_config_dir(empty.path()))
        .await
        .unwrap();
    let e = anonymous.create(&spec).await.unwrap_err();
    eprintln!("without credentials: {}", all_text(&e));
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    assert!(
        e.message().contains(&tag) && e.message().contains(&host),
        "{e}"
    );
    assert_eq!(e.context_value("registry"), Some(host.as_str()), "{e}");
    assert!(anonymous.list(&selector).await.unwrap().is_empty());

    // Wrong password: the same, and the password is nowhere in the error or the config.
    let wrong = base
        .clone()
        .credentials(&host, USER, WRONG)
        .docker_config_dir(empty.path());
    assert!(!format!("{wrong:?}").contains(WRONG), "{wrong:?}");
    let e = DockerDriver::connect(wrong)
        .await
        .unwrap()
        .create(&spec)
        .await
        .unwrap_err();
    eprintln!("with a wrong password: {}", all_text(&e));
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    assert!(e.message().contains(&host), "{e}");
    assert!(!all_text(&e).contains(WRONG), "{}", all_text(&e));
    assert!(anonymous.list(&selector).await.unwrap().is_empty());

    // Explicit credentials.
    let explicit = DockerDriver::connect(
        base.clone()
            .credentials(&host, USER, PASSWORD)
            .docker_config_dir(empty.path()),
    )
    .await
    .unwrap();
    pull_and_run(&explicit, &spec, &local).await;

    // A config.json of the test's own, with a base64 `auth` entry.
    let config_dir = tempfile::tempdir().unwrap();
    let auth = base64::engine::general_purpose::STANDARD.encode(format!("{USER}:{PASSWORD}"));
    std::fs::write(
        config_dir.path().join("config.json"),
        format!(r#"{{"auths": {{"http://{host}": {{"auth": "{auth}"}}}}}}"#),
    )
    .unwrap();
    let from_file = DockerDriver::connect(base.clone().docker_config_dir(config_dir.path()))
        .await
        .unwrap();
    let run = from_file.create(&spec).await.unwrap();
    run.stop().await.unwrap();
    local.remove();

    // A credential helper, as `credsStore` and as a `credHelpers` entry: a script of the
    // test's own on the PATH of a child process (this binary again), which pulls.
    let bin = tempfile::tempdir().unwrap();
    let helper = bin.path().join("docker-credential-runcelltest");
    std::fs::write(
        &helper,
        format!(
            "#!/bin/sh\n[ \"$1\" = get ] || exit 1\nread server\necho \"$server\" >> {log}\nprintf '{{\"ServerURL\":\"%s\",\"Username\":\"{USER}\",\"Secret\":\"{PASSWORD}\"}}' \"$server\"\n",
            log = bin.path().join("asked").display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&helper, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    for config in [
        r#"{"credsStore": "runcelltest"}"#.to_string(),
        format!(r#"{{"credHelpers": {{"{host}": "runcelltest"}}}}"#),
    ] {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), &config).unwrap();
        let path = format!(
            "{}:{}",
            bin.path().display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let out = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "pull_in_a_child", "--ignored", "--nocapture"])
            .env("PATH", path)
            .env("RUNCELL_TEST_CHILD_IMAGE", &tag)
            .env("RUNCELL_TEST_CHILD_CONFIG", dir.path())
            .output()
            .unwrap();
        assert!(
            out.status.success() && String::from_utf8_lossy(&out.stdout).contains("1 passed"),
            "a pull through the credential helper ({config}) failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        local.remove();
    }
    let asked = std::fs::read_to_string(bin.path().join("asked")).unwrap_or_default();
    assert_eq!(asked.lines().count(), 2, "the helper was asked: {asked:?}");
    assert!(asked.lines().all(|l| l.contains(&host)), "{asked:?}");

    for r in anonymous.list(&selector).await.unwrap() {
        anonymous.remove(&r.id).await.unwrap();
    }
    assert!(anonymous.list(&selector).await.unwrap().is_empty());
    drop(local);
    drop(registry);
}

/// A registry that speaks only HTTPS (its own CA, a certificate for 127.0.0.1) with basic
/// auth: a pull with credentials works, without them it is a typed error naming the image
/// and the registry. (dockerd counts 127.0.0.0/8 as an insecure registry range and skips
/// certificate verification there, so an untrusted CA cannot be shown failing on
/// loopback.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulls_from_a_tls_registry() {
    if let Err(e) = DockerDriver::connect(DockerConfig::default()).await {
        assert!(!strict(), "CI or RUNCELL_REQUIRE names docker, but: {e}");
        eprintln!("no Docker engine, test skipped: {e}");
        return;
    }
    let openssl = Command::new("openssl")
        .arg("version")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !std::path::Path::new(REGISTRY).exists() || !openssl {
        assert!(
            !strict(),
            "the TLS registry test needs {REGISTRY} and openssl"
        );
        eprintln!("\n*** SKIPPED pulls_from_a_tls_registry: tools or permissions missing");
        return;
    }
    let certs = tempfile::tempdir().unwrap();
    common::new_ca(certs.path(), "ca");
    common::issue(
        certs.path(),
        "ca",
        "server",
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    );
    let registry = Registry::start(Some(certs.path()));
    let host = format!("127.0.0.1:{}", registry.port);
    let (tag, local) = push_test_image(&host, "tls");

    let empty = tempfile::tempdir().unwrap();
    let mut spec = RunSpec::new(&tag).label("sandbox.test/case", "tls-registry");
    spec.network = Network::None;
    let selector = BTreeMap::from([("sandbox.test/case".to_string(), "tls-registry".to_string())]);
    let driver = DockerDriver::connect(
        DockerConfig::default()
            .credentials(&host, USER, PASSWORD)
            .docker_config_dir(empty.path()),
    )
    .await
    .unwrap();
    pull_and_run(&driver, &spec, &local).await;

    // Without credentials: refused over HTTPS too, typed, naming image and registry.
    let anonymous = DockerDriver::connect(DockerConfig::default().docker_config_dir(empty.path()))
        .await
        .unwrap();
    let e = anonymous.create(&spec).await.unwrap_err();
    eprintln!("without credentials: {}", all_text(&e));
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    assert!(
        e.message().contains(&tag) && e.message().contains(&host),
        "{e}"
    );
    assert!(driver.list(&selector).await.unwrap().is_empty());
    drop(local);
    drop(registry);
}

/// The child of the credential-helper step: pulls the image with only the given Docker
/// config directory (whose helper is on this process's PATH). Run only by that step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by pulls_use_registry_credentials in a child process"]
async fn pull_in_a_child() {
    let (Ok(image), Ok(config)) = (
        std::env::var("RUNCELL_TEST_CHILD_IMAGE"),
        std::env::var("RUNCELL_TEST_CHILD_CONFIG"),
    ) else {
        panic!("only run by pulls_use_registry_credentials");
    };
    let driver = DockerDriver::connect(DockerConfig::default().docker_config_dir(config))
        .await
        .unwrap();
    let mut spec = RunSpec::new(&image).label("sandbox.test/case", CASE);
    spec.network = Network::None;
    let run = driver.create(&spec).await.unwrap();
    run.stop().await.unwrap();
}

#[tokio::test]
async fn registry_keys_come_together_and_errors_hold_no_password() {
    let config = runcell_core::DriverConfig::new(
        "docker",
        [("registry_username", USER), ("registry_password", PASSWORD)],
    );
    let e = runcell_core::connect("docker", config).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config, "{e}");
    assert!(e.message().contains("registry_server"), "{e}");
    assert!(!all_text(&e).contains(PASSWORD), "{}", all_text(&e));
}

/// Creates a run of `spec` (which pulls), execs `true` in it, stops it, and removes the
/// pulled image again.
async fn pull_and_run(driver: &DockerDriver, spec: &RunSpec, local: &LocalTag) {
    let run = driver.create(spec).await.unwrap();
    let out = run.exec(ExecSpec::new(["true"])).await.unwrap();
    assert!(out.status.success(), "{}", out.status);
    run.stop().await.unwrap();
    local.remove();
}
