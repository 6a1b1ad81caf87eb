//! The run's mux: a small process per run on this host (as ssh's ControlMaster) that
//! holds the run open, with its exec helper's session, so that a `sandbox exec` after the
//! first pays this process's start and one local round trip instead of an engine
//! connection, an attach and an engine exec.
//!
//! The first `sandbox exec` of a run (and `RUNCELL_MUX` not `off`) starts it in the
//! background: `sandbox __mux`, its settings (driver, `--config` pairs, config file, run,
//! socket) on its stdin, never in argv; its environment is the exec's. It listens on a
//! Unix socket in a directory only this user can enter (`$XDG_RUNTIME_DIR/runcell`, else
//! `/tmp/runcell-<uid>`; mode 0700, checked) named by a hash of the run and of everything
//! that chooses the engine, and serves peers of its own uid only. It exits after
//! `RUNCELL_MUX_IDLE` (default 5 min) without a connection, when its run is gone, and on
//! `sandbox stop` / `sandbox gc` of its run. One lock file per socket keeps it to one mux.
//!
//! Each connection carries one exec: `HELLO` from the mux, then `EXEC` (the spec as
//! JSON), `STARTED`, output, `EXIT` with the exit code `sandbox exec` exits with (and the
//! line it tells on stderr); stdin within a window the mux acknowledges; `RESIZE`;
//! `INTERRUPT` (the command's processes are killed and awaited, then `GONE`). A client
//! that vanishes before `EXIT` leaves its command to run on for its grace, as a broken
//! connection would (`ExecStream::leave`: `sandbox logs -f` picks it up); past the grace
//! it is killed.
//! Frames: u32 little-endian length of what follows, a kind byte, the payload.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use runcell_core::{
    ErrorKind, ExecSpec, ExitStatus, OutputChunk, Run, RunExt, Stdin, TerminalSize,
};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{Notify, Semaphore, mpsc};

use crate::errors::{Failure, code};

/// `off`: never; `require`: fail when the mux cannot be used; anything else: use it when
/// it can be had.
pub const MUX_ENV: &str = "RUNCELL_MUX";
/// How long a mux waits without a connection before it exits (`300`, `30s`, `10m`).
pub const IDLE_ENV: &str = "RUNCELL_MUX_IDLE";
const DEFAULT_IDLE: Duration = Duration::from_secs(300);
/// The hidden subcommand that runs the mux.
pub const SUBCOMMAND: &str = "__mux";
/// Bumped on any incompatible change (a mux of another version is not used).
const VERSION: u32 = 1;
/// The largest frame either side accepts.
const MAX_FRAME: usize = (1 << 20) + 64;
/// Stdin bytes a client sends ahead of the mux's acknowledgements.
const STDIN_WINDOW: u32 = 1 << 20;
/// Stdin read at a time.
const STDIN_CHUNK: usize = 64 << 10;
/// How long a client waits for the mux's `HELLO`, and the mux for an `EXEC`.
const GREETING: Duration = Duration::from_secs(5);
/// How often an idle mux checks that its run is still there.
const LIVENESS_CHECK: Duration = Duration::from_secs(15);
/// How long an interrupted client waits for `GONE` (the mux's wait is bounded by
/// [`crate::exec::KILL_WAIT`]).
const GONE_WAIT: Duration = Duration::from_secs(30);

mod kind {
    pub const EXEC: u8 = 1;
    pub const STDIN: u8 = 2;
    pub const STDIN_EOF: u8 = 3;
    pub const RESIZE: u8 = 4;
    pub const INTERRUPT: u8 = 5;
    pub const QUIT: u8 = 6;
    pub const HELLO: u8 = 101;
    pub const STARTED: u8 = 102;
    pub const STDOUT: u8 = 103;
    pub const STDERR: u8 = 104;
    pub const LOST: u8 = 105;
    pub const STDIN_ACK: u8 = 106;
    pub const EXIT: u8 = 107;
    pub const FAILED: u8 = 108;
    pub const GONE: u8 = 109;
    pub const BYE: u8 = 110;
}

/// Whether to use the mux.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Off,
    On,
    Require,
}

pub fn mode() -> Mode {
    match std::env::var(MUX_ENV).as_deref() {
        Ok("off") | Ok("0") | Ok("false") => Mode::Off,
        Ok("require") => Mode::Require,
        _ => Mode::On,
    }
}

/// What the mux is started with (on its stdin).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Launch {
    pub driver: String,
    pub config: Vec<String>,
    pub config_file: Option<PathBuf>,
    pub run: String,
    pub socket: PathBuf,
}

#[derive(Serialize, Deserialize)]
struct Hello {
    version: u32,
    stdin_streaming: bool,
}

/// An exec as the client asks for it.
#[derive(Serialize, Deserialize)]
struct Request {
    argv: Vec<String>,
    env: Vec<(String, String)>,
    working_dir: Option<String>,
    user: Option<String>,
    timeout_ms: Option<u64>,
    grace_ms: Option<u64>,
    output_buffer: Option<u64>,
    tty: Option<(u16, u16)>,
    piped_stdin: bool,
    /// The marker of its processes, to await them after an interrupt.
    marker: Option<String>,
}

#[derive(Serialize, Deserialize)]
struct Started {
    exec_id: Option<String>,
}

#[derive(Serialize, Deserialize)]
pub struct Exit {
    pub code: i32,
    pub message: Option<String>,
}

#[derive(Serialize, Deserialize)]
struct Failed {
    message: String,
    hint: Option<String>,
    code: i32,
}

fn frame(kind: u8, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(5 + payload.len());
    f.extend_from_slice(&(payload.len() as u32 + 1).to_le_bytes());
    f.push(kind);
    f.extend_from_slice(payload);
    f
}

fn json_frame(kind: u8, value: &impl Serialize) -> Vec<u8> {
    frame(kind, &serde_json::to_vec(value).unwrap_or_default())
}

/// The next frame, `None` at a clean end.
async fn read_frame(r: &mut OwnedReadHalf) -> io::Result<Option<(u8, Vec<u8>)>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len == 0 || len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a frame of {len} bytes"),
        ));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    let kind = body.remove(0);
    Ok(Some((kind, body)))
}

/// Reads frames into a channel (so that a `select!` never loses half a frame); the
/// channel ends with the connection.
fn frames_of(mut r: OwnedReadHalf) -> mpsc::UnboundedReceiver<(u8, Vec<u8>)> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok(Some(f)) = read_frame(&mut r).await {
            if tx.send(f).is_err() {
                return;
            }
        }
    });
    rx
}

/// Writes the frames of a channel; ends with it or the connection.
fn writer_of(
    mut w: OwnedWriteHalf,
    capacity: usize,
) -> (mpsc::Sender<Vec<u8>>, tokio::task::JoinHandle<()>) {
    let (tx, mut rx) = mpsc::channel::<Vec<u8>>(capacity);
    let written = tokio::spawn(async move {
        while let Some(f) = rx.recv().await {
            if w.write_all(&f).await.is_err() {
                return;
            }
        }
        let _ = w.shutdown().await;
    });
    (tx, written)
}

fn uid() -> u32 {
    rustix::process::getuid().as_raw()
}

/// The directory of this user's mux sockets, made if missing: `None` unless it is a
/// directory (not a link) of this user that nobody else may enter.
fn private_dir() -> Option<PathBuf> {
    let dir = match std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        Some(d) => PathBuf::from(d).join("runcell"),
        None => PathBuf::from(format!("/tmp/runcell-{}", uid())),
    };
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => {
            tracing::debug!("no mux: cannot make {}: {e}", dir.display());
            return None;
        }
    }
    let md = std::fs::symlink_metadata(&dir).ok()?;
    if !md.is_dir() || md.uid() != uid() || md.mode() & 0o077 != 0 {
        tracing::debug!(
            "no mux: {} is not a private directory of this user",
            dir.display()
        );
        return None;
    }
    Some(dir)
}

/// The socket of the mux for `run` reached with these settings (and this environment's
/// engine variables): `None` when no private directory can be had.
pub fn socket_path(
    driver: &str,
    config: &[String],
    config_file: Option<&Path>,
    run: &str,
) -> Option<PathBuf> {
    let mut h = DefaultHasher::new();
    (VERSION, driver, config, config_file, run).hash(&mut h);
    let mut vars: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| {
            (k.starts_with("RUNCELL_") && !k.starts_with(MUX_ENV))
                || k.starts_with("DOCKER_")
                || k.starts_with("KUBE")
                || k == "CONTAINER_HOST"
                || k == "XDG_RUNTIME_DIR"
                || k == "HOME"
        })
        .collect();
    vars.sort();
    vars.hash(&mut h);
    Some(private_dir()?.join(format!("{:016x}.sock", h.finish())))
}

// ---------------------------------------------------------------------------------
// Client

/// A connection to a run's mux, greeted.
pub struct Client {
    frames: mpsc::UnboundedReceiver<(u8, Vec<u8>)>,
    out: mpsc::Sender<Vec<u8>>,
    stdin_streaming: bool,
}

/// Connects to the mux at `path`: `None` when none listens there (or it is not this
/// user's, or of another version).
pub async fn connect(path: &Path) -> Option<Client> {
    let sock = UnixStream::connect(path).await.ok()?;
    if sock.peer_cred().ok()?.uid() != uid() {
        tracing::warn!("{} is served by another user: not used", path.display());
        return None;
    }
    let (r, w) = sock.into_split();
    let mut frames = frames_of(r);
    let (k, payload) = tokio::time::timeout(GREETING, frames.recv()).await.ok()??;
    let hello: Hello = serde_json::from_slice(&payload).ok()?;
    if k != kind::HELLO || hello.version != VERSION {
        return None;
    }
    Some(Client {
        frames,
        out: writer_of(w, 64).0,
        stdin_streaming: hello.stdin_streaming,
    })
}

impl Client {
    /// Whether the run's driver streams stdin.
    pub fn stdin_streaming(&self) -> bool {
        self.stdin_streaming
    }

    /// Starts `spec` through the mux.
    pub async fn start(
        mut self,
        spec: &ExecSpec,
        marker: Option<String>,
    ) -> Result<MuxExec, Failure> {
        let req = Request {
            argv: spec.argv.clone(),
            env: spec.env.clone(),
            working_dir: spec.working_dir.clone(),
            user: spec.user.clone(),
            timeout_ms: spec
                .timeout
                .map(|t| t.as_millis().min(u64::MAX as u128) as u64),
            grace_ms: spec
                .grace
                .map(|t| t.as_millis().min(u64::MAX as u128) as u64),
            output_buffer: spec.output_buffer,
            tty: spec.tty.map(|t| (t.rows, t.cols)),
            piped_stdin: matches!(spec.stdin, Stdin::Piped),
            marker,
        };
        let gone = || Failure::usage("the run's mux went away before the command started");
        self.out
            .send(json_frame(kind::EXEC, &req))
            .await
            .map_err(|_| gone())?;
        let (k, payload) = self.frames.recv().await.ok_or_else(gone)?;
        match k {
            kind::STARTED => {
                let started: Started = serde_json::from_slice(&payload).map_err(|_| gone())?;
                let window = Arc::new(Semaphore::new(STDIN_WINDOW as usize));
                Ok(MuxExec {
                    frames: self.frames,
                    out: self.out,
                    exec_id: started.exec_id,
                    window,
                    exit: None,
                })
            }
            kind::FAILED => {
                let f: Failed = serde_json::from_slice(&payload).map_err(|_| gone())?;
                Err(Failure::Remote {
                    message: f.message,
                    hint: f.hint,
                    code: f.code,
                })
            }
            _ => Err(gone()),
        }
    }
}

/// A command running through the mux.
pub struct MuxExec {
    frames: mpsc::UnboundedReceiver<(u8, Vec<u8>)>,
    out: mpsc::Sender<Vec<u8>>,
    exec_id: Option<String>,
    window: Arc<Semaphore>,
    exit: Option<Exit>,
}

/// The stdin of a command running through the mux.
pub struct MuxStdin {
    out: mpsc::Sender<Vec<u8>>,
    window: Arc<Semaphore>,
}

impl MuxStdin {
    /// Sends `data` once the window has room; `Err` once the command or the mux ended.
    pub async fn write(&mut self, data: &[u8]) -> Result<(), ()> {
        for part in data.chunks(STDIN_CHUNK) {
            let permits = self
                .window
                .acquire_many(part.len() as u32)
                .await
                .map_err(|_| ())?;
            permits.forget();
            self.out
                .send(frame(kind::STDIN, part))
                .await
                .map_err(|_| ())?;
        }
        Ok(())
    }

    pub async fn close(self) {
        let _ = self.out.send(frame(kind::STDIN_EOF, &[])).await;
    }
}

impl MuxExec {
    pub fn exec_id(&self) -> Option<&str> {
        self.exec_id.as_deref()
    }

    pub fn take_stdin(&mut self) -> MuxStdin {
        MuxStdin {
            out: self.out.clone(),
            window: self.window.clone(),
        }
    }

    pub fn resize(&self, rows: u16, cols: u16) {
        let mut p = rows.to_le_bytes().to_vec();
        p.extend_from_slice(&cols.to_le_bytes());
        let _ = self.out.try_send(frame(kind::RESIZE, &p));
    }

    /// The next chunk of output; `None` at the end (then [`MuxExec::exit`] tells how it
    /// ended). Cancel-safe.
    pub async fn next_chunk(&mut self) -> Option<OutputChunk> {
        loop {
            let (k, payload) = match self.frames.recv().await {
                Some(f) => f,
                None => {
                    if self.exit.is_none() {
                        self.exit = Some(Exit {
                            code: code::TRANSPORT_LOST,
                            message: Some(
                                "sandbox: the run's mux went away; the command may still run \
                                 (`sandbox ps` shows it)"
                                    .into(),
                            ),
                        });
                    }
                    return None;
                }
            };
            match k {
                kind::STDOUT => return Some(OutputChunk::Stdout(Bytes::from(payload))),
                kind::STDERR => return Some(OutputChunk::Stderr(Bytes::from(payload))),
                kind::LOST => {
                    let n = payload
                        .get(..8)
                        .and_then(|b| b.try_into().ok())
                        .map_or(0, u64::from_le_bytes);
                    return Some(OutputChunk::Lost(n));
                }
                kind::STDIN_ACK => {
                    let n = payload
                        .get(..4)
                        .and_then(|b| b.try_into().ok())
                        .map_or(0, u32::from_le_bytes);
                    let room = STDIN_WINDOW as usize - self.window.available_permits();
                    self.window.add_permits((n as usize).min(room));
                }
                kind::EXIT => {
                    self.exit = serde_json::from_slice(&payload).ok();
                    return None;
                }
                _ => {}
            }
        }
    }

    /// How the command ended, once [`MuxExec::next_chunk`] returned `None`.
    pub fn exit(&mut self) -> Exit {
        self.exit.take().unwrap_or(Exit {
            code: code::TRANSPORT_LOST,
            message: Some("sandbox: the run's mux sent no exit status".into()),
        })
    }

    /// Has the mux kill the command's processes and waits (bounded) until it says they
    /// are gone.
    pub async fn interrupt(mut self) {
        if self.out.send(frame(kind::INTERRUPT, &[])).await.is_err() {
            return;
        }
        let _ = tokio::time::timeout(GONE_WAIT, async {
            while let Some((k, _)) = self.frames.recv().await {
                if k == kind::GONE {
                    return;
                }
            }
        })
        .await;
    }
}

/// Asks the mux at `path` (if any) to exit; true if one answered.
pub async fn quit(path: &Path) -> bool {
    let Some(mut c) = connect(path).await else {
        return false;
    };
    if c.out.send(frame(kind::QUIT, &[])).await.is_err() {
        return false;
    }
    matches!(
        tokio::time::timeout(GREETING, c.frames.recv()).await,
        Ok(Some((kind::BYE, _)))
    )
}

/// Starts the mux for `launch` in the background (not waited for); its log goes beside
/// its socket.
pub fn spawn(launch: &Launch) {
    let result = (|| -> io::Result<()> {
        let exe = std::env::current_exe()?;
        let log = launch.socket.with_extension("log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .mode(0o600)
            .open(log)?;
        let mut child = std::process::Command::new(exe)
            .arg(SUBCOMMAND)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(log)
            // Not in the terminal's foreground group: Ctrl-C there is not for it.
            .process_group(0)
            .spawn()?;
        let settings = serde_json::to_vec(launch).map_err(io::Error::other)?;
        if let Some(mut stdin) = child.stdin.take() {
            use std::io::Write;
            stdin.write_all(&settings)?;
        }
        Ok(())
    })();
    if let Err(e) = result {
        tracing::debug!("cannot start the run's mux: {e}");
    }
}

// ---------------------------------------------------------------------------------
// Server

/// The mux: reads its [`Launch`] on stdin, then serves until idle, quit, or its run is
/// gone. Returns the exit code.
pub async fn serve(
    connect_driver: impl AsyncFnOnce(&Launch) -> Result<(Box<dyn Run>, bool), Failure>,
) -> i32 {
    let mut input = Vec::new();
    if tokio::io::stdin().read_to_end(&mut input).await.is_err() {
        return code::FAILED;
    }
    let Ok(launch) = serde_json::from_slice::<Launch>(&input) else {
        eprintln!("sandbox mux: unreadable settings");
        return code::FAILED;
    };
    let idle = std::env::var(IDLE_ENV)
        .ok()
        .and_then(|v| crate::units::parse_duration(&v).ok())
        .unwrap_or(DEFAULT_IDLE);
    // One mux per socket: the lock is held for its whole life.
    let lock_path = launch.socket.with_extension("lock");
    let lock = match std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(&lock_path)
    {
        Ok(f) => f,
        Err(e) => {
            eprintln!("sandbox mux: {}: {e}", lock_path.display());
            return code::FAILED;
        }
    };
    if rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_err() {
        return 0; // Another is starting or serving.
    }
    if connect(&launch.socket).await.is_some() {
        return 0;
    }
    let _ = std::fs::remove_file(&launch.socket);
    let (run, stdin_streaming): (Arc<dyn Run>, bool) = match connect_driver(&launch).await {
        Ok((run, streaming)) => (Arc::from(run), streaming),
        Err(e) => {
            eprintln!("sandbox mux: {e}");
            return code::FAILED;
        }
    };
    // The helper's session is opened now, not on the first client's time.
    if let Err(e) = run.exec(ExecSpec::new(["true"])).await {
        eprintln!("sandbox mux: the run does not answer: {e}");
        return code::FAILED;
    }
    let listener = match UnixListener::bind(&launch.socket) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("sandbox mux: {}: {e}", launch.socket.display());
            return code::FAILED;
        }
    };
    let _ = std::fs::set_permissions(&launch.socket, std::fs::Permissions::from_mode(0o600));
    let bound = std::fs::metadata(&launch.socket).map(|m| m.ino()).ok();
    tracing::info!("serving run {} on {}", launch.run, launch.socket.display());

    let state = Arc::new(State {
        active: AtomicUsize::new(0),
        quit: Notify::new(),
        stdin_streaming,
        driver: launch.driver.clone(),
    });
    let (mut last_busy, mut last_check) = (Instant::now(), Instant::now());
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                if let Ok((sock, _)) = accepted {
                    let (run, state) = (run.clone(), state.clone());
                    state.active.fetch_add(1, Ordering::SeqCst);
                    tokio::spawn(async move {
                        serve_conn(&run, &state, sock).await;
                        state.active.fetch_sub(1, Ordering::SeqCst);
                    });
                }
            }
            _ = state.quit.notified() => break,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {
                if state.active.load(Ordering::SeqCst) > 0 {
                    last_busy = Instant::now();
                } else if last_busy.elapsed() >= idle {
                    tracing::info!("idle for {idle:?}: exiting");
                    break;
                } else if last_check.elapsed() >= LIVENESS_CHECK {
                    // A run removed behind its back (not by `sandbox stop`) ends it too.
                    last_check = Instant::now();
                    if run_gone(&*run).await {
                        tracing::info!("the run is gone: exiting");
                        break;
                    }
                }
            }
        }
    }
    // What the connections still have to say goes out first (bounded).
    drop(listener);
    let deadline = Instant::now() + Duration::from_secs(5);
    while state.active.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Our socket only (a mux started after a quit may have bound a new one).
    if std::fs::metadata(&launch.socket).map(|m| m.ino()).ok() == bound {
        let _ = std::fs::remove_file(&launch.socket);
    }
    drop(lock);
    0
}

/// Whether the run is gone (checked with one exec; any other failure is not taken for
/// that).
async fn run_gone(run: &dyn Run) -> bool {
    let check = ExecSpec::new(["true"]).timeout(Duration::from_secs(10));
    match run.exec(check).await {
        Ok(out) => matches!(out.status, ExitStatus::RunLost(_)),
        Err(e) => matches!(e.kind(), ErrorKind::RunLost | ErrorKind::NotFound),
    }
}

struct State {
    /// Connections being served.
    active: AtomicUsize,
    quit: Notify,
    stdin_streaming: bool,
    /// The driver's name, for the hints of failures it tells.
    driver: String,
}

/// One connection: one exec.
async fn serve_conn(run: &Arc<dyn Run>, state: &Arc<State>, sock: UnixStream) {
    match sock.peer_cred() {
        Ok(c) if c.uid() == uid() => {}
        _ => return,
    }
    let (r, w) = sock.into_split();
    let (out, written) = writer_of(w, 32);
    serve_exec(run, state, frames_of(r), out).await;
    // What it queued goes out before the connection counts as done (bounded: a stdin
    // task may hold the writer a little longer).
    let _ = tokio::time::timeout(Duration::from_secs(2), written).await;
}

/// The exec of one connection, from its `HELLO` to its `EXIT`.
async fn serve_exec(
    run: &Arc<dyn Run>,
    state: &Arc<State>,
    mut frames: mpsc::UnboundedReceiver<(u8, Vec<u8>)>,
    out: mpsc::Sender<Vec<u8>>,
) {
    let hello = Hello {
        version: VERSION,
        stdin_streaming: state.stdin_streaming,
    };
    if out.send(json_frame(kind::HELLO, &hello)).await.is_err() {
        return;
    }
    let Ok(Some((k, payload))) = tokio::time::timeout(GREETING, frames.recv()).await else {
        return;
    };
    match k {
        kind::EXEC => {}
        kind::QUIT => {
            let _ = out.send(frame(kind::BYE, &[])).await;
            state.quit.notify_one();
            return;
        }
        _ => return,
    }
    let Ok(req) = serde_json::from_slice::<Request>(&payload) else {
        return;
    };
    let marker = req.marker.clone();
    let timeout = req.timeout_ms.map(Duration::from_millis);
    let spec = spec_of(req);
    let mut exec = match run.exec_stream(spec).await {
        Ok(exec) => exec,
        Err(e) => {
            let lost = e.kind() == ErrorKind::RunLost;
            let failure = Failure::from(e);
            let f = Failed {
                message: failure.to_string(),
                hint: failure.hint(&state.driver),
                code: failure.code(),
            };
            let _ = out.send(json_frame(kind::FAILED, &f)).await;
            if lost {
                state.quit.notify_one();
            }
            return;
        }
    };
    let started = Started {
        exec_id: exec.exec_id().map(|id| id.to_string()),
    };
    if out.send(json_frame(kind::STARTED, &started)).await.is_err() {
        return abandon(exec);
    }
    // Stdin: fed by its own task, acknowledged as written; the window bounds the queue.
    let unacked = Arc::new(AtomicU64::new(0));
    let mut stdin_tx = exec.take_stdin().map(|mut writer| {
        let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
        let (acks, unacked) = (out.clone(), unacked.clone());
        tokio::spawn(async move {
            while let Some(data) = rx.recv().await {
                let n = data.len() as u32;
                if writer.write(Bytes::from(data)).await.is_err() {
                    break;
                }
                unacked.fetch_sub(u64::from(n), Ordering::SeqCst);
                let _ = acks.send(frame(kind::STDIN_ACK, &n.to_le_bytes())).await;
            }
        });
        tx
    });
    loop {
        tokio::select! {
            chunk = exec.next_chunk() => {
                let f = match chunk {
                    Some(OutputChunk::Stdout(b)) => frame(kind::STDOUT, &b),
                    Some(OutputChunk::Stderr(b)) => frame(kind::STDERR, &b),
                    Some(OutputChunk::Lost(n)) => frame(kind::LOST, &n.to_le_bytes()),
                    None => break,
                };
                if out.send(f).await.is_err() {
                    return abandon(exec);
                }
            }
            f = frames.recv() => match f {
                Some((kind::STDIN, data)) => {
                    // Counted against the window: a client beyond it is cut off.
                    let queued = unacked.fetch_add(data.len() as u64, Ordering::SeqCst);
                    if queued + data.len() as u64 > u64::from(STDIN_WINDOW) {
                        return abandon(exec);
                    }
                    if let Some(tx) = &stdin_tx {
                        let _ = tx.send(data);
                    }
                }
                Some((kind::STDIN_EOF, _)) => stdin_tx = None,
                Some((kind::RESIZE, p)) if p.len() == 4 => {
                    let rows = u16::from_le_bytes([p[0], p[1]]);
                    let cols = u16::from_le_bytes([p[2], p[3]]);
                    let _ = exec.resize(rows, cols);
                }
                Some((kind::INTERRUPT, _)) => {
                    drop(exec);
                    if let Some(marker) = marker {
                        crate::exec::wait_gone(&**run, &marker).await;
                    }
                    let _ = out.send(frame(kind::GONE, &[])).await;
                    return;
                }
                Some(_) => {}
                None => return abandon(exec),
            }
        }
    }
    let status = exec.wait().await;
    let (code, message) = crate::exec::exit_outcome(&status, timeout);
    let _ = out
        .send(json_frame(kind::EXIT, &Exit { code, message }))
        .await;
    if matches!(status, ExitStatus::RunLost(_)) {
        state.quit.notify_one();
    }
}

/// The client went before its command ended: the mux leaves the command as a broken
/// connection would (it runs on for its grace, unattached; `sandbox logs -f` picks it
/// up). On the plain path there is nothing to leave it to: it is killed.
fn abandon(exec: runcell_core::ExecStream) {
    if let Err(e) = exec.leave() {
        tracing::debug!("the client went; its command is killed: {e}");
    }
}

fn spec_of(req: Request) -> ExecSpec {
    let mut spec = ExecSpec::new(req.argv);
    spec.env = req.env;
    spec.working_dir = req.working_dir;
    spec.user = req.user;
    spec.timeout = req.timeout_ms.map(Duration::from_millis);
    spec.grace = req.grace_ms.map(Duration::from_millis);
    spec.output_buffer = req.output_buffer;
    spec.tty = req.tty.map(|(rows, cols)| TerminalSize::new(rows, cols));
    if req.piped_stdin {
        spec.stdin = Stdin::Piped;
    }
    spec
}
