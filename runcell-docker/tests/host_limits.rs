//! The host process runs out of file descriptors (its `RLIMIT_NOFILE`) while it starts
//! runs and runs commands: every failure is [`ErrorKind::LimitReached`] naming the limit,
//! nothing panics or hangs, the runs already started keep working once descriptors are
//! free again, and nothing a failed start made is left. (A file of its own: the limit is
//! the whole process's.)

use std::collections::BTreeMap;
use std::time::Duration;

use runcell_core::{
    Driver, DriverExt, ErrorKind, ExecHelper, ExecSpec, Network, PullPolicy, RunExt, RunGuard,
    RunSpec,
};
use runcell_docker::DockerConfig;
use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};

mod common;

const CASE: &str = "host-fd-limit";

fn open_fds() -> u64 {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_out_of_host_file_descriptors_is_a_typed_error() {
    let Some(driver) = common::docker_or_skip("host_limits", DockerConfig::default()).await else {
        return;
    };
    let spec = RunSpec::new("sandbox-test/busybox:latest")
        .pull(PullPolicy::Never)
        .network(Network::None)
        .exec_helper(ExecHelper::Required)
        .label("sandbox.test/case", CASE);
    let label: BTreeMap<String, String> = [("sandbox.test/case".into(), CASE.into())].into();
    let mut runs: Vec<RunGuard> = Vec::new();
    for _ in 0..2 {
        runs.push(driver.start(&spec).await.expect("a run"));
    }
    for run in &runs {
        run.exec(ExecSpec::new(["true"])).await.unwrap();
    }

    // A limit a few descriptors above what is open: the next runs run out of them.
    let saved = getrlimit(Resource::Nofile);
    let mut refused = Vec::new();
    for headroom in [0usize, 1, 2, 3, 4, 6, 8, 12] {
        // Every descriptor number below the limit taken, but `headroom` of them.
        setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some(open_fds() + 64),
                maximum: saved.maximum,
            },
        )
        .unwrap();
        let mut filler = Vec::new();
        while let Ok(f) = std::fs::File::open("/dev/null") {
            filler.push(f);
        }
        filler.truncate(filler.len().saturating_sub(headroom));
        // Other work lets its descriptors go a moment later: a start that failed half-way
        // must then still remove what it made.
        let filler = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            drop(filler);
        });
        let attempt = tokio::time::timeout(Duration::from_secs(120), async {
            let started = driver.start(&spec).await;
            let exec = runs[0].exec(ExecSpec::new(["echo", "still"])).await;
            (started, exec)
        })
        .await;
        filler.await.unwrap();
        setrlimit(Resource::Nofile, saved).unwrap();
        let (started, exec) = attempt.unwrap_or_else(|_| panic!("hung at {headroom} spare"));
        match started {
            Ok(run) => runs.push(run),
            Err(e) => refused.push(e),
        }
        if let Err(e) = exec {
            refused.push(e);
        }
    }
    assert!(!refused.is_empty(), "no operation ran out of descriptors");
    for e in &refused {
        eprintln!("refused: {e:?}");
    }
    for e in &refused {
        assert_eq!(e.kind(), ErrorKind::LimitReached, "{e:?}");
        assert!(
            e.context_value("limit")
                .is_some_and(|l| l.contains("open files")),
            "{e:?}"
        );
        assert!(e.is_temporary());
    }
    eprintln!(
        "{} operations refused, {} runs started; first: {}",
        refused.len(),
        runs.len(),
        refused[0]
    );

    // Descriptors free again: every run answers; the failed starts left nothing.
    for run in &runs {
        let out = run.exec(ExecSpec::new(["echo", "after"])).await.unwrap();
        assert_eq!(out.stdout_str(), "after\n");
    }
    let ours = |listed: Vec<runcell_core::RunInfo>| {
        let pid = std::process::id().to_string();
        listed
            .into_iter()
            .filter(|r| r.labels.get("sandbox.dev/owner-pid") == Some(&pid))
            .map(|r| r.id)
            .collect::<Vec<_>>()
    };
    let listed = ours(driver.list(&label).await.unwrap());
    assert_eq!(listed.len(), runs.len(), "{listed:?}");
    for run in runs {
        run.stop().await.unwrap();
    }
    let left = ours(driver.list(&label).await.unwrap());
    assert!(left.is_empty(), "{left:?}");
}
