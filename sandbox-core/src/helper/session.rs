//! The host side of one helper connection: frames in and out over one exec stream,
//! multiplexed by id, with the flow-control credits of the protocol.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::{Buf, Bytes, BytesMut};
use futures::StreamExt;
use futures::stream::BoxStream;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio_util::sync::{CancellationToken, DropGuard};

use super::proto::{self, Dec, Enc, Entry, FileError, Hello, Spawn, SpawnError};
use crate::error::{Error, ErrorKind, Result};
use crate::exec::{ExitStatus, OutputChunk};
use crate::raw::{RawExec, RawProcess, RawStatus};
use crate::spec::Stdin;

/// What the helper said about one id.
#[derive(Debug)]
pub(crate) enum Event {
    Started,
    SpawnFailed(SpawnError, String),
    Out(OutputChunk),
    Exit(ExitStatus),
    /// An entry and its payload's length (it counts against the credit).
    Entry(Entry, usize),
    Done,
    FileFailed(FileError, String, String),
    /// The connection broke.
    Lost(String),
}

struct Slot {
    events: mpsc::UnboundedSender<Event>,
    stdin: Option<Arc<Semaphore>>,
    /// Output bytes the helper may still send: a helper that sends more is cut off, so
    /// what the sandbox sends can never grow the host's memory past the credits.
    credit: Arc<AtomicI64>,
}

/// The receiving side of one id: its events, the credit it hands back as it consumes
/// output, and, when dropped before the id's last event, a `DISCARD` (and a `KILL`
/// while a spawn is unanswered) so that the helper never waits on a reader that is gone.
pub(crate) struct Receiver {
    id: u32,
    events: mpsc::UnboundedReceiver<Event>,
    frames: mpsc::UnboundedSender<Vec<u8>>,
    credit: Arc<AtomicI64>,
    done: bool,
    kill_on_drop: bool,
}

impl Receiver {
    fn track(&mut self, event: Option<Event>) -> Option<Event> {
        match &event {
            Some(Event::Out(_) | Event::Entry(..) | Event::Started) => {}
            _ => self.done = true,
        }
        event
    }

    /// The next event; `None` once the connection is gone.
    pub(crate) async fn next(&mut self) -> Option<Event> {
        let event = self.events.recv().await;
        self.track(event)
    }

    /// [`Receiver::next`] from a blocking thread.
    pub(crate) fn blocking_next(&mut self) -> Option<Event> {
        let event = self.events.blocking_recv();
        self.track(event)
    }

    /// Drops the receiver without telling the helper (an operation it ends by itself, such
    /// as a `PUT` ended with `STDIN_EOF`).
    pub(crate) fn quiet(mut self) {
        self.done = true;
    }

    /// The exec's output, returning each chunk's bytes as credit once the pump took it.
    fn into_output(
        self,
        status: Arc<Mutex<Option<ExitStatus>>>,
    ) -> BoxStream<'static, io::Result<OutputChunk>> {
        futures::stream::unfold(Some(self), move |events| {
            let status = status.clone();
            async move {
                let mut events = events?;
                loop {
                    match events.next().await {
                        Some(Event::Out(chunk)) => {
                            let n = match &chunk {
                                OutputChunk::Stdout(b) | OutputChunk::Stderr(b) => b.len(),
                            };
                            events.give_credit(n);
                            return Some((Ok(chunk), Some(events)));
                        }
                        Some(Event::Exit(s)) => {
                            *status.lock().unwrap() = Some(s);
                            return None;
                        }
                        Some(Event::Lost(why)) => {
                            return Some((Err(io::Error::other(why)), None));
                        }
                        None => {
                            return Some((
                                Err(io::Error::other("the helper connection closed")),
                                None,
                            ));
                        }
                        Some(_) => continue,
                    }
                }
            }
        })
        .boxed()
    }

    /// Grants the helper `n` more output bytes (after consuming as many).
    pub(crate) fn give_credit(&self, n: usize) {
        self.credit.fetch_add(n as i64, Ordering::Relaxed);
        let mut credit = Enc::frame(proto::CREDIT, self.id);
        credit.u32(n as u32);
        let _ = self.frames.send(credit.finish());
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if self.kill_on_drop {
            let _ = self.frames.send(Enc::frame(proto::KILL, self.id).finish());
        }
        let _ = self
            .frames
            .send(Enc::frame(proto::DISCARD, self.id).finish());
    }
}

#[derive(Default)]
struct Table {
    slots: HashMap<u32, Slot>,
    kills: HashMap<u32, Vec<oneshot::Sender<()>>>,
    dead: Option<String>,
}

/// One live helper. Dropping it closes the stream: the helper kills what it started and
/// exits.
pub(crate) struct Session {
    frames: mpsc::UnboundedSender<Vec<u8>>,
    table: Arc<Mutex<Table>>,
    pub(crate) hello: Hello,
    next_id: AtomicU32,
    stop: CancellationToken,
    _stop: DropGuard,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("hello", &self.hello)
            .finish_non_exhaustive()
    }
}

fn lost(why: impl Into<String>) -> Error {
    Error::new(ErrorKind::Backend, why.into())
}

impl Session {
    /// Takes over a started helper exec: waits for its `HELLO` (bounded), then runs the
    /// reader and writer tasks.
    pub(crate) async fn open(mut process: RawProcess, timeout: Duration) -> Result<Session> {
        let mut sink = process
            .stdin
            .take()
            .ok_or_else(|| lost("the helper exec has no stdin"))?;
        let mut buf = BytesMut::new();
        let mut stderr = Vec::new();
        let hello = tokio::time::timeout(timeout, async {
            loop {
                if let Some((kind, _, payload, n)) = proto::split_frame(&buf)
                    .map_err(|_| lost("the helper sent a malformed frame"))?
                {
                    if kind != proto::HELLO {
                        return Err(lost("the helper did not greet"));
                    }
                    let hello = Hello::decode(&mut Dec::new(payload))
                        .map_err(|_| lost("the helper sent a malformed greeting"))?;
                    buf.advance(n);
                    return Ok(hello);
                }
                match process.output.next().await {
                    Some(Ok(OutputChunk::Stdout(b))) => buf.extend_from_slice(&b),
                    Some(Ok(OutputChunk::Stderr(b))) => stderr.extend_from_slice(&b),
                    Some(Err(e)) => return Err(lost(format!("the helper exec broke: {e}"))),
                    None => {
                        let status = process.status.status().await;
                        let status = match status {
                            Ok(s) => s.to_string(),
                            Err(e) => e.to_string(),
                        };
                        let stderr = String::from_utf8_lossy(&stderr);
                        return Err(lost(format!(
                            "the helper ended before its greeting ({status}): {}",
                            stderr.trim()
                        )));
                    }
                }
            }
        })
        .await
        .map_err(|_| lost("the helper did not greet in time"))??;

        let table = Arc::new(Mutex::new(Table::default()));
        let (frames, mut frames_rx) = mpsc::unbounded_channel::<Vec<u8>>();
        let stop = CancellationToken::new();

        // Writer: frames to the helper's stdin, batched, flushed per batch.
        {
            let (table, stop) = (table.clone(), stop.clone());
            tokio::spawn(async move {
                let write = async {
                    while let Some(frame) = frames_rx.recv().await {
                        let mut batch = frame;
                        while batch.len() < 256 * 1024 {
                            match frames_rx.try_recv() {
                                Ok(more) => batch.extend_from_slice(&more),
                                Err(_) => break,
                            }
                        }
                        sink.write_all(&batch).await?;
                        sink.flush().await?;
                    }
                    io::Result::Ok(())
                };
                let why = tokio::select! {
                    r = write => match r {
                        Ok(()) => "the session closed".to_string(),
                        Err(e) => format!("writing to the helper failed: {e}"),
                    },
                    _ = stop.cancelled() => "the session closed".to_string(),
                };
                let _ = sink.shutdown().await;
                fail_all(&table, &why);
                stop.cancel();
            });
        }

        // Reader: frames from the helper's stdout, dispatched by id.
        {
            let (table, stop) = (table.clone(), stop.clone());
            let mut output = process.output;
            let status = process.status;
            tokio::spawn(async move {
                let read = async {
                    loop {
                        while let Some((kind, id, payload, n)) = proto::split_frame(&buf)
                            .map_err(|_| "the helper sent a malformed frame".to_string())?
                        {
                            dispatch(&table, kind, id, payload)?;
                            buf.advance(n);
                        }
                        match output.next().await {
                            Some(Ok(OutputChunk::Stdout(b))) => buf.extend_from_slice(&b),
                            Some(Ok(OutputChunk::Stderr(b))) => {
                                tracing::debug!(
                                    "exec helper: {}",
                                    String::from_utf8_lossy(&b).trim_end()
                                );
                            }
                            Some(Err(e)) => return Err(format!("the helper stream broke: {e}")),
                            None => {
                                let s = match status.status().await {
                                    Ok(s) => s.to_string(),
                                    Err(e) => e.to_string(),
                                };
                                return Err(format!("the helper ended ({s})"));
                            }
                        }
                    }
                    #[allow(unreachable_code)]
                    std::result::Result::<(), String>::Ok(())
                };
                let why = tokio::select! {
                    r = read => r.err().unwrap_or_default(),
                    _ = stop.cancelled() => "the session closed".to_string(),
                };
                fail_all(&table, &why);
                // The writer closes the helper's stdin: it kills what still runs.
                stop.cancel();
            });
        }

        Ok(Session {
            frames,
            table,
            hello,
            next_id: AtomicU32::new(1),
            stop: stop.clone(),
            _stop: stop.drop_guard(),
        })
    }

    /// Why the connection is gone, once it is.
    pub(crate) fn dead(&self) -> Option<String> {
        self.table.lock().unwrap().dead.clone()
    }

    /// Opens an id: its receiver, and a stdin window when asked.
    fn open_id(&self, window: bool) -> Result<(Receiver, Option<Arc<Semaphore>>)> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        let stdin = window.then(|| Arc::new(Semaphore::new(proto::STDIN_WINDOW as usize)));
        let credit = Arc::new(AtomicI64::new(i64::from(proto::INITIAL_CREDIT)));
        let mut table = self.table.lock().unwrap();
        if let Some(why) = &table.dead {
            return Err(lost(why.clone()));
        }
        table.slots.insert(
            id,
            Slot {
                events: tx,
                stdin: stdin.clone(),
                credit: credit.clone(),
            },
        );
        let receiver = Receiver {
            id,
            events: rx,
            frames: self.frames.clone(),
            credit,
            done: false,
            kill_on_drop: false,
        };
        Ok((receiver, stdin))
    }

    /// Starts one exec: waits for the helper's answer (started or a typed spawn error).
    pub(crate) async fn spawn(self: &Arc<Self>, raw: &RawExec) -> Result<(u32, RawProcess)> {
        let piped = !matches!(raw.stdin, Stdin::Null);
        let (mut events, window) = self.open_id(piped)?;
        let id = events.id;
        let spawn = Spawn {
            argv: raw.argv.iter().map(|a| a.as_bytes().to_vec()).collect(),
            env: raw
                .env
                .iter()
                .map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec()))
                .collect(),
            working_dir: raw.working_dir.as_ref().map(|d| d.as_bytes().to_vec()),
            user: raw.user.as_ref().map(|u| u.as_bytes().to_vec()),
            stdin_piped: piped,
        };
        let mut frame = Enc::frame(proto::SPAWN, id);
        spawn.encode(&mut frame);
        let frame = frame.finish();
        if frame.len() > proto::MAX_PAYLOAD {
            // Not reached with validated specs (argv and env are capped at 1 MiB each).
            return Err(Error::invalid_spec(
                "argv",
                "the command and its env are too large",
            ));
        }
        let _ = self.send_frame(frame);
        let status = Arc::new(Mutex::new(None));
        // Dropped before the answer: the helper kills what it may have started.
        events.kill_on_drop = true;
        let answer = match tokio::time::timeout(ANSWER_TIMEOUT, events.next()).await {
            Ok(answer) => answer,
            Err(_) => {
                self.stop.cancel();
                return Err(lost(format!(
                    "the helper did not answer a spawn within {ANSWER_TIMEOUT:?}; its connection is dropped"
                )));
            }
        };
        events.kill_on_drop = false;
        match answer {
            Some(Event::Started) => {}
            Some(Event::SpawnFailed(kind, message)) => {
                return spawn_failed(id, &raw.argv[0], kind, message);
            }
            Some(Event::Lost(why)) => return Err(lost(why)),
            None => return Err(lost("the helper connection closed")),
            Some(other) => return Err(lost(format!("the helper answered a spawn with {other:?}"))),
        }
        let stdin = window.map(|window| self.stdin_sink(id, window));
        let output = events.into_output(status.clone());
        Ok((
            id,
            RawProcess {
                output,
                stdin,
                status: Box::new(HelperStatus(status)),
            },
        ))
    }

    /// A stdin sink: bytes written to it go out as `STDIN` frames within the window;
    /// shutting it down sends `STDIN_EOF`.
    fn stdin_sink(
        &self,
        id: u32,
        window: Arc<Semaphore>,
    ) -> std::pin::Pin<Box<dyn tokio::io::AsyncWrite + Send>> {
        let (near, mut far) = tokio::io::duplex(proto::CHUNK);
        let frames = self.frames.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; proto::CHUNK];
            loop {
                let n = match far.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                match window.acquire_many(n as u32).await {
                    Ok(permit) => permit.forget(),
                    Err(_) => return, // the exec ended
                }
                let mut frame = Enc::frame(proto::STDIN, id);
                frame.raw(&buf[..n]);
                if frames.send(frame.finish()).is_err() {
                    return;
                }
            }
            let _ = frames.send(Enc::frame(proto::STDIN_EOF, id).finish());
        });
        Box::pin(near)
    }

    /// Kills the process tree of exec `id`; returns once the helper says it is done.
    pub(crate) async fn kill(&self, id: u32) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        {
            let mut table = self.table.lock().unwrap();
            if let Some(why) = &table.dead {
                return Err(lost(why.clone()));
            }
            table.kills.entry(id).or_default().push(tx);
        }
        let _ = self.send_frame(Enc::frame(proto::KILL, id).finish());
        rx.await
            .map_err(|_| lost("the helper connection broke during a kill"))
    }

    /// Starts a file operation (`PUT` of `dir` or `GET` of `path`): its id, events and
    /// stdin window.
    pub(crate) fn file_op(
        &self,
        kind: u8,
        path: &str,
    ) -> Result<(u32, Receiver, Option<Arc<Semaphore>>)> {
        let (events, window) = self.open_id(kind == proto::PUT)?;
        let id = events.id;
        let mut frame = Enc::frame(kind, id);
        frame.bytes(path.as_bytes());
        let _ = self.send_frame(frame.finish());
        Ok((id, events, window))
    }

    /// Sends a frame of an open operation.
    pub(crate) fn send_frame(&self, frame: Vec<u8>) -> Result<()> {
        self.frames
            .send(frame)
            .map_err(|_| lost("the helper connection closed"))
    }
}

/// How long the helper may take to answer a spawn or a file operation before its
/// connection is taken for dead (it answers in milliseconds; only a silently dropped
/// connection takes longer).
pub(crate) const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

/// A spawn the helper refused, as the plain path reports it: a missing or
/// non-executable program is exit 127 / 126 with the reason on stderr; a missing working
/// directory or user is [`ExitStatus::NotStarted`] naming the field.
fn spawn_failed(
    id: u32,
    program: &str,
    kind: SpawnError,
    message: String,
) -> Result<(u32, RawProcess)> {
    let (status, stderr) = match kind {
        SpawnError::NotFound => (ExitStatus::Exited(127), format!("{program}: {message}\n")),
        SpawnError::NotExecutable => (ExitStatus::Exited(126), format!("{program}: {message}\n")),
        SpawnError::WorkingDirMissing | SpawnError::WorkingDirDenied => (
            ExitStatus::NotStarted {
                field: "working_dir".into(),
                reason: message,
            },
            String::new(),
        ),
        SpawnError::UnknownUser | SpawnError::UserDenied => (
            ExitStatus::NotStarted {
                field: "user".into(),
                reason: message,
            },
            String::new(),
        ),
        SpawnError::Resources => {
            return Err(Error::new(
                ErrorKind::Unavailable,
                format!("the sandbox refused a new process (pids or memory limit): {message}"),
            )
            .temporary());
        }
        SpawnError::Other => {
            return Err(Error::new(
                ErrorKind::Backend,
                format!("the exec helper could not start the command: {message}"),
            ));
        }
    };
    let output = if stderr.is_empty() {
        futures::stream::empty().boxed()
    } else {
        futures::stream::iter([Ok(OutputChunk::Stderr(Bytes::from(stderr)))]).boxed()
    };
    Ok((
        id,
        RawProcess {
            output,
            stdin: None,
            status: Box::new(HelperStatus(Arc::new(Mutex::new(Some(status))))),
        },
    ))
}

struct HelperStatus(Arc<Mutex<Option<ExitStatus>>>);

#[async_trait]
impl RawStatus for HelperStatus {
    async fn status(&self) -> Result<ExitStatus> {
        self.0
            .lock()
            .unwrap()
            .clone()
            .ok_or_else(|| lost("the helper reported no exit status"))
    }
}

/// Marks the connection dead and tells every open id.
fn fail_all(table: &Mutex<Table>, why: &str) {
    let mut table = table.lock().unwrap();
    if table.dead.is_none() {
        table.dead = Some(why.to_string());
    }
    for (_, slot) in table.slots.drain() {
        let _ = slot.events.send(Event::Lost(why.to_string()));
        if let Some(w) = slot.stdin {
            w.close();
        }
    }
    table.kills.clear();
}

/// Routes one frame from the helper.
fn dispatch(
    table: &Mutex<Table>,
    kind: u8,
    id: u32,
    payload: &[u8],
) -> std::result::Result<(), String> {
    let bad = || format!("the helper sent a malformed frame (kind {kind})");
    let mut d = Dec::new(payload);
    let mut table = table.lock().unwrap();
    if matches!(kind, proto::STDOUT | proto::STDERR | proto::ENTRY)
        && let Some(slot) = table.slots.get(&id)
        && slot
            .credit
            .fetch_sub(payload.len() as i64, Ordering::Relaxed)
            < payload.len() as i64
    {
        return Err(format!(
            "the helper sent more output for id {id} than it was granted"
        ));
    }
    let (event, last) = match kind {
        proto::STARTED => (Event::Started, false),
        proto::SPAWN_ERROR => {
            let k = SpawnError::from_u8(d.u8().map_err(|_| bad())?);
            let msg = String::from_utf8_lossy(d.bytes().map_err(|_| bad())?).into_owned();
            (Event::SpawnFailed(k, msg), true)
        }
        proto::STDOUT => (
            Event::Out(OutputChunk::Stdout(Bytes::copy_from_slice(payload))),
            false,
        ),
        proto::STDERR => (
            Event::Out(OutputChunk::Stderr(Bytes::copy_from_slice(payload))),
            false,
        ),
        proto::EXIT => {
            let k = d.u8().map_err(|_| bad())?;
            let v = d.i32().map_err(|_| bad())?;
            let status = if k == proto::SIGNALED {
                ExitStatus::Signaled(v)
            } else {
                ExitStatus::Exited(v)
            };
            (Event::Exit(status), true)
        }
        proto::ENTRY => (
            Event::Entry(Entry::decode(&mut d).map_err(|_| bad())?, payload.len()),
            false,
        ),
        proto::DONE => (Event::Done, true),
        proto::FILE_ERROR => {
            let k = FileError::from_u8(d.u8().map_err(|_| bad())?);
            let path = String::from_utf8_lossy(d.bytes().map_err(|_| bad())?).into_owned();
            let msg = String::from_utf8_lossy(d.bytes().map_err(|_| bad())?).into_owned();
            (Event::FileFailed(k, path, msg), true)
        }
        proto::STDIN_ACK => {
            let n = d.u32().map_err(|_| bad())?;
            if let Some(w) = table.slots.get(&id).and_then(|s| s.stdin.as_ref()) {
                w.add_permits(n as usize);
            }
            return Ok(());
        }
        // Nothing sends pings today; an answer is harmless.
        proto::PONG => return Ok(()),
        proto::KILLED => {
            for tx in table.kills.remove(&id).unwrap_or_default() {
                let _ = tx.send(());
            }
            return Ok(());
        }
        proto::PROTOCOL_ERROR => {
            return Err(format!(
                "the helper refused a frame: {}",
                String::from_utf8_lossy(d.bytes().unwrap_or_default())
            ));
        }
        _ => return Err(bad()),
    };
    if last {
        if let Some(slot) = table.slots.remove(&id) {
            let _ = slot.events.send(event);
            if let Some(w) = slot.stdin {
                w.close();
            }
        }
    } else if let Some(slot) = table.slots.get(&id) {
        let _ = slot.events.send(event);
    }
    Ok(())
}
