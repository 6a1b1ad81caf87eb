//! Snapshots on Kubernetes ([`crate::K8sConfig::snapshot_registry`]). Kubernetes has no
//! commit, so the run's exec helper writes what changed in the pod's root filesystem since
//! the run started as one layer: files changed or added (by change time against the
//! listing it made at create), deletions as whiteouts, the workspace whole; `/proc`,
//! `/sys`, `/dev`, the helper's place and the pod's other mounts left out. The library takes
//! the CA files it installed back out of that layer and pushes the run's base image (as
//! the node pulled it: the container's image ID, by digest) plus the layer as a new image
//! to the snapshot registry, tagged with the snapshot's id; its configuration is the
//! base's, with the snapshot's labels. A run from it is a pod of that image by digest,
//! its workspace in its own filesystem.
//!
//! The registry is the only store: listing is its tags, removal deletes the manifest (the
//! registry must allow deletes; the blobs go at the registry's own garbage collection).
//! The manifest is pushed last, so a snapshot cut short (the registry refusing or gone
//! halfway, the caller giving up) is never listed: what it pushed are blobs no manifest
//! names.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::errors::OciDistributionError;
use oci_client::manifest::{OciDescriptor, OciImageManifest};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use runcell_core::raw::RunFiles;
use runcell_core::snapshot_labels::{SNAPSHOT_ID, SNAPSHOT_WORKSPACE};
use runcell_core::{ByteStream, Error, ErrorKind, Result, Snapshot, ca, labels};
use sha2::{Digest as _, Sha256};

use crate::{K8sConfig, K8sDriver, error};

/// The base image's reference, as the node pulled it.
const BASE_LABEL: &str = "sandbox.dev/snapshot-base";
/// The bytes the snapshot's layer holds.
const SIZE_LABEL: &str = "sandbox.dev/snapshot-size";
/// The pod annotation with the workspace's path of a run from a snapshot (it has no
/// workspace volume to read it from).
pub(crate) const WORKSPACE_ANNOTATION: &str = "sandbox.dev/workspace";
/// The most a layer may hold (sparse files count whole).
const MAX_LAYER_BYTES: u64 = 8 << 30;
/// The longest the helper's layer may send nothing (it comes from the run, whose code may
/// have replaced the helper).
const STALL: Duration = Duration::from_secs(120);
/// The most a system bundle (rewritten without the library's CA) may be.
const MAX_BUNDLE: u64 = 16 << 20;
const LAYER_TYPE: &str = "application/vnd.oci.image.layer.v1.tar";
const CONFIG_TYPE: &str = "application/vnd.oci.image.config.v1+json";
const MANIFEST_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";

/// The snapshot registry's client and where in it snapshots go.
#[derive(Clone)]
pub(crate) struct Registry {
    http: reqwest::Client,
    host: String,
    repository: String,
    plain_http: bool,
    /// The snapshot registry's explicit login, if any ([`SnapshotRegistry::login`]).
    login: Vec<runcell_core::credentials::RegistryCredentials>,
}

fn backend(what: impl Into<String>) -> Error {
    Error::new(ErrorKind::Backend, what.into())
}

/// A registry's answer as an error naming what was asked of it.
fn registry_error(what: &str, e: OciDistributionError) -> Error {
    let kind = match &e {
        OciDistributionError::UnauthorizedError { .. }
        | OciDistributionError::AuthenticationFailure(_) => ErrorKind::Config,
        OciDistributionError::ImageManifestNotFoundError(_) => ErrorKind::NotFound,
        OciDistributionError::ServerError { code: 404, .. } => ErrorKind::NotFound,
        OciDistributionError::RequestError(_) => ErrorKind::Unavailable,
        _ => ErrorKind::Backend,
    };
    let hint = if kind == ErrorKind::Config {
        " (not authorized: give the registry's login, SnapshotRegistry::login, or `docker login` it into the Docker CLI's config.json)"
    } else {
        ""
    };
    Error::new(kind, format!("snapshot registry: {what}{hint}")).with_source(e)
}

fn not_found(e: &OciDistributionError) -> bool {
    match e {
        OciDistributionError::ImageManifestNotFoundError(_) => true,
        OciDistributionError::ServerError { code, .. } => *code == 404,
        OciDistributionError::RegistryError { envelope, .. } => envelope.errors.iter().any(|e| {
            matches!(
                e.code,
                oci_client::errors::OciErrorCode::ManifestUnknown
                    | oci_client::errors::OciErrorCode::NameUnknown
                    | oci_client::errors::OciErrorCode::NotFound
            )
        }),
        _ => false,
    }
}

/// A registry client speaking plain HTTP to the hosts of `plain`, HTTPS to others.
fn oci_client(plain: Vec<String>) -> Result<Client> {
    let protocol = if plain.is_empty() {
        ClientProtocol::Https
    } else {
        ClientProtocol::HttpsExcept(plain)
    };
    Client::try_from(ClientConfig {
        protocol,
        connect_timeout: Some(Duration::from_secs(10)),
        read_timeout: Some(Duration::from_secs(60)),
        // One streamed PUT per blob (its size is known): chunked pushes send the stream's
        // own small chunks as requests of their own, thousands for a layer.
        use_monolithic_push: true,
        ..ClientConfig::default()
    })
    .map_err(|e| {
        Error::new(
            ErrorKind::Config,
            "k8s: snapshot_registry: no client for it",
        )
        .with_field("snapshot_registry")
        .with_source(e)
    })
}

/// A registry on this machine's loopback (`localhost`, `127.x.y.z`, `[::1]`, with or
/// without a port), which Docker and containerd speak plain HTTP to as well.
fn loopback(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => host.split(':').next().unwrap_or(""),
    };
    name == "localhost"
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

fn sha256(data: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(data))
}

impl Registry {
    /// The configured registry's client; `None` without one.
    pub(crate) fn of(config: &K8sConfig) -> Result<Option<Registry>> {
        let Some(cfg) = &config.snapshot_registry else {
            return Ok(None);
        };
        let (host, repository) = cfg.split()?;
        // The registry clients are reqwest's on rustls, as kube's are: with ring, unless the
        // application installed a provider of its own (then that one; this is no error).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_secs(60))
            .build()
            .map_err(|e| {
                Error::new(
                    ErrorKind::Config,
                    "k8s: snapshot_registry: no client for it",
                )
                .with_field("snapshot_registry")
                .with_source(e)
            })?;
        Ok(Some(Registry {
            http,
            host: host.to_string(),
            repository: repository.to_string(),
            plain_http: cfg.plain_http,
            login: cfg.login.iter().cloned().collect(),
        }))
    }

    /// A client of its own for one operation, speaking plain HTTP to the snapshot
    /// registry when configured so, and to the hosts of `plain`: a client keeps the first
    /// login it is given per host, and a login may change (a `docker login` meanwhile, a
    /// credential helper's short-lived token).
    fn client(&self, mut plain: Vec<String>) -> Result<Client> {
        if self.plain_http {
            plain.push(self.host.clone());
        }
        oci_client(plain)
    }

    /// How to log in to registry `host`: the explicit login for it, else `config.json`'s,
    /// else anonymously. A login to the snapshot registry over plain HTTP is refused
    /// unless the registry is on loopback (the password would cross the network in the
    /// clear). An identity token (which this client cannot use) is an error for the
    /// snapshot registry, and anonymous access to another (a base's).
    async fn auth_for(&self, host: &str) -> Result<RegistryAuth> {
        let (owned, explicit) = (host.to_string(), self.login.clone());
        let found = tokio::task::spawn_blocking(move || {
            runcell_core::credentials::lookup(&owned, &explicit, None)
                .map_err(|e| e.with("registry", &owned))
        })
        .await
        .map_err(|e| backend(format!("snapshot registry: the login lookup failed: {e}")))??;
        let ours = host == self.host;
        let auth = match found {
            None => RegistryAuth::Anonymous,
            Some(login) => match (login.username, login.password) {
                (Some(user), Some(password)) => RegistryAuth::Basic(user, password),
                _ if ours => {
                    return Err(Error::new(
                        ErrorKind::Config,
                        "snapshot registry: the login found is an identity token, which the snapshot registry client cannot use: give a user and password (SnapshotRegistry::login)",
                    )
                    .with_field("snapshot_registry"));
                }
                _ => {
                    tracing::debug!(
                        registry = host,
                        "an identity token cannot be used: reading the base anonymously"
                    );
                    RegistryAuth::Anonymous
                }
            },
        };
        let plain = if ours {
            self.plain_http
        } else {
            loopback(host)
        };
        if plain && !loopback(host) && !matches!(auth, RegistryAuth::Anonymous) {
            return Err(Error::new(
                ErrorKind::Config,
                format!("snapshot registry: a login to {host} over plain HTTP would send the password in the clear: use HTTPS, or a registry on loopback"),
            )
            .with_field("snapshot_registry"));
        }
        Ok(auth)
    }

    fn tagged(&self, tag: &str) -> Reference {
        Reference::with_tag(self.host.clone(), self.repository.clone(), tag.to_string())
    }

    /// The reference a run from snapshot image `digest` starts from.
    fn image_of(&self, digest: &str) -> String {
        format!("{}/{}@{digest}", self.host, self.repository)
    }

    /// The manifest digest of snapshot `id`'s image and its labels; `None` if it has none.
    async fn find(&self, id: &str) -> Result<Option<(String, BTreeMap<String, String>)>> {
        let auth = self.auth_for(&self.host).await?;
        self.find_with(id, &auth).await
    }

    /// [`Registry::find`] with the login given.
    async fn find_with(
        &self,
        id: &str,
        auth: &RegistryAuth,
    ) -> Result<Option<(String, BTreeMap<String, String>)>> {
        let reference = self.tagged(id);
        match self
            .client(Vec::new())?
            .pull_manifest_and_config(&reference, auth)
            .await
        {
            Ok((_, digest, config)) => Ok(Some((digest, config_labels(&config)))),
            Err(e) if not_found(&e) => Ok(None),
            Err(e) => Err(registry_error(&format!("reading {id}"), e)),
        }
    }

    /// Every snapshot in the repository.
    async fn list(&self) -> Result<Vec<Snapshot>> {
        let auth = self.auth_for(&self.host).await?;
        let tags = match self
            .client(Vec::new())?
            .list_tags(&self.tagged("latest"), &auth, None, None)
            .await
        {
            Ok(t) => t.tags,
            Err(e) if not_found(&e) => Vec::new(),
            Err(e) => return Err(registry_error("listing snapshots", e)),
        };
        let mut out = Vec::new();
        for tag in tags {
            if runcell_core::check_snapshot_id(&tag).is_err() {
                continue;
            }
            // Removed meanwhile: not listed.
            let Some((digest, labels)) = self.find_with(&tag, &auth).await? else {
                continue;
            };
            if labels.get(SNAPSHOT_ID) != Some(&tag) {
                continue;
            }
            let base = labels.get(BASE_LABEL).cloned().unwrap_or_default();
            let size = labels
                .get(SIZE_LABEL)
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            if let Some(s) = Snapshot::from_labels(&labels, self.image_of(&digest), base, size) {
                out.push(s);
            }
        }
        Ok(out)
    }

    /// Deletes the manifest `digest` (and with it the tag).
    async fn delete(&self, id: &str, digest: &str) -> Result<()> {
        let scheme = if self.plain_http { "http" } else { "https" };
        let url = format!(
            "{scheme}://{}/v2/{}/manifests/{digest}",
            self.host, self.repository
        );
        let auth = self.auth_for(&self.host).await?;
        let sent = |request: reqwest::RequestBuilder| async move {
            request.send().await.map_err(|e| {
                Error::new(
                    ErrorKind::Unavailable,
                    "snapshot registry: deleting a snapshot",
                )
                .with("snapshot", id)
                .with_source(e)
            })
        };
        // First as the registry says it wants: then with the login, or a token for
        // `delete` from its token service.
        let mut answer = sent(self.http.delete(&url)).await?;
        if answer.status().as_u16() == 401
            && let RegistryAuth::Basic(user, password) = &auth
        {
            let challenge = answer
                .headers()
                .get(reqwest::header::WWW_AUTHENTICATE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string();
            let request = self.http.delete(&url);
            answer = match bearer_challenge(&challenge) {
                None => sent(request.basic_auth(user, Some(password))).await?,
                Some((realm, service)) => {
                    let token = self
                        .delete_token(&realm, service.as_deref(), user, password)
                        .await?;
                    sent(request.bearer_auth(token)).await?
                }
            };
        }
        match answer.status().as_u16() {
            200..=299 | 404 => Ok(()),
            405 => Err(Error::unsupported(
                "snapshot",
                format!(
                    "the snapshot registry {} does not allow deletes (a distribution registry: storage.delete.enabled)",
                    self.host
                ),
            )),
            code @ (401 | 403) => Err(Error::new(
                ErrorKind::Config,
                format!(
                    "snapshot registry: deleting {id} answered {code}: {}",
                    if matches!(auth, RegistryAuth::Anonymous) {
                        "it wants a login (SnapshotRegistry::login, or `docker login`)"
                    } else {
                        "the login may not delete"
                    }
                ),
            )
            .with_field("snapshot_registry")),
            code => Err(backend(format!(
                "snapshot registry: deleting {id} answered {code}"
            ))),
        }
    }

    /// A token for deleting from the repository, from the registry's token service at
    /// `realm` (its `service`), asked with the login. The realm must be HTTPS, or the
    /// registry's own host or loopback (the login goes to it).
    async fn delete_token(
        &self,
        realm: &str,
        service: Option<&str>,
        user: &str,
        password: &str,
    ) -> Result<String> {
        let refused = |why: String| {
            Error::new(
                ErrorKind::Config,
                format!("snapshot registry: its token service {why}"),
            )
            .with_field("snapshot_registry")
        };
        let url = reqwest::Url::parse(realm).map_err(|_| refused("names no URL".into()))?;
        let realm_host = url.host_str().unwrap_or_default().to_string();
        let realm_authority = match url.port() {
            Some(port) => format!("{realm_host}:{port}"),
            None => realm_host.clone(),
        };
        let trusted =
            url.scheme() == "https" || realm_authority == self.host || loopback(&realm_authority);
        if !trusted {
            return Err(refused(format!(
                "is at {realm_authority} over plain HTTP: the login is not sent there"
            )));
        }
        let scope = format!("repository:{}:delete", self.repository);
        let mut query = vec![("scope", scope.as_str())];
        if let Some(service) = service {
            query.push(("service", service));
        }
        let answer = self
            .http
            .get(url)
            .query(&query)
            .basic_auth(user, Some(password))
            .send()
            .await
            .map_err(|e| {
                Error::new(
                    ErrorKind::Unavailable,
                    "snapshot registry: its token service",
                )
                .with_source(e)
            })?;
        if !answer.status().is_success() {
            return Err(refused(format!(
                "answered {} for a delete token",
                answer.status().as_u16()
            )));
        }
        let body = answer
            .bytes()
            .await
            .map_err(|e| refused("sent no answer".into()).with_source(e))?;
        if body.len() > 1 << 20 {
            return Err(refused("sent more than 1 MiB".into()));
        }
        let json: serde_json::Value =
            serde_json::from_slice(&body).map_err(|_| refused("sent no JSON".into()))?;
        json.get("token")
            .or_else(|| json.get("access_token"))
            .and_then(|t| t.as_str())
            .map(String::from)
            .ok_or_else(|| refused("sent no token".into()))
    }

    /// Pushes `base` + the layer (`file`, `digest`, `size`) with `labels` in the base's
    /// configuration, tagged `id`; the new image's manifest digest.
    async fn push(
        &self,
        id: &str,
        base: &Reference,
        layer: (std::fs::File, String, u64),
        labels: &BTreeMap<String, String>,
    ) -> Result<String> {
        let target = self.tagged(id);
        let auth = self.auth_for(&self.host).await?;
        // A base on a loopback registry is read over plain HTTP, as the node pulled it.
        let base_host = base.resolve_registry().to_string();
        let base_host_is_target = base_host == self.host;
        let base_auth = if base_host_is_target {
            auth.clone()
        } else {
            self.auth_for(&base_host).await?
        };
        let client = if loopback(&base_host) {
            self.client(vec![base_host])?
        } else {
            self.client(Vec::new())?
        };
        let (manifest, _, config) = client
            .pull_manifest_and_config(base, &base_auth)
            .await
            .map_err(|e| {
                let field = if base_host_is_target {
                    "snapshot_registry"
                } else {
                    "image"
                };
                registry_error(&format!("reading the base image {base}"), e).with_field(field)
            })?;
        client
            .store_auth_if_needed(target.resolve_registry(), &auth)
            .await;
        let same_registry = base.resolve_registry() == target.resolve_registry();
        for l in &manifest.layers {
            let there = |e| registry_error("checking a layer", e);
            if client
                .blob_exists(&target, &l.digest)
                .await
                .map_err(there)?
            {
                continue;
            }
            if same_registry
                && client.mount_blob(&target, base, &l.digest).await.is_ok()
                && client
                    .blob_exists(&target, &l.digest)
                    .await
                    .map_err(there)?
            {
                continue;
            }
            let size =
                u64::try_from(l.size).map_err(|_| backend("a base layer's size is negative"))?;
            let read = client
                .pull_blob_stream(base, l)
                .await
                .map_err(|e| registry_error("reading a base layer", e))?;
            let stream = read.stream.map_err(OciDistributionError::from);
            client
                .push_blob_stream(&target, stream, &l.digest, Some(size))
                .await
                .map_err(|e| registry_error("pushing a base layer", e))?;
        }
        let (file, digest, size) = layer;
        if !client
            .blob_exists(&target, &digest)
            .await
            .map_err(|e| registry_error("checking the layer", e))?
        {
            let body = tokio_util::io::ReaderStream::new(tokio::fs::File::from_std(file))
                .map_err(OciDistributionError::from);
            client
                .push_blob_stream(&target, body, &digest, Some(size))
                .await
                .map_err(|e| registry_error("pushing the layer", e))?;
        }
        let config = new_config(&config, &digest, labels)?;
        let config_digest = sha256(&config);
        let config_len = config.len() as i64;
        client
            .push_blob(&target, config, &config_digest)
            .await
            .map_err(|e| registry_error("pushing the configuration", e))?;
        let mut layers = manifest.layers.clone();
        layers.push(OciDescriptor {
            media_type: LAYER_TYPE.into(),
            digest,
            size: size as i64,
            ..OciDescriptor::default()
        });
        let manifest = OciImageManifest {
            schema_version: 2,
            media_type: Some(MANIFEST_TYPE.into()),
            config: OciDescriptor {
                media_type: CONFIG_TYPE.into(),
                digest: config_digest,
                size: config_len,
                ..OciDescriptor::default()
            },
            layers,
            ..OciImageManifest::default()
        };
        let body = serde_json::to_vec(&manifest)
            .map_err(|e| backend(format!("snapshot: the manifest: {e}")))?;
        let manifest_digest = sha256(&body);
        client
            .push_manifest_raw(&target, body, http::HeaderValue::from_static(MANIFEST_TYPE))
            .await
            .map_err(|e| registry_error("pushing the manifest", e))?;
        Ok(manifest_digest)
    }
}

/// A `WWW-Authenticate: Bearer realm="..",service=".."` challenge's realm and service;
/// `None` for another scheme.
fn bearer_challenge(header: &str) -> Option<(String, Option<String>)> {
    let rest = header.trim();
    let params = rest
        .get(..7)
        .filter(|p| p.eq_ignore_ascii_case("bearer "))
        .map(|_| &rest[7..])?;
    let mut realm = None;
    let mut service = None;
    let mut left = params;
    while !left.is_empty() {
        let (key, after) = left.split_once('=')?;
        let key = key
            .trim()
            .trim_start_matches(',')
            .trim()
            .to_ascii_lowercase();
        let after = after.trim_start();
        let (value, next) = if let Some(quoted) = after.strip_prefix('"') {
            let end = quoted.find('"')?;
            (&quoted[..end], &quoted[end + 1..])
        } else {
            match after.find(',') {
                Some(end) => (&after[..end], &after[end..]),
                None => (after, ""),
            }
        };
        match key.as_str() {
            "realm" => realm = Some(value.to_string()),
            "service" => service = Some(value.to_string()),
            _ => {}
        }
        left = next.trim_start().trim_start_matches(',').trim_start();
    }
    Some((realm?, service))
}

/// The labels of an image configuration (`config.Labels`).
fn config_labels(config: &str) -> BTreeMap<String, String> {
    serde_json::from_str::<serde_json::Value>(config)
        .ok()
        .and_then(|v| v.get("config")?.get("Labels")?.as_object().cloned())
        .map(|m| {
            m.into_iter()
                .filter_map(|(k, v)| Some((k, v.as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

/// The base's configuration with the layer (uncompressed: its digest is its diff ID), a
/// history entry, a creation time and `labels` instead of the base's own `sandbox.dev/`
/// ones (a snapshot of a run from a snapshot must not look like its base).
fn new_config(base: &str, layer: &str, labels: &BTreeMap<String, String>) -> Result<Vec<u8>> {
    let bad = |why: &str| backend(format!("snapshot: the base image's configuration {why}"));
    let mut config: serde_json::Value =
        serde_json::from_str(base).map_err(|_| bad("is not JSON"))?;
    let root = config
        .as_object_mut()
        .ok_or_else(|| bad("is not an object"))?;
    let created = humantime_now();
    root.insert("created".into(), created.clone().into());
    let rootfs = root
        .entry("rootfs")
        .or_insert_with(|| serde_json::json!({"type": "layers", "diff_ids": []}));
    rootfs
        .get_mut("diff_ids")
        .and_then(|d| d.as_array_mut())
        .ok_or_else(|| bad("has no rootfs.diff_ids"))?
        .push(layer.into());
    if let Some(history) = root
        .entry("history")
        .or_insert_with(|| serde_json::json!([]))
        .as_array_mut()
    {
        history.push(serde_json::json!({"created": created, "created_by": "runcell snapshot"}));
    }
    let inner = root
        .entry("config")
        .or_insert_with(|| serde_json::json!({}))
        .as_object_mut()
        .ok_or_else(|| bad("has a config that is not an object"))?;
    let mut merged: serde_json::Map<String, serde_json::Value> = inner
        .get("Labels")
        .and_then(|l| l.as_object())
        .map(|l| {
            l.iter()
                .filter(|(k, _)| !k.starts_with("sandbox.dev/"))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
        .unwrap_or_default();
    for (k, v) in labels {
        merged.insert(k.clone(), v.clone().into());
    }
    inner.insert("Labels".into(), merged.into());
    serde_json::to_vec(&config).map_err(|e| backend(format!("snapshot: the configuration: {e}")))
}

/// Now as RFC 3339 (UTC, seconds).
fn humantime_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let days = secs / 86_400;
    let rem = secs % 86_400;
    // Civil from days (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Copies the helper's layer (a tar named from the root) into a temporary file without
/// what the library installed for the run's CA: the CA files (`/etc/sandbox`) and the
/// `update-ca-certificates` source go, and where that source was there (`injected`: its
/// text) each system bundle in the layer loses the last copy of each injected
/// certificate. Refuses a name that is absolute or climbs (`..`). Returns the file,
/// rewound, its digest and size.
fn write_layer(from: impl Read, injected: Option<&str>) -> Result<(std::fs::File, String, u64)> {
    // An error of the helper's layer (a name it cannot carry, a file it cannot read) is
    // passed on as it came.
    let io = |what: &'static str| move |e: std::io::Error| passed_on(e, what);
    let file = tempfile::tempfile().map_err(io("a temporary file"))?;
    let out = runcell_core::files::Sha256Writer::new(std::io::BufWriter::new(
        file.try_clone().map_err(io("a temporary file"))?,
    ));
    let mut builder = tar::Builder::new(out);
    builder.follow_symlinks(false);
    let dropped = [ca::CA_FILE, ca::BUNDLE_FILE, ca::SYSTEM_EXTRA_DIR_FILE];
    let mut archive = tar::Archive::new(from);
    for entry in archive.entries().map_err(io("reading the layer"))? {
        let mut entry = entry.map_err(io("reading the layer"))?;
        let path = entry.path().map_err(io("reading the layer"))?.into_owned();
        let shown = path.display().to_string();
        if path.is_absolute()
            || path
                .components()
                .any(|c| matches!(c, std::path::Component::ParentDir))
        {
            return Err(backend(format!(
                "snapshot: the helper's layer names {shown:?} (absolute or climbing)"
            )));
        }
        let full = format!("/{}", shown.trim_end_matches('/'));
        if dropped.contains(&full.as_str()) {
            continue;
        }
        let mut header = entry.header().clone();
        let kind = header.entry_type();
        if let Some(injected) = injected
            && ca::SYSTEM_BUNDLES.contains(&full.as_str())
            && kind.is_file()
            && entry.size() <= MAX_BUNDLE
        {
            let mut text = String::new();
            entry
                .read_to_string(&mut text)
                .map_err(io("reading a system bundle"))?;
            let pristine = ca::without_last_copies(&text, injected);
            header.set_size(pristine.len() as u64);
            builder
                .append_data(&mut header, &path, pristine.as_bytes())
                .map_err(io("writing the layer"))?;
            continue;
        }
        if kind.is_symlink() || kind.is_hard_link() {
            let target = entry
                .link_name()
                .map_err(io("reading the layer"))?
                .ok_or_else(|| backend(format!("snapshot: the link {shown:?} has no target")))?
                .into_owned();
            builder
                .append_link(&mut header, &path, &target)
                .map_err(io("writing the layer"))?;
        } else {
            builder
                .append_data(&mut header, &path, &mut entry)
                .map_err(io("writing the layer"))?;
        }
    }
    let mut out = builder.into_inner().map_err(io("writing the layer"))?;
    out.flush().map_err(io("writing the layer"))?;
    let (_, digest, len) = out.finish();
    let mut file = file;
    std::io::Seek::rewind(&mut file).map_err(io("a temporary file"))?;
    Ok((file, digest, len))
}

/// An I/O error met while the layer was copied: the helper's own error where it is in
/// the chain (the tar reader wraps it), with its kind and field; else a backend error.
fn passed_on(e: std::io::Error, what: &str) -> Error {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(c) = cause {
        // An io::Error's source is its payload's source: its payload is looked at here.
        let payload = c
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .map(|p| p as &(dyn std::error::Error + 'static));
        if let Some(inner) = payload
            .and_then(|p| p.downcast_ref::<Error>())
            .or_else(|| c.downcast_ref::<Error>())
        {
            let same = Error::new(inner.kind(), inner.message().to_string());
            return match inner.field() {
                Some(field) => same.with_field(field.to_string()),
                None => same,
            };
        }
        // An io::Error's own source skips its payload: go through the payload.
        cause = payload.map_or_else(|| c.source(), |p| p.source());
    }
    backend(format!("snapshot: {what}: {e}"))
}

/// `stream`, failing once it holds more than `cap` bytes or sends nothing for [`STALL`].
fn bounded(
    stream: ByteStream,
    cap: u64,
) -> impl futures::Stream<Item = std::io::Result<bytes::Bytes>> {
    futures::stream::unfold(
        (stream, 0u64, false),
        move |(mut stream, total, done)| async move {
            if done {
                return None;
            }
            let next = match tokio::time::timeout(STALL, stream.next()).await {
                Err(_) => Some(Err(std::io::Error::other(format!(
                    "the run's helper sent nothing for {} s",
                    STALL.as_secs()
                )))),
                Ok(next) => next,
            };
            match next {
                None => None,
                Some(Err(e)) => Some((Err(e), (stream, total, true))),
                Some(Ok(chunk)) => {
                    let total = total + chunk.len() as u64;
                    if total > cap {
                        let e = std::io::Error::other(format!(
                            "the run's changes hold more than {} GiB: too big for a snapshot",
                            cap >> 30
                        ));
                        Some((Err(e), (stream, total, true)))
                    } else {
                        Some((Ok(chunk), (stream, total, false)))
                    }
                }
            }
        },
    )
}

/// The base image of a pod's container, as the node pulled it (`host/repo@sha256:...`).
fn base_of(pod: &Pod) -> Result<Reference> {
    let image_id = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.iter().find(|c| c.name == crate::CONTAINER))
        .map(|c| c.image_id.clone())
        .unwrap_or_default();
    let from_registry = image_id.contains('/') && image_id.contains("@sha256:");
    let parsed = from_registry
        .then(|| image_id.parse::<Reference>().ok())
        .flatten();
    parsed.ok_or_else(|| {
        Error::unsupported(
            "snapshot",
            format!(
                "the run's image did not come from a registry (the node has it as {:?}): a snapshot on Kubernetes is its base image plus a layer, pushed to the snapshot registry",
                image_id.chars().take(200).collect::<String>()
            ),
        )
    })
}

impl K8sDriver {
    fn registry(&self) -> Result<&Registry> {
        self.registry.as_ref().ok_or_else(|| {
            Error::unsupported(
                "snapshot",
                "snapshots on Kubernetes need a snapshot registry (K8sConfig::snapshot_registry, RUNCELL_K8S_SNAPSHOT_REGISTRY)",
            )
        })
    }

    /// A small file of the run as its helper reads it: `None` if absent or unreadable.
    async fn run_file(run: &dyn RunFiles, path: &str) -> Option<String> {
        let tar = run.helper_archive(path).await.ok()??;
        let file = runcell_core::files::file_from_tar_stream(tar, path)
            .await
            .ok()?;
        String::from_utf8(file.read_all(1 << 20, path).await.ok()?).ok()
    }

    pub(crate) async fn snapshot_pod(
        &self,
        id: &str,
        labels: &BTreeMap<String, String>,
        run: &dyn RunFiles,
    ) -> Result<Snapshot> {
        self.registry()?;
        let began = std::time::Instant::now();
        let pod = self.managed_pod(id).await?;
        let base = base_of(&pod)?;
        let workspace = self.run_state(id).await?.workspace.clone();
        let snapshot_id = labels
            .get(SNAPSHOT_ID)
            .cloned()
            .ok_or_else(|| backend("snapshot labels without an id"))?;
        // What the library appended to a system bundle, by its evidence (read before the
        // layer: the bundles come first in it).
        let injected = Self::run_file(run, ca::SYSTEM_EXTRA_DIR_FILE).await;
        let layer = run.helper_layer(&workspace).await?.ok_or_else(|| {
            Error::unsupported(
                "snapshot",
                "snapshots on Kubernetes need the exec helper (the run is on the plain exec path)",
            )
        })?;
        // In a task of its own: a caller that gives up (a dropped future) cannot leave a
        // snapshot pushed for nobody; one made after it gave up is removed.
        let (this, run_id, mut all) = (self.clone(), id.to_string(), labels.clone());
        all.insert(SNAPSHOT_WORKSPACE.into(), workspace);
        let (answer, wait) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let made = async {
                let stream = Box::pin(bounded(
                    runcell_core::files::checked_tar_stream(layer),
                    MAX_LAYER_BYTES,
                ));
                let reader =
                    tokio_util::io::SyncIoBridge::new(tokio_util::io::StreamReader::new(stream));
                let (file, digest, size) = tokio::task::spawn_blocking(move || {
                    write_layer(reader, injected.as_deref())
                })
                .await
                .map_err(|e| backend(format!("snapshot: writing the layer: {e}")))??;
                tracing::debug!(run = %run_id, ms = began.elapsed().as_millis() as u64, bytes = size, "snapshot: layer written");
                all.insert(BASE_LABEL.into(), base.whole());
                all.insert(SIZE_LABEL.into(), size.to_string());
                let registry = this.registry()?;
                let digest = registry
                    .push(&snapshot_id, &base, (file, digest, size), &all)
                    .await
                    .map_err(|e| e.with("run", &run_id))?;
                tracing::debug!(run = %run_id, ms = began.elapsed().as_millis() as u64, "snapshot: pushed");
                Snapshot::from_labels(&all, registry.image_of(&digest), base.whole(), size)
                    .ok_or_else(|| backend("snapshot labels incomplete"))
            }
            .await;
            if let Err(Ok(snapshot)) = answer.send(made)
                && let Err(e) = this.remove_registry_snapshot(&snapshot.id).await
            {
                tracing::warn!(snapshot = %snapshot.id, "removing a snapshot nobody waits for: {e}");
            }
        });
        wait.await
            .map_err(|_| backend("the snapshot ended without an answer"))?
    }

    pub(crate) async fn list_registry_snapshots(&self) -> Result<Vec<Snapshot>> {
        match &self.registry {
            Some(r) => r.list().await,
            None => Ok(Vec::new()),
        }
    }

    pub(crate) async fn remove_registry_snapshot(&self, id: &str) -> Result<()> {
        let registry = self.registry()?;
        let Some((digest, _)) = registry.find(id).await? else {
            return Ok(());
        };
        let image = registry.image_of(&digest);
        let selector = format!("{}={}", labels::MANAGED_BY, labels::MANAGED_BY_VALUE);
        let pods = self
            .pods()
            .list(&kube::api::ListParams::default().labels(&selector))
            .await
            .map_err(|e| error::map("list pods", e))?;
        let users: Vec<String> = pods
            .items
            .into_iter()
            .filter(|p| {
                p.spec
                    .iter()
                    .flat_map(|s| s.containers.iter())
                    .any(|c| c.image.as_deref() == Some(image.as_str()))
            })
            .filter_map(|p| p.metadata.name)
            .collect();
        if !users.is_empty() {
            return Err(Error::invalid_spec(
                "snapshot",
                format!("{id} is in use by runs {users:?}: stop them first"),
            ));
        }
        registry.delete(id, &digest).await
    }

    /// What a run from a snapshot cannot have here, before anything is created.
    pub(crate) fn check_from_snapshot(&self, spec: &runcell_core::RunSpec) -> Result<()> {
        if spec.security.read_only_rootfs {
            return Err(Error::unsupported(
                "security.read_only_rootfs",
                "a run from a snapshot on Kubernetes keeps its workspace in its own filesystem, which a read-only root would make read-only",
            ));
        }
        if self.config.workspace_volume != crate::WorkspaceVolume::EmptyDir {
            return Err(Error::unsupported(
                "workspace_volume",
                "a run from a snapshot on Kubernetes has the snapshot's workspace in its own filesystem, not on a claim",
            ));
        }
        Ok(())
    }

    /// Checks that a run's `image` is snapshot `id`'s, before anything is created.
    pub(crate) async fn check_snapshot_image(&self, id: &str, image: &str) -> Result<()> {
        let registry = self.registry()?;
        let gone = || {
            Error::new(
                ErrorKind::NotFound,
                format!("snapshot {id} does not exist (or not with image {image})"),
            )
            .with_field("from_snapshot")
        };
        let (digest, labels) = registry.find(id).await?.ok_or_else(gone)?;
        if registry.image_of(&digest) != image
            || labels.get(SNAPSHOT_ID).map(String::as_str) != Some(id)
        {
            return Err(gone());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tar_of(entries: &[(&str, &[u8])]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, data) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_entry_type(tar::EntryType::Regular);
            b.append_data(&mut h, path, *data).unwrap();
        }
        b.into_inner().unwrap()
    }

    fn names_and_data(file: std::fs::File) -> Vec<(String, String)> {
        let mut a = tar::Archive::new(file);
        a.entries()
            .unwrap()
            .map(|e| {
                let mut e = e.unwrap();
                let p = e.path().unwrap().display().to_string();
                let mut s = String::new();
                e.read_to_string(&mut s).unwrap();
                (p, s)
            })
            .collect()
    }

    #[test]
    fn the_layer_loses_the_librarys_ca_and_keeps_the_rest() {
        let cert = "-----BEGIN CERTIFICATE-----\nQUJD\n-----END CERTIFICATE-----\n";
        let bundle = format!("{cert}{cert}");
        let etc_sandbox = ca::CA_FILE.trim_start_matches('/').to_string();
        let extra = ca::SYSTEM_EXTRA_DIR_FILE.trim_start_matches('/');
        let sys = ca::SYSTEM_BUNDLES[0].trim_start_matches('/');
        let raw = tar_of(&[
            ("usr/local/x", b"x"),
            (&etc_sandbox, b"ca"),
            (extra, cert.as_bytes()),
            (sys, bundle.as_bytes()),
            ("tmp/.wh.gone", b""),
        ]);
        let (file, digest, size) = write_layer(&raw[..], Some(cert)).unwrap();
        let got = names_and_data(file);
        assert_eq!(
            got,
            vec![
                ("usr/local/x".to_string(), "x".to_string()),
                (sys.to_string(), cert.to_string()),
                ("tmp/.wh.gone".to_string(), String::new()),
            ]
        );
        assert!(digest.starts_with("sha256:") && size > 0);
        // Without the evidence the bundle is the run's own.
        let (file, _, _) = write_layer(&raw[..], None).unwrap();
        assert!(names_and_data(file).contains(&(sys.to_string(), bundle.clone())));
        // A name that climbs is refused.
        let mut h = tar::Header::new_gnu();
        h.set_size(0);
        h.set_entry_type(tar::EntryType::Regular);
        h.as_gnu_mut().unwrap().name[..9].copy_from_slice(b"../escape");
        h.set_cksum();
        let mut evil = h.as_bytes().to_vec();
        evil.extend_from_slice(&[0u8; 1024]);
        assert!(write_layer(&evil[..], None).is_err());
    }

    #[test]
    fn bearer_challenges_are_read() {
        assert_eq!(
            bearer_challenge(
                r#"Bearer realm="https://auth.example/token",service="registry.example",scope="repository:a:pull""#
            ),
            Some((
                "https://auth.example/token".into(),
                Some("registry.example".into())
            ))
        );
        assert_eq!(
            bearer_challenge(r#"bearer realm="https://a/t""#),
            Some(("https://a/t".into(), None))
        );
        assert_eq!(bearer_challenge(r#"Basic realm="registry""#), None);
        assert_eq!(bearer_challenge("Bearer service=\"x\""), None);
        assert_eq!(bearer_challenge("Bearer realm=\"unterminated"), None);
    }

    #[test]
    fn loopback_registries_are_known() {
        for host in [
            "localhost",
            "localhost:5000",
            "127.0.0.1:5000",
            "127.9.9.9",
            "[::1]:5000",
        ] {
            assert!(loopback(host), "{host}");
        }
        for host in [
            "registry.example:5000",
            "10.0.0.1:5000",
            "[fe80::1]:5000",
            "localhost.example",
        ] {
            assert!(!loopback(host), "{host}");
        }
    }

    #[test]
    fn the_configuration_gets_the_layer_and_only_our_labels() {
        let base = r#"{"architecture":"amd64","os":"linux","config":{"Env":["PATH=/bin"],"Labels":{"a":"b","sandbox.dev/snapshot-id":"snap-old"}},"rootfs":{"type":"layers","diff_ids":["sha256:1"]}}"#;
        let labels = BTreeMap::from([(
            "sandbox.dev/snapshot-id".to_string(),
            "snap-new".to_string(),
        )]);
        let out: serde_json::Value =
            serde_json::from_slice(&new_config(base, "sha256:2", &labels).unwrap()).unwrap();
        assert_eq!(
            out["rootfs"]["diff_ids"],
            serde_json::json!(["sha256:1", "sha256:2"])
        );
        assert_eq!(
            out["config"]["Labels"],
            serde_json::json!({"a": "b", "sandbox.dev/snapshot-id": "snap-new"})
        );
        assert_eq!(out["config"]["Env"], serde_json::json!(["PATH=/bin"]));
        assert_eq!(
            config_labels(&serde_json::to_string(&out).unwrap())["a"],
            "b"
        );
        assert!(new_config("[]", "sha256:2", &labels).is_err());
        let now = humantime_now();
        assert_eq!((now.len(), &now[4..5], &now[19..]), (20, "-", "Z"));
    }
}
