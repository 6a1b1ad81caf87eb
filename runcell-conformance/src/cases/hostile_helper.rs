//! A hostile exec helper: code in the sandbox (root) stops the helper, writes what it
//! likes on the helper's stdout and stderr, or replaces the helper's binary. Whatever it
//! does, the host stays bounded in time (an exec ends within its timeout plus the kill
//! bound, its processes killed) and in memory, and the helper an attach runs is the one
//! the library ships.
//!
//! On the plain path there is no helper to attack: these cases check only that the run
//! works there.

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use runcell_core::{DriverExt, ExecPath, ExecSpec, ExitStatus, KILL_BOUND, Run, RunExt};

use super::robustness::wait_gone;
use crate::{Context, RssSampler, sh_ok, sh_stdout};

/// How long past its deadline a helper's answer to a spawn is still awaited (core's
/// `ANSWER_GRACE`).
const ANSWER_GRACE: Duration = Duration::from_secs(2);
/// How long a helper may take to greet (core's `GREETING_TIMEOUT`).
const GREETING: Duration = Duration::from_secs(8);
/// Host memory a hostile helper may cost, at most.
const MEMORY_BOUND: u64 = 64 << 20;
/// The timeout of the execs the cases time.
const TIMEOUT: Duration = Duration::from_secs(3);

/// The longest an exec with [`TIMEOUT`] may take, whatever the helper does.
fn exec_bound() -> Duration {
    TIMEOUT + ANSWER_GRACE + KILL_BOUND
}

/// Prints the pid of every process running the helper (its command line starts with the
/// helper's path: a script standing in for it has its interpreter first).
const HELPER_PIDS: &str = "for d in /proc/[0-9]*; do \
     case \"$(tr '\\0' ' ' < $d/cmdline 2>/dev/null)\" in \
       /.runcell/helper*) echo ${d#/proc/};; esac; done";

/// The pid of the helper that serves this run's execs: the parent of an exec's
/// shepherd (`$PPID` of the exec). (Not "the one helper process": CI once saw a second
/// helper beside it in a pooled run under load, for a moment.)
async fn helper_pid(run: &dyn Run) -> anyhow::Result<u32> {
    let script = "set -- $(sed 's/.*) //' /proc/$PPID/stat); p=$2; \
                  echo $p $(tr '\\0' ' ' < /proc/$p/cmdline)";
    let line = sh_stdout(run, script).await?;
    let (pid, cmdline) = line.split_once(' ').unwrap_or((&line, ""));
    match pid.parse::<u32>() {
        Ok(pid) if cmdline.starts_with("/.runcell/helper") => Ok(pid),
        _ => bail!("the exec's shepherd's parent is not the helper: {line:?}"),
    }
}

/// Kills the helper from inside, its daemon and every relay (its stream breaks: the next
/// exec starts a new one). The killer is itself a child of the daemon: it may or may not
/// report, and it has no grace (its stream does not resume, so that the exec after it is
/// the one that starts the new session).
async fn kill_helper(run: &dyn Run) {
    let script = format!("for p in $({HELPER_PIDS}); do kill -9 $p; done");
    let _ = run
        .exec(
            ExecSpec::new(["sh", "-c", &script])
                .timeout(Duration::from_secs(20))
                .grace(Duration::ZERO),
        )
        .await;
}

/// Waits until no helper process is stopped (state `T`): one the host gave up on must not
/// stay behind stopped for good.
async fn no_stopped_helper(run: &dyn Run, within: Duration) -> anyhow::Result<()> {
    let script = format!(
        "for p in $({HELPER_PIDS}); do s=$(cat /proc/$p/stat 2>/dev/null) && \
           set -- ${{s##*) }} && echo \"$p $1\"; done"
    );
    let start = Instant::now();
    loop {
        let states = sh_stdout(run, &script).await?;
        if !states.lines().any(|l| l.ends_with(" T")) {
            return Ok(());
        }
        if start.elapsed() > within {
            bail!("a stopped helper is still there after {within:?}: {states}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `kill -STOP` on the helper, before it answers a spawn or while the exec runs: an exec
/// with a 3 s timeout still ends `TimedOut` within its timeout plus the kill bound, its
/// processes are gone, the stopped helper does not stay behind, and the next exec runs
/// through a new helper.
pub async fn a_stopped_helper_cannot_stretch_a_timeout(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    if run.exec_path() != ExecPath::Helper {
        ensure!(sh_stdout(&*run, "echo plain").await? == "plain");
        run.stop().await?;
        return Ok(());
    }

    // Stopped while the exec runs (after it started: the exec stops it itself).
    let pid = helper_pid(&*run).await?;
    let started = Instant::now();
    let out = run
        .exec(
            ExecSpec::new([
                "sh",
                "-c",
                "sleep 0.5; kill -STOP \"$1\"; sleep 1304",
                "sh",
                &pid.to_string(),
            ])
            .timeout(TIMEOUT),
        )
        .await?;
    let took = started.elapsed();
    ensure!(
        out.status == ExitStatus::TimedOut,
        "an exec whose helper was stopped while it ran: {}",
        out.status
    );
    ensure!(
        took < exec_bound(),
        "an exec with a {TIMEOUT:?} timeout whose helper was stopped took {took:?}"
    );
    wait_gone(&*run, "sleep 1304", Duration::from_secs(10)).await?;
    ensure!(run.exec_path() == ExecPath::Helper);
    ensure!(sh_stdout(&*run, "echo after-stop").await? == "after-stop");
    no_stopped_helper(&*run, Duration::from_secs(10)).await?;

    // Stopped before it reads the spawn (by a background process of an earlier exec).
    let pid = helper_pid(&*run).await?;
    sh_ok(
        &*run,
        &format!("(sleep 0.3; kill -STOP {pid}) >/dev/null 2>&1 </dev/null &"),
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let started = Instant::now();
    let out = run
        .exec(ExecSpec::new(["sleep", "1305"]).timeout(TIMEOUT))
        .await?;
    let took = started.elapsed();
    ensure!(
        out.status == ExitStatus::TimedOut,
        "an exec sent to a stopped helper: {}",
        out.status
    );
    ensure!(
        took < exec_bound(),
        "an exec with a {TIMEOUT:?} timeout sent to a stopped helper took {took:?}"
    );
    ensure!(sh_stdout(&*run, "echo after-stop").await? == "after-stop");
    wait_gone(&*run, "sleep 1305", Duration::from_secs(10)).await?;
    no_stopped_helper(&*run, Duration::from_secs(10)).await?;
    run.stop().await?;
    Ok(())
}

/// Puts a stand-in for the helper in place: a script whose `body` runs after it marks
/// that it ran, installed over `/.runcell/helper` by a loop racing the library's upload
/// until the stand-in ran once; then kills the helper, so that the next exec starts a
/// new session (the loop has a session of its own, so that the kill of the killer, which
/// may walk the helper's session, leaves it alone). `/tmp/hostile/real` is a copy of the real helper, for stand-ins that
/// replay its greeting or relay to it.
async fn install_stand_in(run: &dyn Run, body: &str) -> anyhow::Result<()> {
    let script = format!("#!/bin/sh\ntouch /tmp/hostile/ran\n{body}\n");
    let setup = format!(
        "rm -rf /tmp/hostile && mkdir -p /tmp/hostile && cp /.runcell/helper /tmp/hostile/real && \
         cat > /tmp/hostile/fake <<'EOF'\n{script}EOF\n\
         chmod 755 /tmp/hostile/fake\n\
         setsid sh -c 'while [ ! -e /tmp/hostile/ran ]; do \
            cp /tmp/hostile/fake /.runcell/helper.x && mv -f /.runcell/helper.x /.runcell/helper; \
          done' >/dev/null 2>&1 </dev/null &"
    );
    sh_ok(run, &setup).await?;
    kill_helper(run).await;
    Ok(())
}

/// Whether the stand-in ran; if not (the upload won every race), stops its loop.
async fn stand_in_ran(run: &dyn Run) -> anyhow::Result<bool> {
    let ran = sh_stdout(run, "test -e /tmp/hostile/ran && echo yes || echo no").await? == "yes";
    if !ran {
        sh_ok(run, "touch /tmp/hostile/ran").await?;
    }
    Ok(ran)
}

/// A stand-in that relays to the real helper (so the session works) and, when told,
/// floods the stream's stderr, then writes bytes that are no frame on its stdout.
const RELAY: &str = "exec 3<&0\n\
     /tmp/hostile/real <&3 3<&- &\n\
     exec 0</dev/null\n\
     while [ ! -e /tmp/hostile/flood ]; do sleep 0.1; done\n\
     head -c 209715200 /dev/zero >&2\n\
     while [ ! -e /tmp/hostile/garbage ]; do sleep 0.1; done\n\
     printf '\\377\\377\\377\\377\\103garbage'\n\
     wait";

/// What sandbox code writes on the helper's own streams (a stand-in that relays to the
/// real helper and shares its stdout and stderr): 200 MiB on stderr is logged up to a cap,
/// never kept; bytes that are no frame on stdout drop the session, its exec in flight ends
/// `TransportLost` with its processes killed, and the next exec runs through a new helper.
/// The host's memory stays bounded throughout.
pub async fn garbage_on_the_helpers_streams_costs_only_its_session(
    cx: &Context,
) -> anyhow::Result<()> {
    // The stand-in must win its race with the upload at least once in five runs.
    for _ in 0..5 {
        let run = cx.driver.start(&cx.spec()).await?;
        if run.exec_path() != ExecPath::Helper {
            ensure!(sh_stdout(&*run, "echo plain").await? == "plain");
            run.stop().await?;
            return Ok(());
        }
        let result = garbage(&*run).await;
        run.stop().await?;
        if result? {
            return Ok(());
        }
    }
    bail!("the stand-in never won its race with the upload; the case proves nothing")
}

async fn garbage(run: &dyn Run) -> anyhow::Result<bool> {
    install_stand_in(run, RELAY).await?;
    // The stand-in's loop renames its file over the helper's path without pause: an
    // engine's extractor (Podman's) can lose every try of the library's upload to it.
    // That is the sandbox breaking its own helper, a typed error; this try proves
    // nothing, and the caller stops the run.
    let relayed = match sh_stdout(run, "echo relayed").await {
        Err(e) if format!("{e:#}").contains("upload archive failed") => return Ok(false),
        other => other?,
    };
    ensure!(relayed == "relayed");
    if !stand_in_ran(run).await? {
        return Ok(false);
    }
    let sampler = RssSampler::start();

    // 200 MiB on its stderr.
    let started = Instant::now();
    sh_ok(run, "touch /tmp/hostile/flood").await?;
    // The flood is done once the stand-in waits for its next signal.
    let flooded = async {
        loop {
            let out = sh_stdout(
                run,
                "for d in /proc/[0-9]*; do tr '\\0' ' ' < $d/cmdline 2>/dev/null; echo; done",
            )
            .await?;
            if !out.contains("head -c 209715200") {
                return anyhow::Ok(());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), flooded)
        .await
        .context("a stderr flood of 200 MiB took over 60 s")??;
    ensure!(sh_stdout(run, "echo after-flood").await? == "after-flood");
    ensure!(
        started.elapsed() < Duration::from_secs(60),
        "a stderr flood took {:?}",
        started.elapsed()
    );

    // Garbage on its stdout while an exec runs.
    let mut victim = run
        .exec_stream(ExecSpec::new(["sh", "-c", "echo started; sleep 1306"]))
        .await?;
    ensure!(
        victim.next_chunk().await.is_some(),
        "no output before the garbage"
    );
    let started = Instant::now();
    // Its own stream breaks too: it may or may not report.
    let _ = run
        .exec(
            ExecSpec::new(["sh", "-c", "touch /tmp/hostile/garbage; sleep 1"])
                .timeout(Duration::from_secs(10)),
        )
        .await;
    // An exec whose stream broke (its grace the default) is resumed through a new helper
    // once: a reconnect (bounded at 15 s: an engine exec, an upload, the greeting; on a
    // run whose new helper cannot start and that takes the plain path now, none), whose
    // daemon has no record of it (bounded at 10 s: `ANSWER_TIMEOUT`); then it is killed
    // by the exec marker (`KILL_BOUND`). On a loaded Kubernetes test node this took more
    // than 22 s.
    let lost_bound = Duration::from_secs(15 + 10) + KILL_BOUND + ANSWER_GRACE;
    let status = tokio::time::timeout(lost_bound, victim.wait())
        .await
        .context("an exec did not end when garbage broke its helper's stream")?;
    ensure!(
        matches!(status, ExitStatus::TransportLost(_)),
        "an exec whose helper stream carried garbage: {status}"
    );
    ensure!(
        started.elapsed() < lost_bound,
        "the garbage took {:?} to end the session",
        started.elapsed()
    );
    wait_gone(run, "sleep 1306", Duration::from_secs(10)).await?;
    ensure!(run.exec_path() == ExecPath::Helper);
    ensure!(sh_stdout(run, "echo after-garbage").await? == "after-garbage");
    if let Some(growth) = sampler.stop().await {
        ensure!(
            growth < MEMORY_BOUND,
            "host memory grew by {} MiB while the helper's streams were flooded",
            growth >> 20
        );
    }
    Ok(true)
}

/// One stand-in for the helper: what the script does after it marks that it ran.
struct Fake {
    name: &'static str,
    body: &'static str,
    /// The exec to time reads stdin (for a stand-in that lies about stdin).
    stdin: bool,
}

/// The greeting of the real helper, replayed: `/tmp/hostile/real` is a copy of it, and its
/// digest is its own, so a replay passes the host's check of the greeting.
const REPLAY_HELLO: &str = "/tmp/hostile/real </dev/null 2>/dev/null | head -c 45";

const FAKES: &[Fake] = &[
    Fake {
        name: "never-greets",
        body: "exec sleep 1000",
        stdin: false,
    },
    Fake {
        name: "floods-stderr",
        body: "exec yes stderr-flood-before-the-greeting >&2",
        stdin: false,
    },
    Fake {
        name: "garbage",
        body: "printf 'this is not a frame at all'; exec sleep 1000",
        stdin: false,
    },
    Fake {
        name: "replays-then-floods-started",
        // STARTED (65) for id 1 with pid 42, forever.
        body: "while :; do printf '\\011\\000\\000\\000\\101\\001\\000\\000\\000\\052\\000\\000\\000'; done",
        stdin: false,
    },
    Fake {
        name: "replays-then-floods-stderr-and-never-answers",
        body: "exec yes stderr-flood-after-the-greeting >&2",
        stdin: false,
    },
    Fake {
        name: "replays-then-acknowledges-u32-max",
        // STARTED for id 1, then STDIN_ACK (70) of 0xffffffff bytes.
        body: "printf '\\011\\000\\000\\000\\101\\001\\000\\000\\000\\052\\000\\000\\000'; \
               printf '\\011\\000\\000\\000\\106\\001\\000\\000\\000\\377\\377\\377\\377'; \
               exec sleep 1000",
        stdin: true,
    },
];

/// The helper's binary replaced, by a loop racing the library's upload, with a script that
/// never greets, floods stderr, writes garbage, or replays the real greeting and then floods
/// `STARTED` frames, never answers, or acknowledges more stdin than was sent. Each time, the
/// exec that starts the new session ends within its timeout plus the greeting and kill
/// bounds (as an error where the helper is required), the host's memory stays bounded,
/// and once the stand-in is gone the run works again.
pub async fn a_hostile_helper_binary_cannot_stall_or_bloat_the_host(
    cx: &Context,
) -> anyhow::Result<()> {
    for fake in FAKES {
        let mut ran = false;
        // The stand-in must win its race with the upload at least once in three runs.
        for _ in 0..3 {
            let run = cx.driver.start(&cx.spec()).await?;
            if run.exec_path() != ExecPath::Helper {
                ensure!(sh_stdout(&*run, "echo plain").await? == "plain");
                run.stop().await?;
                return Ok(());
            }
            let result = attack(&*run, fake).await;
            run.stop().await?;
            if result? {
                ran = true;
                break;
            }
        }
        ensure!(
            ran,
            "{}: the stand-in never won its race with the upload; the case proves nothing",
            fake.name
        );
    }
    Ok(())
}

/// One attack of [`a_hostile_helper_binary_cannot_stall_or_bloat_the_host`]: whether the
/// stand-in ran.
async fn attack(run: &dyn Run, fake: &Fake) -> anyhow::Result<bool> {
    let name = fake.name;
    let replay = if name.starts_with("replays") {
        format!("{REPLAY_HELLO}; ")
    } else {
        String::new()
    };
    install_stand_in(run, &format!("{replay}{}", fake.body)).await?;

    let sampler = RssSampler::start();
    let mut spec = ExecSpec::new(["sh", "-c", "cat >/dev/null; echo done"]).timeout(TIMEOUT);
    if fake.stdin {
        spec = spec.stdin_bytes(vec![b'i'; 100]);
    }
    let started = Instant::now();
    let result = run.exec(spec).await;
    let took = started.elapsed();
    let growth = sampler.stop().await;
    // A stand-in that greets is a session like any: the exec's bound. One that does not
    // costs the greeting's bound, then the exec takes the plain path or fails.
    let bound = if name.starts_with("replays") {
        exec_bound()
    } else {
        GREETING + TIMEOUT + Duration::from_secs(5)
    };
    ensure!(
        took < bound,
        "{name}: the exec took {took:?}, over {bound:?} ({result:?})"
    );
    if let Some(growth) = growth {
        ensure!(
            growth < MEMORY_BOUND,
            "{name}: host memory grew by {} MiB",
            growth >> 20
        );
    }

    // Once the stand-in ran, the loop is gone: the next session runs the real helper again
    // (or the run went on with plain execs).
    let after = tokio::time::timeout(bound + GREETING, async {
        loop {
            match run.exec(ExecSpec::new(["sh", "-c", "echo again"])).await {
                Ok(out) if out.status.success() => return out.stdout_str(),
                _ => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    })
    .await;
    if !stand_in_ran(run).await? {
        // The upload won the race: this attempt shows nothing.
        return Ok(false);
    }
    let after = after.with_context(|| format!("{name}: the run did not recover"))?;
    ensure!(after == "again\n", "{name}: {after:?}");
    if let Ok(out) = &result {
        ensure!(
            !out.status.success() || run.exec_path() == ExecPath::Plain,
            "{name}: an exec through a stand-in for the helper succeeded: {}",
            out.status
        );
    }
    Ok(true)
}

/// A helper binary replaced from inside is never run: a new session (after the helper
/// died, and in an attached run) uploads the shipped helper again first. Checked from
/// inside: the stand-in never ran, one helper runs from the helper's path, and the file
/// there is the one the run started with again. (The helper is not dumpable: sandbox code
/// without `CAP_SYS_PTRACE` cannot open its `/proc/<pid>/exe` or its streams.)
pub async fn a_new_session_runs_the_shipped_helper(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.create(&cx.spec()).await?;
    if run.exec_path() != ExecPath::Helper {
        let plain = sh_stdout(&*run, "echo plain").await;
        run.stop().await?;
        ensure!(plain? == "plain");
        return Ok(());
    }
    let id = run.id().to_string();
    let replaced = async {
        sh_ok(&*run, "cp /.runcell/helper /tmp/shipped").await?;
        sh_ok(&*run, REPLACE).await?;
        kill_helper(&*run).await;
        ensure!(sh_stdout(&*run, "echo again").await? == "again");
        ensure!(run.exec_path() == ExecPath::Helper);
        one_shipped_helper(&*run, "after the helper died").await?;
        sh_ok(&*run, REPLACE).await
    }
    .await;
    if let Err(e) = replaced {
        run.stop().await?;
        return Err(e);
    }
    if !cx.caps.attach {
        run.stop().await?;
        return Ok(());
    }
    drop(run);
    let again = cx.driver.attach(&id).await?;
    let attached = async {
        ensure!(sh_stdout(&*again, "echo attached").await? == "attached");
        ensure!(again.exec_path() == ExecPath::Helper);
        one_shipped_helper(&*again, "after an attach").await
    }
    .await;
    again.stop().await?;
    attached
}

/// Replaces the helper's binary with a script that marks that it ran.
const REPLACE: &str = "printf '#!/bin/sh\\ntouch /tmp/fake-ran\\nexec sleep 1000\\n' > /.runcell/helper.x && \
     chmod 755 /.runcell/helper.x && mv -f /.runcell/helper.x /.runcell/helper";

/// Waits until exactly one helper daemon runs (an old one may still be ending), the file
/// at the helper's path is the shipped one, and no stand-in ever ran.
async fn one_shipped_helper(run: &dyn Run, when: &str) -> anyhow::Result<()> {
    let script = format!(
        "n=0; for p in $({HELPER_PIDS}); do case \"$(tr '\\0' ' ' < /proc/$p/cmdline)\" in \
           *' --daemon '*) n=$((n+1));; esac; done; echo helpers=$n; \
         cmp -s /.runcell/helper /tmp/shipped && echo file=shipped || echo file=other; \
         test -e /tmp/fake-ran && echo fake-ran; true"
    );
    let start = Instant::now();
    loop {
        let seen = sh_stdout(run, &script).await?;
        ensure!(
            !seen.contains("fake-ran"),
            "{when}: the replaced binary ran"
        );
        ensure!(
            seen.contains("file=shipped"),
            "{when}: the helper's file is not the shipped one ({seen:?})"
        );
        if seen.contains("helpers=1\n") {
            return Ok(());
        }
        if start.elapsed() > Duration::from_secs(10) {
            bail!("{when}: {seen:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
