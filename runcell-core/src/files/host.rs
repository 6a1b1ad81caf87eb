//! Host folders: a host workspace read into a tar stream, and a tar stream from a
//! sandbox unpacked into a host folder, both through held descriptors.

use std::io::Write as _;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt as _;
use std::rc::Rc;

use super::*;

/// A tar stream of the content of host directory `dir` (paths relative to it; symbolic
/// links kept as links, never followed): how a host workspace is copied into a target.
/// Built on a blocking thread as it is read (a few chunks ahead), never whole in memory.
///
/// The folder may be shared with a live run that swaps names in it: it is walked through
/// held directory descriptors, every name opened `O_NOFOLLOW` and the file read the one
/// examined, so a link swapped in is archived as a link (or skipped), never read through.
/// A file that shrinks while it is read fails the stream, naming it.
///
/// The folder's content may be the sandbox's: the walk holds one descriptor per level of
/// the directory it is in (a subdirectory is opened when its turn comes, not when it is
/// listed), so a folder of many subdirectories costs one, and a tree deeper than
/// 256 levels fails the stream instead of taking the host's descriptors.
pub fn tar_dir_stream(dir: &std::path::Path) -> ByteStream {
    let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<Bytes>>(4);
    let dir = dir.to_path_buf();
    tokio::task::spawn_blocking(move || {
        let out = ChannelWriter {
            tx: tx.clone(),
            buf: Vec::with_capacity(ChannelWriter::CHUNK),
        };
        if let Err(e) = write_dir_tar(&dir, out) {
            let what = format!("cannot archive {}: {e}", dir.display());
            let _ = tx.blocking_send(Err(std::io::Error::new(e.kind(), what)));
        }
    });
    stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    })
    .boxed()
}

/// A `Write` that hands its bytes to a stream in chunks (blocking when the reader is
/// behind; `BrokenPipe` once the reader is gone).
struct ChannelWriter {
    tx: tokio::sync::mpsc::Sender<std::io::Result<Bytes>>,
    buf: Vec<u8>,
}

impl ChannelWriter {
    const CHUNK: usize = 64 << 10;

    fn send(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = Bytes::from(std::mem::replace(
            &mut self.buf,
            Vec::with_capacity(Self::CHUNK),
        ));
        self.tx
            .blocking_send(Ok(chunk))
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::BrokenPipe))
    }
}

impl std::io::Write for ChannelWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let n = data.len().min(Self::CHUNK - self.buf.len());
        self.buf.extend_from_slice(&data[..n]);
        if self.buf.len() >= Self::CHUNK {
            self.send()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.send()
    }
}

/// A reader of exactly `left` bytes: an end before that is an error naming `name`.
struct Exact<R> {
    inner: R,
    left: u64,
    name: std::path::PathBuf,
}

impl<R: std::io::Read> std::io::Read for Exact<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.left == 0 {
            return Ok(0);
        }
        let want = buf.len().min(self.left.min(usize::MAX as u64) as usize);
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("{} shrank while it was read", self.name.display()),
            ));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

/// How deep [`tar_dir_stream`] walks: one descriptor is held per level.
pub const MAX_DEPTH: usize = 256;

/// Writes the tar archive of `dir`'s content to `out` (see [`tar_dir_stream`]).
fn write_dir_tar(dir: &std::path::Path, out: ChannelWriter) -> std::io::Result<()> {
    use rustix::fs::{AtFlags, CWD, Dir, FileType, Mode, OFlags, fstat, openat, statat};
    let dir_flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
    let root = openat(CWD, dir, dir_flags, Mode::empty())?;
    let mut builder = tar::Builder::new(out);
    let header = |st: &rustix::fs::Stat, kind: tar::EntryType, size: u64| {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(st.st_mode & 0o7777);
        h.set_uid(st.st_uid.into());
        h.set_gid(st.st_gid.into());
        h.set_mtime(st.st_mtime.max(0) as u64);
        h.set_size(size);
        h
    };
    // Subdirectories still to archive: their parent's descriptor, name, path and depth.
    type Pending = (Rc<OwnedFd>, std::ffi::CString, std::path::PathBuf, usize);
    let mut stack: Vec<Pending> = Vec::new();
    let mut next = Some((Rc::new(root), std::path::PathBuf::new(), 0usize));
    loop {
        let (fd, rel, depth) = match next.take() {
            Some(dir) => dir,
            None => {
                let Some((parent, name, rel, depth)) = stack.pop() else {
                    break;
                };
                if depth > MAX_DEPTH {
                    return Err(std::io::Error::other(format!(
                        "{} is more than {MAX_DEPTH} directories deep: not archived",
                        rel.display()
                    )));
                }
                let flags = dir_flags | OFlags::NOFOLLOW;
                let sub = match openat(&*parent, &name, flags, Mode::empty()) {
                    Ok(sub) => sub,
                    // Swapped for something else meanwhile: skipped.
                    Err(
                        rustix::io::Errno::NOENT
                        | rustix::io::Errno::NOTDIR
                        | rustix::io::Errno::LOOP,
                    ) => continue,
                    Err(e) => return Err(e.into()),
                };
                drop(parent);
                let st = fstat(&sub)?;
                let mut h = header(&st, tar::EntryType::Directory, 0);
                builder.append_data(&mut h, &rel, std::io::empty())?;
                (Rc::new(sub), rel, depth)
            }
        };
        let mut names: Vec<std::ffi::CString> = Vec::new();
        for entry in Dir::read_from(&fd)? {
            let name = entry?.file_name().to_owned();
            if !matches!(name.to_bytes(), b"." | b"..") {
                names.push(name);
            }
        }
        names.sort();
        for name in names {
            let path = rel.join(std::ffi::OsStr::from_bytes(name.to_bytes()));
            let st = match statat(&fd, &name, AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) => st,
                // Removed while we walked: as if it had not been there.
                Err(rustix::io::Errno::NOENT) => continue,
                Err(e) => return Err(e.into()),
            };
            match FileType::from_raw_mode(st.st_mode) {
                FileType::Directory => stack.push((fd.clone(), name, path, depth + 1)),
                FileType::RegularFile => {
                    let flags = OFlags::RDONLY
                        | OFlags::NOFOLLOW
                        | OFlags::NONBLOCK
                        | OFlags::NOCTTY
                        | OFlags::CLOEXEC;
                    let file = match openat(&fd, &name, flags, Mode::empty()) {
                        Ok(file) => file,
                        Err(rustix::io::Errno::NOENT | rustix::io::Errno::LOOP) => continue,
                        Err(e) => return Err(e.into()),
                    };
                    // The file read is the one examined.
                    let st = fstat(&file)?;
                    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
                        continue;
                    }
                    let size = st.st_size.max(0) as u64;
                    let mut h = header(&st, tar::EntryType::Regular, size);
                    let data = Exact {
                        inner: std::fs::File::from(file),
                        left: size,
                        name: path.clone(),
                    };
                    builder.append_data(&mut h, &path, data)?;
                }
                FileType::Symlink => {
                    let target = match rustix::fs::readlinkat(&fd, &name, Vec::new()) {
                        Ok(t) => t,
                        Err(rustix::io::Errno::NOENT | rustix::io::Errno::INVAL) => continue,
                        Err(e) => return Err(e.into()),
                    };
                    let target = std::ffi::OsStr::from_bytes(target.as_bytes());
                    let mut h = header(&st, tar::EntryType::Symlink, 0);
                    builder.append_link(&mut h, &path, target)?;
                }
                // Fifos, sockets, devices: nothing to copy.
                _ => {}
            }
        }
    }
    builder.into_inner()?.flush()
}

/// Unpacks a tar stream into host directory `dir`, dropping the first `strip` path
/// components of each entry: only regular files, their hard links (to a regular file
/// the archive put inside `dir`) and directories, and only inside `dir` (the archive
/// comes from the sandbox and may hold links meant to write elsewhere on the host). An entry whose way passes a symbolic link on the host (one the host
/// workspace had, pointing anywhere) is skipped, and permission bits are kept without
/// setuid, setgid and sticky bits, owners and extended attributes: what comes back
/// never gains privileges on the host. Streams: memory stays bounded whatever the size.
///
/// The host folder may be a live run's bind mount, whose code can swap any name in it for
/// a link while this runs: every entry is reached from a held descriptor of `dir`, one
/// `O_NOFOLLOW` component at a time, each file is written under a fresh `O_EXCL` name and
/// renamed into place within its held directory, and modes are set through descriptors.
/// Nothing is looked up by name twice.
pub async fn unpack_into(tar: ByteStream, dir: &std::path::Path, strip: usize) -> Result<()> {
    let reader = tokio_util::io::SyncIoBridge::new(StreamReader::new(checked_tar_stream(tar)));
    let dir = dir.to_path_buf();
    let bad = |e: std::io::Error| {
        Error::new(ErrorKind::Backend, "cannot unpack the workspace").with_source(e)
    };
    tokio::task::spawn_blocking(move || {
        use rustix::fs::{CWD, Mode, OFlags};
        std::fs::create_dir_all(&dir).map_err(bad)?;
        let root = rustix::fs::openat(
            CWD,
            &dir,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| bad(e.into()))?;
        let mut archive = tar::Archive::new(reader);
        // The regular files written, by path: (device, inode), the only files a hard link
        // may name (bounded: a link to a file no longer remembered is skipped).
        let mut made: std::collections::HashMap<std::path::PathBuf, (u64, u64)> =
            std::collections::HashMap::new();
        let mut made_bytes = 0usize;
        for entry in archive.entries().map_err(bad)? {
            let mut entry = entry.map_err(bad)?;
            let path = entry.path().map_err(bad)?.into_owned();
            let rest: std::path::PathBuf = path
                .components()
                .filter(|c| !matches!(c, std::path::Component::CurDir))
                .skip(strip)
                .collect();
            if rest.as_os_str().is_empty() {
                continue;
            }
            // `..`, absolute paths: never.
            if rest
                .components()
                .any(|c| !matches!(c, std::path::Component::Normal(_)))
            {
                continue;
            }
            let kind = entry.header().entry_type();
            if kind == tar::EntryType::Link {
                let target = match entry.link_name() {
                    Ok(Some(t)) => t.into_owned(),
                    _ => continue,
                };
                let target: std::path::PathBuf = target
                    .components()
                    .filter(|c| !matches!(c, std::path::Component::CurDir))
                    .skip(strip)
                    .collect();
                let inside = !target.as_os_str().is_empty()
                    && target
                        .components()
                        .all(|c| matches!(c, std::path::Component::Normal(_)));
                // Only to a file this unpack wrote, and still that file.
                let linked = match made.get(&target) {
                    Some(&want) if inside => unpack_hard_link(&root, &rest, &target, want),
                    _ => Ok(false),
                };
                match linked {
                    Ok(true) => {}
                    Ok(false) => {
                        tracing::debug!(path = %crate::Shown(rest.display()), "unpacking skips a hard link to no file of its own")
                    }
                    Err(e) => {
                        return Err(Error::new(
                            ErrorKind::Backend,
                            format!("cannot unpack the workspace: {}", rest.display()),
                        )
                        .with_source(e));
                    }
                }
                continue;
            }
            if !matches!(kind, tar::EntryType::Regular | tar::EntryType::Directory) {
                tracing::debug!(?kind, "unpacking skips a non-regular entry");
                continue;
            }
            let mode = entry.header().mode().map_err(bad)? & 0o777;
            let mtime = entry.header().mtime().unwrap_or(0);
            let mut written = None;
            let is_dir = kind == tar::EntryType::Directory;
            match unpack_entry(&root, &rest, is_dir, mode, mtime, &mut entry, &mut written) {
                Ok(true) => {
                    if let Some(id) = written {
                        let len = rest.as_os_str().len();
                        if made.len() < MADE_FILES && made_bytes + len <= MADE_PATH_BYTES {
                            made_bytes += len;
                            made.insert(rest, id);
                        } else {
                            made.remove(&rest);
                        }
                    }
                }
                Ok(false) => {
                    tracing::debug!(path = %crate::Shown(rest.display()), "unpacking skips an entry behind a host symlink")
                }
                Err(e) => {
                    return Err(Error::new(
                        ErrorKind::Backend,
                        format!("cannot unpack the workspace: {}", rest.display()),
                    )
                    .with_source(e));
                }
            }
        }
        // The reader stops at the first zero block: the rest must end the archive well.
        std::io::copy(&mut archive.into_inner(), &mut std::io::sink()).map_err(bad)?;
        Ok(())
    })
    .await
    .map_err(|e| Error::new(ErrorKind::Backend, "unpacking panicked").with_source(e))?
}

/// Regular files an unpack remembers for hard links, and their paths' bytes.
const MADE_FILES: usize = 1 << 20;
const MADE_PATH_BYTES: usize = 64 << 20;

/// Writes one entry at `rest` below the held directory `root` (module docs of
/// [`unpack_into`]): `Ok(false)` if its way passes a symbolic link (any parent, and the
/// place itself for a directory; a file replaces a link at its own place).
fn unpack_entry(
    root: &std::os::fd::OwnedFd,
    rest: &std::path::Path,
    is_dir: bool,
    mode: u32,
    mtime: u64,
    data: &mut impl std::io::Read,
    written: &mut Option<(u64, u64)>,
) -> std::io::Result<bool> {
    use rustix::fs::{Mode, OFlags, openat};
    use rustix::io::Errno;
    let nofollow = OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let parts: Vec<&std::ffi::OsStr> = rest.iter().collect();
    let Some((name, parents)) = parts.split_last() else {
        return Ok(true);
    };
    let Some(dir) = walk(root, parents, true)? else {
        return Ok(false);
    };
    let perm = Mode::from_raw_mode(mode);
    if is_dir {
        let open = || {
            openat(
                &dir,
                *name,
                OFlags::RDONLY | OFlags::DIRECTORY | nofollow,
                Mode::empty(),
            )
        };
        let d = match open() {
            Err(Errno::NOENT) => {
                rustix::fs::mkdirat(&dir, *name, Mode::from_raw_mode(0o700))?;
                open()
            }
            other => other,
        };
        let d = match d {
            Ok(d) => d,
            Err(e @ (Errno::LOOP | Errno::NOTDIR)) => return link_or(&dir, name, e),
            Err(e) => return Err(e.into()),
        };
        rustix::fs::fchmod(&d, perm)?;
        return Ok(true);
    }
    // A fresh name of our own, written, then renamed over the entry's name.
    let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | nofollow;
    let (tmp, fd) = (0..16)
        .find_map(|_| {
            let tmp = format!(".runcell-tmp-{:016x}", rand::random::<u64>());
            match openat(&dir, tmp.as_str(), flags, Mode::from_raw_mode(0o600)) {
                Err(Errno::EXIST) => None,
                r => Some(r.map(|fd| (tmp, fd))),
            }
        })
        .unwrap_or(Err(Errno::EXIST))?;
    let mut file = std::fs::File::from(fd);
    let done = (|| -> std::io::Result<(u64, u64)> {
        std::io::copy(data, &mut file)?;
        rustix::fs::fchmod(&file, perm)?;
        if mtime > 0 {
            let _ =
                file.set_modified(std::time::UNIX_EPOCH + std::time::Duration::from_secs(mtime));
        }
        let st = rustix::fs::fstat(&file)?;
        rustix::fs::renameat(&dir, tmp.as_str(), &dir, *name)?;
        Ok((st.st_dev, st.st_ino))
    })();
    match done {
        Ok(id) => *written = Some(id),
        Err(e) => {
            let _ = rustix::fs::unlinkat(&dir, tmp.as_str(), rustix::fs::AtFlags::empty());
            return Err(e);
        }
    }
    Ok(true)
}

/// The directory `parents` name below `root`, reached one `O_NOFOLLOW` component at a
/// time (made 0755 where missing if `create`); `None` if a symbolic link is in the way.
fn walk(
    root: &std::os::fd::OwnedFd,
    parents: &[&std::ffi::OsStr],
    create: bool,
) -> std::io::Result<Option<std::os::fd::OwnedFd>> {
    use rustix::fs::{Mode, OFlags, openat};
    use rustix::io::Errno;
    let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let mut dir = root.try_clone()?;
    for p in parents {
        let open = || openat(&dir, *p, flags, Mode::empty());
        let opened = match open() {
            Err(Errno::NOENT) if create => {
                match rustix::fs::mkdirat(&dir, *p, Mode::from_raw_mode(0o755)) {
                    Ok(()) | Err(Errno::EXIST) => {}
                    Err(e) => return Err(e.into()),
                }
                open()
            }
            other => other,
        };
        dir = match opened {
            Ok(d) => d,
            Err(e @ (Errno::LOOP | Errno::NOTDIR)) => {
                return link_or(&dir, p, e).map(|_| None);
            }
            Err(e) => return Err(e.into()),
        };
    }
    Ok(Some(dir))
}

/// Makes `rest` below `root` another name of the regular file `target` (both relative
/// to `root`), which this unpack wrote as (device, inode) `want`, as [`unpack_entry`]
/// writes a file: a fresh name linked, checked to be that file, then renamed into place.
/// `Ok(false)` (skipped) if a symbolic link is in either way or another file is at
/// `target` now (code in a live run may change a bind-mounted folder as it is unpacked).
fn unpack_hard_link(
    root: &std::os::fd::OwnedFd,
    rest: &std::path::Path,
    target: &std::path::Path,
    want: (u64, u64),
) -> std::io::Result<bool> {
    use rustix::fs::{AtFlags, FileType};
    use rustix::io::Errno;
    let parts: Vec<&std::ffi::OsStr> = rest.iter().collect();
    let targets: Vec<&std::ffi::OsStr> = target.iter().collect();
    let (Some((name, parents)), Some((tname, tparents))) =
        (parts.split_last(), targets.split_last())
    else {
        return Ok(true);
    };
    let (Some(tdir), Some(dir)) = (walk(root, tparents, false)?, walk(root, parents, true)?) else {
        return Ok(false);
    };
    // `linkat` without `AT_SYMLINK_FOLLOW` follows nothing: a link swapped in at the
    // target's name is linked itself, then found by the check below.
    let tmp = (0..16)
        .find_map(|_| {
            let tmp = format!(".runcell-tmp-{:016x}", rand::random::<u64>());
            match rustix::fs::linkat(&tdir, *tname, &dir, tmp.as_str(), AtFlags::empty()) {
                Err(Errno::EXIST) => None,
                r => Some(r.map(|()| tmp)),
            }
        })
        .unwrap_or(Err(Errno::EXIST));
    let tmp = match tmp {
        Ok(t) => t,
        Err(Errno::NOENT | Errno::PERM) => return Ok(false),
        Err(e) => return Err(e.into()),
    };
    let is_it = |n: &std::ffi::OsStr| {
        rustix::fs::statat(&dir, n, AtFlags::SYMLINK_NOFOLLOW).is_ok_and(|st| {
            FileType::from_raw_mode(st.st_mode) == FileType::RegularFile
                && (st.st_dev, st.st_ino) == want
        })
    };
    // Renamed into place unless it is not that file, or the name is that file already
    // (a rename between two names of one inode does nothing and leaves the fresh name).
    let (done, renamed) = if !is_it(std::ffi::OsStr::new(&tmp)) {
        (Ok(false), false)
    } else if is_it(name) {
        (Ok(true), false)
    } else {
        let r = rustix::fs::renameat(&dir, tmp.as_str(), &dir, *name);
        let renamed = r.is_ok();
        (r.map(|()| true), renamed)
    };
    if !renamed {
        let _ = rustix::fs::unlinkat(&dir, tmp.as_str(), AtFlags::empty());
    }
    Ok(done?)
}

/// `Ok(false)` (skip the entry) if `name` in `dir` is a symbolic link, else `e`: a
/// non-directory that is not a link is in the way.
fn link_or(
    dir: &std::os::fd::OwnedFd,
    name: &std::ffi::OsStr,
    e: rustix::io::Errno,
) -> std::io::Result<bool> {
    use rustix::fs::{AtFlags, FileType};
    match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Symlink => Ok(false),
        _ => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::files::tests::archive;

    /// A host folder streams as an archive of its content: files with their modes,
    /// directories, links as links; a link to a folder outside is never read through, also
    /// while it keeps trading places with a directory.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_host_folder_streams_whole_and_never_through_a_link() {
        use std::os::unix::fs::PermissionsExt;
        let base = std::env::temp_dir().join(format!("runcell-tardir-{:x}", rand::random::<u64>()));
        let (host, outside) = (base.join("host"), base.join("outside"));
        std::fs::create_dir_all(host.join("sub/d")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("secret"), "secret").unwrap();
        std::fs::write(host.join("sub/f"), vec![7u8; 200_000]).unwrap();
        std::fs::set_permissions(host.join("sub/f"), std::fs::Permissions::from_mode(0o751))
            .unwrap();
        std::os::unix::fs::symlink(&outside, host.join("sub/l")).unwrap();
        let tar = collect_bytes(tar_dir_stream(&host), u64::MAX)
            .await
            .unwrap();
        let mut seen = Vec::new();
        for entry in tar::Archive::new(&tar[..]).entries().unwrap() {
            let mut entry = entry.unwrap();
            let path = entry.path().unwrap().display().to_string();
            let kind = entry.header().entry_type();
            let mode = entry.header().mode().unwrap();
            let mut data = Vec::new();
            std::io::Read::read_to_end(&mut entry, &mut data).unwrap();
            seen.push((path, kind, mode, data.len()));
        }
        assert_eq!(
            seen,
            vec![
                ("sub".to_string(), tar::EntryType::Directory, 0o755, 0),
                ("sub/f".to_string(), tar::EntryType::Regular, 0o751, 200_000),
                ("sub/l".to_string(), tar::EntryType::Symlink, 0o777, 0),
                ("sub/d".to_string(), tar::EntryType::Directory, 0o755, 0),
            ]
        );
        // Now `sub/d` and `sub/l` trade places while the folder is read, many times.
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let swapper = {
            let (stop, d, l) = (stop.clone(), host.join("sub/d"), host.join("sub/l"));
            std::thread::spawn(move || {
                let (cwd, flags) = (rustix::fs::CWD, rustix::fs::RenameFlags::EXCHANGE);
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    rustix::fs::renameat_with(cwd, &d, cwd, &l, flags).unwrap();
                }
            })
        };
        for _ in 0..200 {
            if let Ok(tar) = collect_bytes(tar_dir_stream(&host), u64::MAX).await {
                assert!(
                    !tar.windows(6).any(|w| w == b"secret"),
                    "read through a link"
                );
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        swapper.join().unwrap();
        std::fs::remove_dir_all(&base).unwrap();
    }

    /// A hard link comes back as another name of a file the archive put inside the
    /// folder, never of anything else: not through a host symlink, not to a path outside,
    /// not to the symlink itself, not to a missing file, not to a file the folder had; a
    /// link to the name it is at leaves no temporary name.
    /// A folder the sandbox may fill: many subdirectories cost the walk one descriptor,
    /// and a tree too deep for the host's descriptors fails the stream.
    #[tokio::test]
    async fn a_wide_or_deep_folder_holds_few_host_descriptors() {
        let fds = || std::fs::read_dir("/proc/self/fd").unwrap().count();
        let base = std::env::temp_dir().join(format!("runcell-wide-{:x}", rand::random::<u64>()));
        let wide = base.join("wide");
        for i in 0..3000 {
            std::fs::create_dir_all(wide.join(format!("d{i}/e"))).unwrap();
        }
        std::fs::write(wide.join("d2999/e/f"), b"x").unwrap();
        let before = fds();
        let mut stream = tar_dir_stream(&wide);
        let (mut tar, mut peak) = (Vec::new(), 0);
        while let Some(chunk) = stream.next().await {
            tar.extend_from_slice(&chunk.unwrap());
            peak = peak.max(fds());
        }
        // Other tests of this process open descriptors too: a margin, far below 3000.
        assert!(
            peak < before + 300,
            "{before} descriptors, {peak} while walking"
        );
        let entries = tar::Archive::new(&tar[..]).entries().unwrap().count();
        assert_eq!(entries, 6001);
        let mut deep = base.join("deep");
        for _ in 0..MAX_DEPTH + 2 {
            deep.push("d");
        }
        std::fs::create_dir_all(&deep).unwrap();
        let e = collect_bytes(tar_dir_stream(&base.join("deep")), u64::MAX)
            .await
            .unwrap_err();
        std::fs::remove_dir_all(&base).unwrap();
        assert!(e.to_string().contains("directories deep"), "{e}");
    }

    #[tokio::test]
    async fn unpacked_hard_links_only_link_files_of_the_archive() {
        use std::os::unix::fs::MetadataExt;
        let base = std::env::temp_dir().join(format!(
            "runcell-unpack-links-{}-{:x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        let (host, outside) = (base.join("host"), base.join("outside"));
        std::fs::create_dir_all(&host).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("x"), b"secret").unwrap();
        std::os::unix::fs::symlink(&outside, host.join("link")).unwrap();
        let mut builder = tar::Builder::new(Vec::new());
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Regular);
        header.set_mode(0o644);
        header.set_size(2);
        builder
            .append_data(&mut header, "top/a/f", &b"ab"[..])
            .unwrap();
        for (name, target) in [
            ("top/same", "top/a/f"),
            ("top/a/g", "top/a/f"),
            ("top/out", "top/../outside/x"),
            ("top/through", "top/link/x"),
            ("top/to-link", "top/link"),
            ("top/missing", "top/nothing"),
            ("top/stolen", "top/host-only"),
            ("top/a/f", "top/a/f"),
        ] {
            let mut header = tar::Header::new_gnu();
            header.set_entry_type(tar::EntryType::Link);
            header.set_size(0);
            builder.append_link(&mut header, name, target).unwrap();
        }
        let tar = builder.into_inner().unwrap();
        std::fs::write(host.join("host-only"), b"the user's").unwrap();
        unpack_into(byte_stream(tar), &host, 1).await.unwrap();
        let ino = |p: &str| {
            std::fs::symlink_metadata(host.join(p))
                .map(|m| m.ino())
                .ok()
        };
        assert_eq!(ino("same"), ino("a/f"));
        assert_eq!(ino("a/g"), ino("a/f"));
        assert_eq!(std::fs::read(host.join("same")).unwrap(), b"ab");
        for skipped in ["out", "through", "to-link", "missing", "stolen"] {
            assert_eq!(ino(skipped), None, "{skipped}");
        }
        assert_eq!(std::fs::metadata(outside.join("x")).unwrap().nlink(), 1);
        assert_eq!(
            std::fs::metadata(host.join("host-only")).unwrap().nlink(),
            1
        );
        let names: Vec<_> = ["", "a"]
            .iter()
            .flat_map(|d| std::fs::read_dir(host.join(d)).unwrap())
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with(".runcell-tmp"))
            .collect();
        assert!(names.is_empty(), "{names:?}");
        std::fs::remove_dir_all(&base).unwrap();
    }

    /// What the sandbox sends back never gains privileges on the host nor writes through
    /// a host symlink.
    #[tokio::test]
    async fn unpacking_drops_privileged_bits_and_never_follows_host_links() {
        use std::os::unix::fs::PermissionsExt;
        let base = std::env::temp_dir().join(format!(
            "runcell-unpack-{}-{:x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        let (host, outside) = (base.join("host"), base.join("outside"));
        std::fs::create_dir_all(&host).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::set_permissions(&outside, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::os::unix::fs::symlink(&outside, host.join("link")).unwrap();
        let mut builder = tar::Builder::new(Vec::new());
        let mut add = |path: &str, kind: tar::EntryType, mode: u32, data: &[u8]| {
            let mut header = tar::Header::new_gnu();
            header.set_entry_type(kind);
            header.set_mode(mode);
            header.set_size(data.len() as u64);
            builder.append_data(&mut header, path, data).unwrap();
        };
        add("suid", tar::EntryType::Regular, 0o4755, b"x");
        add("sgid-dir/", tar::EntryType::Directory, 0o2777, b"");
        add("link/", tar::EntryType::Directory, 0o777, b"");
        add("link/planted", tar::EntryType::Regular, 0o644, b"x");
        add("dev", tar::EntryType::Char, 0o666, b"");
        let tar = builder.into_inner().unwrap();
        unpack_into(byte_stream(tar), &host, 0).await.unwrap();
        let mode = |p: &str| {
            std::fs::symlink_metadata(host.join(p))
                .unwrap()
                .permissions()
                .mode()
                & 0o7777
        };
        assert_eq!(mode("suid"), 0o755);
        assert_eq!(mode("sgid-dir"), 0o777);
        assert!(!outside.join("planted").exists());
        assert_eq!(
            std::fs::metadata(&outside).unwrap().permissions().mode() & 0o777,
            0o755
        );
        assert!(!host.join("dev").exists());
        std::fs::remove_dir_all(&base).unwrap();
    }

    /// The host folder may be a live run's bind mount: a name in it that keeps trading
    /// places with a link to a folder outside never gets anything written or changed
    /// through it.
    #[tokio::test]
    async fn unpacking_while_a_link_is_swapped_in_never_writes_through_it() {
        use std::os::unix::fs::PermissionsExt;
        let base = std::env::temp_dir().join(format!("runcell-race-{:x}", rand::random::<u64>()));
        let (host, outside) = (base.join("host"), base.join("outside"));
        std::fs::create_dir_all(host.join("d")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::set_permissions(&outside, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::symlink(&outside, host.join("l")).unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let swapper = {
            let (stop, d, l) = (stop.clone(), host.join("d"), host.join("l"));
            std::thread::spawn(move || {
                let cwd = rustix::fs::CWD;
                let flags = rustix::fs::RenameFlags::EXCHANGE;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    rustix::fs::renameat_with(cwd, &d, cwd, &l, flags).unwrap();
                }
            })
        };
        let mut builder = tar::Builder::new(Vec::new());
        for (path, kind, data) in [
            ("d/", tar::EntryType::Directory, &b""[..]),
            ("d/planted", tar::EntryType::Regular, &b"x"[..]),
        ] {
            let mut header = tar::Header::new_gnu();
            header.set_entry_type(kind);
            header.set_mode(0o777);
            header.set_size(data.len() as u64);
            builder.append_data(&mut header, path, data).unwrap();
        }
        let tar = builder.into_inner().unwrap();
        for _ in 0..300 {
            let _ = unpack_into(byte_stream(tar.clone()), &host, 0).await;
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        swapper.join().unwrap();
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
        let mode = std::fs::metadata(&outside).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[tokio::test]
    async fn unpacking_a_cut_archive_fails() {
        let whole = archive(&[("d/a", 10), ("d/b", 5000)]);
        let dir = std::env::temp_dir().join(format!("runcell-unpack-{}", std::process::id()));
        let e = unpack_into(byte_stream(whole[..512 * 3].to_vec()), &dir, 0)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("d/b"), "{e}");
        unpack_into(byte_stream(whole), &dir, 0).await.unwrap();
        assert_eq!(std::fs::read(dir.join("d/b")).unwrap().len(), 5000);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
