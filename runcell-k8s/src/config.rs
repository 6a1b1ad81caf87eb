//! The driver's settings and the ways to build it: [`K8sDriver::connect`] (the inferred
//! kubeconfig), [`K8sDriver::from_client`] and the registry's [`K8sDriver::from_config`].

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Toleration;
use kube::Client;
use runcell_core::{Driver, DriverConfig, Error, ErrorKind, Result};

use crate::{K8sDriver, PodTemplate};

/// Driver settings beyond the cluster connection. Built with [`K8sConfig::default`] and
/// its setters (it will grow).
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct K8sConfig {
    /// Namespace of the runs; default: the kubeconfig's (or `default`).
    pub namespace: Option<String>,
    /// Pod-level settings: runtime class, node selector, tolerations, extra labels/annotations.
    pub template: PodTemplate,
    /// How long a pod may take to run. Default 120 s.
    pub ready_timeout: Option<Duration>,
    /// Copy the workspace back into the host directory when a run stops.
    pub sync_workspace_on_stop: bool,
    /// Wait (up to the ready timeout) for a pod that no node has room for (pod slots,
    /// memory, CPU), as a cluster with an autoscaler that adds nodes wants. Default: the
    /// create fails at once with [`runcell_core::ErrorKind::LimitReached`] naming the
    /// limit (context `limit`), leaving nothing.
    pub wait_unschedulable: bool,
    /// Use the exec path for API servers without `v5.channel.k8s.io` (before 1.30) even
    /// on newer ones: stdin is framed instead of closed, and `Stdin::Piped` is unsupported.
    /// Older servers get it automatically.
    pub exec_v4_compatible: bool,
    /// Where the run's workspace lives: an `emptyDir` (the default), an existing
    /// PersistentVolumeClaim, or a claim made for each run.
    pub workspace_volume: WorkspaceVolume,
    /// Where snapshots go (`Run::snapshot`); none: this driver has no snapshots.
    pub snapshot_registry: Option<SnapshotRegistry>,
}

/// The registry repository Kubernetes snapshots are pushed to and runs from them are
/// pulled from ([`K8sConfig::snapshot_registry`]); the cluster's nodes must be able to
/// pull from it. A snapshot is the run's base image (as the node pulled it, by digest)
/// plus one layer of what the run changed, tagged with the snapshot's id.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SnapshotRegistry {
    /// `host[:port]/path` (`registry.internal:5000/runcell-snapshots`): no tag, no digest.
    pub repository: String,
    /// Plain HTTP to that host (a registry on loopback or a network you trust); HTTPS
    /// otherwise.
    pub plain_http: bool,
    /// The login for that host ([`SnapshotRegistry::login`]); without one, the Docker
    /// CLI's `config.json` (`$DOCKER_CONFIG`, else `~/.docker`: `auths`, `credHelpers`,
    /// `credsStore`) is asked, else the registry is spoken to anonymously. A base image
    /// on another registry is read with that registry's login from `config.json`.
    pub login: Option<runcell_core::credentials::RegistryCredentials>,
}

impl SnapshotRegistry {
    /// A repository spoken to over HTTPS.
    pub fn new(repository: impl Into<String>) -> SnapshotRegistry {
        SnapshotRegistry {
            repository: repository.into(),
            plain_http: false,
            login: None,
        }
    }

    /// Logs in to the registry as `username` (HTTP basic auth, or the registry's token
    /// service with it). The nodes pull with the pods' `image_pull_secrets`
    /// ([`K8sConfig::image_pull_secrets`]), not with this.
    pub fn login(mut self, username: impl Into<String>, password: impl Into<String>) -> Self {
        let host = self.repository.split('/').next().unwrap_or_default();
        self.login = Some(runcell_core::credentials::RegistryCredentials::new(
            host, username, password,
        ));
        self
    }

    /// Speaks plain HTTP to it.
    pub fn plain_http(mut self, on: bool) -> Self {
        self.plain_http = on;
        self
    }

    /// The registry host and the repository path, checked ([`ErrorKind::Config`] naming
    /// `snapshot_registry`).
    pub(crate) fn split(&self) -> Result<(&str, &str)> {
        let bad = |why: &str| {
            config_error(
                "snapshot_registry",
                format!(
                    "{:?} {why}",
                    self.repository.chars().take(200).collect::<String>()
                ),
            )
        };
        let (host, path) = self
            .repository
            .split_once('/')
            .ok_or_else(|| bad("is not host/repository"))?;
        let host_ok = !host.is_empty()
            && host.len() <= 253
            && (host.contains(['.', ':']) || host == "localhost")
            && host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-.:[]".contains(&b));
        if !host_ok {
            return Err(bad(
                "does not start with a registry host (name with a dot or a port, or localhost)",
            ));
        }
        let part_ok = |p: &str| {
            !p.is_empty()
                && p.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
                && p.as_bytes()[0].is_ascii_alphanumeric()
                && p.as_bytes()[p.len() - 1].is_ascii_alphanumeric()
        };
        if path.len() > 200 || !path.split('/').all(part_ok) {
            return Err(bad(
                "has no valid repository path (lowercase letters, digits, . _ - between slashes; no tag or digest)",
            ));
        }
        Ok((host, path))
    }
}

/// The volume under the run's workspace path ([`K8sConfig::workspace_volume`]).
///
/// A claim's name and a size are checked ([`ErrorKind::Config`] naming the config key:
/// `workspace_claim`, `workspace_storage_class`, `workspace_size`) before anything is
/// created.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum WorkspaceVolume {
    /// An `emptyDir` of the pod: the workspace goes with the pod.
    #[default]
    EmptyDir,
    /// An existing PersistentVolumeClaim in the run's namespace, mounted at the workspace
    /// path: what a run writes there stays for the next run on the same claim. A claim
    /// that does not exist fails the create ([`ErrorKind::NotFound`] naming
    /// `workspace_claim`) before anything is created.
    Claim {
        /// The claim's name.
        name: String,
    },
    /// A claim made for each run, named `<run id>-ws` and labelled like the run, created
    /// right after the pod (which waits for it to bind). Unless `keep`, the pod owns it:
    /// removing the run (stop, reap, a failed create) deletes it, and should this process
    /// die first, the cluster's garbage collector deletes it with the pod.
    PerRun {
        /// `storageClassName`: `None` uses the cluster's default StorageClass; `Some("")`
        /// means no class (the claim binds only to a matching PersistentVolume made
        /// beforehand).
        storage_class: Option<String>,
        /// The requested size, a Kubernetes quantity (`1Gi`, `500Mi`).
        size: String,
        /// Keep the claim after the run: once the run has started (its pod ran, or it
        /// was claimed from a pool) the claim loses its owner, gets the label
        /// [`WORKSPACE_KEPT_LABEL`](crate::WORKSPACE_KEPT_LABEL) and stays after stop,
        /// remove or reap until the user deletes it. Until then the pod owns it, so a
        /// create that fails, is cancelled or whose process dies leaves nothing.
        keep: bool,
    },
}

/// The size of a per-run claim configured by `workspace_storage_class` alone.
pub const DEFAULT_WORKSPACE_SIZE: &str = "1Gi";

impl WorkspaceVolume {
    /// A per-run claim of `size` from `storage_class` (`None`: the default class), deleted
    /// with the run.
    pub fn per_run(storage_class: Option<String>, size: impl Into<String>) -> WorkspaceVolume {
        WorkspaceVolume::PerRun {
            storage_class,
            size: size.into(),
            keep: false,
        }
    }

    /// An existing claim.
    pub fn claim(name: impl Into<String>) -> WorkspaceVolume {
        WorkspaceVolume::Claim { name: name.into() }
    }

    /// Checks names and size: an [`ErrorKind::Config`] error naming the config key.
    pub(crate) fn validate(&self) -> Result<()> {
        match self {
            WorkspaceVolume::EmptyDir => Ok(()),
            WorkspaceVolume::Claim { name } => check_name("workspace_claim", name),
            WorkspaceVolume::PerRun {
                storage_class,
                size,
                ..
            } => {
                if let Some(class) = storage_class.as_deref().filter(|c| !c.is_empty()) {
                    check_name("workspace_storage_class", class)?;
                }
                if !is_positive_quantity(size) {
                    return Err(config_error(
                        "workspace_size",
                        format!(
                            "{size:?} is not a positive Kubernetes quantity (such as 1Gi, 500Mi, 2G)"
                        ),
                    ));
                }
                Ok(())
            }
        }
    }
}

fn config_error(key: &'static str, message: String) -> Error {
    Error::new(ErrorKind::Config, format!("k8s: {key}: {message}")).with_field(key)
}

/// A DNS-1123 subdomain (what names of claims and StorageClasses must be): at most 253
/// characters, lowercase letters, digits, `-` and `.`, each dot-separated part starting
/// and ending with a letter or digit.
fn check_name(key: &'static str, name: &str) -> Result<()> {
    let part_ok = |p: &str| {
        !p.is_empty()
            && p.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !p.starts_with('-')
            && !p.ends_with('-')
    };
    if name.len() <= 253 && name.split('.').all(part_ok) {
        return Ok(());
    }
    Err(config_error(
        key,
        format!(
            "{name:?} is not a valid name (a DNS-1123 subdomain: at most 253 lowercase letters, digits, '-' and '.', starting and ending with a letter or digit)"
        ),
    ))
}

/// A quantity as Kubernetes parses it (`<number><suffix>`: a decimal number, then one of
/// `Ki Mi Gi Ti Pi Ei`, `m k M G T P E`, `e<n>`/`E<n>` or nothing), above zero.
pub(crate) fn is_positive_quantity(text: &str) -> bool {
    // A bound of our own: a size is a few characters.
    if text.is_empty() || text.len() > 64 {
        return false;
    }
    let number = text.strip_prefix('+').unwrap_or(text);
    let end = number
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(number.len());
    let (digits, suffix) = number.split_at(end);
    let (whole, fraction) = digits.split_once('.').unwrap_or((digits, ""));
    if (whole.is_empty() && fraction.is_empty()) || fraction.contains('.') {
        return false;
    }
    let suffix_ok = match suffix {
        "" | "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei" | "m" | "k" | "M" | "G" | "T" | "P" | "E" => {
            true
        }
        _ => match suffix.strip_prefix(['e', 'E']) {
            Some(exp) => {
                let exp = exp.strip_prefix(['+', '-']).unwrap_or(exp);
                !exp.is_empty() && exp.bytes().all(|b| b.is_ascii_digit())
            }
            None => false,
        },
    };
    suffix_ok && digits.bytes().any(|b| b.is_ascii_digit() && b != b'0')
}

impl K8sConfig {
    /// Sets the namespace of the runs.
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = Some(namespace.into());
        self
    }

    /// Sets the pod-level settings.
    pub fn template(mut self, template: PodTemplate) -> Self {
        self.template = template;
        self
    }

    /// Sets how long a pod may take to run.
    pub fn ready_timeout(mut self, timeout: Duration) -> Self {
        self.ready_timeout = Some(timeout);
        self
    }

    /// Waits for a pod no node has room for ([`K8sConfig::wait_unschedulable`]).
    pub fn wait_unschedulable(mut self, on: bool) -> Self {
        self.wait_unschedulable = on;
        self
    }

    /// Copies the workspace back into the host directory when a run stops.
    pub fn sync_workspace_on_stop(mut self, on: bool) -> Self {
        self.sync_workspace_on_stop = on;
        self
    }

    /// Sets the pod's `imagePullSecrets`: Secrets (in the run's namespace) with the
    /// credentials of private registries.
    pub fn image_pull_secrets<I, S>(mut self, names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.template.image_pull_secrets = names.into_iter().map(Into::into).collect();
        self
    }

    /// Uses the exec path for API servers before 1.30 (see the field).
    pub fn exec_v4_compatible(mut self, on: bool) -> Self {
        self.exec_v4_compatible = on;
        self
    }

    /// Sets where the run's workspace lives (see [`WorkspaceVolume`]). Checked by
    /// [`K8sDriver::connect`] and before each create.
    pub fn workspace_volume(mut self, volume: WorkspaceVolume) -> Self {
        self.workspace_volume = volume;
        self
    }

    /// Gives the driver snapshots, pushed to `registry` (see [`SnapshotRegistry`]).
    /// Checked by [`K8sDriver::connect`].
    pub fn snapshot_registry(mut self, registry: SnapshotRegistry) -> Self {
        self.snapshot_registry = Some(registry);
        self
    }
}

impl K8sDriver {
    /// Connects with the inferred kubeconfig and checks that the API server answers.
    pub async fn connect(config: K8sConfig) -> Result<K8sDriver> {
        config.workspace_volume.validate()?;
        let registry = crate::snapshot::Registry::of(&config)?;
        let kube_config = kube::Config::infer().await.map_err(|e| {
            Error::new(
                ErrorKind::Unavailable,
                "no cluster configuration (KUBECONFIG, ~/.kube/config, or in-cluster service account)",
            )
            .with_source(e)
        })?;
        let cluster_url = kube_config.cluster_url.to_string();
        let namespace = config
            .namespace
            .clone()
            .unwrap_or_else(|| kube_config.default_namespace.clone());
        let client = crate::client::build(kube_config).map_err(|e| {
            Error::new(
                ErrorKind::Unavailable,
                format!("cannot build a client for {cluster_url}"),
            )
            .with_source(e)
        })?;
        let version = client.apiserver_version().await.map_err(|e| {
            Error::new(
                ErrorKind::Unavailable,
                format!("cannot reach the Kubernetes API server at {cluster_url}"),
            )
            .with_source(e)
        })?;
        // v5.channel.k8s.io (stdin close) is served from 1.30 on.
        let minor: u32 = version.minor.trim_end_matches('+').parse().unwrap_or(0);
        let v5 = version.major != "1" || minor >= 30;
        Ok(K8sDriver {
            client,
            namespace,
            framed_stdin: config.exec_v4_compatible || !v5,
            config,
            cluster_url,
            runs: Arc::default(),
            registry,
        })
    }

    /// A driver on an existing client (custom TLS, auth or middleware), in `namespace`.
    pub fn from_client(
        client: Client,
        namespace: impl Into<String>,
        config: K8sConfig,
    ) -> Result<K8sDriver> {
        Ok(K8sDriver {
            cluster_url: "(caller's client)".into(),
            namespace: namespace.into(),
            client,
            framed_stdin: config.exec_v4_compatible,
            registry: crate::snapshot::Registry::of(&config)?,
            config,
            runs: Arc::default(),
        })
    }

    /// The registry constructor (see the crate docs for the keys).
    pub async fn from_config(mut config: DriverConfig) -> Result<Arc<dyn Driver>> {
        let k8s = K8sConfig::from_driver_config(&mut config)?;
        config.finish()?;
        Ok(Arc::new(K8sDriver::connect(k8s).await?))
    }
}

impl K8sConfig {
    /// Takes the driver's keys out of `config` (the caller checks that none is left).
    fn from_driver_config(config: &mut DriverConfig) -> Result<K8sConfig> {
        let pairs = |config: &mut DriverConfig, key: &str| -> Result<BTreeMap<String, String>> {
            let Some(text) = config.take(key) else {
                return Ok(BTreeMap::new());
            };
            text.split(',')
                .filter(|p| !p.trim().is_empty())
                .map(|p| {
                    p.split_once('=')
                        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                        .ok_or_else(|| {
                            Error::new(
                                ErrorKind::Config,
                                format!("k8s: {key}: {p:?} is not key=value"),
                            )
                        })
                })
                .collect()
        };
        let tolerations: Vec<Toleration> = match config.take("tolerations") {
            None => Vec::new(),
            Some(json) => serde_json::from_str(&json)
                .map_err(|e| Error::new(ErrorKind::Config, format!("k8s: tolerations: {e}")))?,
        };
        let k8s = K8sConfig {
            namespace: config.take("namespace"),
            template: PodTemplate {
                runtime_class: config.take("runtime_class"),
                node_selector: pairs(config, "node_selector")?,
                tolerations,
                labels: pairs(config, "pod_labels")?,
                annotations: pairs(config, "pod_annotations")?,
                image_pull_secrets: config
                    .take("image_pull_secrets")
                    .map(|names| {
                        names
                            .split(',')
                            .map(str::trim)
                            .filter(|n| !n.is_empty())
                            .map(String::from)
                            .collect()
                    })
                    .unwrap_or_default(),
            },
            ready_timeout: config
                .take_parsed::<u64>("ready_timeout_secs")?
                .map(Duration::from_secs),
            sync_workspace_on_stop: config
                .take_parsed::<bool>("sync_workspace_on_stop")?
                .unwrap_or(false),
            wait_unschedulable: config
                .take_parsed::<bool>("wait_unschedulable")?
                .unwrap_or(false),
            exec_v4_compatible: config
                .take_parsed::<bool>("exec_v4_compatible")?
                .unwrap_or(false),
            workspace_volume: workspace_volume(config)?,
            snapshot_registry: match config.take("snapshot_registry") {
                None => None,
                Some(repository) => Some(SnapshotRegistry {
                    repository,
                    plain_http: config
                        .take_parsed::<bool>("snapshot_registry_plain_http")?
                        .unwrap_or(false),
                    login: None,
                }),
            },
        };
        if k8s.snapshot_registry.is_none() && config.take("snapshot_registry_plain_http").is_some()
        {
            return Err(config_error(
                "snapshot_registry_plain_http",
                "applies only with snapshot_registry".into(),
            ));
        }
        Ok(k8s)
    }
}

/// The workspace keys: `workspace_claim=<name>` (an existing claim), or a per-run claim
/// chosen by `workspace_size=<quantity>` (default [`DEFAULT_WORKSPACE_SIZE`]) and/or
/// `workspace_storage_class=<class>` (empty: no class), with `workspace_keep=true|false`.
fn workspace_volume(config: &mut DriverConfig) -> Result<WorkspaceVolume> {
    let claim = config.take("workspace_claim");
    let storage_class = config.take("workspace_storage_class");
    let size = config.take("workspace_size");
    let keep = config.take_parsed::<bool>("workspace_keep")?;
    let per_run_key = [
        ("workspace_size", size.is_some()),
        ("workspace_storage_class", storage_class.is_some()),
        ("workspace_keep", keep.is_some()),
    ]
    .into_iter()
    .find(|(_, given)| *given)
    .map(|(key, _)| key);
    let volume = match (claim, per_run_key) {
        (Some(_), Some(key)) => {
            return Err(config_error(
                key,
                "is for a per-run claim and cannot be combined with workspace_claim (an existing claim)".into(),
            ));
        }
        (Some(name), None) => WorkspaceVolume::Claim { name },
        (None, _) if size.is_none() && storage_class.is_none() => {
            if keep.is_some() {
                return Err(config_error(
                    "workspace_keep",
                    "applies only to a per-run claim: set workspace_size or workspace_storage_class too".into(),
                ));
            }
            WorkspaceVolume::EmptyDir
        }
        (None, _) => WorkspaceVolume::PerRun {
            storage_class,
            size: size.unwrap_or_else(|| DEFAULT_WORKSPACE_SIZE.into()),
            keep: keep.unwrap_or(false),
        },
    };
    volume.validate()?;
    Ok(volume)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_pull_secrets_are_a_comma_separated_list() {
        let mut config = DriverConfig::new(
            "k8s",
            [("image_pull_secrets", " registry-a, registry-b ,,")],
        );
        let k8s = K8sConfig::from_driver_config(&mut config).unwrap();
        config.finish().unwrap();
        assert_eq!(
            k8s.template.image_pull_secrets,
            ["registry-a", "registry-b"]
        );
        let set = K8sConfig::default().image_pull_secrets(["one"]);
        assert_eq!(set.template.image_pull_secrets, ["one"]);
    }

    fn workspace_of(pairs: &[(&str, &str)]) -> Result<WorkspaceVolume> {
        let mut config = DriverConfig::new("k8s", pairs.iter().copied());
        let k8s = K8sConfig::from_driver_config(&mut config)?;
        config.finish().unwrap();
        Ok(k8s.workspace_volume)
    }

    #[test]
    fn workspace_keys_choose_the_volume() {
        assert_eq!(workspace_of(&[]).unwrap(), WorkspaceVolume::EmptyDir);
        assert_eq!(
            workspace_of(&[("workspace_claim", "agent-cache")]).unwrap(),
            WorkspaceVolume::claim("agent-cache")
        );
        assert_eq!(
            workspace_of(&[("workspace_size", "2Gi")]).unwrap(),
            WorkspaceVolume::per_run(None, "2Gi")
        );
        assert_eq!(
            workspace_of(&[("workspace_storage_class", "fast.ssd")]).unwrap(),
            WorkspaceVolume::per_run(Some("fast.ssd".into()), DEFAULT_WORKSPACE_SIZE)
        );
        // Empty: no class (binds only to a PersistentVolume made beforehand).
        assert_eq!(
            workspace_of(&[("workspace_storage_class", "")]).unwrap(),
            WorkspaceVolume::per_run(Some(String::new()), DEFAULT_WORKSPACE_SIZE)
        );
        assert_eq!(
            workspace_of(&[
                ("workspace_storage_class", "standard"),
                ("workspace_size", "500Mi"),
                ("workspace_keep", "true"),
            ])
            .unwrap(),
            WorkspaceVolume::PerRun {
                storage_class: Some("standard".into()),
                size: "500Mi".into(),
                keep: true,
            }
        );
        // From the environment too.
        let mut config = DriverConfig::from_vars(
            "k8s",
            [
                ("RUNCELL_K8S_WORKSPACE_SIZE", "1G"),
                ("RUNCELL_K8S_WORKSPACE_KEEP", "false"),
            ],
        );
        let k8s = K8sConfig::from_driver_config(&mut config).unwrap();
        config.finish().unwrap();
        assert_eq!(k8s.workspace_volume, WorkspaceVolume::per_run(None, "1G"));
    }

    #[test]
    fn bad_workspace_keys_are_config_errors_naming_the_key() {
        for (pairs, key) in [
            (
                &[("workspace_claim", "c"), ("workspace_size", "1Gi")][..],
                "workspace_size",
            ),
            (
                &[("workspace_claim", "c"), ("workspace_storage_class", "s")][..],
                "workspace_storage_class",
            ),
            (
                &[("workspace_claim", "c"), ("workspace_keep", "true")][..],
                "workspace_keep",
            ),
            (&[("workspace_keep", "true")][..], "workspace_keep"),
            (
                &[("workspace_size", "1Gi"), ("workspace_keep", "yes please")][..],
                "workspace_keep",
            ),
            (&[("workspace_size", "lots")][..], "workspace_size"),
            (&[("workspace_size", "0Gi")][..], "workspace_size"),
            (&[("workspace_size", "-1Gi")][..], "workspace_size"),
            (&[("workspace_claim", "Agent_Cache")][..], "workspace_claim"),
            (&[("workspace_claim", "")][..], "workspace_claim"),
            (
                &[("workspace_storage_class", "-fast")][..],
                "workspace_storage_class",
            ),
        ] {
            let e = workspace_of(pairs).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Config, "{pairs:?}: {e}");
            assert_eq!(e.field(), Some(key), "{pairs:?}: {e}");
            assert!(e.to_string().contains(key), "{e}");
        }
    }

    #[test]
    fn workspace_volumes_set_in_code_are_checked_the_same_way() {
        let bad = [
            WorkspaceVolume::claim("x".repeat(254)),
            WorkspaceVolume::claim("a..b"),
            WorkspaceVolume::per_run(Some("UPPER".into()), "1Gi"),
            WorkspaceVolume::per_run(None, "1 Gi"),
        ];
        for volume in bad {
            let config = K8sConfig::default().workspace_volume(volume.clone());
            let e = config.workspace_volume.validate().unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Config, "{volume:?}");
            assert!(e.field().is_some_and(|f| f.starts_with("workspace_")));
        }
        for good in [
            WorkspaceVolume::EmptyDir,
            WorkspaceVolume::claim("team-a.cache-1"),
            WorkspaceVolume::per_run(None, "16Mi"),
        ] {
            good.validate().unwrap();
        }
    }

    #[test]
    fn quantities_follow_the_kubernetes_grammar_and_are_positive() {
        for good in [
            "1", "1Gi", "500Mi", "1.5Gi", ".5Gi", "2.Ti", "+3G", "1e9", "1E+3", "100k", "7Ei",
        ] {
            assert!(is_positive_quantity(good), "{good}");
        }
        for bad in [
            "", "Gi", "0", "0.0Mi", "-1Gi", "1GB", "1gi", "1 Gi", "1.2.3", "1e", "1e3Gi", "1Gi ",
            "e3", ".",
        ] {
            assert!(!is_positive_quantity(bad), "{bad}");
        }
        assert!(!is_positive_quantity(&"1".repeat(65)));
    }
}
