//! The in-sandbox exec helper: one long-lived exec per run that starts every later
//! command as its own child, over one held-open stream (see `helper/proto.rs` for the
//! protocol and `helper/main.rs` for the program).
//!
//! Core owns all of it, for every driver: a backend only supplies what it already has,
//! [`crate::raw::Backend::put_executable`] (to place the binary at [`HELPER_PATH`];
//! `put_tar` by default) and [`crate::raw::Backend::exec_raw`] (to start it with a piped
//! stdin). A backend makes
//! [`HELPER_DIR`] a small writable, executable place in the target (Docker: an anonymous
//! volume; Kubernetes: an `emptyDir`), so that it works with a read-only root too; where
//! it cannot, the run falls back to the plain exec path.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;

use crate::error::{Error, ErrorKind, Result};
use crate::raw::{Backend, RawExec};
use crate::spec::Stdin;

pub use crate::spec::{EXEC_HELPER_ENV, ExecHelper};

pub(crate) mod durable;
pub(crate) mod files;
#[path = "../../helper/proto.rs"]
#[allow(dead_code)]
pub(crate) mod proto;
mod session;

pub(crate) use session::{KILL_ANSWER_TIMEOUT, Session};

mod embedded {
    include!(concat!(env!("OUT_DIR"), "/helper_bin.rs"));
}

/// Where a backend must offer a writable, executable directory in every target.
pub const HELPER_DIR: &str = proto::HELPER_DIR;
/// Where core places the helper binary.
pub const HELPER_PATH: &str = "/.runcell/helper";
/// How long a helper may take to answer its first frame (it greets within milliseconds of
/// its start; a helper that does not is replaced by the plain path, or fails a run that
/// requires it).
pub(crate) const GREETING_TIMEOUT: Duration = Duration::from_secs(8);

/// Which path a run's execs take ([`crate::Run::exec_path`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ExecPath {
    /// Through the in-sandbox helper: one held-open stream, a fork+exec per command.
    Helper,
    /// One engine exec per command.
    Plain,
}

/// True when this build embeds a helper: always, unless it was built with
/// `RUNCELL_HELPER_PATH=none` (or on docs.rs).
pub fn available() -> bool {
    !embedded::BYTES.is_empty()
}

/// Logs that run `run` takes the plain exec path because the helper could not start:
/// at warn level the first time in this process, at info level after that.
pub(crate) fn log_fallback(run: &str, why: &dyn std::fmt::Display) {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!(
            run,
            "the exec helper could not start ({why}); this run uses plain execs (one engine exec per command; later fallbacks are logged at info level)"
        );
    } else {
        tracing::info!(
            run,
            "the exec helper could not start ({why}); using plain execs"
        );
    }
}

/// The helper's size and digest, as embedded.
pub(crate) fn embedded_digest() -> (u64, u64) {
    (embedded::BYTES.len() as u64, embedded::DIGEST)
}

/// The exec helper binary this build embeds (empty when it has none), for
/// a backend that puts it into an image it makes ([`crate::raw::Backend::helper_in_image`]).
pub fn helper_binary() -> &'static [u8] {
    embedded::BYTES
}

/// What tells this build's helper from any other (protocol version, size and digest), to
/// label an image that carries it.
pub fn helper_build() -> String {
    let (size, digest) = embedded_digest();
    format!("{}-{size}-{digest:016x}", proto::VERSION)
}

/// Places the binary at [`HELPER_PATH`] (its size and digest are checked by the helper's
/// greeting).
async fn install<B: Backend>(backend: &B, id: &str) -> Result<()> {
    // Code in the target may race the upload (renaming its own file over the path while
    // Podman's extractor creates it fails the upload with "file exists"): five tries
    // within 1.5 s, then the error. A target that is gone fails at once.
    let mut tries = 0;
    loop {
        tries += 1;
        match backend
            .put_executable(id, HELPER_PATH, bytes::Bytes::from_static(embedded::BYTES))
            .await
        {
            Ok(()) => return Ok(()),
            Err(e) if tries < 5 && e.kind() == ErrorKind::Backend => {
                tracing::debug!(run = %id, "uploading the exec helper failed ({e}); trying again");
                tokio::time::sleep(std::time::Duration::from_millis(50 << tries)).await;
            }
            Err(e) => return Err(e.with("path", HELPER_PATH)),
        }
    }
}

/// Starts the helper already in place and checks that it is this build's.
async fn open<B: Backend>(backend: &B, id: &str) -> Result<Session> {
    let mut exec = RawExec::new([HELPER_PATH]);
    exec.stdin = Stdin::Piped;
    exec.self_delimited = true;
    let process = backend.exec_raw(id, exec).await?;
    let session = Session::open(process, GREETING_TIMEOUT).await?;
    let hello = &session.hello;
    if hello.version != proto::VERSION || (hello.size, hello.digest) != embedded_digest() {
        return Err(Error::new(
            ErrorKind::Backend,
            format!(
                "the helper in the target is not this build's (version {}, {} bytes)",
                hello.version, hello.size
            ),
        ));
    }
    Ok(session)
}

/// Starts a helper in target `id`, always from a fresh upload of this build's binary: the
/// file in the target is the sandbox's to change (a root exec may replace it), and its
/// greeting, computed in the sandbox, proves nothing. Uploading before every start (the
/// first exec of an attached run, or after a session broke) makes the helper that runs
/// the one the library ships (it costs one `put_executable` of ~1.5 MB, tens of
/// milliseconds on Docker); the greeting then checks that the upload is complete.
pub(crate) async fn start<B: Backend>(backend: &B, id: &str) -> Result<Arc<Session>> {
    start_with(backend, id, false).await
}

/// [`start`], first trying the helper the engine put in place from the run's image when
/// `in_image` ([`crate::raw::Backend::helper_in_image`]: only at create, before any
/// command of the run); if that one does not greet as this build's, it is uploaded.
///
/// Such an image is a snapshot whose top layer the library wrote (the helper in it is
/// this build's bytes), but the run's keep-alive comes from the same image, whose other
/// files the snapshotted run could change: it could replace the helper before it starts.
/// An upload does not prevent that either (the keep-alive can race it), and it gives the
/// run nothing it did not have: the host side treats every helper as the sandbox's.
pub(crate) async fn start_with<B: Backend>(
    backend: &B,
    id: &str,
    in_image: bool,
) -> Result<Arc<Session>> {
    if !available() {
        return Err(Error::new(
            ErrorKind::Unsupported,
            "this build has no exec helper (not built for a Linux glibc target)",
        ));
    }
    let began = std::time::Instant::now();
    if in_image {
        match open(backend, id).await {
            Ok(session) => {
                tracing::debug!(
                    run = %id,
                    pid = session.hello.pid,
                    start_ms = began.elapsed().as_millis() as u64,
                    "exec helper started from the image"
                );
                return Ok(Arc::new(session));
            }
            Err(e) => {
                tracing::debug!(run = %id, "the image's exec helper did not start ({e}); uploading it");
            }
        }
    }
    install(backend, id).await?;
    let installed = began.elapsed();
    let session = open(backend, id).await?;
    tracing::debug!(
        run = %id,
        pid = session.hello.pid,
        uid = session.hello.uid,
        install_ms = installed.as_millis() as u64,
        start_ms = began.elapsed().as_millis() as u64,
        "exec helper started"
    );
    Ok(Arc::new(session))
}

/// How long [`wake`] may take.
const WAKE_BOUND: Duration = Duration::from_secs(5);

/// Continues the helper's processes `pids` (the daemon and the relay of a session that
/// was given up on: `SIGCONT` through one engine exec, bounded, its output discarded): a
/// relay that was stopped then reads its closed stream and exits, and a stopped daemon
/// applies the grace rules to what that connection started, instead of staying behind
/// stopped. Harmless for a process that runs, is gone, or never was one.
pub(crate) async fn wake<B: Backend>(backend: &B, id: &str, pids: &[u32]) {
    let pids: Vec<String> = pids
        .iter()
        .filter(|p| **p > 1)
        .map(u32::to_string)
        .collect();
    if pids.is_empty() {
        return;
    }
    let mut argv = vec![
        "sh".to_string(),
        "-c".into(),
        "kill -CONT \"$@\" 2>/dev/null; exit 0".into(),
        "runcell-wake".into(),
    ];
    argv.extend(pids);
    let exec = RawExec::new(argv);
    let wake = async {
        let mut process = backend.exec_raw(id, exec).await?;
        drop(process.stdin.take());
        while let Some(Ok(_)) = process.output.next().await {}
        Result::Ok(())
    };
    if let Ok(Err(e)) | Err(e) = tokio::time::timeout(WAKE_BOUND, wake)
        .await
        .map_err(|_| Error::new(ErrorKind::Timeout, "the wake exec did not end"))
    {
        tracing::debug!(run = %id, "could not continue the old exec helper: {e}");
    }
}
