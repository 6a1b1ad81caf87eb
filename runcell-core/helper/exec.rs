//! Execs: the registry of live execs and their shepherds, a `SPAWN` resolved into a
//! plan and started under a shepherd of its own, the reaper of every child, and kills.
//! An exec's output and stdin threads are in `streams.rs`.

use std::collections::{HashMap, VecDeque};
use std::ffi::{OsStr, OsString};
use std::fs::{self, File};
use std::io::{self, ErrorKind, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use crate::flow::Flow;
use crate::proto::{Dec, Enc, KILL_GRACE_MS, KILLED, STARTED, Spawn, SpawnError};
use crate::sys::{self, EACCES, ECHILD, ENOENT, ENOTDIR, EPERM};
use crate::users::{Creds, can_search_as, find_program, resolve_user};
use crate::{Helper, diag, lock, shepherd, spawn_error_kind, start_thread, wait};

/// How long a shepherd may take to answer a plan (it starts the command and answers at
/// once; only a stopped one takes longer).
const SHEPHERD_ANSWER: Duration = Duration::from_secs(8);
/// How long a kill waits for the exec's shepherd to confirm that its processes are gone
/// (its graceful kill takes about `KILL_GRACE_MS`; the host waits 4 s for `KILLED`).
const KILL_CONFIRM: Duration = Duration::from_millis(KILL_GRACE_MS + 2500);
/// How long an exiting helper waits for the shepherds of live execs to kill them.
const SHUTDOWN_KILL: Duration = Duration::from_secs(3);

/// The execs the helper knows.
#[derive(Default)]
pub(crate) struct Registry {
    /// By id, until forgotten: once its `EXIT` was sent and its shepherd exited (no
    /// process of it is left), or at once when its spawn failed.
    execs: HashMap<u32, Arc<Exec>>,
    /// Shepherds not reaped yet: pid → exec id ([`SPARE`] for the spare).
    shepherds: HashMap<i32, u32>,
    /// Bumped on every spawn.
    spawned: u64,
    /// A shepherd started ahead, waiting for its plan: the next exec takes it, so that
    /// starting the shepherd is not on any exec's way.
    spare: Option<Shepherd>,
}

/// The exec id a spare shepherd is registered under (0 is the connection: never an exec).
const SPARE: u32 = 0;

/// A shepherd started, not yet given a plan: its pid, the helper's end of its control
/// channel, and the helper's ends of the pipes its command will get.
struct Shepherd {
    pid: i32,
    ctl: UnixStream,
    stdin: File,
    stdout: File,
    stderr: File,
}

/// A live exec.
pub(crate) struct Exec {
    pub(crate) id: u32,
    /// Its shepherd (the session leader of the exec's processes).
    pub(crate) shepherd: i32,
    /// The helper's end of the shepherd's control channel, for kill orders (the output
    /// thread reads a clone of it).
    ctl: Mutex<UnixStream>,
    /// Output credit.
    pub(crate) flow: Flow,
    pub(crate) st: Mutex<ExecState>,
    /// Signalled on any change of `st`.
    pub(crate) cv: Condvar,
    /// Written once the command's status is known, to wake the output thread's poll.
    wake: io::PipeWriter,
    /// A terminal exec's terminal (its master side), for `RESIZE`.
    pub(crate) tty: Option<File>,
}

/// The mutable part of an exec.
#[derive(Default)]
pub(crate) struct ExecState {
    /// Wait status of the command, once its shepherd reported it.
    pub(crate) status: Option<i32>,
    /// Wait status of the shepherd, once reaped: none of the exec's processes is left.
    pub(crate) shepherd_status: Option<i32>,
    /// `STARTED` was sent: the threads may send frames.
    started: bool,
    /// The command's pid, once started.
    pub(crate) root: Option<i32>,
    /// `EXIT` was sent (or the spawn was abandoned): no more frames.
    pub(crate) done: bool,
    /// Stdin is a pipe (else `/dev/null`).
    pub(crate) piped: bool,
    /// `STDIN` data not written yet, and its size.
    pub(crate) queue: VecDeque<Vec<u8>>,
    pub(crate) queued: usize,
    /// `STDIN_EOF` received.
    pub(crate) eof: bool,
}

impl Exec {
    /// The command's status is known: record it and wake the output thread.
    pub(crate) fn reaped(&self, status: i32) {
        lock(&self.st).status = Some(status);
        self.cv.notify_all();
        let _ = (&self.wake).write(&[1]);
    }

    /// The command's wait status, once known.
    pub(crate) fn status(&self) -> Option<i32> {
        lock(&self.st).status
    }

    /// Orders the shepherd to kill the exec's processes (errors mean it is gone).
    fn order_kill(&self, immediate: bool) {
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

    /// `EXIT` was sent (or the spawn abandoned).
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

#[cfg(test)]
impl Exec {
    /// An exec with no process behind it, for unit tests. Its shepherd's pid is one no
    /// process can have (above any `pid_max`), so nothing is ever signalled. Also returns
    /// the shepherd's end of the control channel, a clone of the helper's end (what the
    /// output thread reads) and the read end of the wake pipe.
    pub(crate) fn for_tests(
        id: u32,
        piped: bool,
    ) -> (Exec, UnixStream, UnixStream, io::PipeReader) {
        let (mine, theirs) = UnixStream::pair().expect("a socket pair");
        let reader = mine.try_clone().expect("a clone");
        let (wake_r, wake_w) = io::pipe().expect("a pipe");
        let ex = Exec {
            id,
            shepherd: i32::MAX,
            ctl: Mutex::new(mine),
            flow: Flow::new(),
            st: Mutex::new(ExecState {
                piped,
                ..ExecState::default()
            }),
            cv: Condvar::new(),
            wake: wake_w,
            tty: None,
        };
        (ex, theirs, reader, wake_r)
    }

    /// `STARTED` was sent.
    pub(crate) fn started_for_tests(&self) {
        lock(&self.st).started = true;
        self.cv.notify_all();
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
    /// An exec not forgotten yet.
    pub(crate) fn exec(&self, id: u32) -> Option<Arc<Exec>> {
        lock(&self.reg).execs.get(&id).cloned()
    }

    // ---- spawn -------------------------------------------------------------------------

    /// Spawns an exec (its shepherd, which starts the command) and its threads;
    /// `STARTED` is sent here. The shepherd is the spare when one is ready (then a new
    /// spare is started once this exec started), else a new one.
    pub(crate) fn start_exec(
        &'static self,
        id: u32,
        sp: &Spawn,
    ) -> Result<(), (SpawnError, String)> {
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
        let (ex, shepherd) = {
            // The registry stays locked from taking (or starting) the shepherd to the
            // exec's registration, so the reaper cannot reap it before.
            let mut r = lock(&self.reg);
            if self.stopping.load(Ordering::SeqCst) {
                return Err((SpawnError::Other, "the helper is exiting".into()));
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
            let ex = Arc::new(Exec {
                id,
                shepherd: shepherd.pid,
                ctl: Mutex::new(ctl),
                flow: Flow::new(),
                st: Mutex::new(ExecState {
                    piped: sp.stdin_piped,
                    ..ExecState::default()
                }),
                cv: Condvar::new(),
                wake: wake_w,
                tty: master,
            });
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
            start_thread("spawn", move || {
                self.finish_spawn(id, &ex, mine, order, stdin, pipes, wake_r);
                self.refill_spare();
            })
        };
        if !started {
            lock(&ex.st).done = true;
            ex.cv.notify_all();
            ex.order_kill(true);
            lock(&self.reg).execs.remove(&id);
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

    /// Sends the shepherd its order, waits (bounded) for its answer, starts the exec's
    /// threads and sends `STARTED`; on a failure sends `SPAWN_ERROR` and abandons the exec
    /// (its shepherd killed).
    #[allow(clippy::too_many_arguments)]
    fn finish_spawn(
        &'static self,
        id: u32,
        ex: &Arc<Exec>,
        mine: UnixStream,
        order: Vec<u8>,
        stdin: Option<File>,
        pipes: [Option<File>; 2],
        wake_r: io::PipeReader,
    ) {
        let mut reader = mine;
        let answer = reader
            .set_write_timeout(Some(SHEPHERD_ANSWER))
            .and_then(|()| reader.set_read_timeout(Some(SHEPHERD_ANSWER)))
            .and_then(|()| reader.write_all(&order))
            .and_then(|()| shepherd::read_frame(&mut reader));
        drop(order);
        // SPAWN_ERROR first, then the exec is over: a kill waiting for the spawn to end
        // answers after it.
        let abandon = |kind: SpawnError, msg: String| {
            self.send_spawn_error(id, kind, &msg);
            lock(&ex.st).done = true;
            ex.cv.notify_all();
            ex.order_kill(true);
            lock(&self.reg).execs.remove(&id);
        };
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
            Ok(_) => return abandon(SpawnError::Other, "the exec's shepherd failed".into()),
            Err(e) => {
                let msg = format!("the exec's shepherd did not answer: {e}");
                return abandon(SpawnError::Other, msg);
            }
        };
        let _ = reader.set_read_timeout(None);
        let _ = lock(&ex.ctl).set_write_timeout(Some(Duration::from_secs(1)));
        let h = self;
        let ex_out = ex.clone();
        let mut ok = start_thread("output", move || {
            h.output_thread(&ex_out, pipes, wake_r, reader)
        });
        if ok && let Some(p) = stdin {
            let ex_in = ex.clone();
            ok = start_thread("stdin", move || h.stdin_thread(&ex_in, p));
        }
        if !ok {
            return abandon(SpawnError::Resources, "cannot start a thread".into());
        }
        {
            let mut st = lock(&ex.st);
            self.send_u32(STARTED, id, root);
            st.started = true;
            st.root = Some(root as i32);
        }
        ex.cv.notify_all();
    }

    /// Resolves user, environment, working directory and program of a `SPAWN`.
    fn plan(&self, sp: &Spawn) -> Result<Plan, (SpawnError, String)> {
        let Some(prog) = sp.argv.first() else {
            return Err((SpawnError::Other, "empty argv".into()));
        };
        if prog.is_empty() {
            return Err((SpawnError::NotFound, "empty program name".into()));
        }
        let creds = match &sp.user {
            Some(u) => Some(resolve_user(u)?),
            None => None,
        };
        let switch = match &creds {
            Some(c) if self.root => Some(c.clone()),
            Some(c) if c.uid == self.uid && c.gid == self.gid => None,
            Some(c) => {
                return Err((
                    SpawnError::UserDenied,
                    format!(
                        "the helper runs as {}:{} and cannot switch to {}:{}",
                        self.uid, self.gid, c.uid, c.gid
                    ),
                ));
            }
            None => None,
        };

        let mut env = self.base_env.clone();
        let mut home_set = false;
        for (k, v) in &sp.env {
            home_set |= k.as_slice() == b"HOME";
            set_env(&mut env, k, v);
        }
        if let (Some(c), false) = (&creds, home_set) {
            set_env(&mut env, b"HOME", &c.home);
        }

        let dir = match &sp.working_dir {
            Some(d) => self.cwd.join(OsStr::from_bytes(d)),
            None => self.cwd.clone(),
        };
        let mut cwd = None;
        if sp.working_dir.is_some() || switch.is_some() {
            let shown = dir.display();
            let m = fs::metadata(&dir).map_err(|e| {
                let kind = match e.raw_os_error() {
                    Some(ENOENT | ENOTDIR) => SpawnError::WorkingDirMissing,
                    Some(EACCES | EPERM) => SpawnError::WorkingDirDenied,
                    _ => SpawnError::Other,
                };
                (kind, format!("working directory {shown}: {e}"))
            })?;
            if !m.is_dir() {
                return Err((
                    SpawnError::WorkingDirMissing,
                    format!("working directory {shown}: not a directory"),
                ));
            }
            let enterable = match &switch {
                Some(c) => can_search_as(&dir, c),
                None => sys::can_execute(&dir),
            };
            if !enterable {
                return Err((
                    SpawnError::WorkingDirDenied,
                    format!("working directory {shown}: permission denied"),
                ));
            }
            if self.cwd_id != Some((m.dev(), m.ino())) {
                cwd = Some(dir.clone());
            }
        }

        // The program is resolved here, so std takes its posix_spawn path (it falls back to
        // fork+exec for a bare name with a PATH of its own) and PATH is the exec's.
        let program = if prog.contains(&b'/') {
            dir.join(OsStr::from_bytes(prog))
        } else {
            let path = env
                .iter()
                .find(|(k, _)| k.as_bytes() == b"PATH")
                .map(|(_, v)| v.as_bytes());
            find_program(prog, path, &dir, switch.as_ref())?
        };
        Ok(Plan {
            program,
            env,
            cwd,
            switch,
        })
    }

    /// After `EXIT`: forget the exec unless its shepherd (so some process of it) lives.
    pub(crate) fn exec_finished(&self, id: u32) {
        let mut r = lock(&self.reg);
        if r.execs
            .get(&id)
            .is_some_and(|ex| lock(&ex.st).shepherd_status.is_some())
        {
            r.execs.remove(&id);
        }
    }

    // ---- reaping and tracking ----------------------------------------------------------

    /// Waits for every child: shepherds are marked gone on their exec, anything else (an
    /// orphan of a shepherd that was killed) is just reaped.
    pub(crate) fn reaper(&'static self) {
        loop {
            let generation = lock(&self.reg).spawned;
            match sys::wait_exited() {
                Ok(pid) => self.reap(pid),
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

    /// Reaps one exited child. A shepherd's exit means none of its exec's processes is
    /// left: its exec is forgotten if its `EXIT` went out, and a kill waiting for it ends.
    fn reap(&self, pid: i32) {
        let mut r = lock(&self.reg);
        // Under the lock: a spawn in progress finishes (and registers its shepherd) first,
        // and a child std reaped itself (failed exec) is simply gone.
        let Ok(Some(status)) = sys::reap(pid) else {
            return;
        };
        let Some(id) = r.shepherds.remove(&pid) else {
            return;
        };
        let Some(ex) = r.execs.get(&id).cloned() else {
            return;
        };
        let done = {
            let mut st = lock(&ex.st);
            st.shepherd_status = Some(status);
            st.done
        };
        ex.cv.notify_all();
        if done {
            r.execs.remove(&id);
        }
    }

    // ---- kill --------------------------------------------------------------------------

    /// `KILL`: the exec's shepherd kills its processes (stop, TERM + CONT, grace, KILL)
    /// and exits once none is left; then `KILLED`.
    pub(crate) fn kill_exec(&'static self, id: u32) {
        let mut all_gone = true;
        if let Some(ex) = self.exec(id) {
            // Its spawn ends first (bounded): the shepherd gets its order before any kill,
            // and `STARTED` or `SPAWN_ERROR` goes out before `KILLED`.
            ex.wait_started();
            // A shepherd stopped from inside (`kill -STOP $PPID`) would never kill: it is
            // this helper's child, so its pid is its own until reaped.
            sys::signal(ex.shepherd, sys::SIGCONT);
            ex.order_kill(false);
            if !ex.wait_shepherd(Instant::now() + KILL_CONFIRM) {
                diag(format_args!(
                    "exec {id}: its processes are not all gone {KILL_CONFIRM:?} after the kill"
                ));
                all_gone = false;
            }
        }
        // Never a kill that did not happen: the host then kills by the exec marker, and
        // reports the exec KillFailed if that fails too.
        let mut f = Enc::frame(KILLED, id);
        f.u8(u8::from(all_gone));
        self.send(f.finish());
    }

    /// Has the shepherd of every exec whose `EXIT` was not sent kill its processes at
    /// once (stdin ended, the stream or the protocol broke), and waits a little for them.
    /// Called with `stopping` set, so no exec starts any more.
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
        for ex in &live {
            ex.order_kill(true);
        }
        let deadline = Instant::now() + SHUTDOWN_KILL;
        for ex in &live {
            ex.wait_shepherd(deadline);
        }
    }
}

/// The resolved parts of a `SPAWN`.
struct Plan {
    program: PathBuf,
    env: Vec<(OsString, OsString)>,
    /// Set only when it differs from the helper's own (keeps std's posix_spawn path).
    cwd: Option<PathBuf>,
    /// The user to switch to in the child (the helper runs as root).
    switch: Option<Creds>,
}

/// Sets (or replaces) a variable.
fn set_env(env: &mut Vec<(OsString, OsString)>, k: &[u8], v: &[u8]) {
    let k = OsStr::from_bytes(k);
    let v = OsString::from_vec(v.to_vec());
    match env.iter_mut().find(|(n, _)| n == k) {
        Some(e) => e.1 = v,
        None => env.push((k.to_os_string(), v)),
    }
}

#[cfg(test)]
mod tests {
    use std::fs::Permissions;
    use std::io::Read;
    use std::os::unix::fs::PermissionsExt;
    use std::path::Path;
    use std::sync::mpsc::channel;

    use super::*;
    use crate::testing::{Frame, TempDir};

    fn spawn(argv: &[&str]) -> Spawn {
        Spawn {
            argv: argv.iter().map(|a| a.as_bytes().to_vec()).collect(),
            ..Spawn::default()
        }
    }

    fn var<'a>(env: &'a [(OsString, OsString)], k: &str) -> Option<&'a OsStr> {
        env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_os_str())
    }

    fn executable(path: &Path, mode: u32) {
        fs::write(path, "#!/bin/sh\n").unwrap();
        fs::set_permissions(path, Permissions::from_mode(mode)).unwrap();
    }

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

    #[test]
    fn set_env_replaces_a_variable_or_appends_it() {
        let mut env = vec![("A".into(), "1".into()), ("B".into(), "2".into())];
        set_env(&mut env, b"B", b"3");
        set_env(&mut env, b"C", b"4");
        set_env(&mut env, b"A", b"");
        let expected: Vec<(OsString, OsString)> = vec![
            ("A".into(), "".into()),
            ("B".into(), "3".into()),
            ("C".into(), "4".into()),
        ];
        assert_eq!(env, expected);
    }

    #[test]
    fn a_plan_needs_a_program() {
        let dir = TempDir::new();
        let h = Helper::for_tests(false, dir.path());
        let err = |sp: &Spawn| h.plan(sp).err().expect("an error");
        assert_eq!(err(&spawn(&[])), (SpawnError::Other, "empty argv".into()));
        assert_eq!(
            err(&spawn(&["", "x"])),
            (SpawnError::NotFound, "empty program name".into())
        );
        assert_eq!(
            err(&spawn(&["no-such-program-here"])).0,
            SpawnError::NotFound
        );
    }

    #[test]
    fn a_plan_resolves_the_program_with_the_execs_path_and_directory() {
        let dir = TempDir::new();
        fs::create_dir_all(dir.join("work/bin")).unwrap();
        executable(&dir.join("work/bin/tool"), 0o755);
        executable(&dir.join("work/local"), 0o755);
        let h = Helper::for_tests(false, dir.path());

        // A bare name on the PATH the exec sets (later settings win).
        let mut sp = spawn(&["tool"]);
        sp.env = vec![
            (b"PATH".to_vec(), b"/nowhere".to_vec()),
            (b"PATH".to_vec(), b"bin".to_vec()),
            (b"EXTRA".to_vec(), b"yes".to_vec()),
        ];
        sp.working_dir = Some(b"work".to_vec());
        let plan = h.plan(&sp).unwrap();
        assert_eq!(plan.program, dir.join("work/bin/tool"));
        assert_eq!(plan.cwd.as_deref(), Some(dir.join("work").as_path()));
        assert_eq!(var(&plan.env, "PATH"), Some(OsStr::new("bin")));
        assert_eq!(var(&plan.env, "EXTRA"), Some(OsStr::new("yes")));
        assert!(plan.switch.is_none());
        // The run's environment is kept.
        let (k, v) = h.base_env.first().expect("the test has an environment");
        assert_eq!(var(&plan.env, k.to_str().unwrap()), Some(v.as_os_str()));

        // A path with a slash is taken from the working directory, not looked up.
        let mut sp = spawn(&["./local"]);
        sp.working_dir = Some(b"work".to_vec());
        assert_eq!(h.plan(&sp).unwrap().program, dir.join("work/./local"));
        let sp = spawn(&["work/local"]);
        let plan = h.plan(&sp).unwrap();
        assert_eq!(plan.program, dir.join("work/local"));
        assert!(plan.cwd.is_none());
    }

    #[test]
    fn a_plan_names_the_working_directory_only_when_it_is_another() {
        let dir = TempDir::new();
        fs::create_dir(dir.join("sub")).unwrap();
        fs::write(dir.join("file"), "").unwrap();
        let h = Helper::for_tests(false, dir.path());
        let with_dir = |d: &Path| {
            let mut sp = spawn(&["/bin/sh"]);
            sp.working_dir = Some(d.as_os_str().as_bytes().to_vec());
            h.plan(&sp)
        };
        // The helper's own directory, by another name: std keeps its posix_spawn path.
        assert!(with_dir(dir.path()).unwrap().cwd.is_none());
        assert!(with_dir(&dir.join("sub/..")).unwrap().cwd.is_none());
        assert_eq!(
            with_dir(&dir.join("sub")).unwrap().cwd,
            Some(dir.join("sub"))
        );
        let (kind, msg) = with_dir(&dir.join("missing")).err().unwrap();
        assert_eq!(kind, SpawnError::WorkingDirMissing);
        assert!(msg.starts_with("working directory "), "{msg}");
        let (kind, msg) = with_dir(&dir.join("file")).err().unwrap();
        assert_eq!(kind, SpawnError::WorkingDirMissing);
        assert!(msg.ends_with("not a directory"), "{msg}");
        let (kind, _) = with_dir(&dir.join("file/below")).err().unwrap();
        assert_eq!(kind, SpawnError::WorkingDirMissing);
    }

    #[test]
    fn a_helper_not_running_as_root_runs_only_its_own_user() {
        let dir = TempDir::new();
        let h = Helper::for_tests(false, dir.path());
        let mut sp = spawn(&["/bin/sh"]);
        let other = format!("{}:{}", h.uid + 1, h.gid);
        sp.user = Some(other.into_bytes());
        let (kind, msg) = h.plan(&sp).err().unwrap();
        assert_eq!(kind, SpawnError::UserDenied);
        assert!(msg.contains("cannot switch to"), "{msg}");

        // Its own ids: no switch, and HOME is the user's unless the exec sets it.
        let own = format!("{}:{}", h.uid, h.gid);
        sp.user = Some(own.clone().into_bytes());
        let plan = h.plan(&sp).unwrap();
        assert!(plan.switch.is_none());
        let home = resolve_user(own.as_bytes()).unwrap().home;
        assert_eq!(
            var(&plan.env, "HOME").map(OsStrExt::as_bytes),
            Some(&home[..])
        );
        sp.env = vec![(b"HOME".to_vec(), b"/custom".to_vec())];
        let plan = h.plan(&sp).unwrap();
        assert_eq!(var(&plan.env, "HOME"), Some(OsStr::new("/custom")));
    }

    #[test]
    fn as_root_a_plan_checks_directory_and_program_as_the_user() {
        let dir = TempDir::new();
        fs::set_permissions(dir.path(), Permissions::from_mode(0o755)).unwrap();
        for (name, mode) in [("open", 0o755), ("closed", 0o700)] {
            fs::create_dir(dir.join(name)).unwrap();
            fs::set_permissions(dir.join(name), Permissions::from_mode(mode)).unwrap();
        }
        executable(&dir.join("open/mine"), 0o700);
        executable(&dir.join("open/ours"), 0o755);
        let h = Helper::for_tests(true, dir.path());
        let plan_of = |prog: &str, wd: &str| {
            let mut sp = spawn(&[prog]);
            // A uid in no passwd: gid 0, home "/".
            sp.user = Some(b"54321".to_vec());
            sp.working_dir = Some(wd.as_bytes().to_vec());
            sp.env = vec![(b"PATH".to_vec(), b".".to_vec())];
            h.plan(&sp)
        };
        let plan = plan_of("ours", "open").unwrap();
        assert_eq!(plan.program, dir.join("open/./ours"));
        let c = plan.switch.expect("a user switch");
        assert_eq!((c.uid, c.gid, c.groups), (54321, 0, vec![0]));
        assert_eq!(var(&plan.env, "HOME"), Some(OsStr::new("/")));
        assert_eq!(plan.cwd, Some(dir.join("open")));
        // The helper's own directory needs no change of directory.
        assert_eq!(plan_of("./open/ours", ".").unwrap().cwd, None);
        assert_eq!(
            plan_of("mine", "open").err().unwrap().0,
            SpawnError::NotExecutable
        );
        assert_eq!(
            plan_of("/bin/sh", "closed").err().unwrap().0,
            SpawnError::WorkingDirDenied
        );
        let mut sp = spawn(&["sh"]);
        sp.user = Some(b"54321".to_vec());
        assert!(h.plan(&sp).is_ok());
        // With a user, even the helper's own directory must be enterable by that user.
        let closed = Helper::for_tests(true, &dir.join("closed"));
        assert_eq!(
            closed.plan(&sp).err().unwrap().0,
            SpawnError::WorkingDirDenied
        );
        sp.user = None;
        assert!(closed.plan(&sp).is_ok());
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

    #[test]
    fn a_reaped_shepherd_ends_its_exec_and_a_finished_exec_is_forgotten() {
        let dir = TempDir::new();
        let h = Helper::for_tests(false, dir.path());
        let (ex, _theirs, _reader, _wake) = Exec::for_tests(7, false);
        let ex = Arc::new(ex);
        let child = Command::new("sh").args(["-c", "exit 5"]).spawn().unwrap();
        let pid = child.id() as i32;
        drop(child); // Reaped by the helper, as its shepherds are.
        h.register_for_tests(&ex, pid);
        assert!(h.exec(7).is_some());
        let deadline = Instant::now() + Duration::from_secs(10);
        while lock(&ex.st).shepherd_status.is_none() {
            assert!(Instant::now() < deadline, "the child was not reaped");
            h.reap(pid);
            thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(lock(&ex.st).shepherd_status, Some(5 << 8));
        // Its EXIT was not sent yet: still known, until it is.
        assert!(h.exec(7).is_some());
        assert!(lock(&h.reg).shepherds.is_empty());
        h.exec_finished(7);
        assert!(h.exec(7).is_none());
    }

    #[test]
    fn an_exec_whose_exit_went_out_is_forgotten_when_its_shepherd_is_reaped() {
        let dir = TempDir::new();
        let h = Helper::for_tests(false, dir.path());
        let (ex, _theirs, _reader, _wake) = Exec::for_tests(8, false);
        let ex = Arc::new(ex);
        // A shepherd still alive keeps a finished exec known.
        h.register_for_tests(&ex, i32::MAX);
        h.exec_finished(8);
        assert!(h.exec(8).is_some());
        lock(&h.reg).shepherds.clear();

        lock(&ex.st).done = true;
        let child = Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        drop(child);
        h.register_for_tests(&ex, pid);
        let deadline = Instant::now() + Duration::from_secs(10);
        while h.exec(8).is_some() {
            assert!(Instant::now() < deadline, "the exec was not forgotten");
            h.reap(pid);
            thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(lock(&ex.st).shepherd_status, Some(0));
    }

    #[test]
    fn a_kill_orders_the_shepherd_and_reports_whether_all_is_gone() {
        let dir = TempDir::new();
        let h = Helper::leaked(false, dir.path());
        // An unknown exec: nothing to kill, done at once.
        h.kill_exec(40);
        let f = h.take_frames();
        assert_eq!(
            (f[0].kind, f[0].id, &f[0].payload[..]),
            (KILLED, 40, &[1u8][..])
        );

        // A shepherd that exits: a graceful kill order, then KILLED 1.
        let (ex, mut theirs, _reader, _wake) = Exec::for_tests(41, false);
        let ex = Arc::new(ex);
        ex.started_for_tests();
        h.register_for_tests(&ex, i32::MAX);
        lock(&ex.st).shepherd_status = Some(0);
        h.kill_exec(41);
        assert_eq!(orders(&mut theirs), [(shepherd::KILL_TREE, vec![0])]);
        assert_eq!(h.take_frames()[0].payload, [1]);

        // A shepherd that never exits: KILLED 0 once the confirmation's time is up.
        let (ex, mut theirs, _reader, _wake) = Exec::for_tests(42, false);
        let ex = Arc::new(ex);
        ex.started_for_tests();
        h.register_for_tests(&ex, i32::MAX - 1);
        let started = Instant::now();
        h.kill_exec(42);
        assert!(started.elapsed() >= KILL_CONFIRM);
        assert_eq!(orders(&mut theirs), [(shepherd::KILL_TREE, vec![0])]);
        let f: Vec<Frame> = h.take_frames();
        assert_eq!(
            (f[0].kind, f[0].id, &f[0].payload[..]),
            (KILLED, 42, &[0u8][..])
        );
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
}
