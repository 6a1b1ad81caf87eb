//! The host side of one helper connection: frames in and out over one exec stream,
//! multiplexed by id, with the flow-control credits of the protocol.
//!
//! The helper runs inside the sandbox, where code can stop it, replace it or write
//! anything on its stdout and stderr. Whatever it does, this side stays bounded:
//!
//! - in time: the greeting, the answer to a spawn and a kill each have a bound (a spawn's
//!   also the exec's deadline plus [`ANSWER_GRACE`]), and a helper that stops answering
//!   `PING`s for [`PING_TIMEOUT`] is taken for dead, so that no operation waits on it for
//!   longer; a session that missed a bound is *retired* (marked broken: its operations end
//!   as lost, the next exec starts a new helper). So an exec through the helper ends at
//!   most [`ANSWER_GRACE`] + [`crate::KILL_BOUND`] after its timeout (counted from the
//!   call; a helper that must start first adds its upload and at most the greeting bound),
//!   killed by the helper or, when it does not confirm within [`KILL_ANSWER_TIMEOUT`], by
//!   the engine through the exec marker;
//! - in memory: stderr is kept or logged up to a cap, a frame is at most
//!   [`proto::MAX_PAYLOAD`], every id's queue of events holds at most the output bytes its
//!   credit allows in at most [`MAX_QUEUED`] items (more output is merged into queued
//!   chunks), and every other event can come once per id;
//! - in arithmetic: every number from the peer is checked before it is used (a `STDIN_ACK`
//!   for more bytes than are in flight, a second `STARTED`, more output than granted are
//!   protocol errors that drop the connection); nothing here panics on what the peer says.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use bytes::{Buf, Bytes, BytesMut};
use futures::StreamExt;
use futures::stream::BoxStream;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{Notify, Semaphore, mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::proto::{self, Attached, Dec, Enc, Entry, FileError, Hello, Spawn, SpawnError};
use crate::error::{Error, ErrorKind, Result};
use crate::exec::{ExitStatus, OutputChunk};
use crate::raw::{RawExec, RawProcess, RawStatus};
use crate::spec::Stdin;

/// How long the helper may take to answer a spawn or a file operation before its
/// connection is taken for dead (it answers in milliseconds; only a stopped or hostile
/// helper takes longer).
pub(crate) const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long past an exec's deadline its spawn may still be answered before the helper is
/// taken for hung (the exec then ends `TimedOut`, killed through the engine).
pub(crate) const ANSWER_GRACE: Duration = Duration::from_secs(2);
/// How long the helper may take to confirm a kill (its own kill takes about
/// [`proto::KILL_GRACE_MS`]) before the session is retired and the engine kills instead.
pub(crate) const KILL_ANSWER_TIMEOUT: Duration = Duration::from_secs(4);
/// How long a closed session's stream is kept for what was queued before the close to
/// leave, and for the helper's side to end it.
const DRAIN_BOUND: Duration = Duration::from_secs(2);
/// How often the host pings a live helper.
const PING_INTERVAL: Duration = Duration::from_secs(2);
/// A helper that leaves a `PING` unanswered this long is taken for dead.
pub(crate) const PING_TIMEOUT: Duration = Duration::from_secs(8);
/// Largest greeting frame accepted (a `HELLO` is 36 bytes of payload).
const MAX_HELLO_FRAME: usize = 1024;
/// The helper's stderr kept for the error of a failed greeting.
const GREETING_STDERR: usize = 4096;
/// The helper's stderr logged per session; the rest is counted, not logged.
const LOGGED_STDERR: usize = 64 * 1024;
/// The longest text taken from the peer into an error or event.
const PEER_TEXT: usize = 4096;
/// The field of the error of a spawn whose id the run's daemon holds already (the spawn
/// is tried again with another id).
const ID_IN_USE: &str = "exec_id";
/// Items one id's queue holds before further output is merged into queued chunks.
pub(crate) const MAX_QUEUED: usize = 1024;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Text from the peer, lossy and cut at [`PEER_TEXT`] bytes.
fn peer_text(b: &[u8]) -> String {
    let mut s = String::from_utf8_lossy(&b[..b.len().min(PEER_TEXT)]).into_owned();
    if b.len() > PEER_TEXT {
        s.push_str("...");
    }
    s
}

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
    /// The answer to an `ATTACH`.
    Attached(Attached),
    /// No record of the id (the answer to an `ATTACH`).
    Gone,
    /// Another connection attached to the exec.
    Detached,
    /// The answer to a `LIST`.
    Execs(Vec<proto::ExecInfo>),
    /// The connection broke.
    Lost(String),
}

enum Item {
    Event(Event),
    /// Output merged from several frames of one stream (a long queue).
    Merged {
        stderr: bool,
        data: BytesMut,
    },
}

#[derive(Default)]
struct Inbox {
    items: VecDeque<Item>,
    closed: bool,
}

/// One id's queue of events: filled by the reader task without ever blocking it (so that
/// one slow reader never stalls the connection), bounded by the credit and
/// [`MAX_QUEUED`].
#[derive(Default)]
struct Mailbox {
    inbox: Mutex<Inbox>,
    notify: Notify,
}

impl Mailbox {
    fn push(&self, event: Event) {
        let mut inbox = lock(&self.inbox);
        if inbox.closed {
            return;
        }
        if let Event::Out(chunk @ (OutputChunk::Stdout(_) | OutputChunk::Stderr(_))) = &event
            && inbox.items.len() >= MAX_QUEUED
        {
            // A long queue: the bytes go into the newest queued chunk of the same stream
            // (the order between stdout and stderr is approximate anyway), so that tiny
            // frames cannot multiply the host's memory beyond the credit.
            let (stderr, bytes) = match chunk {
                OutputChunk::Stdout(b) => (false, b),
                OutputChunk::Stderr(b) => (true, b),
                OutputChunk::Lost(_) => return,
            };
            let same = inbox.items.iter_mut().rev().find(|item| match item {
                Item::Event(Event::Out(OutputChunk::Stdout(_))) => !stderr,
                Item::Event(Event::Out(OutputChunk::Stderr(_))) => stderr,
                Item::Merged { stderr: s, .. } => *s == stderr,
                _ => false,
            });
            if let Some(item) = same {
                if let Item::Event(Event::Out(
                    OutputChunk::Stdout(old) | OutputChunk::Stderr(old),
                )) = item
                {
                    let mut data = BytesMut::with_capacity(old.len() + bytes.len());
                    data.extend_from_slice(old);
                    *item = Item::Merged { stderr, data };
                }
                if let Item::Merged { data, .. } = item {
                    data.extend_from_slice(bytes);
                }
                return;
            }
        }
        inbox.items.push_back(Item::Event(event));
        drop(inbox);
        self.notify.notify_one();
    }

    fn close(&self) {
        lock(&self.inbox).closed = true;
        self.notify.notify_one();
    }

    /// The next event; `Err(())` while there is none yet; `Ok(None)` once closed and empty.
    fn try_recv(&self) -> std::result::Result<Option<Event>, ()> {
        let mut inbox = lock(&self.inbox);
        match inbox.items.pop_front() {
            Some(Item::Event(e)) => Ok(Some(e)),
            Some(Item::Merged { stderr, data }) => {
                let data = data.freeze();
                Ok(Some(Event::Out(if stderr {
                    OutputChunk::Stderr(data)
                } else {
                    OutputChunk::Stdout(data)
                })))
            }
            None if inbox.closed => Ok(None),
            None => Err(()),
        }
    }

    async fn recv(&self) -> Option<Event> {
        loop {
            let notified = self.notify.notified();
            if let Ok(event) = self.try_recv() {
                return event;
            }
            notified.await;
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        lock(&self.inbox).items.len()
    }
}

struct Slot {
    mailbox: Arc<Mailbox>,
    stdin: Option<Arc<Semaphore>>,
    /// Output bytes the helper may still send: a helper that sends more is cut off, so
    /// what the sandbox sends can never grow the host's memory past the credits.
    credit: Arc<AtomicI64>,
    /// A spawn whose `STARTED` (or an attach whose `ATTACHED`) has not come: the only
    /// state in which one may come.
    awaiting_start: bool,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.mailbox.close();
        if let Some(w) = &self.stdin {
            w.close();
        }
    }
}

/// The receiving side of one id: its events, the credit it hands back as it consumes
/// output, and, when dropped before the id's last event, a `DISCARD` (and a `KILL`
/// while a spawn is unanswered) so that the helper never waits on a reader that is gone.
pub(crate) struct Receiver {
    pub(super) id: u32,
    mailbox: Arc<Mailbox>,
    frames: mpsc::UnboundedSender<Vec<u8>>,
    credit: Arc<AtomicI64>,
    pub(super) done: bool,
    pub(super) kill_on_drop: bool,
    /// Another connection took the exec over (`DETACHED`), or its stream left it
    /// ([`crate::ExecStream::leave`]): this one's end must not kill it.
    pub(crate) handover: Arc<super::durable::Handover>,
    /// The session's table: an id dropped before its last event leaves it at once (a
    /// detached exec's last event never comes to a reader that let go of it).
    table: std::sync::Weak<Mutex<Table>>,
    /// Sent instead of `DISCARD` when dropped early (a detached exec's reader only
    /// lets go of it: `DISCARD` of a detached exec unattaches it).
    pub(super) on_drop: u8,
}

impl Receiver {
    fn track(&mut self, event: Option<Event>) -> Option<Event> {
        match &event {
            Some(Event::Out(_) | Event::Entry(..) | Event::Started | Event::Attached(_)) => {}
            _ => self.done = true,
        }
        event
    }

    /// The next event; `None` once the connection is gone.
    pub(crate) async fn next(&mut self) -> Option<Event> {
        let event = self.mailbox.recv().await;
        self.track(event)
    }

    /// [`Receiver::next`] from a blocking thread.
    pub(crate) fn blocking_next(&mut self) -> Option<Event> {
        let event = futures::executor::block_on(self.mailbox.recv());
        self.track(event)
    }

    /// Drops the receiver without telling the helper (an operation it ends by itself, such
    /// as a `PUT` ended with `STDIN_EOF`).
    pub(crate) fn quiet(mut self) {
        self.done = true;
    }

    /// The exec's output, returning each chunk's bytes as credit once the pump took it.
    /// With `resume`, a broken connection is not the end: the exec is attached again
    /// through a new connection from the offset reached (see [`super::durable::Resume`]).
    pub(crate) fn into_output(
        self,
        status: Arc<Mutex<Option<ExitStatus>>>,
        resume: Option<super::durable::Resume>,
    ) -> BoxStream<'static, io::Result<OutputChunk>> {
        futures::stream::unfold(Some((self, resume)), move |state| {
            let status = status.clone();
            async move {
                let (mut events, mut resume) = state?;
                loop {
                    let why = match events.next().await {
                        Some(Event::Out(chunk)) => {
                            let n = match &chunk {
                                OutputChunk::Stdout(b) | OutputChunk::Stderr(b) => b.len(),
                                OutputChunk::Lost(_) => 0,
                            };
                            events.give_credit(n);
                            if let Some(r) = &mut resume {
                                r.offset += n as u64;
                            }
                            return Some((Ok(chunk), Some((events, resume))));
                        }
                        Some(Event::Exit(s)) => {
                            *lock(&status) = Some(s);
                            return None;
                        }
                        Some(Event::Detached) => {
                            events.handover.taken_over.store(true, Ordering::SeqCst);
                            return Some((
                                Err(io::Error::other(
                                    "another stream attached to this exec and reads it now",
                                )),
                                None,
                            ));
                        }
                        Some(Event::Lost(why)) => why,
                        None => "the helper connection closed".to_string(),
                        Some(_) => continue,
                    };
                    let Some(r) = &mut resume else {
                        return Some((Err(io::Error::other(why)), None));
                    };
                    match r.resume(&why).await {
                        Ok((next, lost)) => {
                            // The old receiver's connection is gone: nothing to tell it.
                            events.done = true;
                            events = next;
                            if lost > 0 {
                                r.offset = r.offset.saturating_add(lost);
                                return Some((Ok(OutputChunk::Lost(lost)), Some((events, resume))));
                            }
                        }
                        Err(e) => return Some((Err(io::Error::other(e)), None)),
                    }
                }
            }
        })
        .boxed()
    }

    /// Grants the helper `n` more output bytes (after consuming as many).
    pub(crate) fn give_credit(&self, n: usize) {
        // `n` is what this id received: at most its credit, so it fits.
        let n = u32::try_from(n).unwrap_or(u32::MAX);
        self.credit.fetch_add(i64::from(n), Ordering::Relaxed);
        let mut credit = Enc::frame(proto::CREDIT, self.id);
        credit.u32(n);
        let _ = self.frames.send(credit.finish());
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if let Some(table) = self.table.upgrade() {
            let mut table = lock(&table);
            if table
                .slots
                .get(&self.id)
                .is_some_and(|slot| Arc::ptr_eq(&slot.mailbox, &self.mailbox))
            {
                table.slots.remove(&self.id);
            }
        }
        if self.handover.left.load(Ordering::SeqCst) {
            // Its stream left it: it runs on (for its grace), unattached.
            let _ = self.frames.send(Enc::frame(proto::LEAVE, self.id).finish());
            return;
        }
        if self.kill_on_drop {
            let _ = self.frames.send(Enc::frame(proto::KILL, self.id).finish());
        }
        let _ = self.frames.send(Enc::frame(self.on_drop, self.id).finish());
    }
}

#[derive(Default)]
struct Table {
    slots: HashMap<u32, Slot>,
    /// Waiting kills, told whether every process of the exec is gone.
    kills: HashMap<u32, Vec<oneshot::Sender<bool>>>,
    dead: Option<String>,
    /// When the unanswered `PING` was sent.
    ping: Option<Instant>,
    /// When the last frame came: a helper heard from within [`PING_INTERVAL`] is not
    /// pinged (a busy run's stream carries no pings; an idle one's does).
    heard: Option<Instant>,
}

/// One live helper. Dropping it closes the stream: the helper kills what it started and
/// exits.
pub(crate) struct Session {
    frames: mpsc::UnboundedSender<Vec<u8>>,
    table: Arc<Mutex<Table>>,
    pub(crate) hello: Hello,
    /// `GET`s this session runs at once: half the helper's bound ([`proto::MAX_GETS`]),
    /// so that one just done (the helper counts it until its thread ends) never makes
    /// the next one refused.
    pub(crate) gets: Arc<Semaphore>,
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

pub(super) fn lost(why: impl Into<String>) -> Error {
    Error::new(ErrorKind::Backend, why.into())
}

/// The output of a spawn whose outcome is unknown: the command may have run. The pump
/// reads the error, kills by the exec marker (the session is dead) and reports
/// [`ExitStatus::TransportLost`].
fn may_have_run(id: u32, why: String) -> (u32, RawProcess) {
    let output = futures::stream::iter([Err(io::Error::other(format!(
        "{why}; the command may have run"
    )))])
    .boxed();
    (
        id,
        RawProcess {
            output,
            stdin: None,
            status: Box::new(HelperStatus(Arc::new(Mutex::new(None)))),
        },
    )
}

/// What became of a spawn's wait for its answer.
enum Answer {
    Got(Option<Event>),
    /// The exec's deadline (and the grace) passed.
    Deadline,
    /// [`ANSWER_TIMEOUT`] passed.
    Silent,
}

impl Session {
    /// Takes over a started helper exec: waits for its `HELLO` (bounded in time, and in
    /// what it keeps of the helper's output meanwhile), then runs the reader, writer and
    /// pinger tasks.
    pub(crate) async fn open(mut process: RawProcess, timeout: Duration) -> Result<Session> {
        let mut sink = process
            .stdin
            .take()
            .ok_or_else(|| lost("the helper exec has no stdin"))?;
        let mut buf = BytesMut::new();
        let mut stderr = Vec::new();
        let mut stderr_total = 0u64;
        let hello = tokio::time::timeout(timeout, async {
            loop {
                if buf.len() >= 5 {
                    let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
                    if buf[4] != proto::HELLO {
                        return Err(lost("the helper did not greet"));
                    }
                    if len > MAX_HELLO_FRAME {
                        return Err(lost("the helper sent a malformed greeting"));
                    }
                }
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
                    Some(Ok(OutputChunk::Lost(_))) => {}
                    Some(Ok(OutputChunk::Stderr(b))) => {
                        stderr_total = stderr_total.saturating_add(b.len() as u64);
                        let room = GREETING_STDERR.saturating_sub(stderr.len());
                        stderr.extend_from_slice(&b[..room.min(b.len())]);
                    }
                    Some(Err(e)) => return Err(lost(format!("the helper exec broke: {e}"))),
                    None => {
                        let status = tokio::time::timeout(PING_TIMEOUT, process.status.status())
                            .await
                            .map_err(|_| lost("no exit status"))
                            .and_then(|s| s);
                        let status = match status {
                            Ok(s) => s.to_string(),
                            Err(e) => e.to_string(),
                        };
                        let mut text = String::from_utf8_lossy(&stderr).trim().to_string();
                        if stderr_total > stderr.len() as u64 {
                            text.push_str(&format!(
                                " (and {} more bytes)",
                                stderr_total - stderr.len() as u64
                            ));
                        }
                        return Err(lost(format!(
                            "the helper ended before its greeting ({status}): {text}"
                        )));
                    }
                }
            }
        })
        .await
        .map_err(|_| lost(format!("the helper did not greet within {timeout:?}")))??;

        let table = Arc::new(Mutex::new(Table::default()));
        let (frames, mut frames_rx) = mpsc::unbounded_channel::<Vec<u8>>();
        let stop = CancellationToken::new();
        // Cancelled when the writer ended (what was queued before the close went out).
        let flushed = CancellationToken::new();

        // Writer: frames to the helper's stdin, batched, flushed per batch.
        {
            let (table, stop) = (table.clone(), stop.clone());
            let flushed = flushed.clone().drop_guard();
            tokio::spawn(async move {
                let _flushed = flushed;
                // The bytes of the batch not written yet: a batch the close cuts short is
                // finished first below (a frame cut short would swallow those after it).
                let mut pending = BytesMut::new();
                let write = async {
                    while let Some(frame) = frames_rx.recv().await {
                        pending.extend_from_slice(&frame);
                        while pending.len() < 256 * 1024 {
                            match frames_rx.try_recv() {
                                Ok(more) => pending.extend_from_slice(&more),
                                Err(_) => break,
                            }
                        }
                        // `write` is cancel-safe: what it did not report written was not.
                        while !pending.is_empty() {
                            let n = sink.write(&pending).await?;
                            if n == 0 {
                                return Err(io::ErrorKind::WriteZero.into());
                            }
                            pending.advance(n);
                        }
                        sink.flush().await?;
                    }
                    io::Result::Ok(())
                };
                let (why, writable) = tokio::select! {
                    r = write => match r {
                        Ok(()) => ("the session closed".to_string(), true),
                        Err(e) => (format!("writing to the helper failed: {e}"), false),
                    },
                    _ = stop.cancelled() => ("the session closed".to_string(), true),
                };
                fail_all(&table, &why);
                stop.cancel();
                // What was queued before the close still goes out, in order, bounded (a
                // helper that does not read may never take it): above all the `KILL` of
                // a spawn given up on, which must reach the daemon after its `SPAWN`.
                let flush = async {
                    sink.write_all(&pending).await?;
                    while let Ok(frame) = frames_rx.try_recv() {
                        sink.write_all(&frame).await?;
                    }
                    sink.flush().await?;
                    sink.shutdown().await
                };
                if writable {
                    let _ = tokio::time::timeout(Duration::from_secs(1), flush).await;
                }
            });
        }

        // Reader: frames from the helper's stdout, dispatched by id. It never waits on a
        // reader of one id (events are queued, bounded by the credits).
        {
            let (table, stop) = (table.clone(), stop.clone());
            let mut output = process.output;
            let status = process.status;
            tokio::spawn(async move {
                let mut logged = 0usize;
                let mut unlogged = 0u64;
                let read = async {
                    loop {
                        while let Some((kind, id, payload, n)) = proto::split_frame(&buf)
                            .map_err(|_| "the helper sent a malformed frame".to_string())?
                        {
                            dispatch(&table, kind, id, payload)?;
                            buf.advance(n);
                        }
                        // A run keeps no buffer sized by its largest frame while idle.
                        if buf.is_empty() && buf.capacity() > 2 * proto::CHUNK {
                            buf = BytesMut::new();
                        }
                        match output.next().await {
                            Some(Ok(OutputChunk::Stdout(b))) => buf.extend_from_slice(&b),
                            Some(Ok(OutputChunk::Lost(_))) => {}
                            Some(Ok(OutputChunk::Stderr(b))) => {
                                let room = LOGGED_STDERR.saturating_sub(logged);
                                if room > 0 {
                                    let shown = &b[..room.min(b.len())];
                                    logged += shown.len();
                                    tracing::debug!(
                                        "exec helper: {}",
                                        crate::Shown(String::from_utf8_lossy(shown).trim_end())
                                    );
                                }
                                unlogged =
                                    unlogged.saturating_add((b.len() - room.min(b.len())) as u64);
                            }
                            Some(Err(e)) => return Err(format!("the helper stream broke: {e}")),
                            None => {
                                let s = match tokio::time::timeout(PING_TIMEOUT, status.status())
                                    .await
                                {
                                    Ok(Ok(s)) => s.to_string(),
                                    Ok(Err(e)) => e.to_string(),
                                    Err(_) => "no exit status".to_string(),
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
                if unlogged > 0 {
                    tracing::debug!("exec helper: {unlogged} more bytes of stderr not logged");
                }
                fail_all(&table, &why);
                // The writer closes the helper's stdin: it kills what still runs.
                stop.cancel();
                // The stream is dropped once the writer sent what was queued before the
                // close (above all the `KILL` of a spawn given up on) and the helper's side
                // ended it, or after DRAIN_BOUND: dropping it may abort its transport
                // with bytes not sent yet (Kubernetes' websocket task, with the `KILL`).
                let drain = async {
                    // Output is read meanwhile: a helper whose output is backed up may not
                    // read what the writer sends.
                    tokio::join!(flushed.cancelled(), async {
                        while output.next().await.is_some() {}
                    });
                };
                let _ = tokio::time::timeout(DRAIN_BOUND, drain).await;
                drop((output, status));
            });
        }

        // Pinger: a helper that stops answering (stopped, hung, or not reading) is taken
        // for dead, so that nothing waits on it for longer than PING_TIMEOUT.
        {
            let (table, stop, frames) = (table.clone(), stop.clone(), frames.clone());
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(PING_INTERVAL) => {}
                    }
                    let overdue = {
                        let mut table = lock(&table);
                        match table.ping {
                            Some(sent) => sent.elapsed() >= PING_TIMEOUT,
                            None if table.heard.is_some_and(|t| t.elapsed() < PING_INTERVAL) => {
                                false
                            }
                            None => {
                                table.ping = Some(Instant::now());
                                let _ = frames.send(Enc::frame(proto::PING, 0).finish());
                                false
                            }
                        }
                    };
                    if overdue {
                        let why =
                            format!("the helper did not answer a ping within {PING_TIMEOUT:?}");
                        tracing::warn!("{why}; its connection is dropped");
                        fail_all(&table, &why);
                        stop.cancel();
                        return;
                    }
                }
            });
        }

        Ok(Session {
            frames,
            table,
            hello,
            gets: Arc::new(Semaphore::new(proto::MAX_GETS / 2)),
            // Exec ids are the run's daemon's: a random start keeps this process's ids
            // apart from another's (a clash is refused and another id taken).
            next_id: AtomicU32::new(rand::random::<u32>() >> 1 | 1),
            stop: stop.clone(),
            _stop: stop.drop_guard(),
        })
    }

    /// Why the connection is gone, once it is.
    pub(crate) fn dead(&self) -> Option<String> {
        lock(&self.table).dead.clone()
    }

    /// Marks the session broken (every open operation ends as lost, the next exec of the
    /// run starts a new helper) and closes its stream.
    pub(crate) fn retire(&self, why: &str) {
        fail_all(&self.table, why);
        self.stop.cancel();
    }

    /// Opens an id: its receiver, and a stdin window when asked.
    fn open_id(&self, window: bool, spawn: bool) -> Result<(Receiver, Option<Arc<Semaphore>>)> {
        self.open_id_at(None, window, spawn)
    }

    /// [`Session::open_id`] with the id given (an exec to attach to); an id open here
    /// already is refused.
    pub(super) fn open_id_at(
        &self,
        given: Option<u32>,
        window: bool,
        spawn: bool,
    ) -> Result<(Receiver, Option<Arc<Semaphore>>)> {
        let mailbox = Arc::new(Mailbox::default());
        let stdin = window.then(|| Arc::new(Semaphore::new(proto::STDIN_WINDOW as usize)));
        let credit = Arc::new(AtomicI64::new(i64::from(proto::INITIAL_CREDIT)));
        let mut table = lock(&self.table);
        if let Some(why) = &table.dead {
            return Err(lost(why.clone()));
        }
        // After 2^32 operations the counter wraps: never 0 (the connection's) nor an id
        // still in use.
        let id = match given {
            Some(id) if id == 0 || table.slots.contains_key(&id) => {
                return Err(Error::invalid_spec(
                    "exec_id",
                    format!("exec {id} is read by another stream of this process already"),
                ));
            }
            Some(id) => id,
            None => loop {
                let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                if id != 0 && !table.slots.contains_key(&id) {
                    break id;
                }
            },
        };
        table.slots.insert(
            id,
            Slot {
                mailbox: mailbox.clone(),
                stdin: stdin.clone(),
                credit: credit.clone(),
                awaiting_start: spawn,
            },
        );
        let receiver = Receiver {
            id,
            mailbox,
            frames: self.frames.clone(),
            credit,
            done: false,
            kill_on_drop: false,
            handover: Arc::default(),
            table: Arc::downgrade(&self.table),
            on_drop: proto::DISCARD,
        };
        Ok((receiver, stdin))
    }

    /// Starts one exec and waits for the helper's answer: started, or a typed spawn error.
    ///
    /// The wait is bounded by [`ANSWER_TIMEOUT`], and by `deadline` (the exec's) plus
    /// [`ANSWER_GRACE`]. A helper that misses the bound is retired; since the command may
    /// have started, the exec is returned anyway, with output that ends at once: past the
    /// deadline the pump times it out, else it ends as lost; either way the pump kills by
    /// the exec marker. So does a connection that breaks before the answer: the helper may
    /// have started the command (`TransportLost`, never an error).
    ///
    /// An id the run's daemon holds already (another process's exec) is refused by the
    /// helper; another id is tried then. `resume` (a durable session only) lets the
    /// output resume through a new connection when this one breaks.
    pub(crate) async fn spawn(
        self: &Arc<Self>,
        raw: &RawExec,
        opts: &super::durable::SpawnOpts,
        deadline: Option<Instant>,
        resume: Option<super::durable::Reconnect>,
    ) -> Result<(u32, RawProcess, Arc<super::durable::ExecLink>)> {
        let mut tries = 0;
        loop {
            match self.spawn_once(raw, opts, deadline, resume.clone()).await {
                Err(e) if e.field() == Some(ID_IN_USE) && tries < 16 => tries += 1,
                other => return other,
            }
        }
    }

    async fn spawn_once(
        self: &Arc<Self>,
        raw: &RawExec,
        opts: &super::durable::SpawnOpts,
        deadline: Option<Instant>,
        resume: Option<super::durable::Reconnect>,
    ) -> Result<(u32, RawProcess, Arc<super::durable::ExecLink>)> {
        let (id, process, resume, handover) = self.spawn_raw(raw, opts, deadline, resume).await?;
        let link = super::durable::ExecLink::new(id, self.clone(), handover);
        let process = match resume {
            Some((events, status, reconnect)) => RawProcess {
                output: events.into_output(
                    status,
                    Some(super::durable::Resume::new(
                        link.clone(),
                        reconnect,
                        opts,
                        process.stdin.is_some(),
                    )),
                ),
                ..process
            },
            None => process,
        };
        Ok((id, process, link))
    }

    /// [`Session::spawn_once`] up to its output: for a started exec whose output may
    /// resume, its receiver, status and reconnect are returned for the caller to build
    /// the output with its link.
    #[allow(clippy::type_complexity)]
    async fn spawn_raw(
        self: &Arc<Self>,
        raw: &RawExec,
        opts: &super::durable::SpawnOpts,
        deadline: Option<Instant>,
        resume: Option<super::durable::Reconnect>,
    ) -> Result<(
        u32,
        RawProcess,
        Option<(
            Receiver,
            Arc<Mutex<Option<ExitStatus>>>,
            super::durable::Reconnect,
        )>,
        Arc<super::durable::Handover>,
    )> {
        let tty = opts.tty;
        let piped = !matches!(raw.stdin, Stdin::Null);
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
            tty,
            detach: opts.detach,
            keep: opts.keep,
            grace_ms: opts.grace_ms,
        };
        let (mut events, window) = self.open_id(piped, true)?;
        let id = events.id;
        let mut frame = Enc::frame(proto::SPAWN, id);
        spawn.encode(&mut frame);
        let frame = frame.finish();
        if frame.len() > proto::MAX_PAYLOAD {
            // Not reached with validated specs (argv and env are capped at 1 MiB each).
            events.quiet();
            lock(&self.table).slots.remove(&id);
            return Err(Error::invalid_spec(
                "argv",
                "the command and its env are too large",
            ));
        }
        if self.send_frame(frame).is_err() {
            // Never sent: nothing ran.
            events.quiet();
            return Err(lost("the helper connection closed"));
        }
        let status = Arc::new(Mutex::new(None));
        // Dropped before the answer: the helper kills what it may have started.
        events.kill_on_drop = true;
        let limit = Instant::now() + ANSWER_TIMEOUT;
        let answer = match deadline.filter(|d| *d < limit) {
            None => match tokio::time::timeout_at(limit, events.next()).await {
                Ok(event) => Answer::Got(event),
                Err(_) => Answer::Silent,
            },
            Some(deadline) => match tokio::time::timeout_at(deadline, events.next()).await {
                Ok(event) => Answer::Got(event),
                Err(_) => match tokio::time::timeout(ANSWER_GRACE, events.next()).await {
                    Ok(event) => Answer::Got(event),
                    Err(_) => Answer::Deadline,
                },
            },
        };
        let event = match answer {
            Answer::Got(event) => event,
            Answer::Deadline => {
                let why = "the helper did not answer a spawn by the exec's deadline";
                tracing::warn!(
                    "{why}; its connection is dropped, the exec killed through the engine"
                );
                // Its `KILL` queued first: a stopped daemon that goes on reads it after the
                // `SPAWN` (the connection's end alone would leave the command its grace).
                drop(events);
                self.retire(why);
                // The deadline passed: the pump times the exec out and kills it.
                return Ok((
                    id,
                    RawProcess {
                        output: futures::stream::pending().boxed(),
                        stdin: None,
                        status: Box::new(HelperStatus(status)),
                    },
                    None,
                    Arc::default(),
                ));
            }
            Answer::Silent => {
                let why = format!("the helper did not answer a spawn within {ANSWER_TIMEOUT:?}");
                tracing::warn!("{why}; its connection is dropped");
                drop(events);
                self.retire(&why);
                let (id, process) = may_have_run(id, why);
                return Ok((id, process, None, Arc::default()));
            }
        };
        let may_have_run = |id, why| {
            let (id, process) = may_have_run(id, why);
            Ok((id, process, None, Arc::default()))
        };
        events.kill_on_drop = false;
        match event {
            Some(Event::Started) => {}
            Some(Event::SpawnFailed(kind, message)) => {
                let (id, process) = spawn_failed(id, &raw.argv[0], kind, message)?;
                return Ok((id, process, None, Arc::default()));
            }
            Some(Event::Lost(why)) => return may_have_run(id, why),
            None => return may_have_run(id, "the helper connection closed".into()),
            Some(other) => {
                let why = format!("the helper answered a spawn with {other:?}");
                self.retire(&why);
                return may_have_run(id, why);
            }
        }
        let stdin = window.map(|window| self.stdin_sink(id, window));
        let resume = resume.filter(|_| self.hello.durable && (opts.detach || opts.grace_ms > 0));
        let process = RawProcess {
            output: futures::stream::empty().boxed(),
            stdin,
            status: Box::new(HelperStatus(status.clone())),
        };
        let handover = events.handover.clone();
        match resume {
            Some(reconnect) => Ok((id, process, Some((events, status, reconnect)), handover)),
            None => Ok((
                id,
                RawProcess {
                    output: events.into_output(status, None),
                    ..process
                },
                None,
                handover,
            )),
        }
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
                // `n` is at most CHUNK.
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
    /// Unbounded here: the caller bounds it ([`KILL_ANSWER_TIMEOUT`]); a dead session
    /// ends it at once.
    pub(crate) async fn kill(&self, id: u32) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        {
            let mut table = lock(&self.table);
            if let Some(why) = &table.dead {
                return Err(lost(why.clone()));
            }
            table.kills.entry(id).or_default().push(tx);
        }
        let _ = self.send_frame(Enc::frame(proto::KILL, id).finish());
        let all_gone = rx
            .await
            .map_err(|_| lost("the helper connection broke during a kill"))?;
        if all_gone {
            Ok(())
        } else {
            Err(Error::new(
                ErrorKind::Backend,
                "the helper's kill left some of the exec's processes alive",
            ))
        }
    }

    /// Starts a file operation (`PUT` of `dir`, `GET` of `path`, `LAYER` of the workspace
    /// `path`, or `BASE`, whose payload is empty: `path` is not sent): its id, events and
    /// stdin window.
    pub(crate) fn file_op(
        &self,
        kind: u8,
        path: &str,
    ) -> Result<(u32, Receiver, Option<Arc<Semaphore>>)> {
        let (events, window) = self.open_id(kind == proto::PUT, false)?;
        let id = events.id;
        let mut frame = Enc::frame(kind, id);
        if kind != proto::BASE {
            frame.bytes(path.as_bytes());
        }
        let _ = self.send_frame(frame.finish());
        Ok((id, events, window))
    }

    /// Sends a frame of an open operation.
    /// `RESIZE`: the new size of a terminal exec's terminal (a frame, no answer).
    pub(crate) fn resize(&self, id: u32, rows: u16, cols: u16) -> Result<()> {
        let mut frame = Enc::frame(proto::RESIZE, id);
        frame.u32(rows.into()).u32(cols.into());
        self.send_frame(frame.finish())
    }

    pub(crate) fn send_frame(&self, frame: Vec<u8>) -> Result<()> {
        self.frames
            .send(frame)
            .map_err(|_| lost("the helper connection closed"))
    }
}

/// A spawn the helper refused, as the plain path reports it: a missing or
/// non-executable program is exit 127 / 126 with the reason on stderr; a missing working
/// directory or user is [`ExitStatus::NotStarted`] naming the field.
fn spawn_failed(
    id: u32,
    program: &str,
    kind: SpawnError,
    message: String,
) -> Result<(u32, RawProcess)> {
    if kind == SpawnError::IdInUse {
        return Err(Error::invalid_spec(
            ID_IN_USE,
            format!("the run's helper holds exec {id} already: {message}"),
        ));
    }
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
                ErrorKind::LimitReached,
                format!("the sandbox refused a new process: {message}"),
            )
            .with("limit", crate::exec::RUN_LIMITS));
        }
        SpawnError::Other | SpawnError::IdInUse => {
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

/// An exec's status, once its `EXIT` came (shared with its output stream).
pub(crate) struct HelperStatus(pub(crate) Arc<Mutex<Option<ExitStatus>>>);

#[async_trait]
impl RawStatus for HelperStatus {
    async fn status(&self) -> Result<ExitStatus> {
        lock(&self.0)
            .clone()
            .ok_or_else(|| lost("the helper reported no exit status"))
    }
}

/// Marks the connection dead and tells every open id.
fn fail_all(table: &Mutex<Table>, why: &str) {
    let mut table = lock(table);
    if table.dead.is_none() {
        table.dead = Some(why.to_string());
    }
    for (_, slot) in table.slots.drain() {
        slot.mailbox.push(Event::Lost(why.to_string()));
        // Dropping the slot closes its queue and stdin window.
    }
    table.kills.clear();
}

/// A `STARTED` or `ATTACHED` (`what`) for `id`: true when its slot awaited it (now no
/// more), false for an id no longer open; a second one, or one unasked, is a protocol
/// error.
fn take_answer(table: &mut Table, id: u32, what: &str) -> std::result::Result<bool, String> {
    match table.slots.get_mut(&id) {
        Some(slot) if slot.awaiting_start => {
            slot.awaiting_start = false;
            Ok(true)
        }
        Some(_) => Err(format!("the helper sent {what} twice or unasked (id {id})")),
        None => Ok(false),
    }
}

/// Routes one frame from the helper; `Err` is a protocol error (the connection is dropped).
fn dispatch(
    table: &Mutex<Table>,
    kind: u8,
    id: u32,
    payload: &[u8],
) -> std::result::Result<(), String> {
    let bad = || format!("the helper sent a malformed frame (kind {kind})");
    let mut d = Dec::new(payload);
    let mut table = lock(table);
    table.heard = Some(Instant::now());
    // Output or an end for an id whose `STARTED`/`ATTACHED` has not come is what the
    // helper still sent to an earlier reader of the same exec on this connection (one
    // that let go of it): not this reader's, dropped.
    if matches!(kind, proto::STDOUT | proto::STDERR | proto::EXIT)
        && table.slots.get(&id).is_some_and(|slot| slot.awaiting_start)
    {
        return Ok(());
    }
    let len = i64::try_from(payload.len()).unwrap_or(i64::MAX);
    if matches!(kind, proto::STDOUT | proto::STDERR | proto::ENTRY)
        && let Some(slot) = table.slots.get(&id)
        && slot.credit.fetch_sub(len, Ordering::Relaxed) < len
    {
        return Err(format!(
            "the helper sent more output for id {id} than it was granted"
        ));
    }
    let (event, last) = match kind {
        proto::STARTED => {
            if !take_answer(&mut table, id, "STARTED")? {
                return Ok(());
            }
            (Event::Started, false)
        }
        proto::SPAWN_ERROR => {
            let k = SpawnError::from_u8(d.u8().map_err(|_| bad())?);
            let msg = peer_text(d.bytes().map_err(|_| bad())?);
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
            (Event::Exit(crate::execs::exit_status(k, v)), true)
        }
        proto::ENTRY => (
            Event::Entry(Entry::decode(&mut d).map_err(|_| bad())?, payload.len()),
            false,
        ),
        proto::DONE => (Event::Done, true),
        proto::ATTACHED => {
            if !take_answer(&mut table, id, "ATTACHED")? {
                return Ok(());
            }
            (
                Event::Attached(Attached::decode(&mut d).map_err(|_| bad())?),
                false,
            )
        }
        proto::GONE => (Event::Gone, true),
        proto::DETACHED => (Event::Detached, true),
        proto::EXECS => {
            let n = d.u32().map_err(|_| bad())? as usize;
            if n > proto::MAX_RECORDS {
                return Err(format!(
                    "the helper listed {n} execs, more than it may hold"
                ));
            }
            let mut list = Vec::with_capacity(n);
            for _ in 0..n {
                list.push(proto::ExecInfo::decode(&mut d).map_err(|_| bad())?);
            }
            (Event::Execs(list), true)
        }
        proto::FILE_ERROR => {
            let k = FileError::from_u8(d.u8().map_err(|_| bad())?);
            let path = peer_text(d.bytes().map_err(|_| bad())?);
            let msg = peer_text(d.bytes().map_err(|_| bad())?);
            (Event::FileFailed(k, path, msg), true)
        }
        proto::STDIN_ACK => {
            let n = d.u32().map_err(|_| bad())?;
            if let Some(w) = table.slots.get(&id).and_then(|s| s.stdin.as_ref())
                && !w.is_closed()
            {
                // At most what is in flight: the window less what is free.
                let n = n as usize;
                let free = w.available_permits();
                if n.checked_add(free)
                    .is_none_or(|total| total > proto::STDIN_WINDOW as usize)
                {
                    return Err(format!(
                        "the helper acknowledged {n} stdin bytes of id {id}, more than were sent"
                    ));
                }
                w.add_permits(n.min(Semaphore::MAX_PERMITS - free));
            }
            return Ok(());
        }
        proto::PONG => {
            table.ping = None;
            return Ok(());
        }
        proto::KILLED => {
            // One byte: 0 when some process outlived the kill; none (an exec already
            // gone) is done.
            let all_gone = !matches!(d.u8(), Ok(0));
            for tx in table.kills.remove(&id).unwrap_or_default() {
                let _ = tx.send(all_gone);
            }
            return Ok(());
        }
        proto::PROTOCOL_ERROR => {
            return Err(format!(
                "the helper refused a frame: {}",
                peer_text(d.bytes().unwrap_or_default())
            ));
        }
        _ => return Err(bad()),
    };
    if last {
        if let Some(slot) = table.slots.remove(&id) {
            slot.mailbox.push(event);
        }
    } else if let Some(slot) = table.slots.get(&id) {
        slot.mailbox.push(event);
    }
    Ok(())
}

#[cfg(test)]
mod tests;
