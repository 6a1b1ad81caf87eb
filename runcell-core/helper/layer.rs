//! `BASE` and `LAYER` (version 6; `proto.rs`, "Snapshot layers"): the run's base
//! listing, and what changed in the root filesystem since, as the entries of an OCI
//! image layer (whiteouts included).
//!
//! Both walk the root filesystem with [`files::walk`]: from a held descriptor of `/`,
//! every entry opened from its directory's descriptor with nothing followed, each name
//! looked up once. What changed is told by change times (`st_ctime`), which no user can
//! set back. The base listing lives in the daemon's directory, where code that runs as
//! the helper's user can write: it is read bounded and checked, and all it can choose is
//! which names of a changed directory come out as whiteouts.

use std::collections::HashSet;
use std::fs::{File, Metadata};
use std::io::{self, BufWriter, ErrorKind, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::files::{
    self, GetEnd, Met, Name, Sender, Visit, components, create_temp, cstr, entry_of, open_in,
};
use crate::proto::{
    BASE_FILE, BASE_MARGIN_SECS, DAEMON_DIR, DIRECTORY, Entry, FileError, HELPER_DIR,
    MAX_BASE_BYTES, MAX_BASE_NAMES, REGULAR,
};
use crate::sys::{self, O_CLOEXEC, O_CREAT, O_EXCL, O_NOFOLLOW, O_PATH, O_WRONLY};
use crate::{daemon, file_error_kind, lock};

/// The base listing's first line, up to T0.
const MAGIC: &[u8] = b"runcell-base 2 ";
/// The longest first line.
const MAX_HEADER: usize = 64;
/// The most of `/proc/self/mountinfo` read.
const MAX_MOUNTINFO: u64 = 16 << 20;
/// The prefix of a whiteout's name.
const WHITEOUT: &[u8] = b".wh.";
/// The opaque whiteout: the directory it is in hides what lower layers hold in it.
const OPAQUE: &[u8] = b".wh..wh..opq";
/// Paths below `/` never walked (besides mount points and the helper's directories).
const SYSTEM: [&str; 3] = ["proc", "sys", "dev"];

/// One `BASE` at a time in this process (another that comes meanwhile then finds the
/// listing made).
static RECORDING: Mutex<()> = Mutex::new(());

/// A failure of the operation as a whole (no entry to name).
fn failed(kind: FileError, msg: impl Into<String>) -> GetEnd {
    GetEnd::Failed(kind, Vec::new(), msg.into())
}

/// `rel`/`name` (`name` alone below the root) into `buf`.
fn join<'b>(buf: &'b mut Vec<u8>, rel: &[u8], name: &[u8]) -> &'b [u8] {
    buf.clear();
    buf.extend_from_slice(rel);
    if !rel.is_empty() {
        buf.push(b'/');
    }
    buf.extend_from_slice(name);
    buf
}

/// A name a directory may hold: not empty, `.` or `..`, no `/` (nor NUL).
fn plain_name(n: &[u8]) -> bool {
    !n.is_empty() && n != b"." && n != b".." && !n.contains(&b'/') && !n.contains(&0)
}

/// An absolute path (of the root filesystem) as the walks name it: relative to `/`,
/// plain components; `None` for one with `..` or that is not absolute.
fn relative(path: &[u8]) -> Option<Vec<u8>> {
    if path.first() != Some(&b'/') {
        return None;
    }
    let parts: Vec<&[u8]> = components(path).collect();
    parts.iter().all(|c| *c != b"..").then(|| parts.join(&b'/'))
}

// ---- What is skipped ---------------------------------------------------------------------

/// What `BASE` and `LAYER` never walk (nor list as names, nor send), with everything
/// below it: paths relative to the root walked.
pub(crate) struct Skips {
    fixed: HashSet<Vec<u8>>,
    mounts: HashSet<Vec<u8>>,
}

impl Skips {
    /// `fixed` paths and the mount points `mounts` (relative to the root walked).
    pub(crate) fn new(
        fixed: impl IntoIterator<Item = Vec<u8>>,
        mounts: impl IntoIterator<Item = Vec<u8>>,
    ) -> Skips {
        let keep = |p: &Vec<u8>| !p.is_empty();
        Skips {
            fixed: fixed.into_iter().filter(keep).collect(),
            mounts: mounts.into_iter().filter(keep).collect(),
        }
    }

    /// The root filesystem's: `/proc`, `/sys`, `/dev`, [`HELPER_DIR`], the daemon's
    /// directory beside this executable, and every mount point of this process's mount
    /// namespace but `/`.
    fn system() -> Result<Skips, GetEnd> {
        let mut fixed: Vec<Vec<u8>> = SYSTEM.iter().map(|p| p.as_bytes().to_vec()).collect();
        fixed.extend(relative(HELPER_DIR.as_bytes()));
        if let Ok((_, dir)) = daemon::exe_and_dir() {
            fixed.extend(relative(
                dir.join(DAEMON_DIR).as_os_str().as_encoded_bytes(),
            ));
        }
        let mut text = Vec::new();
        File::open("/proc/self/mountinfo")
            .and_then(|f| f.take(MAX_MOUNTINFO + 1).read_to_end(&mut text))
            .map_err(|e| failed(file_error_kind(&e), format!("/proc/self/mountinfo: {e}")))?;
        if text.len() as u64 > MAX_MOUNTINFO {
            return Err(failed(
                FileError::Other,
                "/proc/self/mountinfo is larger than the helper reads",
            ));
        }
        Ok(Skips::new(fixed, mount_points(&text)))
    }

    /// Whether `rel` is skipped.
    fn has(&self, rel: &[u8]) -> bool {
        self.fixed.contains(rel) || self.mounts.contains(rel)
    }
}

/// The mount points (field 5) of a `mountinfo` text, relative to `/` (`/` itself left
/// out), octal escapes (`\040`) decoded.
fn mount_points(text: &[u8]) -> Vec<Vec<u8>> {
    text.split(|&b| b == b'\n')
        .filter_map(|line| line.split(|&b| b == b' ').nth(4))
        .filter_map(|field| relative(&unescape(field)))
        .filter(|rel| !rel.is_empty())
        .collect()
}

/// A `mountinfo` field with its `\ooo` escapes decoded.
fn unescape(field: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(field.len());
    let mut i = 0;
    while i < field.len() {
        let octal = field
            .get(i + 1..i + 4)
            .filter(|d| field[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)))
            .and_then(|d| {
                let v = d.iter().fold(0u32, |v, c| v * 8 + u32::from(c - b'0'));
                u8::try_from(v).ok()
            });
        match octal {
            Some(b) => {
                out.push(b);
                i += 4;
            }
            None => {
                out.push(field[i]);
                i += 1;
            }
        }
    }
    out
}

// ---- The base listing --------------------------------------------------------------------

/// A directory of a base listing: its path's and its names' ranges in the listing's
/// data (each name ended by a NUL), and its (device, inode).
struct BaseDir {
    path: (u32, u32),
    names: (u32, u32),
    id: (u64, u64),
}

/// A base listing, read back: T0 and, per directory, its (device, inode) and the names
/// it held.
pub(crate) struct Base {
    /// T0: seconds and nanoseconds since the epoch.
    t0: (i64, i64),
    data: Vec<u8>,
    /// Per directory, sorted by path.
    dirs: Vec<BaseDir>,
}

impl Base {
    /// Parses a listing (untrusted: the run's code may have written it).
    pub(crate) fn parse(data: Vec<u8>) -> Result<Base, String> {
        if data.len() as u64 > MAX_BASE_BYTES {
            return Err(format!("larger than {} MiB", MAX_BASE_BYTES >> 20));
        }
        let nl = data
            .iter()
            .take(MAX_HEADER)
            .position(|&b| b == b'\n')
            .ok_or("no header line")?;
        let t0 = data[..nl]
            .strip_prefix(MAGIC)
            .and_then(|t| std::str::from_utf8(t).ok())
            .and_then(|t| t.split_once(' '))
            .and_then(|(s, n)| Some((s.parse::<i64>().ok()?, n.parse::<i64>().ok()?)))
            .filter(|(_, n)| (0..1_000_000_000).contains(n))
            .ok_or("not a base listing of version 2")?;
        let nul = |from: usize| data[from..].iter().position(|&b| b == 0).map(|i| from + i);
        let mut dirs = Vec::new();
        let mut count = 0usize;
        let mut at = nl + 1;
        while at < data.len() {
            let end = nul(at).ok_or("it ends inside a directory's path")?;
            let path = &data[at..end];
            if !path.is_empty() && !path.split(|&b| b == b'/').all(plain_name) {
                return Err(format!(
                    "a directory path that is not plain: {:?}",
                    String::from_utf8_lossy(path)
                ));
            }
            let id_end = nul(end + 1).ok_or("it ends inside a directory's inode")?;
            let id = std::str::from_utf8(&data[end + 1..id_end])
                .ok()
                .and_then(|t| t.split_once(' '))
                .and_then(|(d, i)| Some((d.parse::<u64>().ok()?, i.parse::<u64>().ok()?)))
                .ok_or("a directory's device and inode are not two numbers")?;
            let first = id_end + 1;
            let mut i = first;
            let mut prev: Option<(usize, usize)> = None;
            loop {
                let e = nul(i).ok_or("it ends inside a directory's names")?;
                if e == i {
                    break;
                }
                let name = &data[i..e];
                if !plain_name(name) || name.starts_with(WHITEOUT) {
                    return Err(format!(
                        "a name that is not plain or looks like a whiteout: {:?}",
                        String::from_utf8_lossy(name)
                    ));
                }
                // Sorted, each once: as the helper writes them.
                if prev.is_some_and(|(a, b)| data[a..b] >= *name) {
                    return Err(format!(
                        "names out of order or listed twice: {:?}",
                        String::from_utf8_lossy(name)
                    ));
                }
                prev = Some((i, e));
                i = e + 1;
                count += 1;
            }
            count += 1;
            if count > MAX_BASE_NAMES {
                return Err(format!("more than {MAX_BASE_NAMES} names"));
            }
            // Within MAX_BASE_BYTES: every offset fits.
            dirs.push(BaseDir {
                path: (at as u32, end as u32),
                names: (first as u32, i as u32),
                id,
            });
            at = i + 1;
        }
        let path = |d: &BaseDir| &data[d.path.0 as usize..d.path.1 as usize];
        dirs.sort_unstable_by(|a, b| path(a).cmp(path(b)));
        if dirs.windows(2).any(|w| path(&w[0]) == path(&w[1])) {
            return Err("a directory listed twice".into());
        }
        Ok(Base { t0, data, dirs })
    }

    /// The directory `rel`, if the listing has it.
    fn dir(&self, rel: &[u8]) -> Option<&BaseDir> {
        let data = &self.data;
        let i = self
            .dirs
            .binary_search_by(|d| data[d.path.0 as usize..d.path.1 as usize].cmp(rel))
            .ok()?;
        Some(&self.dirs[i])
    }

    /// The (device, inode) the directory `rel` was, if the listing has it.
    fn id(&self, rel: &[u8]) -> Option<(u64, u64)> {
        self.dir(rel).map(|d| d.id)
    }

    /// The names the directory `rel` held, if the listing has it.
    fn names(&self, rel: &[u8]) -> Option<impl Iterator<Item = &[u8]>> {
        let data = &self.data;
        let (from, to) = self.dir(rel)?.names;
        Some(
            data[from as usize..to as usize]
                .split(|&b| b == 0)
                .filter(|n| !n.is_empty()),
        )
    }
}

/// `BASE`'s walk: writes each directory's path, (device, inode) and names (but those
/// that look like whiteouts: no layer can carry them, nor a base listing).
struct Record<W: Write> {
    out: W,
    skips: Skips,
    root_dev: u64,
    bytes: u64,
    count: usize,
    scratch: Vec<u8>,
}

impl<W: Write> Visit for Record<W> {
    fn leaves(&self) -> bool {
        false
    }

    /// Another file system than `/` is not walked (a mount point moved while the walk
    /// ran, say); its name is listed.
    fn enter(&mut self, m: &Met<'_>) -> Result<bool, GetEnd> {
        Ok(m.md.dev() == self.root_dev)
    }

    fn listed(&mut self, m: &Met<'_>, names: &mut Vec<Name>) -> Result<(), GetEnd> {
        let (skips, scratch) = (&self.skips, &mut self.scratch);
        names.retain(|n| !skips.has(join(scratch, m.rel, &n.name)));
        let id = format!("{} {}\0", m.md.dev(), m.md.ino());
        self.count += 1 + names.len();
        self.bytes +=
            (m.rel.len() + 2 + id.len() + names.iter().map(|n| n.name.len() + 1).sum::<usize>())
                as u64;
        if self.count > MAX_BASE_NAMES || self.bytes > MAX_BASE_BYTES {
            return Err(GetEnd::Failed(
                FileError::Other,
                m.rel.to_vec(),
                format!(
                    "the root filesystem holds more than a base listing does ({MAX_BASE_NAMES} names, {} MiB)",
                    MAX_BASE_BYTES >> 20
                ),
            ));
        }
        let write = |out: &mut W| -> io::Result<()> {
            out.write_all(m.rel)?;
            out.write_all(&[0])?;
            out.write_all(id.as_bytes())?;
            for n in names.iter().filter(|n| !n.name.starts_with(WHITEOUT)) {
                out.write_all(&n.name)?;
                out.write_all(&[0])?;
            }
            out.write_all(&[0])
        };
        write(&mut self.out).map_err(|e| write_failed(&e))
    }

    fn leaf(&mut self, _: &Met<'_>) -> Result<(), GetEnd> {
        Ok(())
    }
}

fn write_failed(e: &io::Error) -> GetEnd {
    failed(
        file_error_kind(e),
        format!("cannot write the base listing: {e}"),
    )
}

/// Opens the directory `root` (absolute) names and its metadata.
fn open_root(root: &[u8]) -> Result<(File, Metadata), GetEnd> {
    let f = files::resolve(root).map_err(|(kind, msg)| failed(kind, msg))?;
    let md = f
        .metadata()
        .map_err(|e| failed(file_error_kind(&e), e.to_string()))?;
    if !md.is_dir() {
        return Err(failed(FileError::NotDir, "the root is not a directory"));
    }
    Ok((f, md))
}

/// Records the base listing of the tree at `root` (absolute; `/` but in tests) with
/// `t0` in `dir` (the daemon's directory), unless one is there already.
pub(crate) fn record(dir: &File, root: &[u8], skips: Skips, t0: (i64, i64)) -> Result<(), GetEnd> {
    let _one = lock(&RECORDING);
    let name = cstr(BASE_FILE.as_bytes()).map_err(|e| write_failed(&e))?;
    match open_in(dir, &name, O_PATH) {
        // Taken once: later, the run's code has changed files.
        Ok(_) => return Ok(()),
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(write_failed(&e)),
    }
    let (root, md) = open_root(root)?;
    let flags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
    let (tmp, file) = create_temp(|t| sys::openat(Some(dir.as_fd()), t, flags, 0o600))
        .map_err(|e| write_failed(&e))?;
    let file = File::from(file);
    let done = (|| {
        let mut out = BufWriter::with_capacity(256 * 1024, &file);
        out.write_all(format!("runcell-base 2 {} {}\n", t0.0, t0.1).as_bytes())
            .map_err(|e| write_failed(&e))?;
        let mut rec = Record {
            out,
            skips,
            root_dev: md.dev(),
            bytes: 0,
            count: 0,
            scratch: Vec::new(),
        };
        files::walk(&mut rec, root, md, Vec::new())?;
        rec.out.flush().map_err(|e| write_failed(&e))?;
        drop(rec);
        file.sync_all().map_err(|e| write_failed(&e))?;
        // Under its name only when whole, and never over another (one made meanwhile by
        // another process is kept).
        match sys::linkat(dir.as_fd(), &tmp, dir.as_fd(), &name) {
            Err(e) if e.kind() != ErrorKind::AlreadyExists => Err(write_failed(&e)),
            _ => Ok(()),
        }
    })();
    let _ = sys::unlinkat(dir.as_fd(), &tmp);
    done
}

/// T0 of a `BASE` taken now: [`BASE_MARGIN_SECS`] earlier.
fn t0_now() -> Result<(i64, i64), GetEnd> {
    SystemTime::now()
        .checked_sub(Duration::from_secs(BASE_MARGIN_SECS))
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| (d.as_secs() as i64, i64::from(d.subsec_nanos())))
        .ok_or_else(|| failed(FileError::Other, "the clock is before 1970"))
}

/// Reads the base listing in `dir`.
pub(crate) fn read_base(dir: &File) -> Result<Base, GetEnd> {
    let name = cstr(BASE_FILE.as_bytes()).map_err(|e| write_failed(&e))?;
    let malformed = |why: String| {
        failed(
            FileError::Other,
            format!("the run's base listing is malformed: {why}"),
        )
    };
    // Non-blocking: a fifo put in its place must not hold the walk up.
    let f = match open_in(dir, &name, sys::O_RDONLY | sys::O_NONBLOCK_OPEN) {
        Ok(f) => f,
        Err(e) if e.kind() == ErrorKind::NotFound => {
            return Err(failed(
                FileError::Other,
                "the run has no base listing (it is recorded when the run is created, before any command runs, for drivers whose snapshots need it; was it removed?)",
            ));
        }
        Err(e) => {
            return Err(failed(
                file_error_kind(&e),
                format!("the run's base listing: {e}"),
            ));
        }
    };
    if !f.metadata().is_ok_and(|m| m.is_file()) {
        return Err(malformed("not a regular file".into()));
    }
    let mut data = Vec::new();
    f.take(MAX_BASE_BYTES + 1)
        .read_to_end(&mut data)
        .map_err(|e| failed(file_error_kind(&e), format!("the run's base listing: {e}")))?;
    Base::parse(data).map_err(malformed)
}

// ---- The layer ---------------------------------------------------------------------------

/// `LAYER`'s walk: sends what changed since T0, directories the base listing does not
/// have (as they are now) whole, the workspace (a mount point) whole, and whiteouts.
struct Changes<'a, 'b> {
    out: Sender<'b>,
    base: &'a Base,
    skips: Skips,
    root_dev: u64,
    /// The workspace, when it is a mount point (relative to the root).
    workspace: Option<Vec<u8>>,
    /// The directory being sent whole (a new or moved one), while the walk is in it.
    whole: Option<Vec<u8>>,
    scratch: Vec<u8>,
}

/// `rel` is `top` or below it.
fn within(rel: &[u8], top: Option<&[u8]>) -> bool {
    top.is_some_and(|w| {
        rel.strip_prefix(w)
            .is_some_and(|rest| rest.is_empty() || rest[0] == b'/')
    })
}

impl Changes<'_, '_> {
    fn changed(&self, md: &Metadata) -> bool {
        (md.ctime(), md.ctime_nsec()) >= self.base.t0
    }

    /// `rel` is the workspace or below it.
    fn in_workspace(&self, rel: &[u8]) -> bool {
        within(rel, self.workspace.as_deref())
    }

    /// `rel` is sent whatever its change time: in the workspace or in a directory sent
    /// whole.
    fn in_whole(&self, rel: &[u8]) -> bool {
        self.in_workspace(rel) || within(rel, self.whole.as_deref())
    }

    /// `rel` (not the root) is a directory above the workspace.
    fn above_workspace(&self, rel: &[u8]) -> bool {
        self.workspace.as_deref().is_some_and(|w| {
            w.strip_prefix(rel)
                .is_some_and(|rest| rest.first() == Some(&b'/'))
        })
    }

    /// The whiteout of `name` in the directory `rel` (`name` empty: the opaque one).
    fn whiteout(&mut self, rel: &[u8], name: &[u8], mtime: i64) -> Result<(), GetEnd> {
        let mut path = Vec::new();
        if name.is_empty() {
            join(&mut path, rel, OPAQUE);
        } else {
            join(&mut path, rel, &[WHITEOUT, name].concat());
        }
        self.out.entry(&Entry {
            path,
            kind: REGULAR,
            mode: 0,
            uid: 0,
            gid: 0,
            mtime,
            size: 0,
            link: Vec::new(),
        })
    }
}

/// An entry sent in a layer may not look like a whiteout.
fn no_whiteout(rel: &[u8]) -> Result<(), GetEnd> {
    let name = rel.rsplit(|&b| b == b'/').next().unwrap_or(rel);
    if name.starts_with(WHITEOUT) {
        return Err(GetEnd::Failed(
            FileError::Invalid,
            rel.to_vec(),
            "names starting with .wh. cannot be carried by a layer (they mark deletions in it)"
                .into(),
        ));
    }
    Ok(())
}

/// A socket or a device: no entry of a layer.
fn special(md: &Metadata) -> bool {
    use std::os::unix::fs::FileTypeExt;
    let ft = md.file_type();
    ft.is_socket() || ft.is_block_device() || ft.is_char_device()
}

impl Visit for Changes<'_, '_> {
    /// Another file system than `/` is not walked but in the workspace; one that is no
    /// mount point (skipped before) fails the layer: what it holds would be lost.
    fn enter(&mut self, m: &Met<'_>) -> Result<bool, GetEnd> {
        if m.md.dev() == self.root_dev || self.in_workspace(m.rel) {
            return Ok(true);
        }
        Err(GetEnd::Failed(
            FileError::Other,
            m.rel.to_vec(),
            "a directory of another file system that is no mount point (a subvolume?): a layer cannot tell what changed in it".into(),
        ))
    }

    fn listed(&mut self, m: &Met<'_>, names: &mut Vec<Name>) -> Result<(), GetEnd> {
        let (skips, scratch, ws) = (&self.skips, &mut self.scratch, self.workspace.as_deref());
        // Sockets and devices have no entry: never sent, whited out below when the base
        // lists their names.
        names.retain(|n| {
            let child = join(scratch, m.rel, &n.name);
            (!skips.has(child) || Some(child) == ws) && !n.special
        });
        if m.rel.is_empty() {
            // The root has no entry; it is never sent whole.
        } else if self.in_whole(m.rel) {
            no_whiteout(m.rel)?;
            self.out
                .entry(&entry_of(m.rel, DIRECTORY, m.md, 0, Vec::new()))?;
            // Whatever lower layers hold below the workspace is hidden.
            if Some(m.rel) == self.workspace.as_deref() {
                self.whiteout(m.rel, b"", m.md.mtime())?;
            }
            return Ok(());
        } else {
            let was = self.base.id(m.rel);
            if was != Some((m.md.dev(), m.md.ino())) {
                // Made or moved here since T0 (rename(2) changes the change time of the
                // directory moved, not of what it holds): sent whole, what the base had
                // at its path hidden.
                no_whiteout(m.rel)?;
                self.out
                    .entry(&entry_of(m.rel, DIRECTORY, m.md, 0, Vec::new()))?;
                if was.is_some() {
                    self.whiteout(m.rel, b"", m.md.mtime())?;
                }
                self.whole = Some(m.rel.to_vec());
                return Ok(());
            }
        }
        let changed = self.changed(m.md);
        if !m.rel.is_empty() && (changed || self.above_workspace(m.rel)) {
            no_whiteout(m.rel)?;
            self.out
                .entry(&entry_of(m.rel, DIRECTORY, m.md, 0, Vec::new()))?;
        }
        if !changed {
            return Ok(());
        }
        let Some(before) = self.base.names(m.rel) else {
            return Ok(());
        };
        let mut gone = Vec::new();
        for old in before {
            if names
                .binary_search_by(|n| n.name.as_slice().cmp(old))
                .is_err()
            {
                gone.push(old.to_vec());
            }
        }
        for old in gone {
            self.whiteout(m.rel, &old, m.md.mtime())?;
        }
        Ok(())
    }

    fn leaf(&mut self, m: &Met<'_>) -> Result<(), GetEnd> {
        let changed = self.changed(m.md);
        if special(m.md) {
            // One that took its name after the listing said otherwise: whited out (what
            // the name was before is gone; a whiteout of a name no lower layer has is
            // harmless).
            if changed || self.in_whole(m.rel) {
                let (dir, name) = match m.rel.iter().rposition(|&b| b == b'/') {
                    Some(i) => (&m.rel[..i], &m.rel[i + 1..]),
                    None => (&b""[..], m.rel),
                };
                self.whiteout(dir, name, m.md.mtime())?;
            }
            return Ok(());
        }
        if !changed && !self.in_whole(m.rel) {
            return Ok(());
        }
        // Only what has an entry.
        no_whiteout(m.rel)?;
        self.out.leaf(m)
    }
}

/// Sends the layer of the tree at `root` (absolute; `/` but in tests) against `base`:
/// `workspace` (absolute in that tree, or empty) is sent whole when it is one of
/// `skips`' mount points. A workspace that is a fixed skip or below one is refused; one
/// that is not a directory fails.
pub(crate) fn send(
    out: Sender<'_>,
    root: &[u8],
    skips: Skips,
    base: &Base,
    workspace: &[u8],
) -> Result<(), GetEnd> {
    let (root, md) = open_root(root)?;
    let rel = if workspace.is_empty() {
        Vec::new()
    } else {
        relative(workspace).ok_or_else(|| {
            failed(
                FileError::Invalid,
                "the workspace must be an absolute path without `..`",
            )
        })?
    };
    // `/` is no mount point: ordinary root filesystem.
    let workspace = if rel.is_empty() {
        None
    } else {
        if skips.fixed.iter().any(|f| within(&rel, Some(f))) {
            return Err(failed(
                FileError::Invalid,
                format!(
                    "the workspace {} is in a directory a layer never holds",
                    String::from_utf8_lossy(workspace)
                ),
            ));
        }
        // It must be a directory (no link followed).
        let mut cur = root
            .try_clone()
            .map_err(|e| failed(file_error_kind(&e), e.to_string()))?;
        for c in rel.split(|&b| b == b'/') {
            cur = cstr(c)
                .and_then(|c| open_in(&cur, &c, O_PATH))
                .map_err(|e| {
                    let kind = match e.raw_os_error() {
                        Some(sys::ENOTDIR) | Some(sys::ELOOP) => FileError::NotDir,
                        _ => file_error_kind(&e),
                    };
                    failed(
                        kind,
                        format!("the workspace {}: {e}", String::from_utf8_lossy(workspace)),
                    )
                })?;
        }
        if !cur.metadata().is_ok_and(|m| m.is_dir()) {
            return Err(failed(
                FileError::NotDir,
                format!(
                    "the workspace {} is not a directory",
                    String::from_utf8_lossy(workspace)
                ),
            ));
        }
        skips.mounts.contains(&rel).then_some(rel)
    };
    let mut changes = Changes {
        out,
        base,
        skips,
        root_dev: md.dev(),
        workspace,
        whole: None,
        scratch: Vec::new(),
    };
    files::walk(&mut changes, root, md, Vec::new())
}

// ---- The operations ----------------------------------------------------------------------

/// The daemon's directory (`held`, the daemon's own descriptor), or, for the relay that
/// serves its connection itself, the one beside the executable, resolved as the relay
/// does (made if missing, never through a link, ours and 0700).
fn daemon_dir(held: Option<&File>) -> Result<File, GetEnd> {
    let dir = match held {
        Some(d) => d.try_clone(),
        None => daemon::exe_and_dir().and_then(|(_, d)| daemon::open_daemon_dir(&d)),
    };
    dir.map_err(|e| failed(file_error_kind(&e), format!("no daemon directory: {e}")))
}

/// `BASE` of the root filesystem (see the module docs of `proto.rs`).
pub(crate) fn base_op(held: Option<&File>) -> Result<(), GetEnd> {
    let t0 = t0_now()?;
    let dir = daemon_dir(held)?;
    record(&dir, b"/", Skips::system()?, t0)
}

/// `LAYER` of the root filesystem, `workspace` the absolute path (or empty).
pub(crate) fn layer_op(
    out: Sender<'_>,
    held: Option<&File>,
    workspace: &[u8],
) -> Result<(), GetEnd> {
    let base = read_base(&daemon_dir(held)?)?;
    send(out, b"/", Skips::system()?, &base, workspace)
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::{PermissionsExt, symlink};
    use std::path::{Path, PathBuf};
    use std::thread;

    use super::*;
    use crate::flow::Flow;
    use crate::link::Link;
    use crate::proto::{FIFO, HARDLINK, LINK_TARGET, STDOUT, SYMLINK};
    use crate::testing::TempDir;

    /// One entry as a layer sent it: path, kind, mode, link, data.
    #[derive(Debug, PartialEq, Eq)]
    struct Sent {
        path: String,
        kind: u8,
        mode: u32,
        link: String,
        data: Vec<u8>,
    }

    fn sent(path: &str, kind: u8, mode: u32, link: &str, data: &str) -> Sent {
        Sent {
            path: path.into(),
            kind,
            mode,
            link: link.into(),
            data: data.as_bytes().to_vec(),
        }
    }

    fn bytes(p: &Path) -> &[u8] {
        p.as_os_str().as_bytes()
    }

    /// A tree to take layers of, a daemon directory beside it for the base listing, and
    /// what the walks skip there (`skipped`, and the mount point `mnt`).
    struct Tree {
        tmp: TempDir,
    }

    impl Tree {
        fn new() -> Tree {
            let tmp = TempDir::new();
            fs::create_dir(tmp.join("root")).unwrap();
            fs::create_dir(tmp.join("d")).unwrap();
            Tree { tmp }
        }

        fn root(&self) -> PathBuf {
            self.tmp.join("root")
        }

        fn at(&self, rel: &str) -> PathBuf {
            self.root().join(rel)
        }

        fn dir(&self) -> File {
            File::open(self.tmp.join("d")).unwrap()
        }

        fn skips() -> Skips {
            Skips::new(
                [b"skipped".to_vec()],
                [b"mnt".to_vec(), b"mnt/inner".to_vec()],
            )
        }

        /// Records the base listing with T0 a little ahead, then waits until every later
        /// change time (coarse clock) is past it.
        fn record(&self) -> Result<(), GetEnd> {
            let soon = SystemTime::now() + Duration::from_millis(30);
            let d = soon.duration_since(UNIX_EPOCH).unwrap();
            let t0 = (d.as_secs() as i64, i64::from(d.subsec_nanos()));
            let r = record(&self.dir(), bytes(&self.root()), Tree::skips(), t0);
            thread::sleep(Duration::from_millis(150));
            r
        }

        fn base(&self) -> Vec<u8> {
            fs::read(self.tmp.join("d").join(BASE_FILE)).unwrap()
        }

        /// The layer: what was sent, or the failure (kind, path, message).
        fn layer(&self, workspace: &str) -> Result<Vec<Sent>, (FileError, String, String)> {
            let link = Link::new(None);
            let flow = Flow::new();
            let r = read_base(&self.dir()).and_then(|base| {
                send(
                    Sender::new(&link, &flow, 7),
                    bytes(&self.root()),
                    Tree::skips(),
                    &base,
                    workspace.as_bytes(),
                )
            });
            match r {
                Ok(()) => {}
                Err(GetEnd::Failed(k, p, m)) => {
                    return Err((k, String::from_utf8(p).unwrap(), m));
                }
                Err(GetEnd::Discarded) => panic!("discarded"),
            }
            let mut out: Vec<Sent> = Vec::new();
            for f in link.take_frames() {
                assert_eq!(f.id, 7);
                match f.kind {
                    crate::proto::ENTRY => {
                        let e = Entry::decode(&mut f.dec()).unwrap();
                        out.push(Sent {
                            path: String::from_utf8(e.path).unwrap(),
                            kind: e.kind,
                            mode: e.mode,
                            link: String::from_utf8(e.link).unwrap(),
                            data: Vec::new(),
                        });
                    }
                    STDOUT => out.last_mut().unwrap().data.extend_from_slice(&f.payload),
                    k => panic!("frame kind {k}"),
                }
            }
            Ok(out)
        }
    }

    fn write(p: &Path, data: &str, mode: u32) {
        fs::write(p, data).unwrap();
        fs::set_permissions(p, fs::Permissions::from_mode(mode)).unwrap();
    }

    /// The tree of the layer tests, before the base listing.
    fn initial(t: &Tree) {
        for d in ["a", "b/c", "del", "skipped", "mnt/sub", "mnt/inner"] {
            fs::create_dir_all(t.at(d)).unwrap();
        }
        write(&t.at("a/keep"), "k", 0o644);
        write(&t.at("a/mod"), "m", 0o600);
        write(&t.at("a/gone"), "g", 0o644);
        write(&t.at("b/c/old"), "o", 0o644);
        write(&t.at("del/x"), "x", 0o644);
        write(&t.at("hl1"), "h", 0o640);
        write(&t.at("skipped/f"), "s", 0o644);
        write(&t.at("mnt/sub/w"), "w", 0o644);
        write(&t.at("mnt/inner/secret"), "s", 0o644);
        symlink("a", t.at("link")).unwrap();
    }

    /// What the run's code does after the base listing.
    fn changes(t: &Tree) {
        fs::write(t.at("a/mod"), "mm").unwrap();
        fs::remove_file(t.at("a/gone")).unwrap();
        write(&t.at("b/c/new"), "n", 0o644);
        fs::remove_dir_all(t.at("del")).unwrap();
        fs::hard_link(t.at("hl1"), t.at("hl2")).unwrap();
        symlink("b", t.at("ln2")).unwrap();
        write(&t.at("skipped/new"), "s", 0o644);
        sys::mkfifoat(File::open(t.root()).unwrap().as_fd(), c"ff", 0o600).unwrap();
        fs::create_dir(t.at("nd")).unwrap();
        fs::set_permissions(t.at("nd"), fs::Permissions::from_mode(0o750)).unwrap();
        write(&t.at("nd/f"), "f", 0o644);
    }

    #[test]
    fn a_layer_holds_what_changed_with_whiteouts_and_never_follows_links() {
        let t = Tree::new();
        initial(&t);
        t.record().unwrap();
        // Nothing changed yet: an empty layer.
        assert_eq!(t.layer("").unwrap(), []);
        changes(&t);
        let got = t.layer("").unwrap();
        let wh = |p: &str| sent(p, REGULAR, 0, "", "");
        assert_eq!(
            got,
            [
                // `/` has no entry, only its whiteouts.
                wh(".wh.del"),
                sent("a", DIRECTORY, 0o755, "", ""),
                wh("a/.wh.gone"),
                sent("a/mod", REGULAR, 0o600, "", "mm"),
                // `b` did not change: only what did below it.
                sent("b/c", DIRECTORY, 0o755, "", ""),
                sent("b/c/new", REGULAR, 0o644, "", "n"),
                sent("ff", FIFO, 0o600, "", ""),
                sent("hl1", REGULAR, 0o640 | LINK_TARGET, "", "h"),
                sent("hl2", HARDLINK, 0o640, "hl1", ""),
                // A link to a directory: itself, never what it points to.
                sent("ln2", SYMLINK, 0o777, "b", ""),
                sent("nd", DIRECTORY, 0o750, "", ""),
                sent("nd/f", REGULAR, 0o644, "", "f"),
            ]
        );
    }

    #[test]
    fn a_workspace_that_is_a_mount_point_is_sent_whole_but_mounts_below_it_are_not() {
        let t = Tree::new();
        initial(&t);
        t.record().unwrap();
        let got = t.layer("/mnt").unwrap();
        assert_eq!(
            got,
            [
                sent("mnt", DIRECTORY, 0o755, "", ""),
                // What lower layers held in it is hidden (files deleted from it).
                sent("mnt/.wh..wh..opq", REGULAR, 0, "", ""),
                sent("mnt/sub", DIRECTORY, 0o755, "", ""),
                sent("mnt/sub/w", REGULAR, 0o644, "", "w"),
            ]
        );
        // Below an unchanged directory: its ancestors come too. No mount point (`b`):
        // the change times rule.
        let t = Tree::new();
        fs::create_dir_all(t.at("x/y/ws/z")).unwrap();
        write(&t.at("x/y/ws/z/f"), "f", 0o644);
        t.record().unwrap();
        let ws = |rel: &str| {
            let link = Link::new(None);
            let flow = Flow::new();
            let base = read_base(&t.dir()).unwrap();
            let skips = Skips::new([], [b"x/y/ws".to_vec()]);
            let r = send(
                Sender::new(&link, &flow, 1),
                bytes(&t.root()),
                skips,
                &base,
                rel.as_bytes(),
            );
            assert!(r.is_ok());
            link.take_frames()
                .iter()
                .filter(|f| f.kind == crate::proto::ENTRY)
                .map(|f| String::from_utf8(Entry::decode(&mut f.dec()).unwrap().path).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(
            ws("/x/y/ws"),
            [
                "x",
                "x/y",
                "x/y/ws",
                "x/y/ws/.wh..wh..opq",
                "x/y/ws/z",
                "x/y/ws/z/f"
            ]
        );
        // Not a mount point: ordinary root filesystem, nothing changed.
        assert!(ws("/x/y").is_empty());
        assert!(ws("").is_empty());
    }

    #[test]
    fn names_that_look_like_whiteouts_fail_a_layer_only_when_sent() {
        let t = Tree::new();
        initial(&t);
        write(&t.at("a/.wh.old"), "", 0o644);
        t.record().unwrap();
        assert!(t.layer("").is_ok());
        write(&t.at("a/.wh.evil"), "", 0o644);
        let (kind, path, msg) = t.layer("").unwrap_err();
        assert_eq!((kind, path.as_str()), (FileError::Invalid, "a/.wh.evil"));
        assert!(msg.contains("names starting with .wh."), "{msg}");
        // A directory too.
        fs::remove_file(t.at("a/.wh.evil")).unwrap();
        fs::create_dir(t.at("b/.wh.d")).unwrap();
        assert_eq!(t.layer("").unwrap_err().1, "b/.wh.d");
    }

    #[test]
    fn the_base_listing_is_taken_once_and_lists_every_directory_walked() {
        let t = Tree::new();
        initial(&t);
        t.record().unwrap();
        let first = t.base();
        let header_end = first.iter().position(|&b| b == b'\n').unwrap();
        let header = std::str::from_utf8(&first[..header_end]).unwrap();
        assert!(header.starts_with("runcell-base 2 "), "{header}");
        let body = &first[header_end + 1..];
        let id = |rel: &str| {
            let md = fs::symlink_metadata(t.at(rel)).unwrap();
            format!("{} {}", md.dev(), md.ino())
        };
        // Skipped paths are neither walked nor listed; the link is a name.
        let expected = format!(
            "\0{}\0a\0b\0del\0hl1\0link\0\0\
            a\0{}\0gone\0keep\0mod\0\0\
            b\0{}\0c\0\0\
            b/c\0{}\0old\0\0\
            del\0{}\0x\0\0",
            id(""),
            id("a"),
            id("b"),
            id("b/c"),
            id("del")
        );
        assert_eq!(String::from_utf8_lossy(body), expected);
        // Never taken again: the run changed files by then.
        changes(&t);
        t.record().unwrap();
        assert_eq!(t.base(), first);
        // Nothing temporary is left in the directory.
        let names: Vec<_> = fs::read_dir(t.tmp.join("d")).unwrap().collect();
        assert_eq!(names.len(), 1);
    }

    #[test]
    fn a_missing_or_malformed_base_listing_fails_the_layer() {
        let t = Tree::new();
        let (kind, _, msg) = t.layer("").unwrap_err();
        assert_eq!(kind, FileError::Other);
        assert!(msg.contains("the run has no base listing"), "{msg}");
        let file = t.tmp.join("d").join(BASE_FILE);
        for bad in [
            &b""[..],
            b"runcell-base 1 1 0\n",
            b"runcell-base 3 1 0\n",
            b"runcell-base 2 1\n",
            b"runcell-base 2 1 1000000000\n",
            b"runcell-base 2 1 0\n\x001 2\0a\0",
            b"runcell-base 2 1 0\n\x001 2\0a/b\0\0",
            b"runcell-base 2 1 0\n\x001 2\0..\0\0",
            b"runcell-base 2 1 0\n\x001 2\0.\0\0",
            b"runcell-base 2 1 0\na/../b\x001 2\0x\0\0",
            b"runcell-base 2 1 0\na//b\x001 2\0x\0\0",
            b"runcell-base 2 1 0\n/a\x001 2\0x\0\0",
            b"runcell-base 2 1 0\na\x001 2\0x\0\0a\x001 2\0y\0\0",
            b"runcell-base 2 1 0\na",
            b"runcell-base 2 1 0\na\0",
            // No (device, inode), or not numbers.
            b"runcell-base 2 1 0\na\0x\0\0",
            b"runcell-base 2 1 0\na\x001\0x\0\0",
            b"runcell-base 2 1 0\na\x001 -2\0x\0\0",
            b"runcell-base 2 1 0\na\0\0",
            // Names that look like whiteouts, out of order, or twice.
            b"runcell-base 2 1 0\n\x001 2\0.wh.x\0\0",
            b"runcell-base 2 1 0\n\x001 2\0.wh..wh..opq\0\0",
            b"runcell-base 2 1 0\n\x001 2\0b\0a\0\0",
            b"runcell-base 2 1 0\n\x001 2\0a\0a\0\0",
        ] {
            fs::write(&file, bad).unwrap();
            let (kind, _, msg) = t.layer("").unwrap_err();
            assert_eq!(kind, FileError::Other, "{bad:?}");
            assert!(msg.contains("malformed"), "{bad:?}: {msg}");
        }
        // Not a regular file (a fifo would block a reader that waits).
        fs::remove_file(&file).unwrap();
        sys::mkfifoat(t.dir().as_fd(), c"base", 0o600).unwrap();
        assert!(t.layer("").unwrap_err().2.contains("not a regular file"));
        // A well-formed one: directories in any order, empty ones.
        fs::remove_file(&file).unwrap();
        fs::write(
            &file,
            b"runcell-base 2 1 5\nz\x003 4\0\0\x001 2\0q\0\0a\x005 6\0x\0y\0\0",
        )
        .unwrap();
        let base = read_base(&t.dir()).unwrap();
        assert_eq!(base.t0, (1, 5));
        let names = |rel: &[u8]| {
            base.names(rel)
                .map(|n| n.map(<[u8]>::to_vec).collect::<Vec<_>>())
        };
        assert_eq!(names(b""), Some(vec![b"q".to_vec()]));
        assert_eq!(names(b"a"), Some(vec![b"x".to_vec(), b"y".to_vec()]));
        assert_eq!(names(b"z"), Some(vec![]));
        assert_eq!(names(b"b"), None);
        assert_eq!(base.id(b"a"), Some((5, 6)));
        assert_eq!(base.id(b""), Some((1, 2)));
    }

    /// Whiteouts and the opaque marker as a layer sends them.
    fn wh(p: &str) -> Sent {
        sent(p, REGULAR, 0, "", "")
    }

    #[test]
    fn a_directory_moved_or_swapped_is_sent_whole_and_hides_what_was_at_its_path() {
        let t = Tree::new();
        initial(&t);
        t.record().unwrap();
        // rename(2) changes the moved directory's change time, not its contents'.
        fs::rename(t.at("b"), t.at("b2")).unwrap();
        // Swapped: each path now holds the other's directory (another inode).
        fs::rename(t.at("a"), t.at("tmp")).unwrap();
        fs::rename(t.at("del"), t.at("a")).unwrap();
        fs::rename(t.at("tmp"), t.at("del")).unwrap();
        let got = t.layer("").unwrap();
        assert_eq!(
            got,
            [
                wh(".wh.b"),
                sent("a", DIRECTORY, 0o755, "", ""),
                wh("a/.wh..wh..opq"),
                sent("a/x", REGULAR, 0o644, "", "x"),
                // Not in the base listing: nothing below it to hide.
                sent("b2", DIRECTORY, 0o755, "", ""),
                sent("b2/c", DIRECTORY, 0o755, "", ""),
                sent("b2/c/old", REGULAR, 0o644, "", "o"),
                sent("del", DIRECTORY, 0o755, "", ""),
                wh("del/.wh..wh..opq"),
                sent("del/gone", REGULAR, 0o644, "", "g"),
                sent("del/keep", REGULAR, 0o644, "", "k"),
                sent("del/mod", REGULAR, 0o600, "", "m"),
            ]
        );
    }

    #[test]
    fn a_name_the_base_lists_taken_by_a_socket_is_whited_out() {
        let t = Tree::new();
        initial(&t);
        t.record().unwrap();
        fs::remove_file(t.at("a/keep")).unwrap();
        let _sock = std::os::unix::net::UnixListener::bind(t.at("a/keep")).unwrap();
        // A new socket under a name the base never had: nothing to hide, nothing sent.
        let _new = std::os::unix::net::UnixListener::bind(t.at("a/sock")).unwrap();
        assert_eq!(
            t.layer("").unwrap(),
            [sent("a", DIRECTORY, 0o755, "", ""), wh("a/.wh.keep")]
        );
    }

    /// Nests `levels` directories `n` in `d` (from held descriptors: their paths are
    /// longer than PATH_MAX); the deepest.
    fn nest(mut d: File, levels: usize) -> File {
        for _ in 0..levels {
            match sys::mkdirat(d.as_fd(), c"n", 0o755) {
                Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
                r => r.unwrap(),
            }
            d = open_in(&d, c"n", sys::O_RDONLY).unwrap();
        }
        d
    }

    #[test]
    fn a_tree_deeper_than_a_walk_goes_fails_naming_it() {
        use crate::proto::MAX_WALK_DEPTH;
        // BASE: the root and MAX_WALK_DEPTH levels below it are one too many.
        let t = Tree::new();
        nest(File::open(t.root()).unwrap(), MAX_WALK_DEPTH);
        match t.record() {
            Err(GetEnd::Failed(FileError::Other, p, m)) => {
                assert!(p.starts_with(b"n/n/n/"));
                assert!(m.contains("nested deeper"), "{m}");
            }
            _ => panic!("recorded"),
        }
        // LAYER: as deep as a walk goes at the base, then deeper.
        let t = Tree::new();
        nest(File::open(t.root()).unwrap(), MAX_WALK_DEPTH - 1);
        t.record().unwrap();
        nest(File::open(t.root()).unwrap(), MAX_WALK_DEPTH + 1);
        let (kind, path, msg) = t.layer("").unwrap_err();
        assert_eq!(kind, FileError::Other);
        assert!(path.starts_with("n/n/n/"), "{path}");
        assert!(msg.contains("nested deeper"), "{msg}");
    }

    #[test]
    fn a_workspace_in_a_fixed_skip_or_that_is_no_directory_is_refused() {
        let t = Tree::new();
        initial(&t);
        t.record().unwrap();
        for ws in ["/skipped", "/skipped/f", "/skipped/nope", "a", "/a/../b"] {
            assert_eq!(t.layer(ws).unwrap_err().0, FileError::Invalid, "{ws}");
        }
        assert_eq!(t.layer("/nope").unwrap_err().0, FileError::NotFound);
        assert_eq!(t.layer("/a/nope").unwrap_err().0, FileError::NotFound);
        assert_eq!(t.layer("/hl1").unwrap_err().0, FileError::NotDir);
        assert_eq!(t.layer("/hl1/x").unwrap_err().0, FileError::NotDir);
        // A link is never followed.
        assert_eq!(t.layer("/link").unwrap_err().0, FileError::NotDir);
        assert!(t.layer("/a").unwrap().is_empty());
        assert!(t.layer("/").unwrap().is_empty());
    }

    #[test]
    fn another_file_system_that_is_no_mount_point_fails_a_layer_but_in_the_workspace() {
        let t = Tree::new();
        initial(&t);
        t.record().unwrap();
        let base = read_base(&t.dir()).unwrap();
        let link = Link::new(None);
        let flow = Flow::new();
        let f = File::open(t.at("a")).unwrap();
        let md = f.metadata().unwrap();
        let mut changes = Changes {
            out: Sender::new(&link, &flow, 1),
            base: &base,
            skips: Tree::skips(),
            // As if `a` were on another device than the root (a btrfs subvolume).
            root_dev: md.dev() + 1,
            workspace: None,
            whole: None,
            scratch: Vec::new(),
        };
        let met = Met {
            rel: b"a",
            f: &f,
            md: &md,
            top: false,
        };
        match changes.enter(&met) {
            Err(GetEnd::Failed(FileError::Other, p, _)) => assert_eq!(p, b"a"),
            _ => panic!("entered"),
        }
        changes.workspace = Some(b"a".to_vec());
        assert!(changes.enter(&met).unwrap());
    }

    #[test]
    fn mount_points_are_field_five_relative_and_unescaped() {
        let text = b"22 27 0:21 / /proc rw,relatime - proc proc rw\n\
            1 0 8:1 / / rw - ext4 /dev/root rw\n\
            30 27 0:30 /x /home/my\\040dir rw - tmpfs tmpfs rw\n\
            31 27 0:31 / /a\\134b\\011c rw - tmpfs tmpfs rw\n\
            32 27 0:32 / relative rw - tmpfs tmpfs rw\n\
            33 27 0:33 / /up/../x rw - tmpfs tmpfs rw\n\
            short line\n";
        let got: Vec<String> = mount_points(text)
            .into_iter()
            .map(|m| String::from_utf8(m).unwrap())
            .collect();
        assert_eq!(got, ["proc", "home/my dir", "a\\b\tc"]);
        assert_eq!(unescape(b"a\\040"), b"a ");
        assert_eq!(unescape(b"\\04"), b"\\04");
        assert_eq!(unescape(b"\\777x"), b"\\777x");
        assert_eq!(unescape(b"\\08x"), b"\\08x");
        assert_eq!(unescape(b"x\\"), b"x\\");
    }

    #[test]
    fn the_root_filesystem_skips_its_system_directories_and_mounts() {
        let s = Skips::system().unwrap();
        for p in ["proc", "sys", "dev", ".runcell"] {
            assert!(s.has(p.as_bytes()), "{p}");
        }
        assert!(!s.has(b""));
        assert!(!s.has(b"usr"));
        // This test's own daemon directory, beside its executable.
        let (_, dir) = daemon::exe_and_dir().unwrap();
        assert!(s.has(&relative(bytes(&dir.join(DAEMON_DIR))).unwrap()));
    }
}
