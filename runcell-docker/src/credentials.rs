//! Registry credentials for pulls: explicit ones from the driver config, else the Docker
//! CLI's `config.json` (`auths`, `credHelpers`, `credsStore`). Secrets never reach logs,
//! `Debug` output, labels or errors.

use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use base64::Engine;
use bollard::auth::DockerCredentials;
use runcell_core::{Error, ErrorKind, Result};

/// The key under which the Docker CLI keeps Docker Hub's credentials.
pub const DOCKER_HUB_KEY: &str = "https://index.docker.io/v1/";

/// Credentials for one registry, given explicitly. `Debug` shows the server and the user,
/// never the password.
#[derive(Clone, PartialEq, Eq)]
pub struct RegistryCredentials {
    /// The registry host (`registry.example:5000`, `docker.io`); a URL is reduced to its host.
    pub server: String,
    /// The user name.
    pub username: String,
    /// The password or token.
    pub password: String,
}

impl RegistryCredentials {
    /// Credentials of `username` on `server`.
    pub fn new(
        server: impl Into<String>,
        username: impl Into<String>,
        password: impl Into<String>,
    ) -> Self {
        RegistryCredentials {
            server: server.into(),
            username: username.into(),
            password: password.into(),
        }
    }
}

impl fmt::Debug for RegistryCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegistryCredentials")
            .field("server", &self.server)
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .finish()
    }
}

pub use runcell_core::{normalize_registry as normalize, registry_of};

/// The server name a credential helper and the daemon expect for `registry`.
fn server_address(registry: &str) -> String {
    if registry == "docker.io" {
        DOCKER_HUB_KEY.to_string()
    } else {
        registry.to_string()
    }
}

/// The credentials to send for a pull of `image`: the explicit ones for its registry,
/// else those of `config.json` in `docker_config_dir` (default `$DOCKER_CONFIG`, else
/// `~/.docker`). `None` pulls anonymously.
pub fn for_image(
    image: &str,
    explicit: &[RegistryCredentials],
    docker_config_dir: Option<&Path>,
) -> Result<Option<DockerCredentials>> {
    let registry = registry_of(image);
    if let Some(c) = explicit.iter().find(|c| normalize(&c.server) == registry) {
        return Ok(Some(DockerCredentials {
            username: Some(c.username.clone()),
            password: Some(c.password.clone()),
            serveraddress: Some(server_address(&registry)),
            ..Default::default()
        }));
    }
    let dir = match docker_config_dir {
        Some(d) => Some(d.to_path_buf()),
        None => default_config_dir(),
    };
    match dir {
        Some(dir) => from_config_file(&dir.join("config.json"), &registry),
        None => Ok(None),
    }
}

fn default_config_dir() -> Option<PathBuf> {
    match std::env::var_os("DOCKER_CONFIG") {
        Some(d) if !d.is_empty() => Some(PathBuf::from(d)),
        _ => std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".docker")),
    }
}

fn config_error(path: &Path, what: impl fmt::Display) -> Error {
    Error::new(
        ErrorKind::Config,
        format!("docker: {}: {what}", path.display()),
    )
    .with("path", path.display().to_string())
}

/// Credentials for `registry` from a Docker CLI `config.json`: its `credHelpers` entry,
/// else its `auths` entry, else its `credsStore`. A missing file is no credentials.
pub fn from_config_file(path: &Path, registry: &str) -> Result<Option<DockerCredentials>> {
    // A config file is small; a larger one is refused unread (bounded memory).
    const MAX_CONFIG_BYTES: u64 = 4 << 20;
    let mut text = String::new();
    let read = std::fs::File::open(path).and_then(|f| {
        use std::io::Read as _;
        f.take(MAX_CONFIG_BYTES + 1).read_to_string(&mut text)
    });
    match read {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(config_error(path, "cannot be read").with_source(e)),
    }
    if text.len() as u64 > MAX_CONFIG_BYTES {
        return Err(config_error(
            path,
            format_args!("is larger than {} MiB", MAX_CONFIG_BYTES >> 20),
        ));
    }
    // serde_json's messages quote no input, so no secret can leak through them.
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| config_error(path, e))?;
    let entry = |table: &str| {
        json.get(table)
            .and_then(|t| t.as_object())
            .and_then(|t| t.iter().find(|(k, _)| normalize(k) == registry))
            .map(|(_, v)| v)
    };
    if let Some(helper) = entry("credHelpers").and_then(|h| h.as_str()) {
        return helper_get(helper, registry);
    }
    if let Some(auth) = entry("auths").and_then(|a| a.as_object()) {
        let text = |k: &str| {
            auth.get(k)
                .and_then(|v| v.as_str())
                .filter(|s| !s.is_empty())
                .map(String::from)
        };
        let mut creds = DockerCredentials {
            username: text("username"),
            password: text("password"),
            identitytoken: text("identitytoken"),
            serveraddress: Some(server_address(registry)),
            ..Default::default()
        };
        if let Some(encoded) = text("auth") {
            let decoded = base64::engine::general_purpose::STANDARD
                .decode(encoded.trim())
                .ok()
                .and_then(|b| String::from_utf8(b).ok())
                .and_then(|s| {
                    s.split_once(':')
                        .map(|(u, p)| (u.to_string(), p.to_string()))
                })
                .ok_or_else(|| {
                    config_error(
                        path,
                        format!("auths entry for {registry}: auth is not base64 of user:password"),
                    )
                })?;
            creds.username = Some(decoded.0);
            creds.password = Some(decoded.1);
        }
        if creds.username.is_some() || creds.identitytoken.is_some() {
            return Ok(Some(creds));
        }
    }
    if let Some(store) = json.get("credsStore").and_then(|s| s.as_str()) {
        return helper_get(store, registry);
    }
    Ok(None)
}

/// `docker-credential-<helper> get` with the server on stdin. A helper that has no
/// credentials for it (non-zero exit) is no credentials; one that cannot be run is a
/// config error naming it.
fn helper_get(helper: &str, registry: &str) -> Result<Option<DockerCredentials>> {
    let program = format!("docker-credential-{helper}");
    let server = server_address(registry);
    let mut child = Command::new(&program)
        .arg("get")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| {
            Error::new(
                ErrorKind::Config,
                format!("docker: credential helper {program} cannot be run"),
            )
            .with("registry", registry)
            .with_source(e)
        })?;
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(server.as_bytes());
    }
    let out = child.wait_with_output().map_err(|e| {
        Error::new(
            ErrorKind::Config,
            format!("docker: credential helper {program} failed"),
        )
        .with("registry", registry)
        .with_source(e)
    })?;
    if !out.status.success() {
        tracing::debug!(helper = %program, registry, "credential helper has no credentials");
        return Ok(None);
    }
    parse_helper_output(&out.stdout, &server)
        .map(Some)
        .ok_or_else(|| {
            Error::new(
                ErrorKind::Config,
                format!(
                    "docker: credential helper {program} answered something other than its JSON"
                ),
            )
            .with("registry", registry)
        })
}

/// A helper's answer `{"ServerURL":..,"Username":..,"Secret":..}`; the user `<token>`
/// means the secret is an identity token.
fn parse_helper_output(stdout: &[u8], server: &str) -> Option<DockerCredentials> {
    let json: serde_json::Value = serde_json::from_slice(stdout).ok()?;
    let username = json.get("Username")?.as_str()?.to_string();
    let secret = json.get("Secret")?.as_str()?.to_string();
    Some(if username == "<token>" {
        DockerCredentials {
            identitytoken: Some(secret),
            serveraddress: Some(server.to_string()),
            ..Default::default()
        }
    } else {
        DockerCredentials {
            username: Some(username),
            password: Some(secret),
            serveraddress: Some(server.to_string()),
            ..Default::default()
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registries_of_references() {
        assert_eq!(registry_of("busybox"), "docker.io");
        assert_eq!(registry_of("library/busybox:1"), "docker.io");
        assert_eq!(registry_of("127.0.0.1:5000/t/img:v1"), "127.0.0.1:5000");
        assert_eq!(registry_of("localhost/img"), "localhost");
        assert_eq!(registry_of("ghcr.io/o/img@sha256:ab"), "ghcr.io");
        assert_eq!(normalize(DOCKER_HUB_KEY), "docker.io");
        assert_eq!(normalize("http://Reg.example:5000/v2/"), "reg.example:5000");
    }

    #[test]
    fn debug_redacts_the_password() {
        let c = RegistryCredentials::new("reg:5000", "alice", "s3cret-pw");
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("s3cret-pw") && shown.contains("alice"),
            "{shown}"
        );
    }

    #[test]
    fn explicit_credentials_win_and_match_by_host() {
        let dir = tempfile::tempdir().unwrap();
        let explicit = [RegistryCredentials::new("https://reg:5000", "u", "p")];
        let c = for_image("reg:5000/x", &explicit, Some(dir.path()))
            .unwrap()
            .unwrap();
        assert_eq!(
            (c.username.as_deref(), c.password.as_deref()),
            (Some("u"), Some("p"))
        );
        assert!(
            for_image("other:5000/x", &explicit, Some(dir.path()))
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn config_json_auths() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        std::fs::write(
            &path,
            r#"{"auths": {
                "https://index.docker.io/v1/": {"auth": "dTE6cDE="},
                "reg:5000": {"username": "u2", "password": "p2"},
                "tok.example": {"identitytoken": "t3"},
                "bad.example": {"auth": "%%%"},
                "marker.example": {}
            }}"#,
        )
        .unwrap();
        let hub = from_config_file(&path, "docker.io").unwrap().unwrap();
        assert_eq!(
            (hub.username.as_deref(), hub.password.as_deref()),
            (Some("u1"), Some("p1"))
        );
        assert_eq!(hub.serveraddress.as_deref(), Some(DOCKER_HUB_KEY));
        let reg = from_config_file(&path, "reg:5000").unwrap().unwrap();
        assert_eq!(reg.password.as_deref(), Some("p2"));
        let tok = from_config_file(&path, "tok.example").unwrap().unwrap();
        assert_eq!(tok.identitytoken.as_deref(), Some("t3"));
        let e = from_config_file(&path, "bad.example").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(from_config_file(&path, "marker.example").unwrap().is_none());
        assert!(
            from_config_file(&path, "nowhere.example")
                .unwrap()
                .is_none()
        );
        assert!(
            from_config_file(&dir.path().join("absent.json"), "x")
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn a_missing_helper_is_a_config_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        std::fs::write(
            &path,
            r#"{"credHelpers": {"reg:5000": "runcell-test-absent"}}"#,
        )
        .unwrap();
        let e = from_config_file(&path, "reg:5000").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(
            e.message()
                .contains("docker-credential-runcell-test-absent"),
            "{e}"
        );
    }

    #[test]
    fn an_oversized_config_is_refused_unread() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        let mut text = String::from("{\"auths\": {}, \"pad\": \"");
        text.push_str(&"x".repeat(5 << 20));
        text.push_str("\"}");
        std::fs::write(&path, text).unwrap();
        let e = from_config_file(&path, "reg:5000").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.message().contains("larger than 4 MiB"), "{e}");
    }

    #[test]
    fn helper_answers() {
        let c =
            parse_helper_output(br#"{"ServerURL":"r","Username":"u","Secret":"s"}"#, "r").unwrap();
        assert_eq!(
            (c.username.as_deref(), c.password.as_deref()),
            (Some("u"), Some("s"))
        );
        let t = parse_helper_output(
            br#"{"ServerURL":"r","Username":"<token>","Secret":"s"}"#,
            "r",
        )
        .unwrap();
        assert_eq!((t.identitytoken.as_deref(), t.username), (Some("s"), None));
        assert!(parse_helper_output(b"nope", "r").is_none());
    }
}
