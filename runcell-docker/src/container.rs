//! The container's life on the engine besides its create body (`body.rs`): the start
//! (after the CA files), listing, removal, and what core is told of a container that did
//! not come up.

use std::time::Duration;

use bollard::Docker;
use bollard::query_parameters::RemoveContainerOptionsBuilder;
use futures::StreamExt;
use runcell_core::raw::{Backend, KEEPALIVE, Plan};
use runcell_core::{Error, ErrorKind, Result};

use crate::{DockerDriver, error};

impl DockerDriver {
    /// Everything after the container exists: the CA files, then the start. On error
    /// core removes the container.
    pub(crate) async fn set_up(&self, id: &str, plan: &Plan<'_>) -> Result<()> {
        if let Some(pem) = &plan.ca_pem {
            self.install_ca(id, plan.spec, pem).await?;
        }
        if let Err(e) = self
            .docker
            .start_container(id, None::<bollard::query_parameters::StartContainerOptions>)
            .await
        {
            let message = error::message(&e).to_string();
            return Err(
                if message.contains("unable to find user")
                    || message.contains("unable to find group")
                {
                    Error::new(
                        ErrorKind::NotFound,
                        format!("the image has no such user: {message}"),
                    )
                    .with_field("user")
                    .with("run", id)
                } else {
                    let mut err = Error::new(ErrorKind::StartFailed, "the container did not start")
                        .with("run", id);
                    for (k, v) in self.diagnose(id).await {
                        err = err.with(k, v);
                    }
                    err.with_source(e)
                },
            );
        }
        Ok(())
    }

    /// Lists containers, again when a container vanished while the engine listed it:
    /// Podman then fails the whole list ("getting container from store ...: container
    /// not known", status 500) instead of leaving it out, as Docker does. The window is
    /// a removal's (storage gone, record not yet), which lasts long on a loaded rootless
    /// engine: asked again for up to 10 s, 50 ms apart at first, then up to 500 ms.
    pub(crate) async fn list_containers(
        &self,
        options: bollard::query_parameters::ListContainersOptions,
    ) -> std::result::Result<Vec<bollard::models::ContainerSummary>, bollard::errors::Error> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let mut pause = Duration::from_millis(50);
        loop {
            match self.docker.list_containers(Some(options.clone())).await {
                Err(e)
                    if tokio::time::Instant::now() < deadline
                        && error::status(&e) == Some(500)
                        && error::message(&e).contains("container not known") =>
                {
                    tracing::debug!("the engine lost a container while listing: asking again");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(500));
                }
                answer => return answer,
            }
        }
    }

    /// The last lines the container wrote, for errors (empty if none or unreadable).
    async fn log_tail(&self, id: &str) -> String {
        let options = bollard::query_parameters::LogsOptionsBuilder::default()
            .stdout(true)
            .stderr(true)
            .tail("20")
            .build();
        let lines: Vec<_> = self
            .docker
            .logs(id, Some(options))
            .filter_map(|item| async move { item.ok().map(|l| l.to_string()) })
            .collect()
            .await;
        lines.concat().trim().to_string()
    }

    /// What core is told of a container that did not come up: its keep-alive, exit code
    /// and error when it is not running, and its last log lines.
    pub(crate) async fn diagnose_container(&self, id: &str) -> Vec<(&'static str, String)> {
        let mut found = Vec::new();
        if let Ok(inspect) = self
            .docker
            .inspect_container(
                id,
                None::<bollard::query_parameters::InspectContainerOptions>,
            )
            .await
        {
            let state = inspect.state.unwrap_or_default();
            if state.running != Some(true) {
                found.push(("keepalive", KEEPALIVE.join(" ")));
                found.push(("exit_code", state.exit_code.unwrap_or(-1).to_string()));
                if let Some(error) = state.error.filter(|e| !e.is_empty()) {
                    found.push(("error", error));
                }
            }
        }
        let log = self.log_tail(id).await;
        if !log.is_empty() {
            found.push(("log", log));
        }
        found
    }
}

impl DockerDriver {
    /// A [`ErrorKind::RunLost`] error with what the engine says of the container (its
    /// exit code, an OOM kill, its error), or that it is gone; bounded in time.
    pub(crate) async fn why_lost(&self, id: &str, e: Error) -> Error {
        let inspect = tokio::time::timeout(
            WHY_LOST_BOUND,
            self.docker.inspect_container(
                id,
                None::<bollard::query_parameters::InspectContainerOptions>,
            ),
        )
        .await;
        let why = match inspect {
            Ok(Ok(i)) => why_stopped(&i.state.unwrap_or_default()),
            Ok(Err(e)) if error::status(&e) == Some(404) => "the container is gone".into(),
            _ => return self.locate(e),
        };
        self.locate(e.with_detail(why))
    }
}

/// How long [`DockerDriver::why_lost`] may look.
const WHY_LOST_BOUND: Duration = Duration::from_secs(5);

/// What the engine says of a container that is not running: its state, exit code, an
/// OOM kill, its error.
pub(crate) fn why_stopped(state: &bollard::models::ContainerState) -> String {
    let mut why = match state.status {
        Some(s) => format!("{s}"),
        None => "not running".to_string(),
    };
    if let Some(code) = state.exit_code {
        why.push_str(&format!(", exit code {code}"));
    }
    if state.oom_killed == Some(true) {
        why.push_str(", killed for its memory use (OOMKilled)");
    }
    if let Some(error) = state.error.as_deref().filter(|e| !e.is_empty()) {
        why.push_str(&format!(", {error}"));
    }
    why
}

/// Force-removes a container with its anonymous volumes; one already gone, or already
/// being removed, is no error.
pub(crate) async fn remove_container(docker: &Docker, id: &str) -> Result<()> {
    let options = RemoveContainerOptionsBuilder::default()
        .force(true)
        .v(true)
        .build();
    match docker.remove_container(id, Some(options)).await {
        Ok(()) => Ok(()),
        Err(e) if error::status(&e) == Some(404) => Ok(()),
        // "removal already in progress": another stop got there first.
        Err(e) if error::status(&e) == Some(409) => Ok(()),
        Err(e) => Err(error::map("remove container", e).with("run", id)),
    }
}
