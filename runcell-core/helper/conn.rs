//! A connection's reader: reads frames from the connection's stream (the socket, or the
//! relay's own stdin when it serves the connection itself) and dispatches them, never
//! blocking on one exec nor on the stream's other direction.

use std::collections::HashMap;
use std::fs::File;
use std::io::{ErrorKind, Read};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::files::{self, GetEnd, Put, Sender};
use crate::flow::Flow;
use crate::layer;
use crate::link::{Link, REQUEST_BACKLOG, TOTAL_BACKLOG, file_error_frame};
use crate::proto::{
    self, ATTACH, BASE, CREDIT, DISCARD, DONE, Dec, DecodeError, ENTRY, Enc, Entry, FileError, GET,
    KILL, KILLED, LAYER, LEAVE, LIST, MAX_GETS, PING, PONG, PUT, RELEASE, RESIZE, SPAWN, STDIN,
    STDIN_ACK, STDIN_EOF, STDIN_WINDOW, Spawn, SpawnError,
};
use crate::{Helper, diag, lock, start_thread, sys};

/// Bytes read from the stream at a time.
const READ_CHUNK: usize = 64 * 1024;
/// Queued stdin bytes of one exec from one connection beyond which that connection broke
/// the window rule (what other connections queued for it does not count).
const STDIN_QUEUE_LIMIT: usize = 4 * STDIN_WINDOW as usize;
/// Queued stdin bytes of one exec from all connections together beyond which the one
/// that sends more broke the rule (connections that ended leave theirs queued).
const STDIN_TOTAL_LIMIT: usize = 4 * STDIN_QUEUE_LIMIT;

/// A `PUT` or `GET` in progress.
enum FileOp {
    Put(Box<Put>),
    Get(Arc<Flow>),
}

/// A connection's reader: dispatches its frames; its file operations are its own.
pub(crate) struct Conn {
    h: &'static Helper,
    link: Arc<Link>,
    files: HashMap<u32, FileOp>,
    /// What the frames are read from, once [`Conn::run`] runs.
    input: Option<RawFd>,
}

impl Conn {
    /// The reader of the connection whose frames go out through `link`.
    pub(crate) fn new(h: &'static Helper, link: Arc<Link>) -> Conn {
        Conn {
            h,
            link,
            files: HashMap::new(),
            input: None,
        }
    }

    /// Reads frames from `input` until it ends or breaks, or a frame is malformed
    /// (`PROTOCOL_ERROR` is then queued). The connection's file operations are
    /// abandoned; the exit code for a helper that ends with its connection: 0, or 2
    /// after a protocol error.
    pub(crate) fn run(mut self, mut input: File) -> i32 {
        self.input = Some(input.as_raw_fd());
        let mut buf: Vec<u8> = Vec::with_capacity(2 * READ_CHUNK);
        loop {
            let mut start = 0;
            loop {
                match proto::split_frame(&buf[start..]) {
                    Ok(Some((kind, id, payload, len))) => {
                        // Whatever it asks for, a peer that does not read waits first.
                        self.link.wait_backlog(REQUEST_BACKLOG, TOTAL_BACKLOG);
                        if let Err(msg) = self.handle(kind, id, payload) {
                            return self.protocol_error(&msg);
                        }
                        start += len;
                    }
                    Ok(None) => break,
                    Err(_) => return self.protocol_error("frame length out of range"),
                }
            }
            buf.drain(..start);
            if buf.capacity() > 4 * READ_CHUNK && buf.len() < READ_CHUNK {
                buf.shrink_to(2 * READ_CHUNK);
            }
            let old = buf.len();
            buf.resize(old + READ_CHUNK, 0);
            match input.read(&mut buf[old..]) {
                Ok(0) => return self.end(0),
                Ok(n) => buf.truncate(old + n),
                Err(e) if e.kind() == ErrorKind::Interrupted => buf.truncate(old),
                Err(_) => return self.end(0),
            }
        }
    }

    /// The connection is over: a `PUT` cut short leaves no temporary file, a `GET` stops.
    fn end(&mut self, code: i32) -> i32 {
        for (_, op) in self.files.drain() {
            match op {
                FileOp::Put(mut p) => {
                    if let Some(pf) = p.file.take() {
                        pf.abandon();
                    }
                }
                FileOp::Get(flow) => flow.discard(),
            }
        }
        code
    }

    /// `PROTOCOL_ERROR`, then the end of the connection.
    fn protocol_error(&mut self, msg: &str) -> i32 {
        diag(format_args!("protocol error: {msg}"));
        self.link.send_protocol_error(msg);
        self.end(2)
    }

    /// Dispatches one frame; `Err` is a protocol error.
    fn handle(&mut self, kind: u8, id: u32, payload: &[u8]) -> Result<(), String> {
        let bad = |e: DecodeError| format!("frame kind {kind}: {e}");
        let mut d = Dec::new(payload);
        match kind {
            SPAWN => {
                let sp = Spawn::decode(&mut d).map_err(bad)?;
                self.spawn(id, &sp);
            }
            STDIN => self.stdin(id, payload)?,
            STDIN_EOF => self.stdin_eof(id),
            CREDIT => {
                let n = d.u32().map_err(bad)?;
                match self.files.get(&id) {
                    Some(FileOp::Get(flow)) => flow.grant(n),
                    _ => self.h.grant(&self.link, id, n),
                }
            }
            DISCARD => self.discard(id),
            RESIZE => {
                let rows = d.u32().and_then(proto::size).map_err(bad)?;
                let cols = d.u32().and_then(proto::size).map_err(bad)?;
                if let Some(ex) = self.h.exec(id)
                    && let Some(tty) = &ex.tty
                {
                    let _ = sys::set_window_size(tty, rows, cols);
                }
            }
            KILL => self.kill(id),
            PING => self.link.send_empty(PONG, id),
            PUT => {
                let path = d.bytes().map_err(bad)?.to_vec();
                self.put(id, path);
            }
            GET => {
                let path = d.bytes().map_err(bad)?.to_vec();
                self.stream(id, move |link, flow| files::get_tree(link, id, &path, flow));
            }
            BASE => {
                let h = self.h;
                self.stream(id, move |_, _| layer::base_op(h.daemon_dir.as_ref()));
            }
            LAYER => {
                let workspace = d.bytes().map_err(bad)?.to_vec();
                let h = self.h;
                self.stream(id, move |link, flow| {
                    let out = Sender::new(link, flow, id);
                    layer::layer_op(out, h.daemon_dir.as_ref(), &workspace)
                });
            }
            ENTRY => {
                let e = Entry::decode(&mut d).map_err(bad)?;
                self.entry(id, e);
            }
            ATTACH => {
                let from = d.u64().map_err(bad)?;
                self.h.attach(&self.link, id, from);
            }
            RELEASE => self.h.release(id),
            LEAVE => self.h.leave(&self.link, id),
            LIST => self.h.list(&self.link, id),
            _ => return Err(format!("unknown frame kind {kind}")),
        }
        Ok(())
    }

    /// Drops finished `GET`s.
    fn sweep(&mut self) {
        self.files
            .retain(|_, op| !matches!(op, FileOp::Get(f) if f.finished.load(Ordering::Acquire)));
    }

    /// Whether an id names something of this connection: one of its file operations, or
    /// an exec attached to it (whose frames would be mixed up with a new operation's).
    fn in_use(&self, id: u32) -> bool {
        self.files.contains_key(&id)
            || self
                .h
                .exec(id)
                .is_some_and(|ex| lock(&ex.st).attached_to(&self.link))
    }

    /// `SPAWN`: refused for id 0, an id of this connection's, or one the helper holds a
    /// record of.
    fn spawn(&mut self, id: u32, sp: &Spawn) {
        self.sweep();
        if id == 0 {
            // 0 is the connection's (and a spare shepherd's mark in the registry).
            self.link
                .send_spawn_error(id, SpawnError::Other, "id 0 is not an exec's");
            return;
        }
        if self.files.contains_key(&id) {
            self.link
                .send_spawn_error(id, SpawnError::IdInUse, "id already in use");
            return;
        }
        // A host gives up on a spawn the helper does not answer in time (a helper stopped
        // by a process of the run) and closes the connection: the command must not run
        // once the helper goes on and reads the `SPAWN` with the end behind it (a
        // detached one neither: no host ends a connection before the answer to a spawn
        // it still waits for).
        if self.input.is_some_and(sys::hung_up) {
            self.link.send_spawn_error(
                id,
                SpawnError::Other,
                "the connection ended before the spawn was read: nothing ran",
            );
            return;
        }
        if let Err((kind, msg)) = self.h.start_exec(id, sp, &self.link) {
            self.link.send_spawn_error(id, kind, &msg);
        }
    }

    /// `STDIN` for a `PUT` or an exec (queued for its stdin thread, never blocking here;
    /// acknowledged to this connection).
    fn stdin(&mut self, id: u32, data: &[u8]) -> Result<(), String> {
        if let Some(FileOp::Put(p)) = self.files.get_mut(&id) {
            if !p.failed
                && let Err(e) = p.data(self.h.root, data)
            {
                p.fail(&self.link, id, e);
            }
            self.link.send_u32(STDIN_ACK, id, data.len() as u32);
            return Ok(());
        }
        let Some(ex) = self.h.exec(id) else {
            return Ok(()); // Over (after EXIT nothing is sent): dropped.
        };
        let mut st = lock(&ex.st);
        if st.done {
            return Ok(());
        }
        st.stdin_taken += data.len() as u64;
        if !st.piped || st.eof {
            self.link.send_u32(STDIN_ACK, id, data.len() as u32);
            return Ok(());
        }
        let mine = st.stdin_queued(&self.link, data.len());
        if mine > STDIN_QUEUE_LIMIT || st.stdin_total() > STDIN_TOTAL_LIMIT {
            st.stdin_written(&self.link, data.len());
            return Err(format!("exec {id}: stdin window exceeded"));
        }
        st.queue.push_back((data.to_vec(), self.link.clone()));
        drop(st);
        ex.cv.notify_all();
        Ok(())
    }

    /// `STDIN_EOF`: the end of a `PUT` (`DONE`) or of an exec's stdin.
    fn stdin_eof(&mut self, id: u32) {
        if matches!(self.files.get(&id), Some(FileOp::Put(_)))
            && let Some(FileOp::Put(mut p)) = self.files.remove(&id)
        {
            if p.failed {
                return;
            }
            match p.file.take() {
                Some(pf) => {
                    let rel = pf.rel.clone();
                    pf.abandon();
                    self.link
                        .send_file_error(id, FileError::Invalid, &rel, "short data");
                }
                None => self.link.send_empty(DONE, id),
            }
            return;
        }
        if let Some(ex) = self.h.exec(id) {
            lock(&ex.st).eof = true;
            ex.cv.notify_all();
        }
    }

    /// `DISCARD`: a `GET` is abandoned without another frame; an exec attached here
    /// stops sending output here (see [`Helper::discard_exec`]). Unknown ids are ignored.
    fn discard(&mut self, id: u32) {
        if let Some(FileOp::Get(flow)) = self.files.get(&id) {
            flow.discard();
            self.files.remove(&id);
            return;
        }
        self.h.discard_exec(&self.link, id);
    }

    /// `KILL` (which implies `DISCARD`); `KILLED` comes here. One kill per exec runs at
    /// a time, on a thread of its own: a `KILL` while it runs only waits for its end.
    fn kill(&mut self, id: u32) {
        let h = self.h;
        self.discard(id);
        let Some(ex) = h.exec(id) else {
            self.link.send_empty(KILLED, id);
            return;
        };
        if !h.join_kill(&ex, &self.link) {
            return;
        }
        let killed = ex.clone();
        if !start_thread("kill", move || h.kill_exec(&killed)) {
            h.kill_exec(&ex);
        }
    }

    /// `PUT`: the base directory must exist.
    fn put(&mut self, id: u32, path: Vec<u8>) {
        self.sweep();
        if self.in_use(id) {
            self.link
                .send_file_error(id, FileError::Other, b"", "id already in use");
            return;
        }
        let put = match Put::start(&path) {
            Ok(put) => put,
            Err(failure) => {
                let mut put = Put::failed_with(None);
                put.fail(&self.link, id, failure);
                put
            }
        };
        self.files.insert(id, FileOp::Put(Box::new(put)));
    }

    /// `ENTRY` of a `PUT`.
    fn entry(&mut self, id: u32, e: Entry) {
        let root = self.h.root;
        let Some(FileOp::Put(p)) = self.files.get_mut(&id) else {
            return;
        };
        if p.failed {
            return;
        }
        let r = match &p.file {
            Some(prev) => Err((FileError::Invalid, prev.rel.clone(), "short data".into())),
            None => p.apply(root, e),
        };
        if let Err(err) = r {
            p.fail(&self.link, id, err);
        }
    }

    /// A `GET`, `BASE` or `LAYER` (`op`), on a thread of its own, under a flow of its
    /// own, ended by `DONE` or `FILE_ERROR` (nothing once discarded). Each counts among
    /// the connection's [`MAX_GETS`].
    fn stream(
        &mut self,
        id: u32,
        op: impl FnOnce(&Link, &Flow) -> Result<(), GetEnd> + Send + 'static,
    ) {
        self.sweep();
        if self.in_use(id) {
            self.link
                .send_file_error(id, FileError::Other, b"", "id already in use");
            return;
        }
        let running = self
            .files
            .values()
            .filter(|op| matches!(op, FileOp::Get(_)))
            .count();
        if running >= MAX_GETS {
            self.link.send_file_error(
                id,
                FileError::Other,
                b"",
                &format!("{MAX_GETS} GETs, BASEs and LAYERs run on this connection already"),
            );
            return;
        }
        let flow = Arc::new(Flow::new());
        self.files.insert(id, FileOp::Get(flow.clone()));
        let f = flow.clone();
        let link = self.link.clone();
        let started = start_thread("get", move || {
            // The last frame, unless discarded meanwhile (it costs no credit).
            match op(&link, &f) {
                Ok(()) => {
                    f.send(&link, Enc::frame(DONE, id).finish(), 0);
                }
                Err(GetEnd::Failed(kind, rel, msg)) => {
                    f.send(&link, file_error_frame(id, kind, &rel, &msg), 0);
                }
                Err(GetEnd::Discarded) => {}
            }
            f.finished.store(true, Ordering::Release);
        });
        if !started {
            self.files.remove(&id);
            self.link
                .send_file_error(id, FileError::Other, b"", "cannot start a thread");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::os::unix::fs::PermissionsExt;
    use std::path::Path;
    use std::time::{Duration, Instant};

    use super::*;
    use crate::exec::Exec;
    use crate::proto::{ATTACHED, EXECS, FILE_ERROR, GONE, PROTOCOL_ERROR, REGULAR, SPAWN_ERROR};
    use crate::testing::{Frame, TempDir};

    /// What a test looks at besides the connection: the helper and the frames queued
    /// for this connection.
    struct Peer {
        h: &'static Helper,
        link: Arc<Link>,
    }

    impl Peer {
        fn take_frames(&self) -> Vec<Frame> {
            self.link.take_frames()
        }

        fn exec(&self, id: u32) -> Option<Arc<Exec>> {
            self.h.exec(id)
        }
    }

    fn conn(dir: &TempDir) -> (Conn, Peer) {
        let h = Helper::leaked(false, dir.path());
        let link = Arc::new(Link::new(None));
        (Conn::new(h, link.clone()), Peer { h, link })
    }

    fn path_payload(p: &Path) -> Vec<u8> {
        let mut e = Enc::frame(0, 0);
        e.bytes(p.as_os_str().as_encoded_bytes());
        e.finish()[9..].to_vec()
    }

    fn entry_payload(path: &str, size: u64, mode: u32) -> Vec<u8> {
        let (uid, gid, _) = crate::sys::ids();
        let mut e = Enc::frame(0, 0);
        Entry {
            path: path.as_bytes().to_vec(),
            kind: REGULAR,
            mode,
            uid,
            gid,
            mtime: 1_700_000_000,
            size,
            link: Vec::new(),
        }
        .encode(&mut e);
        e.finish()[9..].to_vec()
    }

    /// A `FILE_ERROR`'s kind and path.
    fn file_error(f: &Frame) -> (FileError, Vec<u8>) {
        assert_eq!(f.kind, FILE_ERROR, "{f:?}");
        let mut d = f.dec();
        let kind = FileError::from_u8(d.u8().unwrap());
        (kind, d.bytes().unwrap().to_vec())
    }

    #[test]
    fn ping_is_answered_and_unknown_or_malformed_frames_are_protocol_errors() {
        let dir = TempDir::new();
        let (mut c, h) = conn(&dir);
        c.handle(PING, 77, b"").unwrap();
        let f = h.take_frames();
        assert_eq!((f[0].kind, f[0].id), (PONG, 77));
        assert_eq!(c.handle(200, 1, b"").unwrap_err(), "unknown frame kind 200");
        // A CREDIT needs its u32; a SPAWN, a PUT, a GET, an ENTRY and an ATTACH their
        // fields.
        for kind in [CREDIT, SPAWN, PUT, GET, ENTRY, ATTACH] {
            let err = c.handle(kind, 1, &[1, 2]).unwrap_err();
            assert!(err.starts_with(&format!("frame kind {kind}: ")), "{err}");
        }
        assert!(h.take_frames().is_empty());
    }

    #[test]
    fn frames_for_unknown_ids_are_ignored_and_a_kill_of_one_is_done_at_once() {
        let dir = TempDir::new();
        let (mut c, h) = conn(&dir);
        c.handle(STDIN, 5, b"data").unwrap();
        c.handle(STDIN_EOF, 5, b"").unwrap();
        c.handle(CREDIT, 5, &10u32.to_le_bytes()).unwrap();
        c.handle(DISCARD, 5, b"").unwrap();
        c.handle(RELEASE, 5, b"").unwrap();
        assert!(h.take_frames().is_empty());
        c.handle(KILL, 5, b"").unwrap();
        let f = h.take_frames();
        assert_eq!((f.len(), f[0].kind, f[0].id), (1, KILLED, 5));
    }

    #[test]
    fn a_spawn_that_cannot_be_planned_is_a_spawn_error() {
        let dir = TempDir::new();
        let (mut c, h) = conn(&dir);
        let mut e = Enc::frame(SPAWN, 1);
        Spawn::default().encode(&mut e);
        c.handle(SPAWN, 1, &e.finish()[9..]).unwrap();
        let f = h.take_frames();
        assert_eq!((f[0].kind, f[0].id), (SPAWN_ERROR, 1));
        let mut d = f[0].dec();
        assert_eq!(SpawnError::from_u8(d.u8().unwrap()), SpawnError::Other);
        assert_eq!(d.bytes().unwrap(), b"empty argv");
        // Nothing of it is left.
        assert!(h.exec(1).is_none());
        assert!(!c.in_use(1));
    }

    #[test]
    fn a_put_writes_its_file_and_acknowledges_its_data() {
        let dir = TempDir::new();
        let (mut c, h) = conn(&dir);
        c.handle(PUT, 3, &path_payload(dir.path())).unwrap();
        c.handle(ENTRY, 3, &entry_payload("f.txt", 11, 0o640))
            .unwrap();
        c.handle(STDIN, 3, b"hello ").unwrap();
        c.handle(STDIN, 3, b"world").unwrap();
        c.handle(STDIN_EOF, 3, b"").unwrap();
        let f: Vec<(u8, u32)> = h.take_frames().iter().map(|f| (f.kind, f.id)).collect();
        assert_eq!(f, [(STDIN_ACK, 3), (STDIN_ACK, 3), (DONE, 3)]);
        assert_eq!(fs::read(dir.join("f.txt")).unwrap(), b"hello world");
        let mode = fs::metadata(dir.join("f.txt"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o7777, 0o640);
        // The id is free again.
        assert!(!c.in_use(3));
    }

    #[test]
    fn a_put_cut_short_fails_and_leaves_no_temporary_file() {
        let dir = TempDir::new();
        let (mut c, h) = conn(&dir);
        c.handle(PUT, 4, &path_payload(dir.path())).unwrap();
        c.handle(ENTRY, 4, &entry_payload("part", 10, 0o644))
            .unwrap();
        c.handle(STDIN, 4, b"12345").unwrap();
        // Another entry before the file is whole, then the end.
        c.handle(ENTRY, 4, &entry_payload("next", 0, 0o644))
            .unwrap();
        c.handle(STDIN_EOF, 4, b"").unwrap();
        let f = h.take_frames();
        assert_eq!(f[0].kind, STDIN_ACK);
        assert_eq!(file_error(&f[1]), (FileError::Invalid, b"part".to_vec()));
        assert_eq!(f.len(), 2, "{f:?}");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);

        // The same, ended by STDIN_EOF inside the file.
        c.handle(PUT, 5, &path_payload(dir.path())).unwrap();
        c.handle(ENTRY, 5, &entry_payload("part", 10, 0o644))
            .unwrap();
        c.handle(STDIN_EOF, 5, b"").unwrap();
        let f = h.take_frames();
        assert_eq!(file_error(&f[0]), (FileError::Invalid, b"part".to_vec()));
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn a_failed_put_still_acknowledges_its_data_and_sends_one_error() {
        let dir = TempDir::new();
        let (mut c, h) = conn(&dir);
        c.handle(PUT, 6, &path_payload(Path::new("relative")))
            .unwrap();
        c.handle(ENTRY, 6, &entry_payload("f", 3, 0o644)).unwrap();
        c.handle(STDIN, 6, b"abc").unwrap();
        c.handle(STDIN_EOF, 6, b"").unwrap();
        let f = h.take_frames();
        assert_eq!(file_error(&f[0]).0, FileError::Invalid);
        assert_eq!((f[1].kind, f[1].u32()), (STDIN_ACK, 3));
        assert_eq!(f.len(), 2, "{f:?}");
        // A PUT into a file, not a directory.
        fs::write(dir.join("file"), "").unwrap();
        c.handle(PUT, 7, &path_payload(&dir.join("file"))).unwrap();
        assert_eq!(file_error(&h.take_frames()[0]).0, FileError::NotDir);
    }

    #[test]
    fn an_id_in_use_is_refused() {
        let dir = TempDir::new();
        let (mut c, h) = conn(&dir);
        c.handle(PUT, 8, &path_payload(dir.path())).unwrap();
        let mut e = Enc::frame(SPAWN, 8);
        Spawn {
            argv: vec![b"true".to_vec()],
            ..Spawn::default()
        }
        .encode(&mut e);
        c.handle(SPAWN, 8, &e.finish()[9..]).unwrap();
        c.handle(GET, 8, &path_payload(dir.path())).unwrap();
        c.handle(PUT, 8, &path_payload(dir.path())).unwrap();
        let f = h.take_frames();
        assert_eq!(f.len(), 3, "{f:?}");
        assert_eq!(f[0].kind, SPAWN_ERROR);
        assert_eq!(SpawnError::from_u8(f[0].payload[0]), SpawnError::IdInUse);
        for f in &f {
            let mut d = f.dec();
            d.u8().unwrap();
            if f.kind == FILE_ERROR {
                d.bytes().unwrap();
            }
            assert_eq!(d.bytes().unwrap(), b"id already in use");
        }
    }

    #[test]
    fn a_get_streams_its_file_on_a_thread_and_is_forgotten_when_done() {
        let dir = TempDir::new();
        let (mut c, h) = conn(&dir);
        fs::write(dir.join("data"), b"contents").unwrap();
        c.handle(GET, 9, &path_payload(&dir.join("data"))).unwrap();
        let mut frames = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !frames.iter().any(|f: &Frame| f.kind == DONE) {
            assert!(Instant::now() < deadline, "no DONE: {frames:?}");
            frames.extend(h.take_frames());
            std::thread::sleep(Duration::from_millis(5));
        }
        let kinds: Vec<u8> = frames.iter().map(|f| f.kind).collect();
        assert_eq!(kinds, [ENTRY, crate::proto::STDOUT, DONE]);
        assert_eq!(frames[1].payload, b"contents");
        let e = Entry::decode(&mut frames[0].dec()).unwrap();
        assert_eq!((e.path, e.size), (b"data".to_vec(), 8));
        // Finished: swept by the next operation, so the id is free again.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            c.sweep();
            if !c.in_use(9) {
                break;
            }
            assert!(Instant::now() < deadline, "the GET was never finished");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn a_discarded_get_sends_nothing_more() {
        let dir = TempDir::new();
        let (mut c, h) = conn(&dir);
        // Larger than the initial credit: the GET waits for credit that never comes.
        let size = crate::proto::INITIAL_CREDIT as usize + 1000;
        fs::write(dir.join("big"), vec![7u8; size]).unwrap();
        c.handle(GET, 10, &path_payload(&dir.join("big"))).unwrap();
        // ENTRY and STDOUT payloads both count against the credit.
        let mut sent = 0;
        let deadline = Instant::now() + Duration::from_secs(10);
        while sent < crate::proto::INITIAL_CREDIT as usize {
            assert!(Instant::now() < deadline, "{sent} bytes sent");
            for f in h.take_frames() {
                assert!(f.kind == ENTRY || f.kind == crate::proto::STDOUT, "{f:?}");
                sent += f.payload.len();
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(sent, crate::proto::INITIAL_CREDIT as usize);
        c.handle(DISCARD, 10, b"").unwrap();
        assert!(!c.in_use(10));
        std::thread::sleep(Duration::from_millis(200));
        assert!(h.take_frames().is_empty());
    }

    #[test]
    fn stdin_beyond_the_window_is_a_protocol_error() {
        let dir = TempDir::new();
        let (mut c, h) = conn(&dir);
        let (ex, _theirs, _reader, _wake) = Exec::for_tests(11, true);
        let ex = Arc::new(ex);
        h.h.register_for_tests(&ex, i32::MAX);
        let chunk = vec![0u8; STDIN_WINDOW as usize];
        for _ in 0..4 {
            c.handle(STDIN, 11, &chunk).unwrap();
        }
        assert_eq!(lock(&ex.st).queued_from(&h.link), STDIN_QUEUE_LIMIT);
        assert_eq!(
            c.handle(STDIN, 11, b"x").unwrap_err(),
            "exec 11: stdin window exceeded"
        );
        // Queued with the connection that sent it (its STDIN_ACK goes there).
        assert!(
            lock(&ex.st)
                .queue
                .iter()
                .all(|(_, from)| Arc::ptr_eq(from, &h.link))
        );
        // A STDIN_EOF is recorded for the stdin thread; later data is acknowledged and
        // dropped.
        c.handle(STDIN_EOF, 11, b"").unwrap();
        assert!(lock(&ex.st).eof);
        let _ = h.take_frames();
        c.handle(STDIN, 11, b"late").unwrap();
        let f = h.take_frames();
        assert_eq!((f[0].kind, f[0].u32()), (STDIN_ACK, 4));
        assert_eq!(
            lock(&ex.st).stdin_taken,
            4 * u64::from(STDIN_WINDOW) + 1 + 4
        );
    }

    #[test]
    fn credit_and_discard_of_an_exec_count_only_from_the_connection_attached() {
        let dir = TempDir::new();
        let (mut c, h) = conn(&dir);
        let (ex, _theirs, _reader, _wake) = Exec::for_tests(12, false);
        let ex = Arc::new(ex);
        h.h.register_for_tests(&ex, i32::MAX);
        let initial = u64::from(crate::proto::INITIAL_CREDIT);
        // Not attached here: ignored.
        c.handle(CREDIT, 12, &5u32.to_le_bytes()).unwrap();
        c.handle(DISCARD, 12, b"").unwrap();
        assert_eq!(lock(&ex.st).out.credit(), initial);
        assert!(!lock(&ex.st).discarded);
        ex.attach_for_tests(&h.link);
        c.handle(CREDIT, 12, &5u32.to_le_bytes()).unwrap();
        assert_eq!(lock(&ex.st).out.credit(), initial + 5);
        c.handle(DISCARD, 12, b"").unwrap();
        assert!(lock(&ex.st).discarded);
        assert!(h.take_frames().is_empty());
    }

    #[test]
    fn attach_list_and_release_are_answered_here() {
        let dir = TempDir::new();
        let (mut c, h) = conn(&dir);
        c.handle(ATTACH, 20, &7u64.to_le_bytes()).unwrap();
        c.handle(LIST, 21, b"").unwrap();
        let f = h.take_frames();
        assert_eq!((f[0].kind, f[0].id), (GONE, 20));
        assert_eq!((f[1].kind, f[1].id, f[1].u32()), (EXECS, 21, 0));
        let (ex, _theirs, _reader, _wake) = Exec::for_tests(20, false);
        let ex = Arc::new(ex);
        h.h.register_for_tests(&ex, i32::MAX);
        c.handle(ATTACH, 20, &0u64.to_le_bytes()).unwrap();
        let f = h.take_frames();
        assert_eq!((f[0].kind, f[0].id), (ATTACHED, 20));
        assert!(lock(&ex.st).attached_to(&h.link));
        // Attached here: its id is this connection's, no file operation may take it.
        c.handle(GET, 20, &path_payload(dir.path())).unwrap();
        assert_eq!(file_error(&h.take_frames()[0]).0, FileError::Other);
        // Released while it runs: kept until it is over.
        c.handle(RELEASE, 20, b"").unwrap();
        assert!(lock(&ex.st).released && !lock(&ex.st).gone);
    }

    #[test]
    fn the_reader_ends_with_the_stream_or_at_a_malformed_frame() {
        let dir = TempDir::new();
        // A PING, then the end: 0.
        let (c, h) = conn(&dir);
        let (r, mut w) = std::io::pipe().unwrap();
        let mut ping = Enc::frame(PING, 3).finish();
        // Split across reads.
        std::io::Write::write_all(&mut w, &ping[..4]).unwrap();
        let t = std::thread::spawn(move || c.run(File::from(std::os::fd::OwnedFd::from(r))));
        std::thread::sleep(Duration::from_millis(50));
        std::io::Write::write_all(&mut w, &ping.split_off(4)).unwrap();
        drop(w);
        assert_eq!(t.join().unwrap(), 0);
        let f = h.take_frames();
        assert_eq!((f.len(), f[0].kind, f[0].id), (1, PONG, 3));
        // A frame length out of range: PROTOCOL_ERROR, 2.
        let (c, h) = conn(&dir);
        let (r, mut w) = std::io::pipe().unwrap();
        std::io::Write::write_all(&mut w, &[1, 0, 0, 0, PING]).unwrap();
        assert_eq!(c.run(File::from(std::os::fd::OwnedFd::from(r))), 2);
        let f = h.take_frames();
        assert_eq!((f.len(), f[0].kind), (1, PROTOCOL_ERROR));
        // An unknown kind: the same.
        let (c, h) = conn(&dir);
        let (r, mut w) = std::io::pipe().unwrap();
        std::io::Write::write_all(&mut w, &Enc::frame(99, 0).finish()).unwrap();
        assert_eq!(c.run(File::from(std::os::fd::OwnedFd::from(r))), 2);
        assert_eq!(h.take_frames()[0].kind, PROTOCOL_ERROR);
    }
}
