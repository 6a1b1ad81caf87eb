//! The conformance suites `cargo xtask test` runs: one table. A row is a driver, the
//! package whose `conformance` test binary links it, the environment that selects what it
//! covers (exec path, pooled runs, engine, exec protocol), and the phase it runs in (rows
//! of one phase run side by side). To cover a new configuration, add a row.

use crate::{HELPER_ENV, POOLED_ENV};

/// When a suite runs: the rows of a phase run side by side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// On the Docker engine, first.
    Docker,
    /// On the Podman services, beside the cluster's start-up and suites.
    Podman,
    /// On the test cluster, first group.
    K8s,
    /// On the test cluster, second group (after the first).
    K8sLater,
}

/// A value of a suite's environment: literal, or known only when the engines are up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Value {
    Lit(&'static str),
    /// The rootful Podman service's address.
    PodmanHost,
    /// The rootless Podman service's address.
    RootlessHost,
    /// The cluster's restricted kubeconfig.
    Kubeconfig,
    /// The loopback registry's snapshot repository (`registry.rs`).
    SnapshotRegistry,
    /// The suite's image as pushed to that registry (the base of snapshots).
    RegistryImage,
}

/// One suite.
#[derive(Debug)]
pub struct SuiteDef {
    /// Its name in logs (`target/xtask-logs/<label>.log`).
    pub label: &'static str,
    /// The registered driver name (`RUNCELL_TEST`).
    pub driver: &'static str,
    /// The package whose `conformance` test binary runs.
    pub package: &'static str,
    pub phase: Phase,
    pub env: &'static [(&'static str, Value)],
    /// Runs the test binary as this user (the rootless engine's).
    pub user: Option<&'static str>,
}

use Value::{Kubeconfig, Lit, PodmanHost, RegistryImage, RootlessHost, SnapshotRegistry};

const OURS: &str = "runcell-conformance";
const HOST: &str = "RUNCELL_DOCKER_HOST";
const KUBECONFIG: &str = "KUBECONFIG";
/// The exec path for API servers without v5.channel.k8s.io (before 1.30): stdin framed,
/// never closed.
const V4: &str = "RUNCELL_K8S_EXEC_V4_COMPATIBLE";
/// How long the idle case leaves its run alone.
const IDLE_ENV: &str = "RUNCELL_CONFORMANCE_IDLE_SECS";
/// Twice the test node's `streamingConnectionIdleTimeout` (30 s, `realnode.sh`): the
/// helper suites show that a held stream outlives it.
const NODE_IDLE_TWICE: &str = "65";
/// Snapshots on Kubernetes: the registry they are pushed to, over plain HTTP.
const SNAPSHOT_REGISTRY: &str = "RUNCELL_K8S_SNAPSHOT_REGISTRY";
const SNAPSHOT_PLAIN_HTTP: &str = "RUNCELL_K8S_SNAPSHOT_REGISTRY_PLAIN_HTTP";
/// The suite's image.
const IMAGE_ENV: &str = "RUNCELL_CONFORMANCE_IMAGE";

/// Every suite.
pub const SUITES: &[SuiteDef] = &[
    // Docker, through the exec helper and on the plain exec path; the example third-party
    // driver (default mode); every run from a warm pool's target (claimed, then set up).
    suite(
        "docker/helper",
        "docker",
        OURS,
        Phase::Docker,
        &[(HELPER_ENV, Lit("required"))],
    ),
    suite(
        "docker/plain",
        "docker",
        OURS,
        Phase::Docker,
        &[(HELPER_ENV, Lit("off"))],
    ),
    suite("audit", "audit", "sandbox-driver-audit", Phase::Docker, &[]),
    suite(
        "docker/pooled",
        "docker",
        OURS,
        Phase::Docker,
        &[(POOLED_ENV, Lit("1"))],
    ),
    // Podman, rootful, and rootless with the suite run as the engine's user (as rootless
    // setups run the library; a host workspace is then that user's).
    suite(
        "podman",
        "docker",
        OURS,
        Phase::Podman,
        &[(HOST, PodmanHost), (HELPER_ENV, Lit("required"))],
    ),
    SuiteDef {
        user: Some(crate::podman::ROOTLESS_USER),
        ..suite(
            "podman-rootless",
            "docker",
            OURS,
            Phase::Podman,
            &[(HOST, RootlessHost), (HELPER_ENV, Lit("auto"))],
        )
    },
    // The cluster, on both exec protocol versions, helper and plain; pooled runs. Through
    // the helper with snapshots: runs pulled from a registry on loopback, snapshots pushed
    // to it.
    suite(
        "k8s/helper",
        "k8s",
        OURS,
        Phase::K8s,
        &[
            (KUBECONFIG, Kubeconfig),
            (HELPER_ENV, Lit("required")),
            (IDLE_ENV, Lit(NODE_IDLE_TWICE)),
            (SNAPSHOT_REGISTRY, SnapshotRegistry),
            (SNAPSHOT_PLAIN_HTTP, Lit("true")),
            (IMAGE_ENV, RegistryImage),
        ],
    ),
    suite(
        "k8s/plain",
        "k8s",
        OURS,
        Phase::K8s,
        &[(KUBECONFIG, Kubeconfig), (HELPER_ENV, Lit("off"))],
    ),
    suite(
        "k8s-v4/helper",
        "k8s",
        OURS,
        Phase::K8sLater,
        &[
            (KUBECONFIG, Kubeconfig),
            (HELPER_ENV, Lit("required")),
            (V4, Lit("true")),
            (IDLE_ENV, Lit(NODE_IDLE_TWICE)),
        ],
    ),
    suite(
        "k8s-v4/plain",
        "k8s",
        OURS,
        Phase::K8sLater,
        &[
            (KUBECONFIG, Kubeconfig),
            (HELPER_ENV, Lit("off")),
            (V4, Lit("true")),
        ],
    ),
    suite(
        "k8s/pooled",
        "k8s",
        OURS,
        Phase::K8sLater,
        &[
            (KUBECONFIG, Kubeconfig),
            (HELPER_ENV, Lit("auto")),
            (POOLED_ENV, Lit("1")),
        ],
    ),
];

const fn suite(
    label: &'static str,
    driver: &'static str,
    package: &'static str,
    phase: Phase,
    env: &'static [(&'static str, Value)],
) -> SuiteDef {
    SuiteDef {
        label,
        driver,
        package,
        phase,
        env,
        user: None,
    }
}

/// The suites of `phase`.
pub fn of(phase: Phase) -> impl Iterator<Item = &'static SuiteDef> {
    SUITES.iter().filter(move |s| s.phase == phase)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_unique_and_every_phase_runs_something() {
        let mut labels: Vec<_> = SUITES.iter().map(|s| s.label).collect();
        labels.sort();
        let n = labels.len();
        labels.dedup();
        assert_eq!(
            labels.len(),
            n,
            "a label twice: logs would overwrite each other"
        );
        for phase in [Phase::Docker, Phase::Podman, Phase::K8s, Phase::K8sLater] {
            assert!(of(phase).next().is_some(), "{phase:?} runs nothing");
        }
        // Each engine is covered on both exec paths.
        for prefix in ["docker/", "k8s/"] {
            for mode in ["required", "off"] {
                assert!(
                    SUITES
                        .iter()
                        .any(|s| s.label.starts_with(prefix)
                            && s.env.contains(&(HELPER_ENV, Lit(mode)))),
                    "{prefix} without {HELPER_ENV}={mode}"
                );
            }
        }
    }
}
