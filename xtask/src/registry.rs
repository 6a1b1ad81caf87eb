//! The loopback registry of the Kubernetes snapshot suite: Debian's `docker-registry` on
//! 127.0.0.1 (plain HTTP, deletes allowed), with the suite's base image pushed into it (the
//! node pulls runs' images from it, and a snapshot is that base plus a layer); killed on
//! drop. The leftover check asks it for the snapshot tags left.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};

/// Where snapshots go in it.
pub const SNAPSHOTS: &str = "runcell-snapshots";

/// The running registry.
pub struct Registry {
    child: Child,
    /// `127.0.0.1:<port>`.
    pub host: String,
    /// The suite's image, pushed as `<host>/runcell-base/busybox:<unique>`.
    pub base: String,
    dir: PathBuf,
}

impl Registry {
    /// Starts it and pushes the suite's image (`image`, in the local Docker engine) with a
    /// label of its own: an image ID of its own, so that the node never takes the pulled
    /// copy for its imported suite image (containerd 1.6 lost the imported one then).
    pub fn start(image: &str) -> Result<Registry> {
        let binary = "/usr/bin/docker-registry";
        ensure!(
            std::path::Path::new(binary).exists(),
            "{binary} is missing (cargo xtask test installs docker-registry)"
        );
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let dir =
            std::env::temp_dir().join(format!("runcell-registry-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let config = dir.join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: 127.0.0.1:{port}\n",
                dir.join("data").display()
            ),
        )?;
        let child = Command::new(binary)
            .arg("serve")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {binary}"))?;
        let host = format!("127.0.0.1:{port}");
        let mut registry = Registry {
            child,
            host: host.clone(),
            base: String::new(),
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            ensure!(
                Instant::now() < deadline,
                "docker-registry did not listen on {host}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let unique = format!("{}-{port}", std::process::id());
        let tag = format!("{host}/runcell-base/busybox:{unique}");
        let container = format!("runcell-base-{unique}");
        docker(&["create", "--name", &container, image, "true"])?;
        let label = format!("LABEL runcell.test.base={unique}");
        let committed = docker(&["commit", "--change", &label, &container, &tag]);
        docker(&["rm", "-f", "-v", &container])?;
        committed?;
        let pushed = docker(&["push", &tag]);
        // The node pulls it from the registry; the engine's copy is not needed.
        let _ = docker(&["rmi", "-f", &tag]);
        pushed?;
        registry.base = tag;
        Ok(registry)
    }

    /// The repository snapshots go to (`RUNCELL_K8S_SNAPSHOT_REGISTRY`).
    pub fn snapshots(&self) -> String {
        format!("{}/{SNAPSHOTS}", self.host)
    }

    /// The snapshot tags in it (none once every suite cleaned up).
    pub fn snapshot_tags(&self) -> Result<Vec<String>> {
        let body = self.get(&format!("/v2/{SNAPSHOTS}/tags/list"))?;
        if body.is_empty() {
            return Ok(Vec::new());
        }
        let json: serde_json::Value = serde_json::from_str(&body)
            .with_context(|| format!("the registry's tag list: {body}"))?;
        Ok(json
            .get("tags")
            .and_then(|t| t.as_array())
            .map(|t| {
                t.iter()
                    .filter_map(|v| v.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default())
    }

    /// A GET's body (empty on 404).
    fn get(&self, path: &str) -> Result<String> {
        let mut s = std::net::TcpStream::connect(&self.host)?;
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        write!(s, "GET {path} HTTP/1.0\r\nHost: {}\r\n\r\n", self.host)?;
        let mut answer = String::new();
        s.read_to_string(&mut answer)?;
        let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
        let status = head.split_whitespace().nth(1).unwrap_or("");
        match status {
            "200" => Ok(body.to_string()),
            "404" => Ok(String::new()),
            _ => bail!("the registry answered {path} with {head}"),
        }
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn docker(args: &[&str]) -> Result<()> {
    let out = Command::new("docker")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("running docker")?;
    ensure!(
        out.status.success(),
        "docker {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}
