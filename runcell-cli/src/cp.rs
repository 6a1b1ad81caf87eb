//! `sandbox cp`: files and directories between the host and a run, streamed.
//!
//! Files go as one-file streams (`put_file_stream` / `get_file_stream`), directories as
//! tar streams built and unpacked as they flow. On the host, nothing is ever written
//! through a symlink: a file lands by rename from a temporary file beside it (a symlink
//! at the destination is replaced, not followed), and a directory is unpacked by the
//! `tar` crate, which refuses entries that would land outside the destination (`..`,
//! absolute paths, or a path through a symlink that points out).
//!
//! A copy succeeds only when the whole transfer did: a file read out of a run, or an
//! archive, that ends before its end-of-archive (its success marker) or inside an entry
//! is an error naming the entry (see `runcell_core::files::TarCheck`). SIGINT or SIGTERM
//! during a copy cancels it: the temporary file (or staging directory) on the host is
//! removed, a file half-written in the run through the exec helper is removed by the
//! helper, then `sandbox` exits 130/143. What was already whole stays: files unpacked
//! into an existing directory, and, on the plain path, what the engine's extractor wrote
//! in place (a file cut short there stays cut short). A file copied out lands with the
//! holes of a sparse file (whole 4 KiB blocks of zeros are not written).

use std::collections::HashMap;
use std::future::Future;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use runcell_core::files::{ByteStream, checked_tar_stream};
use runcell_core::{ErrorKind, ExecSpec, Run, RunExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::errors::Failure;

/// One side of a copy: a host path, or `RUN:/path` in a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Place {
    Host(PathBuf),
    Run { run: String, path: String },
}

impl Place {
    /// `RUN:/abs/path` is in a run (a run id has no `/`); anything else is a host path
    /// (write `./a:b` for a host file whose name has a colon).
    pub fn parse(text: &str) -> Place {
        if let Some((run, path)) = text.split_once(':')
            && !run.is_empty()
            && !run.contains('/')
            && path.starts_with('/')
        {
            return Place::Run {
                run: run.into(),
                path: path.into(),
            };
        }
        Place::Host(PathBuf::from(text))
    }
}

fn base_name(path: &str) -> Option<&str> {
    path.trim_end_matches('/')
        .rsplit('/')
        .next()
        .filter(|n| !n.is_empty() && *n != "." && *n != "..")
}

fn join(dir: &str, name: &str) -> String {
    format!("{}/{name}", dir.trim_end_matches('/'))
}

fn parent(path: &str) -> &str {
    match path.trim_end_matches('/').rsplit_once('/') {
        Some(("", _)) | None => "/",
        Some((p, _)) => p,
    }
}

/// Whether `path` is a directory in the run.
async fn is_dir_in_run(run: &dyn Run, path: &str) -> Result<bool, Failure> {
    let out = run
        .exec(ExecSpec::new(["sh", "-c", "test -d \"$1\"", "sh", path]))
        .await?;
    Ok(out.status.success())
}

/// How long a cancelled copy may take to unwind (remove its temporary files).
const UNWIND: Duration = Duration::from_secs(10);

/// Runs `copy` until it ends, or until SIGINT/SIGTERM: then `cancel` fires, the copy
/// unwinds (removing its temporary files) and the process exits 130/143.
async fn cancellable<T>(
    copy: impl Future<Output = Result<T, Failure>>,
    cancel: CancellationToken,
) -> Result<T, Failure> {
    let mut signals = crate::exec::Signals::new()?;
    tokio::pin!(copy);
    let code = tokio::select! {
        done = &mut copy => return done,
        code = signals.recv() => code,
    };
    cancel.cancel();
    let _ = tokio::time::timeout(UNWIND, copy).await;
    eprintln!("sandbox: interrupted: the copy was cancelled");
    std::process::exit(code)
}

fn interrupted() -> Failure {
    Failure::usage("interrupted")
}

/// `stream`, failing (instead of going on) once `cancel` fires.
fn until_cancelled(stream: ByteStream, cancel: CancellationToken) -> ByteStream {
    futures::stream::unfold(Some(stream), move |state| {
        let cancel = cancel.clone();
        async move {
            let mut stream = state?;
            tokio::select! {
                item = stream.next() => item.map(|i| (i, Some(stream))),
                _ = cancel.cancelled() => Some((
                    Err(std::io::Error::new(std::io::ErrorKind::Interrupted, "interrupted")),
                    None,
                )),
            }
        }
    })
    .boxed()
}

/// Host to run. Like `docker cp`: into `dst` when it is a directory (or ends with `/`),
/// else as `dst`.
pub async fn copy_in(run: &dyn Run, src: &Path, dst: &str) -> Result<String, Failure> {
    let cancel = CancellationToken::new();
    let copy = copy_in_until(run, src, dst, cancel.clone());
    cancellable(copy, cancel).await
}

async fn copy_in_until(
    run: &dyn Run,
    src: &Path,
    dst: &str,
    cancel: CancellationToken,
) -> Result<String, Failure> {
    let meta =
        std::fs::metadata(src).map_err(|e| Failure::usage(format!("{}: {e}", src.display())))?;
    let src_name = src
        .file_name()
        .map(|n| n.to_owned())
        // `.` or `dir/..`: the directory's own name.
        .or_else(|| src.canonicalize().ok()?.file_name().map(|n| n.to_owned()))
        .and_then(|n| n.into_string().ok())
        .ok_or_else(|| Failure::usage(format!("{}: no file name", src.display())))?;
    let into = dst.ends_with('/') || is_dir_in_run(run, dst).await?;
    if meta.is_file() {
        let target = if into {
            join(dst, &src_name)
        } else {
            dst.to_string()
        };
        let file = tokio::fs::File::open(src)
            .await
            .map_err(|e| Failure::usage(format!("{}: {e}", src.display())))?;
        let mode = {
            use std::os::unix::fs::PermissionsExt;
            meta.permissions().mode() & 0o7777
        };
        // Dropped on cancel: a `PUT` cut short leaves no temporary file in the run.
        tokio::select! {
            put = run.put_file_stream(&target, file, meta.len(), mode) => put?,
            _ = cancel.cancelled() => return Err(interrupted()),
        }
        Ok(target)
    } else if meta.is_dir() {
        let (dir, root) = if into {
            (dst.trim_end_matches('/').to_string(), src_name)
        } else {
            let name =
                base_name(dst).ok_or_else(|| Failure::usage(format!("{dst}: no file name")))?;
            (parent(dst).to_string(), name.to_string())
        };
        let dir = if dir.is_empty() { "/".to_string() } else { dir };
        let target = join(&dir, &root);
        tokio::select! {
            put = run.put_archive(&dir, dir_tar_stream(src.to_path_buf(), root)) => put?,
            _ = cancel.cancelled() => return Err(interrupted()),
        }
        Ok(target)
    } else {
        Err(Failure::usage(format!(
            "{}: not a regular file or directory",
            src.display()
        )))
    }
}

/// A tar stream of the host directory `src` with `root` as its top entry, built on a
/// blocking thread as it is read. Symlinks are archived as symlinks, never followed.
fn dir_tar_stream(src: PathBuf, root: String) -> ByteStream {
    let (tx, rx) = mpsc::channel::<std::io::Result<Bytes>>(4);
    tokio::task::spawn_blocking(move || {
        let writer = ChannelWriter {
            tx: tx.clone(),
            buf: Vec::with_capacity(CHUNK),
        };
        let mut builder = tar::Builder::new(writer);
        builder.follow_symlinks(false);
        let built = builder
            .append_dir_all(&root, &src)
            .and_then(|()| builder.into_inner())
            .and_then(|mut w| w.flush());
        if let Err(e) = built {
            let _ = tx.blocking_send(Err(e));
        }
    });
    futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    })
    .boxed()
}

const CHUNK: usize = 64 << 10;

struct ChannelWriter {
    tx: mpsc::Sender<std::io::Result<Bytes>>,
    buf: Vec<u8>,
}

impl Write for ChannelWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= CHUNK {
            self.flush()?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = Bytes::from(std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK)));
        self.tx
            .blocking_send(Ok(chunk))
            .map_err(|_| std::io::Error::other("the run stopped reading the archive"))
    }
}

/// Run to host. Into `dst` when it is a directory, else as `dst`.
pub async fn copy_out(run: &dyn Run, src: &str, dst: &Path) -> Result<PathBuf, Failure> {
    let cancel = CancellationToken::new();
    let copy = copy_out_until(run, src, dst, cancel.clone());
    cancellable(copy, cancel).await
}

async fn copy_out_until(
    run: &dyn Run,
    src: &str,
    dst: &Path,
    cancel: CancellationToken,
) -> Result<PathBuf, Failure> {
    let name = base_name(src)
        .ok_or_else(|| Failure::usage(format!("{src}: no file name")))?
        .to_string();
    let into = dst.is_dir();
    let target = if into {
        dst.join(&name)
    } else {
        dst.to_path_buf()
    };
    if !src.ends_with('/') {
        match run.get_file_stream(src).await {
            Ok(reader) => {
                write_file(reader, &target, &cancel).await?;
                return Ok(target);
            }
            // A directory (or a symlink, a device...): as an archive below.
            Err(e) if e.kind() == ErrorKind::InvalidSpec && e.field() == Some("path") => {}
            Err(e) => return Err(e.into()),
        }
    }
    if target.symlink_metadata().is_ok_and(|m| !m.is_dir()) {
        return Err(Failure::usage(format!(
            "{}: exists and is not a directory",
            target.display()
        )));
    }
    let archive = run.get_archive(src.trim_end_matches('/')).await?;
    // Checked (a cut archive fails the copy, naming the entry), and failing on cancel: the
    // unpacking then stops and removes its staging directory.
    let archive = until_cancelled(checked_tar_stream(archive), cancel.clone());
    let reader = tokio_util::io::SyncIoBridge::new(tokio_util::io::StreamReader::new(archive));
    let dst = dst.to_path_buf();
    let out = target.clone();
    tokio::task::spawn_blocking(move || -> Result<(), String> {
        if into {
            // Merge into the existing directory: `name/...` lands in `dst/name/...`.
            return unpack(reader, &dst);
        }
        // A new name: unpack beside it, then move the top entry into place.
        let parent = match out.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let staging = tempfile::Builder::new()
            .prefix(".sandbox-cp-")
            .tempdir_in(&parent)
            .map_err(|e| format!("{}: {e}", parent.display()))?;
        unpack(reader, staging.path())?;
        std::fs::rename(staging.path().join(&name), &out)
            .map_err(|e| format!("{}: {e}", out.display()))
    })
    .await
    .map_err(|e| Failure::usage(format!("copy failed: {e}")))?
    .map_err(Failure::usage)?;
    Ok(target)
}

/// Regular files one copy remembers for the hard links that name them, and their paths'
/// bytes.
const MADE_FILES: usize = 1 << 20;
const MADE_PATH_BYTES: usize = 64 << 20;

fn unpack(reader: impl std::io::Read, dst: &Path) -> Result<(), String> {
    let mut archive = tar::Archive::new(reader);
    archive.set_overwrite(true);
    // Permission bits without setuid, setgid and sticky (`mode & 0o777`): code in the
    // sandbox may be root, and its files must not gain privileges on the host.
    archive.set_preserve_permissions(false);
    archive.set_preserve_mtime(true);
    archive.set_unpack_xattrs(false);
    // Each entry through `unpack_in`: it refuses `..`, absolute paths and paths that a
    // symlink would lead out of `dst`. A hard link only to a regular file this copy wrote
    // (by path, then by inode): the archive is the sandbox's, and `dst` may hold the
    // user's own files.
    // As `unpack_in` places an entry: without `/` and `.` components.
    let plain = |p: &Path| -> PathBuf {
        p.components()
            .filter(|c| {
                !matches!(
                    c,
                    std::path::Component::CurDir | std::path::Component::RootDir
                )
            })
            .collect()
    };
    let inode = |p: &Path| {
        use std::os::unix::fs::MetadataExt;
        std::fs::symlink_metadata(p)
            .ok()
            .filter(|m| m.is_file())
            .map(|m| (m.dev(), m.ino()))
    };
    let mut made: HashMap<PathBuf, (u64, u64)> = HashMap::new();
    let mut made_bytes = 0usize;
    for entry in archive
        .entries()
        .map_err(|e| format!("reading the archive: {e}"))?
    {
        let mut entry = entry.map_err(|e| format!("reading the archive: {e}"))?;
        let path = entry
            .path()
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        let at = entry.path().map(|p| plain(&p)).unwrap_or_default();
        let kind = entry.header().entry_type();
        let linked = if kind == tar::EntryType::Link {
            let target = entry
                .link_name()
                .ok()
                .flatten()
                .map(|t| plain(&t))
                .unwrap_or_default();
            match made.get(&target) {
                Some(&id) if inode(&dst.join(&target)) == Some(id) => Some(id),
                _ => {
                    return Err(format!(
                        "{path}: refused, a hard link to a file this copy did not write"
                    ));
                }
            }
        } else {
            None
        };
        match entry.unpack_in(dst) {
            Ok(true) if linked.is_some() && inode(&dst.join(&at)) != linked => {
                let _ = std::fs::remove_file(dst.join(&at));
                return Err(format!("{path}: refused, its hard link's file changed"));
            }
            Ok(true) => {
                let len = at.as_os_str().len();
                if kind == tar::EntryType::Regular
                    && made.len() < MADE_FILES
                    && made_bytes + len <= MADE_PATH_BYTES
                    && let Some(id) = inode(&dst.join(&at))
                {
                    made_bytes += len;
                    made.insert(at, id);
                }
            }
            Ok(false) => {
                return Err(format!(
                    "{path}: refused, it would land outside {}",
                    dst.display()
                ));
            }
            Err(e) => return Err(format!("{path}: {e}")),
        }
    }
    // The reader stops at the first zero block: the rest must end the archive well.
    std::io::copy(&mut archive.into_inner(), &mut std::io::sink())
        .map_err(|e| format!("reading the archive: {e}"))?;
    Ok(())
}

/// Writes a file from the run: into a temporary file beside `target`, then renamed over
/// it (a symlink at `target` is replaced, never followed).
async fn write_file(
    mut reader: runcell_core::FileReader,
    target: &Path,
    cancel: &CancellationToken,
) -> Result<(), Failure> {
    if target.is_dir() {
        return Err(Failure::usage(format!(
            "{}: is a directory",
            target.display()
        )));
    }
    let parent = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let temp = tempfile::Builder::new()
        .prefix(".sandbox-cp-")
        .tempfile_in(&parent)
        .map_err(|e| Failure::usage(format!("{}: {e}", parent.display())))?;
    // Without setuid, setgid and sticky bits: the sandbox's files never gain privileges here.
    let mode = reader.mode() & 0o777;
    let (file, temp_path) = temp.into_parts();
    let mut file = tokio::fs::File::from_std(file);
    // The reader ends only after the whole file and the archive's end arrived. On an
    // error or a cancel, `temp_path` is dropped: the temporary file is removed.
    tokio::select! {
        copied = copy_sparse(&mut reader, &mut file) => copied
            .map_err(|e| Failure::usage(format!("copying to {}: {e}", target.display())))?,
        _ = cancel.cancelled() => return Err(interrupted()),
    };
    tokio::io::AsyncWriteExt::flush(&mut file)
        .await
        .map_err(|e| Failure::usage(format!("{}: {e}", target.display())))?;
    {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&temp_path, std::fs::Permissions::from_mode(mode));
    }
    temp_path
        .persist(target)
        .map_err(|e| Failure::usage(format!("{}: {e}", target.display())))?;
    Ok(())
}

/// Copies `reader` into the new file `file`, leaving each whole 4 KiB block of zeros
/// (aligned in the file) unwritten: a sparse file in the run lands sparse again.
async fn copy_sparse(
    reader: &mut (impl tokio::io::AsyncRead + Unpin),
    file: &mut tokio::fs::File,
) -> std::io::Result<u64> {
    use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};
    const HOLE: usize = 4096;
    let mut buf = vec![0u8; CHUNK];
    let mut pos = 0u64;
    loop {
        // A whole buffer (or the rest): blocks stay aligned, as `pos` moves by `CHUNK`.
        let mut fill = 0;
        while fill < buf.len() {
            match reader.read(&mut buf[fill..]).await? {
                0 => break,
                n => fill += n,
            }
        }
        let mut start = 0; // Of the data not written yet.
        for at in (0..fill).step_by(HOLE) {
            let block = &buf[at..(at + HOLE).min(fill)];
            if block.len() == HOLE && block.iter().all(|b| *b == 0) {
                file.write_all(&buf[start..at]).await?;
                file.seek(std::io::SeekFrom::Current(HOLE as i64)).await?;
                start = at + HOLE;
            }
        }
        file.write_all(&buf[start..fill]).await?;
        pos += fill as u64;
        if fill < buf.len() {
            // A hole at the end was seeked over, not written.
            file.flush().await?;
            file.set_len(pos).await?;
            return Ok(pos);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hard link from the run's archive lands only as another name of a file the same
    /// copy wrote: one to a file the destination had (even inside it) is refused.
    #[test]
    fn hard_links_land_only_on_files_of_the_copy() {
        use std::os::unix::fs::MetadataExt;
        let archive = |links: &[(&str, &str)]| {
            let mut b = tar::Builder::new(Vec::new());
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(tar::EntryType::Regular);
            h.set_mode(0o644);
            h.set_size(2);
            b.append_data(&mut h, "out/a", &b"ab"[..]).unwrap();
            for (name, target) in links {
                let mut h = tar::Header::new_gnu();
                h.set_entry_type(tar::EntryType::Link);
                h.set_size(0);
                b.append_link(&mut h, name, target).unwrap();
            }
            b.into_inner().unwrap()
        };
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("secret"), "the user's").unwrap();
        unpack(
            &archive(&[("out/b", "out/a"), ("out/c", "./out/a")])[..],
            dir.path(),
        )
        .unwrap();
        let ino = |p: &str| std::fs::metadata(dir.path().join(p)).unwrap().ino();
        assert_eq!((ino("out/b"), ino("out/c")), (ino("out/a"), ino("out/a")));
        for target in ["secret", "out/../secret", "out/missing"] {
            let to = tempfile::tempdir().unwrap();
            std::fs::write(to.path().join("secret"), "the user's").unwrap();
            let got = unpack(&archive(&[("out/x", target)])[..], to.path());
            assert!(
                got.as_ref().is_err_and(|e| e.contains("out/x")),
                "{target}: {got:?}"
            );
            assert!(!to.path().join("out/x").exists(), "{target}");
            assert_eq!(
                std::fs::metadata(to.path().join("secret")).unwrap().nlink(),
                1
            );
        }
    }

    #[tokio::test]
    async fn files_from_the_run_land_with_their_holes() {
        let dir = tempfile::tempdir().unwrap();
        let mut data = vec![0u8; 3 * CHUNK + 5000];
        data[..5].copy_from_slice(b"start");
        data[CHUNK + 10..CHUNK + 13].copy_from_slice(b"mid");
        let path = dir.path().join("f");
        let mut file = tokio::fs::File::create(&path).await.unwrap();
        let n = copy_sparse(&mut &data[..], &mut file).await.unwrap();
        drop(file);
        assert_eq!(n, data.len() as u64);
        assert_eq!(std::fs::read(&path).unwrap(), data);
        use std::os::unix::fs::MetadataExt;
        let allocated = std::fs::metadata(&path).unwrap().blocks() * 512;
        assert!(allocated <= 16 << 10, "{allocated} bytes allocated");
        // Data to the end, and nothing at all.
        for data in [vec![1u8; CHUNK + 1], Vec::new()] {
            let mut file = tokio::fs::File::create(&path).await.unwrap();
            copy_sparse(&mut &data[..], &mut file).await.unwrap();
            drop(file);
            assert_eq!(std::fs::read(&path).unwrap(), data);
        }
    }

    #[test]
    fn places() {
        assert_eq!(
            Place::parse("sbx-1:/workspace/a"),
            Place::Run {
                run: "sbx-1".into(),
                path: "/workspace/a".into()
            }
        );
        assert_eq!(Place::parse("./a:/b"), Place::Host("./a:/b".into()));
        assert_eq!(Place::parse("a:b"), Place::Host("a:b".into()));
        assert_eq!(Place::parse("/tmp/x"), Place::Host("/tmp/x".into()));
        assert_eq!(parent("/a/b"), "/a");
        assert_eq!(parent("/a"), "/");
        assert_eq!(base_name("/a/b/"), Some("b"));
        assert_eq!(base_name("/"), None);
    }
}
