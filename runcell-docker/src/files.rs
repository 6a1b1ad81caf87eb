//! Archives in and out of a container through the engine's archive API (`PUT` and `GET
//! /containers/{id}/archive`); core checks every archive.

use std::sync::Arc;

use bollard::Docker;
use bollard::query_parameters::{
    DownloadFromContainerOptionsBuilder, UploadToContainerOptionsBuilder,
};
use futures::{StreamExt, TryStreamExt};
use runcell_core::{ByteStream, Error, ErrorKind, Result};

use crate::error;

pub(crate) async fn put_archive(
    docker: &Docker,
    id: &str,
    dir: &str,
    tar: ByteStream,
) -> Result<()> {
    runcell_core::files::validate_dir_path(dir)?;
    // The daemon must never replace a directory with a file or the reverse: without this
    // flag, a file named like an existing directory (`/workspace`) replaces it, content and
    // all (through a bind mount, on the host).
    let options = UploadToContainerOptionsBuilder::default()
        .path(dir)
        .no_overwrite_dir_non_dir("true")
        .build();
    // Core checks the source (a cut one fails inside an entry); the failure is kept to
    // name the entry instead of the engine's generic error.
    let cut: Arc<std::sync::Mutex<Option<String>>> = Arc::default();
    let tar = {
        let cut = cut.clone();
        tar.inspect_err(move |e| {
            cut.lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert_with(|| e.to_string());
        })
        .boxed()
    };
    let uploaded = docker
        .upload_to_container(id, Some(options), bollard::body_try_stream(tar))
        .await;
    if let Some(why) = cut.lock().unwrap_or_else(|p| p.into_inner()).take() {
        return Err(Error::new(
            ErrorKind::Backend,
            format!("the archive to upload failed: {why}"),
        )
        .with_operation("upload archive")
        .with("run", id)
        .with("dir", dir));
    }
    match uploaded {
        Ok(()) => Ok(()),
        // 400 or 500 ("Error processing tar file(exit status 1): cannot overwrite
        // directory ... with non-directory"), depending on the daemon's version.
        Err(e) if error::message(&e).contains("cannot overwrite") => Err(Error::invalid_spec(
            "path",
            format!(
                "would replace a directory with a non-directory (or the reverse) in {dir}: {}",
                error::message(&e)
            ),
        )
        .with("run", id)),
        Err(e) => Err(error::map("upload archive", e)
            .with("run", id)
            .with("dir", dir)),
    }
}

pub(crate) async fn get_archive(docker: &Docker, id: &str, path: &str) -> Result<ByteStream> {
    let options = DownloadFromContainerOptionsBuilder::default()
        .path(path)
        .build();
    let mut chunks = docker.download_from_container(id, Some(options));
    // The daemon's answer (404, 409, ...) comes with the first item: read it here so that
    // it is a typed error, not a broken stream.
    let first = match chunks.next().await {
        None => None,
        Some(Ok(b)) => Some(b),
        Some(Err(e)) => {
            let mapped = error::map("download archive", e)
                .with("run", id)
                .with("path", path);
            return Err(if mapped.kind() == ErrorKind::NotFound {
                mapped.with_field("path")
            } else {
                mapped
            });
        }
    };
    let rest = chunks.map_err(std::io::Error::other);
    // Core checks that the archive ends whole (`files::checked_tar_stream`).
    Ok(futures::stream::iter(first.map(Ok)).chain(rest).boxed())
}
