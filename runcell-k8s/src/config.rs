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
    /// Use the exec path for API servers without `v5.channel.k8s.io` (before 1.30) even
    /// on newer ones: stdin is framed instead of closed, and `Stdin::Piped` is unsupported.
    /// Older servers get it automatically.
    pub exec_v4_compatible: bool,
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
}

impl K8sDriver {
    /// Connects with the inferred kubeconfig and checks that the API server answers.
    pub async fn connect(config: K8sConfig) -> Result<K8sDriver> {
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
        })
    }

    /// A driver on an existing client (custom TLS, auth or middleware), in `namespace`.
    pub fn from_client(
        client: Client,
        namespace: impl Into<String>,
        config: K8sConfig,
    ) -> K8sDriver {
        K8sDriver {
            cluster_url: "(caller's client)".into(),
            namespace: namespace.into(),
            client,
            framed_stdin: config.exec_v4_compatible,
            config,
            runs: Arc::default(),
        }
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
            exec_v4_compatible: config
                .take_parsed::<bool>("exec_v4_compatible")?
                .unwrap_or(false),
        };
        Ok(k8s)
    }
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
}
