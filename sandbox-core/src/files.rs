//! Files in and out of a run: tar streams with bounded memory, path rules, and the
//! single-file framing that [`crate::RunExt`]'s file helpers build on.
//!
//! [`crate::Run::put_archive`] and [`crate::Run::get_archive`] move tar archives as
//! [`ByteStream`]s, so a file of any size crosses with a few chunks in memory. The
//! single-file helpers frame one file as a tar stream (header, contents, padding) without
//! buffering it, and read one file back out of an archive stream the same way.

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
/// the host). Streams: memory stays bounded whatever the size.
pub async fn unpack_into(tar: ByteStream, dir: &std::path::Path, strip: usize) -> Result<()> {
    let reader = tokio_util::io::SyncIoBridge::new(StreamReader::new(tar));
    let dir = dir.to_path_buf();
    let bad = |e: std::io::Error| {
        Error::new(ErrorKind::Backend, "cannot unpack the workspace").with_source(e)
    };
    tokio::task::spawn_blocking(move || {
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
            match entry.header().entry_type() {
                tar::EntryType::Regular | tar::EntryType::Directory => {
                    // `unpack_in` refuses `..` and absolute paths.
                    let target = dir.join(&rest);
                    if rest
                        .components()
                        .any(|c| !matches!(c, std::path::Component::Normal(_)))
                    {
                        continue;
                    }
                    if let Some(parent) = target.parent() {
                        std::fs::create_dir_all(parent).map_err(bad)?;
                    }
                    entry.unpack(&target).map_err(bad)?;
                }
                other => tracing::debug!(?other, "unpacking skips a non-regular entry"),
            }
        }
        Ok(())
    })
    .await
    .map_err(|e| Error::new(ErrorKind::Backend, "unpacking panicked").with_source(e))?
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
pub struct FileReader {
    size: u64,
    mode: u32,
    reader: Pin<Box<dyn AsyncRead + Send>>,
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
    let mut reader = StreamReader::new(tar);
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
            return Err(Error::new(ErrorKind::NotFound, "no such file in the run")
                .with_field("path")
                .with("path", path));
        }
        let header = tar::Header::from_byte_slice(&block);
        let size = header.entry_size().map_err(|e| unreadable(path, e))?;
        let mode = header.mode().unwrap_or(0o644);
        match header.entry_type() {
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                let body = reader.take(size);
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
        let e = file_from_tar_stream(byte_stream(Bytes::new()), "/x")
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotFound);
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
}
