//! A Docker daemon over ssh on loopback: the test's own `sshd` on `127.0.0.1:<port>`
//! (host and client keys made here with `ssh-keygen`, its configuration in the test's
//! directory), whose sessions run `docker system dial-stdio` against the engine. The
//! driver connects with `ssh_key` and `ssh_known_hosts` (nothing of the user's `~/.ssh`
//! is read for host keys or written), starts a run, execs, moves a file and stops; a
//! changed host key, a key the server does not accept, and ssh settings for a host that is
//! not `ssh://` are typed errors. Needs root (sshd). Skipped without the engine, `sshd`,
//! `ssh` or root, unless `CI` is set or `RUNCELL_REQUIRE` names docker: then it fails.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use runcell_core::{
    DriverExt, ErrorKind, ExecHelper, ExecPath, ExecSpec, Network, PullPolicy, RunExt, RunSpec,
};
use runcell_docker::{DockerConfig, DockerDriver};

mod common;
use common::{can_run, whole_run};

const SOCKET: &str = "/var/run/docker.sock";
const SSHD: &str = "/usr/sbin/sshd";

fn missing() -> Option<String> {
    if !Path::new(SOCKET).exists() {
        return Some(format!("no Docker engine at {SOCKET}"));
    }
    if !Path::new(SSHD).exists() {
        return Some(format!("no {SSHD} (Debian: openssh-server)"));
    }
    let ok = |program: &str, arg: &str| {
        Command::new(program)
            .arg(arg)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok()
    };
    if !ok("ssh", "-V") || !ok("ssh-keygen", "--help") {
        return Some("no ssh client (Debian: openssh-client)".into());
    }
    if !ok("docker", "--version") {
        return Some("no docker CLI (the remote side runs `docker system dial-stdio`)".into());
    }
    let uid = Command::new("id").arg("-u").output().unwrap().stdout;
    if String::from_utf8_lossy(&uid).trim() != "0" {
        return Some("sshd needs root".into());
    }
    None
}

fn keygen(path: &Path) -> String {
    let out = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", "sandbox-test", "-f"])
        .arg(path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read_to_string(path.with_extension("pub")).unwrap()
}

/// The test's sshd on loopback; killed when dropped.
struct Sshd {
    child: Child,
    port: u16,
}

impl Drop for Sshd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn sshd(dir: &Path, host_key: &Path, authorized: &Path) -> Sshd {
    // Its privilege-separation directory.
    std::fs::create_dir_all("/run/sshd").unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = dir.join("sshd_config");
    std::fs::write(
        &config,
        format!(
            "Port {port}\nListenAddress 127.0.0.1\nHostKey {}\nAuthorizedKeysFile {}\n\
             PidFile {}\nStrictModes no\nUsePAM no\nPasswordAuthentication no\n\
             KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n\
             LogLevel VERBOSE\n",
            host_key.display(),
            authorized.display(),
            dir.join("sshd.pid").display()
        ),
    )
    .unwrap();
    let log = std::fs::File::create(dir.join("sshd.log")).unwrap();
    let child = Command::new(SSHD)
        .args(["-D", "-e", "-f"])
        .arg(&config)
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let mut sshd = Sshd { child, port };
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Ok(Some(status)) = sshd.child.try_wait() {
            panic!(
                "sshd exited ({status}): {}",
                std::fs::read_to_string(dir.join("sshd.log")).unwrap_or_default()
            );
        }
        assert!(Instant::now() < deadline, "sshd did not listen");
        std::thread::sleep(Duration::from_millis(50));
    }
    sshd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_over_ssh_on_loopback() {
    if !can_run("the ssh test", missing()) {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let host_key = dir.join("host_key");
    let host_pub = keygen(&host_key);
    let client_key = dir.join("client_key");
    let authorized = dir.join("authorized_keys");
    std::fs::write(&authorized, keygen(&client_key)).unwrap();
    let server = sshd(dir, &host_key, &authorized);
    let known_hosts = dir.join("known_hosts");
    std::fs::write(
        &known_hosts,
        format!("[127.0.0.1]:{} {host_pub}", server.port),
    )
    .unwrap();
    let address = format!("ssh://root@127.0.0.1:{}", server.port);
    let config = |key: &PathBuf, known: &PathBuf| {
        DockerConfig::default()
            .host(&address)
            .ssh_key(key)
            .ssh_known_hosts(known)
    };

    // A whole run over ssh, and the same through the registry's config keys.
    let driver = DockerDriver::connect(config(&client_key, &known_hosts))
        .await
        .unwrap_or_else(|e| {
            panic!(
                "connect over ssh: {e}\nsshd: {}",
                std::fs::read_to_string(dir.join("sshd.log")).unwrap_or_default()
            )
        });
    whole_run(
        &driver,
        "ssh",
        vec![
            ("host", address.clone()),
            ("ssh_key", client_key.display().to_string()),
            ("ssh_known_hosts", known_hosts.display().to_string()),
        ],
    )
    .await;

    // The plain exec path: stdin through the engine's attach stream, whose end of input
    // must reach the remote (`cat` ends only then).
    let spec = RunSpec::new("sandbox-test/busybox:latest")
        .pull(PullPolicy::Never)
        .network(Network::None)
        .exec_helper(ExecHelper::Off)
        .label("sandbox.test/case", "ssh-plain");
    let run = driver.start(&spec).await.expect("a plain run over ssh");
    assert_eq!(run.exec_path(), ExecPath::Plain);
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        run.exec(ExecSpec::new(["cat"]).stdin_bytes(&b"to the end"[..])),
    )
    .await
    .expect("stdin's end did not reach the remote: cat never ended")
    .unwrap();
    assert_eq!(out.stdout_str(), "to the end");
    run.stop().await.unwrap();

    // Another host key than the one known: refused, the ssh client's words in the error.
    let other = dir.join("other_known_hosts");
    let impostor = keygen(&dir.join("impostor_key"));
    std::fs::write(&other, format!("[127.0.0.1]:{} {impostor}", server.port)).unwrap();
    let err = DockerDriver::connect(config(&client_key, &other))
        .await
        .expect_err("a changed host key was accepted");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(err.to_string().contains(&address), "{err}");
    assert!(
        err.to_string().contains("Host key verification failed"),
        "{err}"
    );

    // A key the server does not accept.
    let stranger = dir.join("stranger_key");
    keygen(&stranger);
    let err = DockerDriver::connect(config(&stranger, &known_hosts))
        .await
        .expect_err("an unknown client key was accepted");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(err.to_string().contains("Permission denied"), "{err}");

    // ssh settings for a host that is not ssh://: a configuration error naming the field.
    let err = DockerDriver::connect(
        DockerConfig::default()
            .host(format!("unix://{SOCKET}"))
            .ssh_key(&client_key),
    )
    .await
    .expect_err("ssh_key for a unix socket was accepted");
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    assert_eq!(err.field(), Some("ssh_key"), "{err}");
    drop(server);
}
