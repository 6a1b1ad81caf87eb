//! The engine becomes unreachable in the middle of a run: the running exec tries to
//! resume for its grace (3 s here), then ends as `TransportLost`, and the next exec fails
//! as `Unavailable`, both within a bounded time, with no retry storm. The outage is a unix-socket relay to the real daemon that the
//! test cuts.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use runcell_core::{Driver, ErrorKind, ExecSpec, ExitStatus, Network, RunExt, RunSpec};
use runcell_docker::{DockerConfig, DockerDriver};
use tokio::net::{UnixListener, UnixStream};
use tokio::task::JoinSet;

mod common;

const DAEMON: &str = "/var/run/docker.sock";

/// Relays connections to the daemon until the returned set is dropped or aborted.
fn relay(listener: UnixListener) -> JoinSet<()> {
    let mut tasks = JoinSet::new();
    tasks.spawn(async move {
        let mut conns = JoinSet::new();
        while let Ok((mut client, _)) = listener.accept().await {
            conns.spawn(async move {
                if let Ok(mut daemon) = UnixStream::connect(DAEMON).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut daemon).await;
                }
            });
        }
    });
    tasks
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_outage_mid_run_is_reported_fast() {
    let config = DockerConfig::default().host(format!("unix://{DAEMON}"));
    let Some(direct) = common::docker_or_skip("engine_outage", config).await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("relay.sock");
    let mut relay_tasks = relay(UnixListener::bind(&socket).unwrap());
    let via_relay = DockerDriver::connect(
        DockerConfig::default()
            .host(format!("unix://{}", socket.display()))
            .timeout(Duration::from_secs(5)),
    )
    .await
    .unwrap();

    let mut spec =
        RunSpec::new("sandbox-test/busybox:latest").label("sandbox.test/case", "engine-outage");
    spec.network = Network::None;
    let run = via_relay.create(&spec).await.unwrap();
    let running = run
        .exec_stream(ExecSpec::new(["sleep", "600"]).grace(Duration::from_secs(3)))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;

    // The outage: every relayed connection and the socket go away.
    relay_tasks.abort_all();
    while relay_tasks.join_next().await.is_some() {}
    std::fs::remove_file(&socket).unwrap();

    let started = Instant::now();
    let status = tokio::time::timeout(Duration::from_secs(30), running.wait())
        .await
        .expect("the running exec hung");
    assert!(
        matches!(status, ExitStatus::TransportLost(_)),
        "got {status}"
    );
    let e = run.exec(ExecSpec::new(["true"])).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert_eq!(
        e.context_value("address"),
        Some(format!("unix://{}", socket.display()).as_str()),
        "{e}"
    );
    // The grace (3 s), the kill's bound through the unreachable engine
    // (`runcell_core::KILL_BOUND`, 10 s), and the next exec's engine timeout (5 s).
    assert!(
        started.elapsed()
            < Duration::from_secs(3) + runcell_core::KILL_BOUND + Duration::from_secs(6),
        "took {:?}",
        started.elapsed()
    );

    // The run itself is still there; the direct connection cleans it up.
    let selector = BTreeMap::from([("sandbox.test/case".to_string(), "engine-outage".to_string())]);
    for r in direct.list(&selector).await.unwrap() {
        direct.remove(&r.id).await.unwrap();
    }
    assert!(direct.list(&selector).await.unwrap().is_empty());
}
