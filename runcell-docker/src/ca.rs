//! The run's CA files, written into the created container before it starts (core installs
//! them in a pooled target after the claim): the injected certificates, the full bundle,
//! and where possible the image's system bundle.

use runcell_core::{ErrorKind, Result, RunSpec, ca, files};

use crate::DockerDriver;
use crate::files::{get_archive, put_archive};

impl DockerDriver {
    /// Writes the CA files into the created (not yet started) container: the injected
    /// certificates, the full bundle, and, where the image has a system bundle and a
    /// writable root, the system bundle itself plus an `update-ca-certificates` source.
    pub(crate) async fn install_ca(&self, id: &str, spec: &RunSpec, injected: &str) -> Result<()> {
        let mut system = None;
        for path in ca::SYSTEM_BUNDLES {
            if let Some(text) = self.read_regular_file(id, path).await? {
                system = Some((path, text));
                break;
            }
        }
        let bundle = ca::full_bundle(system.as_ref().map_or("", |(_, t)| t), injected);
        if spec.security.read_only_rootfs {
            // Only the volume at /etc/sandbox is writable; the daemon judges an upload by
            // its destination, so upload there (the system store stays as the image has it).
            let tar = files::tar_of_files(&[
                ("ca.pem", injected.as_bytes(), 0o644),
                ("ca-bundle.pem", bundle.as_bytes(), 0o644),
            ])?;
            return put_archive(&self.docker, id, ca::DIR, files::byte_stream(tar)).await;
        }
        let mut files: Vec<(&str, &[u8], u32)> = vec![
            (ca::CA_FILE, injected.as_bytes(), 0o644),
            (ca::BUNDLE_FILE, bundle.as_bytes(), 0o644),
        ];
        if let Some((path, _)) = system {
            files.push((path, bundle.as_bytes(), 0o644));
            files.push((ca::SYSTEM_EXTRA_DIR_FILE, injected.as_bytes(), 0o644));
        }
        put_archive(
            &self.docker,
            id,
            "/",
            files::byte_stream(files::tar_of_files(&files)?),
        )
        .await
    }

    /// A regular file's text from the container, `None` if absent or not a regular file.
    async fn read_regular_file(&self, id: &str, path: &str) -> Result<Option<String>> {
        let tar = match get_archive(&self.docker, id, path).await {
            Ok(t) => t,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        // Not a regular file, or not UTF-8 text: no usable bundle.
        let Ok(file) = files::file_from_tar_stream(tar, path).await else {
            return Ok(None);
        };
        Ok(String::from_utf8(file.read_all(files::FILE_LIMIT, path).await?).ok())
    }
}
