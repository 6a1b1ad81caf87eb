//! The Kubernetes test cluster (testenv/k8s): upstream control plane built from Go
//! modules, and one real node: the upstream kubelet on its own containerd with CNI.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the repo")
        .to_path_buf()
}

/// The variable naming the cluster's state directory. The test cluster's variables use
/// their own prefix: `RUNCELL_K8S_*` is the k8s driver's config, and the driver rejects
/// keys it does not know.
pub const STATE_ENV: &str = "RUNCELL_TESTENV_STATE";

/// The cluster's state directory.
pub fn state_dir() -> PathBuf {
    std::env::var_os(STATE_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join("target/k8s"))
}

/// The node's registry hosts directory (containerd's `config_path`, `realnode.sh`): a
/// `<host:port>/hosts.toml` there makes the node trust a registry's CA.
pub fn registry_hosts_dir() -> PathBuf {
    state_dir().join("realnode/etc/certs.d")
}

/// The test cluster's `cluster.sh`.
pub fn cluster_script() -> PathBuf {
    repo().join("testenv/k8s/cluster.sh")
}

fn script(name: &str) -> Command {
    let mut cmd = Command::new("bash");
    cmd.arg(repo().join("testenv/k8s").join(name))
        .env(STATE_ENV, state_dir());
    cmd
}

fn ensure_go() -> Result<()> {
    let found = Command::new("go")
        .arg("version")
        .output()
        .or_else(|_| Command::new("/usr/local/go/bin/go").arg("version").output());
    match found {
        Ok(out) if out.status.success() => Ok(()),
        _ => bail!(
            "the test cluster is built from Go modules: install Go >= 1.26 (e.g. /usr/local/go/bin/go)"
        ),
    }
}

/// `cluster.sh up`: builds (once per version), starts, waits for the node; returns the
/// kubeconfig path.
pub fn up() -> Result<PathBuf> {
    ensure_go()?;
    eprintln!("$ testenv/k8s/cluster.sh up");
    let out = script("cluster.sh")
        .arg("up")
        .stderr(std::process::Stdio::inherit())
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    print!("{stdout}");
    if !out.status.success() {
        bail!(
            "cluster.sh up failed ({}); logs in {}/logs",
            out.status,
            state_dir().display()
        );
    }
    let kubeconfig = stdout
        .lines()
        .last()
        .context("cluster.sh up printed no kubeconfig path")?
        .trim();
    Ok(PathBuf::from(kubeconfig))
}

/// `cluster.sh down|status`.
pub fn run(subcommand: &str) -> Result<()> {
    let status = script("cluster.sh").arg(subcommand).status()?;
    if !status.success() {
        bail!("cluster.sh {subcommand}: {status}");
    }
    Ok(())
}

/// The smoke test of the cluster itself, with the stock kubectl.
pub fn smoke(kubeconfig: &Path) -> Result<()> {
    eprintln!("$ testenv/k8s/smoke.sh");
    let status = script("smoke.sh").arg(kubeconfig).status()?;
    if !status.success() {
        bail!("the cluster smoke test failed: {status}");
    }
    Ok(())
}

/// Fails if the cluster holds a pod, Secret, ConfigMap or claim made by the library in this
/// test session (label `sandbox.conformance/session=<session>`); other objects, a
/// developer's own or a parallel job's, are not this session's business.
pub fn assert_no_leftovers(kubeconfig: &Path, session: &str) -> Result<()> {
    let selector = format!(
        "sandbox.dev/managed-by,{}={session}",
        crate::engine::SESSION_LABEL
    );
    let mut get = kubectl(kubeconfig)?;
    get.args([
        "get",
        "pods,secrets,configmaps,persistentvolumeclaims",
        "--all-namespaces",
        "-l",
        &selector,
        "-o",
        "name",
    ]);
    let left = output(get, None)?;
    if !left.trim().is_empty() {
        bail!("the tests left objects of session {session} in the cluster:\n{left}");
    }
    eprintln!("no pod, Secret or ConfigMap of session {session} is left in the cluster");
    Ok(())
}

/// The namespace the suite runs in under the driver's RBAC Role.
pub const TEST_NAMESPACE: &str = "sandbox-conformance";

fn kubectl(kubeconfig: &Path) -> Result<Command> {
    let bin = std::fs::read_dir(state_dir().join("bin"))?
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("kubectl"))
        .find(|p| p.exists())
        .context("no kubectl built under the state dir")?;
    let mut cmd = Command::new(bin);
    cmd.arg("--kubeconfig").arg(kubeconfig);
    Ok(cmd)
}

fn output(mut cmd: Command, stdin: Option<&[u8]>) -> Result<String> {
    use std::io::Write;
    cmd.stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    if stdin.is_some() {
        cmd.stdin(std::process::Stdio::piped());
    }
    let mut child = cmd.spawn()?;
    if let Some(data) = stdin {
        child.stdin.take().expect("piped").write_all(data)?;
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8(out.stdout)?)
}

/// A kubeconfig for a ServiceAccount bound to exactly `runcell-k8s/deploy/rbac.yaml`, in
/// [`TEST_NAMESPACE`]: the suite runs with the permissions the README documents.
pub fn restricted_kubeconfig(admin: &Path) -> Result<PathBuf> {
    let ns_yaml = format!("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {TEST_NAMESPACE}\n");
    let mut apply = kubectl(admin)?;
    apply.args(["apply", "-f", "-"]);
    output(apply, Some(ns_yaml.as_bytes()))?;
    let mut apply = kubectl(admin)?;
    apply
        .args(["apply", "-n", TEST_NAMESPACE, "-f"])
        .arg(repo().join("runcell-k8s/deploy/rbac.yaml"));
    output(apply, None)?;
    let mut token = kubectl(admin)?;
    token.args([
        "create",
        "token",
        "sandbox-driver",
        "-n",
        TEST_NAMESPACE,
        "--duration",
        "2h",
    ]);
    let token = output(token, None)?;
    let field = |path: &str| -> Result<String> {
        let mut view = kubectl(admin)?;
        view.args([
            "config",
            "view",
            "--raw",
            "--minify",
            "-o",
            &format!("jsonpath={{{path}}}"),
        ]);
        output(view, None)
    };
    let server = field(".clusters[0].cluster.server")?;
    let ca = field(".clusters[0].cluster.certificate-authority-data")?;
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {server}\n    certificate-authority-data: {ca}\n\
         users:\n- name: sandbox-driver\n  user:\n    token: {}\ncontexts:\n- name: sandbox-driver\n  context:\n    cluster: test\n    user: sandbox-driver\n    namespace: {TEST_NAMESPACE}\n\
         current-context: sandbox-driver\n",
        token.trim()
    );
    let path = state_dir().join("sandbox-driver.kubeconfig");
    std::fs::write(&path, text)?;
    eprintln!(
        "the suite runs as ServiceAccount {TEST_NAMESPACE}/sandbox-driver with runcell-k8s/deploy/rbac.yaml"
    );
    Ok(path)
}
