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

mod host;
mod tarcheck;

pub use host::{tar_dir_stream, unpack_into};
pub use tarcheck::{TarCheck, checked_tar_stream};

/// A writer that passes what it is given on and keeps its SHA-256 and length (a layer's
/// digest as it is written, for the drivers' snapshots).
pub struct Sha256Writer<W> {
    inner: W,
    hash: sha2::Sha256,
    len: u64,
}

impl<W: std::io::Write> Sha256Writer<W> {
    /// Writes to `inner`.
    pub fn new(inner: W) -> Self {
        Sha256Writer {
            inner,
            hash: <sha2::Sha256 as sha2::Digest>::new(),
            len: 0,
        }
    }

    /// The writer, the digest of what went through (`sha256:<hex>`) and its length.
    pub fn finish(self) -> (W, String, u64) {
        let digest = format!("sha256:{:x}", sha2::Digest::finalize(self.hash));
        (self.inner, digest, self.len)
    }
}

impl<W: std::io::Write> std::io::Write for Sha256Writer<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        sha2::Digest::update(&mut self.hash, &buf[..n]);
        self.len += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
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
    pub(super) fn archive(files: &[(&str, usize)]) -> Vec<u8> {
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

    pub(super) fn check_all(data: &[u8], step: usize) -> std::io::Result<()> {
        let mut check = TarCheck::new();
        for chunk in data.chunks(step.max(1)) {
            check.feed(chunk)?;
        }
        check.finish()
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
}
