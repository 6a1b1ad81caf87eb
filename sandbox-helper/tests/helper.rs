//! Integration tests of the exec helper: start the built binary on this host (as a child
//! with piped stdin/stdout, no container) and speak the protocol to it.
//!
//! Several tests need root (per-exec users, owners); the crate's tests run as root here.

#[allow(dead_code, clippy::type_complexity)]
#[path = "../../sandbox-core/helper/proto.rs"]
mod proto;

use std::collections::HashSet;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::thread;
use std::time::{Duration, Instant};

use proto::*;

const BIN: &str = env!("CARGO_BIN_EXE_runcell-helper");
/// Bound for anything that should happen "soon" on a loaded machine.
const PATIENCE: Duration = Duration::from_secs(30);

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A unique marker / name part.
fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// A directory under /tmp removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        let p = PathBuf::from("/tmp").join(unique("runcell-helper-test"));
        fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

#[derive(Debug)]
struct Frame {
    kind: u8,
    id: u32,
    payload: Vec<u8>,
}

/// What an exec produced.
#[derive(Debug, Default)]
struct Output {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    /// (EXITED | SIGNALED, value).
    exit: (u8, i32),
}

impl Output {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
}

/// A running helper and a synchronous client for it.
struct Helper {
    child: Child,
    stdin: Option<ChildStdin>,
    rx: Receiver<Frame>,
    hello: Hello,
}

impl Helper {
    fn start() -> Helper {
        Helper::start_with(|_| {})
    }

    fn start_with(configure: impl FnOnce(&mut Command)) -> Helper {
        let mut cmd = Command::new(BIN);
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        configure(&mut cmd);
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
        }
    }

    fn send(&mut self, frame: Vec<u8>) {
        self.stdin
            .as_mut()
            .expect("stdin open")
            .write_all(&frame)
            .expect("write to the helper");
    }

    fn send_empty(&mut self, kind: u8, id: u32) {
        self.send(Enc::frame(kind, id).finish());
    }

    fn send_u32(&mut self, kind: u8, id: u32, v: u32) {
        let mut e = Enc::frame(kind, id);
        e.u32(v);
        self.send(e.finish());
    }

    fn send_data(&mut self, kind: u8, id: u32, data: &[u8]) {
        let mut e = Enc::frame(kind, id);
        e.raw(data);
        self.send(e.finish());
    }

    fn send_entry(&mut self, id: u32, entry: &Entry) {
        let mut e = Enc::frame(ENTRY, id);
        entry.encode(&mut e);
        self.send(e.finish());
    }

    fn send_path(&mut self, kind: u8, id: u32, path: &Path) {
        let mut e = Enc::frame(kind, id);
        e.bytes(path.as_os_str().as_encoded_bytes());
        self.send(e.finish());
    }

    fn recv(&mut self) -> Frame {
        match self.rx.recv_timeout(PATIENCE) {
            Ok(f) => f,
            Err(e) => panic!("no frame from the helper: {e:?}"),
        }
    }

    fn try_recv(&mut self, d: Duration) -> Option<Frame> {
        match self.rx.recv_timeout(d) {
            Ok(f) => Some(f),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => panic!("the helper closed its stdout"),
        }
    }

    /// SPAWN and the answer: the root's pid, or the typed error.
    fn spawn(&mut self, id: u32, sp: &Spawn) -> Result<u32, (SpawnError, String)> {
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
    fn wait_exit(&mut self, id: u32) -> Output {
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

    fn run(&mut self, id: u32, sp: &Spawn) -> Output {
        self.spawn(id, sp).expect("spawn");
        self.wait_exit(id)
    }

    /// Reads STDOUT of `id` until it holds `lines` lines (granting credit).
    fn read_lines(&mut self, id: u32, lines: usize) -> Vec<String> {
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

    /// Closes the helper's stdin and waits for it to exit.
    fn close(&mut self) -> ExitStatus {
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

/// A SPAWN of `argv` with a fresh SANDBOX_EXEC_ID.
fn spawn_of(argv: &[&str]) -> Spawn {
    Spawn {
        argv: argv.iter().map(|a| a.as_bytes().to_vec()).collect(),
        env: vec![(b"SANDBOX_EXEC_ID".to_vec(), unique("exec").into_bytes())],
        ..Spawn::default()
    }
}

fn sh(script: &str) -> Spawn {
    spawn_of(&["sh", "-c", script])
}

/// (ppid, state, start time) of a process, if it exists.
fn proc_stat(pid: u32) -> Option<(char, u64)> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    Some((f[0].chars().next()?, f[19].parse().ok()?))
}

/// Waits until `pid` (started at `start`) is gone or a zombie.
fn assert_gone(pid: u32, start: u64) {
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

fn assert_alive(pid: u32) -> u64 {
    match proc_stat(pid) {
        Some((state, start)) if state != 'Z' => start,
        other => panic!("process {pid} is not alive: {other:?}"),
    }
}

/// Reads a FILE_ERROR: (kind, path).
fn file_error(f: &Frame) -> (FileError, String) {
    assert_eq!(f.kind, FILE_ERROR, "{f:?}");
    let mut d = Dec::new(&f.payload);
    let kind = FileError::from_u8(d.u8().unwrap());
    let path = String::from_utf8_lossy(d.bytes().unwrap()).into_owned();
    (kind, path)
}

fn fnv_of_file(path: &str) -> (u64, u64) {
    let data = fs::read(path).unwrap();
    let mut f = Fnv::default();
    f.update(&data);
    (data.len() as u64, f.0)
}

#[test]
fn hello_describes_the_helper() {
    let h = Helper::start();
    assert_eq!(h.hello.version, VERSION);
    assert_eq!(h.hello.pid, h.child.id());
    let status = fs::read_to_string("/proc/self/status").unwrap();
    let field = |name: &str| -> u32 {
        let line = status.lines().find(|l| l.starts_with(name)).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    assert_eq!(h.hello.uid, field("Uid:"));
    assert_eq!(h.hello.gid, field("Gid:"));
    let (size, digest) = fnv_of_file(BIN);
    assert_eq!(h.hello.size, size);
    assert_eq!(h.hello.digest, digest);
}

#[test]
fn ping_pong() {
    let mut h = Helper::start();
    h.send_empty(PING, 77);
    let f = h.recv();
    assert_eq!((f.kind, f.id), (PONG, 77));
}

#[test]
fn exit_codes_and_signals() {
    let mut h = Helper::start();
    assert_eq!(h.run(1, &spawn_of(&["true"])).exit, (EXITED, 0));
    assert_eq!(h.run(2, &sh("exit 3")).exit, (EXITED, 3));
    assert_eq!(h.run(3, &sh("kill -9 $$")).exit, (SIGNALED, 9));
    assert_eq!(h.run(4, &sh("exit 137")).exit, (EXITED, 137));
    let o = h.run(5, &sh("echo out; echo err >&2; exit 1"));
    assert_eq!(o.exit, (EXITED, 1));
    assert_eq!(o.stdout, b"out\n");
    assert_eq!(o.stderr, b"err\n");
    // Without a piped stdin the process reads /dev/null.
    let o = h.run(6, &spawn_of(&["cat"]));
    assert_eq!((o.exit, o.stdout.len()), ((EXITED, 0), 0));
}

#[test]
fn environment() {
    let mut h = Helper::start_with(|c| {
        c.env("FOO_BASE", "base")
            .env("FOO", "old")
            .env("SANDBOX_EXEC_ID", "inherited");
    });
    let mut sp = sh(r#"echo "$FOO|$FOO_BASE|$SANDBOX_EXEC_ID""#);
    let marker = String::from_utf8(sp.env[0].1.clone()).unwrap();
    sp.env.push((b"FOO".to_vec(), b"a".to_vec()));
    sp.env.push((b"FOO".to_vec(), b"b".to_vec()));
    let o = h.run(1, &sp);
    assert_eq!(o.text(), format!("b|base|{marker}\n"));

    // The helper's own SANDBOX_EXEC_ID is never passed on.
    let mut sp = sh(r#"echo "${SANDBOX_EXEC_ID-unset}""#);
    sp.env.clear();
    assert_eq!(h.run(2, &sp).text(), "unset\n");

    // The program is looked up on the exec's PATH.
    let dir = TempDir::new();
    let script = dir.path().join("hello-tool");
    fs::write(&script, "#!/bin/sh\necho from-path\n").unwrap();
    fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
    let mut sp = spawn_of(&["hello-tool"]);
    sp.env.push((
        b"PATH".to_vec(),
        format!("/nonexistent:{}:/usr/bin:/bin", dir.path().display()).into_bytes(),
    ));
    assert_eq!(h.run(3, &sp).text(), "from-path\n");
    let mut sp = spawn_of(&["true"]);
    sp.env.push((b"PATH".to_vec(), b"/nonexistent".to_vec()));
    assert_eq!(h.spawn(4, &sp).unwrap_err().0, SpawnError::NotFound);
}

#[test]
fn working_directory() {
    let default = TempDir::new();
    let other = TempDir::new();
    let d = default.path().to_path_buf();
    let mut h = Helper::start_with(|c| {
        c.current_dir(&d);
    });
    assert_eq!(
        h.run(1, &spawn_of(&["pwd"])).text(),
        format!("{}\n", d.display())
    );
    let mut sp = spawn_of(&["pwd"]);
    sp.working_dir = Some(other.path().as_os_str().as_encoded_bytes().to_vec());
    assert_eq!(
        h.run(2, &sp).text(),
        format!("{}\n", other.path().display())
    );
    // Relative to the helper's own directory.
    fs::create_dir(d.join("sub")).unwrap();
    let mut sp = spawn_of(&["pwd"]);
    sp.working_dir = Some(b"sub".to_vec());
    assert_eq!(h.run(3, &sp).text(), format!("{}/sub\n", d.display()));
}

#[test]
fn spawn_errors_are_typed() {
    let dir = TempDir::new();
    let mut h = Helper::start();
    let err = |h: &mut Helper, id, sp: &Spawn| h.spawn(id, sp).unwrap_err().0;

    assert_eq!(
        err(&mut h, 1, &spawn_of(&["no-such-program-runcell"])),
        SpawnError::NotFound
    );
    assert_eq!(
        err(&mut h, 2, &spawn_of(&["/nonexistent/program"])),
        SpawnError::NotFound
    );
    let plain = dir.path().join("plain");
    fs::write(&plain, "data").unwrap();
    fs::set_permissions(&plain, fs::Permissions::from_mode(0o644)).unwrap();
    assert_eq!(
        err(&mut h, 3, &spawn_of(&[plain.to_str().unwrap()])),
        SpawnError::NotExecutable
    );
    let mut sp = spawn_of(&["plain"]);
    sp.env.push((
        b"PATH".to_vec(),
        dir.path().as_os_str().as_encoded_bytes().to_vec(),
    ));
    assert_eq!(err(&mut h, 4, &sp), SpawnError::NotExecutable);

    let mut sp = spawn_of(&["true"]);
    sp.working_dir = Some(b"/nonexistent/dir".to_vec());
    assert_eq!(err(&mut h, 5, &sp), SpawnError::WorkingDirMissing);
    sp.working_dir = Some(plain.as_os_str().as_encoded_bytes().to_vec());
    assert_eq!(err(&mut h, 6, &sp), SpawnError::WorkingDirMissing);

    let mut sp = spawn_of(&["true"]);
    sp.user = Some(b"no-such-user-runcell".to_vec());
    assert_eq!(err(&mut h, 7, &sp), SpawnError::UnknownUser);
    sp.user = Some(b"root:no-such-group-runcell".to_vec());
    assert_eq!(err(&mut h, 8, &sp), SpawnError::UnknownUser);

    // Exists, but the user cannot enter it (switching users needs root).
    if !is_root() {
        return;
    }
    let closed = dir.path().join("closed");
    fs::create_dir(&closed).unwrap();
    fs::set_permissions(&closed, fs::Permissions::from_mode(0o700)).unwrap();
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let mut sp = spawn_of(&["true"]);
    sp.user = Some(b"65534".to_vec());
    sp.working_dir = Some(closed.as_os_str().as_encoded_bytes().to_vec());
    assert_eq!(err(&mut h, 9, &sp), SpawnError::WorkingDirDenied);

    // The helper still works after all that.
    assert_eq!(h.run(10, &spawn_of(&["true"])).exit, (EXITED, 0));
}

/// Lines of a colon file as fields.
fn db(path: &str) -> Vec<Vec<String>> {
    fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| l.split(':').map(str::to_string).collect())
        .collect()
}

/// What `id -G` should print for a user of /etc/passwd: primary gid + member groups.
fn expected_groups(name: &str) -> Vec<u32> {
    let passwd = db("/etc/passwd");
    let user = passwd.iter().find(|f| f[0] == name).unwrap();
    let mut groups: Vec<u32> = vec![user[3].parse().unwrap()];
    for g in db("/etc/group") {
        if g.len() >= 4 && g[3].split(',').any(|m| m == name) {
            groups.push(g[2].parse().unwrap());
        }
    }
    groups.sort_unstable();
    groups.dedup();
    groups
}

fn id_groups(out: &str) -> Vec<u32> {
    let mut g: Vec<u32> = out.split_whitespace().map(|x| x.parse().unwrap()).collect();
    g.sort_unstable();
    g.dedup();
    g
}

fn is_root() -> bool {
    fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
}

#[test]
fn per_exec_user() {
    if !is_root() {
        eprintln!("skipped: needs root");
        return;
    }
    let mut h = Helper::start();
    let script = r#"id -u; id -g; id -G; echo "$HOME""#;

    let mut sp = sh(script);
    sp.user = Some(b"nobody".to_vec());
    let o = h.run(1, &sp);
    assert_eq!(o.exit, (EXITED, 0), "{o:?}");
    let lines: Vec<&str> = std::str::from_utf8(&o.stdout).unwrap().lines().collect();
    assert_eq!(lines[0], "65534");
    assert_eq!(id_groups(lines[2]), expected_groups("nobody"));
    let home = db("/etc/passwd")
        .into_iter()
        .find(|f| f[0] == "nobody")
        .unwrap()[5]
        .clone();
    assert_eq!(lines[3], home);

    // uid:gid, and the exec's own HOME wins.
    let mut sp = sh(script);
    sp.user = Some(b"65534:65534".to_vec());
    sp.env.push((b"HOME".to_vec(), b"/custom".to_vec()));
    let o = h.run(2, &sp);
    let lines: Vec<&str> = std::str::from_utf8(&o.stdout).unwrap().lines().collect();
    assert_eq!(&lines[..2], &["65534", "65534"]);
    assert_eq!(lines[3], "/custom");

    // A uid not in /etc/passwd: gid 0, home "/".
    let mut sp = sh(script);
    sp.user = Some(b"54321".to_vec());
    let o = h.run(3, &sp);
    let lines: Vec<&str> = std::str::from_utf8(&o.stdout).unwrap().lines().collect();
    assert_eq!(&lines[..2], &["54321", "0"]);
    assert_eq!(id_groups(lines[2]), vec![0]);
    assert_eq!(lines[3], "/");

    // Supplementary groups of a user listed as a member in /etc/group, if there is one.
    let passwd = db("/etc/passwd");
    let member = db("/etc/group").into_iter().find_map(|g| {
        let m = g.get(3)?.split(',').find(|m| {
            !m.is_empty()
                && m.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })?;
        passwd.iter().any(|p| p[0] == m).then(|| m.to_string())
    });
    if let Some(name) = member {
        let mut sp = sh("id -G");
        sp.user = Some(name.clone().into_bytes());
        let o = h.run(4, &sp);
        assert_eq!(id_groups(&o.text()), expected_groups(&name), "user {name}");
        assert!(expected_groups(&name).len() > 1);
    }
}

/// Deterministic pseudo-random bytes.
fn noise(len: usize) -> Vec<u8> {
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

#[test]
fn stdin_round_trip_through_cat() {
    let mut h = Helper::start();
    let data = noise(5 * 1024 * 1024 + 123);
    let mut sp = spawn_of(&["cat"]);
    sp.stdin_piped = true;
    h.spawn(1, &sp).unwrap();
    let (mut sent, mut acked, mut out) = (0usize, 0usize, Vec::new());
    let mut eof_sent = false;
    loop {
        while sent < data.len() && sent - acked + CHUNK <= STDIN_WINDOW as usize {
            let n = CHUNK.min(data.len() - sent);
            h.send_data(STDIN, 1, &data[sent..sent + n]);
            sent += n;
        }
        if sent == data.len() && !eof_sent {
            h.send_empty(STDIN_EOF, 1);
            eof_sent = true;
        }
        let f = h.recv();
        assert_eq!(f.id, 1);
        match f.kind {
            STDIN_ACK => {
                acked += Dec::new(&f.payload).u32().unwrap() as usize;
                assert!(acked <= sent);
            }
            STDOUT => {
                out.extend_from_slice(&f.payload);
                h.send_u32(CREDIT, 1, f.payload.len() as u32);
            }
            EXIT => {
                assert_eq!(Dec::new(&f.payload).u8().unwrap(), EXITED);
                break;
            }
            k => panic!("unexpected frame kind {k}"),
        }
    }
    assert_eq!(acked, data.len());
    assert!(out == data, "cat's output differs from its input");
}

#[test]
fn stdin_closed_by_the_process_is_still_acked() {
    let mut h = Helper::start();
    let mut sp = sh("exec 0<&-; sleep 0.3; echo done");
    sp.stdin_piped = true;
    h.spawn(1, &sp).unwrap();
    let data = noise(STDIN_WINDOW as usize);
    for c in data.chunks(CHUNK) {
        h.send_data(STDIN, 1, c);
    }
    let mut acked = 0;
    let mut out = Vec::new();
    loop {
        let f = h.recv();
        match f.kind {
            STDIN_ACK => acked += Dec::new(&f.payload).u32().unwrap() as usize,
            STDOUT => out.extend_from_slice(&f.payload),
            EXIT => break,
            k => panic!("unexpected frame kind {k}"),
        }
    }
    assert_eq!(acked, data.len());
    assert_eq!(out, b"done\n");
}

#[test]
fn large_stdout_with_credit() {
    let mut h = Helper::start();
    let size = 8 * 1024 * 1024;
    let o = h.run(1, &sh(&format!("yes abcdefg | head -c {size}")));
    assert_eq!(o.exit, (EXITED, 0));
    assert_eq!(o.stdout.len(), size);
    assert!(o.stdout.chunks(8).all(|c| c == &b"abcdefg\n"[..c.len()]));
}

#[test]
fn no_credit_means_no_output() {
    let mut h = Helper::start();
    let total = 4 * INITIAL_CREDIT as usize;
    h.spawn(
        1,
        &spawn_of(&["head", "-c", &total.to_string(), "/dev/zero"]),
    )
    .unwrap();
    let mut got = 0usize;
    let until = Instant::now() + Duration::from_millis(1500);
    while let Some(f) = h.try_recv(until.saturating_duration_since(Instant::now())) {
        assert_eq!(f.kind, STDOUT, "only output before credit: {f:?}");
        got += f.payload.len();
        assert!(
            got <= INITIAL_CREDIT as usize,
            "more than the initial credit"
        );
    }
    assert!(got <= INITIAL_CREDIT as usize);
    h.send_u32(CREDIT, 1, total as u32);
    let o = h.wait_exit(1);
    assert_eq!(o.exit, (EXITED, 0));
    assert_eq!(got + o.stdout.len(), total);
}

#[test]
fn background_child_holding_stdout_does_not_delay_exit() {
    let mut h = Helper::start();
    let t = Instant::now();
    let o = h.run(1, &sh("sleep 30 & echo $!"));
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "EXIT took {:?}",
        t.elapsed()
    );
    assert_eq!(o.exit, (EXITED, 0));
    let pid: u32 = o.text().trim().parse().unwrap();
    let start = assert_alive(pid);
    // The exec is over, but its background process is still its own: KILL reaches it.
    h.send_empty(KILL, 1);
    let f = h.recv();
    assert_eq!((f.kind, f.id), (KILLED, 1));
    assert_gone(pid, start);
}

#[test]
fn kill_takes_the_whole_tree() {
    let mut h = Helper::start();
    let root = h.spawn(1, &sh("sleep 1000 & echo $!; wait")).unwrap();
    let pid: u32 = h.read_lines(1, 1)[0].parse().unwrap();
    let (root_start, start) = (assert_alive(root), assert_alive(pid));
    h.send_empty(KILL, 1);
    let (mut killed, mut exit) = (false, None);
    while !killed || exit.is_none() {
        let f = h.recv();
        assert_eq!(f.id, 1);
        match f.kind {
            KILLED => killed = true,
            EXIT => exit = Some(Dec::new(&f.payload).u8().unwrap()),
            STDOUT | STDERR => {}
            k => panic!("unexpected frame kind {k}"),
        }
    }
    assert_eq!(exit, Some(SIGNALED));
    assert_gone(root, root_start);
    assert_gone(pid, start);
    // KILL of an id that is over: KILLED at once.
    h.send_empty(KILL, 99);
    assert_eq!(h.recv().kind, KILLED);
}

/// A descendant that left the session, cleared its environment and lost its parent is
/// still killed: `wait_before_orphaning` lets the tracker see it with its parent first.
fn kill_escaped_descendant(wait_before_orphaning: bool) {
    let mut h = Helper::start();
    let pause = if wait_before_orphaning {
        "sleep 0.5"
    } else {
        "true"
    };
    let script = format!(
        r#"( setsid sh -c 'echo $$; exec env -i sleep 1000' & {pause} ); echo orphaned; sleep 1000"#
    );
    let root = h.spawn(1, &sh(&script)).unwrap();
    let shepherd = stat_fields(root).unwrap().ppid;
    // Both lines, in either order.
    let lines = h.read_lines(1, 2);
    assert!(lines.iter().any(|l| l == "orphaned"), "{lines:?}");
    let pid: u32 = lines.iter().find_map(|l| l.parse().ok()).unwrap();
    // Wait until it runs `sleep` with an empty environment, re-parented to the helper.
    let deadline = Instant::now() + PATIENCE;
    while fs::read(format!("/proc/{pid}/environ")).is_ok_and(|e| !e.is_empty())
        || fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() != "sleep")
    {
        assert!(Instant::now() < deadline);
        thread::sleep(Duration::from_millis(10));
    }
    let start = assert_alive(pid);
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let ppid: u32 = stat[stat.rfind(')').unwrap() + 2..]
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(ppid, shepherd, "re-parented to the exec's shepherd");
    assert_ne!(shepherd, h.hello.pid);
    h.send_empty(KILL, 1);
    let mut killed = false;
    let mut exited = false;
    while !killed || !exited {
        let f = h.recv();
        killed |= f.kind == KILLED;
        exited |= f.kind == EXIT;
    }
    assert_gone(pid, start);
}

#[test]
fn kill_reaches_a_tracked_escaped_descendant() {
    kill_escaped_descendant(true);
}

#[test]
fn kill_reaches_an_escaped_descendant_orphaned_at_once() {
    kill_escaped_descendant(false);
}

#[test]
fn end_of_stdin_kills_every_tree() {
    let mut h = Helper::start();
    let root = h.spawn(1, &sh("sleep 1000 & echo $!; sleep 1000")).unwrap();
    let pid: u32 = h.read_lines(1, 1)[0].parse().unwrap();
    let root2 = h.spawn(2, &spawn_of(&["sleep", "1000"])).unwrap();
    let starts = [assert_alive(root), assert_alive(pid), assert_alive(root2)];
    let status = h.close();
    assert!(status.success(), "{status:?}");
    assert_gone(root, starts[0]);
    assert_gone(pid, starts[1]);
    assert_gone(root2, starts[2]);
}

#[test]
fn malformed_frame_is_a_protocol_error() {
    let mut h = Helper::start();
    let root = h.spawn(1, &spawn_of(&["sleep", "1000"])).unwrap();
    let start = assert_alive(root);
    // A SPAWN whose payload ends early.
    let mut e = Enc::frame(SPAWN, 2);
    e.u32(5);
    h.send(e.finish());
    let f = h.recv();
    assert_eq!(f.kind, PROTOCOL_ERROR);
    let deadline = Instant::now() + PATIENCE;
    while h.child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "the helper did not exit");
        thread::sleep(Duration::from_millis(10));
    }
    assert_gone(root, start);
}

fn entry(path: &str, kind: u8, mode: u32, size: u64, link: &str) -> Entry {
    Entry {
        path: path.as_bytes().to_vec(),
        kind,
        mode,
        uid: 0,
        gid: 0,
        mtime: 1_700_000_000,
        size,
        link: link.as_bytes().to_vec(),
    }
}

/// Reads frames of a PUT until DONE or FILE_ERROR; returns the last frame and acked bytes.
fn put_result(h: &mut Helper, id: u32) -> (Frame, usize) {
    let mut acked = 0;
    loop {
        let f = h.recv();
        assert_eq!(f.id, id);
        match f.kind {
            STDIN_ACK => acked += Dec::new(&f.payload).u32().unwrap() as usize,
            DONE | FILE_ERROR => return (f, acked),
            k => panic!("unexpected frame kind {k}"),
        }
    }
}

#[test]
fn put_then_get_a_tree() {
    let dir = TempDir::new();
    let mut h = Helper::start();
    let data = noise(150_000);
    h.send_path(PUT, 1, dir.path());
    h.send_entry(1, &entry("d", DIRECTORY, 0o750, 0, ""));
    h.send_entry(1, &entry("d/f", REGULAR, 0o640, data.len() as u64, ""));
    for c in data.chunks(CHUNK) {
        h.send_data(STDIN, 1, c);
    }
    h.send_entry(1, &entry("d/l", SYMLINK, 0o777, 0, "f"));
    h.send_entry(1, &entry("d/e", REGULAR, 0o600, 0, ""));
    h.send_empty(STDIN_EOF, 1);
    let (f, acked) = put_result(&mut h, 1);
    assert_eq!(f.kind, DONE, "{f:?}");
    assert_eq!(acked, data.len());

    let d = dir.path().join("d");
    assert_eq!(fs::metadata(&d).unwrap().mode() & 0o7777, 0o750);
    assert_eq!(fs::read(d.join("f")).unwrap(), data);
    let fm = fs::metadata(d.join("f")).unwrap();
    assert_eq!(fm.mode() & 0o7777, 0o640);
    assert_eq!(fm.mtime(), 1_700_000_000);
    assert_eq!(fs::read_link(d.join("l")).unwrap(), Path::new("f"));
    assert_eq!(fs::read(d.join("e")).unwrap(), b"");
    // No temporary files left behind.
    let names: HashSet<String> = fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(
        names,
        ["e", "f", "l"].iter().map(|s| s.to_string()).collect()
    );

    h.send_path(GET, 2, &d);
    let mut entries = Vec::new();
    let mut contents: Vec<u8> = Vec::new();
    loop {
        let f = h.recv();
        assert_eq!(f.id, 2);
        match f.kind {
            ENTRY => entries.push(Entry::decode(&mut Dec::new(&f.payload)).unwrap()),
            STDOUT => {
                contents.extend_from_slice(&f.payload);
                h.send_u32(CREDIT, 2, f.payload.len() as u32);
            }
            DONE => break,
            k => panic!("unexpected frame kind {k}: {f:?}"),
        }
    }
    let summary: Vec<(String, u8, u32, u64, String)> = entries
        .iter()
        .map(|e| {
            (
                String::from_utf8(e.path.clone()).unwrap(),
                e.kind,
                if e.kind == SYMLINK { 0 } else { e.mode },
                e.size,
                String::from_utf8(e.link.clone()).unwrap(),
            )
        })
        .collect();
    let s = |x: &str| x.to_string();
    assert_eq!(
        summary,
        vec![
            (s("d"), DIRECTORY, 0o750, 0, s("")),
            (s("d/e"), REGULAR, 0o600, 0, s("")),
            (s("d/f"), REGULAR, 0o640, data.len() as u64, s("")),
            (s("d/l"), SYMLINK, 0, 0, s("f")),
        ]
    );
    assert_eq!(contents, data);

    // A second PUT replaces the file and the symlink.
    h.send_path(PUT, 3, dir.path());
    h.send_entry(3, &entry("d/f", REGULAR, 0o644, 3, ""));
    h.send_data(STDIN, 3, b"new");
    h.send_entry(3, &entry("d/l", REGULAR, 0o644, 0, ""));
    h.send_empty(STDIN_EOF, 3);
    assert_eq!(put_result(&mut h, 3).0.kind, DONE);
    assert_eq!(fs::read(d.join("f")).unwrap(), b"new");
    assert!(fs::symlink_metadata(d.join("l")).unwrap().is_file());
}

#[test]
fn put_never_replaces_a_directory() {
    let dir = TempDir::new();
    let x = dir.path().join("x");
    fs::create_dir(&x).unwrap();
    fs::write(x.join("keep"), "kept").unwrap();
    let mut h = Helper::start();
    h.send_path(PUT, 1, dir.path());
    h.send_entry(1, &entry("x", REGULAR, 0o644, 5, ""));
    h.send_data(STDIN, 1, b"hello");
    h.send_entry(1, &entry("y", REGULAR, 0o644, 0, ""));
    h.send_empty(STDIN_EOF, 1);
    let f = h.recv();
    assert_eq!(file_error(&f), (FileError::IsDir, "x".to_string()));
    // The rest is discarded, its data still acknowledged; nothing else follows.
    let f = h.recv();
    assert_eq!(
        (f.kind, Dec::new(&f.payload).u32().unwrap()),
        (STDIN_ACK, 5)
    );
    h.send_empty(PING, 2);
    assert_eq!(h.recv().kind, PONG);
    assert_eq!(fs::read_to_string(x.join("keep")).unwrap(), "kept");
    assert!(!dir.path().join("y").exists());
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);

    // A file where a directory goes.
    fs::write(dir.path().join("file"), "").unwrap();
    h.send_path(PUT, 3, dir.path());
    h.send_entry(3, &entry("file", DIRECTORY, 0o755, 0, ""));
    h.send_empty(STDIN_EOF, 3);
    assert_eq!(file_error(&h.recv()).0, FileError::NotDir);
}

#[test]
fn put_rejects_bad_paths_and_bases() {
    let dir = TempDir::new();
    let mut h = Helper::start();
    for (id, path) in [(1, "../escape"), (2, "/abs"), (3, "a//b"), (4, "")] {
        h.send_path(PUT, id, dir.path());
        h.send_entry(id, &entry(path, REGULAR, 0o644, 0, ""));
        h.send_empty(STDIN_EOF, id);
        assert_eq!(file_error(&h.recv()).0, FileError::Invalid, "{path}");
    }
    h.send_path(PUT, 5, &dir.path().join("missing"));
    h.send_empty(STDIN_EOF, 5);
    assert_eq!(file_error(&h.recv()), (FileError::NotFound, String::new()));
    fs::write(dir.path().join("file"), "").unwrap();
    h.send_path(PUT, 6, &dir.path().join("file"));
    h.send_empty(STDIN_EOF, 6);
    assert_eq!(file_error(&h.recv()), (FileError::NotDir, String::new()));
}

#[test]
fn get_of_a_missing_path() {
    let dir = TempDir::new();
    let mut h = Helper::start();
    h.send_path(GET, 1, &dir.path().join("missing"));
    assert_eq!(file_error(&h.recv()).0, FileError::NotFound);
    // Under a non-directory (ENOTDIR): not found either.
    fs::write(dir.path().join("file"), "").unwrap();
    h.send_path(GET, 2, &dir.path().join("file").join("x"));
    assert_eq!(file_error(&h.recv()).0, FileError::NotFound);
}

#[test]
fn a_pids_limit_gives_typed_resource_errors() {
    if !is_root() || !Path::new("/usr/bin/prlimit").exists() {
        eprintln!("skipped: needs root and prlimit");
        return;
    }
    // RLIMIT_NPROC counts the tasks of a uid (a uid of its own per helper). The helper has
    // 3 threads (main, writer, reaper); an exec takes its shepherd, its process and an
    // output thread.
    let start_limited = |uid: u32, nproc: u32| {
        Helper::start_with(|c| {
            use std::os::unix::process::CommandExt;
            let mut p = Command::new("/usr/bin/prlimit");
            p.arg(format!("--nproc={nproc}")).arg("--").arg(BIN);
            p.uid(uid).gid(uid).current_dir("/");
            std::mem::swap(c, &mut p);
            c.stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit());
        })
    };
    let uid = 54000 + (std::process::id() % 1000) * 2;

    // How many tasks the helper's own threads take varies a little with timing (kill
    // threads come and go), so the limit is not counted exactly: execs are
    // started until the kernel refuses one, which must be a typed error, never a crash.
    let mut h = start_limited(uid, 8);
    let mut roots = Vec::new();
    let mut refused = None;
    for id in 1..=8 {
        match h.spawn(id, &spawn_of(&["sleep", "1000"])) {
            Ok(root) => roots.push((id, root, assert_alive(root))),
            Err((kind, msg)) => {
                refused = Some((kind, msg));
                break;
            }
        }
    }
    let (kind, msg) = refused.expect("the pids limit never refused a spawn");
    assert_eq!(kind, SpawnError::Resources, "{msg}");
    assert!(!roots.is_empty(), "no exec fitted under the limit");
    let mut sp = spawn_of(&["cat"]);
    sp.stdin_piped = true;
    assert_eq!(h.spawn(20, &sp).unwrap_err().0, SpawnError::Resources);
    h.send_empty(PING, 21);
    assert_eq!(h.recv().kind, PONG);
    // KILL works without a thread to spare.
    for (id, root, start) in roots {
        h.send_empty(KILL, id);
        let (mut killed, mut exited) = (false, false);
        while !killed || !exited {
            let f = h.recv();
            killed |= f.kind == KILLED && f.id == id;
            exited |= f.kind == EXIT && f.id == id;
        }
        assert_gone(root, start);
    }
    // Room again.
    assert_eq!(h.run(30, &spawn_of(&["true"])).exit, (EXITED, 0));
}

#[test]
fn helper_not_running_as_root() {
    if !is_root() {
        eprintln!("skipped: needs root to start the helper as another user");
        return;
    }
    let dir = TempDir::new();
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let secret = dir.path().join("secret");
    fs::write(&secret, "s3cret").unwrap();
    fs::set_permissions(&secret, fs::Permissions::from_mode(0o600)).unwrap();
    let d = dir.path().to_path_buf();
    let mut h = Helper::start_with(|c| {
        use std::os::unix::process::CommandExt;
        c.uid(65534).gid(65534).current_dir(&d);
    });
    assert_eq!((h.hello.uid, h.hello.gid), (65534, 65534));
    // It reads its own executable although it is not dumpable.
    assert_eq!((h.hello.size, h.hello.digest), fnv_of_file(BIN));
    // Not dumpable: its /proc files belong to root, so processes of its own uid cannot
    // read its descriptors or ptrace it.
    // (`/proc/<pid>` itself, world-readable, keeps showing its effective uid.)
    for f in ["fd", "environ", "mem"] {
        let m = fs::metadata(format!("/proc/{}/{f}", h.hello.pid)).unwrap();
        assert_eq!((m.uid(), m.gid()), (0, 0), "/proc/<helper>/{f}");
    }

    // Reading /proc (of its children) still works: a KILL takes the whole tree.
    let root = h.spawn(10, &sh("sleep 1000 & echo $!; wait")).unwrap();
    let pid: u32 = h.read_lines(10, 1)[0].parse().unwrap();
    let (root_start, start) = (assert_alive(root), assert_alive(pid));
    h.send_empty(KILL, 10);
    let (mut killed, mut exited) = (false, false);
    while !killed || !exited {
        let f = h.recv();
        assert_eq!(f.id, 10, "{f:?}");
        killed |= f.kind == KILLED;
        exited |= f.kind == EXIT;
    }
    assert_gone(root, root_start);
    assert_gone(pid, start);

    // Switching user needs root; its own user is fine.
    let mut sp = spawn_of(&["id", "-u"]);
    sp.user = Some(b"root".to_vec());
    assert_eq!(h.spawn(1, &sp).unwrap_err().0, SpawnError::UserDenied);
    sp.user = Some(b"65534:65534".to_vec());
    assert_eq!(h.run(2, &sp).text(), "65534\n");

    // An unreadable file: Denied, with its path.
    h.send_path(GET, 3, &secret);
    assert_eq!(
        file_error(&h.recv()),
        (FileError::Denied, "secret".to_string())
    );
    let name = dir
        .path()
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    h.send_path(GET, 4, dir.path());
    let mut last;
    loop {
        last = h.recv();
        if last.kind != ENTRY {
            break;
        }
    }
    assert_eq!(
        file_error(&last),
        (FileError::Denied, format!("{name}/secret"))
    );

    // A directory it may not enter, as a working directory.
    let closed = dir.path().join("closed");
    fs::create_dir(&closed).unwrap();
    fs::set_permissions(&closed, fs::Permissions::from_mode(0o700)).unwrap();
    let mut sp = spawn_of(&["true"]);
    sp.working_dir = Some(closed.as_os_str().as_encoded_bytes().to_vec());
    assert_eq!(h.spawn(5, &sp).unwrap_err().0, SpawnError::WorkingDirDenied);
}

/// The helper's threads (its `/proc/<pid>/task` entries).
fn threads(pid: u32) -> usize {
    fs::read_dir(format!("/proc/{pid}/task")).unwrap().count()
}

/// The helper's thread count once it answered a PING: all its permanent threads run.
fn idle_threads(h: &mut Helper) -> usize {
    h.send_empty(PING, 0xfff0);
    let f = h.recv();
    assert_eq!((f.kind, f.id), (PONG, 0xfff0));
    threads(h.hello.pid)
}

/// Waits until the helper is back to `idle` threads.
fn assert_threads_back_to(h: &Helper, idle: usize) {
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
fn drain_initial_credit(h: &mut Helper, id: u32) {
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

#[test]
fn discard_of_a_running_exec_drains_it_and_still_exits() {
    let mut h = Helper::start();
    let idle = idle_threads(&mut h);
    h.spawn(1, &sh("yes | head -c 64000000")).unwrap();
    // The host stops reading: no credit, then DISCARD.
    drain_initial_credit(&mut h, 1);
    h.send_empty(DISCARD, 1);
    // The output is drained and dropped, so `head` ends and EXIT arrives (nothing else).
    let f = h.recv();
    assert_eq!((f.kind, f.id), (EXIT, 1), "{f:?}");
    let mut d = Dec::new(&f.payload);
    assert_eq!((d.u8().unwrap(), d.i32().unwrap()), (EXITED, 0));
    // Its output thread is gone.
    assert_threads_back_to(&h, idle);
    // A DISCARD of an unknown id is ignored; credit for a discarded id too.
    h.send_empty(DISCARD, 77);
    h.send_u32(CREDIT, 1, 1 << 20);
    h.send_empty(PING, 2);
    let f = h.recv();
    assert_eq!((f.kind, f.id), (PONG, 2), "{f:?}");
    assert_eq!(h.run(3, &sh("echo ok")).text(), "ok\n");
}

#[test]
fn kill_without_credit_ends_the_exec() {
    let mut h = Helper::start();
    let idle = idle_threads(&mut h);
    let root = h.spawn(1, &spawn_of(&["yes"])).unwrap();
    let start = assert_alive(root);
    drain_initial_credit(&mut h, 1);
    // Timed out: KILL, still without granting anything.
    h.send_empty(KILL, 1);
    let (mut killed, mut exit) = (false, None);
    while !killed || exit.is_none() {
        let f = h.recv();
        assert_eq!(f.id, 1, "{f:?}");
        match f.kind {
            KILLED => killed = true,
            EXIT => exit = Some(Dec::new(&f.payload).u8().unwrap()),
            k => panic!("unexpected frame kind {k} (no credit was granted)"),
        }
    }
    assert_eq!(exit, Some(SIGNALED));
    assert_gone(root, start);
    assert_threads_back_to(&h, idle);
}

#[test]
fn discard_abandons_a_get() {
    let dir = TempDir::new();
    let path = dir.path().join("big");
    fs::write(&path, noise(8 * INITIAL_CREDIT as usize)).unwrap();
    let mut h = Helper::start();
    let idle = idle_threads(&mut h);
    h.send_path(GET, 1, &path);
    // ENTRY and STDOUT up to the initial credit.
    let mut got = 0usize;
    while got < INITIAL_CREDIT as usize {
        let f = h.recv();
        assert_eq!(f.id, 1, "{f:?}");
        assert!(matches!(f.kind, ENTRY | STDOUT), "{f:?}");
        got += f.payload.len();
    }
    assert_eq!(got, INITIAL_CREDIT as usize);
    h.send_empty(DISCARD, 1);
    h.send_u32(CREDIT, 1, 1 << 20);
    h.send_empty(PING, 2);
    let f = h.recv();
    assert_eq!(
        (f.kind, f.id),
        (PONG, 2),
        "no frame of a discarded GET: {f:?}"
    );
    if let Some(f) = h.try_recv(Duration::from_millis(300)) {
        panic!("a frame after DISCARD: {f:?}");
    }
    // Its thread is gone and the file is closed.
    assert_threads_back_to(&h, idle);
    let open = fs::read_dir(format!("/proc/{}/fd", h.hello.pid))
        .unwrap()
        .filter_map(|e| fs::read_link(e.unwrap().path()).ok())
        .any(|target| target == path);
    assert!(!open, "the helper still has the file open");
    h.send_empty(PING, 3);
    assert_eq!(h.recv().kind, PONG);
}

#[test]
fn get_entries_count_against_the_credit() {
    let dir = TempDir::new();
    let tree = dir.path().join("many");
    fs::create_dir(&tree).unwrap();
    let count = 6000;
    for i in 0..count {
        fs::write(tree.join(format!("{i:06}-{}", "n".repeat(200))), "").unwrap();
    }
    let mut h = Helper::start();
    h.send_path(GET, 1, &tree);
    // Entries up to the initial credit (the next one, a few hundred bytes, does not fit),
    // then nothing.
    let mut got = 0usize;
    let mut entries = 0;
    loop {
        let f = if got <= INITIAL_CREDIT as usize - 1024 {
            h.recv()
        } else {
            match h.try_recv(Duration::from_millis(500)) {
                Some(f) => f,
                None => break,
            }
        };
        assert_eq!((f.kind, f.id), (ENTRY, 1), "{f:?}");
        got += f.payload.len();
        entries += 1;
        assert!(got <= INITIAL_CREDIT as usize, "{got} bytes without credit");
    }
    assert!(entries < count, "all entries without credit");
    // With credit, the rest.
    h.send_u32(CREDIT, 1, got as u32);
    loop {
        let f = h.recv();
        assert_eq!(f.id, 1, "{f:?}");
        match f.kind {
            ENTRY => {
                entries += 1;
                h.send_u32(CREDIT, 1, f.payload.len() as u32);
            }
            DONE => break,
            k => panic!("unexpected frame kind {k}"),
        }
    }
    assert_eq!(entries, count + 1);
}

/// SIGKILLs a process on drop (one the helper left running on purpose).
struct KillOnDrop(u32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-9", &self.0.to_string()])
            .stderr(Stdio::null())
            .status();
    }
}

#[test]
fn end_of_stdin_spares_background_processes_of_ended_execs() {
    let mut h = Helper::start();
    // Ended (EXIT sent), its background process lives on: like after a plain exec.
    let o = h.run(1, &sh("sleep 1234 >/dev/null 2>&1 & echo $!"));
    assert_eq!(o.exit, (EXITED, 0));
    let bg: u32 = o.text().trim().parse().unwrap();
    let _guard = KillOnDrop(bg);
    let bg_start = assert_alive(bg);
    // In flight: its whole tree goes.
    let root = h.spawn(2, &sh("sleep 1000 & echo $!; sleep 1000")).unwrap();
    let pid: u32 = h.read_lines(2, 1)[0].parse().unwrap();
    let starts = [assert_alive(root), assert_alive(pid)];
    thread::sleep(Duration::from_millis(300));
    let status = h.close();
    assert!(status.success(), "{status:?}");
    assert_gone(root, starts[0]);
    assert_gone(pid, starts[1]);
    thread::sleep(Duration::from_millis(200));
    assert_eq!(
        assert_alive(bg),
        bg_start,
        "the background sleep was killed"
    );
}

#[test]
fn a_spawn_of_several_mebibytes() {
    // Exec's own limit on argv + env is a quarter of the stack limit (at most 6 MiB) and
    // 128 KiB per string: raise the former, keep under the latter.
    let mut h = Helper::start_with(|c| {
        let mut p = Command::new("sh");
        p.args(["-c", r#"ulimit -s 65536 && exec "$0""#, BIN]);
        std::mem::swap(c, &mut p);
        c.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
    });
    let pieces = 14;
    let len = 120_000;
    let script = r#"n=0; for a in "$@"; do n=$((n + ${#a})); done; echo "$# $n ${#RUNCELL_BIG_0} ${#RUNCELL_BIG_13}""#;
    let mut sp = sh(script);
    sp.argv.push(b"sh".to_vec());
    for i in 0..pieces {
        sp.argv.push(vec![b'a' + i as u8; len]);
        sp.env.push((
            format!("RUNCELL_BIG_{i}").into_bytes(),
            vec![b'A' + i as u8; len],
        ));
    }
    let mut e = Enc::frame(SPAWN, 1);
    sp.encode(&mut e);
    assert!(e.finish().len() > 3 << 20, "a SPAWN over 3 MiB");
    let o = h.run(1, &sp);
    assert_eq!(o.exit, (EXITED, 0), "{o:?}");
    assert_eq!(o.text(), format!("{pieces} {} {len} {len}\n", pieces * len));
}

#[test]
fn root_makes_its_own_directory_and_executable_root_owned() {
    if !is_root() {
        eprintln!("skipped: needs root");
        return;
    }
    let dir = TempDir::new();
    let own = dir.path().join("runcell");
    fs::create_dir(&own).unwrap();
    let exe = own.join("helper");
    // Copied by another process: no write descriptor of ours can make the exec ETXTBSY.
    let copied = Command::new("cp").arg(BIN).arg(&exe).status().unwrap();
    assert!(copied.success());
    for p in [&own, &exe] {
        std::os::unix::fs::chown(p, Some(65534), Some(65534)).unwrap();
        fs::set_permissions(p, fs::Permissions::from_mode(0o777)).unwrap();
    }
    let e = exe.clone();
    let h = Helper::start_with(|c| {
        let mut p = Command::new(&e);
        std::mem::swap(c, &mut p);
        c.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
    });
    assert_eq!(h.hello.uid, 0);
    for p in [&own, &exe] {
        let m = fs::metadata(p).unwrap();
        assert_eq!(
            (m.uid(), m.gid(), m.mode() & 0o7777),
            (0, 0, 0o755),
            "{}",
            p.display()
        );
    }
}

#[test]
fn stdin_is_read_while_stdout_is_blocked() {
    let dir = TempDir::new();
    let marker = dir.path().join("spawned");
    let mut child = Command::new(BIN)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    // Nobody reads the helper's stdout: `yes` fills the pipe within its initial credit.
    let _unread = child.stdout.take().unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let spawn = |id: u32, sp: &Spawn| {
        let mut e = Enc::frame(SPAWN, id);
        sp.encode(&mut e);
        e.finish()
    };
    stdin.write_all(&spawn(1, &spawn_of(&["yes"]))).unwrap();
    thread::sleep(Duration::from_millis(300));
    // The helper still reads and handles frames (its answers wait in its queue).
    for id in 2..50 {
        stdin.write_all(&Enc::frame(PING, id).finish()).unwrap();
    }
    let touch = format!("touch '{}'", marker.display());
    stdin.write_all(&spawn(50, &sh(&touch))).unwrap();
    let deadline = Instant::now() + PATIENCE;
    while !marker.exists() {
        assert!(
            Instant::now() < deadline,
            "the helper stopped reading its stdin"
        );
        thread::sleep(Duration::from_millis(20));
    }
    // And it exits when its stdin ends, even though its stdout is still blocked.
    drop(stdin);
    let deadline = Instant::now() + PATIENCE;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the helper did not exit");
        }
        thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}");
}

/// Reads a GET's frames until its last one (`DONE` or `FILE_ERROR`), granting credit:
/// the entries' paths, the data bytes, and the last frame.
fn get_all(h: &mut Helper, id: u32) -> (Vec<String>, usize, Frame) {
    let (mut paths, mut data) = (Vec::new(), 0);
    loop {
        let f = h.recv();
        assert_eq!(f.id, id, "{f:?}");
        match f.kind {
            ENTRY => {
                let e = Entry::decode(&mut Dec::new(&f.payload)).unwrap();
                paths.push(String::from_utf8(e.path).unwrap());
            }
            STDOUT => {
                data += f.payload.len();
                h.send_u32(CREDIT, id, f.payload.len() as u32);
            }
            DONE | FILE_ERROR => return (paths, data, f),
            k => panic!("unexpected frame kind {k}: {f:?}"),
        }
    }
}

#[test]
fn a_file_that_shrinks_while_it_is_read_fails_the_get_naming_it() {
    let dir = TempDir::new();
    let d = dir.path().join("d");
    fs::create_dir(&d).unwrap();
    fs::write(d.join("a"), "first").unwrap();
    fs::write(d.join("big"), noise(8 * INITIAL_CREDIT as usize)).unwrap();
    fs::write(d.join("z"), "last").unwrap();
    let mut h = Helper::start();
    h.send_path(GET, 1, &d);
    // Everything the initial credit allows, without granting more: the helper is in the
    // middle of `big`.
    let mut got = 0usize;
    while got < INITIAL_CREDIT as usize {
        let f = h.recv();
        assert!(matches!(f.kind, ENTRY | STDOUT), "{f:?}");
        got += f.payload.len();
    }
    fs::OpenOptions::new()
        .write(true)
        .open(d.join("big"))
        .unwrap()
        .set_len(1000)
        .unwrap();
    h.send_u32(CREDIT, 1, INITIAL_CREDIT);
    let (paths, _, last) = get_all(&mut h, 1);
    assert!(paths.is_empty(), "entries after the cut file: {paths:?}");
    assert_eq!(file_error(&last), (FileError::Other, "d/big".to_string()));
    let msg = String::from_utf8_lossy(&last.payload).into_owned();
    assert!(msg.contains("shrank"), "{msg}");
}

#[test]
fn a_fifo_asked_for_is_an_error_and_skipped_below_a_directory() {
    let dir = TempDir::new();
    let d = dir.path().join("d");
    fs::create_dir(&d).unwrap();
    fs::write(d.join("file"), "x").unwrap();
    let fifo = d.join("fifo");
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    let mut h = Helper::start();
    h.send_path(GET, 1, &fifo);
    assert_eq!(
        file_error(&h.recv()),
        (FileError::Invalid, "fifo".to_string())
    );
    h.send_path(GET, 2, &d);
    let (paths, data, last) = get_all(&mut h, 2);
    assert_eq!(last.kind, DONE, "{last:?}");
    assert_eq!(paths, ["d", "d/file"]);
    assert_eq!(data, 1);
}

#[test]
fn a_put_leaves_blocks_of_zeros_as_holes() {
    let dir = TempDir::new();
    let size = 8usize << 20;
    let mut data = vec![0u8; size];
    data[..5].copy_from_slice(b"start");
    data[3 << 20..(3 << 20) + 3].copy_from_slice(b"mid");
    // Unaligned data around a block boundary, then zeros to the end (a hole at the end).
    data[(4 << 20) - 2..(4 << 20) + 2].copy_from_slice(b"edge");
    let mut h = Helper::start();
    h.send_path(PUT, 1, dir.path());
    h.send_entry(1, &entry("sparse", REGULAR, 0o644, size as u64, ""));
    // Chunks that do not line up with the hole blocks.
    for c in data.chunks(CHUNK - 100) {
        h.send_data(STDIN, 1, c);
    }
    h.send_empty(STDIN_EOF, 1);
    assert_eq!(put_result(&mut h, 1).0.kind, DONE);
    let path = dir.path().join("sparse");
    assert_eq!(fs::read(&path).unwrap(), data);
    let md = fs::metadata(&path).unwrap();
    assert_eq!(md.len(), size as u64);
    // A few blocks of data, not 8 MiB.
    assert!(
        md.blocks() * 512 < 1 << 20,
        "{} bytes allocated for {size} bytes, mostly zeros",
        md.blocks() * 512
    );
}

#[test]
fn a_put_cut_by_the_end_of_the_connection_leaves_no_temporary_file() {
    let dir = TempDir::new();
    let mut h = Helper::start();
    h.send_path(PUT, 1, dir.path());
    h.send_entry(1, &entry("whole", REGULAR, 0o644, 3, ""));
    h.send_data(STDIN, 1, b"abc");
    h.send_entry(1, &entry("cut", REGULAR, 0o644, 100_000, ""));
    h.send_data(STDIN, 1, &noise(1000));
    // Both acked: the temporary file of `cut` exists now.
    let mut acked = 0;
    while acked < 1003 {
        let f = h.recv();
        assert_eq!(f.kind, STDIN_ACK, "{f:?}");
        acked += Dec::new(&f.payload).u32().unwrap() as usize;
    }
    let names = || -> Vec<String> {
        let mut n: Vec<String> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        n.sort();
        n
    };
    assert_eq!(names().len(), 2, "{:?}", names());
    assert!(h.close().success());
    assert_eq!(names(), ["whole"]);
}

// ---- shepherds -------------------------------------------------------------------------

/// Fields of `/proc/<pid>/stat` the shepherd tests look at.
#[derive(Debug, Clone, Copy)]
struct Stat {
    ppid: u32,
    pgrp: u32,
    sid: u32,
}

fn stat_fields(pid: u32) -> Option<Stat> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    Some(Stat {
        ppid: f[1].parse().ok()?,
        pgrp: f[2].parse().ok()?,
        sid: f[3].parse().ok()?,
    })
}

/// A process's command line, arguments separated by spaces.
fn cmdline(pid: u32) -> String {
    fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

/// Waits until `cond` holds.
fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !cond() {
        assert!(Instant::now() < deadline, "never: {what}");
        thread::sleep(Duration::from_millis(20));
    }
}

/// KILL of a running exec, then its KILLED and EXIT (frames of other ids are skipped):
/// the EXIT.
fn kill_and_wait(h: &mut Helper, id: u32) -> (u8, i32) {
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

#[test]
fn every_exec_runs_under_a_shepherd_in_a_session_of_its_own() {
    let mut h = Helper::start();
    let helper = stat_fields(h.hello.pid).unwrap();
    let a = h.spawn(1, &spawn_of(&["sleep", "1000"])).unwrap();
    let b = h.spawn(2, &spawn_of(&["sleep", "1000"])).unwrap();
    let (sa, sb) = (stat_fields(a).unwrap(), stat_fields(b).unwrap());
    for (root, st) in [(a, sa), (b, sb)] {
        let shepherd = stat_fields(st.ppid).unwrap();
        assert_ne!(
            st.ppid, h.hello.pid,
            "the command is not the helper's child"
        );
        assert_eq!(
            shepherd.ppid, h.hello.pid,
            "the shepherd is the helper's child"
        );
        assert_eq!(shepherd.sid, st.ppid, "the shepherd leads a session");
        assert_eq!(st.sid, st.ppid, "the command is in its shepherd's session");
        assert_eq!(st.pgrp, root, "the command leads a process group");
        assert_ne!(st.sid, helper.sid);
        let line = cmdline(st.ppid);
        assert!(line.starts_with("runcell-shepherd "), "{line}");
    }
    assert_ne!(sa.sid, sb.sid, "two execs share a session");
    // The command starts with no signal blocked (the shepherd blocks SIGCHLD for itself).
    let o = h.run(3, &sh("grep SigBlk /proc/self/status"));
    assert_eq!(
        o.text().split_whitespace().nth(1),
        Some("0000000000000000"),
        "{}",
        o.text()
    );
    assert_eq!(kill_and_wait(&mut h, 1).0, SIGNALED);
    assert_eq!(kill_and_wait(&mut h, 2).0, SIGNALED);
}

#[test]
fn an_escaped_daemon_is_killed_while_another_exec_runs() {
    let mut h = Helper::start();
    // Another exec runs all along: one subreaper for every exec could not tell whose
    // orphan the daemon is.
    let other = h.spawn(1, &spawn_of(&["sleep", "1000"])).unwrap();
    let other_start = assert_alive(other);
    // Double fork, a new session, an empty environment, its parent gone.
    let root = h
        .spawn(
            2,
            &sh("(setsid sh -c 'echo $$; exec env -i sleep 1001' &); echo forked; exec sleep 1002"),
        )
        .unwrap();
    let shepherd = stat_fields(root).unwrap().ppid;
    let shepherd_start = assert_alive(shepherd);
    let lines = h.read_lines(2, 2);
    let daemon: u32 = lines.iter().find_map(|l| l.parse().ok()).unwrap();
    eventually(
        "the daemon runs, orphaned, with an empty environment",
        || {
            stat_fields(daemon).is_some_and(|s| s.ppid == shepherd && s.sid == daemon)
                && fs::read(format!("/proc/{daemon}/environ")).is_ok_and(|e| e.is_empty())
                && cmdline(daemon).starts_with("sleep 1001")
        },
    );
    let start = assert_alive(daemon);
    assert_eq!(kill_and_wait(&mut h, 2).0, SIGNALED);
    assert_gone(daemon, start);
    assert_gone(shepherd, shepherd_start);
    assert_eq!(
        assert_alive(other),
        other_start,
        "the other exec was killed"
    );
    assert_eq!(kill_and_wait(&mut h, 1).0, SIGNALED);
}

#[test]
fn a_shepherd_stays_while_background_processes_live_then_exits() {
    let mut h = Helper::start();
    let o = h.run(1, &sh("sleep 1 >/dev/null 2>&1 & echo $!"));
    assert_eq!(o.exit, (EXITED, 0));
    let bg: u32 = o.text().trim().parse().unwrap();
    // Its parent exited: the background process is its shepherd's now.
    let shepherd = stat_fields(bg).unwrap().ppid;
    assert!(cmdline(shepherd).starts_with("runcell-shepherd "));
    assert_eq!(stat_fields(shepherd).unwrap().ppid, h.hello.pid);
    let start = assert_alive(shepherd);
    // Gone once the last process of its exec is, and the helper forgot the exec.
    assert_gone(shepherd, start);
    eventually("the shepherd was reaped", || proc_stat(shepherd).is_none());
    h.send_empty(KILL, 1);
    let f = h.recv();
    assert_eq!((f.kind, f.id), (KILLED, 1));
}

#[test]
fn a_killed_shepherd_ends_its_exec_as_signaled_and_takes_its_session() {
    let mut h = Helper::start();
    let root = h.spawn(1, &sh("sleep 1000 & echo $!; wait")).unwrap();
    let bg: u32 = h.read_lines(1, 1)[0].parse().unwrap();
    let shepherd = stat_fields(root).unwrap().ppid;
    let starts = (assert_alive(root), assert_alive(bg));
    let killed = Command::new("kill")
        .args(["-9", &shepherd.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let o = h.wait_exit(1);
    assert_eq!(o.exit, (SIGNALED, 9));
    assert_gone(root, starts.0);
    assert_gone(bg, starts.1);
    assert_eq!(h.run(2, &sh("echo ok")).text(), "ok\n");
}

/// The pids of the processes whose `/proc/<pid>` belongs to `uid`.
fn processes_of(uid: u32) -> Vec<u32> {
    let mut v: Vec<u32> = fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            fs::metadata(format!("/proc/{pid}")).is_ok_and(|m| m.uid() == uid)
                && proc_stat(*pid).is_some_and(|(state, _)| state != 'Z')
        })
        .collect();
    v.sort();
    v
}

#[test]
fn a_fork_bomb_under_a_pids_limit_is_killed_by_its_shepherd() {
    if !is_root() || !Path::new("/usr/bin/prlimit").exists() {
        eprintln!("skipped: needs root and prlimit");
        return;
    }
    let uid = 57000 + (std::process::id() % 1000) * 2;
    let mut h = Helper::start_with(|c| {
        use std::os::unix::process::CommandExt;
        let mut p = Command::new("/usr/bin/prlimit");
        p.arg("--nproc=48").arg("--").arg(BIN);
        p.uid(uid).gid(uid).current_dir("/");
        std::mem::swap(c, &mut p);
        c.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
    });
    let other = h.spawn(1, &spawn_of(&["sleep", "1000"])).unwrap();
    let other_start = assert_alive(other);
    let other_shepherd = stat_fields(other).unwrap().ppid;
    let idle = processes_of(uid);
    // Forks until the kernel refuses (the shell then exits, its children orphaned to
    // the shepherd): no process slot is left for anything new.
    let o = h.run(2, &sh("while :; do sleep 1000 & done"));
    assert_ne!(o.exit, (EXITED, 0));
    let full = processes_of(uid).len();
    assert!(full > 30, "{full} processes");
    // The kill needs no new process: the shepherd is there already.
    let t = Instant::now();
    h.send_empty(KILL, 2);
    let f = h.recv();
    assert_eq!((f.kind, f.id), (KILLED, 2));
    eprintln!("{full} processes, killed in {:?}", t.elapsed());
    eventually("only the helper and the other exec are left", || {
        processes_of(uid) == idle
    });
    assert_eq!(
        assert_alive(other),
        other_start,
        "the other exec was killed"
    );
    assert!(idle.contains(&other_shepherd));
    assert_eq!(h.run(4, &spawn_of(&["true"])).exit, (EXITED, 0));
    assert_eq!(kill_and_wait(&mut h, 1).0, SIGNALED);
}

unsafe extern "C" {
    fn renameat2(
        from_dir: i32,
        from: *const std::ffi::c_char,
        to_dir: i32,
        to: *const std::ffi::c_char,
        flags: u32,
    ) -> i32;
}

/// Exchanges two names atomically (`RENAME_EXCHANGE`); false if refused.
fn exchange(a: &std::ffi::CStr, b: &std::ffi::CStr) -> bool {
    // SAFETY: NUL-terminated names that outlive the call; AT_FDCWD and RENAME_EXCHANGE.
    unsafe { renameat2(-100, a.as_ptr(), -100, b.as_ptr(), 2) == 0 }
}

/// Runs a PUT of `entries` (regular files get `data`) into `base`: true if `DONE`, false
/// if a refusal (a link not followed, a non-directory in the way, a name missing).
fn put_ok(h: &mut Helper, id: u32, base: &Path, entries: &[Entry], data: &[u8]) -> bool {
    h.send_path(PUT, id, base);
    for e in entries {
        h.send_entry(id, e);
        if e.kind == REGULAR && e.size > 0 {
            h.send_data(STDIN, id, data);
        }
    }
    h.send_empty(STDIN_EOF, id);
    let (f, _) = put_result(h, id);
    if f.kind == DONE {
        return true;
    }
    let (kind, _) = file_error(&f);
    assert!(
        matches!(
            kind,
            FileError::Untrusted | FileError::NotDir | FileError::NotFound
        ),
        "{f:?}"
    );
    // The data after the failure is still acknowledged: drain to a PONG.
    h.send_empty(PING, id);
    while h.recv().kind != PONG {}
    false
}

/// A directory of another user whose `d` keeps trading places with a link to a root-only
/// directory: PUTs through it, PUTs of a directory entry at it and GETs of it never touch
/// or read the root-only directory, and a path through a link in it is refused.
#[test]
fn a_link_another_user_swaps_in_is_never_followed() {
    use std::os::unix::ffi::OsStrExt;
    if !is_root() {
        eprintln!("skipped: needs root");
        return;
    }
    let dir = TempDir::new();
    let canary = dir.path().join("canary");
    fs::create_dir(&canary).unwrap();
    fs::set_permissions(&canary, fs::Permissions::from_mode(0o700)).unwrap();
    fs::write(canary.join("secret"), "secret").unwrap();
    let race = dir.path().join("race");
    fs::create_dir_all(race.join("d")).unwrap();
    std::os::unix::fs::symlink(&canary, race.join("l")).unwrap();
    std::os::unix::fs::chown(&race, Some(65534), Some(65534)).unwrap();
    let c = |p: PathBuf| std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    let (d, l) = (c(race.join("d")), c(race.join("l")));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let swapper = {
        let stop = stop.clone();
        thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                assert!(exchange(&d, &l), "{}", std::io::Error::last_os_error());
                n += 1;
            }
            n
        })
    };
    let mut h = Helper::start();
    let (mut done, mut refused) = (0, 0);
    let mut tally = |ok: bool| if ok { done += 1 } else { refused += 1 };
    let mut id = 0;
    for _ in 0..300 {
        id += 3;
        let planted = entry("planted", REGULAR, 0o4777, 3, "");
        tally(put_ok(&mut h, id, &race.join("d"), &[planted], b"pwn"));
        let at_d = entry("d", DIRECTORY, 0o777, 0, "");
        let below = entry("d/planted", REGULAR, 0o4777, 3, "");
        tally(put_ok(&mut h, id + 1, &race, &[at_d, below], b"pwn"));
        h.send_path(GET, id + 2, &race.join("d"));
        loop {
            let f = h.recv();
            match f.kind {
                STDOUT => {
                    assert!(!f.payload.windows(6).any(|w| w == b"secret"));
                    h.send_u32(CREDIT, id + 2, f.payload.len() as u32);
                }
                ENTRY => {}
                DONE => break,
                FILE_ERROR => break,
                k => panic!("unexpected frame kind {k}"),
            }
        }
    }
    id += 3;
    h.send_path(GET, id, &race.join("l").join("secret"));
    let (kind, _) = file_error(&h.recv());
    assert!(matches!(kind, FileError::Untrusted | FileError::NotFound));
    stop.store(true, Ordering::Relaxed);
    let swaps = swapper.join().unwrap();
    let md = fs::metadata(&canary).unwrap();
    assert_eq!((md.mode() & 0o7777, md.uid()), (0o700, 0));
    let names: Vec<_> = fs::read_dir(&canary)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("secret")]);
    assert_eq!(fs::read_to_string(canary.join("secret")).unwrap(), "secret");
    assert!(
        done > 0 && refused > 0,
        "{done} done, {refused} refused, {swaps} swaps"
    );
}
