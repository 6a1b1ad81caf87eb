//! The pure translation of a [`RunSpec`] into the objects of one run: the Pod and, when a
//! CA bundle is given, the Secret that carries it.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{
    Capabilities, Container, EmptyDirVolumeSource, EnvVar, LocalObjectReference,
    PersistentVolumeClaim, PersistentVolumeClaimSpec, PersistentVolumeClaimVolumeSource, Pod,
    PodSecurityContext, PodSpec, ResourceRequirements, SeccompProfile, Secret, SecretVolumeSource,
    SecurityContext, Toleration, Volume, VolumeMount, VolumeResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use runcell_core::{Error, PullPolicy, Result, RunSpec, ca};

/// The name of the workload container.
pub const CONTAINER: &str = "sandbox";
/// The kept-alive process (core's, the same for every driver). The image's ENTRYPOINT and
/// CMD are never run.
pub use runcell_core::raw::KEEPALIVE;
/// Where the CA Secret is mounted (read-only); the bundle is built from it into [`ca::DIR`].
pub const CA_SECRET_MOUNT: &str = "/etc/sandbox-ca";
/// The key of the CA Secret, so the file's name under [`CA_SECRET_MOUNT`].
pub const CA_SECRET_KEY: &str = "ca.pem";
/// The pod annotation that records the run's host workspace directory (empty on a pooled
/// pod until a claim sets it).
pub const HOST_DIR_ANNOTATION: &str = "sandbox.dev/host-dir";
/// The pod annotation a claim sets to a token of its own: a claim whose response was lost
/// (a retried request, a dropped connection) finds out it won.
pub const CLAIM_ANNOTATION: &str = "sandbox.dev/claim";
/// Grace period of the pod: PID 1 is `sleep`, which ignores SIGTERM.
pub const TERMINATION_GRACE_SECONDS: i64 = 1;

/// The pod-level settings of the driver that are not part of a run's spec.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PodTemplate {
    /// `runtimeClassName` (gVisor, Kata, ...).
    pub runtime_class: Option<String>,
    /// `nodeSelector`.
    pub node_selector: BTreeMap<String, String>,
    /// `tolerations`.
    pub tolerations: Vec<Toleration>,
    /// Extra labels on every pod (the run's own labels win).
    pub labels: BTreeMap<String, String>,
    /// Extra annotations on every pod.
    pub annotations: BTreeMap<String, String>,
    /// `imagePullSecrets`: names of `kubernetes.io/dockerconfigjson` Secrets in the run's
    /// namespace, for images from private registries.
    pub image_pull_secrets: Vec<String>,
}

/// The name of the Secret carrying a run's CA bundle.
pub fn ca_secret_name(run_id: &str) -> String {
    format!("{run_id}-ca")
}

/// The name of a run's own workspace claim ([`crate::WorkspaceVolume::PerRun`]).
pub fn workspace_claim_name(run_id: &str) -> String {
    format!("{run_id}-ws")
}

/// The name of the pod's workspace volume (and of its mount).
pub const WORKSPACE_VOLUME: &str = "workspace";

/// The label (value `true`) of a per-run workspace claim that stays after the run
/// (`keep`): no owner, not deleted with the run; the user deletes it.
pub const WORKSPACE_KEPT_LABEL: &str = "sandbox.dev/workspace-kept";

/// Puts the pod's workspace on the PersistentVolumeClaim `claim` instead of its
/// `emptyDir`, at the same mount path.
pub fn workspace_on_claim(pod: &mut Pod, claim: &str) {
    let Some(spec) = pod.spec.as_mut() else {
        return;
    };
    for volume in spec.volumes.iter_mut().flatten() {
        if volume.name == WORKSPACE_VOLUME {
            *volume = Volume {
                name: WORKSPACE_VOLUME.into(),
                persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                    claim_name: claim.into(),
                    read_only: None,
                }),
                ..Default::default()
            };
        }
    }
}

/// A pod of a run from a snapshot: its workspace at `path` is the image's (the snapshot
/// carries it; no volume over it, copy on write like the rest of the image), recorded in
/// an annotation, and its image, named by digest, is pulled when the node lacks it.
pub fn workspace_in_image(pod: &mut Pod, path: &str) {
    pod.metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert(crate::snapshot::WORKSPACE_ANNOTATION.into(), path.into());
    let Some(spec) = pod.spec.as_mut() else {
        return;
    };
    if let Some(volumes) = spec.volumes.as_mut() {
        volumes.retain(|v| v.name != WORKSPACE_VOLUME);
    }
    for c in &mut spec.containers {
        if let Some(mounts) = c.volume_mounts.as_mut() {
            mounts.retain(|m| m.name != WORKSPACE_VOLUME);
        }
        c.image_pull_policy = Some("IfNotPresent".into());
    }
}

/// The claim a pod's workspace is on, if it is on one.
pub fn workspace_claim_of(pod: &Pod) -> Option<&str> {
    pod.spec
        .iter()
        .flat_map(|s| s.volumes.iter().flatten())
        .find(|v| v.name == WORKSPACE_VOLUME)?
        .persistent_volume_claim
        .as_ref()
        .map(|c| c.claim_name.as_str())
}

/// A run's own workspace claim ([`workspace_claim_name`]): `labels` are the run's (as on
/// its CA Secret), plus [`WORKSPACE_KEPT_LABEL`] when `owner` is `None`; `owner` is the
/// pod's `(name, uid)`, whose deletion then deletes the claim (garbage collection).
/// `ReadWriteOnce`, `size` requested. Pure: snapshotted in tests.
pub fn workspace_claim(
    run_id: &str,
    namespace: &str,
    labels: &BTreeMap<String, String>,
    storage_class: Option<&str>,
    size: &str,
    owner: Option<(&str, &str)>,
) -> PersistentVolumeClaim {
    let mut labels = labels.clone();
    if owner.is_none() {
        labels.insert(WORKSPACE_KEPT_LABEL.into(), "true".into());
    }
    PersistentVolumeClaim {
        metadata: ObjectMeta {
            name: Some(workspace_claim_name(run_id)),
            namespace: Some(namespace.into()),
            labels: Some(labels),
            owner_references: owner.map(|(name, uid)| {
                vec![OwnerReference {
                    api_version: "v1".into(),
                    kind: "Pod".into(),
                    name: name.into(),
                    uid: uid.into(),
                    block_owner_deletion: Some(false),
                    controller: None,
                }]
            }),
            ..Default::default()
        },
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec!["ReadWriteOnce".into()]),
            resources: Some(VolumeResourceRequirements {
                requests: Some(BTreeMap::from([(
                    "storage".to_string(),
                    Quantity(size.into()),
                )])),
                ..Default::default()
            }),
            storage_class_name: storage_class.map(String::from),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The objects of a run: its Pod and, when `ca_pem` is given (the spec's CA bundle, parsed
/// and normalized), the CA Secret that carries it. `labels` are the run's full labels; the
/// container's env is [`RunSpec::run_env`]. Errors only for what Kubernetes cannot express
/// (a non-numeric user). Pure: snapshotted in tests.
pub fn run_objects(
    spec: &RunSpec,
    run_id: &str,
    namespace: &str,
    labels: &BTreeMap<String, String>,
    ca_pem: Option<&str>,
    template: &PodTemplate,
) -> Result<(Pod, Option<Secret>)> {
    let (run_as_user, run_as_group) = match spec.user.as_deref() {
        None => (None, None),
        Some(user) => parse_user(user)?,
    };
    let mut pod_labels = template.labels.clone();
    pod_labels.extend(labels.clone());
    let mut annotations = template.annotations.clone();
    if let Some(dir) = &spec.workspace.host_dir {
        // So that a driver attaching later can still sync the workspace back.
        annotations.insert(HOST_DIR_ANNOTATION.into(), dir.display().to_string());
    } else if labels.contains_key(runcell_core::labels::POOL) {
        // Empty until a claim sets it (a JSON patch adds a member only under an existing
        // map).
        annotations.insert(HOST_DIR_ANNOTATION.into(), String::new());
    }

    let mut volumes = vec![Volume {
        name: WORKSPACE_VOLUME.into(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Default::default()
    }];
    let mut mounts = vec![VolumeMount {
        name: WORKSPACE_VOLUME.into(),
        mount_path: spec.workspace.path.clone(),
        ..Default::default()
    }];
    // The exec helper's place (core writes it through an exec after start): writable by
    // any user, under a read-only root too.
    volumes.push(Volume {
        name: "runcell-helper".into(),
        empty_dir: Some(EmptyDirVolumeSource {
            size_limit: Some(k8s_openapi::apimachinery::pkg::api::resource::Quantity(
                "16Mi".into(),
            )),
            ..Default::default()
        }),
        ..Default::default()
    });
    mounts.push(VolumeMount {
        name: "runcell-helper".into(),
        mount_path: runcell_core::HELPER_DIR.into(),
        ..Default::default()
    });
    let secret = ca_pem.map(|pem| Secret {
        metadata: ObjectMeta {
            name: Some(ca_secret_name(run_id)),
            namespace: Some(namespace.into()),
            labels: Some(labels.clone()),
            ..Default::default()
        },
        data: Some(BTreeMap::from([(
            CA_SECRET_KEY.to_string(),
            ByteString(pem.as_bytes().to_vec()),
        )])),
        type_: Some("Opaque".into()),
        ..Default::default()
    });
    if secret.is_some() {
        volumes.push(Volume {
            name: "sandbox-ca".into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(ca_secret_name(run_id)),
                default_mode: Some(0o444),
                ..Default::default()
            }),
            ..Default::default()
        });
        mounts.push(VolumeMount {
            name: "sandbox-ca".into(),
            mount_path: CA_SECRET_MOUNT.into(),
            read_only: Some(true),
            ..Default::default()
        });
        // Writable under a read-only root: the bundle is assembled here at start.
        volumes.push(Volume {
            name: "sandbox-etc".into(),
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..Default::default()
        });
        mounts.push(VolumeMount {
            name: "sandbox-etc".into(),
            mount_path: ca::DIR.into(),
            ..Default::default()
        });
    }
    if spec.security.read_only_rootfs {
        volumes.push(Volume {
            name: "tmp".into(),
            empty_dir: Some(EmptyDirVolumeSource {
                medium: Some("Memory".into()),
                ..Default::default()
            }),
            ..Default::default()
        });
        mounts.push(VolumeMount {
            name: "tmp".into(),
            mount_path: "/tmp".into(),
            ..Default::default()
        });
    }

    let mut limits = BTreeMap::new();
    if let Some(bytes) = spec.resources.memory_bytes {
        limits.insert("memory".to_string(), Quantity(bytes.to_string()));
    }
    if let Some(bytes) = spec.resources.disk_bytes {
        // The kubelet evicts the pod when its writable layer, logs and disk-backed
        // emptyDir volumes (the workspace) use more.
        limits.insert("ephemeral-storage".to_string(), Quantity(bytes.to_string()));
    }
    if let Some(cpus) = spec.resources.cpus {
        limits.insert(
            "cpu".to_string(),
            Quantity(format!("{}m", (cpus * 1000.0).round() as u64)),
        );
    }

    let container = Container {
        name: CONTAINER.into(),
        // A hex name (`5`) is written out in full: the node's runtime would otherwise
        // take it for the prefix of any local image's ID.
        image: Some(if runcell_core::could_be_id_prefix(&spec.image) {
            runcell_core::qualified_name(&spec.image)
        } else {
            spec.image.clone()
        }),
        image_pull_policy: Some(
            match spec.pull {
                PullPolicy::Always => "Always",
                PullPolicy::IfNotPresent => "IfNotPresent",
                PullPolicy::Never => "Never",
            }
            .into(),
        ),
        command: Some(KEEPALIVE.iter().map(|s| s.to_string()).collect()),
        args: Some(Vec::new()),
        working_dir: Some(spec.effective_working_dir().to_string()),
        env: Some(
            spec.run_env()
                .into_iter()
                .map(|(name, value)| EnvVar {
                    name,
                    value: Some(value),
                    ..Default::default()
                })
                .collect(),
        ),
        resources: (!limits.is_empty()).then(|| ResourceRequirements {
            limits: Some(limits.clone()),
            requests: Some(limits),
            ..Default::default()
        }),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(!spec.security.no_new_privileges),
            capabilities: (!spec.security.cap_drop.is_empty()).then(|| Capabilities {
                drop: Some(spec.security.cap_drop.clone()),
                ..Default::default()
            }),
            read_only_root_filesystem: spec.security.read_only_rootfs.then_some(true),
            run_as_user,
            run_as_group,
            ..Default::default()
        }),
        volume_mounts: Some(mounts),
        stdin: Some(false),
        tty: Some(false),
        // A keep-alive that fails at once carries its log tail in its terminated state,
        // readable with the pod (no `pods/log` permission needed).
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        ..Default::default()
    };

    let pod = Pod {
        metadata: ObjectMeta {
            name: Some(run_id.into()),
            namespace: Some(namespace.into()),
            labels: Some(pod_labels),
            annotations: (!annotations.is_empty()).then_some(annotations),
            ..Default::default()
        },
        spec: Some(PodSpec {
            containers: vec![container],
            restart_policy: Some("Never".into()),
            automount_service_account_token: Some(false),
            enable_service_links: Some(false),
            // The pause container becomes PID 1 and reaps orphans of exec'd processes.
            share_process_namespace: Some(true),
            termination_grace_period_seconds: Some(TERMINATION_GRACE_SECONDS),
            // The API accepts 1..=2^31-1 seconds (68 years).
            active_deadline_seconds: spec
                .ttl
                .map(|t| t.as_secs().clamp(1, i32::MAX as u64) as i64),
            runtime_class_name: template.runtime_class.clone(),
            node_selector: (!template.node_selector.is_empty())
                .then(|| template.node_selector.clone()),
            tolerations: (!template.tolerations.is_empty()).then(|| template.tolerations.clone()),
            image_pull_secrets: (!template.image_pull_secrets.is_empty()).then(|| {
                template
                    .image_pull_secrets
                    .iter()
                    .map(|name| LocalObjectReference { name: name.clone() })
                    .collect()
            }),
            security_context: Some(PodSecurityContext {
                seccomp_profile: Some(SeccompProfile {
                    type_: "RuntimeDefault".into(),
                    ..Default::default()
                }),
                fs_group: run_as_group,
                ..Default::default()
            }),
            volumes: Some(volumes),
            ..Default::default()
        }),
        ..Default::default()
    };
    Ok((pod, secret))
}

/// `uid` or `uid:gid`; a name cannot be resolved by Kubernetes.
fn parse_user(user: &str) -> Result<(Option<i64>, Option<i64>)> {
    let bad = || {
        Error::invalid_spec(
            "user",
            format!("{user:?}: Kubernetes needs a numeric uid or uid:gid, not a name"),
        )
    };
    let (u, g) = match user.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (user, None),
    };
    let uid = u.parse::<i64>().map_err(|_| bad())?;
    let gid = g.map(|g| g.parse::<i64>().map_err(|_| bad())).transpose()?;
    Ok((Some(uid), gid))
}

/// Gives a pooled pod a writable [`ca::DIR`] (an `emptyDir`), where the CA files go after
/// the claim whatever the user, under a read-only root too. A no-op when it has one.
pub fn add_ca_dir(pod: &mut Pod) {
    let Some(spec) = pod.spec.as_mut() else {
        return;
    };
    let Some(container) = spec.containers.iter_mut().find(|c| c.name == CONTAINER) else {
        return;
    };
    let mounts = container.volume_mounts.get_or_insert_with(Vec::new);
    if mounts.iter().any(|m| m.mount_path == ca::DIR) {
        return;
    }
    mounts.push(VolumeMount {
        name: "sandbox-etc".into(),
        mount_path: ca::DIR.into(),
        ..Default::default()
    });
    spec.volumes.get_or_insert_with(Vec::new).push(Volume {
        name: "sandbox-etc".into(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Default::default()
    });
}

/// The JSON patch (RFC 6902) of a pool claim: it tests that the pod is still ready, takes
/// off the `stale` labels, sets `labels`, the claim's `token` ([`CLAIM_ANNOTATION`]) and,
/// with a host workspace directory, its annotation. What it does not name (labels and annotations of the template or of an
/// admission webhook) stays. The test fails (the API server answers 422) once any other
/// claim won.
pub fn claim_patch(
    stale: &[String],
    labels: &BTreeMap<String, String>,
    host_dir: Option<&std::path::Path>,
    token: &str,
) -> Result<json_patch::Patch> {
    let pointer = |map: &str, key: &str| {
        format!(
            "/metadata/{map}/{}",
            key.replace('~', "~0").replace('/', "~1")
        )
    };
    let mut ops = vec![serde_json::json!({
        "op": "test",
        "path": pointer("labels", runcell_core::labels::POOL_STATE),
        "value": runcell_core::labels::POOL_READY,
    })];
    for key in stale {
        ops.push(serde_json::json!({ "op": "remove", "path": pointer("labels", key) }));
    }
    for (key, value) in labels {
        // `add` on a member that exists replaces it.
        ops.push(
            serde_json::json!({ "op": "add", "path": pointer("labels", key), "value": value }),
        );
    }
    // Pooled pods carry annotations (the host directory's, empty), so their map exists.
    ops.push(serde_json::json!({
        "op": "add",
        "path": pointer("annotations", CLAIM_ANNOTATION),
        "value": token,
    }));
    if let Some(dir) = host_dir {
        ops.push(serde_json::json!({
            "op": "add",
            "path": pointer("annotations", HOST_DIR_ANNOTATION),
            "value": dir.display().to_string(),
        }));
    }
    serde_json::from_value(serde_json::Value::Array(ops)).map_err(|e| {
        Error::new(
            runcell_core::ErrorKind::Backend,
            "cannot build the claim patch",
        )
        .with_source(e)
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use runcell_core::{ErrorKind, Proxy};

    use super::*;

    fn labels(spec: &RunSpec) -> BTreeMap<String, String> {
        runcell_core::labels::fixed_for_snapshots(&spec.labels, spec.ttl)
    }

    #[test]
    fn minimal_spec() {
        let spec = RunSpec::new("busybox:1.36");
        let (pod, secret) = run_objects(
            &spec,
            "sbx-000000000001",
            "default",
            &labels(&spec),
            None,
            &PodTemplate::default(),
        )
        .unwrap();
        assert!(secret.is_none());
        insta::assert_yaml_snapshot!(pod);
    }

    #[test]
    fn full_spec() {
        let mut spec = RunSpec::new("registry.example/tools:2")
            .env("A", "1")
            .label("team", "agents")
            .post_create(["make", "setup"]);
        spec.workspace.path = "/src".into();
        spec.working_dir = Some("/src/app".into());
        spec.user = Some("1000:1000".into());
        spec.proxy = Proxy {
            http: Some("http://proxy:3128".into()),
            https: None,
            no_proxy: vec!["internal".into()],
        };
        spec.ca_bundle = Some("(pem)".into());
        spec.resources.memory_bytes = Some(512 << 20);
        spec.resources.cpus = Some(1.5);
        spec.resources.disk_bytes = Some(1 << 30);
        spec.security.cap_drop = vec!["ALL".into()];
        spec.security.read_only_rootfs = true;
        spec.ttl = Some(Duration::from_secs(3600));
        spec.pull = PullPolicy::Never;
        let template = PodTemplate {
            runtime_class: Some("gvisor".into()),
            node_selector: BTreeMap::from([("pool".into(), "sandboxes".into())]),
            tolerations: vec![Toleration {
                key: Some("sandbox".into()),
                operator: Some("Exists".into()),
                effect: Some("NoSchedule".into()),
                ..Default::default()
            }],
            labels: BTreeMap::from([
                ("team".into(), "overridden-by-run".into()),
                ("cost-center".into(), "ai".into()),
            ]),
            annotations: BTreeMap::from([("example.com/note".into(), "x".into())]),
            image_pull_secrets: vec!["registry-a".into(), "registry-b".into()],
        };
        let (pod, secret) = run_objects(
            &spec,
            "sbx-000000000001",
            "agents",
            &labels(&spec),
            spec.ca_bundle.as_deref(),
            &template,
        )
        .unwrap();
        insta::assert_yaml_snapshot!("full_spec_pod", pod);
        insta::assert_yaml_snapshot!("full_spec_secret", secret);
    }

    /// The workspace on an existing claim: the same mount, the volume a claim.
    #[test]
    fn claim_workspace_pod() {
        let spec = RunSpec::new("busybox:1.36").workspace_path("/src");
        let (mut pod, _) = run_objects(
            &spec,
            "sbx-000000000001",
            "default",
            &labels(&spec),
            None,
            &PodTemplate::default(),
        )
        .unwrap();
        assert_eq!(workspace_claim_of(&pod), None);
        workspace_on_claim(&mut pod, "agent-cache");
        assert_eq!(workspace_claim_of(&pod), Some("agent-cache"));
        insta::assert_yaml_snapshot!(pod);
    }

    /// A run's own claim: the run's labels, owned by its pod (garbage collection deletes
    /// it with the pod); kept, it has no owner and says so in a label.
    #[test]
    fn per_run_claim() {
        let spec = RunSpec::new("busybox:1.36").label("team", "agents");
        let claim = workspace_claim(
            "sbx-000000000001",
            "agents",
            &labels(&spec),
            Some("fast"),
            "2Gi",
            Some(("sbx-000000000001", "0f6c2a8e-0000-4000-8000-000000000001")),
        );
        insta::assert_yaml_snapshot!(claim);

        let kept = workspace_claim(
            "sbx-000000000001",
            "agents",
            &labels(&spec),
            None,
            "2Gi",
            None,
        );
        let meta = &kept.metadata;
        assert_eq!(meta.owner_references, None);
        let kept_labels = meta.labels.clone().unwrap();
        assert_eq!(
            kept_labels.get(WORKSPACE_KEPT_LABEL).map(String::as_str),
            Some("true")
        );
        let mut without = kept_labels.clone();
        without.remove(WORKSPACE_KEPT_LABEL);
        assert_eq!(without, labels(&spec));
        assert_eq!(
            kept.spec.and_then(|s| s.storage_class_name),
            None,
            "no class given: the cluster's default"
        );
    }

    #[test]
    fn a_huge_ttl_is_the_largest_deadline_the_api_accepts() {
        let mut spec = RunSpec::new("x");
        for (ttl, want) in [
            (Duration::MAX, 2_147_483_647),
            (Duration::from_secs(u64::from(u32::MAX)), 2_147_483_647),
            (Duration::from_millis(10), 1),
        ] {
            spec.ttl = Some(ttl);
            let (pod, _) = run_objects(
                &spec,
                "sbx-1",
                "ns",
                &labels(&spec),
                None,
                &PodTemplate::default(),
            )
            .unwrap();
            let deadline = pod.spec.unwrap().active_deadline_seconds;
            assert_eq!(deadline, Some(want), "{ttl:?}");
        }
    }

    #[test]
    fn user_names_are_invalid_here() {
        let mut spec = RunSpec::new("x");
        spec.user = Some("nobody".into());
        let e = run_objects(
            &spec,
            "sbx-1",
            "ns",
            &labels(&spec),
            None,
            &PodTemplate::default(),
        )
        .unwrap_err();
        assert_eq!(
            (e.kind(), e.field()),
            (ErrorKind::InvalidSpec, Some("user"))
        );
        spec.user = Some("1000:staff".into());
        assert!(
            run_objects(
                &spec,
                "sbx-1",
                "ns",
                &labels(&spec),
                None,
                &PodTemplate::default()
            )
            .is_err()
        );
    }

    /// A claim turns a pooled pod's labels into the run's (a detached run without TTL: no
    /// owner, no expiry) and keeps what it does not know; a second claim fails its test.
    #[test]
    fn a_claim_patch_relabels_and_keeps_foreign_labels() {
        use runcell_core::labels::{self as l, Owner};
        let shape = RunSpec::new("img")
            .label("team", "a")
            .ttl(Duration::from_secs(600));
        let mut pooled = l::run_labels("sbx-1", Some(&Owner::current()), shape.ttl, &shape.labels);
        pooled.insert(l::POOL.into(), "k".into());
        pooled.insert(l::POOL_STATE.into(), l::POOL_READY.into());
        assert_eq!(
            pooled
                .keys()
                .cloned()
                .collect::<std::collections::BTreeSet<_>>(),
            l::pooled_keys(shape.ttl, &shape.labels)
        );
        let template = PodTemplate {
            labels: BTreeMap::from([("example.com/tier".into(), "sandbox".into())]),
            ..PodTemplate::default()
        };
        let (pod, _) = run_objects(&shape, "sbx-1", "ns", &pooled, None, &template).unwrap();
        let mut pod = serde_json::to_value(pod).unwrap();
        // What an admission webhook might add.
        pod["metadata"]["labels"]["mesh.example/tls"] = "on".into();

        let mut run = l::run_labels(
            "sbx-1",
            None,
            None,
            &BTreeMap::from([("team".into(), "b".into())]),
        );
        run.insert(l::POOL.into(), "k".into());
        run.insert(l::POOL_STATE.into(), l::POOL_CLAIMED.into());
        let stale: Vec<String> = l::pooled_keys(shape.ttl, &shape.labels)
            .into_iter()
            .filter(|k| !run.contains_key(k))
            .collect();
        let patch =
            claim_patch(&stale, &run, Some(std::path::Path::new("/host/ws")), "t1").unwrap();
        json_patch::patch(&mut pod, &patch).unwrap();

        let got: BTreeMap<String, String> =
            serde_json::from_value(pod["metadata"]["labels"].clone()).unwrap();
        let mut want = run.clone();
        want.insert("mesh.example/tls".into(), "on".into());
        want.insert("example.com/tier".into(), "sandbox".into());
        assert_eq!(got, want);
        assert!(!got.contains_key(l::OWNER_PID) && !got.contains_key(l::EXPIRES_AT));
        assert_eq!(
            pod["metadata"]["annotations"][HOST_DIR_ANNOTATION],
            "/host/ws"
        );
        // The pod is claimed now: the same patch (another process's claim) fails.
        assert!(json_patch::patch(&mut pod, &patch).is_err());
    }
}
