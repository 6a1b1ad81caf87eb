//! Files in and out of a run: tar streams with bounded memory, path rules, and the
//! single-file framing that [`crate::RunExt`]'s file helpers build on.
//!
//! [`crate::Run::put_archive`] and [`crate::Run::get_archive`] move tar archives as
//! [`ByteStream`]s, so a file of any size crosses with a few chunks in memory. The
//! single-file helpers frame one file as a tar stream (header, contents, padding) without
//! buffering it, and read one file back out of an archive stream the same way.
//!
//! # A transfer that fails partway is an error
//! Every transfer ends with a success marker its receiver checks, so a short or cut
//! transfer is always an error naming the entry, never a smaller archive or a shorter
//! file: through the exec helper, its `DONE` (and the archive handed out gets its
//! end-of-archive only after it); on the plain path, the tar end-of-archive after whole
//! entries, which [`checked_tar_stream`] requires of the engine's stream (Docker and
//! Podman's archive API, and `tar` through exec, whose exit status counts too). The
//! readers here ([`FileReader`], [`unpack_into`]) read an archive to its very end before
//! they succeed. A file the sender cannot read (permissions, a read error, a file that
//! shrank while it was read) fails the transfer naming it; entries removed before they
//! were read, and fifos, sockets and devices below a directory, are not in the archive.
//!
//! Sparse files: archives carry no holes, so a sparse file crosses as its full size
//! (no cap: its apparent size is what moves). Where runcell writes the file itself, the
//! exec helper's upload, whole 4 KiB blocks of zeros are left as holes again; the
//! engines' extractors (the plain path) and the host-side unpacking write them out.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::stream::{self, BoxStream, StreamExt, TryStreamExt};
use tokio::io::{AsyncRead, AsyncReadExt, ReadBuf};
use tokio_util::io::StreamReader;

use crate::error::{Error, ErrorKind, Result};

/// A stream of bytes: a tar archive or a file's contents.
pub type ByteStream = BoxStream<'static, std::io::Result<Bytes>>;

/// The most [`crate::RunExt::get_file`] reads into memory (64 MiB); larger files need
/// [`crate::RunExt::get_file_stream`].
pub const FILE_LIMIT: u64 = 64 << 20;

const BLOCK: usize = 512;

/// A stream of these bytes, in one chunk.
pub fn byte_stream(bytes: impl Into<Bytes>) -> ByteStream {
    stream::once(std::future::ready(Ok(bytes.into()))).boxed()
}

/// Reads a whole stream into memory, failing past `limit` bytes.
pub async fn collect_bytes(mut stream: ByteStream, limit: u64) -> std::io::Result<Bytes> {
    let mut buf = Vec::new();
    while let Some(chunk) = stream.try_next().await? {
        if (buf.len() + chunk.len()) as u64 > limit {
            return Err(std::io::Error::other(format!("more than {limit} bytes")));
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(buf.into())
}

/// Checks a path inside the run for a file operation and splits it into the parent
/// directory and the file name. It must be absolute, name a file below `/` (no trailing
/// `/`, no empty, `.` or `..` component) and hold no NUL: otherwise
/// [`ErrorKind::InvalidSpec`] naming `path`, before anything is sent.
pub fn split_file_path(path: &str) -> Result<(&str, &str)> {
    let bad = |why: &str| Error::invalid_spec("path", format!("{path:?} {why}"));
    if path.contains('\0') {
        return Err(Error::invalid_spec("path", "must not contain NUL"));
    }
    if !path.starts_with('/') {
        return Err(bad("must be an absolute path"));
    }
    if path == "/" || path.ends_with('/') {
        return Err(bad("must name a file, not a directory"));
    }
    if path[1..]
        .split('/')
        .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return Err(bad("must not have empty, . or .. components"));
    }
    let (dir, name) = path.rsplit_once('/').expect("an absolute path has a /");
    Ok((if dir.is_empty() { "/" } else { dir }, name))
}

/// Checks a path for [`crate::Run::put_archive`] (its directory) and
/// [`crate::Run::get_archive`] (a file or directory): absolute, no NUL, no `.`/`..`.
pub fn validate_dir_path(dir: &str) -> Result<()> {
    if dir.contains('\0') {
        return Err(Error::invalid_spec("path", "must not contain NUL"));
    }
    if !dir.starts_with('/') {
        return Err(Error::invalid_spec(
            "path",
            format!("{dir:?} must be an absolute path"),
        ));
    }
    if dir.split('/').any(|c| c == "." || c == "..") {
        return Err(Error::invalid_spec(
            "path",
            format!("{dir:?} must not have . or .. components"),
        ));
    }
    Ok(())
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn tar_error(e: std::io::Error) -> Error {
    Error::new(ErrorKind::Backend, "could not build a tar archive").with_source(e)
}

/// A tar archive of regular files held in memory: `(path inside the archive, contents,
/// mode)`. For small files the driver itself writes (CA bundles, ...).
pub fn tar_of_files(files: &[(&str, &[u8], u32)]) -> Result<Vec<u8>> {
    let mut builder = tar::Builder::new(Vec::new());
    for (path, contents, mode) in files {
        let mut header = tar::Header::new_gnu();
        header.set_size(contents.len() as u64);
        header.set_mode(*mode);
        header.set_mtime(now_secs());
        header.set_entry_type(tar::EntryType::Regular);
        builder
            .append_data(&mut header, path.trim_start_matches('/'), *contents)
            .map_err(tar_error)?;
    }
    builder.into_inner().map_err(tar_error)
}

/// A tar archive of the directories `paths` (relative; parents come first or are made by
/// the extractor), mode 0755: how a directory is made in a target without a shell.
pub fn tar_of_dirs(paths: &[&str]) -> Result<Vec<u8>> {
    let mut builder = tar::Builder::new(Vec::new());
    for path in paths {
        let mut header = tar::Header::new_gnu();
        header.set_size(0);
        header.set_mode(0o755);
        header.set_mtime(now_secs());
        header.set_entry_type(tar::EntryType::Directory);
        let name = format!("{}/", path.trim_matches('/'));
        builder
            .append_data(&mut header, name, std::io::empty())
            .map_err(tar_error)?;
    }
    builder.into_inner().map_err(tar_error)
}

/// A tar archive of the content of host directory `dir` (paths relative to it), symbolic
/// links kept as links: how a host workspace is copied into a target.
pub fn tar_dir(dir: &std::path::Path) -> Result<Vec<u8>> {
    let mut builder = tar::Builder::new(Vec::new());
    builder.follow_symlinks(false);
    builder
        .append_dir_all(".", dir)
        .and_then(|_| builder.into_inner())
        .map_err(|e| {
            Error::new(
                ErrorKind::Backend,
                format!("cannot archive {}", dir.display()),
            )
            .with_source(e)
        })
}

/// Unpacks a tar stream into host directory `dir`, dropping the first `strip` path
/// components of each entry: only regular files and directories, and only inside `dir`
/// (the archive comes from the sandbox and may hold links meant to write elsewhere on
/// the host). An entry whose way passes a symbolic link on the host (one the host
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
            if !matches!(kind, tar::EntryType::Regular | tar::EntryType::Directory) {
                tracing::debug!(?kind, "unpacking skips a non-regular entry");
                continue;
            }
            let mode = entry.header().mode().map_err(bad)? & 0o777;
            let mtime = entry.header().mtime().unwrap_or(0);
            match unpack_entry(&root, &rest, kind == tar::EntryType::Directory, mode, mtime, &mut entry) {
                Ok(true) => {}
                Ok(false) => {
                    tracing::debug!(path = %rest.display(), "unpacking skips an entry behind a host symlink")
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
) -> std::io::Result<bool> {
    use rustix::fs::{Mode, OFlags, openat};
    use rustix::io::Errno;
    let nofollow = OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let parts: Vec<&std::ffi::OsStr> = rest.iter().collect();
    let Some((name, parents)) = parts.split_last() else {
        return Ok(true);
    };
    let mut dir = root.try_clone()?;
    for p in parents {
        let open = || {
            openat(
                &dir,
                *p,
                OFlags::PATH | OFlags::DIRECTORY | nofollow,
                Mode::empty(),
            )
        };
        dir = match open() {
            Ok(d) => d,
            Err(Errno::NOENT) => {
                match rustix::fs::mkdirat(&dir, *p, Mode::from_raw_mode(0o755)) {
                    Ok(()) | Err(Errno::EXIST) => {}
                    Err(e) => return Err(e.into()),
                }
                match open() {
                    Ok(d) => d,
                    Err(e @ (Errno::LOOP | Errno::NOTDIR)) => return link_or(&dir, p, e),
                    Err(e) => return Err(e.into()),
                }
            }
            Err(e @ (Errno::LOOP | Errno::NOTDIR)) => return link_or(&dir, p, e),
            Err(e) => return Err(e.into()),
        };
    }
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
    let written = (|| {
        std::io::copy(data, &mut file)?;
        rustix::fs::fchmod(&file, perm)?;
        if mtime > 0 {
            let _ =
                file.set_modified(std::time::UNIX_EPOCH + std::time::Duration::from_secs(mtime));
        }
        rustix::fs::renameat(&dir, tmp.as_str(), &dir, *name)?;
        Ok(())
    })();
    if let Err(e) = written {
        let _ = rustix::fs::unlinkat(&dir, tmp.as_str(), rustix::fs::AtFlags::empty());
        return Err(e);
    }
    Ok(true)
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

/// A tar stream of one regular file `name` with `len` bytes read from `contents`, framed
/// as it is read (nothing is buffered beyond a chunk). A reader that ends before `len`
/// bytes, or has more, makes the stream fail, so a short archive is never sent as whole.
pub fn file_tar_stream(
    name: &str,
    contents: impl AsyncRead + Send + Unpin + 'static,
    len: u64,
    mode: u32,
) -> Result<ByteStream> {
    let mut header = tar::Header::new_gnu();
    header.set_size(len);
    header.set_mode(mode);
    header.set_mtime(now_secs());
    header.set_entry_type(tar::EntryType::Regular);
    // `append_data` writes a GNU long-name entry first where the name needs one.
    let mut head = tar::Builder::new(Vec::new());
    head.append_data(&mut header, name, std::io::empty())
        .map_err(tar_error)?;
    let mut head = head.into_inner().map_err(tar_error)?;
    // `into_inner` appended the two end-of-archive blocks, and the entry's empty body was
    // written with `len` in its header: keep only the headers.
    head.truncate(head.len() - 2 * BLOCK);
    let padding = (BLOCK - (len % BLOCK as u64) as usize) % BLOCK;
    let tail = vec![0u8; padding + 2 * BLOCK];
    let body = exact_stream(contents, len);
    Ok(byte_stream(head)
        .chain(body)
        .chain(byte_stream(tail))
        .boxed())
}

/// The bytes of `reader`, which must end after exactly `len` bytes.
fn exact_stream(reader: impl AsyncRead + Send + Unpin + 'static, len: u64) -> ByteStream {
    const CHUNK: u64 = 64 << 10;
    stream::try_unfold((reader, len), |(mut reader, left)| async move {
        if left == 0 {
            let mut probe = [0u8; 1];
            if reader.read(&mut probe).await? != 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "the contents are longer than the length given",
                ));
            }
            return Ok(None);
        }
        let mut buf = vec![0u8; left.min(CHUNK) as usize];
        let n = reader.read(&mut buf).await?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("the contents ended {left} bytes short of the length given"),
            ));
        }
        buf.truncate(n);
        Ok(Some((Bytes::from(buf), (reader, left - n as u64))))
    })
    .boxed()
}

/// One regular file read out of a tar stream: its size and a reader of exactly its bytes.
/// The reader fails, naming the file, when the archive ends before them, and ends only
/// once the rest of the archive arrived whole (its end-of-archive: the transfer's success
/// marker), so a cut transfer is never a shorter file.
pub struct FileReader {
    size: u64,
    mode: u32,
    reader: Pin<Box<dyn AsyncRead + Send>>,
}

/// Exactly `left` bytes of `inner`, then the rest of `inner` read and dropped.
struct ExactBody<R> {
    inner: R,
    left: u64,
    drained: bool,
    path: String,
}

impl<R: AsyncRead + Unpin> AsyncRead for ExactBody<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        if this.left > 0 {
            let want = (buf.remaining() as u64).min(this.left) as usize;
            let mut part = ReadBuf::new(buf.initialize_unfilled_to(want));
            std::task::ready!(Pin::new(&mut this.inner).poll_read(cx, &mut part))?;
            let n = part.filled().len();
            if n == 0 {
                return Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!(
                        "the archive was cut inside {}: {} bytes missing",
                        this.path, this.left
                    ),
                )));
            }
            buf.advance(n);
            this.left -= n as u64;
            return Poll::Ready(Ok(()));
        }
        while !this.drained {
            let mut scratch = [0u8; 4096];
            let mut rest = ReadBuf::new(&mut scratch);
            std::task::ready!(Pin::new(&mut this.inner).poll_read(cx, &mut rest))?;
            if rest.filled().is_empty() {
                this.drained = true;
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl FileReader {
    /// The file's size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The file's permission bits.
    pub fn mode(&self) -> u32 {
        self.mode
    }

    /// Reads the whole file, failing past `limit` bytes (checked before reading).
    pub async fn read_all(mut self, limit: u64, path: &str) -> Result<Vec<u8>> {
        if self.size > limit {
            return Err(Error::invalid_spec(
                "path",
                format!(
                    "{path} has {} bytes, more than the {limit} that fit in memory here: read it as a stream",
                    self.size
                ),
            ));
        }
        let mut buf = Vec::with_capacity(self.size as usize);
        self.reader
            .read_to_end(&mut buf)
            .await
            .map_err(|e| unreadable(path, e))?;
        Ok(buf)
    }
}

impl std::fmt::Debug for FileReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileReader")
            .field("size", &self.size)
            .field("mode", &format_args!("{:o}", self.mode))
            .finish_non_exhaustive()
    }
}

impl AsyncRead for FileReader {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        self.reader.as_mut().poll_read(cx, buf)
    }
}

fn unreadable(path: &str, e: std::io::Error) -> Error {
    Error::new(ErrorKind::Backend, "unreadable tar archive")
        .with("path", path)
        .with_source(e)
}

/// The first entry of a tar stream (as [`crate::Run::get_archive`] returns it) as a
/// regular file. A directory or another kind of entry is [`ErrorKind::InvalidSpec`]
/// naming `path`; an empty archive is [`ErrorKind::NotFound`]. Only headers are held in
/// memory; the contents are read as the caller reads.
pub async fn file_from_tar_stream(tar: ByteStream, path: &str) -> Result<FileReader> {
    let mut reader = StreamReader::new(checked_tar_stream(tar));
    let mut block = [0u8; BLOCK];
    loop {
        match reader.read_exact(&mut block).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Err(Error::new(ErrorKind::NotFound, "no such file in the run")
                    .with_field("path")
                    .with("path", path));
            }
            Err(e) => return Err(unreadable(path, e)),
        }
        if block.iter().all(|b| *b == 0) {
            // An empty archive, unless the rest of the stream says why it is empty (tar
            // in the run that could not read the file writes an empty archive, then fails).
            // A stream that ends saying the path is not there (`NotFound`) is a missing
            // file too.
            match tokio::io::copy(&mut reader, &mut tokio::io::sink()).await {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(unreadable(path, e)),
            }
            return Err(Error::new(ErrorKind::NotFound, "no such file in the run")
                .with_field("path")
                .with("path", path));
        }
        let header = tar::Header::from_byte_slice(&block);
        let size = header.entry_size().map_err(|e| unreadable(path, e))?;
        let mode = header.mode().unwrap_or(0o644);
        match header.entry_type() {
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                let body = ExactBody {
                    inner: reader,
                    left: size,
                    drained: false,
                    path: path.to_string(),
                };
                return Ok(FileReader {
                    size,
                    mode,
                    reader: Box::pin(body),
                });
            }
            // Metadata entries (long names, PAX headers) precede the real one: skip them.
            tar::EntryType::GNULongName
            | tar::EntryType::GNULongLink
            | tar::EntryType::XHeader
            | tar::EntryType::XGlobalHeader => {
                let padded = size.div_ceil(BLOCK as u64) * BLOCK as u64;
                let skipped =
                    tokio::io::copy(&mut (&mut reader).take(padded), &mut tokio::io::sink())
                        .await
                        .map_err(|e| unreadable(path, e))?;
                if skipped != padded {
                    return Err(unreadable(
                        path,
                        std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "truncated archive"),
                    ));
                }
            }
            tar::EntryType::Directory => {
                return Err(Error::invalid_spec(
                    "path",
                    format!("{path} is a directory, not a regular file"),
                ));
            }
            other => {
                return Err(Error::invalid_spec(
                    "path",
                    format!("{path} is not a regular file ({other:?})"),
                ));
            }
        }
    }
}

// ---- checking a tar stream as it passes -------------------------------------------------

/// Follows a tar stream block by block as it passes, so that a short or cut transfer is
/// an error naming the entry it cut, never an archive that merely looks smaller. The
/// engines' archive streams (and `tar` through exec) carry no success marker of their
/// own: the tar format's end-of-archive (two zero blocks) after whole entries is the
/// marker, and [`TarCheck::finish`] requires it.
///
/// Checked: every header's checksum; every entry's data (its header's size, or a PAX
/// `size`) and padding fully present; GNU long names, PAX headers and GNU sparse
/// extension blocks followed; no lone zero block before more entries (readers such as
/// the `tar` crate stop at the first zero block, silently dropping what follows); the
/// stream not ending before the two zero blocks. Bytes after the end-of-archive (record
/// padding) are not looked at.
#[derive(Debug, Default)]
pub struct TarCheck {
    /// A header block being assembled.
    block: Vec<u8>,
    state: CheckState,
    /// The current (or last) entry's name, for messages.
    entry: String,
    /// Zero blocks in a row.
    zeros: u8,
    /// A GNU long name or PAX `path` for the next entry.
    next_name: Option<String>,
    /// A PAX `size` for the next entry.
    next_size: Option<u64>,
}

#[derive(Debug, Default)]
enum CheckState {
    #[default]
    Header,
    /// An entry's data: `left` bytes of it, then `pad` bytes of padding.
    Data {
        size: u64,
        left: u64,
        pad: u64,
        /// Kept for a metadata entry (long name, PAX header), up to [`META_LIMIT`].
        meta: Option<(u8, Vec<u8>)>,
    },
    /// GNU sparse extension blocks before the data.
    SparseExt { size: u64 },
    /// After the end-of-archive.
    End,
}

/// The most of a metadata entry (GNU long name, PAX header) kept to read names from.
const META_LIMIT: usize = 1 << 20;

fn check_error(message: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, message)
}

impl TarCheck {
    /// A check at the start of a stream.
    pub fn new() -> TarCheck {
        TarCheck::default()
    }

    /// The name of the entry being read (or the last one), empty before the first.
    pub fn entry(&self) -> &str {
        &self.entry
    }

    /// Whether the end-of-archive was seen.
    pub fn ended(&self) -> bool {
        matches!(self.state, CheckState::End)
    }

    fn after(&self) -> String {
        if self.entry.is_empty() {
            "before its first entry".to_string()
        } else {
            format!("after {}", self.entry)
        }
    }

    /// Follows the next bytes of the stream.
    pub fn feed(&mut self, mut data: &[u8]) -> std::io::Result<()> {
        while !data.is_empty() {
            match &mut self.state {
                CheckState::End => return Ok(()),
                CheckState::Data {
                    left, pad, meta, ..
                } => {
                    let n = (data.len() as u64).min(left.saturating_add(*pad)) as usize;
                    let body = (n as u64).min(*left) as usize;
                    if let Some((_, buf)) = meta.as_mut() {
                        let keep = body.min(META_LIMIT.saturating_sub(buf.len()));
                        buf.extend_from_slice(&data[..keep]);
                    }
                    *left -= body as u64;
                    *pad -= (n - body) as u64;
                    data = &data[n..];
                    if *left == 0 && *pad == 0 {
                        let state = std::mem::take(&mut self.state);
                        if let CheckState::Data {
                            meta: Some((kind, buf)),
                            ..
                        } = state
                        {
                            self.metadata(kind, &buf);
                        }
                    }
                }
                CheckState::Header | CheckState::SparseExt { .. } => {
                    let n = (BLOCK - self.block.len()).min(data.len());
                    self.block.extend_from_slice(&data[..n]);
                    data = &data[n..];
                    if self.block.len() == BLOCK {
                        let block = std::mem::take(&mut self.block);
                        self.block_done(&block)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// A whole header (or sparse extension) block.
    fn block_done(&mut self, block: &[u8]) -> std::io::Result<()> {
        if let CheckState::SparseExt { size } = self.state {
            // `isextended` of a GNU sparse extension block.
            if block[504] == 0 {
                self.state = data_state(size, None);
            }
            return Ok(());
        }
        if block.iter().all(|b| *b == 0) {
            self.zeros += 1;
            if self.zeros == 2 {
                self.state = CheckState::End;
            }
            return Ok(());
        }
        if self.zeros > 0 {
            return Err(check_error(format!(
                "a lone zero block in the archive {}: what follows would be dropped",
                self.after()
            )));
        }
        let header = tar::Header::from_byte_slice(block);
        let sum: u32 = block
            .iter()
            .enumerate()
            .map(|(i, b)| {
                if (148..156).contains(&i) {
                    32
                } else {
                    u32::from(*b)
                }
            })
            .sum();
        if header.cksum().ok() != Some(sum) {
            return Err(check_error(format!(
                "not a tar header (bad checksum) {}",
                self.after()
            )));
        }
        let kind = header.entry_type();
        let meta = matches!(
            kind,
            tar::EntryType::GNULongName
                | tar::EntryType::GNULongLink
                | tar::EntryType::XHeader
                | tar::EntryType::XGlobalHeader
        );
        // A PAX size is the next real entry's, never an extension header's (as the tar
        // crate reads it).
        let pending = if meta { None } else { self.next_size.take() };
        let size = match pending {
            Some(s) => s,
            None => header
                .entry_size()
                .map_err(|e| check_error(format!("a bad entry size {}: {e}", self.after())))?,
        };
        // No file is larger: a size past it (a base-256 field, a PAX record) is a lie.
        if size > i64::MAX as u64 {
            return Err(check_error(format!(
                "a bad entry size {size} {}",
                self.after()
            )));
        }
        if meta {
            self.state = data_state(size, Some((kind.as_byte(), Vec::new())));
            return Ok(());
        }
        self.entry = match self.next_name.take() {
            Some(name) => name,
            None => String::from_utf8_lossy(&header.path_bytes()).into_owned(),
        };
        // GNU sparse: `isextended` at 482 of the old GNU header.
        self.state = if kind == tar::EntryType::GNUSparse && block[482] != 0 {
            CheckState::SparseExt { size }
        } else {
            data_state(size, None)
        };
        Ok(())
    }

    /// A long name or a PAX header, for the next entry.
    fn metadata(&mut self, kind: u8, buf: &[u8]) {
        match kind {
            b'L' => {
                let name = buf.split(|b| *b == 0).next().unwrap_or_default();
                self.next_name = Some(String::from_utf8_lossy(name).into_owned());
            }
            b'x' => {
                // Records: "<len> <key>=<value>\n".
                let mut rest = buf;
                while let Some(sp) = rest.iter().position(|b| *b == b' ') {
                    let Some(len) = std::str::from_utf8(&rest[..sp])
                        .ok()
                        .and_then(|l| l.parse::<usize>().ok())
                        .filter(|l| *l > sp && *l <= rest.len())
                    else {
                        break;
                    };
                    let record = &rest[sp + 1..len];
                    let record = record.strip_suffix(b"\n").unwrap_or(record);
                    if let Some(eq) = record.iter().position(|b| *b == b'=') {
                        let (key, value) = (&record[..eq], &record[eq + 1..]);
                        match key {
                            b"path" => {
                                self.next_name = Some(String::from_utf8_lossy(value).into_owned())
                            }
                            b"size" => {
                                self.next_size =
                                    std::str::from_utf8(value).ok().and_then(|v| v.parse().ok())
                            }
                            _ => {}
                        }
                    }
                    rest = &rest[len..];
                }
            }
            _ => {}
        }
    }

    /// The stream ended: `Ok` only after the end-of-archive.
    pub fn finish(&self) -> std::io::Result<()> {
        match &self.state {
            CheckState::End => Ok(()),
            CheckState::Data { size, left, .. } if *left > 0 => Err(check_error(format!(
                "the archive was cut inside {}: {} of its {size} bytes arrived",
                self.entry,
                size - left
            ))),
            _ => Err(check_error(format!(
                "the archive was cut {}: its end-of-archive marker never came",
                self.after()
            ))),
        }
    }
}

fn data_state(size: u64, meta: Option<(u8, Vec<u8>)>) -> CheckState {
    if size == 0 {
        // Nothing follows the header; a metadata entry without data names nothing.
        return CheckState::Header;
    }
    CheckState::Data {
        size,
        left: size,
        pad: (BLOCK as u64 - size % BLOCK as u64) % BLOCK as u64,
        meta,
    }
}

/// `tar` passed through a [`TarCheck`]: the same bytes, but a stream that ends before its
/// end-of-archive, inside an entry, or with a malformed header fails with an error naming
/// the entry, instead of ending. An error of `tar` itself is passed on with the entry it
/// interrupted.
pub fn checked_tar_stream(tar: ByteStream) -> ByteStream {
    stream::unfold(Some((tar, TarCheck::new())), |state| async move {
        let (mut tar, mut check) = state?;
        match tar.next().await {
            Some(Ok(chunk)) => match check.feed(&chunk) {
                Ok(()) => Some((Ok(chunk), Some((tar, check)))),
                Err(e) => Some((Err(e), None)),
            },
            Some(Err(e)) => {
                let e = if check.entry().is_empty()
                    || check.ended()
                    || e.to_string().contains(check.entry())
                {
                    e
                } else {
                    std::io::Error::new(e.kind(), format!("{e} (while reading {})", check.entry()))
                };
                Some((Err(e), None))
            }
            None => check.finish().err().map(|e| (Err(e), None)),
        }
    })
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_paths_are_checked_and_split() {
        assert_eq!(split_file_path("/a/b.txt").unwrap(), ("/a", "b.txt"));
        assert_eq!(split_file_path("/b").unwrap(), ("/", "b"));
        for bad in [
            "", "b", "/", "/a/", "/a//b", "/a/./b", "/a/../b", "/a\0b", "/..",
        ] {
            let e = split_file_path(bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidSpec, "{bad:?}");
            assert_eq!(e.field(), Some("path"), "{bad:?}");
        }
    }

    async fn round_trip(name: &str, data: Vec<u8>) -> (Vec<u8>, Vec<u8>) {
        let len = data.len() as u64;
        let tar = file_tar_stream(name, std::io::Cursor::new(data), len, 0o640).unwrap();
        let whole = collect_bytes(tar, u64::MAX).await.unwrap().to_vec();
        let back = file_from_tar_stream(byte_stream(whole.clone()), "/x")
            .await
            .unwrap();
        assert_eq!(back.mode(), 0o640);
        (whole, back.read_all(u64::MAX, "/x").await.unwrap())
    }

    #[tokio::test]
    async fn one_file_round_trips_through_a_tar_stream() {
        for size in [0usize, 1, 511, 512, 513, 70_000] {
            let data: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
            let (whole, back) = round_trip("f.bin", data.clone()).await;
            assert_eq!(back, data, "size {size}");
            assert_eq!(whole.len() % BLOCK, 0);
            // The `tar` crate reads what we framed.
            let mut archive = tar::Archive::new(&whole[..]);
            let mut entry = archive.entries().unwrap().next().unwrap().unwrap();
            let mut read = Vec::new();
            std::io::Read::read_to_end(&mut entry, &mut read).unwrap();
            assert_eq!(read, data);
        }
        // A name longer than a ustar header holds goes through a long-name entry.
        let long = "n".repeat(300);
        let (_, back) = round_trip(&long, b"long".to_vec()).await;
        assert_eq!(back, b"long");
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

    #[tokio::test]
    async fn a_reader_of_the_wrong_length_fails_the_stream() {
        for (data, len) in [(vec![1u8; 10], 11u64), (vec![1u8; 10], 9)] {
            let tar = file_tar_stream("f", std::io::Cursor::new(data), len, 0o644).unwrap();
            assert!(collect_bytes(tar, u64::MAX).await.is_err(), "len {len}");
        }
    }

    #[tokio::test]
    async fn directories_and_empty_archives_are_typed() {
        let mut builder = tar::Builder::new(Vec::new());
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Directory);
        header.set_size(0);
        builder
            .append_data(&mut header, "workspace", std::io::empty())
            .unwrap();
        let tar = builder.into_inner().unwrap();
        let e = file_from_tar_stream(byte_stream(tar), "/workspace")
            .await
            .unwrap_err();
        assert_eq!(
            (e.kind(), e.field()),
            (ErrorKind::InvalidSpec, Some("path"))
        );
        // An archive of nothing but its end is "no such file"; no archive at all is a
        // cut transfer.
        let e = file_from_tar_stream(byte_stream(vec![0u8; 2 * BLOCK]), "/x")
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotFound);
        let e = file_from_tar_stream(byte_stream(Bytes::new()), "/x")
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Backend, "{e}");
        let big = file_from_tar_stream(
            byte_stream(
                collect_bytes(
                    file_tar_stream("f", std::io::Cursor::new(vec![0u8; 100]), 100, 0o644).unwrap(),
                    u64::MAX,
                )
                .await
                .unwrap(),
            ),
            "/f",
        )
        .await
        .unwrap();
        let e = big.read_all(10, "/f").await.unwrap_err();
        assert_eq!(e.field(), Some("path"));
    }
    /// A tar archive of `files` (name, size) as the `tar` crate writes it.
    fn archive(files: &[(&str, usize)]) -> Vec<u8> {
        let mut builder = tar::Builder::new(Vec::new());
        for (name, size) in files {
            let mut header = tar::Header::new_gnu();
            header.set_size(*size as u64);
            header.set_mode(0o644);
            header.set_entry_type(tar::EntryType::Regular);
            builder
                .append_data(&mut header, name, &vec![7u8; *size][..])
                .unwrap();
        }
        builder.into_inner().unwrap()
    }

    fn check_all(data: &[u8], step: usize) -> std::io::Result<()> {
        let mut check = TarCheck::new();
        for chunk in data.chunks(step.max(1)) {
            check.feed(chunk)?;
        }
        check.finish()
    }

    #[test]
    fn the_check_passes_whole_archives_in_any_chunking() {
        let long = format!("dir/{}", "n".repeat(300));
        let whole = archive(&[("dir/a", 0), ("dir/b", 1), (&long, 70_000), ("dir/c", 512)]);
        for step in [1, 7, 511, 512, 513, 65536, whole.len()] {
            check_all(&whole, step).unwrap_or_else(|e| panic!("step {step}: {e}"));
        }
        // Record padding after the end is fine.
        let mut padded = whole.clone();
        padded.extend_from_slice(&[0u8; 8192]);
        check_all(&padded, 4096).unwrap();
        // One regular file framed by `file_tar_stream`'s way (GNU long name included).
        let mut check = TarCheck::new();
        check.feed(&archive(&[(&long, 3)])).unwrap();
        assert!(check.ended());
        assert_eq!(check.entry(), long);
    }

    #[test]
    fn the_check_names_the_entry_a_cut_archive_ends_in() {
        let whole = archive(&[("dir/a", 100), ("dir/big", 5000), ("dir/c", 10)]);
        // Cut inside dir/big's data: named, with how much arrived.
        let cut = 512 + 512 + 512 + 1000;
        let e = check_all(&whole[..cut], 333).unwrap_err();
        assert!(e.to_string().contains("dir/big"), "{e}");
        assert!(e.to_string().contains("1000 of its 5000 bytes"), "{e}");
        // Cut at an entry boundary (what a reader that stops at EOF takes for the end).
        let boundary = 512 + 512;
        let e = check_all(&whole[..boundary], 512).unwrap_err();
        assert!(e.to_string().contains("after dir/a"), "{e}");
        // Cut after one of the two end blocks, inside a header, and before anything.
        for n in [whole.len() - 512 - (whole.len() % 512), 512 + 512 + 100, 0] {
            assert!(check_all(&whole[..n], 512).is_err(), "cut at {n}");
        }
        // What a builder dropped on error writes: the end right after a cut entry.
        let mut dropped = whole[..512 + 512 + 512 + 1000].to_vec();
        dropped.extend_from_slice(&[0u8; 1024]);
        let e = check_all(&dropped, 512).unwrap_err();
        assert!(e.to_string().contains("dir/big"), "{e}");
    }

    #[test]
    fn a_lying_entry_size_is_refused_not_looped_on() {
        // A base-256 size of u64::MAX: once `left + pad` wrapped to 0 and the check spun.
        let mut header = tar::Header::new_gnu();
        header.set_path("big").unwrap();
        header.set_mode(0o644);
        header.set_size(0);
        let block = header.as_mut_bytes();
        block[124] = 0x80;
        block[125..136].fill(0xff);
        header.set_cksum();
        let mut data = header.as_bytes().to_vec();
        data.extend_from_slice(&[7u8; 4096]);
        let started = std::time::Instant::now();
        let e = check_all(&data, 512).unwrap_err();
        assert!(e.to_string().contains("bad entry size"), "{e}");
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
    }

    #[test]
    fn the_check_refuses_a_lone_zero_block_and_a_bad_header() {
        let a = archive(&[("a", 10)]);
        let b = archive(&[("b", 10)]);
        // "a", one zero block, then "b": a reader stopping at the zero block drops "b".
        let mut lone = a[..1024].to_vec();
        lone.extend_from_slice(&[0u8; 512]);
        lone.extend_from_slice(&b);
        let e = check_all(&lone, 512).unwrap_err();
        assert!(
            e.to_string()
                .contains("lone zero block in the archive after a"),
            "{e}"
        );
        let mut bad = a.clone();
        bad[0] ^= 1;
        let e = check_all(&bad, 512).unwrap_err();
        assert!(e.to_string().contains("checksum"), "{e}");
    }

    #[test]
    fn the_check_follows_pax_sizes_and_names() {
        // A PAX header naming the entry and giving its size (as Go's writer does).
        let mut builder = tar::Builder::new(Vec::new());
        builder
            .append_pax_extensions([("path", &b"pax/name"[..]), ("size", &b"600"[..])])
            .unwrap();
        let mut header = tar::Header::new_ustar();
        header.set_size(600);
        header.set_mode(0o644);
        header.set_entry_type(tar::EntryType::Regular);
        builder
            .append_data(&mut header, "short", &[1u8; 600][..])
            .unwrap();
        let whole = builder.into_inner().unwrap();
        check_all(&whole, 100).unwrap();
        let e = check_all(&whole[..whole.len() - 1024 - 512], 100).unwrap_err();
        assert!(e.to_string().contains("pax/name"), "{e}");
    }

    #[tokio::test]
    async fn checked_streams_fail_where_the_transfer_was_cut() {
        let whole = archive(&[("d/a", 10), ("d/b", 70_000)]);
        let ok = checked_tar_stream(byte_stream(whole.clone()));
        assert_eq!(collect_bytes(ok, u64::MAX).await.unwrap(), whole);
        let cut = checked_tar_stream(byte_stream(whole[..3000].to_vec()));
        let e = collect_bytes(cut, u64::MAX).await.unwrap_err();
        assert!(e.to_string().contains("d/b"), "{e}");
        // An error of the source names the entry it interrupted.
        let broken = stream::iter(vec![
            Ok(Bytes::from(whole[..3000].to_vec())),
            Err(std::io::Error::other("connection reset")),
        ])
        .boxed();
        let e = collect_bytes(checked_tar_stream(broken), u64::MAX)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("connection reset"), "{e}");
        assert!(e.to_string().contains("d/b"), "{e}");
    }

    #[tokio::test]
    async fn a_file_read_from_a_cut_archive_fails_naming_it() {
        let whole = collect_bytes(
            file_tar_stream("f", std::io::Cursor::new(vec![5u8; 10_000]), 10_000, 0o644).unwrap(),
            u64::MAX,
        )
        .await
        .unwrap();
        // Cut inside the data, or after all of it but before the end-of-archive: either
        // way the read fails, never a short or "complete" file.
        for n in [512 + 4000, whole.len() - 1024] {
            let reader = file_from_tar_stream(byte_stream(whole[..n].to_vec()), "/w/f")
                .await
                .unwrap();
            let e = reader.read_all(u64::MAX, "/w/f").await.unwrap_err();
            assert!(e.to_string().contains("/w/f"), "cut at {n}: {e}");
        }
        let reader = file_from_tar_stream(byte_stream(whole.clone()), "/w/f")
            .await
            .unwrap();
        assert_eq!(
            reader.read_all(u64::MAX, "/w/f").await.unwrap(),
            vec![5u8; 10_000]
        );
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
