//! What the modules' unit tests share (compiled only for them): a [`Helper`] without side
//! effects on the test process, frames as a host reads them, and temporary directories.

use std::env;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};

use crate::exec::Registry;
use crate::proto::{self, Dec};
use crate::{Helper, sys};

/// A frame the helper queued: kind, id, payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Frame {
    pub(crate) kind: u8,
    pub(crate) id: u32,
    pub(crate) payload: Vec<u8>,
}

impl Frame {
    /// Splits one whole frame as the host would read it.
    pub(crate) fn parse(bytes: &[u8]) -> Frame {
        let (kind, id, payload, len) = proto::split_frame(bytes)
            .expect("a valid frame")
            .expect("a whole frame");
        assert_eq!(len, bytes.len(), "exactly one frame");
        Frame {
            kind,
            id,
            payload: payload.to_vec(),
        }
    }

    /// A decoder over the payload.
    pub(crate) fn dec(&self) -> Dec<'_> {
        Dec::new(&self.payload)
    }

    /// The payload as one u32 (`STDIN_ACK`, `STARTED`).
    pub(crate) fn u32(&self) -> u32 {
        self.dec().u32().expect("a u32 payload")
    }
}

impl Helper {
    /// A daemon's helper as [`Helper::new`] makes one, but without touching the test
    /// process (no subreaper; no thread runs): the test's own ids, `root` as given, the
    /// working directory `cwd` and the test's environment.
    pub(crate) fn for_tests(root: bool, cwd: &Path) -> Helper {
        let (uid, gid, _) = sys::ids();
        Helper {
            stopping: AtomicBool::new(false),
            durable: true,
            pid: std::process::id() as i32,
            uid,
            gid,
            root,
            size: 1234,
            digest: 0x5678,
            cwd: cwd.to_path_buf(),
            cwd_id: fs::metadata(cwd).ok().map(|m| (m.dev(), m.ino())),
            base_env: env::vars_os().collect(),
            reg: Mutex::new(Registry::default()),
            reg_cv: Condvar::new(),
            janitor_cv: Condvar::new(),
            connections: AtomicUsize::new(0),
            daemon_dir: None,
        }
    }

    /// [`Helper::for_tests`], for as long as the test process lives (threads borrow it).
    pub(crate) fn leaked(root: bool, cwd: &Path) -> &'static Helper {
        Box::leak(Box::new(Helper::for_tests(root, cwd)))
    }
}

/// A fresh directory under `/tmp` (world-searchable, as tests of other users' rights
/// need), removed on drop.
pub(crate) struct TempDir(PathBuf);

impl TempDir {
    /// A new, empty directory.
    pub(crate) fn new() -> TempDir {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let p = Path::new("/tmp").join(format!("runcell-helper-unit-{}-{n}", std::process::id()));
        let _ = fs::remove_dir_all(&p);
        fs::create_dir(&p).expect("create a temporary directory");
        TempDir(p)
    }

    /// Its path.
    pub(crate) fn path(&self) -> &Path {
        &self.0
    }

    /// A path inside it.
    pub(crate) fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}
