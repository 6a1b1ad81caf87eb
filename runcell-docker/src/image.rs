//! The image a container is created from: present as the pull policy says, pulled with
//! the registry's credentials (progress reported), and never an image found by an ID
//! prefix of its name.

use bollard::query_parameters::CreateImageOptionsBuilder;
use futures::StreamExt;
use runcell_core::raw::Plan;
use runcell_core::{Error, ErrorKind, Progress, PullPolicy, Result};

use crate::{DockerDriver, credentials, error};

impl DockerDriver {
    /// Makes the image present as the pull policy says, and returns the reference the
    /// container is created from: the spec's image, or, for a name the engine could take
    /// for an image ID prefix (`5`, `0a1b`), the ID of the local image that carries that
    /// name, or the name written out in full once pulled — never an image found by prefix.
    pub(crate) async fn ensure_image(&self, plan: &Plan<'_>) -> Result<String> {
        let (image, policy) = (plan.spec.image.as_str(), plan.spec.pull);
        if let Some(snapshot) = &plan.spec.from_snapshot {
            self.check_snapshot_image(snapshot, image).await?;
        }
        let hex_name = runcell_core::could_be_id_prefix(image);
        let present = match self.docker.inspect_image(image).await {
            // An engine answers a hex name with the image whose ID begins with it when
            // no image has the name: the name counts only if the image carries it.
            Ok(found) if hex_name => {
                let tag = format!("{image}:latest");
                let named = found.repo_tags.iter().flatten().any(|t| {
                    t == &tag || t.strip_suffix(&tag).is_some_and(|host| host.ends_with('/'))
                });
                match found.id {
                    Some(id) if named => Some(id),
                    _ => None,
                }
            }
            Ok(_) => Some(image.to_string()),
            Err(e) if error::status(&e) == Some(404) => None,
            Err(e) => return Err(error::map("inspect image", e).with("image", image)),
        };
        let pulled_as = if hex_name {
            runcell_core::qualified_name(image)
        } else {
            image.to_string()
        };
        let pull = match policy {
            PullPolicy::Always => true,
            PullPolicy::IfNotPresent => present.is_none(),
            PullPolicy::Never => false,
        };
        if !pull {
            return if let Some(present) = present {
                Ok(present)
            } else {
                Err(Error::new(
                    ErrorKind::NotFound,
                    format!("image {image} is not present and the pull policy is never"),
                )
                .with("image", image))
            };
        }
        let (name, tag) = split_tag(image);
        let mut options = CreateImageOptionsBuilder::default().from_image(name);
        if let Some(tag) = tag {
            options = options.tag(tag);
        }
        let options = options.build();
        let registry = credentials::registry_of(image);
        let (explicit, dir) = (self.credentials.clone(), self.docker_config_dir.clone());
        let owned_image = image.to_string();
        // A credential helper is a process: off the async threads.
        let auth = tokio::task::spawn_blocking(move || {
            credentials::for_image(&owned_image, &explicit, dir.as_deref())
        })
        .await
        .map_err(|e| {
            Error::new(ErrorKind::Backend, "docker: credential lookup panicked").with_source(e)
        })?
        .map_err(|e| e.with("image", image))?;
        let with_credentials = auth.is_some();
        plan.report(Progress::Step(format!("pulling {image}")));
        let mut pull_stream = self.docker.create_image(Some(options), None, auth);
        let pulled = loop {
            match pull_stream.next().await {
                None => break Ok(()),
                Some(Err(e)) => break Err(e),
                Some(Ok(info)) => {
                    let detail = info.progress_detail.unwrap_or_default();
                    plan.report(Progress::Pull {
                        image: image.to_string(),
                        layer: info.id.unwrap_or_default(),
                        status: info.status.unwrap_or_default(),
                        current: detail.current.and_then(|c| u64::try_from(c).ok()),
                        total: detail.total.and_then(|t| u64::try_from(t).ok()),
                    });
                }
            }
        };
        match (pulled, present) {
            (Ok(()), _) => Ok(pulled_as),
            (Err(e), Some(present)) => {
                tracing::warn!(image, "pull failed, using the local image: {e}");
                Ok(present)
            }
            (Err(e), None) if refused(&e) => Err(Error::new(
                ErrorKind::NotFound,
                format!(
                    "image {image} is not present and registry {registry} refused the pull ({}): check the registry credentials",
                    if with_credentials {
                        "credentials were sent"
                    } else {
                        "no credentials for it in the driver config or config.json"
                    }
                ),
            )
            .with("image", image)
            .with("registry", &registry)
            .with_source(e)),
            (Err(e), None) => Err(Error::new(
                ErrorKind::NotFound,
                format!("image {image} is not present and could not be pulled"),
            )
            .with("image", image)
            .with("registry", &registry)
            .with_source(e)),
        }
    }
}

/// Whether a failed pull was the registry refusing access (401/403 or the daemon's
/// wording for them).
fn refused(e: &bollard::errors::Error) -> bool {
    let text = match e {
        bollard::errors::Error::DockerStreamError { error } => error.as_str(),
        _ => error::message(e),
    };
    let text = text.to_ascii_lowercase();
    matches!(error::status(e), Some(401 | 403))
        || [
            "unauthorized",
            "authentication required",
            "no basic auth credentials",
            "access denied",
            "denied: ",
            "pull access denied",
        ]
        .iter()
        .any(|w| text.contains(w))
}

/// Splits `repo[:tag]` for a pull; a reference with neither tag nor digest gets `latest`
/// (the API would otherwise pull every tag). A digest stays in the name.
fn split_tag(image: &str) -> (&str, Option<&str>) {
    if image.contains('@') {
        return (image, None);
    }
    let last = image.rsplit('/').next().unwrap_or(image);
    match last.rsplit_once(':') {
        Some((_, tag)) => (&image[..image.len() - tag.len() - 1], Some(tag)),
        None => (image, Some("latest")),
    }
}

#[cfg(test)]
mod tests {
    use super::split_tag;

    #[test]
    fn pulls_name_a_tag() {
        assert_eq!(split_tag("python"), ("python", Some("latest")));
        assert_eq!(split_tag("python:3.12"), ("python", Some("3.12")));
        assert_eq!(
            split_tag("reg:5000/team/img"),
            ("reg:5000/team/img", Some("latest"))
        );
        assert_eq!(
            split_tag("reg:5000/team/img:v1"),
            ("reg:5000/team/img", Some("v1"))
        );
        assert_eq!(split_tag("img@sha256:abc"), ("img@sha256:abc", None));
    }
}
