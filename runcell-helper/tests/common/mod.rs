//! What the helper's integration tests share: an install of the helper per test (its own
//! daemon), relays to it with a synchronous client each, temporary directories, and
//! checks of processes in `/proc`.
//!
//! Each test file includes this module (`mod common;`) and uses a part of it.
#![allow(dead_code)]

#[allow(dead_code, clippy::type_complexity)]
#[path = "../../../runcell-core/helper/proto.rs"]
pub mod proto;

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::thread;
use std::time::{Duration, Instant};

pub use proto::*;

pub const BIN: &str = env!("CARGO_BIN_EXE_runcell-helper");

/// Bound for anything that should happen "soon" on a loaded machine.
pub const PATIENCE: Duration = Duration::from_secs(30);

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A unique marker / name part.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// A directory under /tmp removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new() -> TempDir {
        let p = PathBuf::from("/tmp").join(unique("runcell-helper-test"));
        fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

#[derive(Debug)]
pub struct Frame {
    pub kind: u8,
    pub id: u32,
    pub payload: Vec<u8>,
}

/// What an exec produced.
#[derive(Debug, Default)]
pub struct Output {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// (EXITED | SIGNALED, value).
    pub exit: (u8, i32),
}

impl Output {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
}

/// One install of the helper: the built helper linked (or copied) into a fresh
/// directory of its own, so that its daemon (the directory `d` beside the executable,
/// the socket in it) is this test's alone. Dropped with its last connection: its daemons
/// are killed (their shepherds then kill every exec) and the directory is removed.
pub struct Instance {
    /// The directory the executable is in.
    pub dir: PathBuf,
    /// The executable.
    pub exe: PathBuf,
    /// The directory is the instance's (removed on drop).
    owned: bool,
}

impl Instance {
    /// A fresh install under /tmp.
    pub fn new() -> Arc<Instance> {
        let dir = PathBuf::from("/tmp").join(unique("runcell-helper-test"));
        fs::create_dir_all(&dir).unwrap();
        let exe = dir.join("helper");
        // A link has no write descriptor that a fork elsewhere in the test process could
        // hold open (ETXTBSY); a copy (made by another process) where links fail.
        if fs::hard_link(BIN, &exe).is_err() {
            let copied = Command::new("cp").arg(BIN).arg(&exe).status().unwrap();
            assert!(copied.success());
        }
        Arc::new(Instance {
            dir,
            exe,
            owned: true,
        })
    }

    /// An executable the test placed itself (its directory is left alone on drop).
    pub fn at(exe: &Path) -> Arc<Instance> {
        Arc::new(Instance {
            dir: exe.parent().unwrap().to_path_buf(),
            exe: exe.to_path_buf(),
            owned: false,
        })
    }

    /// A command that starts a relay of this install.
    pub fn command(&self) -> Command {
        Command::new(&self.exe)
    }

    /// The daemon directory.
    pub fn daemon_dir(&self) -> PathBuf {
        self.dir.join(DAEMON_DIR)
    }

    /// The pids of this install's daemons (by their command line: the executable's
    /// path, then the daemon argument).
    pub fn daemons(&self) -> Vec<u32> {
        let mut head = self.exe.as_os_str().as_encoded_bytes().to_vec();
        head.push(0);
        head.extend_from_slice(DAEMON_ARG.as_bytes());
        head.push(0);
        fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| {
                fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c.starts_with(&head))
                    && proc_stat(*pid).is_some_and(|(state, _)| state != 'Z')
            })
            .collect()
    }

    /// Kills this install's daemons (SIGKILL) and waits until they are gone.
    pub fn kill_daemons(&self) {
        for pid in self.daemons() {
            let start = proc_stat(pid).map(|s| s.1);
            let _ = Command::new("kill")
                .args(["-9", &pid.to_string()])
                .stderr(Stdio::null())
                .status();
            if let Some(start) = start {
                assert_gone(pid, start);
            }
        }
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        self.kill_daemons();
        if self.owned {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

/// A running relay (a connection to its install's daemon, or a helper serving itself)
/// and a synchronous client for it.
pub struct Helper {
    pub child: Child,
    pub stdin: Option<ChildStdin>,
    pub rx: Receiver<Frame>,
    pub hello: Hello,
    /// The install: its daemon lives while a connection to it does.
    pub inst: Arc<Instance>,
}

impl Helper {
    /// A relay of a fresh install (which starts the install's daemon).
    pub fn start() -> Helper {
        Helper::start_with(|_| {})
    }

    /// [`Helper::start`], its command configured by `configure`.
    pub fn start_with(configure: impl FnOnce(&mut Command)) -> Helper {
        let inst = Instance::new();
        let mut cmd = inst.command();
        configure(&mut cmd);
        Helper::start_cmd(inst, cmd)
    }

    /// Another connection to the same install (a relay of its own).
    pub fn connect(&self) -> Helper {
        Helper::start_cmd(self.inst.clone(), self.inst.command())
    }

    /// Runs `cmd` (a relay of `inst`, possibly through a wrapper) with piped stdin and
    /// stdout, and reads its `HELLO`.
    pub fn start_cmd(inst: Arc<Instance>, mut cmd: Command) -> Helper {
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().expect("start the helper");
        let mut out = child.stdout.take().unwrap();
        let stdin = child.stdin.take();
        let (tx, rx) = channel();
        thread::spawn(move || {
            let mut buf = Vec::new();
            let mut chunk = vec![0u8; 128 * 1024];
            loop {
                let n = match out.read(&mut chunk) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                buf.extend_from_slice(&chunk[..n]);
                let mut start = 0;
                while let Some((kind, id, payload, len)) =
                    split_frame(&buf[start..]).expect("helper sent a bad frame")
                {
                    let f = Frame {
                        kind,
                        id,
                        payload: payload.to_vec(),
                    };
                    if tx.send(f).is_err() {
                        return;
                    }
                    start += len;
                }
                buf.drain(..start);
            }
        });
        let first = rx.recv_timeout(PATIENCE).expect("HELLO");
        assert_eq!(first.kind, HELLO);
        assert_eq!(first.id, 0);
        let hello = Hello::decode(&mut Dec::new(&first.payload)).unwrap();
        Helper {
            child,
            stdin,
            rx,
            hello,
            inst,
        }
    }

    pub fn send(&mut self, frame: Vec<u8>) {
        self.stdin
            .as_mut()
            .expect("stdin open")
            .write_all(&frame)
            .expect("write to the helper");
    }

    pub fn send_empty(&mut self, kind: u8, id: u32) {
        self.send(Enc::frame(kind, id).finish());
    }

    pub fn send_u32(&mut self, kind: u8, id: u32, v: u32) {
        let mut e = Enc::frame(kind, id);
        e.u32(v);
        self.send(e.finish());
    }

    pub fn send_data(&mut self, kind: u8, id: u32, data: &[u8]) {
        let mut e = Enc::frame(kind, id);
        e.raw(data);
        self.send(e.finish());
    }

    pub fn send_entry(&mut self, id: u32, entry: &Entry) {
        let mut e = Enc::frame(ENTRY, id);
        entry.encode(&mut e);
        self.send(e.finish());
    }

    pub fn send_path(&mut self, kind: u8, id: u32, path: &Path) {
        let mut e = Enc::frame(kind, id);
        e.bytes(path.as_os_str().as_encoded_bytes());
        self.send(e.finish());
    }

    pub fn recv(&mut self) -> Frame {
        match self.rx.recv_timeout(PATIENCE) {
            Ok(f) => f,
            Err(e) => panic!("no frame from the helper: {e:?}"),
        }
    }

    pub fn try_recv(&mut self, d: Duration) -> Option<Frame> {
        match self.rx.recv_timeout(d) {
            Ok(f) => Some(f),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => panic!("the helper closed its stdout"),
        }
    }

    /// SPAWN and the answer: the root's pid, or the typed error.
    pub fn spawn(&mut self, id: u32, sp: &Spawn) -> Result<u32, (SpawnError, String)> {
        let mut e = Enc::frame(SPAWN, id);
        sp.encode(&mut e);
        self.send(e.finish());
        let f = self.recv();
        assert_eq!(f.id, id, "{f:?}");
        let mut d = Dec::new(&f.payload);
        match f.kind {
            STARTED => Ok(d.u32().unwrap()),
            SPAWN_ERROR => {
                let kind = SpawnError::from_u8(d.u8().unwrap());
                let msg = String::from_utf8_lossy(d.bytes().unwrap()).into_owned();
                Err((kind, msg))
            }
            k => panic!("unexpected frame kind {k}"),
        }
    }

    /// Reads the exec's frames until EXIT, granting credit for all output read.
    pub fn wait_exit(&mut self, id: u32) -> Output {
        let mut out = Output::default();
        loop {
            let f = self.recv();
            assert_eq!(f.id, id, "frame of another id: {f:?}");
            match f.kind {
                STDOUT | STDERR => {
                    assert!(f.payload.len() <= CHUNK);
                    let n = f.payload.len() as u32;
                    if f.kind == STDOUT {
                        out.stdout.extend_from_slice(&f.payload);
                    } else {
                        out.stderr.extend_from_slice(&f.payload);
                    }
                    self.send_u32(CREDIT, id, n);
                }
                EXIT => {
                    let mut d = Dec::new(&f.payload);
                    out.exit = (d.u8().unwrap(), d.i32().unwrap());
                    return out;
                }
                STDIN_ACK | KILLED => {}
                k => panic!("unexpected frame kind {k}"),
            }
        }
    }

    pub fn run(&mut self, id: u32, sp: &Spawn) -> Output {
        self.spawn(id, sp).expect("spawn");
        self.wait_exit(id)
    }

    /// Reads STDOUT of `id` until it holds `lines` lines (granting credit).
    pub fn read_lines(&mut self, id: u32, lines: usize) -> Vec<String> {
        let mut text = Vec::new();
        while text.iter().filter(|&&b| b == b'\n').count() < lines {
            let f = self.recv();
            assert_eq!(f.id, id, "{f:?}");
            match f.kind {
                STDOUT => {
                    text.extend_from_slice(&f.payload);
                    self.send_u32(CREDIT, id, f.payload.len() as u32);
                }
                STDERR => {
                    self.send_u32(CREDIT, id, f.payload.len() as u32);
                }
                k => panic!("unexpected frame kind {k} before {lines} lines"),
            }
        }
        String::from_utf8(text)
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// `ATTACH` and its answer: `Some(ATTACHED)` or `None` (`GONE`).
    pub fn attach(&mut self, id: u32, from: u64) -> Option<Attached> {
        let mut e = Enc::frame(ATTACH, id);
        e.u64(from);
        self.send(e.finish());
        loop {
            let f = self.recv();
            if f.id != id {
                continue;
            }
            match f.kind {
                ATTACHED => return Some(Attached::decode(&mut Dec::new(&f.payload)).unwrap()),
                GONE => return None,
                // What an earlier attachment of this connection still had queued.
                STDOUT | STDERR | EXIT | STDIN_ACK | KILLED => {}
                k => panic!("unexpected frame kind {k} before ATTACHED"),
            }
        }
    }

    /// `LIST` (request id `id`) and its answer.
    pub fn list(&mut self, id: u32) -> Vec<ExecInfo> {
        self.send_empty(LIST, id);
        loop {
            let f = self.recv();
            if (f.kind, f.id) != (EXECS, id) {
                continue;
            }
            let mut d = Dec::new(&f.payload);
            let n = d.u32().unwrap();
            let list = (0..n).map(|_| ExecInfo::decode(&mut d).unwrap()).collect();
            assert!(d.rest().is_empty());
            return list;
        }
    }

    /// Closes the relay's stdin and waits for it to exit.
    pub fn close(&mut self) -> ExitStatus {
        drop(self.stdin.take());
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(Instant::now() < deadline, "the helper did not exit");
            thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A SPAWN of `argv` with a fresh RUNCELL_EXEC_ID.
pub fn spawn_of(argv: &[&str]) -> Spawn {
    Spawn {
        argv: argv.iter().map(|a| a.as_bytes().to_vec()).collect(),
        env: vec![(b"RUNCELL_EXEC_ID".to_vec(), unique("exec").into_bytes())],
        ..Spawn::default()
    }
}

pub fn sh(script: &str) -> Spawn {
    spawn_of(&["sh", "-c", script])
}

/// (ppid, state, start time) of a process, if it exists.
pub fn proc_stat(pid: u32) -> Option<(char, u64)> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    Some((f[0].chars().next()?, f[19].parse().ok()?))
}

/// Waits until `pid` (started at `start`) is gone or a zombie.
pub fn assert_gone(pid: u32, start: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match proc_stat(pid) {
            None => return,
            Some((state, s)) if state == 'Z' || s != start => return,
            Some(_) => {}
        }
        assert!(Instant::now() < deadline, "process {pid} is still alive");
        thread::sleep(Duration::from_millis(20));
    }
}

pub fn assert_alive(pid: u32) -> u64 {
    match proc_stat(pid) {
        Some((state, start)) if state != 'Z' => start,
        other => panic!("process {pid} is not alive: {other:?}"),
    }
}

/// Reads a FILE_ERROR: (kind, path).
pub fn file_error(f: &Frame) -> (FileError, String) {
    assert_eq!(f.kind, FILE_ERROR, "{f:?}");
    let mut d = Dec::new(&f.payload);
    let kind = FileError::from_u8(d.u8().unwrap());
    let path = String::from_utf8_lossy(d.bytes().unwrap()).into_owned();
    (kind, path)
}

pub fn fnv_of_file(path: &str) -> (u64, u64) {
    let data = fs::read(path).unwrap();
    let mut f = Fnv::default();
    f.update(&data);
    (data.len() as u64, f.0)
}

pub fn is_root() -> bool {
    fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
}

/// Deterministic pseudo-random bytes.
pub fn noise(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// The helper's threads (its `/proc/<pid>/task` entries).
pub fn threads(pid: u32) -> usize {
    fs::read_dir(format!("/proc/{pid}/task")).unwrap().count()
}

/// The helper's thread count once it answered a PING: all its permanent threads run.
pub fn idle_threads(h: &mut Helper) -> usize {
    h.send_empty(PING, 0xfff0);
    let f = h.recv();
    assert_eq!((f.kind, f.id), (PONG, 0xfff0));
    threads(h.hello.pid)
}

/// Waits until the helper is back to `idle` threads.
pub fn assert_threads_back_to(h: &Helper, idle: usize) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let n = threads(h.hello.pid);
        if n == idle {
            return;
        }
        assert!(Instant::now() < deadline, "{n} threads, {idle} when idle");
        thread::sleep(Duration::from_millis(20));
    }
}

/// Reads STDOUT of `id`, granting nothing, until the initial credit is used up; then
/// nothing more comes.
pub fn drain_initial_credit(h: &mut Helper, id: u32) {
    let mut got = 0usize;
    while got < INITIAL_CREDIT as usize {
        let f = h.recv();
        assert_eq!((f.kind, f.id), (STDOUT, id), "{f:?}");
        got += f.payload.len();
    }
    assert_eq!(got, INITIAL_CREDIT as usize);
    if let Some(f) = h.try_recv(Duration::from_millis(300)) {
        panic!("a frame beyond the credit: {f:?}");
    }
}

/// Fields of `/proc/<pid>/stat` the shepherd tests look at.
#[derive(Debug, Clone, Copy)]
pub struct Stat {
    pub ppid: u32,
    pub pgrp: u32,
    pub sid: u32,
}

pub fn stat_fields(pid: u32) -> Option<Stat> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    Some(Stat {
        ppid: f[1].parse().ok()?,
        pgrp: f[2].parse().ok()?,
        sid: f[3].parse().ok()?,
    })
}

/// Waits until `cond` holds.
pub fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !cond() {
        assert!(Instant::now() < deadline, "never: {what}");
        thread::sleep(Duration::from_millis(20));
    }
}

/// KILL of a running exec, then its KILLED and EXIT (frames of other ids are skipped):
/// the EXIT.
pub fn kill_and_wait(h: &mut Helper, id: u32) -> (u8, i32) {
    h.send_empty(KILL, id);
    let (mut killed, mut exit) = (false, None);
    while !killed || exit.is_none() {
        let f = h.recv();
        if f.id != id {
            continue;
        }
        match f.kind {
            KILLED => killed = true,
            EXIT => {
                let mut d = Dec::new(&f.payload);
                exit = Some((d.u8().unwrap(), d.i32().unwrap()));
            }
            _ => {}
        }
    }
    exit.unwrap()
}

/// Compiles `src` (C) into `dir/name`; `None` where no C compiler is.
pub fn cc(dir: &Path, name: &str, src: &str) -> Option<PathBuf> {
    let c = dir.join(format!("{name}.c"));
    let exe = dir.join(name);
    fs::write(&c, src).unwrap();
    let ok = Command::new("cc")
        .arg("-O")
        .arg("-o")
        .arg(&exe)
        .arg(&c)
        .status()
        .ok()?
        .success();
    ok.then_some(exe)
}

/// Live (not zombie) processes whose command line starts with `prefix` (NUL-separated).
pub fn live_pids_of(prefix: &[u8]) -> Vec<u32> {
    fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|d| {
            let pid: u32 = d.file_name().to_str()?.parse().ok()?;
            let cmdline = fs::read(d.path().join("cmdline")).ok()?;
            let (state, _) = proc_stat(pid)?;
            (cmdline.starts_with(prefix) && state != 'Z').then_some(pid)
        })
        .collect()
}
