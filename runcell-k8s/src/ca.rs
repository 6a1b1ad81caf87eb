//! The run's CA certificates: carried in a Secret (created before the pod, owned by it
//! once it exists, so garbage collection removes both), mounted read-only at
//! [`crate::pod::CA_SECRET_MOUNT`], and assembled by a script in the running pod into the
//! same files as on Docker before the post-create commands run.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Patch, PatchParams};
use runcell_core::{Error, ErrorKind, ExecSpec, Result, ca};

use crate::{K8sDriver, ca_secret_name, error};

/// The bound of the CA setup exec.
const CA_SETUP_BOUND: Duration = Duration::from_secs(60);
/// How much of the setup script's output is kept.
const CA_SETUP_OUTPUT: usize = 64 << 10;

/// Builds the CA files from the mounted Secret: the CA alone, the full bundle (system
/// roots first) and, where the image's system bundle is writable, the system bundle too.
/// Arguments (core's constants, so that no path is written twice): the mounted CA, the CA
/// file, the bundle file, the `update-ca-certificates` source, then the system bundles to
/// look for.
const CA_SETUP: &str = r#"
set -e
ca="$1"; ca_file="$2"; bundle_file="$3"; extra="$4"; shift 4
sys=""
for f in "$@"; do
  if [ -f "$f" ] && [ ! -L "$f" ]; then sys="$f"; break; fi
done
cat "$ca" > "$ca_file"
{ if [ -n "$sys" ]; then cat "$sys"; echo; fi; cat "$ca"; } | sed '/^$/d' > "$bundle_file"
# The system store only where it is writable (not under a read-only root, not as non-root).
if [ -n "$sys" ] && (cat "$bundle_file" > "$sys") 2>/dev/null; then
  { mkdir -p "$(dirname "$extra")" && cat "$ca" > "$extra"; } 2>/dev/null || true
fi
"#;

/// The CA setup exec's argv.
fn ca_setup_argv() -> Vec<String> {
    let mounted = format!(
        "{}/{}",
        crate::pod::CA_SECRET_MOUNT,
        crate::pod::CA_SECRET_KEY
    );
    let mut argv: Vec<String> = [
        "sh",
        "-c",
        CA_SETUP,
        "runcell-ca-setup",
        &mounted,
        ca::CA_FILE,
        ca::BUNDLE_FILE,
        ca::SYSTEM_EXTRA_DIR_FILE,
    ]
    .map(String::from)
    .to_vec();
    argv.extend(ca::SYSTEM_BUNDLES.map(String::from));
    argv
}

impl K8sDriver {
    /// Makes the CA Secret owned by the pod, so garbage collection removes it with the pod
    /// even if this process dies before it can.
    pub(crate) async fn adopt_secret(&self, id: &str, pod_uid: &str) -> Result<()> {
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

    /// Assembles the CA files in the running pod (an exec through core, bounded).
    pub(crate) async fn install_ca(&self, id: &str) -> Result<()> {
        let setup = ExecSpec::new(ca_setup_argv())
            .working_dir("/")
            .timeout(CA_SETUP_BOUND);
        let out = runcell_core::exec_in(self, id, setup)
            .await?
            .collect(CA_SETUP_OUTPUT)
            .await;
        if out.status.success() {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::Backend,
            format!("installing the CA bundle {}", out.status),
        )
        .with("run", id)
        .with("stderr", out.stderr_str()))
    }
}
