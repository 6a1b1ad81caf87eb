//! A fake peer speaks for the helper: whatever numbers and sizes it sends, the host
//! stays bounded and never panics.

use super::*;
use crate::helper::durable::SpawnOpts;

struct FakeStatus;

#[async_trait]
impl RawStatus for FakeStatus {
    async fn status(&self) -> Result<ExitStatus> {
        Ok(ExitStatus::Exited(0))
    }
}

struct Peer {
    out: Option<mpsc::UnboundedSender<io::Result<OutputChunk>>>,
    input: tokio::io::DuplexStream,
    buf: Vec<u8>,
}

impl Peer {
    fn send(&self, frame: Vec<u8>) {
        if let Some(out) = &self.out {
            let _ = out.send(Ok(OutputChunk::Stdout(frame.into())));
        }
    }

    fn stderr(&self, b: Bytes) {
        if let Some(out) = &self.out {
            let _ = out.send(Ok(OutputChunk::Stderr(b)));
        }
    }

    /// Ends the helper's output (the helper exited).
    fn hang_up(&mut self) {
        self.out = None;
    }

    /// The next frame from the host, skipping `PING`s and `CREDIT`s.
    async fn expect(&mut self, kind: u8) -> (u32, Vec<u8>) {
        loop {
            if let Ok(Some((k, id, payload, n))) = proto::split_frame(&self.buf) {
                let frame = (k, id, payload.to_vec());
                self.buf.drain(..n);
                if frame.0 == kind {
                    return (frame.1, frame.2);
                }
                assert!(
                    matches!(frame.0, proto::PING | proto::CREDIT),
                    "expected kind {kind}, got {}",
                    frame.0
                );
                continue;
            }
            let mut chunk = vec![0u8; 64 * 1024];
            let n = self.input.read(&mut chunk).await.expect("host stream");
            assert!(n > 0, "the host closed the stream");
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}

fn fake() -> (RawProcess, Peer) {
    fake_with(1 << 20)
}

/// [`fake`] whose stdin holds at most `capacity` bytes the peer has not read.
fn fake_with(capacity: usize) -> (RawProcess, Peer) {
    let (tx, rx) = mpsc::unbounded_channel();
    let output = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    })
    .boxed();
    let (near, far) = tokio::io::duplex(capacity);
    (
        RawProcess {
            output,
            stdin: Some(Box::pin(near)),
            status: Box::new(FakeStatus),
        },
        Peer {
            out: Some(tx),
            input: far,
            buf: Vec::new(),
        },
    )
}

fn hello() -> Vec<u8> {
    let mut e = Enc::frame(proto::HELLO, 0);
    Hello {
        version: proto::VERSION,
        pid: 7,
        uid: 0,
        gid: 0,
        size: 1,
        digest: 2,
        relay: 0,
        durable: false,
    }
    .encode(&mut e);
    e.finish()
}

fn frame_u32(kind: u8, id: u32, v: u32) -> Vec<u8> {
    let mut e = Enc::frame(kind, id);
    e.u32(v);
    e.finish()
}

fn data(kind: u8, id: u32, n: usize) -> Vec<u8> {
    let mut e = Enc::frame(kind, id);
    e.raw(&vec![b'x'; n]);
    e.finish()
}

async fn opened() -> (Arc<Session>, Peer) {
    let (process, peer) = fake();
    peer.send(hello());
    let session = Session::open(process, Duration::from_secs(5))
        .await
        .expect("greeting");
    (Arc::new(session), peer)
}

fn exec(stdin: Stdin) -> RawExec {
    let mut raw = RawExec::new(["cat"]);
    raw.stdin = stdin;
    raw
}

/// A started exec: the peer answered its `SPAWN` with `STARTED`.
async fn started(session: &Arc<Session>, peer: &mut Peer, stdin: Stdin) -> (u32, RawProcess) {
    started_with(session, peer, stdin, SpawnOpts::default(), None).await
}

/// [`started`] with spawn options and a reconnect (a durable exec).
async fn started_with(
    session: &Arc<Session>,
    peer: &mut Peer,
    stdin: Stdin,
    opts: SpawnOpts,
    reconnect: Option<crate::helper::durable::Reconnect>,
) -> (u32, RawProcess) {
    let spawn = {
        let session = session.clone();
        tokio::spawn(async move { session.spawn(&exec(stdin), &opts, None, reconnect).await })
    };
    let (id, _) = peer.expect(proto::SPAWN).await;
    peer.send(frame_u32(proto::STARTED, id, 42));
    let (hid, process, _) = spawn.await.unwrap().expect("spawn");
    assert_eq!(hid, id);
    (id, process)
}

async fn dead_within(session: &Session, within: Duration) -> String {
    let start = Instant::now();
    loop {
        if let Some(why) = session.dead() {
            return why;
        }
        assert!(start.elapsed() < within, "the session is still alive");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn first_error(process: &mut RawProcess) -> String {
    loop {
        match tokio::time::timeout(Duration::from_secs(30), process.output.next()).await {
            Ok(Some(Ok(_))) => continue,
            Ok(Some(Err(e))) => return e.to_string(),
            Ok(None) => panic!("the output ended without an error"),
            Err(_) => panic!("the output never ended"),
        }
    }
}

#[tokio::test]
async fn stdin_acks_near_u32_max_drop_the_connection_without_a_panic() {
    for ack in [u32::MAX, u32::MAX - 1, proto::STDIN_WINDOW + 1, 1] {
        let (session, mut peer) = opened().await;
        let (id, mut process) = started(&session, &mut peer, Stdin::Piped).await;
        // Nothing was sent on stdin: even one acknowledged byte is a lie.
        peer.send(frame_u32(proto::STDIN_ACK, id, ack));
        let why = dead_within(&session, Duration::from_secs(5)).await;
        assert!(why.contains("acknowledged"), "{why}");
        assert!(first_error(&mut process).await.contains("acknowledged"));
        // Still usable as a value: no poisoned lock, no panic.
        assert!(session.kill(id).await.is_err());
    }
}

#[tokio::test]
async fn output_beyond_the_credit_drops_the_connection() {
    let (session, mut peer) = opened().await;
    let (id, mut process) = started(&session, &mut peer, Stdin::Null).await;
    let frames = proto::INITIAL_CREDIT as usize / proto::CHUNK;
    for _ in 0..frames {
        peer.send(data(proto::STDOUT, id, proto::CHUNK));
    }
    peer.send(data(proto::STDERR, id, 1));
    let why = dead_within(&session, Duration::from_secs(5)).await;
    assert!(why.contains("more output"), "{why}");
    let mut got = 0;
    loop {
        match process.output.next().await {
            Some(Ok(OutputChunk::Stdout(b) | OutputChunk::Stderr(b))) => got += b.len(),
            Some(Ok(OutputChunk::Lost(n))) => panic!("{n} bytes lost"),
            Some(Err(_)) => break,
            None => panic!("no error"),
        }
    }
    assert!(got <= proto::INITIAL_CREDIT as usize);
}

#[tokio::test]
async fn huge_lengths_are_refused_not_allocated() {
    let (session, peer) = opened().await;
    let mut frame = u32::MAX.to_le_bytes().to_vec();
    frame.extend_from_slice(&[proto::STDOUT, 1, 0, 0, 0]);
    peer.send(frame);
    let why = dead_within(&session, Duration::from_secs(5)).await;
    assert!(why.contains("malformed"), "{why}");

    // A string length past its payload, and a protocol error of 4 MiB of text.
    let (session, mut peer) = opened().await;
    let (id, _process) = started(&session, &mut peer, Stdin::Null).await;
    let mut e = Enc::frame(proto::SPAWN_ERROR, id);
    e.u8(1).u32(u32::MAX);
    peer.send(e.finish());
    let why = dead_within(&session, Duration::from_secs(5)).await;
    assert!(why.contains("malformed"), "{why}");

    let (session, peer) = opened().await;
    let mut e = Enc::frame(proto::PROTOCOL_ERROR, 0);
    e.bytes(&vec![b'y'; proto::MAX_PAYLOAD - 4]);
    peer.send(e.finish());
    let why = dead_within(&session, Duration::from_secs(5)).await;
    assert!(why.len() < PEER_TEXT + 200, "{} bytes kept", why.len());
}

#[tokio::test]
async fn started_twice_drops_the_connection() {
    let (session, mut peer) = opened().await;
    let (id, _process) = started(&session, &mut peer, Stdin::Null).await;
    for _ in 0..1000 {
        peer.send(frame_u32(proto::STARTED, id, 42));
    }
    let why = dead_within(&session, Duration::from_secs(5)).await;
    assert!(why.contains("STARTED"), "{why}");
    // A file operation never gets one.
    let (session, mut peer) = opened().await;
    let (id, _events, _) = session.file_op(proto::GET, "/x").unwrap();
    peer.expect(proto::GET).await;
    peer.send(frame_u32(proto::STARTED, id, 1));
    let why = dead_within(&session, Duration::from_secs(5)).await;
    assert!(why.contains("STARTED"), "{why}");
}

#[test]
fn tiny_frames_cannot_multiply_queued_items() {
    let mailbox = Mailbox::default();
    let n = 200_000;
    for i in 0..n {
        let b = Bytes::from_static(b"z");
        mailbox.push(Event::Out(if i % 2 == 0 {
            OutputChunk::Stdout(b)
        } else {
            OutputChunk::Stderr(b)
        }));
    }
    assert!(
        mailbox.len() <= MAX_QUEUED,
        "{} items queued",
        mailbox.len()
    );
    mailbox.close();
    let (mut out, mut err) = (0, 0);
    while let Ok(Some(event)) = mailbox.try_recv() {
        match event {
            Event::Out(OutputChunk::Stdout(b)) => out += b.len(),
            Event::Out(OutputChunk::Stderr(b)) => err += b.len(),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!((out, err), (n / 2, n / 2), "bytes were lost or added");
}

#[tokio::test]
async fn the_greeting_keeps_bounded_stderr_and_refuses_a_huge_first_frame() {
    let (process, mut peer) = fake();
    let flood = Bytes::from(vec![b'e'; 64 * 1024]);
    for _ in 0..256 {
        peer.stderr(flood.clone());
    }
    peer.hang_up();
    let err = Session::open(process, Duration::from_secs(5))
        .await
        .expect_err("no greeting");
    let text = err.to_string();
    assert!(text.contains("more bytes"), "{text}");
    assert!(text.len() < GREETING_STDERR + 300, "{} bytes", text.len());

    let (process, peer) = fake();
    let mut frame = (proto::MAX_PAYLOAD as u32).to_le_bytes().to_vec();
    frame.push(proto::HELLO);
    peer.send(frame);
    let err = tokio::time::timeout(
        Duration::from_secs(5),
        Session::open(process, Duration::from_secs(60)),
    )
    .await
    .expect("a huge greeting waited for its bytes")
    .expect_err("a huge greeting");
    assert!(err.to_string().contains("malformed greeting"), "{err}");

    let (process, peer) = fake();
    peer.send(frame_u32(proto::STARTED, 1, 1));
    let err = Session::open(process, Duration::from_secs(60))
        .await
        .expect_err("no greeting");
    assert!(err.to_string().contains("did not greet"), "{err}");
}

#[tokio::test(start_paused = true)]
async fn a_helper_that_never_greets_fails_at_the_bound() {
    let (process, _peer) = fake();
    let start = Instant::now();
    let err = Session::open(process, Duration::from_secs(8))
        .await
        .expect_err("no greeting");
    assert!(err.to_string().contains("did not greet"), "{err}");
    let took = start.elapsed();
    assert!(
        took >= Duration::from_secs(8) && took < Duration::from_secs(9),
        "{took:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_spawn_unanswered_by_its_deadline_retires_the_session() {
    let (session, mut peer) = opened().await;
    let start = Instant::now();
    let deadline = start + Duration::from_secs(3);
    let spawn = {
        let session = session.clone();
        tokio::spawn(async move {
            session
                .spawn(
                    &exec(Stdin::Null),
                    &SpawnOpts::default(),
                    Some(deadline),
                    None,
                )
                .await
        })
    };
    peer.expect(proto::SPAWN).await;
    let (_, mut process, _) = spawn.await.unwrap().expect("an exec that may have run");
    let took = start.elapsed();
    assert!(
        took >= Duration::from_secs(3) && took <= Duration::from_secs(3) + ANSWER_GRACE,
        "{took:?}"
    );
    let why = session.dead().expect("the session is retired");
    assert!(why.contains("deadline"), "{why}");
    // The pump times it out (the deadline passed): no output, no end of its own.
    assert!(
        tokio::time::timeout(Duration::from_secs(1), process.output.next())
            .await
            .is_err()
    );
}

/// A transport that loses what it has not forwarded yet when its process is dropped, as
/// Kubernetes' websocket task does: bytes written to the stdin reach the peer 100 ms later,
/// unless the status (which holds the process) was dropped meanwhile.
fn lossy() -> (RawProcess, Peer) {
    struct Aborting(tokio::task::AbortHandle);
    impl Drop for Aborting {
        fn drop(&mut self) {
            self.0.abort();
        }
    }
    struct LossyStatus(#[allow(dead_code)] Aborting);
    #[async_trait]
    impl RawStatus for LossyStatus {
        async fn status(&self) -> Result<ExitStatus> {
            Ok(ExitStatus::Exited(0))
        }
    }
    let (mut process, mut peer) = fake();
    let (near, mut far) = tokio::io::duplex(1 << 20);
    let (mut to_peer, peer_input) = tokio::io::duplex(1 << 20);
    let forward = tokio::spawn(async move {
        let mut chunk = vec![0u8; 64 * 1024];
        loop {
            let n = far.read(&mut chunk).await.unwrap_or(0);
            if n == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            if to_peer.write_all(&chunk[..n]).await.is_err() {
                return;
            }
        }
    });
    process.stdin = Some(Box::pin(near));
    process.status = Box::new(LossyStatus(Aborting(forward.abort_handle())));
    peer.input = peer_input;
    (process, peer)
}

#[tokio::test(start_paused = true)]
async fn the_kill_of_a_spawn_given_up_on_leaves_before_the_stream_is_dropped() {
    let (process, mut peer) = lossy();
    peer.send(hello());
    let session = Arc::new(
        Session::open(process, Duration::from_secs(5))
            .await
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(3);
    let spawn = {
        let session = session.clone();
        tokio::spawn(async move {
            session
                .spawn(
                    &exec(Stdin::Null),
                    &SpawnOpts::default(),
                    Some(deadline),
                    None,
                )
                .await
        })
    };
    let (id, _) = peer.expect(proto::SPAWN).await;
    let _ = spawn.await.unwrap().expect("an exec that may have run");
    assert!(session.dead().is_some());
    // A stopped daemon that goes on reads the `KILL` after the `SPAWN`.
    let (killed, _) = peer.expect(proto::KILL).await;
    assert_eq!(killed, id);
}

/// The close cuts a batch short while the helper does not read: the rest of it still goes
/// out before the `KILL` queued after it (a frame cut short would swallow the `KILL`).
#[tokio::test]
async fn a_batch_the_close_cuts_short_is_finished_before_the_kill() {
    let (process, mut peer) = fake_with(4096);
    peer.send(hello());
    let session = Arc::new(
        Session::open(process, Duration::from_secs(5))
            .await
            .unwrap(),
    );
    // 200 kB of stdin for an exec 99 the helper does not read, then a spawn behind it.
    session.send_frame(data(proto::STDIN, 99, 200_000)).unwrap();
    let deadline = Instant::now() + Duration::from_millis(500);
    let (id, _, _) = session
        .spawn(
            &exec(Stdin::Null),
            &SpawnOpts::default(),
            Some(deadline),
            None,
        )
        .await
        .expect("an exec that may have run");
    assert!(session.dead().is_some());
    // The helper reads again: every frame whole, the `KILL` after the `SPAWN`.
    let mut kinds = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        while let Some((kind, fid, _, n)) = proto::split_frame(&peer.buf).expect("whole frames") {
            kinds.push((kind, fid));
            peer.buf.drain(..n);
        }
        let n = tokio::time::timeout(Duration::from_secs(5), peer.input.read(&mut chunk))
            .await
            .expect("the stream ends")
            .unwrap();
        if n == 0 {
            break;
        }
        peer.buf.extend_from_slice(&chunk[..n]);
    }
    assert!(
        peer.buf.is_empty(),
        "a frame cut short: {} bytes",
        peer.buf.len()
    );
    let at = |k: u8, i: u32| kinds.iter().position(|f| *f == (k, i));
    let (stdin, spawn, kill) = (
        at(proto::STDIN, 99),
        at(proto::SPAWN, id),
        at(proto::KILL, id),
    );
    assert!(
        stdin.is_some() && stdin < spawn && spawn < kill,
        "{kinds:?}"
    );
}

#[tokio::test]
async fn a_resume_with_no_helper_left_to_resume_through_ends_at_once() {
    let (first, mut peer1) = opened_durable().await;
    let tries = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let reconnect: crate::helper::durable::Reconnect = {
        let tries = tries.clone();
        Arc::new(move || {
            tries.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move { Err(Error::new(ErrorKind::Unsupported, "plain execs now")) })
        })
    };
    let opts = SpawnOpts {
        grace_ms: 600_000,
        ..SpawnOpts::default()
    };
    let (_, mut process) =
        started_with(&first, &mut peer1, Stdin::Null, opts, Some(reconnect)).await;
    peer1.hang_up();
    // Not retried for the exec's grace (10 minutes by default).
    let why = tokio::time::timeout(Duration::from_secs(5), first_error(&mut process))
        .await
        .expect("the output ends at once");
    assert!(why.contains("plain execs now"), "{why}");
    assert_eq!(tries.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn a_spawn_never_answered_may_have_run() {
    let (session, mut peer) = opened().await;
    let start = Instant::now();
    let spawn = {
        let session = session.clone();
        tokio::spawn(async move {
            session
                .spawn(&exec(Stdin::Null), &SpawnOpts::default(), None, None)
                .await
        })
    };
    peer.expect(proto::SPAWN).await;
    let (_, mut process, _) = spawn.await.unwrap().expect("an exec that may have run");
    assert!(start.elapsed() <= ANSWER_TIMEOUT, "{:?}", start.elapsed());
    assert!(first_error(&mut process).await.contains("may have run"));
    assert!(session.dead().is_some());
}

#[tokio::test]
async fn a_helper_lost_after_a_spawn_may_have_run() {
    let (session, mut peer) = opened().await;
    let spawn = {
        let session = session.clone();
        tokio::spawn(async move {
            session
                .spawn(&exec(Stdin::Null), &SpawnOpts::default(), None, None)
                .await
        })
    };
    peer.expect(proto::SPAWN).await;
    peer.hang_up();
    let (_, mut process, _) = spawn
        .await
        .unwrap()
        .expect("not an error: the command may have run");
    let why = first_error(&mut process).await;
    assert!(why.contains("may have run"), "{why}");
}

#[tokio::test(start_paused = true)]
async fn a_helper_that_stops_answering_pings_is_dropped() {
    let (session, mut peer) = opened().await;
    let start = Instant::now();
    // Answered pings keep it.
    for _ in 0..10 {
        peer.expect(proto::PING).await;
        peer.send(Enc::frame(proto::PONG, 0).finish());
    }
    assert!(session.dead().is_none());
    let (_, mut process) = started(&session, &mut peer, Stdin::Null).await;
    let stopped = Instant::now();
    let why = first_error(&mut process).await;
    assert!(why.contains("ping"), "{why}");
    let took = stopped.elapsed();
    assert!(took <= PING_INTERVAL + PING_TIMEOUT, "{took:?}");
    assert!(start.elapsed() > Duration::from_secs(18));
}

// ---- durable execs -------------------------------------------------------------------

fn durable_hello() -> Vec<u8> {
    let mut e = Enc::frame(proto::HELLO, 0);
    Hello {
        version: proto::VERSION,
        pid: 7,
        uid: 0,
        gid: 0,
        size: 1,
        digest: 2,
        relay: 8,
        durable: true,
    }
    .encode(&mut e);
    e.finish()
}

async fn opened_durable() -> (Arc<Session>, Peer) {
    let (process, peer) = fake();
    peer.send(durable_hello());
    let session = Session::open(process, Duration::from_secs(5))
        .await
        .expect("greeting");
    (Arc::new(session), peer)
}

fn stdout_frame(id: u32, b: &[u8]) -> Vec<u8> {
    let mut e = Enc::frame(proto::STDOUT, id);
    e.raw(b);
    e.finish()
}

fn attached_frame(id: u32, at: u64, end: u64) -> Vec<u8> {
    let mut e = Enc::frame(proto::ATTACHED, id);
    Attached {
        at,
        end,
        pid: 42,
        ..Attached::default()
    }
    .encode(&mut e);
    e.finish()
}

fn exit_frame(id: u32, code: u32) -> Vec<u8> {
    let mut e = Enc::frame(proto::EXIT, id);
    e.u8(proto::EXITED).u32(code);
    e.finish()
}

#[tokio::test]
async fn a_stream_resumes_through_a_new_session_from_the_offset_it_reached() {
    let (first, mut peer1) = opened_durable().await;
    let (second, mut peer2) = opened_durable().await;
    let reconnect: crate::helper::durable::Reconnect = {
        let second = second.clone();
        Arc::new(move || {
            let second = second.clone();
            Box::pin(async move { Ok(second) })
        })
    };
    let opts = SpawnOpts {
        grace_ms: 60_000,
        ..SpawnOpts::default()
    };
    let spawn = {
        let first = first.clone();
        tokio::spawn(async move {
            first
                .spawn(&exec(Stdin::Null), &opts, None, Some(reconnect))
                .await
        })
    };
    let (id, payload) = peer1.expect(proto::SPAWN).await;
    let sp = Spawn::decode(&mut Dec::new(&payload)).unwrap();
    assert_eq!((sp.detach, sp.grace_ms), (false, 60_000));
    peer1.send(frame_u32(proto::STARTED, id, 42));
    let (_, mut process, link) = spawn.await.unwrap().expect("spawn");
    peer1.send(stdout_frame(id, b"abc"));
    match process.output.next().await {
        Some(Ok(OutputChunk::Stdout(b))) => assert_eq!(&b[..], b"abc"),
        other => panic!("{other:?}"),
    }
    // The first connection breaks: the output asks the second for the rest from 3.
    peer1.hang_up();
    let next = tokio::spawn(async move {
        let mut got = Vec::new();
        while let Some(item) = process.output.next().await {
            got.push(item.expect("no error after the resume"));
        }
        (got, process)
    });
    let (aid, payload) = peer2.expect(proto::ATTACH).await;
    assert_eq!(aid, id);
    assert_eq!(Dec::new(&payload).u64().unwrap(), 3);
    // Two bytes were dropped while nobody was attached.
    peer2.send(attached_frame(id, 5, 8));
    peer2.send(stdout_frame(id, b"fgh"));
    peer2.send(exit_frame(id, 4));
    let (got, process) = tokio::time::timeout(Duration::from_secs(10), next)
        .await
        .expect("the resumed output ends")
        .unwrap();
    assert_eq!(
        got,
        [
            OutputChunk::Lost(2),
            OutputChunk::Stdout(Bytes::from_static(b"fgh"))
        ]
    );
    assert_eq!(
        process.status.status().await.unwrap(),
        ExitStatus::Exited(4)
    );
    // Its kill and resize now go through the second session.
    assert!(Arc::ptr_eq(&link.session(), &second));
}

#[tokio::test]
async fn a_resume_whose_exec_is_gone_ends_the_output_with_an_error() {
    let (first, mut peer1) = opened_durable().await;
    let (second, mut peer2) = opened_durable().await;
    let reconnect: crate::helper::durable::Reconnect = Arc::new(move || {
        let second = second.clone();
        Box::pin(async move { Ok(second) })
    });
    let opts = SpawnOpts {
        detach: true,
        ..SpawnOpts::default()
    };
    let (_, mut process) =
        started_with(&first, &mut peer1, Stdin::Null, opts, Some(reconnect)).await;
    peer1.hang_up();
    let error = tokio::spawn(async move { first_error(&mut process).await });
    let (aid, _) = peer2.expect(proto::ATTACH).await;
    peer2.send(Enc::frame(proto::GONE, aid).finish());
    let why = error.await.unwrap();
    assert!(why.contains("no longer has the exec"), "{why}");
}

#[tokio::test]
async fn a_spawn_whose_id_the_daemon_holds_is_tried_with_another() {
    let (session, mut peer) = opened_durable().await;
    let spawn = {
        let session = session.clone();
        tokio::spawn(async move {
            session
                .spawn(&exec(Stdin::Null), &SpawnOpts::default(), None, None)
                .await
        })
    };
    let (first, _) = peer.expect(proto::SPAWN).await;
    let mut e = Enc::frame(proto::SPAWN_ERROR, first);
    e.u8(SpawnError::IdInUse as u8).bytes(b"in use");
    peer.send(e.finish());
    let (second, _) = peer.expect(proto::SPAWN).await;
    assert_ne!(first, second);
    peer.send(frame_u32(proto::STARTED, second, 42));
    let (hid, _, _) = spawn.await.unwrap().expect("spawn");
    assert_eq!(hid, second);
}

#[tokio::test]
async fn attach_and_list_answers_are_checked() {
    let (session, mut peer) = opened_durable().await;
    // Unknown exec: none.
    let attach = {
        let session = session.clone();
        tokio::spawn(async move { session.attach(9, 0).await.map(|a| a.is_some()) })
    };
    let (id, _) = peer.expect(proto::ATTACH).await;
    peer.send(Enc::frame(proto::GONE, id).finish());
    assert!(!attach.await.unwrap().unwrap());
    // An attach answered past the exec's end is a lie: the session is dropped.
    let attach = {
        let session = session.clone();
        tokio::spawn(async move { session.attach(9, 0).await.map(|a| a.is_some()) })
    };
    let (id, _) = peer.expect(proto::ATTACH).await;
    peer.send(attached_frame(id, 10, 5));
    assert!(attach.await.unwrap().is_err());
    assert!(session.dead().is_some());

    // A list longer than the daemon may hold drops the connection.
    let (session, mut peer) = opened_durable().await;
    let list = {
        let session = session.clone();
        tokio::spawn(async move { session.list().await })
    };
    let (id, _) = peer.expect(proto::LIST).await;
    let mut e = Enc::frame(proto::EXECS, id);
    e.u32(proto::MAX_RECORDS as u32 + 1);
    peer.send(e.finish());
    assert!(list.await.unwrap().is_err());
    let why = dead_within(&session, Duration::from_secs(5)).await;
    assert!(why.contains("listed"), "{why}");
}

/// What a hostile helper sends for a `GET`, turned into an archive: `Ok` with its
/// entries (path, type, link name), or the stream's error.
async fn archive_of(
    entries: &[proto::Entry],
) -> std::result::Result<Vec<(String, tar::EntryType, String)>, String> {
    let (session, mut peer) = opened().await;
    let get = tokio::spawn({
        let session = session.clone();
        async move { crate::helper::files::get(&session, "/x").await }
    });
    let (id, _) = peer.expect(proto::GET).await;
    for e in entries {
        let mut f = Enc::frame(proto::ENTRY, id);
        e.encode(&mut f);
        peer.send(f.finish());
        if e.size > 0 {
            peer.send(data(proto::STDOUT, id, e.size as usize));
        }
    }
    peer.send(Enc::frame(proto::DONE, id).finish());
    let mut stream = get.await.unwrap().map_err(|e| e.to_string())?;
    let mut bytes = Vec::new();
    while let Some(chunk) = stream.next().await {
        bytes.extend_from_slice(&chunk.map_err(|e| e.to_string())?);
    }
    let mut archive = tar::Archive::new(&bytes[..]);
    let mut out = Vec::new();
    for entry in archive.entries().map_err(|e| e.to_string())? {
        let entry = entry.map_err(|e| e.to_string())?;
        let link = entry
            .link_name_bytes()
            .map(|l| String::from_utf8_lossy(&l).into_owned())
            .unwrap_or_default();
        out.push((
            String::from_utf8_lossy(&entry.path_bytes()).into_owned(),
            entry.header().entry_type(),
            link,
        ));
    }
    Ok(out)
}

fn entry(path: &str, kind: u8, mode: u32, size: u64, link: &str) -> proto::Entry {
    proto::Entry {
        path: path.as_bytes().to_vec(),
        kind,
        mode,
        size,
        link: link.as_bytes().to_vec(),
        ..Default::default()
    }
}

/// A helper's archive names nothing outside its tree: an entry path with `..` (or empty,
/// `.`, absolute) fails the GET, and so does a hard link to anything but a regular file
/// it sent before, marked as a link target; such a link goes into the archive.
#[tokio::test]
async fn a_helpers_archive_names_nothing_outside_its_tree() {
    use proto::{DIRECTORY, HARDLINK, LINK_TARGET, REGULAR};
    let dir = entry("x", DIRECTORY, 0o755, 0, "");
    let marked = entry("x/a", REGULAR, 0o644 | LINK_TARGET, 1, "");
    let unmarked = entry("x/b", REGULAR, 0o644, 1, "");
    let fine = archive_of(&[
        dir.clone(),
        marked.clone(),
        entry("x/l", HARDLINK, 0, 0, "x/a"),
    ])
    .await
    .expect("a link to a marked file");
    assert_eq!(
        fine.last(),
        Some(&("x/l".to_string(), tar::EntryType::Link, "x/a".to_string()))
    );
    for (case, entries) in [
        (
            "a path out",
            vec![
                dir.clone(),
                entry("x/../../etc/passwd", REGULAR, 0o644, 1, ""),
            ],
        ),
        (
            "an absolute path",
            vec![entry("/etc/passwd", REGULAR, 0o644, 1, "")],
        ),
        (
            "an empty component",
            vec![dir.clone(), entry("x//a", REGULAR, 0o644, 1, "")],
        ),
        (
            "a link out",
            vec![
                dir.clone(),
                marked.clone(),
                entry("x/l", HARDLINK, 0, 0, "x/../../home/u/.ssh/id"),
            ],
        ),
        (
            "a link to an unmarked file",
            vec![
                dir.clone(),
                unmarked.clone(),
                entry("x/l", HARDLINK, 0, 0, "x/b"),
            ],
        ),
        (
            "a link to a file not sent",
            vec![dir.clone(), entry("x/l", HARDLINK, 0, 0, "x/a")],
        ),
        (
            "a link sent before its file",
            vec![
                dir.clone(),
                entry("x/l", HARDLINK, 0, 0, "x/a"),
                marked.clone(),
            ],
        ),
        (
            "an unknown type",
            vec![dir.clone(), entry("x/c", 9, 0o644, 0, "")],
        ),
    ] {
        let got = archive_of(&entries).await;
        assert!(got.is_err(), "{case}: {got:?}");
    }
}

/// Reads a snapshot layer's stream: its entries (path, type, size), or the stream's
/// error.
async fn layer_entries(
    stream: crate::files::ByteStream,
) -> std::result::Result<Vec<(String, tar::EntryType, u64)>, String> {
    let mut stream = stream;
    let mut bytes = Vec::new();
    while let Some(chunk) = stream.next().await {
        bytes.extend_from_slice(&chunk.map_err(|e| e.to_string())?);
    }
    // A whole archive: two zero blocks at its end.
    assert!(bytes.len() >= 1024 && bytes[bytes.len() - 1024..].iter().all(|b| *b == 0));
    let mut archive = tar::Archive::new(&bytes[..]);
    let mut out = Vec::new();
    for entry in archive.entries().map_err(|e| e.to_string())? {
        let entry = entry.map_err(|e| e.to_string())?;
        out.push((
            String::from_utf8_lossy(&entry.path_bytes()).into_owned(),
            entry.header().entry_type(),
            entry.size(),
        ));
    }
    Ok(out)
}

/// `BASE` goes with an empty payload and succeeds only on `DONE`; a failure names the
/// path below `/`.
#[tokio::test]
async fn a_base_listing_is_recorded_or_its_failure_named() {
    let (session, mut peer) = opened().await;
    let base = tokio::spawn({
        let session = session.clone();
        async move { crate::helper::files::base(&session).await }
    });
    let (id, payload) = peer.expect(proto::BASE).await;
    assert!(payload.is_empty());
    peer.send(Enc::frame(proto::DONE, id).finish());
    base.await.unwrap().expect("recorded");

    let base = tokio::spawn({
        let session = session.clone();
        async move { crate::helper::files::base(&session).await }
    });
    let (id, _) = peer.expect(proto::BASE).await;
    let mut e = Enc::frame(proto::FILE_ERROR, id);
    e.u8(FileError::Denied as u8)
        .bytes(b"root/secret")
        .bytes(b"Permission denied");
    peer.send(e.finish());
    let err = base.await.unwrap().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Backend);
    assert!(
        err.to_string().contains("/root/secret: Permission denied"),
        "{err}"
    );
}

/// A `LAYER` is a tar stream of its entries (whiteouts as empty regular files), an empty
/// archive when nothing changed, an error before its first entry, and an error item
/// (never a whole-looking archive) after one.
#[tokio::test]
async fn a_layer_is_an_archive_of_its_entries_or_an_error() {
    use proto::{DIRECTORY, REGULAR};
    let (session, mut peer) = opened().await;
    let start = |session: &Arc<Session>| {
        let session = session.clone();
        tokio::spawn(async move { crate::helper::files::layer(&session, "/work").await })
    };

    let layer = start(&session);
    let (id, payload) = peer.expect(proto::LAYER).await;
    assert_eq!(Dec::new(&payload).bytes().unwrap(), b"/work");
    for e in [
        entry("etc", DIRECTORY, 0o755, 0, ""),
        entry("etc/.wh.gone", REGULAR, 0, 0, ""),
        entry("etc/new", REGULAR, 0o644, 3, ""),
    ] {
        let mut f = Enc::frame(proto::ENTRY, id);
        e.encode(&mut f);
        peer.send(f.finish());
    }
    peer.send(data(proto::STDOUT, id, 3));
    peer.send(Enc::frame(proto::DONE, id).finish());
    let got = layer_entries(layer.await.unwrap().unwrap()).await.unwrap();
    assert_eq!(
        got,
        [
            ("etc".to_string(), tar::EntryType::Directory, 0),
            ("etc/.wh.gone".to_string(), tar::EntryType::Regular, 0),
            ("etc/new".to_string(), tar::EntryType::Regular, 3),
        ]
    );

    // Nothing changed.
    let layer = start(&session);
    let (id, _) = peer.expect(proto::LAYER).await;
    peer.send(Enc::frame(proto::DONE, id).finish());
    let got = layer_entries(layer.await.unwrap().unwrap()).await.unwrap();
    assert!(got.is_empty(), "{got:?}");

    // No base listing: an error, no stream.
    let layer = start(&session);
    let (id, _) = peer.expect(proto::LAYER).await;
    let mut e = Enc::frame(proto::FILE_ERROR, id);
    e.u8(FileError::Other as u8)
        .bytes(b"")
        .bytes(b"the run has no base listing");
    peer.send(e.finish());
    let err = layer.await.unwrap().err().expect("an error");
    assert!(err.to_string().contains("no base listing"), "{err}");

    // A name a layer cannot carry: unsupported, naming it.
    let layer = start(&session);
    let (id, _) = peer.expect(proto::LAYER).await;
    let mut e = Enc::frame(proto::FILE_ERROR, id);
    e.u8(FileError::Invalid as u8)
        .bytes(b"a/.wh.x")
        .bytes(b"names starting with .wh. cannot be carried by a layer");
    peer.send(e.finish());
    let err = layer.await.unwrap().err().expect("an error");
    assert_eq!(err.kind(), ErrorKind::Unsupported);
    assert!(err.to_string().contains("/a/.wh.x"), "{err}");

    // A failure after the first entry: the stream ends with an error.
    let layer = start(&session);
    let (id, _) = peer.expect(proto::LAYER).await;
    let mut f = Enc::frame(proto::ENTRY, id);
    entry("etc", DIRECTORY, 0o755, 0, "").encode(&mut f);
    peer.send(f.finish());
    let mut e = Enc::frame(proto::FILE_ERROR, id);
    e.u8(FileError::Other as u8)
        .bytes(b"etc/big")
        .bytes(b"the file shrank while it was read");
    peer.send(e.finish());
    let mut stream = layer.await.unwrap().unwrap();
    let mut failed = None;
    while let Some(chunk) = stream.next().await {
        if let Err(e) = chunk {
            failed = Some(e.to_string());
        }
    }
    assert!(failed.is_some_and(|e| e.contains("etc/big")));
}
