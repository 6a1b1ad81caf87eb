//! A registry on loopback for pull tests (Debian's `docker-registry` with basic auth),
//! and the suite's image pushed to it. Shared by the Docker tests and, by path, by the
//! Kubernetes driver's pull test.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The registry's user and password.
pub const USER: &str = "runcell";
pub const PASSWORD: &str = "pw-Zq8vK2xLr7";
/// Debian's `docker-registry`.
pub const REGISTRY: &str = "/usr/bin/docker-registry";

pub fn docker(args: &[&str], stdin: Option<&str>) {
    let mut child = Command::new("docker")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    if let Some(input) = stdin {
        std::io::Write::write_all(&mut child.stdin.take().unwrap(), input.as_bytes()).unwrap();
    }
    drop(child.stdin.take());
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "docker {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `docker-registry serve` on 127.0.0.1 with htpasswd auth; killed on drop.
pub struct Registry {
    child: std::process::Child,
    pub port: u16,
    _dir: tempfile::TempDir,
    config: std::path::PathBuf,
}

impl Registry {
    /// With basic auth ([`USER`], [`PASSWORD`]); with `tls`: the directory of
    /// `server-cert.pem` and `server-key.pem` (HTTPS).
    pub fn start(tls: Option<&std::path::Path>) -> Registry {
        Registry::start_with(true, tls)
    }

    /// Without auth or TLS.
    pub fn open() -> Registry {
        Registry::start_with(false, None)
    }

    /// Without auth or TLS, with `storage` added to its storage settings (YAML lines
    /// indented by two: `  delete:\n    enabled: true\n`).
    pub fn open_with(storage: &str) -> Registry {
        Registry::start_full(false, None, storage)
    }

    /// With basic auth ([`USER`], [`PASSWORD`]) and `storage` as in [`Registry::open_with`].
    pub fn login_with(storage: &str) -> Registry {
        Registry::start_full(true, None, storage)
    }

    fn start_with(auth: bool, tls: Option<&std::path::Path>) -> Registry {
        Registry::start_full(auth, tls, "")
    }

    fn start_full(auth: bool, tls: Option<&std::path::Path>, storage: &str) -> Registry {
        let dir = tempfile::tempdir().unwrap();
        let htpasswd = dir.path().join("htpasswd");
        let hash = bcrypt::hash(PASSWORD, 5).unwrap();
        std::fs::write(&htpasswd, format!("{USER}:{hash}\n")).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let config = dir.path().join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\n{storage}http:\n  addr: 127.0.0.1:{port}\n{}{}",
                dir.path().join("data").display(),
                tls.map(|d| format!(
                    "  tls:\n    certificate: {}\n    key: {}\n",
                    d.join("server-cert.pem").display(),
                    d.join("server-key.pem").display()
                ))
                .unwrap_or_default(),
                if auth {
                    format!(
                        "auth:\n  htpasswd:\n    realm: runcell-test\n    path: {}\n",
                        htpasswd.display()
                    )
                } else {
                    String::new()
                }
            ),
        )
        .unwrap();
        let child = serve(&config);
        let registry = Registry {
            child,
            port,
            _dir: dir,
            config,
        };
        registry.wait_listening();
        registry
    }

    fn wait_listening(&self) {
        let port = self.port;
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "docker-registry did not listen on 127.0.0.1:{port}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Kills it (SIGKILL: no request it was serving ends well).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Where it keeps what was pushed.
    pub fn data_dir(&self) -> std::path::PathBuf {
        self._dir.path().join("data")
    }

    /// Starts it again on the same port and storage.
    pub fn restart(&mut self) {
        self.kill();
        self.child = serve(&self.config);
        self.wait_listening();
    }
}

fn serve(config: &Path) -> std::process::Child {
    Command::new(REGISTRY)
        .arg("serve")
        .arg(config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Removes the local copy of the pushed tag, now and on drop.
pub struct LocalTag(pub String);

impl LocalTag {
    pub fn remove(&self) {
        let _ = Command::new("docker")
            .args(["rmi", "-f", &self.0])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

impl Drop for LocalTag {
    fn drop(&mut self) {
        self.remove();
    }
}

/// The suite's image with a label of its own as `<host>/<repo>/busybox:<unique>` (an image
/// ID of its own: a node that pulls it never confuses it with the suite's image), pushed
/// with a login of the test's own; the local copy is removed (so that a run must pull it).
pub fn push_test_image(host: &str, repo: &str) -> (String, LocalTag) {
    let unique = format!("{}-{}", std::process::id(), rand_suffix());
    let tag = format!("{host}/{repo}/busybox:{unique}");
    let image = runcell_core::envvar::var("RUNCELL_CONFORMANCE_IMAGE")
        .unwrap_or_else(|| "sandbox-test/busybox:latest".into());
    let local = LocalTag(tag.clone());
    let login = tempfile::tempdir().unwrap();
    let login_dir = login.path().to_str().unwrap();
    // A container that never starts, committed with the label: no build, no network.
    let container = format!("runcell-push-{unique}");
    docker(&["create", "--name", &container, &image, "true"], None);
    let label = format!("LABEL runcell.test.push={unique}");
    let committed = Command::new("docker")
        .args(["commit", "--change", &label, &container, &tag])
        .output()
        .unwrap();
    docker(&["rm", "-f", "-v", &container], None);
    assert!(
        committed.status.success(),
        "docker commit: {}",
        String::from_utf8_lossy(&committed.stderr)
    );
    docker(
        &[
            "--config",
            login_dir,
            "login",
            "-u",
            USER,
            "--password-stdin",
            host,
        ],
        Some(PASSWORD),
    );
    docker(&["--config", login_dir, "push", &tag], None);
    local.remove();
    (tag, local)
}

pub fn rand_suffix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos()
        .into()
}

/// `openssl` with `args` in `dir`; fails the test on an error.
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
