//! `put_archive` / `get_archive` through the helper: core reads and writes the tar
//! stream, the helper only creates and reads files (no `tar` needed in the image). And
//! for snapshots: the run's base listing (`BASE`, at create) and the layer of what
//! changed since (`LAYER`, a tar stream as `get_archive`'s).

use std::io::{self, Read};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use tokio::sync::{Semaphore, mpsc};
use tokio_util::io::{StreamReader, SyncIoBridge};

use super::proto::{self, Enc, Entry, FileError};
use super::session::{ANSWER_TIMEOUT, Event, Receiver, Session};
use crate::error::{Error, ErrorKind, Result};
use crate::exec::OutputChunk;
use crate::files::ByteStream;

/// How long a `BASE` may take (it walks the root filesystem of the whole image), and a
/// `LAYER` until its first entry (it walks everything unchanged before it).
pub(crate) const WALK_TIMEOUT: Duration = Duration::from_secs(300);

fn file_error(kind: FileError, path: &str, message: &str, op: &str) -> Error {
    // The snapshot walks name paths below `/`.
    let walk = matches!(op, "base" | "layer");
    let what = match (path.is_empty(), walk) {
        (true, _) => message.to_string(),
        (false, true) => format!("/{path}: {message}"),
        (false, false) => format!("{path}: {message}"),
    };
    if walk {
        let e = match kind {
            // A name of the run's that a layer cannot carry (`.wh.`).
            FileError::Invalid => Error::unsupported("snapshot", what),
            _ => Error::new(ErrorKind::Backend, what),
        };
        return e.with_operation(if op == "base" {
            "record the run's base listing"
        } else {
            "read the run's changes"
        });
    }
    match kind {
        FileError::NotFound => Error::new(ErrorKind::NotFound, what).with_field("path"),
        // Reading below a non-directory: the path does not exist.
        FileError::NotDir if op == "get" => {
            Error::new(ErrorKind::NotFound, what).with_field("path")
        }
        FileError::IsDir | FileError::NotDir => Error::invalid_spec(
            "path",
            format!("would replace a directory with a non-directory (or the reverse): {what}"),
        ),
        FileError::Invalid | FileError::Untrusted => Error::invalid_spec("path", what),
        FileError::Denied | FileError::Other => Error::new(ErrorKind::Backend, what),
    }
    .with_operation(if op == "put" {
        "upload archive"
    } else {
        "download archive"
    })
}

fn lost(why: String) -> Error {
    Error::new(
        ErrorKind::Backend,
        format!("the exec helper's stream broke: {why}"),
    )
}

/// Extracts `tar` into `dir` through the helper.
pub(crate) async fn put(session: &Arc<Session>, dir: &str, tar: ByteStream) -> Result<()> {
    let (id, mut events, window) = session.file_op(proto::PUT, dir)?;
    let window = window.expect("a PUT has a stdin window");
    // However this ends (answer, error, or the future dropped), the sender stops and
    // still ends the operation with `STDIN_EOF`.
    struct CloseOnDrop(Arc<Semaphore>);
    impl Drop for CloseOnDrop {
        fn drop(&mut self) {
            self.0.close();
        }
    }
    let _close = CloseOnDrop(window.clone());
    let sender = {
        let (session, window) = (session.clone(), window.clone());
        // Checked: a source that ends before its end-of-archive (or inside an entry) is an
        // error, not a smaller upload.
        let reader = SyncIoBridge::new(StreamReader::new(crate::files::checked_tar_stream(tar)));
        let handle = tokio::runtime::Handle::current();
        tokio::task::spawn_blocking(move || {
            let sent = send_entries(&session, id, &window, reader, &handle);
            // Whatever happened, the operation ends: the helper then drops its state.
            let _ = session.send_frame(Enc::frame(proto::STDIN_EOF, id).finish());
            sent
        })
    };
    tokio::pin!(sender);
    let mut sent = false;
    loop {
        tokio::select! {
            event = events.next() => {
                window.close();
                return match event {
                    // `DONE` answers the `STDIN_EOF` the sender sends however it ended: the
                    // upload succeeded only if the sender did (it has finished or is about to).
                    Some(Event::Done) if !sent => match (&mut sender).await {
                        Ok(r) => r,
                        Err(e) => Err(Error::new(ErrorKind::Backend, format!("the upload task failed: {e}"))),
                    },
                    Some(Event::Done) => Ok(()),
                    Some(Event::FileFailed(k, path, msg)) => Err(file_error(k, &path, &msg, "put")),
                    Some(Event::Lost(why)) => Err(lost(why)),
                    other => Err(lost(format!("unexpected answer to a PUT: {other:?}"))),
                };
            }
            r = &mut sender, if !sent => {
                sent = true;
                match r {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        // The helper discards a half-sent operation (ended by the sender).
                        window.close();
                        events.quiet();
                        return Err(e);
                    }
                    Err(e) => return Err(Error::new(ErrorKind::Backend, format!("the upload task failed: {e}"))),
                }
            }
        }
    }
}

/// Whether `path` is relative and made of plain names (no empty, `.` or `..` component).
fn plain_relative(path: &[u8]) -> bool {
    !path.is_empty()
        && path
            .split(|&b| b == b'/')
            .all(|c| !c.is_empty() && c != b"." && c != b"..")
}

/// An archive's path as tar extracts it: leading `/` and `./` and trailing `/` dropped.
fn relative(mut path: &[u8]) -> &[u8] {
    loop {
        if let Some(rest) = path.strip_prefix(b"/") {
            path = rest;
        } else if let Some(rest) = path.strip_prefix(b"./") {
            path = rest;
        } else {
            break;
        }
    }
    while let Some(rest) = path.strip_suffix(b"/") {
        path = rest;
    }
    path
}

/// Reads the tar (blocking) and sends each entry and its data within the window.
fn send_entries(
    session: &Session,
    id: u32,
    window: &Semaphore,
    reader: impl Read,
    handle: &tokio::runtime::Handle,
) -> Result<()> {
    let bad = |e: io::Error| Error::invalid_spec("tar", format!("not a readable tar stream: {e}"));
    let mut archive = tar::Archive::new(reader);
    for entry in archive.entries().map_err(bad)? {
        let mut entry = entry.map_err(bad)?;
        let header = entry.header();
        let kind = match header.entry_type() {
            tar::EntryType::Regular | tar::EntryType::Continuous => proto::REGULAR,
            tar::EntryType::Directory => proto::DIRECTORY,
            tar::EntryType::Symlink => proto::SYMLINK,
            tar::EntryType::Link => proto::HARDLINK,
            tar::EntryType::Fifo => proto::FIFO,
            other => {
                return Err(Error::unsupported(
                    "tar",
                    format!(
                        "a tar entry of type {other:?} ({}) through the exec helper (regular files, directories, symbolic and hard links and fifos only)",
                        String::from_utf8_lossy(&entry.path_bytes())
                    ),
                ));
            }
        };
        let raw = entry.path_bytes().into_owned();
        let path = relative(&raw);
        if path.is_empty() || path == b"." {
            continue;
        }
        let link = entry
            .link_name_bytes()
            .map(|l| l.into_owned())
            .unwrap_or_default();
        // A hard link names a path of the archive, relative as entries are.
        let link = if kind == proto::HARDLINK {
            relative(&link).to_vec()
        } else {
            link
        };
        let e = Entry {
            path: path.to_vec(),
            kind,
            mode: header.mode().unwrap_or(0o644) & 0o7777,
            uid: header.uid().unwrap_or(0) as u32,
            gid: header.gid().unwrap_or(0) as u32,
            mtime: header.mtime().unwrap_or(0) as i64,
            size: if kind == proto::REGULAR {
                entry.size()
            } else {
                0
            },
            link,
        };
        let size = e.size;
        let mut frame = Enc::frame(proto::ENTRY, id);
        e.encode(&mut frame);
        session.send_frame(frame.finish())?;
        let mut left = size;
        let mut buf = vec![0u8; proto::CHUNK];
        while left > 0 {
            let want = (left as usize).min(buf.len());
            let n = entry.read(&mut buf[..want]).map_err(bad)?;
            if n == 0 {
                return Err(bad(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "short entry",
                )));
            }
            match handle.block_on(window.acquire_many(n as u32)) {
                Ok(p) => p.forget(),
                Err(_) => return Ok(()), // the helper answered already, or we were dropped
            }
            let mut frame = Enc::frame(proto::STDIN, id);
            frame.raw(&buf[..n]);
            session.send_frame(frame.finish())?;
            left -= n as u64;
        }
    }
    // The reader stops at the first zero block: the rest must end the archive well (the
    // check fails the read otherwise).
    io::copy(&mut archive.into_inner(), &mut io::sink()).map_err(bad)?;
    Ok(())
}

/// One of the session's slots for a walk of the helper's (`GET`, `BASE`, `LAYER`).
async fn read_slot(session: &Arc<Session>) -> Result<tokio::sync::OwnedSemaphorePermit> {
    session
        .gets
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| lost("the helper session closed".to_string()))
}

/// A tar stream of `path` through the helper. A missing path is an error here, not a
/// broken stream; a failure later is an error item of the stream, never a short archive.
pub(crate) async fn get(session: &Arc<Session>, path: &str) -> Result<ByteStream> {
    let slot = read_slot(session).await?;
    let (_, mut events, _) = session.file_op(proto::GET, path)?;
    let first = match tokio::time::timeout(ANSWER_TIMEOUT, events.next()).await {
        Ok(Some(Event::Entry(e, n))) => {
            events.give_credit(n);
            e
        }
        Ok(Some(Event::FileFailed(k, p, msg))) => return Err(file_error(k, &p, &msg, "get")),
        Ok(Some(Event::Lost(why))) => return Err(lost(why)),
        Ok(other) => return Err(lost(format!("unexpected answer to a GET: {other:?}"))),
        Err(_) => return Err(lost("the helper did not answer a GET in time".into())),
    };
    Ok(archive(slot, Some(first), events, ("get", "get_archive")))
}

/// Records the run's base listing (`BASE`), which its snapshot layers are taken against
/// ([`layer`]): once, at create, before any command of the run. One already recorded is
/// kept. Bounded by [`WALK_TIMEOUT`].
pub(crate) async fn base(session: &Arc<Session>) -> Result<()> {
    let _slot = read_slot(session).await?;
    let (_, mut events, _) = session.file_op(proto::BASE, "")?;
    match tokio::time::timeout(WALK_TIMEOUT, events.next()).await {
        Ok(Some(Event::Done)) => Ok(()),
        Ok(Some(Event::FileFailed(k, p, msg))) => Err(file_error(k, &p, &msg, "base")),
        Ok(Some(Event::Lost(why))) => Err(lost(why)),
        Ok(other) => Err(lost(format!("unexpected answer to a BASE: {other:?}"))),
        Err(_) => Err(Error::new(
            ErrorKind::Timeout,
            format!(
                "the exec helper did not record the run's base listing within {WALK_TIMEOUT:?}"
            ),
        )
        .with_operation("record the run's base listing")),
    }
}

/// A tar stream of what changed in the run's root filesystem since its base listing
/// (`LAYER`, an OCI image layer: deletions are empty regular files named `.wh.<name>`),
/// with `workspace` (absolute, or empty for none) whole when it is a mount point. A
/// failure before the first entry (no base listing, say) is an error here, waited for
/// at most [`WALK_TIMEOUT`]; a later one is an error item of the stream, never a short
/// archive.
pub(crate) async fn layer(session: &Arc<Session>, workspace: &str) -> Result<ByteStream> {
    let slot = read_slot(session).await?;
    let (_, mut events, _) = session.file_op(proto::LAYER, workspace)?;
    let first = match tokio::time::timeout(WALK_TIMEOUT, events.next()).await {
        Ok(Some(Event::Entry(e, n))) => {
            events.give_credit(n);
            Some(e)
        }
        // Nothing changed: an empty archive.
        Ok(Some(Event::Done)) => None,
        Ok(Some(Event::FileFailed(k, p, msg))) => return Err(file_error(k, &p, &msg, "layer")),
        Ok(Some(Event::Lost(why))) => return Err(lost(why)),
        Ok(other) => return Err(lost(format!("unexpected answer to a LAYER: {other:?}"))),
        Err(_) => {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "the exec helper sent nothing of the run's changes within {WALK_TIMEOUT:?}"
                ),
            )
            .with_operation("read the run's changes"));
        }
    };
    Ok(archive(slot, first, events, ("layer", "a snapshot layer")))
}

/// The archive of a `GET` or `LAYER` whose first entry came (`None`: it ended with
/// `DONE` before any), written on a blocking task as the rest of its entries come.
fn archive(
    slot: tokio::sync::OwnedSemaphorePermit,
    first: Option<Entry>,
    events: Receiver,
    (op, what): (&'static str, &'static str),
) -> ByteStream {
    let (tx, rx) = mpsc::channel::<io::Result<Bytes>>(4);
    tokio::task::spawn_blocking(move || {
        // Held until the archive is written (or failed).
        let _slot = slot;
        let mut out = ChannelWriter {
            tx: tx.clone(),
            poisoned: false,
        };
        // On failure `events` is dropped before its last event: the helper is told to
        // abandon the GET. The archive's end is written only after the helper's `DONE`:
        // a failed GET is an error item, never a complete-looking shorter archive.
        if let Err(e) = write_tar(first, events, &mut out, op) {
            tracing::debug!("{what} through the helper failed: {e}");
            let _ = tx.blocking_send(Err(e));
        }
    });
    tokio_stream_of(rx)
}

/// The receiving end of a channel as a stream.
fn tokio_stream_of(rx: mpsc::Receiver<io::Result<Bytes>>) -> ByteStream {
    futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    })
    .boxed()
}

/// A blocking `Write` into a channel of chunks; fails once the reader is gone, or once
/// poisoned (after a failure, so that nothing dropped later, such as a `tar::Builder`
/// writing its end-of-archive on drop, reaches the reader).
struct ChannelWriter {
    tx: mpsc::Sender<io::Result<Bytes>>,
    poisoned: bool,
}

impl io::Write for ChannelWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.poisoned {
            return Err(io::Error::other("the archive failed"));
        }
        self.tx
            .blocking_send(Ok(Bytes::copy_from_slice(buf)))
            .map_err(|_| {
                io::Error::new(io::ErrorKind::BrokenPipe, "the archive's reader is gone")
            })?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn write_tar(
    first: Option<Entry>,
    events: Receiver,
    out: &mut ChannelWriter,
    op: &'static str,
) -> io::Result<()> {
    let mut builder = tar::Builder::new(io::BufWriter::with_capacity(proto::CHUNK, out));
    builder.follow_symlinks(false);
    match write_entries(&mut builder, first, events, op) {
        Ok(()) => io::Write::flush(&mut builder.into_inner()?),
        Err(e) => {
            // Dropping the builder would write the end-of-archive (and the buffer would be
            // flushed): not after a failure.
            builder.get_mut().get_mut().poisoned = true;
            Err(e)
        }
    }
}

/// Appends the helper's entries until its `DONE` (`Ok`) or a failure, naming the entry.
/// `first` is the first entry, `None` when the `DONE` came already.
fn write_entries(
    builder: &mut tar::Builder<impl io::Write>,
    first: Option<Entry>,
    mut events: Receiver,
    op: &'static str,
) -> io::Result<()> {
    if first.is_none() {
        return Ok(());
    }
    let mut last = String::new();
    let named = |last: &str, why: String| {
        if last.is_empty() {
            io::Error::other(why)
        } else {
            io::Error::other(format!("{why} (after {last})"))
        }
    };
    // Paths (keyed hashes) of the regular files sent marked as link targets: the only
    // files a hard link may name.
    let keys = std::collections::hash_map::RandomState::new();
    use std::hash::BuildHasher as _;
    let mut targets = std::collections::HashSet::new();
    let mut next = first;
    loop {
        let entry = match next.take() {
            Some(e) => e,
            None => match events.blocking_next() {
                Some(Event::Entry(e, n)) => {
                    events.give_credit(n);
                    e
                }
                Some(Event::Done) => break,
                Some(Event::FileFailed(kind, p, msg)) => {
                    return Err(failed_midway(kind, &p, &msg, op));
                }
                Some(Event::Lost(why)) => {
                    return Err(named(
                        &last,
                        format!("the exec helper's stream broke: {why}"),
                    ));
                }
                None => {
                    return Err(named(
                        &last,
                        "the exec helper never ended the operation".into(),
                    ));
                }
                other => return Err(io::Error::other(format!("unexpected frame {other:?}"))),
            },
        };
        last = String::from_utf8_lossy(&entry.path).into_owned();
        // The helper is the sandbox's: a path that is not relative and plain (`..`, empty
        // or `.` components) would name something outside the archive's tree for whoever
        // unpacks it (a long name goes out as a raw record, past the tar crate's check).
        if !plain_relative(&entry.path) {
            return Err(io::Error::other(format!(
                "the exec helper sent an entry named {}",
                crate::Shown(&last)
            )));
        }
        let mut header = tar::Header::new_gnu();
        header.set_mode(entry.mode & 0o7777);
        header.set_uid(u64::from(entry.uid));
        header.set_gid(u64::from(entry.gid));
        header.set_mtime(entry.mtime.max(0) as u64);
        let path = std::path::PathBuf::from(
            <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(&entry.path),
        );
        match entry.kind {
            proto::DIRECTORY => {
                header.set_entry_type(tar::EntryType::Directory);
                header.set_size(0);
                builder.append_data(&mut header, &path, io::empty())?;
            }
            proto::SYMLINK => {
                header.set_entry_type(tar::EntryType::Symlink);
                header.set_size(0);
                let target =
                    <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(&entry.link);
                builder.append_link(&mut header, &path, target)?;
            }
            proto::HARDLINK => {
                // Only to a file sent before it, marked as one.
                if !plain_relative(&entry.link) || !targets.contains(&keys.hash_one(&entry.link)) {
                    return Err(io::Error::other(format!(
                        "the exec helper sent a hard link ({}) to a file it did not send",
                        crate::Shown(&last)
                    )));
                }
                header.set_entry_type(tar::EntryType::Link);
                header.set_size(0);
                let target =
                    <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(&entry.link);
                builder.append_link(&mut header, &path, target)?;
            }
            proto::FIFO => {
                header.set_entry_type(tar::EntryType::Fifo);
                header.set_size(0);
                builder.append_data(&mut header, &path, io::empty())?;
            }
            proto::REGULAR => {
                if entry.mode & proto::LINK_TARGET != 0 {
                    if targets.len() >= proto::MAX_GET_LINKS {
                        return Err(io::Error::other(format!(
                            "the exec helper marked more than {} files as hard link targets ({})",
                            proto::MAX_GET_LINKS,
                            crate::Shown(&last)
                        )));
                    }
                    targets.insert(keys.hash_one(&entry.path));
                }
                header.set_entry_type(tar::EntryType::Regular);
                header.set_size(entry.size);
                let data = Data {
                    events: &mut events,
                    left: entry.size,
                    pending: Bytes::new(),
                    path: &last,
                    op,
                };
                builder.append_data(&mut header, &path, data)?;
            }
            other => {
                return Err(io::Error::other(format!(
                    "the exec helper sent an entry of unknown type {other} ({})",
                    crate::Shown(&last)
                )));
            }
        }
    }
    Ok(())
}

/// A `FILE_ERROR` after the first entry, as the archive's error item: for a snapshot
/// walk the typed error (a name a layer cannot carry is `Unsupported`) inside it.
fn failed_midway(kind: FileError, path: &str, message: &str, op: &'static str) -> io::Error {
    if op == "layer" {
        io::Error::other(file_error(kind, path, message, op))
    } else {
        io::Error::other(format!("{path}: {message}"))
    }
}

/// One file's data, read from `STDOUT` frames, returning credit as it goes.
struct Data<'a> {
    events: &'a mut Receiver,
    left: u64,
    pending: Bytes,
    /// The file's path in the archive, for messages.
    path: &'a str,
    /// `get` or `layer` (see [`failed_midway`]).
    op: &'static str,
}

impl Read for Data<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.pending.is_empty() {
            if self.left == 0 {
                return Ok(0);
            }
            match self.events.blocking_next() {
                Some(Event::Out(OutputChunk::Stdout(b))) => {
                    self.events.give_credit(b.len());
                    self.pending = b;
                }
                Some(Event::FileFailed(kind, p, msg)) => {
                    return Err(failed_midway(kind, &p, &msg, self.op));
                }
                Some(Event::Lost(why)) => {
                    return Err(io::Error::other(format!(
                        "the exec helper's stream broke inside {}: {why}",
                        self.path
                    )));
                }
                None => {
                    return Err(io::Error::other(format!(
                        "the exec helper's stream ended inside {}",
                        self.path
                    )));
                }
                other => return Err(io::Error::other(format!("unexpected frame {other:?}"))),
            }
        }
        let n = buf.len().min(self.pending.len()).min(self.left as usize);
        buf[..n].copy_from_slice(&self.pending[..n]);
        self.pending = self.pending.slice(n..);
        self.left -= n as u64;
        Ok(n)
    }
}
