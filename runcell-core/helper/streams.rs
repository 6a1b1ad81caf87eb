//! An exec's streams: the output thread (stdout and stderr into the exec's record, sent
//! under the attached connection's credit, and the command's status from the shepherd's
//! channel, then `EXIT`) and the stdin thread.

use std::fs::File;
use std::io::{self, ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::thread;
use std::time::{Duration, Instant};

use crate::exec::Exec;
use crate::proto::{CHUNK, STDERR, STDIN_ACK, STDOUT};
use crate::{Helper, diag, lock, shepherd, sys, wait};

/// How long a terminal must stay quiet, once its command was reaped, to be taken as
/// drained.
const TTY_QUIET: Duration = Duration::from_millis(50);
/// How long a terminal is still read once its command was reaped (a background process
/// may keep printing on it).
const TTY_DRAIN: Duration = Duration::from_secs(2);

impl Helper {
    /// Reads the exec's stdout and stderr into its record (see `record.rs`: while a
    /// connection is attached, only as far as the record has room for bytes it was not
    /// sent, so a command that prints faster than the host reads is blocked on its pipe;
    /// unattached or discarded, always) and the command's status from the shepherd's
    /// channel `ctl`; then the exec is over (`EXIT`).
    pub(crate) fn output_thread(
        &'static self,
        ex: &Exec,
        mut pipes: [Option<File>; 2],
        wake: io::PipeReader,
        mut ctl: UnixStream,
    ) {
        const KINDS: [u8; 2] = [STDOUT, STDERR];
        if !ex.wait_started() {
            return;
        }
        let mut wake = File::from(OwnedFd::from(wake));
        let mut ctl_open = true;
        let mut inbox = Vec::new();
        let mut buf = vec![0u8; CHUNK];
        let mut reaped = false;
        // Once the root is reaped: what is still buffered in each pipe, the rest is dropped.
        let mut budget = [usize::MAX; 2];
        // A terminal's buffer does not hold yet what its other side wrote last (the
        // kernel moves it a moment later): after the root is reaped a terminal is read
        // until it ends (EIO), is quiet for TTY_QUIET, or for TTY_DRAIN at most.
        let tty = ex.tty.is_some();
        let mut drain_until = Instant::now();
        loop {
            if !reaped && ex.status().is_some() {
                reaped = true;
                drain_until = Instant::now() + TTY_DRAIN;
                for (i, p) in pipes.iter().enumerate() {
                    if let Some(f) = p
                        && !tty
                    {
                        budget[i] = sys::readable_bytes(f.as_raw_fd());
                    }
                }
            }
            if reaped {
                for (i, p) in pipes.iter_mut().enumerate() {
                    if budget[i] == 0 {
                        *p = None;
                    }
                }
            }
            if pipes.iter().all(Option::is_none) {
                break;
            }
            // No room: the pipes are not read (the command blocks on them) until a
            // credit, a detach or a discard makes some and kicks the wake pipe.
            let room = {
                let mut st = lock(&ex.st);
                let room = st.room();
                st.starved = room == 0;
                room
            };
            let polled = room > 0;
            let mut fds = [sys::PollFd::default(); 4];
            let mut slots = [usize::MAX; 4];
            let mut n = 0;
            for (i, p) in pipes.iter().enumerate() {
                if let Some(f) = p
                    && room > 0
                {
                    fds[n] = sys::PollFd {
                        fd: f.as_raw_fd(),
                        events: sys::POLLIN,
                        revents: 0,
                    };
                    slots[n] = i;
                    n += 1;
                }
            }
            let wake_slot = (!reaped || room == 0).then(|| {
                fds[n] = sys::PollFd {
                    fd: wake.as_raw_fd(),
                    events: sys::POLLIN,
                    revents: 0,
                };
                n += 1;
                n - 1
            });
            let ctl_slot = (!reaped && ctl_open).then(|| {
                fds[n] = sys::PollFd {
                    fd: ctl.as_raw_fd(),
                    events: sys::POLLIN,
                    revents: 0,
                };
                n += 1;
                n - 1
            });
            let wait_ms = match (reaped, tty) {
                _ if room == 0 => -1,
                (false, _) => -1,
                (true, false) => 0,
                (true, true) => TTY_QUIET.as_millis() as i32,
            };
            match sys::poll_fds(&mut fds[..n], wait_ms) {
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => {
                    thread::sleep(Duration::from_millis(20));
                    continue;
                }
            }
            let mut progress = false;
            let mut room = room;
            for (k, fd) in fds[..n].iter().enumerate() {
                if Some(k) == wake_slot {
                    if fd.revents != 0 {
                        let mut b = [0u8; 64];
                        let _ = wake.read(&mut b);
                    }
                    continue;
                }
                if Some(k) == ctl_slot {
                    if fd.revents != 0 {
                        ctl_open = self.read_shepherd(ex, &mut ctl, &mut inbox);
                    }
                    continue;
                }
                let i = slots[k];
                // A terminal that hung up may still hold what was written last: read it
                // until EIO.
                let hung_up_tty = tty && fd.revents & sys::POLLHUP != 0;
                if fd.revents & sys::POLLIN != 0 || hung_up_tty {
                    if room == 0 {
                        // The other pipe took the room: next round.
                        continue;
                    }
                    progress = true;
                    let want = room.min(budget[i]).min(CHUNK);
                    let Some(f) = pipes[i].as_mut() else { continue };
                    match f.read(&mut buf[..want]) {
                        Ok(0) => pipes[i] = None,
                        Ok(m) => {
                            self.append_output(ex, KINDS[i], &buf[..m]);
                            room -= m;
                            if reaped {
                                budget[i] = budget[i].saturating_sub(m);
                            }
                        }
                        Err(e)
                            if matches!(
                                e.kind(),
                                ErrorKind::Interrupted | ErrorKind::WouldBlock
                            ) => {}
                        Err(_) => pipes[i] = None,
                    }
                } else if fd.revents & (sys::POLLHUP | sys::POLLERR | sys::POLLNVAL) != 0 {
                    progress = true;
                    pipes[i] = None;
                }
            }
            if reaped && polled && (!progress || (tty && Instant::now() >= drain_until)) {
                // Nothing buffered any more; a background process holds the pipe: stop.
                pipes = [None, None];
            }
        }
        // The pipes ended first: the status is still to come from the shepherd.
        while ctl_open && ex.status().is_none() {
            ctl_open = self.read_shepherd(ex, &mut ctl, &mut inbox);
        }
        let status = {
            let mut st = lock(&ex.st);
            while st.status.is_none() {
                st = wait(&ex.cv, st);
            }
            st.status.unwrap_or(0)
        };
        self.exec_over(ex, status);
    }

    /// Feeds the exec's stdin from its queue, acknowledging what was written or dropped
    /// to the connection that sent it.
    pub(crate) fn stdin_thread(&'static self, ex: &Exec, pipe: File) {
        let _ = sys::set_nonblocking(pipe.as_raw_fd());
        if !ex.wait_started() {
            return;
        }
        let mut broken = false;
        loop {
            let (chunk, from) = {
                let mut st = lock(&ex.st);
                loop {
                    if st.done {
                        return;
                    }
                    if let Some(c) = st.queue.pop_front() {
                        break c;
                    }
                    if st.eof {
                        return; // Closes the pipe: the process sees EOF.
                    }
                    st = wait(&ex.cv, st);
                }
            };
            if !broken {
                match write_nonblocking(ex, &pipe, &chunk) {
                    Written::All => {}
                    Written::Broken => broken = true,
                    Written::Done => return,
                }
            }
            let mut st = lock(&ex.st);
            if st.done {
                return;
            }
            st.stdin_written(&from, chunk.len());
            from.send_u32(STDIN_ACK, ex.id, chunk.len() as u32);
        }
    }

    /// Reads the exec's shepherd's channel: the command's status. False once it ended;
    /// when it ended without a status the shepherd was killed (only root or the
    /// helper's own user can), and [`Helper::shepherd_lost`] gives the exec an end.
    fn read_shepherd(&self, ex: &Exec, ctl: &mut UnixStream, inbox: &mut Vec<u8>) -> bool {
        let mut buf = [0u8; 256];
        let open = match ctl.read(&mut buf) {
            Ok(0) => false,
            Ok(n) => {
                inbox.extend_from_slice(&buf[..n]);
                true
            }
            Err(e) => e.kind() == ErrorKind::Interrupted || e.kind() == ErrorKind::WouldBlock,
        };
        for (kind, p) in shepherd::split_frames(inbox) {
            if kind == shepherd::STATUS && p.len() == 4 {
                ex.reaped(i32::from_le_bytes([p[0], p[1], p[2], p[3]]));
            }
        }
        if !open && ex.status().is_none() {
            self.shepherd_lost(ex);
        }
        open
    }

    /// The shepherd died before it sent the command's status (killed from inside the
    /// sandbox): the exec ends as killed by the signal that killed its shepherd (SIGKILL
    /// if it exited), and its processes, now re-parented to the helper whatever session
    /// they made, are killed ([`Helper::kill_strays`]).
    fn shepherd_lost(&self, ex: &Exec) {
        ex.wait_shepherd(Instant::now() + Duration::from_secs(5));
        let ws = lock(&ex.st).shepherd_status.unwrap_or(sys::SIGKILL);
        let status = if ws & 0x7f != 0 && ws & 0x7f != 0x7f {
            ws & 0x7f
        } else {
            sys::SIGKILL
        };
        diag(format_args!(
            "exec {}: its shepherd {} died (wait status {ws:#x})",
            ex.id, ex.shepherd
        ));
        // Reaped (or 5 s passed): what it left is re-parented to this helper.
        self.kill_strays();
        ex.reaped(status);
    }
}

/// How a stdin write ended.
enum Written {
    All,
    /// The process closed its stdin (EPIPE) or another error: drop from now on.
    Broken,
    /// The exec is over.
    Done,
}

/// Writes all of `data` to a non-blocking pipe, waking every 200 ms to notice the end of
/// the exec (a background process may hold the pipe without reading).
fn write_nonblocking(ex: &Exec, pipe: &File, data: &[u8]) -> Written {
    let mut off = 0;
    while off < data.len() {
        match (&*pipe).write(&data[off..]) {
            Ok(0) => return Written::Broken,
            Ok(n) => off += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                let mut fds = [sys::PollFd {
                    fd: pipe.as_raw_fd(),
                    events: sys::POLLOUT,
                    revents: 0,
                }];
                let _ = sys::poll_fds(&mut fds, 200);
                if ex.is_done() {
                    return Written::Done;
                }
            }
            Err(_) => return Written::Broken,
        }
    }
    Written::All
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::mpsc::channel;

    use super::*;
    use crate::link::Link;
    use crate::proto::{EXIT, EXITED, Enc, INITIAL_CREDIT, MIN_KEEP, SIGNALED};
    use crate::testing::{Frame, TempDir};

    fn file<T: Into<OwnedFd>>(p: T) -> File {
        File::from(p.into())
    }

    /// The shepherd's `STATUS` frame.
    fn status_frame(status: i32) -> Vec<u8> {
        let mut e = Enc::frame(shepherd::STATUS, 0);
        e.u32(status as u32);
        e.finish()
    }

    /// What the frames of one exec carry: stdout, stderr, and the `EXIT` if it came.
    #[derive(Debug, Default)]
    struct Got {
        stdout: Vec<u8>,
        stderr: Vec<u8>,
        exit: Option<(u8, u32)>,
    }

    impl Got {
        fn add(&mut self, frames: Vec<Frame>) {
            for f in frames {
                assert!(self.exit.is_none(), "a frame after EXIT: {f:?}");
                match f.kind {
                    STDOUT => self.stdout.extend_from_slice(&f.payload),
                    STDERR => self.stderr.extend_from_slice(&f.payload),
                    EXIT => {
                        let mut d = f.dec();
                        self.exit = Some((d.u8().unwrap(), d.u32().unwrap()));
                    }
                    k => panic!("unexpected frame kind {k}"),
                }
                assert!(f.payload.len() <= CHUNK);
            }
        }
    }

    /// A test exec attached to a new link, registered with `h` (its shepherd a pid no
    /// process has).
    fn attached(
        h: &Helper,
        id: u32,
        piped: bool,
    ) -> (Arc<Exec>, Arc<Link>, UnixStream, UnixStream, io::PipeReader) {
        let (ex, theirs, reader, wake) = Exec::for_tests(id, piped);
        let ex = Arc::new(ex);
        let link = Arc::new(Link::new(None));
        ex.attach_for_tests(&link);
        h.register_for_tests(&ex, i32::MAX - id as i32);
        (ex, link, theirs, reader, wake)
    }

    /// Runs the output thread of a started test exec on a thread of its own; its end
    /// arrives on the returned channel.
    fn run_output(
        h: &'static Helper,
        ex: &Arc<Exec>,
        pipes: [Option<File>; 2],
        wake: io::PipeReader,
        ctl: UnixStream,
    ) -> std::sync::mpsc::Receiver<()> {
        ex.started_for_tests();
        let (tx, rx) = channel();
        let ex = ex.clone();
        thread::spawn(move || {
            h.output_thread(&ex, pipes, wake, ctl);
            let _ = tx.send(());
        });
        rx
    }

    #[test]
    fn output_then_exit_with_the_commands_status() {
        let dir = TempDir::new();
        let h = Helper::leaked(false, dir.path());
        for (status, exit) in [(3 << 8, (EXITED, 3)), (9, (SIGNALED, 9)), (0, (EXITED, 0))] {
            let (ex, link, mut theirs, reader, wake) = attached(h, 3, false);
            let (out_r, mut out_w) = io::pipe().unwrap();
            let (err_r, mut err_w) = io::pipe().unwrap();
            out_w.write_all(b"hello ").unwrap();
            err_w.write_all(b"oops").unwrap();
            out_w.write_all(b"world").unwrap();
            drop((out_w, err_w));
            theirs.write_all(&status_frame(status)).unwrap();
            let pipes = [Some(file(out_r)), Some(file(err_r))];
            let done = run_output(h, &ex, pipes, wake, reader);
            done.recv_timeout(Duration::from_secs(10)).unwrap();
            let mut got = Got::default();
            got.add(link.take_frames());
            assert_eq!(got.stdout, b"hello world");
            assert_eq!(got.stderr, b"oops");
            assert_eq!(got.exit, Some(exit), "status {status:#x}");
            assert!(ex.is_done());
            // Its EXIT went out: a non-detached exec's record is forgotten.
            assert!(lock(&ex.st).gone);
            lock(&h.reg).execs.clear();
        }
    }

    #[test]
    fn the_status_may_come_after_the_pipes_ended() {
        let dir = TempDir::new();
        let h = Helper::leaked(false, dir.path());
        let (ex, link, mut theirs, reader, wake) = attached(h, 4, false);
        let done = run_output(h, &ex, [None, None], wake, reader);
        assert!(done.recv_timeout(Duration::from_millis(200)).is_err());
        assert!(link.take_frames().is_empty());
        // Split across writes: a frame counts once whole.
        let f = status_frame(7 << 8);
        theirs.write_all(&f[..3]).unwrap();
        thread::sleep(Duration::from_millis(50));
        theirs.write_all(&f[3..]).unwrap();
        done.recv_timeout(Duration::from_secs(10)).unwrap();
        let mut got = Got::default();
        got.add(link.take_frames());
        assert_eq!(got.exit, Some((EXITED, 7)));
    }

    #[test]
    fn a_pipe_held_open_by_a_background_process_does_not_delay_exit() {
        let dir = TempDir::new();
        let h = Helper::leaked(false, dir.path());
        let (ex, link, mut theirs, reader, wake) = attached(h, 5, false);
        let (out_r, mut out_w) = io::pipe().unwrap();
        let (err_r, err_w) = io::pipe().unwrap();
        out_w.write_all(b"buffered").unwrap();
        let done = run_output(h, &ex, [Some(file(out_r)), Some(file(err_r))], wake, reader);
        theirs.write_all(&status_frame(0)).unwrap();
        // Both writers stay open: what was buffered is sent, then EXIT.
        done.recv_timeout(Duration::from_secs(10)).unwrap();
        let mut got = Got::default();
        got.add(link.take_frames());
        assert_eq!(got.stdout, b"buffered");
        assert_eq!(got.exit, Some((EXITED, 0)));
        drop((out_w, err_w));
    }

    #[test]
    fn output_waits_for_credit_and_a_discarded_exec_is_drained_silently() {
        let dir = TempDir::new();
        let h = Helper::leaked(false, dir.path());
        let (ex, link, mut theirs, reader, wake) = attached(h, 6, false);
        let (out_r, mut out_w) = io::pipe().unwrap();
        let (err_r, err_w) = io::pipe().unwrap();
        drop(err_w);
        let total = INITIAL_CREDIT as usize + 3 * MIN_KEEP as usize;
        let writer = thread::spawn(move || {
            let data = vec![b'x'; total];
            out_w.write_all(&data).unwrap();
        });
        let done = run_output(h, &ex, [Some(file(out_r)), Some(file(err_r))], wake, reader);
        let mut got = Got::default();
        let deadline = Instant::now() + Duration::from_secs(10);
        while got.stdout.len() < INITIAL_CREDIT as usize {
            assert!(Instant::now() < deadline, "{} bytes", got.stdout.len());
            got.add(link.take_frames());
            thread::sleep(Duration::from_millis(5));
        }
        thread::sleep(Duration::from_millis(200));
        got.add(link.take_frames());
        assert_eq!(
            got.stdout.len(),
            INITIAL_CREDIT as usize,
            "beyond the credit"
        );
        // The record took what it may keep unsent, no more: the writer is blocked.
        assert_eq!(
            lock(&ex.st).out.end(),
            u64::from(INITIAL_CREDIT) + u64::from(MIN_KEEP)
        );
        assert!(!writer.is_finished());
        h.grant(&link, 6, 100);
        let deadline = Instant::now() + Duration::from_secs(10);
        while got.stdout.len() < INITIAL_CREDIT as usize + 100 {
            assert!(Instant::now() < deadline, "the grant was not used");
            got.add(link.take_frames());
            thread::sleep(Duration::from_millis(5));
        }
        thread::sleep(Duration::from_millis(100));
        got.add(link.take_frames());
        assert_eq!(got.stdout.len(), INITIAL_CREDIT as usize + 100);
        // Discarded: the rest is read (the writer finishes) and dropped; EXIT follows.
        h.discard_exec(&link, 6);
        writer.join().unwrap();
        theirs.write_all(&status_frame(0)).unwrap();
        done.recv_timeout(Duration::from_secs(10)).unwrap();
        got.add(link.take_frames());
        assert_eq!(got.stdout.len(), INITIAL_CREDIT as usize + 100);
        assert_eq!(got.exit, Some((EXITED, 0)));
    }

    #[test]
    fn unattached_output_is_kept_up_to_keep_and_never_blocks_the_command() {
        let dir = TempDir::new();
        let h = Helper::leaked(false, dir.path());
        let (ex, mut theirs, reader, wake) = Exec::for_tests(13, false);
        let ex = Arc::new(ex);
        let (out_r, mut out_w) = io::pipe().unwrap();
        let (err_r, mut err_w) = io::pipe().unwrap();
        let total = 5 * MIN_KEEP as usize + 77;
        let writer = thread::spawn(move || {
            for i in 0..total / 1000 {
                out_w.write_all(&[i as u8; 500]).unwrap();
                err_w.write_all(&[i as u8; 500]).unwrap();
            }
            out_w.write_all(&vec![1u8; total % 1000]).unwrap();
        });
        let done = run_output(h, &ex, [Some(file(out_r)), Some(file(err_r))], wake, reader);
        writer.join().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while lock(&ex.st).out.end() < total as u64 {
            assert!(Instant::now() < deadline, "not all was read");
            thread::sleep(Duration::from_millis(5));
        }
        let st = lock(&ex.st);
        assert_eq!(st.out.base(), (total - MIN_KEEP as usize) as u64);
        drop(st);
        theirs.write_all(&status_frame(0)).unwrap();
        done.recv_timeout(Duration::from_secs(10)).unwrap();
        let st = lock(&ex.st);
        assert_eq!(st.exit, Some((EXITED, 0)));
        assert!(!st.exit_sent && !st.gone);
    }

    #[test]
    fn a_command_blocked_on_a_full_record_runs_on_once_unattached() {
        let dir = TempDir::new();
        let h = Helper::leaked(false, dir.path());
        let (ex, link, mut theirs, reader, wake) = attached(h, 14, false);
        let (out_r, mut out_w) = io::pipe().unwrap();
        let total = INITIAL_CREDIT as usize + 8 * MIN_KEEP as usize;
        let writer = thread::spawn(move || out_w.write_all(&vec![b'y'; total]).unwrap());
        let done = run_output(h, &ex, [Some(file(out_r)), None], wake, reader);
        let full = u64::from(INITIAL_CREDIT) + u64::from(MIN_KEEP);
        let deadline = Instant::now() + Duration::from_secs(10);
        while lock(&ex.st).out.end() < full {
            assert!(Instant::now() < deadline, "the record never filled");
            thread::sleep(Duration::from_millis(5));
        }
        thread::sleep(Duration::from_millis(100));
        assert_eq!(lock(&ex.st).out.end(), full);
        assert!(lock(&ex.st).starved);
        // The connection goes: the thread is woken, reads on, keeps the last bytes.
        h.connection_ended(&link);
        writer.join().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while lock(&ex.st).out.end() < total as u64 {
            assert!(Instant::now() < deadline, "not all was read");
            thread::sleep(Duration::from_millis(5));
        }
        theirs.write_all(&status_frame(0)).unwrap();
        done.recv_timeout(Duration::from_secs(10)).unwrap();
        let sent: usize = link.take_frames().iter().map(|f| f.payload.len()).sum();
        assert_eq!(sent, INITIAL_CREDIT as usize);
    }

    #[test]
    fn an_abandoned_exec_sends_nothing() {
        let dir = TempDir::new();
        let h = Helper::leaked(false, dir.path());
        let (ex, link, _theirs, reader, wake) = attached(h, 7, true);
        lock(&ex.st).done = true;
        let (out_r, mut out_w) = io::pipe().unwrap();
        out_w.write_all(b"never sent").unwrap();
        h.output_thread(&ex, [Some(file(out_r)), None], wake, reader);
        let (_r, w) = io::pipe().unwrap();
        h.stdin_thread(&ex, file(w));
        assert!(link.take_frames().is_empty());
    }

    #[test]
    fn a_lost_shepherd_ends_its_exec_as_killed_by_its_signal() {
        let dir = TempDir::new();
        let h = Helper::leaked(false, dir.path());
        // Wait status of the shepherd → the exec's end.
        for (ws, signal) in [(15, 15), (9, 9), (1 << 8, 9), (0, 9)] {
            let (ex, link, theirs, reader, wake) = attached(h, 8, false);
            lock(&ex.st).shepherd_status = Some(ws);
            let done = run_output(h, &ex, [None, None], wake, reader);
            drop(theirs); // Closed without a status.
            done.recv_timeout(Duration::from_secs(10)).unwrap();
            let mut got = Got::default();
            got.add(link.take_frames());
            assert_eq!(got.exit, Some((SIGNALED, signal)), "wait status {ws:#x}");
        }
    }

    #[test]
    fn stdin_is_written_in_order_acknowledged_and_closed_at_eof() {
        let dir = TempDir::new();
        let h = Helper::leaked(false, dir.path());
        let (ex, _theirs, _reader, _wake) = Exec::for_tests(9, true);
        let ex = Arc::new(ex);
        let from = Arc::new(Link::new(None));
        let (mut r, w) = io::pipe().unwrap();
        ex.started_for_tests();
        let feeder = ex.clone();
        let t = thread::spawn(move || h.stdin_thread(&feeder, file(w)));
        for chunk in [&b"ab"[..], b"", b"cde"] {
            let mut st = lock(&ex.st);
            st.stdin_queued(&from, chunk.len());
            st.queue.push_back((chunk.to_vec(), from.clone()));
            drop(st);
            ex.cv.notify_all();
        }
        let mut buf = [0u8; 5];
        r.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"abcde");
        lock(&ex.st).eof = true;
        ex.cv.notify_all();
        t.join().unwrap();
        // The pipe is closed: the process sees EOF.
        assert_eq!(r.read(&mut buf).unwrap(), 0);
        let acks: Vec<(u8, u32, u32)> = from
            .take_frames()
            .iter()
            .map(|f| (f.kind, f.id, f.u32()))
            .collect();
        assert_eq!(
            acks,
            [(STDIN_ACK, 9, 2), (STDIN_ACK, 9, 0), (STDIN_ACK, 9, 3)]
        );
        assert_eq!(lock(&ex.st).queued_from(&from), 0);
    }

    #[test]
    fn stdin_a_process_closed_is_dropped_but_still_acknowledged() {
        let dir = TempDir::new();
        let h = Helper::leaked(false, dir.path());
        let (ex, _theirs, _reader, _wake) = Exec::for_tests(10, true);
        let (a, b) = (Arc::new(Link::new(None)), Arc::new(Link::new(None)));
        let (r, w) = io::pipe().unwrap();
        drop(r);
        {
            let mut st = lock(&ex.st);
            st.queue
                .extend([(b"lost".to_vec(), a.clone()), (b"too".to_vec(), b.clone())]);
            st.stdin_queued(&a, 4);
            st.stdin_queued(&b, 3);
            st.eof = true;
        }
        ex.started_for_tests();
        h.stdin_thread(&ex, file(w));
        // Each acknowledged to the connection that sent it.
        let acks: Vec<u32> = a.take_frames().iter().map(Frame::u32).collect();
        assert_eq!(acks, [4]);
        let acks: Vec<u32> = b.take_frames().iter().map(Frame::u32).collect();
        assert_eq!(acks, [3]);
        let st = lock(&ex.st);
        assert_eq!((st.queued_from(&a), st.queued_from(&b)), (0, 0));
    }

    #[test]
    fn a_write_to_a_full_pipe_gives_up_when_the_exec_ends() {
        let (ex, _theirs, _reader, _wake) = Exec::for_tests(11, true);
        let ex = Arc::new(ex);
        let (r, w) = io::pipe().unwrap();
        let w = file(w);
        sys::set_nonblocking(w.as_raw_fd()).unwrap();
        assert!(matches!(write_nonblocking(&ex, &w, b"fits"), Written::All));
        let ender = ex.clone();
        thread::spawn(move || {
            thread::sleep(Duration::from_millis(100));
            lock(&ender.st).done = true;
        });
        let started = Instant::now();
        let big = vec![0u8; 4 << 20];
        assert!(matches!(write_nonblocking(&ex, &w, &big), Written::Done));
        assert!(started.elapsed() < Duration::from_secs(5));
        drop(r);
        assert!(matches!(write_nonblocking(&ex, &w, b"x"), Written::Broken));
    }
}
