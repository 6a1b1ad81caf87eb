//! What the modules' unit tests share (compiled only for them): a [`Helper`] without side
//! effects on the test process, the frames it queued, and temporary directories.

use std::collections::VecDeque;
use std::env;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Condvar, Mutex};

use crate::exec::Registry;
use crate::proto::{self, Dec};
use crate::{Helper, OutQueue, lock, sys};

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
    /// A helper as [`Helper::new`] makes one, but without touching the test process (no
    /// subreaper, no copy of stdout; no writer runs): the test's own ids, `root` as given,
    /// the working directory `cwd` and the test's environment.
    pub(crate) fn for_tests(root: bool, cwd: &Path) -> Helper {
        let (uid, gid, _) = sys::ids();
        Helper {
            out: Mutex::new(OutQueue::default()),
            out_cv: Condvar::new(),
            idle_cv: Condvar::new(),
            out_broken: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            pid: std::process::id() as i32,
            uid,
            gid,
            root,
            cwd: cwd.to_path_buf(),
            cwd_id: fs::metadata(cwd).ok().map(|m| (m.dev(), m.ino())),
            base_env: env::vars_os().collect(),
            reg: Mutex::new(Registry::default()),
            reg_cv: Condvar::new(),
        }
    }

    /// [`Helper::for_tests`], for as long as the test process lives (threads borrow it).
    pub(crate) fn leaked(root: bool, cwd: &Path) -> &'static Helper {
        Box::leak(Box::new(Helper::for_tests(root, cwd)))
    }

    /// Takes the frames queued so far.
    pub(crate) fn take_frames(&self) -> Vec<Frame> {
        let frames: VecDeque<Vec<u8>> = std::mem::take(&mut lock(&self.out).frames);
        frames.iter().map(|f| Frame::parse(f)).collect()
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
