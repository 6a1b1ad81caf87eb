//! Execs: the registry of execs (each with its record) and their shepherds, a `SPAWN`
//! started under a shepherd of its own, the reaper of every child, and kills. The plan
//! of a spawn is in `plan.rs`, an exec's output and stdin threads in `streams.rs`, its
//! record's life across connections in `durable.rs`.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::{self, ErrorKind, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::link::Link;
use crate::procs;
use crate::proto::{
    Dec, Enc, GONE, INFO_ARG_BYTES, INFO_ARGS, KILL_GRACE_MS, KILLED, MAX_RECORDS, STARTED, Spawn,
    SpawnError,
};
use crate::record::Output;
use crate::sys::{self, ECHILD};
use crate::{Helper, diag, lock, shepherd, spawn_error_kind, start_thread, wait};

/// How long a shepherd may take to answer a plan (it starts the command and answers at
/// once; only a stopped one takes longer).
const SHEPHERD_ANSWER: Duration = Duration::from_secs(8);
/// How long one sweep of strays goes on ([`Helper::kill_strays`]).
const STRAY_PHASE: Duration = Duration::from_secs(2);
/// How long a kill waits for the exec's shepherd to confirm that its processes are gone
/// (its graceful kill takes about `KILL_GRACE_MS`; the host waits 4 s for `KILLED`).
const KILL_CONFIRM: Duration = Duration::from_millis(KILL_GRACE_MS + 2500);
/// How long the end of a connection (or of the one-connection helper) waits for the
/// shepherds of the execs it kills at once.
pub(crate) const SHUTDOWN_KILL: Duration = Duration::from_secs(3);

/// The execs the helper knows.
#[derive(Default)]
pub(crate) struct Registry {
    /// By id: every record, and, after its record was forgotten, an exec whose shepherd
    /// still lives (a background process of it runs: a `KILL` still reaches it, and its
    /// id stays in use). Removed once both are over, or at once when its spawn failed.
    pub(crate) execs: HashMap<u32, Arc<Exec>>,
    /// Shepherds not reaped yet: pid → exec id ([`SPARE`] for the spare).
    shepherds: HashMap<i32, u32>,
    /// Bumped on every spawn.
    spawned: u64,
    /// Bumped on every exec: the order records were made in.
    seq: u64,
    /// A shepherd started ahead, waiting for its plan: the next exec takes it, so that
    /// starting the shepherd is not on any exec's way.
    spare: Option<Shepherd>,
}

/// The exec id a spare shepherd is registered under (0 is the connection: never an exec).
const SPARE: u32 = 0;

impl Registry {
    /// Forgets `ex`'s record: no more frames of it, a later `ATTACH` is `GONE`, `LIST`
    /// no longer shows it, its retained output is freed. The exec itself is removed once
    /// its shepherd was reaped (at once if it was).
    pub(crate) fn forget(&mut self, ex: &Exec, st: &mut ExecState) {
        st.gone = true;
        st.link = None;
        st.deadline = None;
        st.out = Output::new(0);
        if st.shepherd_status.is_some() && self.execs.get(&ex.id).is_some_and(|e| e.seq == ex.seq) {
            self.execs.remove(&ex.id);
        }
    }

    /// Records not forgotten.
    fn records(&self) -> usize {
        self.execs.values().filter(|ex| !lock(&ex.st).gone).count()
    }

    /// Makes room for one more record: at `cap` ([`MAX_RECORDS`]), exited detached
    /// records whose `EXIT` went out (or that nobody is attached to) are forgotten,
    /// oldest first. False when that is not enough.
    fn make_room(&mut self, cap: usize) -> bool {
        let n = self.records();
        if n < cap {
            return true;
        }
        let mut old: Vec<Arc<Exec>> = self
            .execs
            .values()
            .filter(|ex| {
                let st = lock(&ex.st);
                ex.detach && !st.gone && st.done && (st.exit_sent || st.link.is_none())
            })
            .cloned()
            .collect();
        old.sort_by_key(|ex| ex.seq);
        let need = n + 1 - cap;
        for ex in old.iter().take(need) {
            let mut st = lock(&ex.st);
            self.forget(ex, &mut st);
        }
        old.len() >= need
    }
}

/// A shepherd started, not yet given a plan: its pid, the helper's end of its control
/// channel, and the helper's ends of the pipes its command will get.
struct Shepherd {
    pid: i32,
    ctl: UnixStream,
    stdin: File,
    stdout: File,
    stderr: File,
}

/// An exec and its record.
pub(crate) struct Exec {
    pub(crate) id: u32,
    /// Its place in the order execs were made (tells an exec from a later one of the
    /// same id).
    pub(crate) seq: u64,
    /// Its shepherd (the session leader of the exec's processes).
    pub(crate) shepherd: i32,
    /// The helper's end of the shepherd's control channel, for kill orders (the output
    /// thread reads a clone of it).
    ctl: Mutex<UnixStream>,
    pub(crate) st: Mutex<ExecState>,
    /// Signalled on any change of `st`.
    pub(crate) cv: Condvar,
    /// Written (non-blocking) to wake the output thread's poll: the command's status is
    /// known, or its record has room again.
    wake: io::PipeWriter,
    /// A terminal exec's terminal (its master side), for `RESIZE`.
    pub(crate) tty: Option<File>,
    /// Spawned detached: runs on without a connection.
    pub(crate) detach: bool,
    /// How long it outlives the end of its connection ([`Spawn::grace_ms`]).
    pub(crate) grace: Duration,
    /// What `LIST` shows of its command.
    pub(crate) argv: Vec<Vec<u8>>,
    /// When it was spawned, milliseconds since the epoch.
    pub(crate) started_ms: u64,
}

/// The mutable part of an exec.
pub(crate) struct ExecState {
    /// Wait status of the command, once its shepherd reported it.
    pub(crate) status: Option<i32>,
    /// Wait status of the shepherd, once reaped: none of the exec's processes is left.
    pub(crate) shepherd_status: Option<i32>,
    /// `STARTED` was sent: the threads may send frames.
    pub(crate) started: bool,
    /// The command's pid, once started.
    pub(crate) root: Option<i32>,
    /// Over: its output thread ended (status known, output drained: `exit` is set), or
    /// its spawn was abandoned.
    pub(crate) done: bool,
    /// Stdin is a pipe (else `/dev/null`).
    pub(crate) piped: bool,
    /// `STDIN` data not written yet, each with the connection it came from (which gets
    /// its `STDIN_ACK`).
    pub(crate) queue: VecDeque<(Vec<u8>, Arc<Link>)>,
    /// Bytes in `queue` by the connection they came from (each within its own window:
    /// one connection's data never counts against another's).
    queued: Vec<(Arc<Link>, usize)>,
    /// A kill in progress (one per exec, whatever the number of `KILL`s): the
    /// connections that get `KILLED` when it ends, each once.
    pub(crate) killing: Option<Vec<Arc<Link>>>,
    /// `STDIN_EOF` received.
    pub(crate) eof: bool,
    /// Stdin bytes taken so far (queued, or acknowledged and dropped).
    pub(crate) stdin_taken: u64,
    /// The retained output, its offsets and the attached connection's credit.
    pub(crate) out: Output,
    /// The connection attached: every frame of the exec goes there (`None`: output is
    /// retained, nothing is sent).
    pub(crate) link: Option<Arc<Link>>,
    /// `DISCARD` (or `KILL`) of a non-detached exec: its output is read and dropped.
    pub(crate) discarded: bool,
    /// `EXIT`'s kind and value, once the command's status is known and its output was
    /// drained.
    pub(crate) exit: Option<(u8, i32)>,
    /// `EXIT` went out to the attached connection.
    pub(crate) exit_sent: bool,
    /// `RELEASE` came: forgotten once over.
    pub(crate) released: bool,
    /// The record was forgotten (the exec stays only while its shepherd lives).
    pub(crate) gone: bool,
    /// Unattached, not detached: killed (running) or forgotten (over) at this time
    /// unless an `ATTACH` comes first.
    pub(crate) deadline: Option<Instant>,
    /// Its deadline passed: forgotten once over.
    pub(crate) expired: bool,
    /// The output thread waits for room in the record (to be woken when there is).
    pub(crate) starved: bool,
}

impl ExecState {
    /// A new exec's state: attached to `link` (the connection that spawned it).
    pub(crate) fn new(piped: bool, keep: u32, link: Option<Arc<Link>>) -> ExecState {
        ExecState {
            status: None,
            shepherd_status: None,
            started: false,
            root: None,
            done: false,
            piped,
            queue: VecDeque::new(),
            queued: Vec::new(),
            killing: None,
            eof: false,
            stdin_taken: 0,
            out: Output::new(keep),
            link,
            discarded: false,
            exit: None,
            exit_sent: false,
            released: false,
            gone: false,
            deadline: None,
            expired: false,
            starved: false,
        }
    }

    /// Counts `n` more stdin bytes queued from `from`; its bytes queued now.
    pub(crate) fn stdin_queued(&mut self, from: &Arc<Link>, n: usize) -> usize {
        match self.queued.iter_mut().find(|(l, _)| Arc::ptr_eq(l, from)) {
            Some((_, q)) => {
                *q += n;
                *q
            }
            None => {
                self.queued.push((from.clone(), n));
                n
            }
        }
    }

    /// Stdin bytes queued from every connection.
    pub(crate) fn stdin_total(&self) -> usize {
        self.queued.iter().map(|(_, q)| q).sum()
    }

    /// `n` stdin bytes from `from` were written (or dropped).
    pub(crate) fn stdin_written(&mut self, from: &Arc<Link>, n: usize) {
        if let Some(i) = self.queued.iter().position(|(l, _)| Arc::ptr_eq(l, from)) {
            let q = &mut self.queued[i].1;
            *q = q.saturating_sub(n);
            if *q == 0 {
                self.queued.swap_remove(i);
            }
        }
    }

    /// Stdin bytes queued from `from`.
    #[cfg(test)]
    pub(crate) fn queued_from(&self, from: &Arc<Link>) -> usize {
        self.queued
            .iter()
            .find(|(l, _)| Arc::ptr_eq(l, from))
            .map_or(0, |(_, q)| *q)
    }

    /// Whether `link` is the connection attached.
    pub(crate) fn attached_to(&self, link: &Arc<Link>) -> bool {
        self.link.as_ref().is_some_and(|l| Arc::ptr_eq(l, link))
    }

    /// Output bytes the output thread may read now.
    pub(crate) fn room(&self) -> usize {
        self.out.room(self.link.is_some() && !self.discarded)
    }
}

impl Exec {
    /// A new exec of `sp` (its shepherd `shepherd`), attached to `link`.
    #[allow(clippy::too_many_arguments)]
    fn new(
        id: u32,
        seq: u64,
        sp: &Spawn,
        shepherd: i32,
        ctl: UnixStream,
        wake: io::PipeWriter,
        tty: Option<File>,
        link: &Arc<Link>,
    ) -> Exec {
        let started_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        Exec {
            id,
            seq,
            shepherd,
            ctl: Mutex::new(ctl),
            st: Mutex::new(ExecState::new(sp.stdin_piped, sp.keep, Some(link.clone()))),
            cv: Condvar::new(),
            wake,
            tty,
            detach: sp.detach,
            grace: Duration::from_millis(sp.grace_ms.into()),
            argv: info_argv(&sp.argv),
            started_ms,
        }
    }

    /// Wakes the output thread's poll (never blocks: a full pipe holds a wake already).
    pub(crate) fn kick(&self) {
        let _ = (&self.wake).write(&[1]);
    }

    /// Wakes the output thread if it waits for room and there is some now.
    pub(crate) fn kick_if_starved(&self, st: &mut ExecState) {
        if st.starved && st.room() > 0 {
            st.starved = false;
            self.kick();
        }
    }

    /// The command's status is known: record it and wake the output thread.
    pub(crate) fn reaped(&self, status: i32) {
        lock(&self.st).status = Some(status);
        self.cv.notify_all();
        self.kick();
    }

    /// The command's wait status, once known.
    pub(crate) fn status(&self) -> Option<i32> {
        lock(&self.st).status
    }

    /// Orders the shepherd to kill the exec's processes (errors mean it is gone).
    pub(crate) fn order_kill(&self, immediate: bool) {
        let _ = lock(&self.ctl).write_all(&shepherd::kill_frame(immediate));
    }

    /// Waits until the shepherd was reaped, at most until `deadline`; true if it was.
    pub(crate) fn wait_shepherd(&self, deadline: Instant) -> bool {
        let mut st = lock(&self.st);
        while st.shepherd_status.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            st = self
                .cv
                .wait_timeout(st, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        true
    }

    /// The exec is over (its output thread ended, or its spawn was abandoned).
    pub(crate) fn is_done(&self) -> bool {
        lock(&self.st).done
    }

    /// Waits for `STARTED`; false if the exec was abandoned.
    pub(crate) fn wait_started(&self) -> bool {
        let mut st = lock(&self.st);
        while !st.started && !st.done {
            st = wait(&self.cv, st);
        }
        !st.done
    }
}

/// What `LIST` shows of a command: at most [`INFO_ARGS`] arguments of at most
/// [`INFO_ARG_BYTES`] each.
pub(crate) fn info_argv(argv: &[Vec<u8>]) -> Vec<Vec<u8>> {
    argv.iter()
        .take(INFO_ARGS)
        .map(|a| a[..a.len().min(INFO_ARG_BYTES)].to_vec())
        .collect()
}

#[cfg(test)]
impl Exec {
    /// An exec with no process behind it, for unit tests, attached to nothing. Its
    /// shepherd's pid is one no process can have (above any `pid_max`), so nothing is
    /// ever signalled. Also returns the shepherd's end of the control channel, a clone
    /// of the helper's end (what the output thread reads) and the read end of the wake
    /// pipe.
    pub(crate) fn for_tests(
        id: u32,
        piped: bool,
    ) -> (Exec, UnixStream, UnixStream, io::PipeReader) {
        Exec::for_tests_with(id, piped, false, 0)
    }

    /// [`Exec::for_tests`] of a detached exec, or one with a grace and a `keep`.
    pub(crate) fn for_tests_with(
        id: u32,
        piped: bool,
        detach: bool,
        keep: u32,
    ) -> (Exec, UnixStream, UnixStream, io::PipeReader) {
        let (mine, theirs) = UnixStream::pair().expect("a socket pair");
        let reader = mine.try_clone().expect("a clone");
        let (wake_r, wake_w) = io::pipe().expect("a pipe");
        sys::set_nonblocking(wake_w.as_raw_fd()).expect("a non-blocking pipe");
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1 << 40);
        let sp = Spawn {
            argv: vec![b"test".to_vec()],
            stdin_piped: piped,
            detach,
            keep,
            ..Spawn::default()
        };
        let mut ex = Exec::new(
            id,
            SEQ.fetch_add(1, Ordering::Relaxed),
            &sp,
            i32::MAX,
            mine,
            wake_w,
            None,
            &Arc::new(Link::new(None)),
        );
        ex.st.get_mut().unwrap().link = None;
        (ex, theirs, reader, wake_r)
    }

    /// `STARTED` was sent.
    pub(crate) fn started_for_tests(&self) {
        lock(&self.st).started = true;
        self.cv.notify_all();
    }

    /// Attaches `link` (as a spawn or an `ATTACH` would).
    pub(crate) fn attach_for_tests(&self, link: &Arc<Link>) {
        lock(&self.st).link = Some(link.clone());
    }
}

#[cfg(test)]
impl Helper {
    /// Registers `ex` as the exec of the shepherd `pid`.
    pub(crate) fn register_for_tests(&self, ex: &Arc<Exec>, pid: i32) {
        let mut r = lock(&self.reg);
        r.execs.insert(ex.id, ex.clone());
        r.shepherds.insert(pid, ex.id);
    }
}

impl Helper {
    /// An exec not removed yet (its record may be forgotten: see [`ExecState::gone`]).
    pub(crate) fn exec(&self, id: u32) -> Option<Arc<Exec>> {
        lock(&self.reg).execs.get(&id).cloned()
    }

    // ---- spawn -------------------------------------------------------------------------

    /// Spawns an exec (its shepherd, which starts the command) and its threads, attached
    /// to `link` (which gets `STARTED` or `SPAWN_ERROR`). The shepherd is the spare when
    /// one is ready (then a new spare is started once this exec started), else a new one.
    pub(crate) fn start_exec(
        &'static self,
        id: u32,
        sp: &Spawn,
        link: &Arc<Link>,
    ) -> Result<(), (SpawnError, String)> {
        let in_use = || (SpawnError::IdInUse, "id already in use".to_string());
        if self.exec(id).is_some() {
            return Err(in_use());
        }
        let plan = self.plan(sp)?;
        let res = |e: io::Error| (spawn_error_kind(&e, false), e.to_string());
        let owner = plan.switch.as_ref().map(|c| c.uid);
        let tty = sp
            .tty
            .map(|(rows, cols)| sys::open_pty(rows, cols, owner))
            .transpose()
            .map_err(|e| {
                (
                    spawn_error_kind(&e, false),
                    format!("cannot open a terminal: {e}"),
                )
            })?;
        let order = shepherd::plan_frame(
            &plan.program,
            &sp.argv,
            &plan.env,
            plan.cwd.as_deref(),
            plan.switch.as_ref(),
            sp.stdin_piped,
            tty.as_ref().map(|(_, path)| path.as_path()),
        );
        drop(plan);
        // A terminal exec's output and input both go through the terminal's master.
        let (master, output, input) = match tty {
            Some((master, _)) => {
                let output = master.try_clone().map_err(res)?;
                let input = master.try_clone().map_err(res)?;
                (Some(master), Some(output), Some(input))
            }
            None => (None, None, None),
        };
        let (wake_r, wake_w) = io::pipe().map_err(res)?;
        sys::set_nonblocking(wake_w.as_raw_fd()).map_err(res)?;
        let (ex, shepherd) = {
            // The registry stays locked from taking (or starting) the shepherd to the
            // exec's registration, so the reaper cannot reap it before.
            let mut r = lock(&self.reg);
            if self.stopping.load(Ordering::SeqCst) {
                return Err((SpawnError::Other, "the helper is exiting".into()));
            }
            if r.execs.contains_key(&id) {
                return Err(in_use());
            }
            if !r.make_room(MAX_RECORDS) {
                return Err((
                    SpawnError::Resources,
                    format!("the helper holds {MAX_RECORDS} exec records (release some)"),
                ));
            }
            let shepherd = match r.spare.take() {
                // Still registered as the spare: not reaped (a process of the run may
                // have killed it; its plan then fails to go out, as any dead shepherd's).
                Some(s) if r.shepherds.get(&s.pid) == Some(&SPARE) && !sys::has_exited(s.pid) => {
                    // One stopped from inside would hold this exec for the answer's
                    // bound: it is this helper's child, so its pid is its own.
                    sys::signal(s.pid, sys::SIGCONT);
                    s
                }
                _ => self.start_shepherd(&mut r).map_err(|e| {
                    (
                        spawn_error_kind(&e, false),
                        format!("cannot start the exec's shepherd: {e}"),
                    )
                })?,
            };
            let ctl = shepherd.ctl.try_clone().map_err(res)?;
            r.seq += 1;
            let ex = Arc::new(Exec::new(
                id,
                r.seq,
                sp,
                shepherd.pid,
                ctl,
                wake_w,
                master,
                link,
            ));
            r.execs.insert(id, ex.clone());
            r.shepherds.insert(shepherd.pid, id);
            (ex, shepherd)
        };
        let Shepherd {
            ctl: mine,
            stdin,
            stdout,
            stderr,
            ..
        } = shepherd;
        // A command without piped stdin reads /dev/null (the shepherd's plan says so):
        // the pipe's write end is closed here. A terminal exec's command gets none of
        // the shepherd's pipes.
        let (stdin, pipes) = match output {
            Some(output) => (input.filter(|_| sp.stdin_piped), [Some(output), None]),
            None => (
                sp.stdin_piped.then_some(stdin),
                [Some(stdout), Some(stderr)],
            ),
        };
        // The shepherd's answer is awaited on a thread of its own: a shepherd that a
        // process of its uid stopped must not hold the frame reader (every other exec)
        // for the answer's bound.
        let started = {
            let ex = ex.clone();
            let link = link.clone();
            start_thread("spawn", move || {
                let s = Spawned {
                    mine,
                    order,
                    stdin,
                    pipes,
                    wake_r,
                };
                self.finish_spawn(&ex, &link, s);
                self.refill_spare();
            })
        };
        if !started {
            // The caller answers with the error.
            self.abandon(&ex, link, None);
            return Err((SpawnError::Resources, "cannot start a thread".into()));
        }
        Ok(())
    }

    /// Starts a spare shepherd unless one is ready or the helper is exiting. A spare
    /// that cannot start is no error: the next exec starts its own.
    pub(crate) fn refill_spare(&self) {
        let mut r = lock(&self.reg);
        if r.spare.is_some() || self.stopping.load(Ordering::SeqCst) {
            return;
        }
        match self.start_shepherd(&mut r) {
            Ok(s) => r.spare = Some(s),
            Err(e) => diag(format_args!("cannot start a spare shepherd: {e}")),
        }
    }

    /// Starts a shepherd (it sets itself up and waits for its plan), registered as
    /// [`SPARE`]. Called with the registry locked, so that no other spawn runs while the
    /// shepherd's end of the channel is inheritable, and the reaper cannot reap it
    /// before it is registered.
    fn start_shepherd(&self, r: &mut Registry) -> io::Result<Shepherd> {
        let (mine, theirs) = UnixStream::pair()?;
        let mut cmd = Command::new("/proc/self/exe");
        cmd.arg0(shepherd::NAME)
            .arg(shepherd::MODE_ARG)
            .arg(theirs.as_raw_fd().to_string())
            .env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        sys::set_cloexec(theirs.as_raw_fd(), false)?;
        let spawned = cmd.spawn();
        drop(theirs);
        let mut child = spawned?;
        let pid = child.id() as i32;
        r.shepherds.insert(pid, SPARE);
        r.spawned += 1;
        self.reg_cv.notify_all();
        let pipe = |p: Option<OwnedFd>| {
            p.map(File::from)
                .ok_or_else(|| io::Error::other("a shepherd without its pipes"))
        };
        let stdin = pipe(child.stdin.take().map(OwnedFd::from));
        let stdout = pipe(child.stdout.take().map(OwnedFd::from));
        let stderr = pipe(child.stderr.take().map(OwnedFd::from));
        drop(child); // Never waited on: the reaper owns waiting.
        // Registered: should a pipe be missing, dropping `mine` ends the shepherd, and
        // the reaper reaps it as a spare.
        Ok(Shepherd {
            pid,
            ctl: mine,
            stdin: stdin?,
            stdout: stdout?,
            stderr: stderr?,
        })
    }

    /// The spawn failed: `SPAWN_ERROR` to `spawner` first (when `error` is given), then
    /// the exec is over (a kill waiting for the spawn answers after it), its shepherd
    /// killed and the exec removed. Another connection that attached to it meanwhile
    /// gets `GONE`.
    fn abandon(&self, ex: &Exec, spawner: &Arc<Link>, error: Option<(SpawnError, &str)>) {
        if let Some((kind, msg)) = error {
            spawner.send_spawn_error(ex.id, kind, msg);
        }
        {
            let mut r = lock(&self.reg);
            let mut st = lock(&ex.st);
            st.done = true;
            if let Some(other) = st.link.take()
                && !Arc::ptr_eq(spawner, &other)
            {
                other.send_empty(GONE, ex.id);
            }
            st.gone = true;
            if r.execs.get(&ex.id).is_some_and(|e| e.seq == ex.seq) {
                r.execs.remove(&ex.id);
            }
        }
        ex.cv.notify_all();
        ex.order_kill(true);
    }

    /// Starts the exec's stdin thread, sends the shepherd its order, waits (bounded) for
    /// its answer, sends `STARTED` and goes on as the exec's output thread; on a failure
    /// sends `SPAWN_ERROR` and abandons the exec (its shepherd killed).
    fn finish_spawn(&'static self, ex: &Arc<Exec>, link: &Arc<Link>, s: Spawned) {
        let Spawned {
            mine,
            order,
            stdin,
            pipes,
            wake_r,
        } = s;
        let h = self;
        // Its stdin thread first, before the command runs (it waits for the start): a
        // command that fills the pids limit at once must not leave its exec without one.
        if let Some(p) = stdin {
            let ex_in = ex.clone();
            if !start_thread("stdin", move || h.stdin_thread(&ex_in, p)) {
                return self.abandon(
                    ex,
                    link,
                    Some((SpawnError::Resources, "cannot start a thread")),
                );
            }
        }
        let mut reader = mine;
        let answer = reader
            .set_write_timeout(Some(SHEPHERD_ANSWER))
            .and_then(|()| reader.set_read_timeout(Some(SHEPHERD_ANSWER)))
            .and_then(|()| reader.write_all(&order))
            .and_then(|()| shepherd::read_frame(&mut reader));
        drop(order);
        let abandon = |kind: SpawnError, msg: String| self.abandon(ex, link, Some((kind, &msg)));
        let root = match answer {
            Ok(Some((shepherd::STARTED, p))) if p.len() == 4 => {
                u32::from_le_bytes([p[0], p[1], p[2], p[3]])
            }
            Ok(Some((shepherd::FAILED, p))) => {
                let mut d = Dec::new(&p);
                let kind = d.u8().map_or(SpawnError::Other, SpawnError::from_u8);
                let msg = String::from_utf8_lossy(d.bytes().unwrap_or_default()).into_owned();
                return abandon(kind, msg);
            }
            // Its shepherd died before it answered (a process of the command, of the
            // helper's uid, killed it) or never answered: what the command started
            // may be re-parented to this helper by now.
            // Those are killed before the error goes out: a spawn error means nothing
            // of it runs.
            Ok(_) => {
                self.after_lost_shepherd(ex.shepherd);
                return abandon(SpawnError::Other, "the exec's shepherd failed".into());
            }
            // It did not answer (a process of the command stopped it): it is killed, and
            // what it left with it, before the error goes out.
            Err(e) => {
                {
                    let r = lock(&self.reg);
                    // Still this helper's unreaped child: its pid is its own.
                    if r.shepherds.contains_key(&ex.shepherd) {
                        sys::signal(ex.shepherd, sys::SIGKILL);
                    }
                }
                self.after_lost_shepherd(ex.shepherd);
                let msg = format!("the exec's shepherd did not answer: {e}");
                return abandon(SpawnError::Other, msg);
            }
        };
        let _ = reader.set_read_timeout(None);
        let _ = lock(&ex.ctl).set_write_timeout(Some(Duration::from_secs(1)));
        let orphaned = {
            let mut st = lock(&ex.st);
            // Its connection ended before this (`Helper::unattach`): nothing to tell.
            if !st.expired {
                link.send_u32(STARTED, ex.id, root);
            }
            st.started = true;
            st.root = Some(root as i32);
            st.expired
        };
        ex.cv.notify_all();
        if orphaned {
            self.continue_shepherd(ex);
            ex.order_kill(true);
        }
        self.refill_spare();
        // This thread goes on as the exec's output thread: no new thread is needed once
        // the command runs (it may have filled the pids limit already).
        h.output_thread(ex, pipes, wake_r, reader);
    }

    /// Once the shepherd `pid` of an exec that is over was reaped (bounded), kills the
    /// strays it left ([`Helper::kill_strays`]).
    fn after_lost_shepherd(&self, pid: i32) {
        let deadline = Instant::now() + KILL_CONFIRM;
        while lock(&self.reg).shepherds.contains_key(&pid) && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(10));
        }
        self.kill_strays();
    }

    /// Kills the helper's strays: processes that descend from it through no live
    /// shepherd (nor through the daemon a relay started before it served its connection
    /// itself). They are what a shepherd killed from inside the run left (its orphans
    /// are re-parented to the helper, their subreaper, whatever session or group they
    /// made, and cannot leave its tree), and their exec is over: each is SIGKILLed as
    /// soon as a walk finds it, and walks go on until one finds none, for at most
    /// [`STRAY_PHASE`]. One that outruns the walks by forking and exiting over and over
    /// makes the reaper reap its old selves, and each reap sweeps again. The registry is
    /// locked during each walk, so no shepherd starts or is reaped meanwhile (a new one is
    /// never taken for a stray); a signal goes only to the process a walk saw (its start
    /// time checked). A helper that is no subreaper (a unit test's) has none.
    pub(crate) fn kill_strays(&self) {
        if !sys::is_child_subreaper() {
            return;
        }
        let kept = crate::daemon::started_daemon();
        let until = Instant::now() + STRAY_PHASE;
        loop {
            let found = {
                let r = lock(&self.reg);
                shepherd::strays(&procs::scan(), self.pid, &|pid, start| {
                    r.shepherds.contains_key(&pid) || kept == Some((pid, start))
                })
            };
            if found.is_empty() {
                return;
            }
            for (&pid, &start) in &found {
                shepherd::signal_checked(pid, start, sys::SIGKILL);
            }
            if Instant::now() >= until {
                diag(format_args!(
                    "{} stray processes outlived {STRAY_PHASE:?} of kills",
                    found.len()
                ));
                return;
            }
            thread::sleep(Duration::from_millis(2));
        }
    }

    // ---- reaping and tracking ----------------------------------------------------------

    /// Waits for every child: shepherds are marked gone on their exec, anything else (an
    /// orphan of a shepherd that was killed) is just reaped.
    /// Strays a reap told of are swept once every child that exited is reaped (a
    /// process that forks and exits over and over leaves thousands of zombies, each a
    /// reap, and each `/proc` entry a walk reads).
    pub(crate) fn reaper(&'static self) {
        let mut strays = false;
        loop {
            let generation = lock(&self.reg).spawned;
            let next = if strays {
                sys::exited_now()
            } else {
                sys::wait_exited().map(Some)
            };
            match next {
                Ok(Some(pid)) => strays |= self.reap(pid),
                Ok(None) => {
                    self.kill_strays();
                    strays = false;
                }
                Err(e) if e.raw_os_error() == Some(ECHILD) && strays => {
                    self.kill_strays();
                    strays = false;
                }
                Err(e) if e.raw_os_error() == Some(ECHILD) => {
                    let mut r = lock(&self.reg);
                    while r.spawned == generation {
                        r = wait(&self.reg_cv, r);
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    /// Reaps one exited child. A shepherd's own exit means none of its exec's processes
    /// is left: its exec is removed if its record was forgotten, and a kill waiting for
    /// it ends. True when strays may be left ([`Helper::kill_strays`]): the child was a
    /// shepherd a signal killed, or no shepherd at all (an orphan of a killed one, which
    /// may have left more, e.g. a process that keeps forking and exiting).
    pub(crate) fn reap(&self, pid: i32) -> bool {
        let mut r = lock(&self.reg);
        // Under the lock: a spawn in progress finishes (and registers its shepherd) first,
        // and a child std reaped itself (failed exec) is simply gone.
        let Ok(Some(status)) = sys::reap(pid) else {
            return false;
        };
        let Some(id) = r.shepherds.remove(&pid) else {
            return true;
        };
        let killed = status & 0x7f != 0 && status & 0x7f != 0x7f;
        // Not a later exec of the same id (this one's spawn failed and was removed).
        let Some(ex) = r.execs.get(&id).filter(|ex| ex.shepherd == pid).cloned() else {
            return killed;
        };
        let gone = {
            let mut st = lock(&ex.st);
            st.shepherd_status = Some(status);
            st.gone
        };
        ex.cv.notify_all();
        if gone {
            r.execs.remove(&id);
        }
        killed
    }

    // ---- kill --------------------------------------------------------------------------

    /// Sends SIGCONT to the exec's shepherd (one stopped from inside, `kill -STOP
    /// $PPID`, would never kill): it is this helper's child, so its pid is its own until
    /// reaped, which the registry's lock holds off.
    pub(crate) fn continue_shepherd(&self, ex: &Exec) {
        let _r = lock(&self.reg);
        if lock(&ex.st).shepherd_status.is_none() {
            sys::signal(ex.shepherd, sys::SIGCONT);
        }
    }

    /// A `KILL` of `ex` from `link`: true when no kill of it runs (the caller starts
    /// one: [`Helper::kill_exec`]); else `link` gets the `KILLED` of the one running
    /// (once, however many `KILL`s it sent).
    pub(crate) fn join_kill(&self, ex: &Exec, link: &Arc<Link>) -> bool {
        let mut st = lock(&ex.st);
        match &mut st.killing {
            Some(waiting) => {
                if !waiting.iter().any(|l| Arc::ptr_eq(l, link)) {
                    waiting.push(link.clone());
                }
                false
            }
            None => {
                st.killing = Some(vec![link.clone()]);
                true
            }
        }
    }

    /// Kills `ex` (for the connections [`Helper::join_kill`] recorded, which get
    /// `KILLED`): its shepherd kills its processes (stop, TERM + CONT, grace, KILL) and
    /// exits once none is left.
    pub(crate) fn kill_exec(&'static self, ex: &Exec) {
        // Its spawn ends first (bounded): the shepherd gets its order before any kill,
        // and `STARTED` or `SPAWN_ERROR` goes out before `KILLED`.
        ex.wait_started();
        self.continue_shepherd(ex);
        ex.order_kill(false);
        let all_gone = ex.wait_shepherd(Instant::now() + KILL_CONFIRM);
        if !all_gone {
            diag(format_args!(
                "exec {}: its processes are not all gone {KILL_CONFIRM:?} after the kill",
                ex.id
            ));
        }
        // Never a kill that did not happen: the host then kills by the exec marker, and
        // reports the exec KillFailed if that fails too.
        let mut f = Enc::frame(KILLED, ex.id);
        f.u8(u8::from(all_gone));
        let frame = f.finish();
        let waiting = lock(&ex.st).killing.take().unwrap_or_default();
        for link in waiting {
            link.send(frame.clone());
        }
    }

    /// Has the shepherds of `execs` kill their processes at once, and waits a little
    /// ([`SHUTDOWN_KILL`]) for them.
    pub(crate) fn kill_at_once(&self, execs: &[Arc<Exec>]) {
        for ex in execs {
            self.continue_shepherd(ex);
            ex.order_kill(true);
        }
        let deadline = Instant::now() + SHUTDOWN_KILL;
        for ex in execs {
            ex.wait_shepherd(deadline);
        }
    }

    /// The one-connection helper ends: every exec still running is killed at once
    /// (stdin ended, the stream or the protocol broke). Called with `stopping` set, so
    /// no exec starts any more.
    pub(crate) fn kill_live_execs(&self) {
        let live: Vec<Arc<Exec>> = {
            let mut r = lock(&self.reg);
            // Its channel closed, the spare exits.
            r.spare = None;
            r.execs
                .values()
                .filter(|ex| !ex.is_done())
                .cloned()
                .collect()
        };
        self.kill_at_once(&live);
    }
}

/// What the spawn thread takes over.
struct Spawned {
    /// The helper's end of the shepherd's channel (the output thread's, later).
    mine: UnixStream,
    /// The `PLAN` frame.
    order: Vec<u8>,
    /// The command's stdin pipe (piped stdin only).
    stdin: Option<File>,
    /// Its stdout and stderr (a terminal exec: the terminal only).
    pipes: [Option<File>; 2],
    /// The read end of the wake pipe.
    wake_r: io::PipeReader,
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::sync::mpsc::channel;

    use super::*;
    use crate::testing::{Frame, TempDir};

    /// The control frames the shepherd's end received so far.
    fn orders(theirs: &mut UnixStream) -> Vec<(u8, Vec<u8>)> {
        theirs.set_nonblocking(true).unwrap();
        let mut inbox = Vec::new();
        let mut buf = [0u8; 256];
        while let Ok(n) = theirs.read(&mut buf) {
            if n == 0 {
                break;
            }
            inbox.extend_from_slice(&buf[..n]);
        }
        shepherd::split_frames(&mut inbox)
    }

    /// Bytes waiting in the wake pipe.
    fn wakes(wake: &mut io::PipeReader) -> usize {
        sys::readable_bytes(wake.as_raw_fd())
    }

    #[test]
    fn an_exec_records_its_status_and_wakes_the_output_thread() {
        let (ex, _theirs, _reader, mut wake) = Exec::for_tests(1, false);
        assert_eq!(ex.status(), None);
        ex.reaped(0x0300);
        assert_eq!(ex.status(), Some(0x0300));
        let mut b = [0u8; 4];
        assert_eq!(wake.read(&mut b).unwrap(), 1);
    }

    #[test]
    fn a_starved_output_thread_is_woken_only_once_there_is_room() {
        let (ex, _theirs, _reader, mut wake) = Exec::for_tests(1, false);
        let link = Arc::new(Link::new(None));
        ex.attach_for_tests(&link);
        let mut st = lock(&ex.st);
        // Not waiting: no wake.
        ex.kick_if_starved(&mut st);
        assert_eq!(wakes(&mut wake), 0);
        st.starved = true;
        // Full of bytes the connection was not sent: no room, no wake.
        st.out.grant(0);
        let keep = st.room();
        let data = vec![b'x'; keep];
        st.out.append(crate::proto::STDOUT, &data, true);
        while st.out.next_frame(1).is_some() {}
        st.out.append(crate::proto::STDOUT, &data, true);
        assert_eq!(st.room(), 0);
        ex.kick_if_starved(&mut st);
        assert_eq!(wakes(&mut wake), 0);
        // Unattached: room, one wake.
        st.link = None;
        ex.kick_if_starved(&mut st);
        ex.kick_if_starved(&mut st);
        assert_eq!(wakes(&mut wake), 1);
        assert!(!st.starved);
        // A full wake pipe never blocks the kicker.
        drop(st);
        for _ in 0..100_000 {
            ex.kick();
        }
        assert!(wakes(&mut wake) > 0);
    }

    #[test]
    fn waiting_for_the_start_or_the_shepherd_ends() {
        let (ex, _theirs, _reader, _wake) = Exec::for_tests(1, false);
        let ex = Arc::new(ex);
        let started = Instant::now();
        assert!(!ex.wait_shepherd(started + Duration::from_millis(100)));
        assert!(started.elapsed() >= Duration::from_millis(100));

        let (tx, rx) = channel();
        let waiter = ex.clone();
        thread::spawn(move || tx.send(waiter.wait_started()).unwrap());
        assert!(rx.recv_timeout(Duration::from_millis(100)).is_err());
        ex.started_for_tests();
        assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap());

        let (tx, rx) = channel();
        let waiter = ex.clone();
        let deadline = Instant::now() + Duration::from_secs(30);
        thread::spawn(move || tx.send(waiter.wait_shepherd(deadline)).unwrap());
        lock(&ex.st).shepherd_status = Some(0);
        ex.cv.notify_all();
        assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap());

        // An abandoned exec never starts.
        let (ex, _theirs, _reader, _wake) = Exec::for_tests(2, false);
        lock(&ex.st).done = true;
        assert!(ex.is_done());
        assert!(!ex.wait_started());
    }

    /// A child that exits at once, never waited on by std (reaped as shepherds are).
    fn exited_child(script: &str) -> i32 {
        let child = Command::new("sh").args(["-c", script]).spawn().unwrap();
        let pid = child.id() as i32;
        drop(child);
        pid
    }

    #[test]
    fn a_reaped_shepherd_is_noted_and_a_forgotten_record_goes_with_it() {
        let dir = TempDir::new();
        let h = Helper::for_tests(false, dir.path());
        let (mut ex, _theirs, _reader, _wake) = Exec::for_tests(7, false);
        let pid = exited_child("exit 5");
        ex.shepherd = pid;
        let ex = Arc::new(ex);
        h.register_for_tests(&ex, pid);
        let deadline = Instant::now() + Duration::from_secs(10);
        while lock(&ex.st).shepherd_status.is_none() {
            assert!(Instant::now() < deadline, "the child was not reaped");
            h.reap(pid);
            thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(lock(&ex.st).shepherd_status, Some(5 << 8));
        // Its record is not forgotten: still known.
        assert!(h.exec(7).is_some());
        assert!(lock(&h.reg).shepherds.is_empty());
        {
            let mut r = lock(&h.reg);
            let mut st = lock(&ex.st);
            r.forget(&ex, &mut st);
            assert!(st.gone && st.link.is_none());
        }
        assert!(h.exec(7).is_none());
    }

    #[test]
    fn a_forgotten_record_stays_while_its_shepherd_lives() {
        let dir = TempDir::new();
        let h = Helper::for_tests(false, dir.path());
        let (mut ex, _theirs, _reader, _wake) = Exec::for_tests(8, false);
        let pid = exited_child("sleep 0.2");
        ex.shepherd = pid;
        let ex = Arc::new(ex);
        h.register_for_tests(&ex, pid);
        {
            let mut r = lock(&h.reg);
            let mut st = lock(&ex.st);
            r.forget(&ex, &mut st);
        }
        // A background process of it may live: a KILL still reaches it.
        assert!(h.exec(8).is_some());
        let deadline = Instant::now() + Duration::from_secs(10);
        while h.exec(8).is_some() {
            assert!(Instant::now() < deadline, "the exec was not removed");
            h.reap(pid);
            thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(lock(&ex.st).shepherd_status, Some(0));
    }

    #[test]
    fn a_shepherd_of_an_earlier_exec_of_the_same_id_is_not_taken_for_the_later_ones() {
        let dir = TempDir::new();
        let h = Helper::for_tests(false, dir.path());
        // The earlier exec's spawn failed: removed, its shepherd not reaped yet.
        let pid = exited_child("true");
        lock(&h.reg).shepherds.insert(pid, 9);
        let (later, _theirs, _reader, _wake) = Exec::for_tests(9, false);
        let later = Arc::new(later);
        lock(&h.reg).execs.insert(9, later.clone());
        let deadline = Instant::now() + Duration::from_secs(10);
        while lock(&h.reg).shepherds.contains_key(&pid) {
            assert!(Instant::now() < deadline, "the child was not reaped");
            h.reap(pid);
            thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(lock(&later.st).shepherd_status, None);
        assert!(h.exec(9).is_some());
    }

    #[test]
    fn at_the_record_bound_exited_detached_records_make_room_oldest_first() {
        let dir = TempDir::new();
        let h = Helper::for_tests(false, dir.path());
        let link = Arc::new(Link::new(None));
        let mut all = Vec::new();
        for (id, detach, done, attached) in [
            (1, true, true, false),  // Evicted first (oldest).
            (2, false, true, false), // Not detached: kept.
            (3, true, false, false), // Running: kept.
            (4, true, true, true),   // Attached, its EXIT not sent: kept.
            (5, true, true, false),  // Evicted second.
        ] {
            let (ex, theirs, reader, wake) = Exec::for_tests_with(id, false, detach, 0);
            {
                let mut st = lock(&ex.st);
                st.done = done;
                if attached {
                    st.link = Some(link.clone());
                }
                st.shepherd_status = Some(0);
            }
            let ex = Arc::new(ex);
            lock(&h.reg).execs.insert(id, ex.clone());
            all.push((ex, theirs, reader, wake));
        }
        let mut r = lock(&h.reg);
        assert!(r.make_room(6));
        assert_eq!(r.records(), 5);
        assert!(r.make_room(5));
        assert_eq!(r.records(), 4);
        assert!(!r.execs.contains_key(&1));
        assert!(r.make_room(4));
        assert!(!r.execs.contains_key(&5));
        // Nothing more may go.
        assert!(!r.make_room(3));
        let mut left: Vec<u32> = r.execs.keys().copied().collect();
        left.sort();
        assert_eq!(left, [2, 3, 4]);
    }

    #[test]
    fn what_list_shows_of_a_command_is_bounded() {
        let argv: Vec<Vec<u8>> = (0..40)
            .map(|i| vec![b'a' + (i % 26) as u8; i * 20])
            .collect();
        let shown = info_argv(&argv);
        assert_eq!(shown.len(), INFO_ARGS);
        for (i, a) in shown.iter().enumerate() {
            assert_eq!(a.len(), (i * 20).min(INFO_ARG_BYTES));
            assert!(argv[i].starts_with(a));
        }
        assert!(info_argv(&[]).is_empty());
    }

    #[test]
    fn a_kill_orders_the_shepherd_and_reports_whether_all_is_gone() {
        let dir = TempDir::new();
        let h = Helper::leaked(false, dir.path());
        let link = Arc::new(Link::new(None));

        // A shepherd that exits: a graceful kill order, then KILLED 1.
        let (ex, mut theirs, _reader, _wake) = Exec::for_tests(41, false);
        let ex = Arc::new(ex);
        ex.started_for_tests();
        h.register_for_tests(&ex, i32::MAX);
        lock(&ex.st).shepherd_status = Some(0);
        assert!(h.join_kill(&ex, &link));
        h.kill_exec(&ex);
        assert_eq!(orders(&mut theirs), [(shepherd::KILL_TREE, vec![0])]);
        assert_eq!(link.take_frames()[0].payload, [1]);
        assert!(lock(&ex.st).killing.is_none());

        // A shepherd that never exits: KILLED 0 once the confirmation's time is up.
        let (ex, mut theirs, _reader, _wake) = Exec::for_tests(42, false);
        let ex = Arc::new(ex);
        ex.started_for_tests();
        h.register_for_tests(&ex, i32::MAX - 1);
        let started = Instant::now();
        assert!(h.join_kill(&ex, &link));
        h.kill_exec(&ex);
        assert!(started.elapsed() >= KILL_CONFIRM);
        assert_eq!(orders(&mut theirs), [(shepherd::KILL_TREE, vec![0])]);
        let f: Vec<Frame> = link.take_frames();
        assert_eq!(
            (f[0].kind, f[0].id, &f[0].payload[..]),
            (KILLED, 42, &[0u8][..])
        );
    }

    #[test]
    fn kills_of_one_exec_while_one_runs_share_it_and_each_connection_hears_once() {
        let dir = TempDir::new();
        let h = Helper::leaked(false, dir.path());
        let (a, b) = (Arc::new(Link::new(None)), Arc::new(Link::new(None)));
        let (ex, mut theirs, _reader, _wake) = Exec::for_tests(43, false);
        let ex = Arc::new(ex);
        ex.started_for_tests();
        h.register_for_tests(&ex, i32::MAX);
        assert!(h.join_kill(&ex, &a));
        // A flood of KILLs while it runs starts nothing more.
        for _ in 0..10_000 {
            assert!(!h.join_kill(&ex, &a));
            assert!(!h.join_kill(&ex, &b));
        }
        assert_eq!(lock(&ex.st).killing.as_ref().map(Vec::len), Some(2));
        lock(&ex.st).shepherd_status = Some(0);
        h.kill_exec(&ex);
        assert_eq!(orders(&mut theirs), [(shepherd::KILL_TREE, vec![0])]);
        for l in [&a, &b] {
            let f = l.take_frames();
            assert_eq!(f.len(), 1);
            assert_eq!(
                (f[0].kind, f[0].id, &f[0].payload[..]),
                (KILLED, 43, &[1u8][..])
            );
        }
        // Over: the next KILL starts a kill again.
        assert!(h.join_kill(&ex, &b));
    }

    #[test]
    fn at_exit_only_execs_still_running_are_killed_at_once() {
        let dir = TempDir::new();
        let h = Helper::for_tests(false, dir.path());
        let (live, mut live_ctl, _r1, _w1) = Exec::for_tests(1, false);
        let (ended, mut ended_ctl, _r2, _w2) = Exec::for_tests(2, false);
        let (live, ended) = (Arc::new(live), Arc::new(ended));
        lock(&live.st).shepherd_status = Some(0);
        lock(&ended.st).done = true;
        h.register_for_tests(&live, i32::MAX);
        h.register_for_tests(&ended, i32::MAX - 1);
        let started = Instant::now();
        h.kill_live_execs();
        assert!(started.elapsed() < SHUTDOWN_KILL);
        assert_eq!(orders(&mut live_ctl), [(shepherd::KILL_TREE, vec![1])]);
        assert!(orders(&mut ended_ctl).is_empty());
    }

    #[test]
    fn an_abandoned_spawn_answers_its_spawner_and_tells_another_attached_connection() {
        let dir = TempDir::new();
        let h = Helper::for_tests(false, dir.path());
        let spawner = Arc::new(Link::new(None));
        let other = Arc::new(Link::new(None));
        let (ex, mut theirs, _reader, _wake) = Exec::for_tests(3, false);
        let ex = Arc::new(ex);
        h.register_for_tests(&ex, i32::MAX);
        ex.attach_for_tests(&other);
        h.abandon(
            &ex,
            &spawner,
            Some((SpawnError::NotFound, "no such program")),
        );
        let f = spawner.take_frames();
        assert_eq!(
            (f.len(), f[0].kind, f[0].id),
            (1, crate::proto::SPAWN_ERROR, 3)
        );
        let f = other.take_frames();
        assert_eq!((f.len(), f[0].kind, f[0].id), (1, GONE, 3));
        assert!(ex.is_done() && !ex.wait_started());
        assert!(h.exec(3).is_none());
        assert_eq!(orders(&mut theirs), [(shepherd::KILL_TREE, vec![1])]);
        // Attached to the spawner only: the error alone.
        let (ex, _theirs, _reader, _wake) = Exec::for_tests(4, false);
        let ex = Arc::new(ex);
        ex.attach_for_tests(&spawner);
        h.abandon(&ex, &spawner, None);
        assert!(spawner.take_frames().is_empty());
    }
}
