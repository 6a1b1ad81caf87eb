//! Registry logins for the library's own registry requests and for engines' pulls:
//! explicit ones ([`RegistryCredentials`]), else the Docker CLI's `config.json` (`auths`,
//! `credHelpers`, `credsStore`), as `docker`, `crane` and `skopeo` read it. Secrets never
//! reach logs, `Debug` output, labels or errors.

use std::fmt;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::{Error, ErrorKind, Result, normalize_registry as normalize};

/// The key under which the Docker CLI keeps Docker Hub's credentials.
pub const DOCKER_HUB_KEY: &str = "https://index.docker.io/v1/";
/// How long a credential helper may take to answer before it is killed.
const HELPER_BOUND: Duration = Duration::from_secs(30);
/// The most of a credential helper's answer read.
const MAX_HELPER_ANSWER: u64 = 1 << 20;

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

/// A login found for a registry: a user and password, or an identity token. `Debug`
/// shows neither secret.
#[derive(Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct RegistryLogin {
    /// The user name.
    pub username: Option<String>,
    /// The password.
    pub password: Option<String>,
    /// An identity (refresh) token, in place of a user and password.
    pub identity_token: Option<String>,
}

impl fmt::Debug for RegistryLogin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegistryLogin")
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field(
                "identity_token",
                &self.identity_token.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

/// The server name a credential helper and the Docker daemon expect for `registry`.
pub fn server_address(registry: &str) -> String {
    if registry == "docker.io" {
        DOCKER_HUB_KEY.to_string()
    } else {
        registry.to_string()
    }
}

/// The login for `registry` (a host, as [`crate::registry_of`] gives it): the explicit
/// one for it, else that of `config.json` in `docker_config_dir` (default
/// `$DOCKER_CONFIG`, else `~/.docker`). `None`: anonymous. Blocking (a credential helper
/// is a process): call it off the async threads.
pub fn lookup(
    registry: &str,
    explicit: &[RegistryCredentials],
    docker_config_dir: Option<&Path>,
) -> Result<Option<RegistryLogin>> {
    // As the keys are compared: `Reg.Example`, `index.docker.io` and `docker.io` alike.
    let registry = &normalize(registry);
    if let Some(c) = explicit.iter().find(|c| normalize(&c.server) == *registry) {
        return Ok(Some(RegistryLogin {
            username: Some(c.username.clone()),
            password: Some(c.password.clone()),
            identity_token: None,
        }));
    }
    let dir = match docker_config_dir {
        Some(d) => Some(d.to_path_buf()),
        None => default_config_dir(),
    };
    match dir {
        Some(dir) => from_config_file(&dir.join("config.json"), registry),
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
        format!("registry login: {}: {what}", path.display()),
    )
    .with("path", path.display().to_string())
}

/// The login for `registry` from a Docker CLI `config.json`: its `credHelpers` entry,
/// else its `auths` entry, else its `credsStore`. A missing file is no login.
pub fn from_config_file(path: &Path, registry: &str) -> Result<Option<RegistryLogin>> {
    // A config file is small; a larger one is refused unread (bounded memory).
    const MAX_CONFIG_BYTES: u64 = 4 << 20;
    let mut text = String::new();
    let read = std::fs::File::open(path)
        .and_then(|f| f.take(MAX_CONFIG_BYTES + 1).read_to_string(&mut text));
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
        let mut login = RegistryLogin {
            username: text("username"),
            password: text("password"),
            identity_token: text("identitytoken"),
        };
        if let Some(encoded) = text("auth") {
            let (user, password) = decode_auth(encoded.trim()).ok_or_else(|| {
                config_error(
                    path,
                    format!("auths entry for {registry}: auth is not base64 of user:password"),
                )
            })?;
            login.username = Some(user);
            login.password = Some(password);
        }
        if login.username.is_some() || login.identity_token.is_some() {
            return Ok(Some(login));
        }
    }
    if let Some(store) = json.get("credsStore").and_then(|s| s.as_str()) {
        return helper_get(store, registry);
    }
    Ok(None)
}

/// `user:password` from an `auths` entry's `auth` (standard base64).
fn decode_auth(encoded: &str) -> Option<(String, String)> {
    use base64::Engine;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .ok()?;
    let text = String::from_utf8(bytes).ok()?;
    text.split_once(':')
        .map(|(u, p)| (u.to_string(), p.to_string()))
}

/// `docker-credential-<helper> get` with the server on stdin, bounded in time and in
/// what is read. A helper that has no credentials for it (non-zero exit) is no login;
/// one that cannot be run, hangs or answers nonsense is a config error naming it.
fn helper_get(helper: &str, registry: &str) -> Result<Option<RegistryLogin>> {
    helper_get_within(
        &format!("docker-credential-{helper}"),
        registry,
        HELPER_BOUND,
    )
}

/// [`helper_get`] of `program`, within `bound`: the helper runs in a process group of
/// its own, and when it (or a child of its that kept its output open) is not done in
/// time, the whole group is killed.
fn helper_get_within(
    program: &str,
    registry: &str,
    bound: Duration,
) -> Result<Option<RegistryLogin>> {
    use std::os::unix::process::CommandExt;
    let server = server_address(registry);
    let failed = |what: &str| {
        Error::new(
            ErrorKind::Config,
            format!("registry login: credential helper {program} {what}"),
        )
        .with("registry", registry)
    };
    let mut child = Command::new(program)
        .arg("get")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .map_err(|e| failed("cannot be run").with_source(e))?;
    let group = rustix::process::Pid::from_raw(child.id() as i32);
    let kill_group = |child: &mut std::process::Child| {
        // SIGKILL to the helper's whole group (children that kept its pipes), then the
        // helper itself, reaped.
        if let Some(group) = group {
            let _ = rustix::process::kill_process_group(group, rustix::process::Signal::KILL);
        }
        let _ = child.kill();
        let _ = child.wait();
    };
    // Both pipes from threads of their own: neither a helper that never reads nor one
    // that never closes its output holds this thread past the bound.
    if let Some(mut stdin) = child.stdin.take() {
        std::thread::spawn(move || {
            let _ = stdin.write_all(server.as_bytes());
        });
    }
    let (sender, answer) = std::sync::mpsc::channel();
    if let Some(stdout) = child.stdout.take() {
        std::thread::spawn(move || {
            let mut out = Vec::new();
            let _ = stdout.take(MAX_HELPER_ANSWER).read_to_end(&mut out);
            let _ = sender.send(out);
        });
    }
    let deadline = Instant::now() + bound;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            Ok(None) => {
                kill_group(&mut child);
                return Err(failed(&format!(
                    "did not answer within {} s",
                    bound.as_secs_f64()
                )));
            }
            Err(e) => {
                kill_group(&mut child);
                return Err(failed("failed").with_source(e));
            }
        }
    };
    // The helper exited; its output ends unless a child of its own holds it.
    let wait = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(100));
    let out = match answer.recv_timeout(wait) {
        Ok(out) => out,
        Err(_) => {
            kill_group(&mut child);
            return Err(failed("kept its output open after it exited"));
        }
    };
    if !status.success() {
        tracing::debug!(helper = %program, registry, "credential helper has no credentials");
        return Ok(None);
    }
    parse_helper_output(&out)
        .map(Some)
        .ok_or_else(|| failed("answered something other than its JSON"))
}

/// A helper's answer `{"ServerURL":..,"Username":..,"Secret":..}`; the user `<token>`
/// means the secret is an identity token.
fn parse_helper_output(stdout: &[u8]) -> Option<RegistryLogin> {
    let json: serde_json::Value = serde_json::from_slice(stdout).ok()?;
    let username = json.get("Username")?.as_str()?.to_string();
    let secret = json.get("Secret")?.as_str()?.to_string();
    Some(if username == "<token>" {
        RegistryLogin {
            identity_token: Some(secret),
            ..Default::default()
        }
    } else {
        RegistryLogin {
            username: Some(username),
            password: Some(secret),
            identity_token: None,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_redacts_the_secrets() {
        let c = RegistryCredentials::new("reg:5000", "alice", "s3cret-pw");
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("s3cret-pw") && shown.contains("alice"),
            "{shown}"
        );
        let login = RegistryLogin {
            username: Some("bob".into()),
            password: Some("pw-123".into()),
            identity_token: Some("tok-456".into()),
        };
        let shown = format!("{login:?}");
        assert!(
            shown.contains("bob") && !shown.contains("pw-123") && !shown.contains("tok-456"),
            "{shown}"
        );
    }

    #[test]
    fn explicit_credentials_win_and_match_by_host() {
        let dir = tempfile::tempdir().unwrap();
        let explicit = [RegistryCredentials::new("https://reg:5000", "u", "p")];
        let c = lookup("reg:5000", &explicit, Some(dir.path()))
            .unwrap()
            .unwrap();
        assert_eq!(
            (c.username.as_deref(), c.password.as_deref()),
            (Some("u"), Some("p"))
        );
        assert!(
            lookup("other:5000", &explicit, Some(dir.path()))
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
        let reg = from_config_file(&path, "reg:5000").unwrap().unwrap();
        assert_eq!(reg.password.as_deref(), Some("p2"));
        let tok = from_config_file(&path, "tok.example").unwrap().unwrap();
        assert_eq!(tok.identity_token.as_deref(), Some("t3"));
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

    /// A helper script at `dir/name` with `body`.
    fn script(dir: &Path, name: &str, body: &str) -> String {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join(name);
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path.display().to_string()
    }

    #[test]
    fn a_helper_is_bounded_in_time_with_its_children() {
        let dir = tempfile::tempdir().unwrap();
        let answer = r#"echo '{"ServerURL":"r","Username":"u","Secret":"s"}'"#;
        let good = script(dir.path(), "good", &format!("cat >/dev/null; {answer}"));
        let login = helper_get_within(&good, "reg:5000", Duration::from_secs(5))
            .unwrap()
            .unwrap();
        assert_eq!(login.password.as_deref(), Some("s"));
        // Exits at once, but a child keeps its output open.
        let holds = script(
            dir.path(),
            "holds",
            &format!("cat >/dev/null; (sleep 30) & {answer}; exit 0"),
        );
        let began = Instant::now();
        let e = helper_get_within(&holds, "reg:5000", Duration::from_secs(1)).unwrap_err();
        assert!(
            began.elapsed() < Duration::from_secs(5),
            "{:?}",
            began.elapsed()
        );
        assert!(e.message().contains("kept its output open"), "{e}");
        // Never reads, never answers.
        let hangs = script(dir.path(), "hangs", "sleep 30");
        let began = Instant::now();
        let e = helper_get_within(&hangs, "reg:5000", Duration::from_secs(1)).unwrap_err();
        assert!(
            began.elapsed() < Duration::from_secs(5),
            "{:?}",
            began.elapsed()
        );
        assert!(e.message().contains("did not answer"), "{e}");
    }

    #[test]
    fn registries_are_compared_normalized() {
        let explicit = [RegistryCredentials::new("Reg.Example:5000", "u", "p")];
        let dir = tempfile::tempdir().unwrap();
        assert!(
            lookup("reg.example:5000", &explicit, Some(dir.path()))
                .unwrap()
                .is_some()
        );
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"auths": {"https://index.docker.io/v1/": {"auth": "dTE6cDE="}}}"#,
        )
        .unwrap();
        assert!(
            lookup("index.docker.io", &[], Some(dir.path()))
                .unwrap()
                .is_some()
        );
    }

    #[test]
    fn helper_answers() {
        let c = parse_helper_output(br#"{"ServerURL":"r","Username":"u","Secret":"s"}"#).unwrap();
        assert_eq!(
            (c.username.as_deref(), c.password.as_deref()),
            (Some("u"), Some("s"))
        );
        let t =
            parse_helper_output(br#"{"ServerURL":"r","Username":"<token>","Secret":"s"}"#).unwrap();
        assert_eq!((t.identity_token.as_deref(), t.username), (Some("s"), None));
        assert!(parse_helper_output(b"nope").is_none());
    }
}
