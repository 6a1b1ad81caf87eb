//! `PUT` and `GET`: file operations that a sandbox user cannot turn against others.
//!
//! The helper usually runs as root, and it writes and reads inside directories that a
//! less privileged exec user owns. Such a user can swap any name in its directories for a
//! symbolic link at any moment (an exchange by `renameat2` is atomic), so no operation
//! here ever looks a name up twice or follows a link that user could have placed:
//!
//! - The path the host names (a `PUT`'s directory, the directory holding a `GET`'s path)
//!   is resolved one component at a time from `/`, each opened `O_PATH | O_NOFOLLOW` and
//!   held as a descriptor. A symbolic link on the way is followed only when the directory
//!   holding it can be changed by nobody but root or the helper's own user (owned by one
//!   of them, not writable by group or others); any other link is refused
//!   ([`FileError::Untrusted`]), never followed.
//! - Below that, nothing is followed at all: every entry is reached from the held
//!   directory's descriptor, one `O_NOFOLLOW` component at a time, and a link where a
//!   directory is expected is an error.
//! - Every change goes through a descriptor: a file is created under an unpredictable
//!   temporary name with `O_EXCL`, written, given its owner, mode and time on the open
//!   file (`fchown`, `fchmod`, `futimens`), then renamed over its name within the same
//!   held directory (`renameat`); a directory is created, then opened `O_NOFOLLOW` and
//!   changed through that descriptor; a link's owner is set with `AT_SYMLINK_NOFOLLOW`.
//! - A `GET` reopens what it examined through its own descriptor (`/proc/self/fd/N`, the
//!   same inode, never the name again): a directory to list it, a file to read it.
//!
//! One mechanism on every kernel (`openat` walks; `O_PATH` needs Linux 2.6.39), rather
//! than `openat2` where the kernel has it and a walk elsewhere: one path to test.

use std::collections::HashMap;
use std::collections::hash_map::RandomState;
use std::ffi::{CStr, CString};
use std::fs::{self, File, Metadata, OpenOptions, Permissions};
use std::hash::{BuildHasher, Hasher};
use std::io::{self, ErrorKind, Read};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, UNIX_EPOCH};

use crate::flow::Flow;
use crate::link::Link;
use crate::proto::{
    CHUNK, DIRECTORY, Entry, FIFO, FileError, HARDLINK, HOLE_BLOCK, LINK_TARGET, MAX_GET_LINKS,
    MAX_WALK_DEPTH, REGULAR, STDOUT, SYMLINK,
};
use crate::sys::{self, O_CLOEXEC, O_CREAT, O_DIRECTORY, O_EXCL, O_NOFOLLOW, O_PATH, O_WRONLY};
use crate::sys::{EINVAL, ELOOP, ENOENT, ENOTDIR};
use crate::{HEADER, data_frame, file_error_kind};

/// Symbolic links followed in one path, at most (the kernel's own bound).
const MAX_LINKS: usize = 40;
/// Tries at a fresh temporary name when one is taken.
const TEMP_TRIES: usize = 16;

/// A failure: kind, path (relative, for entries), message.
pub(crate) type Failure = (FileError, Vec<u8>, String);

pub(crate) fn cstr(name: &[u8]) -> io::Result<CString> {
    CString::new(name).map_err(|_| io::Error::from_raw_os_error(EINVAL))
}

/// Opens `name` in `dir`, never following a link at `name`.
pub(crate) fn open_in(dir: &File, name: &CStr, flags: i32) -> io::Result<File> {
    let flags = flags | O_NOFOLLOW | O_CLOEXEC;
    sys::openat(Some(dir.as_fd()), name, flags, 0).map(File::from)
}

/// Opens the file that the descriptor `f` names again, with `flags` (read-only): the
/// same inode, whatever its name points to now.
fn reopen(f: &File, flags: i32) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(flags | O_CLOEXEC)
        .open(format!("/proc/self/fd/{}", f.as_raw_fd()))
}

/// Whether nobody but root or the helper's own user can change the entries of the
/// directory `dir` describes.
fn trusted(dir: &Metadata) -> bool {
    let (_, _, euid) = sys::ids();
    (dir.uid() == 0 || dir.uid() == euid) && dir.mode() & 0o022 == 0
}

/// The components of a path, without empty ones and `.`.
pub(crate) fn components(path: &[u8]) -> impl DoubleEndedIterator<Item = &[u8]> {
    path.split(|&b| b == b'/')
        .filter(|c| !c.is_empty() && *c != b".")
}

/// Opens (`O_PATH`) what the absolute `path` names, following a symbolic link only where
/// [`trusted`] (module docs).
pub(crate) fn resolve(path: &[u8]) -> Result<File, (FileError, String)> {
    let fail = |e: io::Error| (file_error_kind(&e), e.to_string());
    if path.first() != Some(&b'/') {
        return Err((FileError::Invalid, "the path must be absolute".into()));
    }
    let root = || {
        sys::openat(None, c"/", O_PATH | O_DIRECTORY | O_CLOEXEC, 0)
            .map(File::from)
            .map_err(fail)
    };
    let mut cur = root()?;
    // Components still to walk, the next one last; and what was walked, for messages.
    let mut todo: Vec<Vec<u8>> = components(path).rev().map(<[u8]>::to_vec).collect();
    let mut walked: Vec<u8> = Vec::new();
    let mut links = 0;
    while let Some(c) = todo.pop() {
        let name = cstr(&c).map_err(fail)?;
        let next = open_in(&cur, &name, O_PATH).map_err(fail)?;
        let md = next.metadata().map_err(fail)?;
        walked.push(b'/');
        walked.extend_from_slice(&c);
        if !md.file_type().is_symlink() {
            cur = next;
            continue;
        }
        if !trusted(&cur.metadata().map_err(fail)?) {
            return Err((
                FileError::Untrusted,
                format!(
                    "{} is a symbolic link in a directory that users other than root can \
                     change: not followed (name the path it points to)",
                    String::from_utf8_lossy(&walked)
                ),
            ));
        }
        links += 1;
        if links > MAX_LINKS {
            return Err(fail(io::Error::from_raw_os_error(ELOOP)));
        }
        let target = sys::readlink_fd(next.as_fd()).map_err(fail)?;
        if target.first() == Some(&b'/') {
            cur = root()?;
        }
        todo.extend(components(&target).rev().map(<[u8]>::to_vec));
    }
    Ok(cur)
}

/// A fresh, unpredictable temporary name (`O_EXCL` makes it ours).
fn temp_name() -> CString {
    static KEYS: OnceLock<RandomState> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = KEYS.get_or_init(RandomState::new).build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    CString::new(format!(".runcell-tmp-{:016x}", h.finish())).expect("no NUL in the name")
}

/// Creates something under a fresh temporary name in a directory, with `create` (which
/// must fail with `EEXIST` if the name is taken): the name and what `create` returned.
pub(crate) fn create_temp<T>(
    mut create: impl FnMut(&CStr) -> io::Result<T>,
) -> io::Result<(CString, T)> {
    let mut last = None;
    for _ in 0..TEMP_TRIES {
        let name = temp_name();
        match create(&name) {
            Ok(t) => return Ok((name, t)),
            Err(e) if e.kind() == ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| io::Error::from(ErrorKind::AlreadyExists)))
}

/// Makes a fifo or symlink (`make`, of the type `kind` accepts) at `name` in `dir`
/// where no other user can reach it before it is in place: in a private staging
/// directory made beside `name` (same filesystem), set up there through a descriptor
/// (`set`: owner, mode), then renamed to `name`. Another user who can write in `dir` can
/// move the staging directory but never enter it, nor choose what is set up.
fn staged(
    dir: &File,
    name: &CStr,
    make: impl FnOnce(&File, &CStr) -> io::Result<()>,
    kind: impl Fn(fs::FileType) -> bool,
    set: impl FnOnce(&File) -> io::Result<()>,
) -> io::Result<()> {
    let (stage_name, ()) = create_temp(|t| sys::mkdirat(dir.as_fd(), t, 0o700))?;
    let entry = c"e";
    let mut stage = None;
    let done = (|| {
        let s = stage.insert(open_in(dir, &stage_name, O_DIRECTORY)?);
        if !fresh_dir(s) {
            return Err(io::Error::other("the staging directory was replaced"));
        }
        make(s, entry)?;
        set(&made_here(s, entry, kind)?)?;
        sys::rename_between(s.as_fd(), entry, dir.as_fd(), name)
    })();
    if let Some(s) = &stage
        && done.is_err()
    {
        let _ = sys::unlinkat(s.as_fd(), entry);
    }
    // Empty now, unless another user swapped a directory of its own in (then not ours
    // to remove, and `rmdir` fails unless it is empty).
    let _ = sys::rmdirat(dir.as_fd(), &stage_name);
    done
}

/// What this process just made at the temporary name `tmp` in `dir`, opened without
/// following it: of the type `kind` accepts, owned by this process's user, with one
/// name; an error otherwise (another user who can write in `dir` swapped the name).
fn made_here(dir: &File, tmp: &CStr, kind: impl Fn(fs::FileType) -> bool) -> io::Result<File> {
    let f = open_in(dir, tmp, O_PATH)?;
    let md = f.metadata()?;
    let (_, _, euid) = sys::ids();
    if kind(md.file_type()) && md.uid() == euid && md.nlink() == 1 {
        Ok(f)
    } else {
        Err(io::Error::other(
            "what was made under a temporary name was replaced",
        ))
    }
}

/// Whether the directory `d` can be the one this process just made: its own, with no
/// entries (not its mode or link count: a default ACL widens the one, btrfs keeps the
/// other at 1). Another user can move in at most an empty directory of ours.
fn fresh_dir(d: &File) -> bool {
    let (_, _, euid) = sys::ids();
    let ours = d.metadata().is_ok_and(|m| m.uid() == euid);
    ours && fs::read_dir(format!("/proc/self/fd/{}", d.as_raw_fd()))
        .is_ok_and(|mut entries| entries.next().is_none())
}

/// `Err(IsDir)` if a directory is at `name` in `dir` (a file or link there is replaced).
fn no_directory_at(dir: &File, name: &CStr) -> Result<(), FileError> {
    match open_in(dir, name, O_PATH).and_then(|f| f.metadata()) {
        Ok(m) if m.is_dir() => Err(FileError::IsDir),
        _ => Ok(()),
    }
}

// ---- PUT -------------------------------------------------------------------------------

/// A `PUT` in progress.
pub(crate) struct Put {
    /// The directory everything lands in (`O_PATH`); `None` once failed.
    base: Option<File>,
    /// After the first error the operation's frames are discarded (STDIN still acked).
    pub(crate) failed: bool,
    /// The regular file whose data is being received.
    pub(crate) file: Option<PutFile>,
    /// The regular files this `PUT` wrote, by path: their (device, inode), the only
    /// files a [`HARDLINK`] may name (at most [`MAX_PUT_FILES`] entries and
    /// [`MAX_LINK_PATH_BYTES`] of paths remembered).
    made: Links<Vec<u8>, (u64, u64)>,
    /// The last [`HELD_FILES`] files written, still open: a hard link to one of them
    /// links that very file (its inode cannot have been freed and given to another).
    held: std::collections::VecDeque<(Vec<u8>, File)>,
}

/// A regular file a `PUT` wrote: its path, (device, inode) and descriptor.
type Written = (Vec<u8>, (u64, u64), File);

/// The most regular files a `PUT` remembers for hard links.
const MAX_PUT_FILES: usize = 1 << 20;
/// The files a `PUT` keeps open for hard links to them.
const HELD_FILES: usize = 256;

/// The most path bytes a `GET` or `PUT` remembers for hard links.
const MAX_LINK_PATH_BYTES: usize = 64 << 20;

/// Files remembered for hard links, bounded in count and path bytes
/// ([`MAX_LINK_PATH_BYTES`]).
struct Links<K, V> {
    map: HashMap<K, V>,
    bytes: usize,
    cap: usize,
}

impl<K: std::hash::Hash + Eq, V> Links<K, V> {
    fn new(cap: usize) -> Self {
        Links {
            map: HashMap::new(),
            bytes: 0,
            cap,
        }
    }

    /// Remembers `v` (which holds a path of `len` bytes) for `k` while within the bounds
    /// (what `k` had is replaced); whether it is remembered.
    fn remember(&mut self, k: K, v: V, len: usize) -> bool {
        if let Some(old) = self.map.get_mut(&k) {
            *old = v;
            true
        } else if self.map.len() < self.cap && self.bytes + len <= MAX_LINK_PATH_BYTES {
            self.bytes += len;
            self.map.insert(k, v);
            true
        } else {
            false
        }
    }
}

/// A regular file being written under a temporary name.
pub(crate) struct PutFile {
    pub(crate) rel: Vec<u8>,
    /// The directory it lands in, its temporary name there and its name.
    dir: File,
    tmp: CString,
    name: CString,
    file: File,
    left: u64,
    entry: Entry,
}

impl PutFile {
    /// Owner, mode, mtime (all on the open file), then the rename over its name; the
    /// file's path and (device, inode).
    fn finish(self, root: bool) -> Result<Written, Failure> {
        let e = &self.entry;
        let r = (|| {
            let md = self.file.metadata()?;
            // A hole at the end was seeked over, not written.
            self.file.set_len(e.size)?;
            if root {
                std::os::unix::fs::fchown(&self.file, Some(e.uid), Some(e.gid))?;
            }
            self.file
                .set_permissions(Permissions::from_mode(e.mode & 0o7777))?;
            if e.mtime > 0 {
                let _ = self
                    .file
                    .set_modified(UNIX_EPOCH + Duration::from_secs(e.mtime as u64));
            }
            sys::renameat(self.dir.as_fd(), &self.tmp, &self.name)?;
            Ok((md.dev(), md.ino()))
        })();
        match r {
            Ok(id) => Ok((self.rel, id, self.file)),
            Err(err) => {
                let _ = sys::unlinkat(self.dir.as_fd(), &self.tmp);
                Err((file_error_kind(&err), self.rel.clone(), err.to_string()))
            }
        }
    }

    /// Removes the temporary file.
    pub(crate) fn abandon(self) {
        let _ = sys::unlinkat(self.dir.as_fd(), &self.tmp);
    }
}

impl Put {
    /// A `PUT` into the directory `path` (which must exist); failed at once if it cannot
    /// be used.
    pub(crate) fn start(path: &[u8]) -> Result<Put, Failure> {
        let base = resolve(path)
            .and_then(|d| match d.metadata() {
                Ok(m) if m.is_dir() => Ok(d),
                Ok(_) => Err((FileError::NotDir, "not a directory".to_string())),
                Err(e) => Err((file_error_kind(&e), e.to_string())),
            })
            .map_err(|(k, m)| (k, Vec::new(), m))?;
        Ok(Put::failed_with(Some(base)))
    }

    /// A `PUT` whose frames are only acknowledged (`base` `None`: it failed).
    pub(crate) fn failed_with(base: Option<File>) -> Put {
        Put {
            failed: base.is_none(),
            base,
            file: None,
            made: Links::new(MAX_PUT_FILES),
            held: std::collections::VecDeque::new(),
        }
    }

    /// Remembers a regular file written, for hard links to it.
    fn wrote(&mut self, (rel, id, file): Written) {
        let len = rel.len();
        self.held.retain(|(p, _)| *p != rel);
        if self.held.len() == HELD_FILES {
            self.held.pop_front();
        }
        self.held.push_back((rel.clone(), file));
        self.made.remember(rel, id, len);
    }

    /// The first failure: `FILE_ERROR` once, then the operation's frames are discarded.
    pub(crate) fn fail(&mut self, link: &Link, id: u32, (kind, rel, msg): Failure) {
        self.failed = true;
        self.base = None;
        if let Some(pf) = self.file.take() {
            pf.abandon();
        }
        link.send_file_error(id, kind, &rel, &msg);
    }

    /// Applies one `ENTRY`.
    pub(crate) fn apply(&mut self, root: bool, e: Entry) -> Result<(), Failure> {
        let rel = e.path.clone();
        let err = |k: FileError, m: &str| (k, rel.clone(), m.to_string());
        let io_err = |x: io::Error| (file_error_kind(&x), rel.clone(), x.to_string());
        // A link (or any non-directory) where a directory is expected.
        let in_the_way = |x: io::Error| match x.raw_os_error() {
            Some(ELOOP | ENOTDIR) => err(FileError::NotDir, "a non-directory is in the way"),
            _ => io_err(x),
        };
        let valid = !rel.is_empty()
            && rel
                .split(|&b| b == b'/')
                .all(|c| !c.is_empty() && c != b"." && c != b"..");
        if !valid {
            return Err(err(FileError::Invalid, "invalid entry path"));
        }
        let Some(base) = &self.base else {
            return Err(err(FileError::Other, "the operation failed"));
        };
        // The entry's directory, reached from the base without following anything.
        let parts: Vec<&[u8]> = rel.split(|&b| b == b'/').collect();
        let (last, parents) = parts.split_last().expect("a valid path has a component");
        let mut dir = base.try_clone().map_err(io_err)?;
        for p in parents {
            let name = cstr(p).map_err(io_err)?;
            dir = open_in(&dir, &name, O_PATH | O_DIRECTORY).map_err(in_the_way)?;
        }
        let name = cstr(last).map_err(io_err)?;
        let mode = e.mode & 0o7777;
        match e.kind {
            DIRECTORY => {
                // Where another user can change the entries (an untrusted parent), an
                // existing directory keeps its owner and mode (that user may have moved
                // any directory it can reach to this name), and one just made is changed
                // only once checked to be it (ours, empty).
                let parent_trusted = dir.metadata().is_ok_and(|m| trusted(&m));
                let (opened, fresh) = match open_in(&dir, &name, O_DIRECTORY) {
                    Err(x) if x.raw_os_error() == Some(ENOENT) => {
                        sys::mkdirat(dir.as_fd(), &name, 0o700).map_err(io_err)?;
                        (open_in(&dir, &name, O_DIRECTORY), true)
                    }
                    other => (other, false),
                };
                let d = opened.map_err(in_the_way)?;
                if fresh && !parent_trusted && !fresh_dir(&d) {
                    return Err(err(
                        FileError::Invalid,
                        "the directory made was replaced by another",
                    ));
                }
                if fresh || parent_trusted {
                    if root {
                        std::os::unix::fs::fchown(&d, Some(e.uid), Some(e.gid)).map_err(io_err)?;
                    }
                    d.set_permissions(Permissions::from_mode(mode))
                        .map_err(io_err)?;
                }
            }
            SYMLINK => {
                no_directory_at(&dir, &name).map_err(|k| err(k, "a directory is in the way"))?;
                let target = cstr(&e.link).map_err(io_err)?;
                staged(
                    &dir,
                    &name,
                    |stage, n| sys::symlinkat(&target, stage.as_fd(), n),
                    |t| t.is_symlink(),
                    |f| {
                        if root {
                            sys::fchown_fd(f.as_fd(), e.uid, e.gid)?;
                        }
                        Ok(())
                    },
                )
                .map_err(io_err)?;
            }
            REGULAR => {
                no_directory_at(&dir, &name).map_err(|k| err(k, "a directory is in the way"))?;
                let flags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
                let (tmp, file) = create_temp(|t| sys::openat(Some(dir.as_fd()), t, flags, 0o600))
                    .map_err(io_err)?;
                let pf = PutFile {
                    rel,
                    dir,
                    tmp,
                    name,
                    file: File::from(file),
                    left: e.size,
                    entry: e,
                };
                if pf.left == 0 {
                    let made = pf.finish(root)?;
                    self.wrote(made);
                } else {
                    self.file = Some(pf);
                }
            }
            HARDLINK => {
                no_directory_at(&dir, &name).map_err(|k| err(k, "a directory is in the way"))?;
                // Only a regular file this PUT wrote (by path, then by inode: another user
                // who can write in its directory may have put another file at its name).
                let Some(&want) = self.made.map.get(&e.link) else {
                    return Err(err(
                        FileError::Invalid,
                        "a hard link to a path this PUT wrote no regular file at",
                    ));
                };
                let held = self.held.iter().find(|(p, _)| *p == e.link);
                let (tmp, ()) = if let Some((_, f)) = held {
                    // The very file written, through its descriptor.
                    create_temp(|t| sys::link_fd(f.as_fd(), dir.as_fd(), t)).map_err(io_err)?
                } else {
                    // By name: only where no other user can change the file's directory
                    // (elsewhere, one could delete the file and have its inode number
                    // given to a file of its own).
                    let tparts: Vec<&[u8]> = e.link.split(|&b| b == b'/').collect();
                    let (tlast, tparents) = tparts.split_last().expect("a remembered path");
                    let mut tdir = base.try_clone().map_err(io_err)?;
                    for p in tparents {
                        let n = cstr(p).map_err(io_err)?;
                        tdir = open_in(&tdir, &n, O_PATH | O_DIRECTORY).map_err(io_err)?;
                    }
                    if !tdir.metadata().is_ok_and(|m| trusted(&m)) {
                        return Err(err(
                            FileError::Invalid,
                            "a hard link to a file written long before, in a directory other users can change",
                        ));
                    }
                    let tname = cstr(tlast).map_err(io_err)?;
                    create_temp(|t| sys::linkat(tdir.as_fd(), &tname, dir.as_fd(), t))
                        .map_err(io_err)?
                };
                let same = |n: &CStr| {
                    open_in(&dir, n, O_PATH)
                        .and_then(|f| f.metadata())
                        .is_ok_and(|m| m.is_file() && (m.dev(), m.ino()) == want)
                };
                // `Ok(false)`: the name is that file already (a rename between two names
                // of one inode does nothing and would leave the temporary name).
                let placed = if !same(&tmp) {
                    Err(err(
                        FileError::Invalid,
                        "the file this hard link names was replaced while the PUT ran",
                    ))
                } else if same(&name) {
                    Ok(false)
                } else {
                    sys::renameat(dir.as_fd(), &tmp, &name)
                        .map(|()| true)
                        .map_err(io_err)
                };
                if !matches!(placed, Ok(true)) {
                    let _ = sys::unlinkat(dir.as_fd(), &tmp);
                }
                placed?;
            }
            FIFO => {
                no_directory_at(&dir, &name).map_err(|k| err(k, "a directory is in the way"))?;
                staged(
                    &dir,
                    &name,
                    |stage, n| sys::mkfifoat(stage.as_fd(), n, 0o600),
                    |t| t.is_fifo(),
                    |f| {
                        if root {
                            sys::fchown_fd(f.as_fd(), e.uid, e.gid)?;
                        }
                        let at = format!("/proc/self/fd/{}", f.as_raw_fd());
                        fs::set_permissions(&at, Permissions::from_mode(mode))
                    },
                )
                .map_err(io_err)?;
            }
            k => return Err(err(FileError::Invalid, &format!("unknown entry type {k}"))),
        }
        Ok(())
    }

    /// Data of the current regular file.
    pub(crate) fn data(&mut self, root: bool, data: &[u8]) -> Result<(), Failure> {
        let Some(pf) = self.file.as_mut() else {
            return Err((
                FileError::Invalid,
                Vec::new(),
                "data without a file entry".into(),
            ));
        };
        if data.len() as u64 > pf.left {
            return Err((
                FileError::Invalid,
                pf.rel.clone(),
                "more data than the entry's size".into(),
            ));
        }
        let pos = pf.entry.size - pf.left;
        write_sparse(&mut pf.file, pos, data)
            .map_err(|x| (file_error_kind(&x), pf.rel.clone(), x.to_string()))?;
        pf.left -= data.len() as u64;
        if let Some(pf) = self.file.take_if(|pf| pf.left == 0) {
            let made = pf.finish(root)?;
            self.wrote(made);
        }
        Ok(())
    }
}

/// Writes `data` at offset `pos` of a new file (its current position), seeking over
/// every whole [`HOLE_BLOCK`]-aligned block of zeros instead of writing it: a sparse
/// file crosses as its full size but lands with holes again (`PutFile::finish` sets the
/// length, for a hole at the end).
fn write_sparse(file: &mut File, mut pos: u64, data: &[u8]) -> io::Result<()> {
    use std::io::{Seek, SeekFrom, Write};
    let mut start = 0; // Of the run of data not written yet.
    let mut at = 0;
    while at < data.len() {
        let n = ((HOLE_BLOCK - pos % HOLE_BLOCK) as usize).min(data.len() - at);
        let piece = &data[at..at + n];
        if n as u64 == HOLE_BLOCK && piece.iter().all(|b| *b == 0) {
            file.write_all(&data[start..at])?;
            file.seek(SeekFrom::Current(HOLE_BLOCK as i64))?;
            start = at + n;
        }
        at += n;
        pos += n as u64;
    }
    file.write_all(&data[start..])
}

// ---- GET -------------------------------------------------------------------------------

/// How a `GET` (or another walk that sends) ended early.
#[derive(Debug)]
pub(crate) enum GetEnd {
    /// `FILE_ERROR`: kind, relative path, message.
    Failed(FileError, Vec<u8>, String),
    /// `DISCARD`: no frame at all.
    Discarded,
}

/// A `GET` of a fifo, socket or device.
fn not_a_file(rel: &[u8]) -> GetEnd {
    GetEnd::Failed(
        FileError::Invalid,
        rel.to_vec(),
        "not a regular file, directory or symbolic link".to_string(),
    )
}

/// Queues a `GET`'s `ENTRY` once the credit covers its payload.
fn send_entry(link: &Link, flow: &Flow, id: u32, e: &Entry) -> Result<(), GetEnd> {
    let mut enc = crate::proto::Enc::frame(crate::proto::ENTRY, id);
    e.encode(&mut enc);
    let frame = enc.finish();
    let cost = (frame.len() - HEADER) as u64;
    if flow.send(link, frame, cost) {
        Ok(())
    } else {
        Err(GetEnd::Discarded)
    }
}

/// What a file was when a `GET` sent it: a later name of the same (device, inode) is a
/// hard link to it only if it is still that file (an inode freed while the `GET` ran is
/// given to the next file made).
#[derive(PartialEq, Eq)]
struct Stamp {
    ctime: (i64, i64),
    mtime: (i64, i64),
    size: u64,
}

impl Stamp {
    fn of(md: &Metadata) -> Stamp {
        Stamp {
            ctime: (md.ctime(), md.ctime_nsec()),
            mtime: (md.mtime(), md.mtime_nsec()),
            size: md.len(),
        }
    }
}

/// An `ENTRY` for a `GET`.
pub(crate) fn entry_of(rel: &[u8], kind: u8, md: &Metadata, size: u64, link: Vec<u8>) -> Entry {
    Entry {
        path: rel.to_vec(),
        kind,
        mode: md.mode() & 0o7777,
        uid: md.uid(),
        gid: md.gid(),
        mtime: md.mtime(),
        size,
        link,
    }
}

/// Streams a path (and, for a directory, everything below it) to the host, `ENTRY`
/// and `STDOUT` payloads under the flow's credit. The path's directory is resolved by
/// [`resolve`]; the path itself and everything below it are never followed.
pub(crate) fn get_tree(link: &Link, id: u32, path: &[u8], flow: &Flow) -> Result<(), GetEnd> {
    let invalid = |m: &str| GetEnd::Failed(FileError::Invalid, Vec::new(), m.to_string());
    if path.first() != Some(&b'/') {
        return Err(invalid("the path must be absolute"));
    }
    let mut parts: Vec<&[u8]> = components(path).collect();
    let base = match parts.pop() {
        Some(b) if b != b".." => b,
        _ => return Err(invalid("the path has no base name")),
    };
    let parent =
        resolve(&[b"/".as_slice(), &parts.join(&b'/')].concat()).map_err(|(kind, msg)| {
            // Under a non-directory (`/etc/passwd/x`): there is no such path.
            let kind = if kind == FileError::NotDir {
                FileError::NotFound
            } else {
                kind
            };
            GetEnd::Failed(kind, Vec::new(), msg)
        })?;
    // The path asked for must exist (below it, what vanished is skipped).
    let (f, md) = cstr(base)
        .and_then(|n| open_in(&parent, &n, O_PATH))
        .and_then(|f| f.metadata().map(|m| (f, m)))
        .map_err(|e| walk_error(base, &e))?;
    drop(parent);
    let mut all = GetAll(Sender::new(link, flow, id));
    walk(&mut all, f, md, base.to_vec())
}

/// A `GET`'s walk: everything it meets.
struct GetAll<'a>(Sender<'a>);

impl Visit for GetAll<'_> {
    fn listed(&mut self, m: &Met<'_>, _: &mut Vec<Name>) -> Result<(), GetEnd> {
        self.0
            .entry(&entry_of(m.rel, DIRECTORY, m.md, 0, Vec::new()))
    }

    fn leaf(&mut self, m: &Met<'_>) -> Result<(), GetEnd> {
        self.0.leaf(m)
    }
}

/// What sends a walk's entries (and their files' data) to the host under a flow's
/// credit, as a `GET` does: multiply-linked files it sent are remembered for
/// [`HARDLINK`]s.
pub(crate) struct Sender<'a> {
    link: &'a Link,
    flow: &'a Flow,
    id: u32,
    buf: Vec<u8>,
    /// Multiply-linked files sent, by (device, inode): their path and what they were.
    links: Links<(u64, u64), (Vec<u8>, Stamp)>,
    /// Files marked [`LINK_TARGET`] so far.
    marked: usize,
}

impl<'a> Sender<'a> {
    /// Sends for the operation `id` through `link`, under `flow`.
    pub(crate) fn new(link: &'a Link, flow: &'a Flow, id: u32) -> Sender<'a> {
        Sender {
            link,
            flow,
            id,
            buf: vec![0u8; HEADER + CHUNK],
            links: Links::new(MAX_GET_LINKS),
            marked: 0,
        }
    }

    /// One `ENTRY` that has no data.
    pub(crate) fn entry(&mut self, e: &Entry) -> Result<(), GetEnd> {
        send_entry(self.link, self.flow, self.id, e)
    }

    /// An entry that is no directory: a symbolic link, a regular file (with its data, or
    /// as a hard link to a file sent before), a fifo; a socket or device below the start
    /// is skipped (it has no entry type), and is an error as the start itself.
    pub(crate) fn leaf(&mut self, m: &Met<'_>) -> Result<(), GetEnd> {
        let (rel, md, top) = (m.rel, m.md, m.top);
        let io_err = |e: &io::Error| walk_error(rel, e);
        let ft = md.file_type();
        if ft.is_symlink() {
            let target = sys::readlink_fd(m.f.as_fd()).map_err(|e| io_err(&e))?;
            return self.entry(&entry_of(rel, SYMLINK, md, 0, target));
        }
        if ft.is_fifo() && !top {
            return self.entry(&entry_of(rel, FIFO, md, 0, Vec::new()));
        }
        if !ft.is_file() {
            // The path asked for is a fifo, socket or device: nothing to copy. Below a
            // directory, sockets and devices have no entry type: skipped, as a file
            // removed before it was read.
            return if top { Err(not_a_file(rel)) } else { Ok(()) };
        }
        let mut f = reopen(m.f, sys::O_NONBLOCK_OPEN).map_err(|e| io_err(&e))?;
        let md = f.metadata().map_err(|e| io_err(&e))?;
        if !md.is_file() {
            return if top { Err(not_a_file(rel)) } else { Ok(()) };
        }
        // Another name of a file this walk sent (what was sent: the inode of the
        // descriptor read, not of a name looked up again), still that file: an inode
        // whose every name went while the walk ran can be another file's now.
        let key = (md.dev(), md.ino());
        let stamp = Stamp::of(&md);
        if md.nlink() > 1
            && let Some((first, was)) = self.links.map.get(&key)
            && *was == stamp
        {
            let e = entry_of(rel, HARDLINK, &md, 0, first.clone());
            return self.entry(&e);
        }
        let size = md.len();
        let mut e = entry_of(rel, REGULAR, &md, size, Vec::new());
        // At most MAX_GET_LINKS marks in all (the host's bound), whatever replaced.
        if md.nlink() > 1
            && self.marked < MAX_GET_LINKS
            && self.links.remember(key, (rel.to_vec(), stamp), rel.len())
        {
            e.mode |= LINK_TARGET;
            self.marked += 1;
        } else {
            self.links.map.remove(&key);
        }
        self.entry(&e)?;
        let mut left = size;
        let mut eof = false;
        let buf = &mut self.buf;
        while left > 0 {
            let credit = self.flow.wait_credit(1).ok_or(GetEnd::Discarded)?;
            let want = (CHUNK as u64).min(left).min(credit) as usize;
            let mut got = 0;
            while !eof && got < want {
                match f.read(&mut buf[HEADER + got..HEADER + want]) {
                    Ok(0) => eof = true,
                    Ok(m) => got += m,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return Err(io_err(&e)),
                }
            }
            if eof {
                // The file shrank while it was read: its `ENTRY` announced more than
                // there is. An error naming it, never zeros in its place.
                let read = size - left + got as u64;
                return Err(GetEnd::Failed(
                    FileError::Other,
                    rel.to_vec(),
                    format!("the file shrank while it was read ({read} of its {size} bytes)"),
                ));
            }
            let frame = data_frame(buf, STDOUT, self.id, want);
            if !self.flow.send(self.link, frame, want as u64) {
                return Err(GetEnd::Discarded);
            }
            left -= want as u64;
        }
        Ok(())
    }
}

// ---- The walk (GET, BASE, LAYER) -------------------------------------------------------

/// The longest path below its start a walk goes to, in bytes.
const MAX_WALK_PATH: usize = 1 << 20;
/// What a walk holds at most of the names of the directories it is inside of (each name
/// counts its length and [`NAME_COST`]).
const MAX_WALK_NAMES: usize = 128 << 20;
/// What a name held by a walk costs besides its bytes.
const NAME_COST: usize = 32;

/// One entry a walk met: its path relative to the walk's start (`/`-separated; empty
/// for the start of a walk of a whole tree), an `O_PATH` descriptor of it (never a link
/// followed) and that descriptor's metadata.
pub(crate) struct Met<'a> {
    pub(crate) rel: &'a [u8],
    pub(crate) f: &'a File,
    pub(crate) md: &'a Metadata,
    /// The walk's start.
    pub(crate) top: bool,
}

/// A name in a directory being walked.
pub(crate) struct Name {
    pub(crate) name: Vec<u8>,
    /// False when the listing said it is no directory (a walk that needs no
    /// [`Visit::leaf`] then never opens it).
    pub(crate) maybe_dir: bool,
    /// True when the listing said it is a socket or a device (no entry type of a
    /// `GET`'s).
    pub(crate) special: bool,
}

/// What a walk does with what it meets.
pub(crate) trait Visit {
    /// Whether [`Visit::leaf`] is wanted; false: a name the listing says is no directory
    /// is not even opened.
    fn leaves(&self) -> bool {
        true
    }

    /// A directory below the start, met: whether to list it and walk into it.
    fn enter(&mut self, _: &Met<'_>) -> Result<bool, GetEnd> {
        Ok(true)
    }

    /// A directory listed (`names` sorted): what is left in `names` is walked, in order.
    fn listed(&mut self, m: &Met<'_>, names: &mut Vec<Name>) -> Result<(), GetEnd>;

    /// Anything but a directory.
    fn leaf(&mut self, m: &Met<'_>) -> Result<(), GetEnd>;
}

/// A walk's failure at `rel`.
fn walk_error(rel: &[u8], e: &io::Error) -> GetEnd {
    let kind = match e.raw_os_error() {
        Some(ENOTDIR) => FileError::NotFound,
        _ => file_error_kind(e),
    };
    GetEnd::Failed(kind, rel.to_vec(), e.to_string())
}

/// What a walk holds for a name.
fn name_cost(n: &Name) -> usize {
    n.name.len() + NAME_COST
}

/// Lists the directory `f` describes through that descriptor (never its name again),
/// sorted; a listing that fails partway is an error, never a shorter directory; more
/// than `budget` (see [`name_cost`]) is an error.
fn list(f: &File, rel: &[u8], budget: usize) -> Result<Vec<Name>, GetEnd> {
    let fail = |e: io::Error| walk_error(rel, &e);
    let mut names = Vec::new();
    let mut cost = 0usize;
    for e in fs::read_dir(format!("/proc/self/fd/{}", f.as_raw_fd())).map_err(fail)? {
        let e = e.map_err(fail)?;
        let ft = e.file_type();
        let n = Name {
            maybe_dir: !ft.as_ref().is_ok_and(|t| !t.is_dir()),
            special: ft.is_ok_and(|t| t.is_socket() || t.is_block_device() || t.is_char_device()),
            name: e.file_name().into_encoded_bytes(),
        };
        cost = cost.saturating_add(name_cost(&n));
        if cost > budget {
            return Err(GetEnd::Failed(
                FileError::Other,
                rel.to_vec(),
                format!(
                    "more names than a walk holds at once ({} MiB of names)",
                    MAX_WALK_NAMES >> 20
                ),
            ));
        }
        names.push(n);
    }
    names.sort_unstable_by(|a, b| a.name.cmp(&b.name));
    Ok(names)
}

/// A directory a walk is inside of.
struct Level {
    dir: File,
    /// The names still to walk, the next one last.
    names: Vec<Name>,
    /// The length of its path.
    len: usize,
}

/// Walks from `start` (what `rel` names, opened `O_PATH`, with its metadata) depth
/// first, each directory's names in order, telling `v` what it meets. Every entry is
/// opened from its directory's held descriptor with nothing followed; one removed before
/// it was opened is skipped. Bounded: the path ([`MAX_WALK_PATH`]), the names held
/// ([`MAX_WALK_NAMES`]) and the depth ([`MAX_WALK_DEPTH`]: a descriptor is held per
/// directory it is inside of).
pub(crate) fn walk(
    v: &mut impl Visit,
    start: File,
    md: Metadata,
    mut rel: Vec<u8>,
) -> Result<(), GetEnd> {
    let met = Met {
        rel: &rel,
        f: &start,
        md: &md,
        top: true,
    };
    if !md.is_dir() {
        return v.leaf(&met);
    }
    let mut held = 0usize;
    let mut stack: Vec<Level> = Vec::new();
    let mut names = list(&start, &rel, MAX_WALK_NAMES)?;
    v.listed(&met, &mut names)?;
    held += names.iter().map(name_cost).sum::<usize>();
    names.reverse();
    let len = rel.len();
    stack.push(Level {
        dir: start,
        names,
        len,
    });
    while let Some(level) = stack.last_mut() {
        let Some(n) = level.names.pop() else {
            stack.pop();
            continue;
        };
        held -= name_cost(&n);
        rel.truncate(level.len);
        if !rel.is_empty() {
            rel.push(b'/');
        }
        rel.extend_from_slice(&n.name);
        if rel.len() > MAX_WALK_PATH {
            return Err(GetEnd::Failed(
                FileError::Other,
                rel[..256].to_vec(),
                format!("a path longer than a walk goes ({MAX_WALK_PATH} bytes)"),
            ));
        }
        if !n.maybe_dir && !v.leaves() {
            continue;
        }
        let found = cstr(&n.name)
            .and_then(|c| open_in(&level.dir, &c, O_PATH))
            .and_then(|f| f.metadata().map(|m| (f, m)));
        let (f, md) = match found {
            Ok(x) => x,
            // Removed while we walked: skipped.
            Err(e) if e.kind() == ErrorKind::NotFound => continue,
            Err(e) => return Err(walk_error(&rel, &e)),
        };
        let met = Met {
            rel: &rel,
            f: &f,
            md: &md,
            top: false,
        };
        if !md.is_dir() {
            v.leaf(&met)?;
            continue;
        }
        if !v.enter(&met)? {
            continue;
        }
        if stack.len() >= MAX_WALK_DEPTH {
            return Err(GetEnd::Failed(
                FileError::Other,
                rel[..rel.len().min(4096)].to_vec(),
                format!("directories nested deeper than a walk goes ({MAX_WALK_DEPTH} levels)"),
            ));
        }
        let mut names = list(&f, &rel, MAX_WALK_NAMES - held)?;
        v.listed(&met, &mut names)?;
        held += names.iter().map(name_cost).sum::<usize>();
        names.reverse();
        stack.push(Level {
            dir: f,
            names,
            len: rel.len(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::io::Write;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::symlink;
    use std::path::Path;

    use super::*;
    use crate::testing::TempDir;

    fn parts(path: &str) -> Vec<&str> {
        components(path.as_bytes())
            .map(|c| std::str::from_utf8(c).unwrap())
            .collect()
    }

    #[test]
    fn components_skip_empty_and_dot_but_keep_dot_dot() {
        assert_eq!(parts("/a/b/c"), ["a", "b", "c"]);
        assert_eq!(parts("//a/./b//"), ["a", "b"]);
        assert_eq!(parts("a/../b"), ["a", "..", "b"]);
        assert_eq!(parts(".../.x/x."), ["...", ".x", "x."]);
        assert!(parts("/").is_empty());
        assert!(parts("").is_empty());
        assert!(parts("./.").is_empty());
        let rev: Vec<&[u8]> = components(b"/a/b").rev().collect();
        assert_eq!(rev, [&b"b"[..], b"a"]);
    }

    #[test]
    fn temp_names_are_unique_and_unpredictable_looking() {
        const PREFIX: &str = ".runcell-tmp-";
        let names: Vec<String> = (0..2000)
            .map(|_| temp_name().into_string().unwrap())
            .collect();
        let unique: HashSet<&String> = names.iter().collect();
        assert_eq!(unique.len(), names.len());
        for n in &names {
            let hex = n.strip_prefix(PREFIX).expect(n);
            assert_eq!(hex.len(), 16, "{n}");
            assert!(hex.bytes().all(|b| b.is_ascii_hexdigit()), "{n}");
        }
        // Not a counter: every hex digit varies, the first as much as the last, and
        // consecutive names differ in most digits.
        for pos in 0..16 {
            let seen: HashSet<u8> = names
                .iter()
                .map(|n| n.as_bytes()[PREFIX.len() + pos])
                .collect();
            assert!(seen.len() >= 12, "digit {pos}: {} values", seen.len());
        }
        let same = names
            .windows(2)
            .map(|w| {
                w[0].bytes()
                    .zip(w[1].bytes())
                    .filter(|(a, b)| a == b)
                    .count()
            })
            .max()
            .unwrap();
        assert!(same < PREFIX.len() + 12, "{same} equal characters");
    }

    #[test]
    fn create_temp_tries_a_fresh_name_while_one_is_taken() {
        let mut taken = 0;
        let (name, value) = create_temp(|n| {
            if taken < 3 {
                taken += 1;
                Err(io::Error::from(ErrorKind::AlreadyExists))
            } else {
                Ok(n.to_owned())
            }
        })
        .unwrap();
        assert_eq!((taken, &name), (3, &value));
        let e =
            create_temp(|_| -> io::Result<()> { Err(io::Error::from(ErrorKind::AlreadyExists)) })
                .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::AlreadyExists);
        let mut calls = 0;
        let e = create_temp(|_| -> io::Result<()> {
            calls += 1;
            Err(io::Error::from(ErrorKind::PermissionDenied))
        })
        .unwrap_err();
        assert_eq!((e.kind(), calls), (ErrorKind::PermissionDenied, 1));
    }

    /// Writes `pieces` (offset, data) with `write_sparse` into a new file of `len` bytes:
    /// the file's contents and its allocated bytes.
    fn sparse(dir: &TempDir, name: &str, len: u64, pieces: &[&[u8]]) -> (Vec<u8>, u64) {
        let path = dir.join(name);
        let mut f = File::create(&path).unwrap();
        let mut pos = 0;
        for p in pieces {
            write_sparse(&mut f, pos, p).unwrap();
            pos += p.len() as u64;
        }
        f.set_len(len).unwrap();
        f.flush().unwrap();
        drop(f);
        (
            fs::read(&path).unwrap(),
            fs::metadata(&path).unwrap().blocks() * 512,
        )
    }

    #[test]
    fn write_sparse_leaves_whole_blocks_of_zeros_as_holes() {
        let dir = TempDir::new();
        let b = HOLE_BLOCK as usize;
        // Data, 64 blocks of zeros, data, 64 blocks of zeros at the end.
        let mut data = vec![1u8; 100];
        data.resize(100 + 64 * b, 0);
        data.extend_from_slice(&[2u8; 10]);
        data.resize(data.len() + 64 * b, 0);
        let (got, allocated) = sparse(&dir, "holes", data.len() as u64, &[&data]);
        assert!(got == data, "the contents changed");
        assert!(
            allocated < 16 * HOLE_BLOCK,
            "{allocated} bytes allocated for {}",
            data.len()
        );

        // The same data in unaligned pieces (as `STDIN` frames cut it): the same file,
        // with a hole at each whole block inside a piece.
        let pieces: Vec<&[u8]> = data.chunks(16 * b + 100).collect();
        let (got, allocated) = sparse(&dir, "pieces", data.len() as u64, &pieces);
        assert!(got == data, "the contents changed");
        assert!(allocated < 32 * HOLE_BLOCK, "{allocated} bytes allocated");
        // Pieces smaller than a block hold no whole block: all written, still the same.
        let pieces: Vec<&[u8]> = data.chunks(b / 3 + 7).collect();
        let (got, _) = sparse(&dir, "small", data.len() as u64, &pieces);
        assert!(got == data, "the contents changed");

        // Zeros that fill no whole aligned block are written.
        let zeros = vec![0u8; b - 1];
        let (got, _) = sparse(&dir, "short", zeros.len() as u64, &[&zeros]);
        assert_eq!(got, zeros);
        // Data everywhere: nothing skipped.
        let full = vec![3u8; 8 * b + 5];
        let (got, allocated) = sparse(&dir, "full", full.len() as u64, &[&full]);
        assert_eq!(got, full);
        assert!(allocated >= 8 * HOLE_BLOCK);
    }

    #[test]
    fn write_sparse_seeks_only_over_aligned_blocks() {
        let dir = TempDir::new();
        let b = HOLE_BLOCK as usize;
        // Starting mid-block: the zeros up to the next boundary are written, the whole
        // block after them is skipped, the rest written again.
        let mut data = vec![0u8; b - 10 + b];
        data.extend_from_slice(b"tail");
        let path = dir.join("mid");
        let mut f = File::create(&path).unwrap();
        f.write_all(&[9u8; 10]).unwrap();
        write_sparse(&mut f, 10, &data).unwrap();
        drop(f);
        let got = fs::read(&path).unwrap();
        assert_eq!(got.len(), 10 + data.len());
        assert_eq!(&got[..10], &[9u8; 10]);
        assert!(got[10..] == data[..]);
    }

    fn resolved_ino(path: &Path) -> Result<u64, (FileError, String)> {
        resolve(path.as_os_str().as_bytes()).map(|f| f.metadata().unwrap().ino())
    }

    #[test]
    fn resolve_follows_links_only_in_directories_only_root_can_change() {
        let dir = TempDir::new();
        fs::create_dir(dir.join("target")).unwrap();
        fs::create_dir(dir.join("trusted")).unwrap();
        symlink("../target", dir.join("trusted/link")).unwrap();
        symlink(dir.join("target"), dir.join("trusted/abs")).unwrap();
        let target = fs::metadata(dir.join("target")).unwrap().ino();
        fs::set_permissions(dir.join("trusted"), Permissions::from_mode(0o755)).unwrap();
        assert_eq!(resolved_ino(&dir.join("trusted/link")), Ok(target));
        assert_eq!(resolved_ino(&dir.join("trusted/abs")), Ok(target));
        assert_eq!(
            resolved_ino(&dir.join("trusted/link/../target")),
            Ok(target)
        );
        // Writable by others: a link there is refused, never followed.
        fs::set_permissions(dir.join("trusted"), Permissions::from_mode(0o777)).unwrap();
        let (kind, msg) = resolved_ino(&dir.join("trusted/link")).unwrap_err();
        assert_eq!(kind, FileError::Untrusted);
        assert!(msg.contains("/trusted/link is a symbolic link"), "{msg}");
        // A directory itself is fine there.
        assert_eq!(resolved_ino(&dir.join("trusted/..")).map(|_| ()), Ok(()));
    }

    #[test]
    fn resolve_refuses_relative_paths_loops_and_missing_names() {
        let dir = TempDir::new();
        assert_eq!(resolve(b"relative").unwrap_err().0, FileError::Invalid);
        assert_eq!(resolve(b"").unwrap_err().0, FileError::Invalid);
        assert_eq!(resolved_ino(Path::new("/")).map(|_| ()), Ok(()));
        fs::set_permissions(dir.path(), Permissions::from_mode(0o755)).unwrap();
        symlink("loop", dir.join("loop")).unwrap();
        let (kind, msg) = resolved_ino(&dir.join("loop")).unwrap_err();
        assert_eq!(kind, FileError::Other);
        assert!(msg.contains("symbolic links"), "{msg}");
        assert_eq!(
            resolved_ino(&dir.join("missing/x")).unwrap_err().0,
            FileError::NotFound
        );
        fs::write(dir.join("file"), "").unwrap();
        assert_eq!(
            resolved_ino(&dir.join("file/x")).unwrap_err().0,
            FileError::NotDir
        );
    }

    fn entry(path: &str, kind: u8, mode: u32, link: &str) -> Entry {
        let (uid, gid, _) = sys::ids();
        Entry {
            path: path.as_bytes().to_vec(),
            kind,
            mode,
            uid,
            gid,
            mtime: 1_600_000_000,
            size: 0,
            link: link.as_bytes().to_vec(),
        }
    }

    #[test]
    fn a_put_creates_directories_links_and_empty_files_and_refuses_bad_paths() {
        let dir = TempDir::new();
        let mut put = Put::start(dir.path().as_os_str().as_bytes()).unwrap();
        put.apply(false, entry("d", DIRECTORY, 0o750, "")).unwrap();
        put.apply(false, entry("d/l", SYMLINK, 0o777, "../x"))
            .unwrap();
        put.apply(false, entry("d/empty", REGULAR, 0o604, ""))
            .unwrap();
        assert!(put.file.is_none());
        let md = fs::metadata(dir.join("d")).unwrap();
        assert!(md.is_dir());
        assert_eq!(md.mode() & 0o7777, 0o750);
        assert_eq!(fs::read_link(dir.join("d/l")).unwrap(), Path::new("../x"));
        let md = fs::metadata(dir.join("d/empty")).unwrap();
        assert_eq!(
            (md.len(), md.mode() & 0o7777, md.mtime()),
            (0, 0o604, 1_600_000_000)
        );
        // A link is replaced by a file; a directory is never replaced.
        put.apply(false, entry("d/l", REGULAR, 0o600, "")).unwrap();
        assert!(fs::symlink_metadata(dir.join("d/l")).unwrap().is_file());
        let (kind, rel, _) = put
            .apply(false, entry("d", REGULAR, 0o600, ""))
            .unwrap_err();
        assert_eq!((kind, rel), (FileError::IsDir, b"d".to_vec()));
        // A link where a directory is expected is never followed.
        symlink(dir.path(), dir.join("d/up")).unwrap();
        let (kind, _, _) = put
            .apply(false, entry("d/up/x", REGULAR, 0o600, ""))
            .unwrap_err();
        assert_eq!(kind, FileError::NotDir);
        for bad in ["", "/abs", "a//b", "./a", "a/..", "a/."] {
            let (kind, _, _) = put
                .apply(false, entry(bad, REGULAR, 0o600, ""))
                .unwrap_err();
            assert_eq!(kind, FileError::Invalid, "{bad:?}");
        }
        let (kind, _, _) = put.apply(false, entry("t", 9, 0o600, "")).unwrap_err();
        assert_eq!(kind, FileError::Invalid);
        // Nothing temporary is left behind.
        let names: Vec<_> = fs::read_dir(dir.join("d"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert!(
            names.iter().all(|n| !n.starts_with(".runcell-tmp-")),
            "{names:?}"
        );
    }
}
