//! A connection's outgoing side: the queue of frames for it and the writer thread that
//! owns its stream (stdout when the relay serves the connection itself, the socket
//! otherwise). Every thread queues frames here and never blocks on the stream. What is
//! queued is bounded: output (`STDOUT`, `STDERR`, a `GET`'s `ENTRY`) by the credit, which
//! the helper caps ([`crate::proto::MAX_CREDIT`]), and `EXIT` by the number of execs;
//! every other frame is an answer to something the peer sent, and those are bounded by
//! the reader: it takes no frame while the connection's unwritten answers (queued, or
//! taken by the writer and not written yet, each counted with its allocation) are over
//! [`REQUEST_BACKLOG`], nor, while all connections' together are over [`TOTAL_BACKLOG`],
//! while any of its own is unwritten ([`Link::wait_backlog`]). A peer that asks and
//! never reads cannot grow the helper's memory, however small its requests (a `PING`
//! flood); output in flight never holds a reader up (a host whose transport cannot read
//! while a write blocks, as on Kubernetes, would otherwise stall).

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::proto::{
    ENTRY, EXIT, Enc, FILE_ERROR, FileError, PROTOCOL_ERROR, SPAWN_ERROR, STDERR, STDOUT,
    SpawnError,
};
use crate::{HEADER, lock, sys, wait};

/// The writer's buffer: small frames are batched into one `write`.
const WRITE_BUFFER: usize = 128 * 1024;
/// Quiet time after which the writer gives the heap's free pages back to the kernel.
pub(crate) const TRIM_AFTER: Duration = Duration::from_secs(1);
/// A connection's unwritten answers beyond which its reader takes no frame until the
/// writer caught up (a host asks for little: its answers in flight are a `LIST` or two).
pub(crate) const REQUEST_BACKLOG: usize = 16 << 20;
/// Unwritten answers of all connections together beyond which a connection's reader
/// takes a frame only once every answer of its own was written.
pub(crate) const TOTAL_BACKLOG: usize = 64 << 20;
/// How often a reader held by [`TOTAL_BACKLOG`] looks again (the other connections'
/// writers do not wake it).
const TOTAL_BACKLOG_POLL: Duration = Duration::from_millis(20);

/// What a queued answer costs beyond its bytes (its allocation and its place in the
/// queue): a flood of small answers is counted at what it takes in memory.
const FRAME_OVERHEAD: usize = 64;

/// What a queued frame counts against the backlog: nothing for output and `EXIT`
/// (bounded by the credit and the execs), its bytes and [`FRAME_OVERHEAD`] for an answer.
fn cost(frame: &[u8]) -> usize {
    if frame.len() > 4 && matches!(frame[4], STDOUT | STDERR | ENTRY | EXIT) {
        0
    } else {
        frame.len() + FRAME_OVERHEAD
    }
}

/// Unwritten answers of every link of this process ([`cost`]).
static TOTAL: AtomicUsize = AtomicUsize::new(0);

fn total_add(n: usize) {
    TOTAL.fetch_add(n, Ordering::Relaxed);
}

fn total_sub(n: usize) {
    let _ = TOTAL.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| {
        Some(t.saturating_sub(n))
    });
}

/// Frames waiting for the writer thread.
#[derive(Default)]
pub(crate) struct OutQueue {
    pub(crate) frames: VecDeque<Vec<u8>>,
    /// Answers not written yet ([`cost`]): in `frames`, and in the batch the writer took.
    bytes: usize,
    /// The writer wrote and flushed everything and waits for more.
    pub(crate) idle: bool,
    /// No more frames come: the writer ends once it wrote what is queued.
    closed: bool,
}

/// One connection's outgoing frames.
pub(crate) struct Link {
    q: Mutex<OutQueue>,
    /// Signalled when a frame is queued or the link closes (the writer waits on it).
    out_cv: Condvar,
    /// Signalled when the writer took a batch, became idle, or the stream broke.
    idle_cv: Condvar,
    /// Set once writing failed or the connection ended: frames are dropped from then.
    broken: AtomicBool,
    /// A daemon connection's socket, to shut it down; `None`: the relay's own stdout.
    sock: Option<UnixStream>,
}

impl Link {
    /// A link whose writer will write to `sock` (a daemon connection) or to stdout.
    pub(crate) fn new(sock: Option<UnixStream>) -> Link {
        Link {
            q: Mutex::new(OutQueue::default()),
            out_cv: Condvar::new(),
            idle_cv: Condvar::new(),
            broken: AtomicBool::new(false),
            sock,
        }
    }

    /// Queues one whole frame for the writer thread; never blocks on the stream.
    /// Dropped once the link broke or closed.
    pub(crate) fn send(&self, frame: Vec<u8>) {
        if self.broken.load(Ordering::Relaxed) {
            return;
        }
        let mut q = lock(&self.q);
        if q.closed {
            return;
        }
        let c = cost(&frame);
        q.bytes += c;
        total_add(c);
        q.frames.push_back(frame);
        drop(q);
        self.out_cv.notify_one();
    }

    /// Writing failed or the connection ended: nothing more is queued.
    pub(crate) fn is_broken(&self) -> bool {
        self.broken.load(Ordering::SeqCst)
    }

    /// The writer thread: writes queued frames in batches, flushing whenever the queue
    /// is empty. Returns true once the link closed and everything queued was written,
    /// false when a write failed (then the link is broken: see [`Link::broke`]).
    pub(crate) fn writer(&self, out: File) -> bool {
        let mut w = io::BufWriter::with_capacity(WRITE_BUFFER, out);
        let mut batch: VecDeque<Vec<u8>> = VecDeque::new();
        let mut written = 0;
        loop {
            let mut q = lock(&self.q);
            // The last batch is written (into the buffer, at worst): no longer owed.
            let done = written.min(q.bytes);
            q.bytes -= done;
            total_sub(done);
            written = 0;
            if q.frames.is_empty() {
                drop(q);
                if w.flush().is_err() {
                    self.broke();
                    return false;
                }
                q = lock(&self.q);
                if q.frames.is_empty() {
                    q.idle = true;
                    self.idle_cv.notify_all();
                    if q.closed {
                        return true;
                    }
                    q = self.idle_wait(q);
                    q.idle = false;
                    if q.frames.is_empty() {
                        // Closed while idle.
                        return true;
                    }
                }
            }
            std::mem::swap(&mut q.frames, &mut batch);
            drop(q);
            self.idle_cv.notify_all();
            for f in batch.drain(..) {
                if w.write_all(&f).is_err() {
                    self.broke();
                    return false;
                }
                written += cost(&f);
            }
            if batch.capacity() > 1024 {
                batch = VecDeque::new();
            }
        }
    }

    /// The idle writer waits for a frame (or the close). After [`TRIM_AFTER`] without
    /// one it gives the heap's free pages back (once per quiet spell: the work since the
    /// last spell freed what it allocated, and glibc would keep it).
    fn idle_wait<'a>(&'a self, mut q: MutexGuard<'a, OutQueue>) -> MutexGuard<'a, OutQueue> {
        let mut trimmed = false;
        while q.frames.is_empty() && !q.closed {
            if trimmed {
                q = wait(&self.out_cv, q);
                continue;
            }
            let (g, timeout) = self
                .out_cv
                .wait_timeout(q, TRIM_AFTER)
                .unwrap_or_else(PoisonError::into_inner);
            q = g;
            if timeout.timed_out() && q.frames.is_empty() {
                drop(q);
                sys::release_free_memory();
                trimmed = true;
                q = lock(&self.q);
            }
        }
        q
    }

    /// Writing failed: the peer is gone. What is queued is dropped, and a daemon
    /// connection's socket is shut down both ways, so that its reader ends too.
    pub(crate) fn broke(&self) {
        self.broken.store(true, Ordering::SeqCst);
        let mut q = lock(&self.q);
        q.frames.clear();
        total_sub(q.bytes);
        q.bytes = 0;
        drop(q);
        self.idle_cv.notify_all();
        if let Some(s) = &self.sock {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// The connection is over: nothing more is queued, and a daemon connection's socket
    /// is shut down (a writer blocked on it fails and ends; the peer sees the end).
    pub(crate) fn close(&self) {
        self.broken.store(true, Ordering::SeqCst);
        lock(&self.q).closed = true;
        self.out_cv.notify_all();
        self.idle_cv.notify_all();
        if let Some(s) = &self.sock {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Lets the writer send what is queued, for at most `bound`.
    pub(crate) fn flush(&self, bound: Duration) {
        let deadline = Instant::now() + bound;
        let mut q = lock(&self.q);
        loop {
            let flushed = q.idle && q.frames.is_empty();
            if flushed || self.is_broken() {
                return;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            q = self
                .idle_cv
                .wait_timeout(q, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Waits until at most `limit` of this link's answers are unwritten and, while all
    /// links together have more than `total` unwritten, none of this one's (or the link
    /// broke).
    pub(crate) fn wait_backlog(&self, limit: usize, total: usize) {
        let mut q = lock(&self.q);
        loop {
            if self.is_broken() {
                return;
            }
            if q.bytes > limit {
                q = wait(&self.idle_cv, q);
            } else if q.bytes > 0 && TOTAL.load(Ordering::Relaxed) > total {
                q = self
                    .idle_cv
                    .wait_timeout(q, TOTAL_BACKLOG_POLL)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            } else {
                return;
            }
        }
    }

    /// Unwritten answers of this link ([`cost`]).
    #[cfg(test)]
    pub(crate) fn backlog(&self) -> usize {
        lock(&self.q).bytes
    }

    /// Drops the `STDOUT`, `STDERR` and `EXIT` frames of exec `id` still queued (not yet
    /// taken by the writer): the connection attaches to it again, and its output starts
    /// over from the offset the new `ATTACHED` names.
    pub(crate) fn purge(&self, id: u32) {
        let mut q = lock(&self.q);
        let before = q.bytes;
        let mut dropped = 0;
        q.frames.retain(|f| {
            let of_id = f.len() >= HEADER
                && matches!(f[4], STDOUT | STDERR | EXIT)
                && f[5..HEADER] == id.to_le_bytes();
            if of_id {
                dropped += cost(f);
            }
            !of_id
        });
        q.bytes = before - dropped;
        total_sub(dropped);
    }

    /// A frame without payload.
    pub(crate) fn send_empty(&self, kind: u8, id: u32) {
        self.send(Enc::frame(kind, id).finish());
    }

    /// A frame whose payload is one u32.
    pub(crate) fn send_u32(&self, kind: u8, id: u32, v: u32) {
        let mut e = Enc::frame(kind, id);
        e.u32(v);
        self.send(e.finish());
    }

    /// `SPAWN_ERROR`.
    pub(crate) fn send_spawn_error(&self, id: u32, kind: SpawnError, msg: &str) {
        let mut e = Enc::frame(SPAWN_ERROR, id);
        e.u8(kind as u8).bytes(msg.as_bytes());
        self.send(e.finish());
    }

    /// `FILE_ERROR`.
    pub(crate) fn send_file_error(&self, id: u32, kind: FileError, path: &[u8], msg: &str) {
        self.send(file_error_frame(id, kind, path, msg));
    }

    /// `PROTOCOL_ERROR` (id 0: the connection).
    pub(crate) fn send_protocol_error(&self, msg: &str) {
        let mut e = Enc::frame(PROTOCOL_ERROR, 0);
        e.bytes(msg.as_bytes());
        self.send(e.finish());
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        total_sub(lock(&self.q).bytes);
    }
}

#[cfg(test)]
impl Link {
    /// Takes the frames queued so far (no writer runs in unit tests).
    pub(crate) fn take_frames(&self) -> Vec<crate::testing::Frame> {
        let mut q = lock(&self.q);
        total_sub(q.bytes);
        q.bytes = 0;
        let frames = std::mem::take(&mut q.frames);
        frames
            .iter()
            .map(|f| crate::testing::Frame::parse(f))
            .collect()
    }

    /// Whether the writer is idle with nothing queued.
    pub(crate) fn is_idle(&self) -> bool {
        let q = lock(&self.q);
        q.idle && q.frames.is_empty()
    }
}

/// A `FILE_ERROR` frame.
pub(crate) fn file_error_frame(id: u32, kind: FileError, path: &[u8], msg: &str) -> Vec<u8> {
    let mut e = Enc::frame(FILE_ERROR, id);
    e.u8(kind as u8).bytes(path).bytes(msg.as_bytes());
    e.finish()
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::fd::OwnedFd;
    use std::sync::Arc;
    use std::thread;

    use super::*;
    use crate::proto::{EXECS, KILLED, PONG, STDIN_ACK};
    use crate::start_thread;
    use crate::testing::Frame;

    fn data(kind: u8, id: u32, n: usize) -> Vec<u8> {
        let mut e = Enc::frame(kind, id);
        e.raw(&vec![id as u8; n]);
        e.finish()
    }

    /// A link whose writer writes into a pipe; the pipe's reading end.
    fn piped() -> (Arc<Link>, io::PipeReader) {
        let link = Arc::new(Link::new(None));
        let (reader, writer) = io::pipe().unwrap();
        let l = link.clone();
        assert!(start_thread("writer", move || {
            l.writer(File::from(OwnedFd::from(writer)));
        }));
        (link, reader)
    }

    #[test]
    fn a_file_error_frame_carries_kind_path_and_message() {
        let f = Frame::parse(&file_error_frame(9, FileError::IsDir, b"a/b", "in the way"));
        assert_eq!((f.kind, f.id), (FILE_ERROR, 9));
        let mut d = f.dec();
        assert_eq!(FileError::from_u8(d.u8().unwrap()), FileError::IsDir);
        assert_eq!(d.bytes().unwrap(), b"a/b");
        assert_eq!(d.bytes().unwrap(), b"in the way");
        assert!(d.rest().is_empty());
    }

    #[test]
    fn frames_are_queued_in_order_and_dropped_once_the_link_broke() {
        let link = Link::new(None);
        link.send_empty(PONG, 1);
        link.send_u32(KILLED, 2, 1);
        link.send_spawn_error(3, SpawnError::UserDenied, "no");
        link.send_file_error(4, FileError::Untrusted, b"d", "link");
        link.send_protocol_error("bad");
        let frames = link.take_frames();
        let heads: Vec<(u8, u32)> = frames.iter().map(|f| (f.kind, f.id)).collect();
        assert_eq!(
            heads,
            [
                (PONG, 1),
                (KILLED, 2),
                (SPAWN_ERROR, 3),
                (FILE_ERROR, 4),
                (PROTOCOL_ERROR, 0)
            ]
        );
        assert!(frames[0].payload.is_empty());
        assert_eq!(frames[1].u32(), 1);
        let mut d = frames[2].dec();
        assert_eq!(SpawnError::from_u8(d.u8().unwrap()), SpawnError::UserDenied);
        assert_eq!(d.bytes().unwrap(), b"no");
        assert_eq!(frames[4].dec().bytes().unwrap(), b"bad");

        link.broke();
        link.send_empty(PONG, 5);
        assert!(link.take_frames().is_empty());
        // A closed link drops frames too.
        let link = Link::new(None);
        link.close();
        link.send_empty(PONG, 6);
        assert!(link.take_frames().is_empty());
    }

    #[test]
    fn purge_drops_only_the_output_and_exit_of_one_id() {
        let link = Link::new(None);
        link.send(data(STDOUT, 1, 10));
        link.send(data(STDOUT, 2, 10));
        link.send_u32(STDIN_ACK, 1, 3);
        link.send(data(STDERR, 1, 10));
        let mut e = Enc::frame(EXIT, 1);
        e.u8(0).u32(0);
        link.send(e.finish());
        link.send_empty(KILLED, 1);
        link.purge(1);
        let heads: Vec<(u8, u32)> = link.take_frames().iter().map(|f| (f.kind, f.id)).collect();
        assert_eq!(heads, [(STDOUT, 2), (STDIN_ACK, 1), (KILLED, 1)]);
    }

    #[test]
    fn the_writer_sends_every_frame_in_order_and_goes_idle() {
        let (link, mut reader) = piped();
        let mut expected = Vec::new();
        for id in 0..200u32 {
            let f = data(STDOUT, id, id as usize * 7);
            expected.extend_from_slice(&f);
            link.send(f);
        }
        let mut got = vec![0u8; expected.len()];
        reader.read_exact(&mut got).unwrap();
        assert!(got == expected, "the frames arrived changed or reordered");
        // Everything written: the writer is idle, and a flush does not wait.
        let started = Instant::now();
        link.flush(Duration::from_secs(5));
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(link.is_idle());
        // Closed: the writer ends, and the stream with it.
        link.close();
        let mut rest = Vec::new();
        reader.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty());
    }

    #[test]
    fn a_writer_that_trimmed_the_heap_while_idle_still_sends() {
        let (link, mut reader) = piped();
        for round in 0..2u32 {
            let f = data(STDOUT, round, 100_000);
            link.send(f.clone());
            let mut got = vec![0u8; f.len()];
            reader.read_exact(&mut got).unwrap();
            assert!(got == f, "round {round}: the frame arrived changed");
            // Quiet for longer than TRIM_AFTER: the writer trims, then waits again.
            thread::sleep(TRIM_AFTER + Duration::from_millis(300));
            assert!(link.is_idle());
        }
        link.close();
    }

    #[test]
    fn a_writer_whose_stream_breaks_drops_everything() {
        let (link, reader) = piped();
        drop(reader);
        link.send(data(STDOUT, 1, 10));
        let deadline = Instant::now() + Duration::from_secs(10);
        while !link.is_broken() {
            assert!(
                Instant::now() < deadline,
                "the broken stream went unnoticed"
            );
            thread::sleep(Duration::from_millis(5));
        }
        link.send(data(STDOUT, 1, 10));
        assert!(link.take_frames().is_empty());
        // Nothing to wait for.
        link.flush(Duration::from_secs(5));
        link.wait_backlog(0, 0);
    }

    #[test]
    fn flush_gives_up_on_a_writer_that_cannot_write() {
        let link = Link::new(None);
        // No writer runs: the queue never empties.
        link.send_empty(PONG, 1);
        let started = Instant::now();
        link.flush(Duration::from_millis(300));
        let waited = started.elapsed();
        assert!(waited >= Duration::from_millis(300), "{waited:?}");
        assert!(waited < Duration::from_secs(5), "{waited:?}");
    }

    #[test]
    fn what_the_writer_took_counts_until_it_is_written() {
        let (link, mut reader) = piped();
        // More than the pipe and the writer's buffer hold: the writer blocks mid-batch.
        for id in 0..10 {
            link.send(data(EXECS, id, 100_000));
        }
        thread::sleep(Duration::from_millis(300));
        let stuck = link.backlog();
        assert!(stuck >= 500_000, "{stuck}");
        // A waiter with a lower limit waits for the reader.
        let (tx, rx) = std::sync::mpsc::channel();
        let l = link.clone();
        thread::spawn(move || {
            l.wait_backlog(100_000, usize::MAX);
            tx.send(()).unwrap();
        });
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err());
        let mut got = vec![0u8; 10 * (HEADER + 100_000)];
        reader.read_exact(&mut got).unwrap();
        rx.recv_timeout(Duration::from_secs(10)).unwrap();
        link.flush(Duration::from_secs(5));
        assert_eq!(link.backlog(), 0);
        link.close();
    }

    #[test]
    fn small_frames_count_what_they_take_in_memory() {
        let link = Link::new(None);
        for id in 0..1000 {
            link.send_empty(PONG, id);
        }
        assert_eq!(link.backlog(), 1000 * (HEADER + FRAME_OVERHEAD));
        link.purge(7);
        link.send(data(STDOUT, 7, 10));
        link.purge(7);
        assert_eq!(link.backlog(), 1000 * (HEADER + FRAME_OVERHEAD));
        // Output and EXIT are bounded otherwise: they count nothing here.
        link.send(data(STDOUT, 8, 100_000));
        link.send(data(STDERR, 8, 100_000));
        link.send_u32(EXIT, 8, 0);
        assert_eq!(link.backlog(), 1000 * (HEADER + FRAME_OVERHEAD));
        link.broke();
        assert_eq!(link.backlog(), 0);
    }

    #[test]
    fn the_backlog_wait_ends_when_the_writer_takes_the_queue() {
        let link = Arc::new(Link::new(None));
        link.send(data(EXECS, 1, 1000));
        let (tx, rx) = std::sync::mpsc::channel();
        let l = link.clone();
        thread::spawn(move || {
            l.wait_backlog(100, usize::MAX);
            tx.send(()).unwrap();
        });
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err());
        let (mut reader, writer) = io::pipe().unwrap();
        let l = link.clone();
        thread::spawn(move || l.writer(File::from(OwnedFd::from(writer))));
        rx.recv_timeout(Duration::from_secs(10)).unwrap();
        let mut got = vec![0u8; HEADER + 1000];
        reader.read_exact(&mut got).unwrap();
        link.close();
    }
}
