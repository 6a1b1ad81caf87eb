//! `sandbox cp`: files and directories between the host and a run, streamed.
//!
//! Files go as one-file streams (`put_file_stream` / `get_file_stream`), directories as
//! tar streams built and unpacked as they flow. On the host, nothing is ever written
//! through a symlink: a file lands by rename from a temporary file beside it (a symlink
//! at the destination is replaced, not followed), and a directory is unpacked by the
//! `tar` crate, which refuses entries that would land outside the destination (`..`,
//! absolute paths, or a path through a symlink that points out).

use std::io::Write;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use futures::StreamExt;
use runcell_core::files::ByteStream;
use runcell_core::{ErrorKind, ExecSpec, Run, RunExt};
use tokio::sync::mpsc;

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

/// Host to run. Like `docker cp`: into `dst` when it is a directory (or ends with `/`),
/// else as `dst`.
pub async fn copy_in(run: &dyn Run, src: &Path, dst: &str) -> Result<String, Failure> {
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
        run.put_file_stream(&target, file, meta.len(), mode).await?;
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
        run.put_archive(&dir, dir_tar_stream(src.to_path_buf(), root))
            .await?;
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
                write_file(reader, &target).await?;
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

fn unpack(reader: impl std::io::Read, dst: &Path) -> Result<(), String> {
    let mut archive = tar::Archive::new(reader);
    archive.set_overwrite(true);
    archive.set_preserve_permissions(true);
    archive.set_preserve_mtime(true);
    archive.set_unpack_xattrs(false);
    // Each entry through `unpack_in`: it refuses `..`, absolute paths and paths that a
    // symlink would lead out of `dst`.
    for entry in archive
        .entries()
        .map_err(|e| format!("reading the archive: {e}"))?
    {
        let mut entry = entry.map_err(|e| format!("reading the archive: {e}"))?;
        let path = entry
            .path()
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        match entry.unpack_in(dst) {
            Ok(true) => {}
            Ok(false) => {
                return Err(format!(
                    "{path}: refused, it would land outside {}",
                    dst.display()
                ));
            }
            Err(e) => return Err(format!("{path}: {e}")),
        }
    }
    Ok(())
}

/// Writes a file from the run: into a temporary file beside `target`, then renamed over
/// it (a symlink at `target` is replaced, never followed).
async fn write_file(mut reader: runcell_core::FileReader, target: &Path) -> Result<(), Failure> {
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
    let mode = reader.mode() & 0o7777;
    let (file, temp_path) = temp.into_parts();
    let mut file = tokio::fs::File::from_std(file);
    tokio::io::copy(&mut reader, &mut file)
        .await
        .map_err(|e| Failure::usage(format!("copying to {}: {e}", target.display())))?;
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

#[cfg(test)]
mod tests {
    use super::*;

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
