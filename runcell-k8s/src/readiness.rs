//! Where a starting pod stands, read from its status (watched, never polled): running,
//! still on its way, or failed for a reason that will not resolve by itself (an image that
//! cannot be used, a configuration the runtime rejects, a keep-alive that exited); the
//! typed error of each, with the pod's warning events; and what core is told of a pod that
//! did not answer its liveness exec ([`K8sDriver::diagnose_pod`]).

use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, Pod};
use kube::Api;
use kube::api::ListParams;
use kube::runtime::wait::await_condition;
use runcell_core::raw::Plan;
use runcell_core::{Error, ErrorKind, Progress, Result};

use crate::{CONTAINER, K8sDriver, KEEPALIVE};

const DEFAULT_READY_TIMEOUT: Duration = Duration::from_secs(120);
/// How long the pod's status may lag a failed liveness exec.
const STATUS_SETTLE: Duration = Duration::from_secs(3);

impl K8sDriver {
    /// Waits (watch, not poll) until the pod of `plan` runs, or fails with what its status
    /// and events say as soon as they say it cannot (an image that cannot be used, a
    /// keep-alive that exited). Each new waiting state is reported as progress.
    pub(crate) async fn wait_ready(&self, plan: &Plan<'_>) -> Result<()> {
        let (id, image) = (plan.id.as_str(), plan.spec.image.as_str());
        let working_dir = plan.spec.effective_working_dir();
        let timeout = self.config.ready_timeout.unwrap_or(DEFAULT_READY_TIMEOUT);
        plan.report(Progress::Step("waiting for the pod to run".into()));
        let reported = Mutex::new(None);
        let wait_unschedulable = self.config.wait_unschedulable;
        let cond = |pod: Option<&Pod>| {
            let Some(pod) = pod else { return true };
            if !matches!(readiness(pod), Readiness::Pending) {
                return true;
            }
            if !wait_unschedulable && limit_reached(pod).is_some() {
                return true;
            }
            let state = waiting_state(pod);
            let mut reported = reported.lock().unwrap_or_else(|p| p.into_inner());
            if reported.as_ref() != Some(&state) {
                plan.report(Progress::Waiting {
                    phase: state.0.clone(),
                    reason: state.1.clone(),
                });
                *reported = Some(state);
            }
            false
        };
        let waiting = tokio::time::timeout(timeout, await_condition(self.pods(), id, cond));
        // A workspace claim that cannot bind fails the wait as soon as it says so.
        let claim = self.workspace_claim(id);
        let waited = match &claim {
            None => waiting.await,
            Some(claim) => tokio::select! {
                waited = waiting => waited,
                e = self.claim_failure(claim) => return Err(self.with_events(e, id).await),
            },
        };
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
                let unbound = match &claim {
                    Some(claim) => self.unbound_claim(claim).await.map(|text| (claim, text)),
                    None => None,
                };
                let e = match &unbound {
                    Some((claim, text)) => Error::new(
                        ErrorKind::Timeout,
                        format!(
                            "the pod did not run within {timeout:?}: {text}; the pod: {why}{}",
                            self.events(id).await
                        ),
                    )
                    .with_field(claim.field())
                    .with("claim", &claim.name),
                    None => Error::new(
                        ErrorKind::Timeout,
                        format!(
                            "the pod did not run within {timeout:?}: {why}{}",
                            self.events(id).await
                        ),
                    ),
                };
                return Err(e.with("run", id));
            }
        };
        let Some(pod) = pod else {
            return Err(
                Error::new(ErrorKind::RunLost, "the pod was deleted while starting")
                    .with("run", id),
            );
        };
        if let Some((limit, message)) = limit_reached(&pod) {
            return Err(Error::new(
                ErrorKind::LimitReached,
                format!("the pod cannot run: {limit} reached ({message})"),
            )
            .with("limit", limit)
            .with("run", id));
        }
        match start_error(&readiness(&pod), image, working_dir) {
            None => Ok(()),
            Some(e) => Err(self.with_events(e, id).await),
        }
    }

    /// What the pod's status says of a run that did not answer core's liveness exec: why
    /// the keep-alive ended (`pod`), its `exit_code`, `reason` and `log` tail (the
    /// termination message), and the pod's warning `events`. The status may lag the failed
    /// exec by a moment: this waits up to [`STATUS_SETTLE`] for the pod to stop running.
    pub(crate) async fn diagnose_pod(&self, id: &str) -> Vec<(&'static str, String)> {
        let stopped = |pod: Option<&Pod>| pod.is_none_or(|p| !is_ready(p));
        let settled =
            tokio::time::timeout(STATUS_SETTLE, await_condition(self.pods(), id, stopped)).await;
        // `Some(None)`: the pod is gone; `None`: unknown (the API did not answer).
        let pod = match settled {
            Ok(Ok(pod)) => Some(pod),
            _ => self.pods().get_opt(id).await.ok(),
        };
        let mut found = Vec::new();
        match &pod {
            None => {}
            Some(None) => found.push(("pod", "deleted while starting".to_string())),
            Some(Some(pod)) => {
                let container = pod
                    .spec
                    .iter()
                    .flat_map(|s| s.containers.iter())
                    .find(|c| c.name == CONTAINER);
                let image = container.and_then(|c| c.image.as_deref()).unwrap_or("");
                let working_dir = container
                    .and_then(|c| c.working_dir.as_deref())
                    .unwrap_or("/");
                if let Some(e) = start_error(&readiness(pod), image, working_dir) {
                    found.push(("pod", e.message().to_string()));
                    found.extend(e.context().iter().filter(|(k, _)| *k != "image").cloned());
                }
            }
        }
        if let Some(events) = self.event_lines(id).await {
            found.push(("events", events));
        }
        found
    }

    /// A [`ErrorKind::RunLost`] error with what the cluster says of the pod: why the
    /// kubelet ended it (evicted for its disk or memory use, its container's exit and
    /// reason), or that it is gone. The kubelet records why a moment after the containers
    /// are gone: this waits up to [`STATUS_SETTLE`] for the pod to end.
    pub(crate) async fn why_lost(&self, id: &str, e: Error) -> Error {
        let ended = |pod: Option<&Pod>| {
            pod.is_none_or(|p| {
                p.metadata.deletion_timestamp.is_some()
                    || p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Failed")
                    || p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Succeeded")
            })
        };
        let settled =
            tokio::time::timeout(STATUS_SETTLE, await_condition(self.pods(), id, ended)).await;
        let pod = match settled {
            Ok(Ok(pod)) => Some(pod),
            _ => tokio::time::timeout(STATUS_SETTLE, self.pods().get_opt(id))
                .await
                .ok()
                .and_then(|r| r.ok()),
        };
        match pod {
            Some(None) => e.with_detail("the pod is gone"),
            Some(Some(pod)) => match why_not_running(&pod) {
                Some(why) => e.with_detail(why),
                None => e,
            },
            None => e,
        }
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
        match self.event_lines(id).await {
            Some(lines) => format!("; events: {lines}"),
            None => String::new(),
        }
    }

    /// The pod's last five warning events, newest first, if it has any.
    async fn event_lines(&self, id: &str) -> Option<String> {
        let events: Api<Event> = Api::namespaced(self.client.clone(), &self.namespace);
        let params = ListParams::default().fields(&format!("involvedObject.name={id}"));
        let list = events.list(&params).await.ok()?;
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
        (!lines.is_empty()).then(|| lines.join(" | "))
    }
}

fn is_warning(e: &Event) -> bool {
    e.type_.as_deref() == Some("Warning")
}

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

/// What the pod's status says of why it or its container does not run: the pod's
/// reason and message (`Evicted: Pod ephemeral local storage usage exceeds ...`), its
/// phase, the container's termination (reason, exit code, message); `None` when it says
/// nothing.
pub(crate) fn why_not_running(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref()?;
    let mut parts = Vec::new();
    if pod.metadata.deletion_timestamp.is_some() {
        parts.push("the pod is being deleted".to_string());
    }
    if let Some(phase) = status.phase.as_deref().filter(|p| *p != "Running") {
        parts.push(format!("pod phase {phase}"));
    }
    let said = |reason: Option<&str>, message: Option<&str>| {
        let reason = reason.unwrap_or("").trim();
        let message = message.unwrap_or("").trim();
        match (reason.is_empty(), message.is_empty()) {
            (true, true) => None,
            (false, true) => Some(reason.to_string()),
            (true, false) => Some(message.to_string()),
            (false, false) => Some(format!("{reason}: {message}")),
        }
    };
    if let Some(pod_said) = said(status.reason.as_deref(), status.message.as_deref()) {
        parts.push(pod_said);
    }
    let terminated = status
        .container_statuses
        .iter()
        .flatten()
        .find(|c| c.name == CONTAINER)
        .and_then(|c| c.state.as_ref())
        .and_then(|s| s.terminated.as_ref());
    if let Some(t) = terminated {
        let mut line = format!("container exited with code {}", t.exit_code);
        if let Some(more) = said(t.reason.as_deref(), t.message.as_deref()) {
            line.push_str(&format!(" ({more})"));
        }
        parts.push(line);
    }
    (!parts.is_empty()).then(|| parts.join("; "))
}

/// True when the pod and its container run.
pub(crate) fn is_ready(pod: &Pod) -> bool {
    matches!(readiness(pod), Readiness::Ready)
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

/// The limit a pod that cannot run ran into, and what the cluster said: the scheduler
/// places it on no node for lack of pod slots (`Too many pods`: the kubelet's `maxPods`)
/// or of a resource (`Insufficient memory`), or the kubelet refused it at admission
/// (`OutOfpods`, `OutOfmemory`, ...). `None` for any other state.
fn limit_reached(pod: &Pod) -> Option<(String, String)> {
    let status = pod.status.as_ref()?;
    // The kubelet's admission: the pod failed at once.
    if status.phase.as_deref() == Some("Failed")
        && let Some(resource) = status.reason.as_deref()?.strip_prefix("OutOf")
    {
        let message = status.message.clone().unwrap_or_default();
        return Some((node_limit(resource), message));
    }
    let unschedulable = status.conditions.iter().flatten().find(|c| {
        c.type_ == "PodScheduled"
            && c.status == "False"
            && c.reason.as_deref() == Some("Unschedulable")
    })?;
    let message = unschedulable.message.clone().unwrap_or_default();
    if message.contains("Too many pods") {
        return Some((node_limit("pods"), message));
    }
    let resource = message
        .split("Insufficient ")
        .nth(1)?
        .split(|c: char| c == '.' || c == ',' || c.is_whitespace())
        .next()
        .filter(|r| !r.is_empty())?;
    Some((node_limit(resource), message))
}

/// The name of a node's limit on `resource` (`pods`, `memory`, `cpu`, ...).
fn node_limit(resource: &str) -> String {
    if resource == "pods" {
        "the node's pod limit (kubelet maxPods)".into()
    } else {
        format!("the node's allocatable {resource}")
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
            .with("registry", runcell_core::registry_of(image))
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

/// A pending pod's state for progress: the container's waiting reason (`ContainerCreating`,
/// `ErrImagePull`) or the pod's phase, and the latest reason given.
fn waiting_state(pod: &Pod) -> (String, Option<String>) {
    let waiting = pod
        .status
        .iter()
        .flat_map(|s| s.container_statuses.iter().flatten())
        .find(|c| c.name == CONTAINER)
        .and_then(|c| c.state.as_ref()?.waiting.as_ref());
    if let Some(w) = waiting
        && let Some(reason) = &w.reason
    {
        return (reason.clone(), w.message.clone().filter(|m| !m.is_empty()));
    }
    let phase = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.clone())
        .unwrap_or_else(|| "Pending".into());
    let condition = pod
        .status
        .iter()
        .flat_map(|s| s.conditions.iter().flatten())
        .find(|c| c.status == "False" && c.reason.is_some())
        .map(|c| {
            format!(
                "{} {}: {}",
                c.type_,
                c.reason.as_deref().unwrap_or(""),
                c.message.as_deref().unwrap_or("")
            )
        });
    (phase, condition)
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

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{
        ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStateWaiting,
        ContainerStatus, PodCondition, PodStatus,
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

    #[test]
    fn why_a_pod_stopped_says_the_kubelets_reason() {
        let mut evicted = pod(
            "Failed",
            ContainerState {
                terminated: Some(ContainerStateTerminated {
                    exit_code: 137,
                    reason: Some("ContainerStatusUnknown".into()),
                    ..Default::default()
                }),
                ..Default::default()
            },
        );
        let status = evicted.status.as_mut().unwrap();
        status.reason = Some("Evicted".into());
        status.message = Some(
            "Pod ephemeral local storage usage exceeds the total limit of containers 16Mi. ".into(),
        );
        assert_eq!(
            why_not_running(&evicted).unwrap(),
            "pod phase Failed; Evicted: Pod ephemeral local storage usage exceeds the total \
             limit of containers 16Mi.; container exited with code 137 (ContainerStatusUnknown)"
        );
        let running = pod(
            "Running",
            ContainerState {
                running: Some(ContainerStateRunning::default()),
                ..Default::default()
            },
        );
        assert_eq!(why_not_running(&running), None);
    }

    /// A pending pod the scheduler places on no node, saying `message`.
    fn unschedulable(message: &str) -> Pod {
        Pod {
            status: Some(PodStatus {
                phase: Some("Pending".into()),
                conditions: Some(vec![PodCondition {
                    type_: "PodScheduled".into(),
                    status: "False".into(),
                    reason: Some("Unschedulable".into()),
                    message: Some(message.into()),
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
    fn progress_names_the_waiting_reason_or_the_phase_and_condition() {
        assert_eq!(
            waiting_state(&waiting("ContainerCreating", "")),
            ("ContainerCreating".to_string(), None)
        );
        assert_eq!(
            waiting_state(&waiting("ErrImagePull", "not present")),
            ("ErrImagePull".to_string(), Some("not present".to_string()))
        );
        assert_eq!(
            waiting_state(&unschedulable("0/1 nodes are available")),
            (
                "Pending".to_string(),
                Some("PodScheduled Unschedulable: 0/1 nodes are available".to_string())
            )
        );
        assert_eq!(
            waiting_state(&Pod::default()),
            ("Pending".to_string(), None)
        );
    }

    #[test]
    fn a_pod_no_node_has_room_for_names_the_limit_it_ran_into() {
        let limit = |pod: &Pod| limit_reached(pod).map(|(limit, _)| limit);
        assert_eq!(
            limit(&unschedulable(
                "0/1 nodes are available: 1 Too many pods. preemption: 0/1 nodes are available: 1 No preemption victims found for incoming pod."
            )),
            Some("the node's pod limit (kubelet maxPods)".into())
        );
        assert_eq!(
            limit(&unschedulable(
                "0/1 nodes are available: 1 Insufficient memory. preemption: ..."
            )),
            Some("the node's allocatable memory".into())
        );
        assert_eq!(
            limit(&unschedulable(
                "0/2 nodes are available: 1 Insufficient cpu, 1 node(s) had untolerated taint."
            )),
            Some("the node's allocatable cpu".into())
        );
        // Not a limit: a selector or a taint no node matches waits (or times out).
        assert_eq!(
            limit(&unschedulable(
                "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector."
            )),
            None
        );
        assert_eq!(limit(&Pod::default()), None);
        // The kubelet's admission refused it.
        let admitted = Pod {
            status: Some(PodStatus {
                phase: Some("Failed".into()),
                reason: Some("OutOfpods".into()),
                message: Some("Node didn't have enough resource: pods".into()),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(
            limit_reached(&admitted),
            Some((
                "the node's pod limit (kubelet maxPods)".into(),
                "Node didn't have enough resource: pods".into()
            ))
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
