//! The status and kill of one exec: [`Control`] on the plain path (the status checked
//! against the target, the kill by the exec marker through one more raw exec), and
//! [`HelperControl`] through the helper (its kill, falling back to the plain one).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;

use crate::error::{Error, ErrorKind, Result};
use crate::exec::{EXEC_ID_ENV, ExecControl, ExitStatus, KILL_SCRIPT};
use crate::helper;
use crate::helper::durable::ExecLink;
use crate::raw::{Backend, RawExec, RawStatus};
use crate::spec::Stdin;

/// How long a kill exec may take before it is abandoned (the script ends within ~1.5 s).
const KILL_EXEC_BOUND: Duration = Duration::from_secs(8);

/// Status and kill of one exec through the helper. When the helper is gone (its stream
/// broke, or it was killed), the kill falls back to the plain path's [`KILL_SCRIPT`] by
/// the exec marker, so a dead helper leaves no process behind.
pub(super) struct HelperControl<B: Backend> {
    /// The session the exec is reached through (it changes when its output resumed
    /// through a new connection).
    pub(super) link: Arc<ExecLink>,
    /// Started detached: neither a dropped stream nor a broken connection kills it.
    pub(super) detached: bool,
    /// The status (from the helper) and the plain kill.
    pub(super) fallback: Control<B>,
}

#[async_trait]
impl<B: Backend> ExecControl for HelperControl<B> {
    /// An exit code from the helper is the command's own: the command called `exit` (a
    /// target removed or stopped kills its processes with SIGKILL, never with an exit
    /// code), so only a signal or an error is checked against the target (no engine call
    /// per failing exec: with hundreds of runs, each command that exits 1 made one).
    async fn status(&self) -> Result<ExitStatus> {
        let status = self.fallback.status.status().await;
        if matches!(status, Ok(ExitStatus::Exited(_))) {
            return status;
        }
        self.fallback.unless_lost(status).await
    }

    /// The helper's kill, bounded by [`helper::KILL_ANSWER_TIMEOUT`]; a helper that does
    /// not confirm it in time is retired (the next exec starts a new one). Without a
    /// helper's kill, the engine kills by the exec marker, and continues the old helper
    /// in case it was stopped (it then sees its closed stream and ends what it started).
    fn detached(&self) -> bool {
        self.detached || self.link.let_go()
    }

    async fn kill(&self) -> Result<()> {
        let session = self.link.session();
        match tokio::time::timeout(helper::KILL_ANSWER_TIMEOUT, session.kill(self.link.id)).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => {
                tracing::debug!(run = %self.fallback.id, "the helper cannot kill ({e}); killing by the exec marker");
            }
            Err(_) => {
                tracing::warn!(run = %self.fallback.id, "the exec helper did not confirm a kill; replacing it, killing by the exec marker");
                session.retire("the helper did not confirm a kill in time");
            }
        }
        let pids = [session.hello.pid, session.hello.relay];
        let wake = helper::wake(&self.fallback.backend, &self.fallback.id, &pids);
        tokio::join!(self.fallback.kill(), wake).0
    }
}

/// Status and kill of a reattached exec: through the helper only (this process does not
/// know the exec's marker, so there is no kill through the engine to fall back on; a
/// kill the helper does not confirm is an error, never taken for done).
pub(super) struct ReattachControl {
    pub(super) link: Arc<ExecLink>,
    pub(super) detached: bool,
    pub(super) status: Box<dyn RawStatus>,
}

#[async_trait]
impl ExecControl for ReattachControl {
    async fn status(&self) -> Result<ExitStatus> {
        self.status.status().await
    }

    fn detached(&self) -> bool {
        self.detached || self.link.let_go()
    }

    async fn kill(&self) -> Result<()> {
        let session = self.link.session();
        match tokio::time::timeout(helper::KILL_ANSWER_TIMEOUT, session.kill(self.link.id)).await {
            Ok(r) => r,
            Err(_) => {
                session.retire("the helper did not confirm a kill in time");
                Err(Error::new(
                    ErrorKind::Backend,
                    "the exec helper did not confirm the kill in time",
                ))
            }
        }
    }
}

/// How long the check that a run's target still runs may take, after an exec that did
/// not succeed.
pub(super) const TARGET_CHECK_BOUND: Duration = Duration::from_secs(10);

impl<B: Backend> Control<B> {
    /// The status, unless the target vanished or stopped under the command: engines then
    /// report an exit code of their own (137 on Docker, 126 on Kubernetes) or none, and
    /// that is never the command's status, but [`ExitStatus::RunLost`]. Checked only when
    /// the exec did not succeed, so a successful exec costs nothing more.
    async fn unless_lost(&self, status: Result<ExitStatus>) -> Result<ExitStatus> {
        if matches!(status, Ok(ExitStatus::Exited(0))) {
            return status;
        }
        // A target being removed kills its processes before the engine marks it stopped:
        // a SIGKILL (or no status) is looked at again for a moment.
        let looks = if matches!(status, Ok(ExitStatus::Signaled(9)) | Err(_)) {
            5
        } else {
            1
        };
        let give_up = tokio::time::Instant::now() + TARGET_CHECK_BOUND;
        for look in 1..=looks {
            // After a SIGKILL or no status, the engine's record of the target may lag
            // (a kubelet reports a container that died a second or more later): a probe
            // exec then tells at once whether the target still runs.
            let check = async {
                self.backend.attach_target(&self.id).await?;
                if looks > 1 {
                    self.probe().await?;
                }
                Ok::<(), Error>(())
            };
            match tokio::time::timeout_at(give_up, check).await {
                Ok(Err(e)) if matches!(e.kind(), ErrorKind::RunLost | ErrorKind::NotFound) => {
                    return Ok(ExitStatus::RunLost(e.to_string()));
                }
                Ok(Ok(())) if look < looks => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                other => {
                    tracing::debug!(run = %self.id, "after {status:?} the target looks {other:?}");
                    break;
                }
            }
        }
        status
    }
}

/// How long the probe exec of [`Control::probe`] may take.
const PROBE_BOUND: Duration = Duration::from_secs(5);

impl<B: Backend> Control<B> {
    /// One raw exec of `true` in the target: an error when the target no longer runs
    /// (the engine refuses the exec: [`ErrorKind::RunLost`] or [`ErrorKind::NotFound`]).
    /// A probe that cannot tell (it times out, or `true` fails) says nothing: `Ok`.
    async fn probe(&self) -> Result<()> {
        // As the exec's own user, as the kill: only the engine's refusal counts, and a
        // `true` that user planted on its PATH runs with no more than its rights.
        let raw = RawExec {
            argv: vec!["true".into()],
            env: Vec::new(),
            working_dir: Some("/".into()),
            user: self.user.clone(),
            stdin: Stdin::Null,
            self_delimited: false,
        };
        let probe = async {
            let mut process = self.backend.exec_raw(&self.id, raw).await?;
            drop(process.stdin.take());
            while let Some(chunk) = process.output.next().await {
                if chunk.is_err() {
                    break;
                }
            }
            process.status.status().await
        };
        match tokio::time::timeout(PROBE_BOUND, probe).await {
            Ok(Err(e)) if matches!(e.kind(), ErrorKind::RunLost | ErrorKind::NotFound) => Err(e),
            _ => Ok(()),
        }
    }
}

/// Status and kill of one exec.
pub(super) struct Control<B: Backend> {
    pub(super) backend: B,
    pub(super) id: String,
    pub(super) marker: String,
    /// The exec's user and env: the kill runs with them, so it may signal its processes.
    pub(super) user: Option<String>,
    pub(super) env: Vec<(String, String)>,
    pub(super) status: Box<dyn RawStatus>,
}

#[async_trait]
impl<B: Backend> ExecControl for Control<B> {
    async fn status(&self) -> Result<ExitStatus> {
        let status = self.status.status().await;
        self.unless_lost(status).await
    }

    /// One more raw exec of [`KILL_SCRIPT`]: not an [`ExecStream`], so nothing kills it in
    /// turn, and bounded in time.
    async fn kill(&self) -> Result<()> {
        let mut env = self.env.clone();
        env.push((EXEC_ID_ENV.to_string(), format!("{}-kill", self.marker)));
        let raw = RawExec {
            argv: ["sh", "-c", KILL_SCRIPT, "runcell-kill", &self.marker]
                .map(String::from)
                .to_vec(),
            env,
            working_dir: Some("/".into()),
            user: self.user.clone(),
            stdin: Stdin::Null,
            self_delimited: false,
        };
        // What the kill says on stderr (which processes outlived it), kept bounded.
        let mut said = Vec::new();
        let kill = async {
            let mut process = self.backend.exec_raw(&self.id, raw).await?;
            drop(process.stdin.take());
            while let Some(chunk) = process.output.next().await {
                let chunk = chunk.map_err(|e| {
                    Error::new(ErrorKind::Backend, "the kill exec broke").with_source(e)
                })?;
                if let crate::exec::OutputChunk::Stderr(b) = chunk {
                    let room = 512usize.saturating_sub(said.len());
                    said.extend_from_slice(&b[..b.len().min(room)]);
                }
            }
            process.status.status().await
        };
        let status = tokio::time::timeout(KILL_EXEC_BOUND, kill)
            .await
            .map_err(|_| {
                Error::new(ErrorKind::Timeout, "the kill exec did not end").with("run", &self.id)
            })??;
        if status.success() {
            Ok(())
        } else {
            let said = String::from_utf8_lossy(&said);
            let said = said.trim();
            Err(Error::new(
                ErrorKind::Backend,
                if said.is_empty() {
                    format!("the kill exec {status}")
                } else {
                    format!("the kill exec {status}: {said}")
                },
            )
            .with("run", &self.id))
        }
    }
}
