//! The run's CA certificates: carried in a Secret (created before the pod, owned by it
//! once it exists, so garbage collection removes both), mounted read-only at
//! [`crate::pod::CA_SECRET_MOUNT`], and assembled by a script in the running pod into the
//! same files as on Docker before the post-create commands run.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Patch, PatchParams};
use runcell_core::{Error, ErrorKind, ExecSpec, Result};

use crate::{K8sDriver, ca_secret_name, error};

/// The bound of the CA setup exec.
const CA_SETUP_BOUND: Duration = Duration::from_secs(60);
/// How much of the setup script's output is kept.
const CA_SETUP_OUTPUT: usize = 64 << 10;

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
        let setup = ExecSpec::new(["sh", "-c", CA_SETUP])
            .working_dir("/")
            .timeout(CA_SETUP_BOUND);
        let out = runcell_core::raw::exec_in(self, id, setup)
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
