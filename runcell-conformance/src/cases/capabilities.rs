//! One case per capability flag that governs a spec field. Every case runs on every
//! driver: where the driver claims the flag, the field must really take effect inside the
//! sandbox (read back from inside with BusyBox tools); where it does not, the field must
//! be an `Unsupported` error naming it, with nothing created (never silently ignored).
//!
//! Limits are read from the cgroup files that apply to the exec's process, for cgroup v2
//! (`memory.max`, `cpu.max`, `pids.max`) and v1 (`memory.limit_in_bytes`,
//! `cpu.cfs_quota_us`/`cpu.cfs_period_us`, `pids.max` under each controller's mount),
//! from the process's own cgroup up to the root of what the sandbox sees.

use std::time::Duration;

use anyhow::{Context as _, bail, ensure};
use bytes::Bytes;
use runcell_core::{
    DriverExt, ErrorKind, ExecPath, ExecSpec, ExitStatus, Network, OutputChunk, Run, RunExt,
    RunSpec,
};

use crate::{Context, sh_stdout};

/// A bound on calls that must not hang (an `Unsupported` answer needs no backend at all).
const HANG: Duration = Duration::from_secs(60);

/// The memory limit the memory case asks for (page-aligned, so cgroup v1 keeps it exact).
const MEMORY_BYTES: u64 = 128 << 20;
/// The cpu limit the cpu case asks for.
const CPUS: f64 = 0.5;
/// The pids limit the pids cases ask for.
const PIDS: u32 = 64;
/// How long the processes that fill a run to its pids limit live.
const FILLED_FOR: Duration = Duration::from_secs(12);
/// The disk limit the disk case asks for, and what its exec writes (four times more).
const DISK_BYTES: u64 = 16 << 20;
/// How long an engine may take to notice a run over its disk limit (the kubelet's
/// eviction manager looks every 10 s at usage that containerd counts every 10 s).
const DISK_NOTICED: Duration = Duration::from_secs(150);
/// `CAP_NET_RAW`'s bit in the capability sets of `/proc/self/status`.
const CAP_NET_RAW_BIT: u32 = 13;

/// The suite's spec, with `no_new_privileges` (on by default) off where the driver cannot
/// honour it, so that only the field under test can be what a driver refuses.
fn base(cx: &Context) -> RunSpec {
    let mut spec = cx.spec();
    if !cx.caps.no_new_privileges {
        spec.security.no_new_privileges = false;
    }
    spec
}

/// Creating `spec` must fail with `Unsupported` naming `field`, and leave nothing behind.
async fn assert_create_unsupported(
    cx: &Context,
    spec: &RunSpec,
    field: &str,
    flag: &str,
) -> anyhow::Result<()> {
    let result = tokio::time::timeout(HANG, cx.driver.create(spec))
        .await
        .with_context(|| format!("creating a run with {field} hung"))?;
    match result {
        Ok(run) => {
            let id = run.id().to_string();
            run.stop().await?;
            bail!(
                "the driver does not claim `{flag}` but created run {id} with {field} set: \
                 the field would be silently ignored; expected Unsupported naming {field}"
            );
        }
        Err(e) => ensure!(
            e.kind() == ErrorKind::Unsupported && e.field() == Some(field),
            "{field} without `{flag}`: expected Unsupported naming {field}, got {:?} naming {:?}: {e}",
            e.kind(),
            e.field()
        ),
    }
    cx.assert_case_clean()
        .await
        .with_context(|| format!("after the unsupported {field}"))
}

/// An exec of `spec` (whose command would create `marker`) must fail with `Unsupported`
/// naming `field` before the command starts: `marker` does not exist afterwards.
async fn assert_exec_unsupported(
    run: &dyn Run,
    spec: ExecSpec,
    marker: &str,
    field: &str,
    flag: &str,
) -> anyhow::Result<()> {
    let result = tokio::time::timeout(HANG, run.exec_stream(spec))
        .await
        .with_context(|| format!("an exec with {field} hung"))?;
    match result {
        Ok(stream) => {
            let status = tokio::time::timeout(HANG, stream.wait())
                .await
                .with_context(|| format!("an exec with {field} hung"))?;
            bail!(
                "the driver does not claim `{flag}` but started an exec with {field} set ({status}); \
                 expected Unsupported naming {field}"
            );
        }
        Err(e) => ensure!(
            e.kind() == ErrorKind::Unsupported && e.field() == Some(field),
            "exec {field} without `{flag}`: expected Unsupported naming {field}, got {:?} naming {:?}: {e}",
            e.kind(),
            e.field()
        ),
    }
    let left = sh_stdout(run, &format!("[ -e {marker} ] && echo ran || echo absent")).await?;
    ensure!(
        left == "absent",
        "the refused exec ran anyway: {marker} exists"
    );
    Ok(())
}

/// Every cgroup limit file that applies to the exec's process, as `<dir> <value>...` lines
/// (one value per file), from its own cgroup up to the root visible in the sandbox. Under
/// cgroup v2 it reads `v2` in the unified hierarchy; under v1 the `v1` files (all in one
/// directory) of `controller`'s hierarchy, found under its own or a joined mount
/// (`cpu,cpuacct`).
const CGROUP_LIMITS: &str = r#"
v2=$1 controller=$2; shift 2
emit() {
  d=$1; shift
  for f in "$@"; do [ -r "$d/$f" ] || return 0; done
  line=$d
  for f in "$@"; do line="$line $(cat "$d/$f")"; done
  echo "$line"
}
walk() {
  root=${1%/} rel=$2; shift 2
  case "$rel" in *..*) rel= ;; esac
  d=$root${rel%/}
  while :; do
    emit "$d" "$@"
    [ "${#d}" -le "${#root}" ] && break
    d=${d%/*}
  done
}
if [ -e /sys/fs/cgroup/cgroup.controllers ]; then
  walk /sys/fs/cgroup "$(sed -n 's/^0:://p' /proc/self/cgroup | head -n 1)" $v2
else
  rel=$(awk -F: -v c="$controller" '{ n = split($2, a, ","); for (i = 1; i <= n; i++) if (a[i] == c) print $3 }' /proc/self/cgroup | head -n 1)
  for root in /sys/fs/cgroup/$controller /sys/fs/cgroup/$controller,* /sys/fs/cgroup/*,$controller /sys/fs/cgroup/*,$controller,*; do
    if [ -d "$root" ]; then walk "$root" "$rel" "$@"; break; fi
  done
fi
"#;

/// The `<dir> <values>` lines of [`CGROUP_LIMITS`], failing when no file was found.
async fn cgroup_limits(
    run: &dyn Run,
    v2: &str,
    controller: &str,
    v1: &[&str],
) -> anyhow::Result<Vec<(String, Vec<String>)>> {
    let mut argv = vec!["sh", "-c", CGROUP_LIMITS, "cgroup-limits", v2, controller];
    argv.extend_from_slice(v1);
    let out = run.exec(ExecSpec::new(argv)).await?;
    ensure!(
        out.status.success(),
        "reading cgroup files: {}; stderr {:?}",
        out.status,
        out.stderr_str()
    );
    let lines: Vec<(String, Vec<String>)> = out
        .stdout_str()
        .lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            let dir = words.next()?.to_string();
            Some((dir, words.map(String::from).collect()))
        })
        .collect();
    if lines.is_empty() {
        let seen = sh_stdout(
            run,
            "stat -fc %T /sys/fs/cgroup; ls /sys/fs/cgroup | tr '\\n' ' '; cat /proc/self/cgroup",
        )
        .await
        .unwrap_or_else(|e| format!("(cannot look: {e:#})"));
        bail!(
            "no cgroup file found for {controller} ({v2} under v2, {} under v1); the sandbox shows: {seen}",
            v1.join(", ")
        );
    }
    Ok(lines)
}

fn show(lines: &[(String, Vec<String>)]) -> String {
    lines
        .iter()
        .map(|(dir, values)| format!("{dir}: {}", values.join(" ")))
        .collect::<Vec<_>>()
        .join("; ")
}

/// One `Name:\tvalue` line of the exec's `/proc/self/status`.
async fn proc_status(run: &dyn Run, name: &str) -> anyhow::Result<String> {
    let line = sh_stdout(run, &format!("grep '^{name}:' /proc/self/status")).await?;
    Ok(line
        .split_once(':')
        .map(|(_, v)| v.trim().to_string())
        .unwrap_or_default())
}

async fn cap_set(run: &dyn Run, name: &str) -> anyhow::Result<u64> {
    let hex = proc_status(run, name).await?;
    u64::from_str_radix(&hex, 16).with_context(|| format!("{name} is not hex: {hex:?}"))
}

/// `resources.memory_bytes`: with `memory_limit`, a cgroup memory limit of exactly the
/// requested bytes applies inside (v2 `memory.max`, v1 `memory.limit_in_bytes`); without,
/// `Unsupported` naming `resources.memory_bytes` and nothing created.
pub async fn memory_limit_is_honoured_or_unsupported(cx: &Context) -> anyhow::Result<()> {
    let spec = base(cx).memory_bytes(MEMORY_BYTES);
    if !cx.caps.memory_limit {
        return assert_create_unsupported(cx, &spec, "resources.memory_bytes", "memory_limit")
            .await;
    }
    let run = cx.driver.start(&spec).await?;
    let lines = cgroup_limits(&*run, "memory.max", "memory", &["memory.limit_in_bytes"]).await?;
    let want = MEMORY_BYTES.to_string();
    ensure!(
        lines.iter().any(|(_, v)| v.first() == Some(&want)),
        "asked for a memory limit of {MEMORY_BYTES} bytes; the cgroup files say {}",
        show(&lines)
    );
    run.stop().await?;
    Ok(())
}

/// `resources.cpus`: with `cpu_limit`, a CFS quota of the requested cores applies inside
/// (v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`); without, `Unsupported`
/// naming `resources.cpus` and nothing created.
pub async fn cpu_limit_is_honoured_or_unsupported(cx: &Context) -> anyhow::Result<()> {
    let spec = base(cx).cpus(CPUS);
    if !cx.caps.cpu_limit {
        return assert_create_unsupported(cx, &spec, "resources.cpus", "cpu_limit").await;
    }
    let run = cx.driver.start(&spec).await?;
    let lines = cgroup_limits(
        &*run,
        "cpu.max",
        "cpu",
        &["cpu.cfs_quota_us", "cpu.cfs_period_us"],
    )
    .await?;
    let cores = |values: &[String]| -> Option<f64> {
        let quota: f64 = values.first()?.parse().ok()?;
        let period: f64 = values.get(1)?.parse().ok()?;
        (quota > 0.0 && period > 0.0).then_some(quota / period)
    };
    ensure!(
        lines
            .iter()
            .filter_map(|(_, v)| cores(v))
            .any(|c| (c - CPUS).abs() < 0.01),
        "asked for a cpu limit of {CPUS} cores; the cgroup files say {}",
        show(&lines)
    );
    run.stop().await?;
    Ok(())
}

/// `resources.pids`: with `pids_limit`, a cgroup pids limit of exactly the requested
/// number applies inside (v2 `pids.max`, v1 `pids/pids.max`); without, `Unsupported`
/// naming `resources.pids` and nothing created.
pub async fn pids_limit_is_honoured_or_unsupported(cx: &Context) -> anyhow::Result<()> {
    let spec = base(cx).pids(PIDS);
    if !cx.caps.pids_limit {
        return assert_create_unsupported(cx, &spec, "resources.pids", "pids_limit").await;
    }
    let run = cx.driver.start(&spec).await?;
    let lines = cgroup_limits(&*run, "pids.max", "pids", &["pids.max"]).await?;
    let want = PIDS.to_string();
    ensure!(
        lines.iter().any(|(_, v)| v.first() == Some(&want)),
        "asked for a pids limit of {PIDS}; the cgroup files say {}",
        show(&lines)
    );
    run.stop().await?;
    Ok(())
}

/// A run at its pids limit: an exec that needs a process the kernel refuses (the exec
/// helper's, for the command) is refused with `LimitReached` naming the limit, never a
/// hang or a generic error; an engine's exec that enters the run's cgroup from outside
/// (the plain path: the kernel lets a process join a full cgroup, it only refuses forks
/// inside) runs. Once processes end, execs work again.
pub async fn a_run_at_its_pids_limit_refuses_execs_with_a_typed_error(
    cx: &Context,
) -> anyhow::Result<()> {
    let run = cx.driver.start(&base(cx).pids(PIDS)).await?;
    // Processes until the kernel refuses twenty times in a row (awk goes on where a
    // shell that cannot fork gives up), then one more that the filler waits on (a fifo
    // nobody opens, if even that one was refused). They all end by themselves after
    // `FILLED_FOR`, for a path whose kill needs a new process too.
    let filler = run
        .exec_stream(ExecSpec::new([
            "sh",
            "-c",
            &format!(
                r#"mkfifo /tmp/hold && exec awk 'BEGIN {{
                    fails = 0; started = 0
                    while (fails < 20 && started < {most}) {{
                        if (system("sleep {secs} >/dev/null 2>&1 &") != 0) fails++; else {{ fails = 0; started++ }}
                    }}
                    if (fails < 20) {{ print "unlimited"; exit }}
                    print "filled"; fflush()
                    if (("exec sleep {secs}" | getline l) < 0) getline l < "/tmp/hold"
                }}' 2>/dev/null"#,
                secs = FILLED_FOR.as_secs(),
                most = PIDS * 4
            ),
        ]))
        .await?;
    let mut filler = filler;
    let mut seen = Vec::new();
    let filled_at = std::time::Instant::now();
    while !String::from_utf8_lossy(&seen).contains("filled") {
        match tokio::time::timeout(HANG, filler.next_chunk()).await {
            Ok(Some(OutputChunk::Stdout(b) | OutputChunk::Stderr(b))) => seen.extend_from_slice(&b),
            Ok(Some(OutputChunk::Lost(_))) => {}
            Ok(None) => bail!(
                "the filler ended before it filled the run (a limit not enforced?): {}",
                String::from_utf8_lossy(&seen)
            ),
            Err(_) => bail!("the filler did not fill the run in {} s", HANG.as_secs()),
        }
    }
    // The last process the filler starts after it printed.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for _ in 0..3 {
        ensure!(
            filled_at.elapsed() < FILLED_FOR / 2,
            "the run took too long to fill to test it"
        );
        match tokio::time::timeout(HANG, run.exec(ExecSpec::new(["true"]))).await {
            Err(_) => bail!("an exec in a run at its pids limit hung"),
            Ok(Ok(out)) if out.status.success() && run.exec_path() == ExecPath::Plain => {
                // The engine's exec got in; a fork inside the run still cannot.
                let fork = run
                    .exec(ExecSpec::new(["sh", "-c", "true & wait && echo forked"]))
                    .await?;
                ensure!(
                    !fork.stdout_str().contains("forked"),
                    "a fork inside a run at its pids limit succeeded: the run was not full"
                );
            }
            // The engine's runtime could not start (it needs threads inside the run, some
            // of the time; its message need not say why: runc's `read init-p: connection
            // reset by peer`): the engine's refusal with its message, as exit 126 (Docker)
            // or 125 (Podman).
            Ok(Ok(out))
                if matches!(out.status, ExitStatus::Exited(125 | 126))
                    && run.exec_path() == ExecPath::Plain
                    && !(out.stderr_str().trim().is_empty()
                        && out.stdout_str().trim().is_empty()) => {}
            Ok(Ok(out)) => bail!(
                "an exec in a run at its pids limit returned {} (stderr {:?})",
                out.status,
                out.stderr_str()
            ),
            Ok(Err(e)) => {
                ensure!(
                    e.kind() == ErrorKind::LimitReached
                        && e.context_value("limit").is_some_and(|l| l.contains("pids")),
                    "an exec in a run at its pids limit: {e:?}"
                );
            }
        }
    }
    // The filler still runs; dropping its stream kills it, which frees the run.
    drop(filler);
    let mut answered = None;
    for _ in 0..(2 * FILLED_FOR.as_secs() + 10) {
        match run.exec(ExecSpec::new(["echo", "again"])).await {
            Ok(out) if out.status.success() => {
                answered = Some(out);
                break;
            }
            // Refused as above, until the run has room (on the plain path the kill of the
            // filler needs a process too: its processes end by themselves).
            Ok(_) => tokio::time::sleep(Duration::from_millis(500)).await,
            Err(e) if e.kind() == ErrorKind::LimitReached => {
                tokio::time::sleep(Duration::from_millis(500)).await
            }
            Err(e) => return Err(e.into()),
        }
    }
    let out = answered.context("the run still refused execs after its filler was killed")?;
    ensure!(out.stdout_str() == "again\n", "{:?}", out.stdout_str());
    run.stop().await?;
    Ok(())
}

/// `resources.disk_bytes`: with `disk_limit`, a run that writes four times its limit into
/// its root filesystem is ended by the engine: the exec that wrote (and waits) ends as
/// `RunLost` with the engine's reason (never success, an exit status or a hang), the
/// next exec is a `RunLost` error, and stop leaves nothing; without, `Unsupported`
/// naming `resources.disk_bytes` and nothing created.
pub async fn disk_limit_is_enforced_or_unsupported(cx: &Context) -> anyhow::Result<()> {
    let spec = base(cx).disk_bytes(DISK_BYTES);
    if !cx.caps.disk_limit {
        return assert_create_unsupported(cx, &spec, "resources.disk_bytes", "disk_limit").await;
    }
    let run = cx.driver.start(&spec).await?;
    let mb = (DISK_BYTES * 4) >> 20;
    let filler = run
        .exec_stream(ExecSpec::new([
            "sh",
            "-c",
            &format!("dd if=/dev/zero of=/tmp/fill bs=1048576 count={mb} 2>/dev/null; echo wrote; exec sleep 600"),
        ]))
        .await?;
    let status = tokio::time::timeout(DISK_NOTICED, filler.wait())
        .await
        .with_context(|| {
            format!(
                "{mb} MiB written over a {} MiB disk limit: the exec still ran after {} s",
                DISK_BYTES >> 20,
                DISK_NOTICED.as_secs()
            )
        })?;
    let ExitStatus::RunLost(why) = &status else {
        bail!("an exec in a run evicted for its disk use reported {status}");
    };
    ensure!(
        ["ephemeral", "storage", "disk", "evict"]
            .iter()
            .any(|w| why.to_ascii_lowercase().contains(w)),
        "the run was lost, but the reason does not say it was its disk use: {why}"
    );
    match run.exec(ExecSpec::new(["true"])).await {
        Ok(out) => bail!(
            "exec in a run evicted for its disk use returned {}",
            out.status
        ),
        Err(e) => ensure!(e.kind() == ErrorKind::RunLost, "expected run lost, got {e}"),
    }
    run.stop().await?;
    cx.assert_case_clean().await
}

/// `security.cap_drop`: with `cap_drop`, dropping `NET_RAW` clears bit 13 of the exec's
/// effective and bounding sets, and dropping `ALL` leaves both empty; without,
/// `Unsupported` naming `security.cap_drop` and nothing created.
pub async fn cap_drop_is_honoured_or_unsupported(cx: &Context) -> anyhow::Result<()> {
    if !cx.caps.cap_drop {
        let spec = base(cx).cap_drop("NET_RAW");
        return assert_create_unsupported(cx, &spec, "security.cap_drop", "cap_drop").await;
    }
    let run = cx.driver.start(&base(cx).cap_drop("NET_RAW")).await?;
    let bit = 1u64 << CAP_NET_RAW_BIT;
    for set in ["CapEff", "CapBnd"] {
        let caps = cap_set(&*run, set).await?;
        ensure!(
            caps & bit == 0,
            "cap_drop [NET_RAW]: {set} is {caps:016x}, NET_RAW (bit {CAP_NET_RAW_BIT}) still set"
        );
    }
    run.stop().await?;

    let run = cx.driver.start(&base(cx).cap_drop("ALL")).await?;
    for set in ["CapEff", "CapBnd"] {
        let caps = cap_set(&*run, set).await?;
        ensure!(caps == 0, "cap_drop [ALL]: {set} is {caps:016x}, not 0");
    }
    run.stop().await?;
    Ok(())
}

/// `security.no_new_privileges` (on by default): with `no_new_privileges`, the exec's
/// `NoNewPrivs` is 1 by default; without, the default spec is `Unsupported` naming
/// `security.no_new_privileges` and nothing is created. Turned off, a run either shows
/// `NoNewPrivs: 0` or (a driver that cannot turn it off) is `Unsupported` naming it.
pub async fn no_new_privileges_is_honoured_or_unsupported(cx: &Context) -> anyhow::Result<()> {
    let on = cx.spec();
    ensure!(
        on.security.no_new_privileges,
        "no_new_privileges is meant to be on by default"
    );
    if cx.caps.no_new_privileges {
        let run = cx.driver.start(&on).await?;
        let nnp = proc_status(&*run, "NoNewPrivs").await?;
        ensure!(
            nnp == "1",
            "no_new_privileges on (the default): NoNewPrivs is {nnp:?}, not 1"
        );
        run.stop().await?;
    } else {
        assert_create_unsupported(cx, &on, "security.no_new_privileges", "no_new_privileges")
            .await?;
    }

    let off = cx.spec().no_new_privileges(false);
    let result = tokio::time::timeout(HANG, cx.driver.create(&off))
        .await
        .context("creating a run with no_new_privileges off hung")?;
    match result {
        Ok(run) => {
            let nnp = proc_status(&*run, "NoNewPrivs").await;
            run.stop().await?;
            let nnp = nnp?;
            ensure!(
                nnp == "0",
                "no_new_privileges off was accepted, but NoNewPrivs is {nnp:?}, not 0: \
                 a driver that cannot turn it off must say Unsupported"
            );
        }
        Err(e) => {
            ensure!(
                e.kind() == ErrorKind::Unsupported
                    && e.field() == Some("security.no_new_privileges"),
                "no_new_privileges off: expected a run or Unsupported naming \
                 security.no_new_privileges, got {:?} naming {:?}: {e}",
                e.kind(),
                e.field()
            );
            cx.assert_case_clean()
                .await
                .context("after no_new_privileges off was refused")?;
        }
    }
    Ok(())
}

/// `security.read_only_rootfs`: with `read_only_rootfs`, even root cannot write to `/` or
/// `/etc`, while `/tmp` and the workspace stay writable; without, `Unsupported` naming
/// `security.read_only_rootfs` and nothing created.
pub async fn read_only_rootfs_is_honoured_or_unsupported(cx: &Context) -> anyhow::Result<()> {
    let spec = base(cx).read_only_rootfs(true);
    if !cx.caps.read_only_rootfs {
        return assert_create_unsupported(
            cx,
            &spec,
            "security.read_only_rootfs",
            "read_only_rootfs",
        )
        .await;
    }
    let run = cx.driver.start(&spec).await?;
    let whoami = sh_stdout(&*run, "id -u").await?;
    for path in ["/ro-probe", "/etc/ro-probe"] {
        let out = run
            .exec(ExecSpec::new([
                "sh",
                "-c",
                &format!("echo x > {path} && echo written"),
            ]))
            .await?;
        ensure!(
            !out.status.success() && out.stdout_str().trim().is_empty(),
            "read-only root: writing {path} as uid {whoami} succeeded ({})",
            out.status
        );
        let left = sh_stdout(
            &*run,
            &format!("[ -e {path} ] && echo there || echo absent"),
        )
        .await?;
        ensure!(left == "absent", "read-only root: {path} exists");
    }
    let ws = spec.workspace.path.trim_end_matches('/').to_string();
    for dir in ["/tmp", ws.as_str()] {
        let got = sh_stdout(
            &*run,
            &format!("echo rw > {dir}/rw-probe && cat {dir}/rw-probe && rm {dir}/rw-probe"),
        )
        .await
        .with_context(|| format!("read-only root: {dir} must stay writable"))?;
        ensure!(
            got == "rw",
            "read-only root: {dir}/rw-probe read back {got:?}"
        );
    }
    run.stop().await?;
    Ok(())
}

/// `ExecSpec::user` with numeric users: with `exec_user`, `1000` runs as uid 1000 and
/// `1000:1000` as uid and gid 1000, and the run's own user is unchanged afterwards;
/// without, `Unsupported` naming `user` and the command never starts.
pub async fn exec_user_is_honoured_or_unsupported(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&base(cx)).await?;
    let own = sh_stdout(&*run, "id -u; id -g").await?;
    if cx.caps.exec_user {
        let as_user =
            |user: &str| ExecSpec::new(["sh", "-c", "id -u; id -g"]).user(user.to_string());
        let out = run.exec(as_user("1000")).await?;
        ensure!(out.status.success(), "exec as 1000: {}", out.status);
        let uid = out.stdout_str().lines().next().unwrap_or("").to_string();
        ensure!(uid == "1000", "exec as 1000: id -u is {uid:?}");
        let out = run.exec(as_user("1000:1000")).await?;
        ensure!(
            out.status.success() && out.stdout_str() == "1000\n1000\n",
            "exec as 1000:1000: {}, id -u/-g {:?}",
            out.status,
            out.stdout_str()
        );
    } else {
        for user in ["1000", "1000:1000"] {
            let marker = "/tmp/exec-user-ran";
            let spec = ExecSpec::new(["sh", "-c", &format!("touch {marker}")]).user(user);
            assert_exec_unsupported(&*run, spec, marker, "user", "exec_user")
                .await
                .with_context(|| format!("user {user}"))?;
        }
    }
    let after = sh_stdout(&*run, "id -u; id -g").await?;
    ensure!(
        after == own,
        "a per-exec user changed the run's user: {own:?} before, {after:?} after"
    );
    run.stop().await?;
    Ok(())
}

/// Users given by name: with `user_names`, a run with `user: nobody` runs its execs as
/// uid/gid 65534, and (with `exec_user` too) an exec as `nobody` does; without, the run is
/// `Unsupported` naming `user` with nothing created, and the exec is `Unsupported` naming
/// `user` and never starts.
pub async fn user_names_are_honoured_or_unsupported(cx: &Context) -> anyhow::Result<()> {
    let mut named = base(cx);
    named.user = Some("nobody".into());
    if cx.caps.user_names {
        let run = cx.driver.start(&named).await?;
        let ids = sh_stdout(&*run, "id -u; id -g").await?;
        ensure!(
            ids == "65534\n65534",
            "run as nobody: id -u/-g {ids:?}, not 65534/65534"
        );
        run.stop().await?;
    } else {
        assert_create_unsupported(cx, &named, "user", "user_names").await?;
    }

    let run = cx.driver.start(&base(cx)).await?;
    if cx.caps.exec_user && cx.caps.user_names {
        let out = run
            .exec(ExecSpec::new(["sh", "-c", "id -u; id -g"]).user("nobody"))
            .await?;
        ensure!(
            out.status.success() && out.stdout_str() == "65534\n65534\n",
            "exec as nobody: {}, id -u/-g {:?}",
            out.status,
            out.stdout_str()
        );
    } else {
        let marker = "/tmp/exec-user-name-ran";
        let spec = ExecSpec::new(["sh", "-c", &format!("touch {marker}")]).user("nobody");
        let flag = if cx.caps.exec_user {
            "user_names"
        } else {
            "exec_user"
        };
        assert_exec_unsupported(&*run, spec, marker, "user", flag).await?;
    }
    run.stop().await?;
    Ok(())
}

/// Reads stdout chunks until `want` has arrived, failing after `within`.
async fn read_until(
    stream: &mut runcell_core::ExecStream,
    stdout: &mut Vec<u8>,
    stderr: &mut Vec<u8>,
    want: &[u8],
    within: Duration,
) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + within;
    while !stdout.windows(want.len()).any(|w| w == want) {
        match tokio::time::timeout_at(deadline, stream.next_chunk()).await {
            Err(_) => bail!(
                "no {:?} within {within:?} (stdout so far {:?}, stderr {:?}): stdin is not streamed",
                String::from_utf8_lossy(want),
                String::from_utf8_lossy(stdout),
                String::from_utf8_lossy(stderr)
            ),
            Ok(None) => bail!(
                "the output ended before {:?} (stdout {:?}, stderr {:?})",
                String::from_utf8_lossy(want),
                String::from_utf8_lossy(stdout),
                String::from_utf8_lossy(stderr)
            ),
            Ok(Some(OutputChunk::Lost(n))) => bail!("{n} output bytes lost"),
            Ok(Some(OutputChunk::Stdout(b))) => stdout.extend_from_slice(&b),
            Ok(Some(OutputChunk::Stderr(b))) => stderr.extend_from_slice(&b),
        }
    }
    Ok(())
}

/// `Stdin::Piped`: with `stdin_streaming`, a conversation works: the command's reply to a
/// first line arrives while stdin is still open, a second line gets its reply after it,
/// closing stdin ends the command, and its exit status comes back; without, `Unsupported`
/// naming `stdin` and the command never starts.
pub async fn stdin_streaming_is_honoured_or_unsupported(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&base(cx)).await?;
    if !cx.caps.stdin_streaming {
        let marker = "/tmp/piped-stdin-ran";
        let spec = ExecSpec::new(["sh", "-c", &format!("touch {marker}; cat")]).stdin_piped();
        assert_exec_unsupported(&*run, spec, marker, "stdin", "stdin_streaming").await?;
        run.stop().await?;
        return Ok(());
    }
    let script = "read a; echo got-$a; read b; echo got-$b; read c || echo eof; exit 3";
    let mut stream = run
        .exec_stream(
            ExecSpec::new(["sh", "-c", script])
                .stdin_piped()
                .timeout(Duration::from_secs(120)),
        )
        .await?;
    let mut stdin = stream
        .take_stdin()
        .context("a piped exec has no stdin writer")?;
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    let within = Duration::from_secs(30);
    stdin.write(Bytes::from_static(b"one\n")).await?;
    read_until(&mut stream, &mut stdout, &mut stderr, b"got-one\n", within)
        .await
        .context("the reply to the first line, stdin still open")?;
    ensure!(
        stdout == b"got-one\n",
        "after the first line: {:?}",
        String::from_utf8_lossy(&stdout)
    );
    stdin.write(Bytes::from_static(b"two\n")).await?;
    read_until(&mut stream, &mut stdout, &mut stderr, b"got-two\n", within)
        .await
        .context("the reply to the second line, stdin still open")?;
    stdin.close();
    read_until(&mut stream, &mut stdout, &mut stderr, b"eof\n", within)
        .await
        .context("EOF after closing stdin")?;
    while let Some(chunk) = tokio::time::timeout(within, stream.next_chunk())
        .await
        .context("the output did not end after the command exited")?
    {
        match chunk {
            OutputChunk::Stdout(b) => stdout.extend_from_slice(&b),
            OutputChunk::Stderr(b) => stderr.extend_from_slice(&b),
            OutputChunk::Lost(n) => bail!("{n} output bytes lost"),
        }
    }
    let status = tokio::time::timeout(within, stream.wait())
        .await
        .context("no exit status after the command exited")?;
    ensure!(
        stdout == b"got-one\ngot-two\neof\n",
        "conversation: stdout {:?}, stderr {:?}",
        String::from_utf8_lossy(&stdout),
        String::from_utf8_lossy(&stderr)
    );
    ensure!(
        status == ExitStatus::Exited(3),
        "conversation: expected exit 3, got {status}"
    );
    run.stop().await?;
    Ok(())
}

/// `network: none`: with `network_none`, the only interface is `lo`; without,
/// `Unsupported` naming `network` and nothing created.
pub async fn network_none_is_honoured_or_unsupported(cx: &Context) -> anyhow::Result<()> {
    let spec = base(cx).network(Network::None);
    if !cx.caps.network_none {
        return assert_create_unsupported(cx, &spec, "network", "network_none").await;
    }
    let run = cx.driver.start(&spec).await?;
    let ifaces = sh_stdout(&*run, "ls /sys/class/net").await?;
    let ifaces: Vec<&str> = ifaces.split_whitespace().collect();
    ensure!(
        ifaces == ["lo"],
        "network none: interfaces {ifaces:?}, want only lo"
    );
    run.stop().await?;
    Ok(())
}
