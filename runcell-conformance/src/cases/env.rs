//! Environment, proxy and CA injection.

use anyhow::ensure;
use runcell_core::{DriverExt, ExecSpec, Proxy, RunExt};

use crate::{Context, TEST_CA, sh_stdout};

/// The run's env reaches every exec; an exec's own env wins.
pub async fn env_is_injected_and_exec_env_wins(cx: &Context) -> anyhow::Result<()> {
    let spec = cx
        .spec()
        .env("RUN_VAR", "run value with spaces")
        .env("SHARED", "from-run");
    let run = cx.driver.start(&spec).await?;
    ensure!(sh_stdout(&*run, "echo \"$RUN_VAR\"").await? == "run value with spaces");
    let out = run
        .exec(
            ExecSpec::new(["sh", "-c", "echo $SHARED $EXEC_ONLY"])
                .env("SHARED", "from-exec")
                .env("EXEC_ONLY", "x"),
        )
        .await?;
    ensure!(
        out.stdout_str() == "from-exec x\n",
        "got {:?}",
        out.stdout_str()
    );
    ensure!(sh_stdout(&*run, "echo $SHARED ${EXEC_ONLY:-unset}").await? == "from-run unset");
    run.stop().await?;
    Ok(())
}

/// Proxy variables in both cases; loopback always bypasses.
pub async fn proxy_is_set_in_both_cases(cx: &Context) -> anyhow::Result<()> {
    let mut spec = cx.spec();
    spec.proxy = Proxy {
        http: Some("http://proxy.invalid:3128".into()),
        https: Some("http://proxy.invalid:3129".into()),
        no_proxy: vec!["internal.example".into()],
    };
    let run = cx.driver.start(&spec).await?;
    let got = sh_stdout(
        &*run,
        "echo $HTTP_PROXY $http_proxy $HTTPS_PROXY $https_proxy; echo $NO_PROXY; echo $no_proxy",
    )
    .await?;
    let lines: Vec<&str> = got.lines().collect();
    ensure!(
        lines[0]
            == "http://proxy.invalid:3128 http://proxy.invalid:3128 http://proxy.invalid:3129 http://proxy.invalid:3129",
        "{got}"
    );
    for line in &lines[1..] {
        let hosts: Vec<&str> = line.split(',').collect();
        for h in ["internal.example", "localhost", "127.0.0.1", "::1"] {
            ensure!(hosts.contains(&h), "no_proxy {line:?} lacks {h}");
        }
    }
    run.stop().await?;
    Ok(())
}

/// The CA variables point at files holding the injected certificate: the file-valued ones
/// at a full bundle (system roots too), `NODE_EXTRA_CA_CERTS` at the CA alone; all before
/// post-create runs.
pub async fn ca_variables_point_at_the_injected_cert(cx: &Context) -> anyhow::Result<()> {
    let mut spec = cx.spec().post_create([
        "sh",
        "-c",
        "cat \"$SSL_CERT_FILE\" > /workspace/seen-by-post-create.pem",
    ]);
    spec.ca_bundle = Some(TEST_CA.to_string());
    let run = cx.driver.start(&spec).await?;
    let body: String = TEST_CA
        .lines()
        .filter(|l| !l.starts_with("-----"))
        .collect::<Vec<_>>()
        .join("\n");
    let marker = body.lines().nth(3).unwrap_or_default().to_string();
    for var in [
        "SSL_CERT_FILE",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        "GIT_SSL_CAINFO",
        "NODE_EXTRA_CA_CERTS",
    ] {
        let path = sh_stdout(&*run, &format!("echo ${var}")).await?;
        ensure!(
            path.starts_with('/'),
            "{var} is not set to a path: {path:?}"
        );
        let text = sh_stdout(&*run, &format!("cat \"${var}\"")).await?;
        ensure!(
            text.contains(&marker),
            "{var}={path} does not hold the injected certificate"
        );
        let certs = text.matches("BEGIN CERTIFICATE").count();
        if var == "NODE_EXTRA_CA_CERTS" {
            ensure!(
                certs == 1,
                "{var} should hold the CA alone, holds {certs} certificates"
            );
        } else if sh_stdout(
            &*run,
            "test -s /etc/ssl/certs/ca-certificates.crt && echo yes || echo no",
        )
        .await?
            == "yes"
        {
            ensure!(
                certs > 1,
                "{var} should be a full bundle (system roots + CA), holds {certs}"
            );
        }
    }
    ensure!(
        sh_stdout(&*run, "cat seen-by-post-create.pem")
            .await?
            .contains(&marker),
        "post-create ran before the CA was installed"
    );
    if cx.caps.system_trust_store {
        let store = sh_stdout(&*run, "cat /etc/ssl/certs/ca-certificates.crt").await?;
        ensure!(
            store.contains(&marker),
            "the system trust store lacks the injected CA"
        );
    }
    run.stop().await?;
    Ok(())
}

/// A read-only root keeps the workspace and `/tmp` writable, and the CA still installs.
pub async fn read_only_root_with_ca(cx: &Context) -> anyhow::Result<()> {
    let mut spec = cx.spec();
    spec.security.read_only_rootfs = true;
    spec.ca_bundle = Some(TEST_CA.to_string());
    let run = cx.driver.start(&spec).await?;
    sh_stdout(&*run, "echo w > /workspace/w && echo t > /tmp/t").await?;
    let root = run
        .exec(ExecSpec::new(["sh", "-c", "echo x > /root-write"]))
        .await?;
    ensure!(
        !root.status.success(),
        "writing to the read-only root succeeded"
    );
    let marker = TEST_CA.lines().nth(4).unwrap_or_default();
    ensure!(
        sh_stdout(&*run, "cat \"$SSL_CERT_FILE\" \"$NODE_EXTRA_CA_CERTS\"")
            .await?
            .contains(marker)
    );
    run.stop().await?;
    Ok(())
}

/// Env names that look like options or hold dots and spaces reach the command as given,
/// in the run's env and an exec's.
pub async fn unusual_env_names_reach_the_command(cx: &Context) -> anyhow::Result<()> {
    let run = cx
        .driver
        .start(&cx.spec().env("-u", "run-dash").env("run.dot", "1"))
        .await?;
    let out = run
        .exec(
            ExecSpec::new(["env"])
                .env("-i", "exec-dash")
                .env("my.var", "2")
                .env("WITH SPACE", "3")
                .env("--", "4"),
        )
        .await?;
    ensure!(
        out.status.success(),
        "{}: {:?}",
        out.status,
        out.stderr_str()
    );
    let env = out.stdout_str();
    for want in [
        "-u=run-dash",
        "run.dot=1",
        "-i=exec-dash",
        "my.var=2",
        "WITH SPACE=3",
        "--=4",
    ] {
        ensure!(
            env.lines().any(|l| l == want),
            "{want:?} missing from:\n{env}"
        );
    }
    run.stop().await?;
    Ok(())
}
