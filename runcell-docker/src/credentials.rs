//! Registry credentials for pulls, as the Docker daemon takes them: the login
//! [`runcell_core::credentials::lookup`] finds for the image's registry.

use std::path::Path;

use bollard::auth::DockerCredentials;
use runcell_core::Result;
use runcell_core::credentials::{RegistryCredentials, lookup, server_address};

pub use runcell_core::registry_of;

/// The credentials to send for a pull of `image`: the explicit ones for its registry,
/// else those of `config.json` in `docker_config_dir` (default `$DOCKER_CONFIG`, else
/// `~/.docker`). `None` pulls anonymously. Blocking (a credential helper is a process).
pub fn for_image(
    image: &str,
    explicit: &[RegistryCredentials],
    docker_config_dir: Option<&Path>,
) -> Result<Option<DockerCredentials>> {
    let registry = registry_of(image);
    Ok(
        lookup(&registry, explicit, docker_config_dir)?.map(|login| DockerCredentials {
            username: login.username,
            password: login.password,
            identitytoken: login.identity_token,
            serveraddress: Some(server_address(&registry)),
            ..Default::default()
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use runcell_core::credentials::DOCKER_HUB_KEY;
    use runcell_core::normalize_registry as normalize;

    #[test]
    fn registries_of_references() {
        assert_eq!(registry_of("busybox"), "docker.io");
        assert_eq!(registry_of("library/busybox:1"), "docker.io");
        assert_eq!(registry_of("127.0.0.1:5000/t/img:v1"), "127.0.0.1:5000");
        assert_eq!(registry_of("localhost/img"), "localhost");
        assert_eq!(registry_of("ghcr.io/o/img@sha256:ab"), "ghcr.io");
        assert_eq!(normalize(DOCKER_HUB_KEY), "docker.io");
        assert_eq!(normalize("http://Reg.example:5000/v2/"), "reg.example:5000");
    }

    #[test]
    fn a_pull_carries_the_daemons_server_name() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"auths": {"https://index.docker.io/v1/": {"auth": "dTE6cDE="}}}"#,
        )
        .unwrap();
        let hub = for_image("busybox", &[], Some(dir.path()))
            .unwrap()
            .unwrap();
        assert_eq!(
            (hub.username.as_deref(), hub.password.as_deref()),
            (Some("u1"), Some("p1"))
        );
        assert_eq!(hub.serveraddress.as_deref(), Some(DOCKER_HUB_KEY));
        let explicit = [RegistryCredentials::new("reg:5000", "u", "p")];
        let reg = for_image("reg:5000/x", &explicit, Some(dir.path()))
            .unwrap()
            .unwrap();
        assert_eq!(reg.serveraddress.as_deref(), Some("reg:5000"));
    }
}
