//! The pure translation of a [`RunSpec`] into Docker's container create body.

use std::collections::{BTreeMap, HashMap};

use bollard::models::{ContainerCreateBody, HostConfig, Mount, MountType};
use sandbox_core::{Network, RunSpec, ca};

/// The kept-alive process. The image's ENTRYPOINT and CMD are never run.
pub const KEEPALIVE: [&str; 2] = ["sleep", "infinity"];

/// The container create body for a run. `labels` are the run's full labels (the
/// library's and the caller's). Pure: snapshotted in tests.
pub fn container_body(spec: &RunSpec, labels: &BTreeMap<String, String>) -> ContainerCreateBody {
    let mut mounts = vec![match &spec.workspace.host_dir {
        Some(dir) => Mount {
            typ: Some(MountType::BIND),
            source: Some(dir.display().to_string()),
            target: Some(spec.workspace.path.clone()),
            ..Default::default()
        },
        // An anonymous volume: writable under a read-only root, removed with the container.
        None => Mount {
            typ: Some(MountType::VOLUME),
            target: Some(spec.workspace.path.clone()),
            ..Default::default()
        },
    }];
    let mut tmpfs = None;
    if spec.security.read_only_rootfs {
        tmpfs = Some(HashMap::from([("/tmp".to_string(), "mode=1777".to_string())]));
        if spec.ca_bundle.is_some() {
            // The CA files are uploaded before start; a volume takes them under a read-only root.
            mounts.push(Mount {
                typ: Some(MountType::VOLUME),
                target: Some(ca::DIR.to_string()),
                ..Default::default()
            });
        }
    }
    let security_opt = spec
        .security
        .no_new_privileges
        .then(|| vec!["no-new-privileges:true".to_string()]);
    ContainerCreateBody {
        image: Some(spec.image.clone()),
        entrypoint: Some(KEEPALIVE[..1].iter().map(|s| s.to_string()).collect()),
        cmd: Some(KEEPALIVE[1..].iter().map(|s| s.to_string()).collect()),
        env: Some(run_env(spec).into_iter().map(|(k, v)| format!("{k}={v}")).collect()),
        working_dir: Some(spec.effective_working_dir().to_string()),
        user: spec.user.clone(),
        labels: Some(labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect()),
        tty: Some(false),
        open_stdin: Some(false),
        attach_stdin: Some(false),
        attach_stdout: Some(false),
        attach_stderr: Some(false),
        host_config: Some(HostConfig {
            // docker-init as PID 1 reaps orphans of exec'd processes and forwards signals.
            init: Some(true),
            mounts: Some(mounts),
            tmpfs,
            memory: spec.resources.memory_bytes.map(|m| m as i64),
            nano_cpus: spec.resources.cpus.map(|c| (c * 1e9).round() as i64),
            pids_limit: spec.resources.pids.map(i64::from),
            network_mode: match spec.network {
                Network::Default => None,
                Network::None => Some("none".into()),
            },
            security_opt,
            cap_drop: (!spec.security.cap_drop.is_empty()).then(|| spec.security.cap_drop.clone()),
            readonly_rootfs: spec.security.read_only_rootfs.then_some(true),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The run's environment: proxy (both cases), CA variables, then the caller's env; a
/// later entry replaces an earlier one of the same name.
pub fn run_env(spec: &RunSpec) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = spec.proxy.env();
    if spec.ca_bundle.is_some() {
        env.extend(ca::env());
    }
    env.extend(spec.env.iter().cloned());
    let mut merged: Vec<(String, String)> = Vec::with_capacity(env.len());
    for (k, v) in env {
        match merged.iter_mut().find(|(name, _)| *name == k) {
            Some(slot) => slot.1 = v,
            None => merged.push((k, v)),
        }
    }
    merged
}
