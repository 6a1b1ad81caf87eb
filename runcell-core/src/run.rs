//! The user-facing traits: [`Driver`] creates runs, [`Run`] is one live sandbox,
//! [`RunExt`] its conveniences.

use std::collections::BTreeMap;
use std::fmt;

use async_trait::async_trait;

use crate::capabilities::Capabilities;
use crate::error::{Error, ErrorKind, Result};
use crate::exec::{DEFAULT_OUTPUT_LIMIT, ExecOutput, ExecStream, ExitStatus};
use crate::files::{self, ByteStream};
use crate::progress::CreateOptions;
use crate::raw::RunInfo;
use crate::spec::{ExecSpec, RunSpec};
use crate::warm::Warm;

/// A backend that creates runs: one long-lived container or pod each.
///
/// Object-safe; share it as `Arc<dyn Driver>`.
#[async_trait]
pub trait Driver: Send + Sync + fmt::Debug + 'static {
    /// The registry name (`docker`, `k8s`, ...).
    fn name(&self) -> &str;

    /// What this driver supports.
    fn capabilities(&self) -> Capabilities;

    /// Creates a run: validates `spec` (and checks it against the capabilities), creates the target, waits until
    /// it is ready, sets up CA and workspace, runs the post-create commands. On any
    /// failure nothing is left behind.
    async fn create(&self, spec: &RunSpec) -> Result<Box<dyn Run>> {
        self.create_with(spec, CreateOptions::default()).await
    }

    /// [`Driver::create`] with options: a progress callback, a detached owner.
    async fn create_with(&self, spec: &RunSpec, options: CreateOptions) -> Result<Box<dyn Run>>;

    /// Re-attaches to a live run by id (from this or another process).
    async fn attach(&self, id: &str) -> Result<Box<dyn Run>>;

    /// The runs this driver manages whose labels include every pair of `selector`.
    async fn list(&self, selector: &BTreeMap<String, String>) -> Result<Vec<RunInfo>>;

    /// Removes a run and everything created for it, without a grace period. Removing a
    /// run that does not exist succeeds.
    async fn remove(&self, id: &str) -> Result<()>;

    /// Warm pools: this driver's pool protocol, which [`crate::Pool`] drives, or `None`
    /// where the driver has none. Every [`crate::raw::Backend`] with [`Capabilities::pool`]
    /// has one; a driver that wraps another forwards the inner one's.
    fn pooling(&self) -> Option<&dyn PoolProtocol> {
        None
    }

    /// The snapshots of this driver ([`Run::snapshot`]); none where it has no snapshots.
    async fn snapshots(&self) -> Result<Vec<crate::Snapshot>> {
        Ok(Vec::new())
    }

    /// Removes snapshot `id` and what was made for it (its image, where no run uses it
    /// any more: the engine keeps an image a live run started from until that run is
    /// gone). Removing a snapshot that does not exist succeeds.
    async fn remove_snapshot(&self, id: &str) -> Result<()> {
        crate::snapshot::check_snapshot_id(id)?;
        Err(Error::unsupported(
            "snapshot",
            "this driver has no snapshots",
        ))
    }

    /// Pushes snapshot `id` to registry repository `repository` (`host[:port]/path`),
    /// tagged with the snapshot's id, so that a driver on another machine can
    /// [`Driver::pull_snapshot`] it (or, with that repository as its snapshot registry,
    /// list it: Kubernetes); returns the pushed reference (`host/path:<id>`). The local
    /// snapshot stays. Logins as the engine's pulls take them
    /// ([`crate::credentials::lookup`]).
    async fn push_snapshot(&self, id: &str, repository: &str) -> Result<String> {
        crate::snapshot::check_snapshot_id(id)?;
        crate::snapshot::check_repository(repository)?;
        Err(Error::unsupported(
            "push_snapshot",
            "this driver cannot push snapshots",
        ))
    }

    /// Pulls a snapshot that [`Driver::push_snapshot`] pushed (`host[:port]/path:<id>`)
    /// and makes it one of this driver's snapshots, to start runs from.
    async fn pull_snapshot(&self, reference: &str) -> Result<crate::Snapshot> {
        crate::snapshot::check_snapshot_reference(reference)?;
        Err(Error::unsupported(
            "pull_snapshot",
            "this driver cannot pull snapshots",
        ))
    }
}

/// The warm-pool protocol of a driver ([`Driver::pooling`]): what [`crate::Pool`] uses,
/// in three steps. Core implements it for every [`crate::raw::Backend`]; callers use
/// [`crate::Pool`] (or [`crate::Pool::warm_and_claim`] for one run), not these methods.
#[async_trait]
pub trait PoolProtocol: Send + Sync {
    /// Step 1: creates a target of `shape` (a spec with nothing run-specific) for pool
    /// `key`, waits until it answers, and makes it claimable. Dropping the returned
    /// [`Warm`] removes the target unless it was claimed.
    async fn pool_warm(&self, shape: &RunSpec, key: &str) -> Result<Warm>;

    /// Step 2: the run ids of the targets of pool `key` that any process made ready and
    /// nobody claimed yet.
    async fn pool_ready(&self, key: &str) -> Result<Vec<String>>;

    /// Step 3: claims `warm` atomically for a run of `spec` (validated, capability-checked
    /// and of the pool's shape: the caller checks), then applies everything run-specific
    /// (env, proxy, CA files, working directory, workspace, post-create, and labels where
    /// [`Capabilities::pool_relabel`]). `Ok(None)`: another claim won the target. On an
    /// error after the claim, the target is removed.
    async fn pool_claim(
        &self,
        warm: Warm,
        spec: &RunSpec,
        options: CreateOptions,
    ) -> Result<Option<Box<dyn Run>>>;
}

/// One live sandbox. Every exec enters the same target.
#[async_trait]
pub trait Run: Send + Sync + fmt::Debug {
    /// The run id (also the name of the container or pod).
    fn id(&self) -> &str;

    /// Starts a command. A non-zero exit is reported in the status, not as an error;
    /// errors mean the exec could not start (invalid spec, run lost, backend down).
    async fn exec_stream(&self, spec: ExecSpec) -> Result<ExecStream>;

    /// Extracts a tar archive, read as a stream, into the directory `dir` (which must
    /// exist). It never replaces a directory with a non-directory or the reverse: that is
    /// [`ErrorKind::InvalidSpec`] naming `path`, and what was there is left as it was.
    async fn put_archive(&self, dir: &str, tar: ByteStream) -> Result<()>;

    /// A tar archive of `path` (a file or directory) as a stream, with `path`'s base name
    /// at its root. A path that does not exist is [`ErrorKind::NotFound`].
    async fn get_archive(&self, path: &str) -> Result<ByteStream>;

    /// Every exec of the run the sandbox keeps a record of (running, or ended and not
    /// released yet), with its state. Capability `durable_execs`; without it
    /// [`ErrorKind::Unsupported`].
    async fn execs(&self) -> Result<Vec<crate::ExecInfo>> {
        Err(Error::unsupported(
            "execs",
            "exec records (needs the exec helper)",
        ))
    }

    /// Saves the run's filesystem state (what its commands changed in the target's own
    /// filesystem, and the workspace) as a [`crate::Snapshot`] that runs can start from
    /// ([`crate::RunSpec::from_snapshot`]). The run keeps running, never frozen; see the
    /// driver for the consistency it gives (Docker: a file replaced whole during the
    /// snapshot is in it whole, before or after; one written in place may be torn).
    async fn snapshot(&self, options: crate::SnapshotOptions) -> Result<crate::Snapshot> {
        let _ = options;
        Err(Error::unsupported(
            "snapshot",
            "this driver has no snapshots",
        ))
    }

    /// Reads exec `id`'s output from offset `from` on (offsets count stdout and stderr
    /// bytes together from 0; [`crate::FROM_NOW`]: only what comes next), then its exit
    /// status, from this or any other process: every byte once and in order when `from`
    /// is where the last reader stopped. Bytes the sandbox no longer has (its buffer
    /// overflowed while nobody read) come first as one [`crate::OutputChunk::Lost`].
    /// Another stream attached to the exec ends ([`crate::ExitStatus::TransportLost`]
    /// saying it was taken over). Dropping the returned stream kills the exec unless it
    /// was started with [`ExecSpec::detach`]. Unknown or released ids are
    /// [`ErrorKind::NotFound`] naming `exec_id`.
    async fn reattach(&self, id: crate::ExecId, from: u64) -> Result<ExecStream> {
        let _ = (id, from);
        Err(Error::unsupported(
            "exec_id",
            "reattaching to an exec (needs the exec helper)",
        ))
    }

    /// Kills every process of exec `id` (as a timeout does). Its record stays, with its
    /// status, until released. An exec that already ended is fine.
    async fn kill_exec(&self, id: crate::ExecId) -> Result<()> {
        let _ = id;
        Err(Error::unsupported(
            "exec_id",
            "killing an exec by id (needs the exec helper)",
        ))
    }

    /// Forgets exec `id`'s record (its kept output and status) once it has ended: a
    /// detached command's record otherwise stays until the run stops.
    async fn release_exec(&self, id: crate::ExecId) -> Result<()> {
        let _ = id;
        Err(Error::unsupported(
            "exec_id",
            "exec records (needs the exec helper)",
        ))
    }

    /// Removes the target and everything created for the run. Idempotent; no grace period.
    async fn stop(&self) -> Result<()>;

    /// The path the run's execs take: through the in-sandbox helper, or one engine exec
    /// each.
    fn exec_path(&self) -> crate::ExecPath {
        crate::ExecPath::Plain
    }
}

/// Conveniences over [`Run`], for every run. Not meant to be implemented by hand.
#[async_trait]
pub trait RunExt: Run {
    /// Runs a command to its end and returns its buffered output, each stream capped at
    /// [`ExecSpec::output_limit`] (default [`DEFAULT_OUTPUT_LIMIT`]).
    ///
    /// A command that could not start because the exec's `working_dir` or `user` does not
    /// exist in the run is an [`ErrorKind::NotFound`] error naming that field
    /// ([`crate::ExitStatus::NotStarted`] on a stream); a target that vanished while the
    /// command ran is an [`ErrorKind::RunLost`] error ([`crate::ExitStatus::RunLost`]).
    async fn exec(&self, spec: ExecSpec) -> Result<ExecOutput> {
        let limit = spec.output_limit.unwrap_or(DEFAULT_OUTPUT_LIMIT);
        let out = self.exec_stream(spec).await?.collect(limit).await;
        match out.status.not_started_error() {
            Some(e) => Err(e.with("run", self.id())),
            None => Ok(out),
        }
    }

    /// Waits for exec `id` to end (from any process) and returns its status, reading
    /// none of its output and taking it from no reader (it watches [`Run::execs`], every
    /// 50 ms at first, then every 500 ms). For a detached exec, or one whose record was
    /// not released yet: a non-detached exec's record goes once its own stream read its
    /// status, and then this is [`ErrorKind::NotFound`] naming `exec_id`.
    async fn wait_exec(&self, id: crate::ExecId) -> Result<ExitStatus> {
        let mut pause = std::time::Duration::from_millis(50);
        loop {
            let list = self.execs().await?;
            let Some(info) = list.into_iter().find(|e| e.id == id) else {
                return Err(crate::execs::no_such_exec(id, self.id()));
            };
            if let Some(status) = info.status {
                return Ok(status);
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(std::time::Duration::from_millis(500));
        }
    }

    /// Writes one file (its parent directory must exist) with `mode`, replacing a regular
    /// file of that name. `path` must be absolute and name a file; a path that is a
    /// directory in the run is [`ErrorKind::InvalidSpec`] naming `path`, and nothing is
    /// changed. For large files see [`RunExt::put_file_stream`].
    async fn put_file(&self, path: &str, contents: &[u8], mode: u32) -> Result<()> {
        let len = contents.len() as u64;
        self.put_file_stream(path, std::io::Cursor::new(contents.to_vec()), len, mode)
            .await
    }

    /// Writes one file of exactly `len` bytes read from `contents`, streaming: memory stays
    /// bounded whatever the size. Same path rules as [`RunExt::put_file`].
    async fn put_file_stream<R>(&self, path: &str, contents: R, len: u64, mode: u32) -> Result<()>
    where
        R: tokio::io::AsyncRead + Send + Unpin + 'static,
    {
        let (dir, name) = files::split_file_path(path)?;
        let tar = files::file_tar_stream(name, contents, len, mode)?;
        self.put_archive(dir, tar)
            .await
            .map_err(|e| e.with("path", path))
    }

    /// Reads one regular file into memory, at most [`files::FILE_LIMIT`] bytes (a larger
    /// file is [`ErrorKind::InvalidSpec`] naming `path`; use [`RunExt::get_file_stream`]).
    /// A directory is [`ErrorKind::InvalidSpec`] naming `path`; a missing file
    /// [`ErrorKind::NotFound`].
    async fn get_file(&self, path: &str) -> Result<Vec<u8>> {
        self.get_file_stream(path)
            .await?
            .read_all(files::FILE_LIMIT, path)
            .await
    }

    /// Reads one regular file as a stream ([`files::FileReader`] is an `AsyncRead` that
    /// knows the size): memory stays bounded whatever the size.
    async fn get_file_stream(&self, path: &str) -> Result<files::FileReader> {
        files::split_file_path(path)?;
        let tar = self.get_archive(path).await?;
        files::file_from_tar_stream(tar, path).await
    }
}

impl<T: Run + ?Sized> RunExt for T {}

/// Runs the spec's post-create commands in order, with the run's env and directory.
/// The first failure is [`ErrorKind::PostCreateFailed`] with its status and the tails of
/// its output; the caller then removes the run.
pub(crate) async fn run_post_create(run: &dyn Run, spec: &RunSpec) -> Result<()> {
    const TAIL: usize = 4096;
    let tail = |b: &[u8]| String::from_utf8_lossy(&b[b.len().saturating_sub(TAIL)..]).into_owned();
    for (i, argv) in spec.post_create.iter().enumerate() {
        let span = tracing::debug_span!("post_create", index = i, program = %argv[0]);
        let out = tracing::Instrument::instrument(
            run.exec(ExecSpec {
                argv: argv.clone(),
                ..Default::default()
            }),
            span,
        )
        .await?;
        if !out.status.success() {
            return Err(Error::new(
                ErrorKind::PostCreateFailed,
                format!("post_create[{i}] ({}) {}", argv[0], out.status),
            )
            .with("run", run.id())
            .with("status", &out.status)
            .with("stdout", tail(&out.stdout))
            .with("stderr", tail(&out.stderr)));
        }
    }
    Ok(())
}

/// A fresh run id: `sbx-` and 12 hex digits, valid as a container name and a
/// Kubernetes object name.
pub(crate) fn new_run_id() -> String {
    format!("sbx-{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_ids_are_valid_names() {
        let id = new_run_id();
        assert_eq!(id.len(), 16);
        assert!(id.starts_with("sbx-"));
        crate::labels::validate_value(&id).unwrap();
        assert_ne!(new_run_id(), new_run_id());
    }
}
