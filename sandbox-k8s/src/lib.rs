//! Kubernetes driver for `sandbox`: one pod per run whose container only runs
//! `sleep infinity`, every tool call an exec over the API's websocket (kube-rs, never
//! `kubectl`).
//!
//! Connect directly with [`K8sDriver::connect`], or through the registry as `k8s`
//! (config from `SANDBOX_K8S_*`: `namespace`, `runtime_class`, `node_selector`
//! (`k=v,k=v`), `tolerations` (JSON), `pod_labels`, `pod_annotations`,
//! `ready_timeout_secs`, `sync_workspace_on_stop`, `exec_v4_compatible`). The cluster comes
//! from `KUBECONFIG`, `~/.kube/config` or the in-cluster service account.
//!
//! # The application picks the Kubernetes version
//!
//! Like every library on [`k8s_openapi`], this crate enables no Kubernetes version
//! feature of it: two libraries picking different ones would break every application
//! that links both. The application (the crate that builds the binary or the tests) must
//! enable exactly one, normally the oldest API server it supports:
//!
//! ```toml
//! [dependencies]
//! runcell-k8s = "0.1"
//! k8s-openapi = { version = "0.29", features = ["v1_36"] }
//! ```
//!
//! Without one, k8s-openapi's build script stops the build ("None of the v1_* features
//! are enabled"). To check or document this crate on its own, set
//! `K8S_OPENAPI_ENABLED_VERSION=1.36` instead. Any version k8s-openapi 0.29 supports
//! works; exec stdin EOF needs API servers 1.30+ at run time, older ones get the v4 path
//! (see [`K8sConfig::exec_v4_compatible`]).
//!
//! # Starting a run
//!
//! `create` succeeds only when the pod runs AND answers an exec, entered in the run's
//! working directory as the run's user. Otherwise it fails at once with a typed error,
//! and removes the pod and its CA Secret: an image that cannot be used is
//! [`ErrorKind::NotFound`] (pull problems) or [`ErrorKind::InvalidSpec`] (an invalid
//! reference) naming the field `image` and the container's waiting reason; a keep-alive
//! that exits at once (no `sleep` in the image, a `sleep` without `infinity`) or a pod
//! that does not answer `sh -c :` is [`ErrorKind::StartFailed`] with the exit code and
//! log tail (context `exit_code`, `log`); a working directory that cannot be entered is
//! [`ErrorKind::NotFound`] naming the field `working_dir`.
#![forbid(unsafe_code)]

mod error;
mod exec;
mod pod;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Event, Pod, Secret, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use runcell_core::labels::{self, Owner};
use runcell_core::{
    ByteStream, Capabilities, CreateGuard, Driver, DriverConfig, Error, ErrorKind, ExecSpec,
    ExecStream, OutputChunk, Result, Run, RunExt, RunInfo, RunSpec, files,
};

pub use exec::{WRAPPER, header, sh_quote};
pub use pod::{CONTAINER, KEEPALIVE, PodTemplate, ca_secret_name, run_objects};

runcell_core::register_driver!(
    "k8s",
    "Kubernetes API (kube-rs, websocket exec)",
    K8sDriver::from_config
);

/// Driver settings beyond the cluster connection.
#[derive(Debug, Clone, Default)]
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

/// The Kubernetes driver.
#[derive(Clone)]
pub struct K8sDriver {
    client: Client,
    namespace: String,
    config: K8sConfig,
    cluster_url: String,
    /// Stdin is framed in the exec header, never closed (v4 servers, or forced).
    framed_stdin: bool,
}

impl std::fmt::Debug for K8sDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("K8sDriver")
            .field("cluster", &self.cluster_url)
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}

const DEFAULT_READY_TIMEOUT: Duration = Duration::from_secs(120);
/// The bound of the create-time probe exec.
const PROBE_BOUND: Duration = Duration::from_secs(30);
/// How long the pod's status may lag a failed probe before the probe's own error is used.
const STATUS_SETTLE: Duration = Duration::from_secs(3);
/// The bound of the CA setup exec.
const CA_SETUP_BOUND: Duration = Duration::from_secs(60);

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
        let client = Client::try_from(kube_config).map_err(|e| {
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
        }
    }

    /// The registry constructor (see the crate docs for the keys).
    pub async fn from_config(mut config: DriverConfig) -> Result<Arc<dyn Driver>> {
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
                node_selector: pairs(&mut config, "node_selector")?,
                tolerations,
                labels: pairs(&mut config, "pod_labels")?,
                annotations: pairs(&mut config, "pod_annotations")?,
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
        config.finish()?;
        Ok(Arc::new(K8sDriver::connect(k8s).await?))
    }

    /// The namespace runs are created in.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    fn secrets(&self) -> Api<Secret> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// A handle on the run `id`; `env` is its container's env (see [`K8sRun`]).
    fn run(
        &self,
        id: &str,
        host_dir: Option<PathBuf>,
        spec_workspace: String,
        env: Vec<(String, String)>,
    ) -> K8sRun {
        K8sRun {
            driver: self.clone(),
            id: id.to_string(),
            host_dir,
            workspace: spec_workspace,
            env,
        }
    }

    /// Waits (watch, not poll) until the pod runs, or fails with what its status and events
    /// say as soon as they say it cannot (an image that cannot be used, a keep-alive that
    /// exited).
    async fn wait_ready(&self, id: &str, image: &str, working_dir: &str) -> Result<()> {
        let timeout = self.config.ready_timeout.unwrap_or(DEFAULT_READY_TIMEOUT);
        let cond =
            |pod: Option<&Pod>| pod.is_none_or(|p| !matches!(readiness(p), Readiness::Pending));
        let waited = tokio::time::timeout(
            timeout,
            kube::runtime::wait::await_condition(self.pods(), id, cond),
        )
        .await;
        let pod = match waited {
            Ok(Ok(pod)) => pod,
            Ok(Err(e)) => {
                return Err(Error::new(ErrorKind::Backend, "watching the pod failed")
                    .with("run", id)
                    .with_source(e));
            }
            Err(_) => {
                let pod = self.pods().get_opt(id).await.ok().flatten();
                let why = pod.as_ref().map(pending_reason).unwrap_or_default();
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "the pod did not run within {timeout:?}: {why}{}",
                        self.events(id).await
                    ),
                )
                .with("run", id));
            }
        };
        let Some(pod) = pod else {
            return Err(
                Error::new(ErrorKind::RunLost, "the pod was deleted while starting")
                    .with("run", id),
            );
        };
        match start_error(&readiness(&pod), image, working_dir) {
            None => Ok(()),
            Some(e) => Err(self.with_events(e, id).await),
        }
    }

    /// Proves that the pod runs AND answers an exec, entered in the run's working directory
    /// as the run's user, while watching the pod: a keep-alive that exits at once (before or
    /// during the probe) fails here with its exit code and log tail, not at the first exec.
    async fn probe(&self, id: &str, spec: &RunSpec) -> Result<()> {
        let probe = ExecSpec::new(["sh", "-c", ":"]).working_dir(spec.effective_working_dir());
        let pods = self.pods();
        let exec = exec::run_internal(&pods, id, probe, self.framed_stdin, PROBE_BOUND);
        let stopped = kube::runtime::wait::await_condition(self.pods(), id, |p: Option<&Pod>| {
            p.is_none_or(|p| !matches!(readiness(p), Readiness::Ready))
        });
        let failure = tokio::select! {
            out = exec => match out {
                Ok(out) if out.status.success() => return Ok(()),
                Ok(out) => {
                    if let Some(e) = out.status.not_started_error() {
                        return Err(e.with("run", id));
                    }
                    Error::new(
                        ErrorKind::StartFailed,
                        format!(
                            "the pod runs but `sh -c :` {} (the library needs a POSIX sh in the image): {}",
                            out.status,
                            out.stderr_str().trim()
                        ),
                    )
                    .with("run", id)
                }
                Err(e) => e,
            },
            Ok(Some(pod)) = stopped => {
                let why = start_error(&readiness(&pod), &spec.image, spec.effective_working_dir()).unwrap_or_else(|| {
                    Error::new(ErrorKind::StartFailed, "the pod stopped running while starting")
                        .with("run", id)
                });
                return Err(self.with_events(why, id).await);
            }
        };
        // The exec failed: if the pod's status says why (the keep-alive exited), that is
        // the error; it may lag the exec by a moment.
        let settled = tokio::time::timeout(
            STATUS_SETTLE,
            kube::runtime::wait::await_condition(self.pods(), id, |p: Option<&Pod>| {
                p.is_none_or(|p| !matches!(readiness(p), Readiness::Ready))
            }),
        )
        .await;
        let why = match settled {
            Ok(Ok(Some(pod))) => {
                start_error(&readiness(&pod), &spec.image, spec.effective_working_dir())
            }
            Ok(Ok(None)) => Some(
                Error::new(ErrorKind::RunLost, "the pod was deleted while starting")
                    .with("run", id),
            ),
            _ => None,
        };
        Err(self.with_events(why.unwrap_or(failure), id).await)
    }

    /// Adds the pod's last events to an error's message, and the run id.
    async fn with_events(&self, e: Error, id: &str) -> Error {
        let events = self.events(id).await;
        let mut out = Error::new(e.kind(), format!("{}{events}", e.message()));
        if let Some(field) = e.field() {
            out = out.with_field(field);
        }
        for (k, v) in e.context() {
            out = out.with(k, v);
        }
        if e.context_value("run").is_none() {
            out = out.with("run", id);
        }
        out
    }

    /// The pod's last warning events, as a suffix for error messages.
    async fn events(&self, id: &str) -> String {
        let events: Api<Event> = Api::namespaced(self.client.clone(), &self.namespace);
        let params = ListParams::default().fields(&format!("involvedObject.name={id}"));
        match events.list(&params).await {
            Ok(list) if list.items.iter().any(is_warning) => {
                let lines: Vec<String> = list
                    .items
                    .iter()
                    .filter(|e| is_warning(e))
                    .rev()
                    .take(5)
                    .map(|e| {
                        format!(
                            "{}: {}",
                            e.reason.as_deref().unwrap_or("?"),
                            e.message.as_deref().unwrap_or("").trim()
                        )
                    })
                    .collect();
                format!("; events: {}", lines.join(" | "))
            }
            _ => String::new(),
        }
    }

    /// Makes the CA Secret owned by the pod, so garbage collection removes it with the pod
    /// even if this process dies before it can.
    async fn adopt_secret(&self, id: &str, pod_uid: &str) -> Result<()> {
        let owner = OwnerReference {
            api_version: "v1".into(),
            kind: "Pod".into(),
            name: id.into(),
            uid: pod_uid.into(),
            ..Default::default()
        };
        let patch = serde_json::json!({ "metadata": { "ownerReferences": [owner] } });
        self.secrets()
            .patch(
                &ca_secret_name(id),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
            .map(|_| ())
            .map_err(|e| error::map("make the CA secret owned by its pod", e).with("run", id))
    }

    /// Everything after the pod exists; on error the caller removes the run.
    async fn set_up(&self, id: &str, spec: &RunSpec, pod_uid: &str) -> Result<()> {
        if spec.ca_bundle.is_some() {
            // At once, so that the window in which a crash could orphan it is tiny.
            self.adopt_secret(id, pod_uid).await?;
        }
        self.wait_ready(id, &spec.image, spec.effective_working_dir())
            .await?;
        self.probe(id, spec).await?;
        let run = self.run(
            id,
            spec.workspace.host_dir.clone(),
            spec.workspace.path.clone(),
            spec.run_env(),
        );
        if spec.ca_bundle.is_some() {
            let setup = ExecSpec::new(["sh", "-c", CA_SETUP]).working_dir("/");
            let out =
                exec::run_internal(&self.pods(), id, setup, self.framed_stdin, CA_SETUP_BOUND)
                    .await?;
            if !out.status.success() {
                return Err(Error::new(
                    ErrorKind::Backend,
                    format!("installing the CA bundle {}", out.status),
                )
                .with("run", id)
                .with("stderr", out.stderr_str()));
            }
        }
        if let Some(dir) = &spec.workspace.host_dir {
            run.put_archive(&spec.workspace.path, files::byte_stream(tar_dir(dir)?))
                .await?;
        }
        runcell_core::run_post_create(&run, spec).await
    }
}

fn is_warning(e: &Event) -> bool {
    e.type_.as_deref() == Some("Warning")
}

/// Builds the CA files from the mounted Secret: the CA alone, the full bundle (system
/// roots first) and, where the image's system bundle is writable, the system bundle too.
const CA_SETUP: &str = r#"
set -e
ca=/etc/sandbox-ca/ca.pem
sys=""
for f in /etc/ssl/certs/ca-certificates.crt /etc/pki/tls/certs/ca-bundle.crt /etc/ssl/cert.pem; do
  if [ -f "$f" ] && [ ! -L "$f" ]; then sys="$f"; break; fi
done
cat "$ca" > /etc/sandbox/ca.pem
{ if [ -n "$sys" ]; then cat "$sys"; echo; fi; cat "$ca"; } | sed '/^$/d' > /etc/sandbox/ca-bundle.pem
# The system store only where it is writable (not under a read-only root, not as non-root).
if [ -n "$sys" ] && (cat /etc/sandbox/ca-bundle.pem > "$sys") 2>/dev/null; then
  { mkdir -p /usr/local/share/ca-certificates && cat "$ca" > /usr/local/share/ca-certificates/sandbox-ca.crt; } 2>/dev/null || true
fi
"#;

/// Where a starting pod stands.
#[derive(Debug, Clone, PartialEq)]
enum Readiness {
    /// The pod runs and its container runs.
    Ready,
    /// Not yet (scheduling, creating the container, pulling).
    Pending,
    /// The container waits for a reason that does not resolve by itself (an image that
    /// cannot be used, a configuration the runtime rejects).
    Stuck { reason: String, message: String },
    /// The container (the keep-alive) ended or could not start.
    Exited {
        code: i32,
        reason: String,
        /// The termination message: with `FallbackToLogsOnError`, the log tail.
        message: String,
    },
    /// The pod ended or is being deleted.
    Failed(String),
}

/// Waiting reasons of a container that mean its image cannot be used (kubelet's
/// `images` package and `kuberuntime`).
const IMAGE_REASONS: &[&str] = &[
    "ErrImagePull",
    "ImagePullBackOff",
    "ErrImageNeverPull",
    "InvalidImageName",
    "ImageInspectError",
    "RegistryUnavailable",
    "SignatureValidationFailed",
];

/// Waiting reasons of a container that the runtime will not get past by retrying.
const STUCK_REASONS: &[&str] = &[
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
    "PreStartHookError",
];

impl Readiness {
    /// What the runtime said about a container it could not create or start.
    fn runtime_message(&self) -> Option<&str> {
        match self {
            Readiness::Stuck { reason, message } if STUCK_REASONS.contains(&reason.as_str()) => {
                Some(message)
            }
            Readiness::Exited {
                reason, message, ..
            } if reason == "StartError" || reason == "ContainerCannotRun" => Some(message),
            _ => None,
        }
    }
}

fn readiness(pod: &Pod) -> Readiness {
    let Some(status) = &pod.status else {
        return Readiness::Pending;
    };
    if pod.metadata.deletion_timestamp.is_some() {
        return Readiness::Failed("the pod is being deleted".into());
    }
    let container = status
        .container_statuses
        .iter()
        .flatten()
        .find(|c| c.name == CONTAINER);
    let state = container.and_then(|c| c.state.as_ref());
    if let Some(t) = state.and_then(|s| s.terminated.as_ref()) {
        return Readiness::Exited {
            code: t.exit_code,
            reason: t.reason.clone().unwrap_or_default(),
            message: t.message.clone().unwrap_or_default(),
        };
    }
    if let Some(w) = state.and_then(|s| s.waiting.as_ref()) {
        let reason = w.reason.as_deref().unwrap_or("");
        if IMAGE_REASONS.contains(&reason) || STUCK_REASONS.contains(&reason) {
            return Readiness::Stuck {
                reason: reason.into(),
                message: w.message.clone().unwrap_or_default(),
            };
        }
    }
    match status.phase.as_deref() {
        Some("Failed") | Some("Succeeded") => Readiness::Failed(format!(
            "phase {}: {} {}",
            status.phase.as_deref().unwrap_or(""),
            status.reason.as_deref().unwrap_or(""),
            status.message.as_deref().unwrap_or("")
        )),
        Some("Running") if state.is_some_and(|s| s.running.is_some()) => Readiness::Ready,
        _ => Readiness::Pending,
    }
}

/// The typed error of a pod that will not run, `None` while it runs or may still run.
///
/// `working_dir` is the container's: a runtime that cannot create or enter it fails the
/// start with a message naming it (runc: `chdir to cwd ("/x") set in config.json failed`,
/// Docker: `Cannot mkdir: /x is not a directory`).
fn start_error(readiness: &Readiness, image: &str, working_dir: &str) -> Option<Error> {
    if let Some(message) = readiness.runtime_message()
        && (message.contains("chdir to cwd")
            || (working_dir != "/"
                && message.contains(working_dir)
                && (message.contains("mkdir") || message.contains("chdir"))))
    {
        return Some(
            Error::new(
                ErrorKind::NotFound,
                format!(
                    "the run's working directory {working_dir} cannot be entered: {}",
                    message.trim()
                ),
            )
            .with_field("working_dir")
            .with("working_dir", working_dir),
        );
    }
    Some(match readiness {
        Readiness::Ready | Readiness::Pending => return None,
        Readiness::Stuck { reason, message } if reason == "InvalidImageName" => {
            Error::invalid_spec(
                "image",
                format!("image {image} is not a valid reference: {reason}: {message}"),
            )
            .with("image", image)
            .with("reason", reason)
        }
        Readiness::Stuck { reason, message } if IMAGE_REASONS.contains(&reason.as_str()) => {
            Error::new(
                ErrorKind::NotFound,
                format!("image {image} cannot be pulled: {reason}: {message}"),
            )
            .with_field("image")
            .with("image", image)
            .with("reason", reason)
        }
        Readiness::Stuck { reason, message } => Error::new(
            ErrorKind::StartFailed,
            format!("the container cannot be created: {reason}: {message}"),
        )
        .with("image", image)
        .with("reason", reason),
        Readiness::Exited {
            code,
            reason,
            message,
        } => {
            let tail = message.trim();
            // runc: `exec: "sleep": executable file not found in $PATH` (StartError);
            // behind an init such as tini: `exec sleep failed: No such file or directory`.
            let lower = tail.to_ascii_lowercase();
            let missing_sleep = lower.contains("executable file not found")
                || (lower.contains("sleep") && lower.contains("no such file or directory"));
            let mut e = Error::new(
                ErrorKind::StartFailed,
                if missing_sleep {
                    format!(
                        "the image {image} has no `{}` to keep the pod alive ({reason}, exit code {code}): {tail}",
                        KEEPALIVE.join(" ")
                    )
                } else {
                    format!(
                        "the keep-alive `{}` exited at once with code {code} ({reason}){}",
                        KEEPALIVE.join(" "),
                        if tail.is_empty() {
                            String::new()
                        } else {
                            format!(": {tail}")
                        }
                    )
                },
            )
            .with("image", image)
            .with("exit_code", code)
            .with("reason", reason);
            if missing_sleep {
                e = e.with_field("image");
            }
            if !tail.is_empty() {
                e = e.with("log", tail);
            }
            e
        }
        Readiness::Failed(msg) => Error::new(
            ErrorKind::StartFailed,
            format!("the pod failed to start: {msg}"),
        ),
    })
}

fn pending_reason(pod: &Pod) -> String {
    let Some(status) = &pod.status else {
        return "no status yet".into();
    };
    for c in status.conditions.iter().flatten() {
        if c.status == "False" && c.reason.is_some() {
            return format!(
                "{} {}: {}",
                c.type_,
                c.reason.as_deref().unwrap_or(""),
                c.message.as_deref().unwrap_or("")
            );
        }
    }
    format!("phase {}", status.phase.as_deref().unwrap_or("unknown"))
}

/// A tar of the directory's content (paths relative to it).
fn tar_dir(dir: &Path) -> Result<Vec<u8>> {
    let mut builder = tar::Builder::new(Vec::new());
    builder.follow_symlinks(false);
    builder
        .append_dir_all(".", dir)
        .and_then(|_| builder.into_inner())
        .map_err(|e| {
            Error::new(
                ErrorKind::Backend,
                format!("cannot archive {}", dir.display()),
            )
            .with_source(e)
        })
}

#[async_trait]
impl Driver for K8sDriver {
    fn name(&self) -> &str {
        "k8s"
    }

    fn capabilities(&self) -> Capabilities {
        let mut c = Capabilities::default();
        c.workspace_seed = true;
        c.memory_limit = true;
        c.cpu_limit = true;
        c.read_only_rootfs = true;
        c.cap_drop = true;
        c.no_new_privileges = true;
        c.ttl = true;
        c.files = true;
        c.stdin_streaming = !self.framed_stdin;
        c.attach = true;
        c.system_trust_store = true;
        c
    }

    async fn create(&self, spec: &RunSpec) -> Result<Box<dyn Run>> {
        runcell_core::prepare(spec, &self.capabilities())?;
        let id = runcell_core::new_run_id();
        let labels = labels::run_labels(&id, &Owner::current(), spec.ttl, &spec.labels);
        let (pod, secret) =
            run_objects(spec, &id, &self.namespace, &labels, &self.config.template)?;
        // If the caller drops this future from here on, the guard removes what exists.
        let guard = {
            let (driver, id) = (self.clone(), id.clone());
            CreateGuard::new(move || {
                let (driver, id) = (driver.clone(), id.clone());
                async move { driver.remove(&id).await }
            })
        };
        if let Some(secret) = &secret
            && let Err(e) = self.secrets().create(&PostParams::default(), secret).await
        {
            guard.disarm();
            return Err(error::map("create CA secret", e).with("run", &id));
        }
        let created = match self.pods().create(&PostParams::default(), &pod).await {
            Ok(p) => p,
            Err(e) => {
                let _ = self.remove(&id).await;
                guard.disarm();
                return Err(error::map("create pod", e)
                    .with("run", &id)
                    .with("image", &spec.image));
            }
        };
        let uid = created.metadata.uid.unwrap_or_default();
        if let Err(e) = self.set_up(&id, spec, &uid).await {
            if let Err(cleanup) = self.remove(&id).await {
                tracing::error!(run = %id, "could not remove the failed run: {cleanup}");
            }
            guard.disarm();
            return Err(e);
        }
        guard.disarm();
        tracing::debug!(run = %id, image = %spec.image, "run started");
        Ok(Box::new(self.run(
            &id,
            spec.workspace.host_dir.clone(),
            spec.workspace.path.clone(),
            spec.run_env(),
        )))
    }

    async fn attach(&self, id: &str) -> Result<Box<dyn Run>> {
        let pod = self
            .pods()
            .get_opt(id)
            .await
            .map_err(|e| error::map("get pod", e).with("run", id))?
            .filter(|p| {
                p.metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get(labels::MANAGED_BY))
                    .map(String::as_str)
                    == Some(labels::MANAGED_BY_VALUE)
            })
            .ok_or_else(|| {
                Error::new(ErrorKind::NotFound, "no managed run with this id").with("run", id)
            })?;
        if !matches!(readiness(&pod), Readiness::Ready) {
            return Err(
                Error::new(ErrorKind::RunLost, "the run's pod is not running").with("run", id),
            );
        }
        let workspace = pod
            .spec
            .iter()
            .flat_map(|s| s.containers.iter())
            .flat_map(|c| c.volume_mounts.iter().flatten())
            .find(|m| m.name == "workspace")
            .map(|m| m.mount_path.clone())
            .unwrap_or_else(|| runcell_core::DEFAULT_WORKSPACE_PATH.into());
        let host_dir = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(pod::HOST_DIR_ANNOTATION))
            .map(PathBuf::from);
        let env = pod
            .spec
            .iter()
            .flat_map(|s| s.containers.iter())
            .filter(|c| c.name == CONTAINER)
            .flat_map(|c| c.env.iter().flatten())
            .map(|e| (e.name.clone(), e.value.clone().unwrap_or_default()))
            .collect();
        Ok(Box::new(self.run(id, host_dir, workspace, env)))
    }

    async fn list(&self, selector: &BTreeMap<String, String>) -> Result<Vec<RunInfo>> {
        let mut terms = vec![format!(
            "{}={}",
            labels::MANAGED_BY,
            labels::MANAGED_BY_VALUE
        )];
        terms.extend(selector.iter().map(|(k, v)| format!("{k}={v}")));
        let pods = self
            .pods()
            .list(&ListParams::default().labels(&terms.join(",")))
            .await
            .map_err(|e| error::map("list pods", e))?;
        Ok(pods
            .items
            .into_iter()
            .filter_map(|p| {
                let labels = p.metadata.labels.clone()?;
                let phase = p.status.as_ref().and_then(|s| s.phase.clone());
                Some(RunInfo {
                    id: labels.get(labels::RUN_ID)?.clone(),
                    running: !matches!(phase.as_deref(), Some("Failed" | "Succeeded")),
                    labels,
                })
            })
            .collect())
    }

    async fn remove(&self, id: &str) -> Result<()> {
        let now = DeleteParams {
            grace_period_seconds: Some(0),
            ..DeleteParams::background()
        };
        match self.pods().delete(id, &now).await {
            Ok(_) => {}
            Err(e) if error::code(&e) == Some(404) => {}
            Err(e) => return Err(error::map("delete pod", e).with("run", id)),
        }
        match self.secrets().delete(&ca_secret_name(id), &now).await {
            Ok(_) => Ok(()),
            Err(e) if error::code(&e) == Some(404) => Ok(()),
            Err(e) => Err(error::map("delete CA secret", e).with("run", id)),
        }
    }
}

/// One run: a pod entered by exec.
pub struct K8sRun {
    driver: K8sDriver,
    id: String,
    host_dir: Option<PathBuf>,
    workspace: String,
    /// The run's env as in the pod spec: the exec wrapper's shell drops the names that
    /// are not shell identifiers (`-u`, `my.var`), so each exec passes those again.
    env: Vec<(String, String)>,
}

impl std::fmt::Debug for K8sRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Env names only: values may be secrets.
        let names: Vec<&str> = self.env.iter().map(|(n, _)| n.as_str()).collect();
        f.debug_struct("K8sRun")
            .field("id", &self.id)
            .field("driver", &self.driver)
            .field("host_dir", &self.host_dir)
            .field("workspace", &self.workspace)
            .field("env", &names)
            .finish()
    }
}

impl K8sRun {
    /// Copies the run's workspace back into its host directory (files the run deleted stay
    /// on the host). A no-op for runs without a host directory.
    pub async fn sync_workspace_to_host(&self) -> Result<()> {
        let Some(dir) = &self.host_dir else {
            return Ok(());
        };
        let out = self
            .tar_exec(&["tar", "-c", "-f", "-", "-C", &self.workspace, "."], None)
            .await?;
        if !out.status.success() || out.stdout_truncated() {
            return Err(tar_error(&out, &self.workspace, &self.id));
        }
        let mut archive = tar::Archive::new(&out.stdout[..]);
        let bad = |e: std::io::Error| {
            Error::new(ErrorKind::Backend, "cannot unpack the workspace").with_source(e)
        };
        for entry in archive.entries().map_err(bad)? {
            let mut entry = entry.map_err(bad)?;
            // Only files and directories, and only inside `dir`: the archive comes from
            // the sandbox and may hold links meant to write elsewhere on the host.
            match entry.header().entry_type() {
                tar::EntryType::Regular | tar::EntryType::Directory => {
                    entry.unpack_in(dir).map_err(bad)?;
                }
                other => {
                    tracing::debug!(run = %self.id, ?other, "workspace sync skips a non-regular entry")
                }
            }
        }
        Ok(())
    }

    async fn tar_exec(
        &self,
        argv: &[&str],
        stdin: Option<Bytes>,
    ) -> Result<runcell_core::ExecOutput> {
        let mut spec = ExecSpec::new(argv.iter().copied())
            .working_dir("/")
            .output_limit(1 << 30);
        if let Some(b) = stdin {
            spec = spec.stdin_bytes(b);
        }
        self.exec(spec).await
    }
}

/// How much of tar's messages is kept.
const TAR_MESSAGES_LIMIT: usize = 64 << 10;
/// The largest archive sent on the v4 exec path, where it is buffered (256 MiB).
const FRAMED_ARCHIVE_LIMIT: u64 = 256 << 20;

fn tar_error(out: &runcell_core::ExecOutput, path: &str, run: &str) -> Error {
    let stderr = out.stderr_str();
    // BusyBox: "can't remove old file x: Is a directory"; GNU: "Cannot open: File exists".
    if stderr.contains("Is a directory")
        || stderr.contains("File exists")
        || stderr.contains("Not a directory")
    {
        return Error::invalid_spec(
            "path",
            format!(
                "would replace a directory with a non-directory (or the reverse): {}",
                stderr.trim()
            ),
        )
        .with("run", run)
        .with("path", path);
    }
    let kind = if stderr.contains("No such file") || stderr.contains("can't change directory") {
        ErrorKind::NotFound
    } else {
        ErrorKind::Backend
    };
    Error::new(
        kind,
        format!("tar in the pod {}: {}", out.status, stderr.trim()),
    )
    .with("run", run)
    .with("path", path)
}

#[async_trait]
impl Run for K8sRun {
    fn id(&self) -> &str {
        &self.id
    }

    async fn exec_stream(&self, spec: ExecSpec) -> Result<ExecStream> {
        exec::start(
            &self.driver.pods(),
            &self.id,
            spec,
            self.driver.framed_stdin,
            &self.env,
        )
        .await
    }

    async fn put_archive(&self, dir: &str, tar: ByteStream) -> Result<()> {
        files::validate_dir_path(dir)?;
        let spec = ExecSpec::new(["tar", "-x", "-f", "-", "-C", dir])
            .working_dir("/")
            .output_limit(TAR_MESSAGES_LIMIT);
        let out = if self.driver.framed_stdin {
            // Without stdin EOF (v4 exec) the length must be known up front: buffer.
            let tar = files::collect_bytes(tar, FRAMED_ARCHIVE_LIMIT)
                .await
                .map_err(|e| {
                    Error::new(
                        ErrorKind::Unsupported,
                        "archives on the v4 exec path are buffered and limited",
                    )
                    .with_field("stdin")
                    .with_source(e)
                })?;
            self.exec(spec.stdin_bytes(tar)).await?
        } else {
            let mut stream = self.exec_stream(spec.stdin_piped()).await?;
            let mut stdin = stream.take_stdin().expect("stdin was asked for");
            let feed = async move {
                let mut tar = tar;
                while let Some(chunk) = tar.try_next().await.map_err(|e| {
                    Error::new(ErrorKind::Backend, "reading the archive to upload failed")
                        .with_source(e)
                })? {
                    stdin.write(chunk).await?;
                }
                Ok::<(), Error>(())
            };
            // A failed feed drops stdin: tar reads a short archive and fails, so this ends.
            let (fed, out) = tokio::join!(feed, stream.collect(TAR_MESSAGES_LIMIT));
            if !out.status.success() {
                return Err(tar_error(&out, dir, &self.id));
            }
            fed?;
            out
        };
        if out.status.success() {
            Ok(())
        } else {
            Err(tar_error(&out, dir, &self.id))
        }
    }

    async fn get_archive(&self, path: &str) -> Result<ByteStream> {
        let (parent, base) = files::split_file_path(path.trim_end_matches('/')).map_err(|_| {
            Error::invalid_spec("path", format!("{path:?} must be an absolute path below /"))
        })?;
        // A name that starts with '-' must not read as an option of tar.
        let base = if base.starts_with('-') {
            format!("./{base}")
        } else {
            base.to_string()
        };
        let mut stream = self
            .exec_stream(
                ExecSpec::new(["tar", "-c", "-f", "-", "-C", parent, &base]).working_dir("/"),
            )
            .await?;
        // Wait for the first bytes of the archive, or for tar's failure: a missing path
        // is a typed error, not a broken stream.
        let mut stderr = Vec::new();
        let first = loop {
            match stream.next_chunk().await {
                Some(OutputChunk::Stdout(b)) => break Some(b),
                Some(OutputChunk::Stderr(b)) => {
                    if stderr.len() < TAR_MESSAGES_LIMIT {
                        stderr.extend_from_slice(&b);
                    }
                }
                None => break None,
            }
        };
        let Some(first) = first else {
            let status = stream.wait().await;
            let out = runcell_core::ExecOutput {
                status,
                stdout: Vec::new(),
                stderr,
                stdout_total: 0,
                stderr_total: 0,
                duration: Default::default(),
            };
            return Err(tar_error(&out, path, &self.id));
        };
        let rest = futures::stream::unfold(Some(stream), |state| async move {
            let mut stream = state?;
            loop {
                match stream.next_chunk().await {
                    Some(OutputChunk::Stdout(b)) => return Some((Ok(b), Some(stream))),
                    Some(OutputChunk::Stderr(_)) => continue,
                    None => {
                        let status = stream.wait().await;
                        return (!status.success()).then(|| {
                            (
                                Err(std::io::Error::other(format!("tar in the pod {status}"))),
                                None,
                            )
                        });
                    }
                }
            }
        });
        Ok(futures::stream::once(async move { Ok(first) })
            .chain(rest)
            .boxed())
    }

    async fn stop(&self) -> Result<()> {
        if self.driver.config.sync_workspace_on_stop {
            match self.sync_workspace_to_host().await {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::RunLost => {}
                Err(e) => tracing::warn!(run = %self.id, "workspace sync at stop failed: {e}"),
            }
        }
        self.driver.remove(&self.id).await
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{
        ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStateWaiting,
        ContainerStatus, PodStatus,
    };

    use super::*;

    fn pod(phase: &str, state: ContainerState) -> Pod {
        Pod {
            status: Some(PodStatus {
                phase: Some(phase.into()),
                container_statuses: Some(vec![ContainerStatus {
                    name: CONTAINER.into(),
                    state: Some(state),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn waiting(reason: &str, message: &str) -> Pod {
        pod(
            "Pending",
            ContainerState {
                waiting: Some(ContainerStateWaiting {
                    reason: Some(reason.into()),
                    message: Some(message.into()),
                }),
                ..Default::default()
            },
        )
    }

    fn terminated(phase: &str, code: i32, reason: &str, message: &str) -> Pod {
        pod(
            phase,
            ContainerState {
                terminated: Some(ContainerStateTerminated {
                    exit_code: code,
                    reason: Some(reason.into()),
                    message: Some(message.into()),
                    ..Default::default()
                }),
                ..Default::default()
            },
        )
    }

    fn error_of(pod: &Pod) -> Error {
        start_error(&readiness(pod), "img:1", "/w").expect("an error")
    }

    #[test]
    fn image_problems_fail_at_once_naming_the_image_and_the_reason() {
        for reason in ["ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull"] {
            let e = error_of(&waiting(reason, "not present"));
            assert_eq!(e.kind(), ErrorKind::NotFound, "{reason}");
            assert_eq!(e.field(), Some("image"), "{reason}");
            assert_eq!(e.context_value("image"), Some("img:1"));
            assert_eq!(e.context_value("reason"), Some(reason));
            assert!(e.message().contains("img:1") && e.message().contains(reason));
        }
        let e = error_of(&waiting("InvalidImageName", "couldn't parse image name"));
        assert_eq!(
            (e.kind(), e.field()),
            (ErrorKind::InvalidSpec, Some("image"))
        );
        assert!(e.message().contains("img:1") && e.message().contains("InvalidImageName"));
        let e = error_of(&waiting("CreateContainerConfigError", "secret missing"));
        assert_eq!(e.kind(), ErrorKind::StartFailed);
        assert!(
            e.message()
                .contains("CreateContainerConfigError: secret missing")
        );
        // Still on its way.
        for reason in ["ContainerCreating", "PodInitializing"] {
            assert_eq!(readiness(&waiting(reason, "")), Readiness::Pending);
        }
    }

    #[test]
    fn a_keep_alive_that_exited_is_an_error_with_its_code_and_log_tail() {
        // Even while the phase still says Running (the status lags the container).
        for phase in ["Running", "Failed", "Pending"] {
            let e = error_of(&terminated(
                phase,
                1,
                "Error",
                "sleep: invalid number 'infinity'\n",
            ));
            assert_eq!(e.kind(), ErrorKind::StartFailed, "{phase}");
            assert_eq!(e.context_value("exit_code"), Some("1"));
            assert_eq!(
                e.context_value("log"),
                Some("sleep: invalid number 'infinity'")
            );
            assert!(e.message().contains("exited at once with code 1"), "{e}");
        }
        let e = error_of(&terminated(
            "Failed",
            127,
            "StartError",
            "exec: \"sleep\": executable file not found in $PATH",
        ));
        assert_eq!(
            (e.kind(), e.field()),
            (ErrorKind::StartFailed, Some("image"))
        );
        assert!(e.message().contains("has no `sleep infinity`"), "{e}");
        let e = error_of(&terminated(
            "Failed",
            127,
            "Error",
            "[FATAL tini (7)] exec sleep failed: No such file or directory\n",
        ));
        assert_eq!(e.field(), Some("image"));
        assert_eq!(e.context_value("exit_code"), Some("127"));
        let e = error_of(&terminated(
            "Failed",
            128,
            "StartError",
            "runc create failed: chdir to cwd (\"/root/w\") set in config.json failed: permission denied",
        ));
        assert_eq!(
            (e.kind(), e.field()),
            (ErrorKind::NotFound, Some("working_dir"))
        );
    }

    #[test]
    fn only_a_running_container_in_a_running_pod_is_ready() {
        let running = ContainerState {
            running: Some(ContainerStateRunning::default()),
            ..Default::default()
        };
        assert_eq!(
            readiness(&pod("Running", running.clone())),
            Readiness::Ready
        );
        assert_eq!(readiness(&pod("Pending", running)), Readiness::Pending);
        assert!(matches!(
            readiness(&Pod {
                status: Some(PodStatus {
                    phase: Some("Failed".into()),
                    reason: Some("DeadlineExceeded".into()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            Readiness::Failed(m) if m.contains("DeadlineExceeded")
        ));
    }
}
