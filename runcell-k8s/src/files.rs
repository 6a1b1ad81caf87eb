//! Files through exec: the API has no archive endpoint, so `tar` runs in the pod (the
//! image needs it), every exec through core ([`runcell_core::exec_in`]: marker,
//! timeout, kill). Archives go in as streaming stdin on v5, buffered (up to
//! [`FRAMED_ARCHIVE_LIMIT`]) on v4, and come out as a stream. The workspace is seeded from
//! the host directory at create and copied back on request or at stop.

use std::path::Path;

use futures::{StreamExt, TryStreamExt};
use runcell_core::exec_in;
use runcell_core::{
    ByteStream, Error, ErrorKind, ExecOutput, ExecSpec, OutputChunk, Result, files,
};

use crate::K8sDriver;

/// How much of tar's messages is kept.
const TAR_MESSAGES_LIMIT: usize = 64 << 10;
/// The largest archive sent on the v4 exec path, where it is buffered (256 MiB).
const FRAMED_ARCHIVE_LIMIT: u64 = 256 << 20;
/// The largest workspace copied back to the host (it is buffered).
const WORKSPACE_SYNC_LIMIT: usize = 1 << 30;

impl K8sDriver {
    /// Extracts `tar` into the directory `dir` of the pod.
    pub(crate) async fn put_tar_by_exec(&self, id: &str, dir: &str, tar: ByteStream) -> Result<()> {
        let spec = ExecSpec::new(["tar", "-x", "-f", "-", "-C", dir]).working_dir("/");
        // Core checks the source: a cut one fails, naming the entry, before tar sees a
        // whole (smaller) archive.
        let out = if self.framed_stdin {
            // Without stdin EOF (v4 exec) the length must be known up front: buffer.
            let tar = files::collect_bytes(tar, FRAMED_ARCHIVE_LIMIT)
                .await
                .map_err(|e| {
                    if e.kind() == std::io::ErrorKind::InvalidData {
                        return Error::new(ErrorKind::Backend, "the archive to upload failed")
                            .with_source(e);
                    }
                    Error::new(
                        ErrorKind::Unsupported,
                        "archives on the v4 exec path are buffered and limited",
                    )
                    .with_field("stdin")
                    .with_source(e)
                })?;
            exec_in(self, id, spec.stdin_bytes(tar))
                .await?
                .collect(TAR_MESSAGES_LIMIT)
                .await
        } else {
            let mut stream = exec_in(self, id, spec.stdin_piped()).await?;
            let mut stdin = stream.take_stdin().expect("stdin was asked for");
            let feed = async move {
                let mut tar = tar;
                while let Some(chunk) = tar.try_next().await.map_err(|e| {
                    Error::new(ErrorKind::Backend, "reading the archive to upload failed")
                        .with_source(e)
                })? {
                    stdin.write(chunk).await?;
                }
                Ok::<(), Error>(())
            };
            // A failed feed drops stdin: tar reads a short archive and fails, so this ends.
            let (fed, out) = tokio::join!(feed, stream.collect(TAR_MESSAGES_LIMIT));
            // A cut source first: tar's complaint about it says less.
            fed.map_err(|e| e.with("run", id).with("dir", dir))?;
            out
        };
        if out.status.success() {
            Ok(())
        } else {
            Err(tar_error(&out, dir, id))
        }
    }

    /// A tar stream of `path` in the pod, with its base name at the root.
    pub(crate) async fn get_tar_by_exec(&self, id: &str, path: &str) -> Result<ByteStream> {
        let (parent, base) = files::split_file_path(path.trim_end_matches('/')).map_err(|_| {
            Error::invalid_spec("path", format!("{path:?} must be an absolute path below /"))
        })?;
        // A name that starts with '-' must not read as an option of tar.
        let base = if base.starts_with('-') {
            format!("./{base}")
        } else {
            base.to_string()
        };
        let mut stream = exec_in(
            self,
            id,
            ExecSpec::new(["tar", "-c", "-f", "-", "-C", parent, &base]).working_dir("/"),
        )
        .await?;
        // Wait for the first bytes of the archive, or for tar's failure: a missing path
        // is a typed error, not a broken stream.
        let mut stderr = Vec::new();
        let first = loop {
            match stream.next_chunk().await {
                Some(OutputChunk::Stdout(b)) => break Some(b),
                // A plain exec never loses output.
                Some(OutputChunk::Lost(_)) => {}
                Some(OutputChunk::Stderr(b)) => {
                    if stderr.len() < TAR_MESSAGES_LIMIT {
                        stderr.extend_from_slice(&b);
                    }
                }
                None => break None,
            }
        };
        let Some(first) = first else {
            let status = stream.wait().await;
            let out = ExecOutput {
                lost_bytes: 0,
                status,
                stdout: Vec::new(),
                stderr,
                stdout_total: 0,
                stderr_total: 0,
                duration: Default::default(),
            };
            return Err(tar_error(&out, path, id));
        };
        // tar's exit status is the transfer's success marker: a file it could not read
        // (or that changed while it read it) fails it, with tar's messages naming the file,
        // even when the archive it wrote looks whole.
        let rest = futures::stream::unfold(Some((stream, stderr)), |state| async move {
            let (mut stream, mut stderr) = state?;
            loop {
                match stream.next_chunk().await {
                    Some(OutputChunk::Stdout(b)) => return Some((Ok(b), Some((stream, stderr)))),
                    Some(OutputChunk::Lost(_)) => {}
                    Some(OutputChunk::Stderr(b)) => {
                        if stderr.len() < TAR_MESSAGES_LIMIT {
                            stderr.extend_from_slice(&b);
                        }
                    }
                    None => {
                        let status = stream.wait().await;
                        return (!status.success()).then(|| {
                            let messages = String::from_utf8_lossy(&stderr);
                            // tar writes an empty archive for a path that is not there,
                            // then fails saying so: that is a missing file, not a
                            // broken transfer.
                            let kind = if messages.contains("No such file or directory") {
                                std::io::ErrorKind::NotFound
                            } else {
                                std::io::ErrorKind::Other
                            };
                            (
                                Err(std::io::Error::new(
                                    kind,
                                    format!("tar in the pod {status}: {}", messages.trim()),
                                )),
                                None,
                            )
                        });
                    }
                }
            }
        });
        // Core checks that the archive itself ends whole.
        Ok(futures::stream::once(async move { Ok(first) })
            .chain(rest)
            .boxed())
    }

    /// Copies the host directory's content into the pod's workspace.
    pub(crate) async fn seed_workspace(&self, id: &str, host_dir: &Path, path: &str) -> Result<()> {
        self.put_tar_by_exec(id, path, files::tar_dir_stream(host_dir))
            .await
    }

    /// Copies run `run_id`'s workspace back into its host directory (files the run deleted
    /// stay on the host). A no-op for runs without a host directory. Runs stopped with
    /// [`crate::K8sConfig::sync_workspace_on_stop`] set do this at stop.
    pub async fn sync_workspace_to_host(&self, run_id: &str) -> Result<()> {
        let state = self
            .run_state(run_id)
            .await
            .map_err(|e| e.with("run", run_id))?;
        let Some(dir) = &state.host_dir else {
            return Ok(());
        };
        let spec =
            ExecSpec::new(["tar", "-c", "-f", "-", "-C", &state.workspace, "."]).working_dir("/");
        let out = exec_in(self, run_id, spec)
            .await?
            .collect(WORKSPACE_SYNC_LIMIT)
            .await;
        if !out.status.success() || out.stdout_truncated() {
            return Err(tar_error(&out, &state.workspace, run_id));
        }
        files::unpack_into(files::byte_stream(out.stdout), dir, 0).await?;
        Ok(())
    }
}

/// The typed error of a tar that failed in the pod, from its messages.
fn tar_error(out: &ExecOutput, path: &str, run: &str) -> Error {
    let stderr = out.stderr_str();
    // BusyBox: "can't remove old file x: Is a directory"; GNU: "Cannot open: File exists".
    if stderr.contains("Is a directory")
        || stderr.contains("File exists")
        || stderr.contains("Not a directory")
    {
        return Error::invalid_spec(
            "path",
            format!(
                "would replace a directory with a non-directory (or the reverse): {}",
                stderr.trim()
            ),
        )
        .with("run", run)
        .with("path", path);
    }
    let kind = if stderr.contains("No such file") || stderr.contains("can't change directory") {
        ErrorKind::NotFound
    } else {
        ErrorKind::Backend
    };
    Error::new(
        kind,
        format!("tar in the pod {}: {}", out.status, stderr.trim()),
    )
    .with("run", run)
    .with("path", path)
}
