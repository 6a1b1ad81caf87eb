//! The pure translation of a [`RunSpec`] into Docker's container create body.

use std::collections::{BTreeMap, HashMap};

use bollard::models::{ContainerCreateBody, HostConfig, Mount, MountType};
use runcell_core::raw::KEEPALIVE;
use runcell_core::{Network, RunSpec, ca};

/// The label on every container of a run that says where its workspace is mounted (a
/// snapshot carries it; Podman's inspect lists mounts in no stable order).
pub(crate) const WORKSPACE_LABEL: &str = "sandbox.dev/workspace";

/// The container create body for a run. `labels` are the run's full labels (the
/// library's and the caller's). Pure: snapshotted in tests.
pub fn container_body(spec: &RunSpec, labels: &BTreeMap<String, String>) -> ContainerCreateBody {
    // A run from a snapshot finds its workspace in the snapshot's image: kept in the
    // container's own filesystem (copy on write: nothing is copied at create, so forks
    // start as fast as any run), unless that filesystem is read-only.
    let workspace_in_image = spec.from_snapshot.is_some()
        && spec.workspace.host_dir.is_none()
        && !spec.security.read_only_rootfs;
    let mut mounts = vec![match &spec.workspace.host_dir {
        // Docker takes no `nosuid`/`nodev` on a bind (20.10 refuses the flags in `Binds`,
        // `BindOptions` has none): the driver defuses the host directory once the
        // container is gone instead; Podman gets them ([`podman_binds`]).
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
    if workspace_in_image {
        mounts.clear();
    }
    // The exec helper's place (core uploads it after start): a volume is writable under a
    // read-only root, executable, and removed with the container.
    mounts.push(Mount {
        typ: Some(MountType::VOLUME),
        target: Some(runcell_core::HELPER_DIR.to_string()),
        ..Default::default()
    });
    let mut tmpfs = None;
    if spec.security.read_only_rootfs {
        tmpfs = Some(HashMap::from([(
            "/tmp".to_string(),
            "mode=1777".to_string(),
        )]));
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
        env: Some(
            spec.run_env()
                .into_iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect(),
        ),
        working_dir: Some(spec.effective_working_dir().to_string()),
        user: spec.user.clone(),
        labels: Some(
            labels
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .chain([(WORKSPACE_LABEL.to_string(), spec.workspace.path.clone())])
                .collect(),
        ),
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

/// Podman takes mount flags in `Binds` (Docker refuses them): there the workspace's bind
/// becomes `SOURCE:TARGET:rw,nosuid,nodev`, so that inside the run a setuid program or a
/// device node written into the host directory is inert. A path with `:` or `,` cannot be
/// written in `Binds` and stays a plain bind (the driver's defusing at removal still
/// applies).
pub(crate) fn podman_binds(body: &mut ContainerCreateBody) {
    let Some(host) = body.host_config.as_mut() else {
        return;
    };
    let Some(mounts) = host.mounts.as_mut() else {
        return;
    };
    let Some(i) = mounts.iter().position(|m| m.typ == Some(MountType::BIND)) else {
        return;
    };
    let (Some(source), Some(target)) = (&mounts[i].source, &mounts[i].target) else {
        return;
    };
    if [source, target].iter().any(|p| p.contains([':', ','])) {
        return;
    }
    let bind = format!("{source}:{target}:rw,nosuid,nodev");
    mounts.remove(i);
    host.binds.get_or_insert_with(Vec::new).push(bind);
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use runcell_core::{Proxy, RunSpec};

    use super::*;

    fn labels(spec: &RunSpec) -> BTreeMap<String, String> {
        runcell_core::labels::fixed_for_snapshots(&spec.labels, spec.ttl)
    }

    #[test]
    fn a_run_from_a_snapshot_keeps_its_workspace_in_the_image_unless_read_only() {
        let targets = |spec: &RunSpec| -> Vec<String> {
            let body = container_body(spec, &labels(spec));
            let mounts = body.host_config.and_then(|h| h.mounts).unwrap_or_default();
            mounts.into_iter().filter_map(|m| m.target).collect()
        };
        let mut spec = RunSpec::new("sha256:0123");
        spec.from_snapshot = Some("snap-0123456789abcdef".into());
        assert_eq!(targets(&spec), [runcell_core::HELPER_DIR]);
        spec.security.read_only_rootfs = true;
        assert_eq!(targets(&spec), ["/workspace", runcell_core::HELPER_DIR]);
        assert_eq!(
            targets(&RunSpec::new("busybox")),
            ["/workspace", runcell_core::HELPER_DIR]
        );
    }

    #[test]
    fn minimal_spec() {
        let spec = RunSpec::new("busybox:1.36");
        insta::assert_yaml_snapshot!(container_body(&spec, &labels(&spec)), {
            ".Labels" => insta::sorted_redaction(),
        });
    }

    #[test]
    fn full_spec() {
        let mut spec = RunSpec::new("registry.example/tools:2")
            .workspace_dir("/srv/work/run-1")
            .env("A", "1")
            .env("HTTP_PROXY", "http://override:1")
            .label("team", "agents")
            .post_create(["make", "setup"]);
        spec.workspace.path = "/src".into();
        spec.working_dir = Some("/src/app".into());
        spec.user = Some("1000:1000".into());
        spec.proxy = Proxy {
            http: Some("http://proxy:3128".into()),
            https: Some("http://proxy:3129".into()),
            no_proxy: vec!["internal".into()],
        };
        spec.ca_bundle = Some("(pem)".into());
        spec.resources.memory_bytes = Some(512 << 20);
        spec.resources.cpus = Some(1.5);
        spec.resources.pids = Some(256);
        spec.network = Network::None;
        spec.security.cap_drop = vec!["ALL".into()];
        spec.security.read_only_rootfs = true;
        spec.ttl = Some(Duration::from_secs(3600));
        insta::assert_yaml_snapshot!(container_body(&spec, &labels(&spec)), {
            ".Labels" => insta::sorted_redaction(),
            ".HostConfig.Tmpfs" => insta::sorted_redaction(),
        });
    }

    /// On Podman the workspace's bind is `nosuid,nodev`; without a host directory, or
    /// with a path `Binds` cannot carry, nothing changes.
    #[test]
    fn podman_binds_the_workspace_nosuid_nodev() {
        let spec = RunSpec::new("busybox:1.36").workspace_dir("/srv/work/run-1");
        let mut body = container_body(&spec, &labels(&spec));
        podman_binds(&mut body);
        insta::assert_yaml_snapshot!(body.host_config.as_ref().unwrap());
        for spec in [
            RunSpec::new("busybox:1.36"),
            RunSpec::new("busybox:1.36").workspace_dir("/srv/work:1"),
        ] {
            let mut body = container_body(&spec, &labels(&spec));
            let before = body.clone();
            podman_binds(&mut body);
            assert_eq!(body, before);
        }
    }
}
