//! Snapshots on Docker ([`runcell_core::Snapshot`]): the engine's commit of the
//! container's filesystem, plus one layer of our own with the workspace (a volume or a
//! bind, which no commit holds) and the CA files the library installed taken back out,
//! loaded as an image whose configuration is the base image's (never the run's env,
//! labels or keep-alive, which a commit would copy in).
//!
//! Consistency: nothing is frozen. Docker 20.10 wedges a container for good when an exec
//! starts while it is paused (the shim waits on the frozen exec and cannot resume: seen
//! here with a concurrent plain-path exec), and a run's other tool calls may exec at any
//! time, so the commit does not pause (`pause=false`) and the workspace is read right
//! after it while the commands go on. A file replaced whole (written aside, renamed into
//! place) is in the snapshot whole, before or after; a file written in place while the
//! snapshot reads it may be captured half-written; the filesystem and the workspace are
//! read one after the other, not at one instant. The image is loaded from a `docker save`-shaped
//! archive that carries only the new layer: the engine takes the layers it already has
//! by their chain ID (the commit's, kept until the load is done) and never reads them.
//!
//! Podman: not yet (its load reads every layer, and its commit copies the container's
//! env and labels into the image): `Unsupported`.

use std::collections::BTreeMap;
use std::io::{Read, Seek, Write};

use bollard::query_parameters::{
    CommitContainerOptionsBuilder, ImportImageOptionsBuilder, ListImagesOptionsBuilder,
    RemoveImageOptionsBuilder,
};
use futures::StreamExt;
use runcell_core::snapshot_labels::{SNAPSHOT_ID, SNAPSHOT_WORKSPACE};
use runcell_core::{Error, ErrorKind, Result, Snapshot, ca, labels};
use sha2::{Digest, Sha256};

use crate::DockerDriver;
use crate::error;

/// The repository snapshot images are tagged in (`runcell-snapshot:<id>`), so that an
/// image prune never takes one.
const REPOSITORY: &str = "runcell-snapshot";
/// Labels with the base image and the size (Docker labels take any value).
const BASE_LABEL: &str = "sandbox.dev/snapshot-base";
const SIZE_LABEL: &str = "sandbox.dev/snapshot-size";

/// The whiteouts and files of the layer that take back what the library installed.
const CA_WHITEOUTS: [&str; 2] = [
    "etc/.wh.sandbox",
    "usr/local/share/ca-certificates/.wh.sandbox-ca.crt",
];

fn backend(what: impl Into<String>) -> Error {
    Error::new(ErrorKind::Backend, what)
}

fn io(what: &'static str) -> impl Fn(std::io::Error) -> Error {
    move |e| backend(format!("snapshot: {what}")).with_source(e)
}

/// Removes an image when dropped unless disarmed (the commit, or a half-made snapshot).
struct ImageGuard {
    docker: bollard::Docker,
    image: Option<String>,
}

impl ImageGuard {
    async fn remove_now(mut self) {
        if let Some(image) = self.image.take() {
            remove_image(&self.docker, &image).await;
        }
    }

    fn disarm(mut self) {
        self.image = None;
    }
}

impl Drop for ImageGuard {
    fn drop(&mut self) {
        if let Some(image) = self.image.take() {
            let docker = self.docker.clone();
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                handle.spawn(async move { remove_image(&docker, &image).await });
            }
        }
    }
}

async fn remove_image(docker: &bollard::Docker, image: &str) {
    let options = RemoveImageOptionsBuilder::default().force(false).build();
    match docker.remove_image(image, Some(options), None).await {
        Ok(_) => {}
        Err(e) if error::status(&e) == Some(404) => {}
        Err(e) => tracing::warn!(image, "could not remove an image of a snapshot: {e}"),
    }
}

impl DockerDriver {
    pub(crate) async fn snapshot_container(
        &self,
        id: &str,
        labels: &BTreeMap<String, String>,
    ) -> Result<Snapshot> {
        if self.podman {
            return Err(Error::unsupported(
                "snapshot",
                "snapshots on Podman are not supported yet",
            ));
        }
        let docker = &self.docker;
        let inspect = docker
            .inspect_container(id, None)
            .await
            .map_err(|e| error::map("inspect container", e).with("run", id))?;
        let managed = inspect
            .config
            .as_ref()
            .and_then(|c| c.labels.as_ref())
            .and_then(|l| l.get(labels::MANAGED_BY))
            .is_some_and(|v| v == labels::MANAGED_BY_VALUE);
        if !managed {
            return Err(Error::new(ErrorKind::NotFound, "no such run").with("run", id));
        }
        let base_name = inspect
            .config
            .as_ref()
            .and_then(|c| c.image.clone())
            .unwrap_or_default();
        let base_id = inspect
            .image
            .clone()
            .ok_or_else(|| backend("the container has no image"))?;
        let workspace = workspace_of(&inspect)?;
        let base = docker
            .inspect_image(&base_id)
            .await
            .map_err(|e| error::map("inspect image", e).with("image", &base_id))?;

        let options = CommitContainerOptionsBuilder::default()
            .container(id)
            .pause(false)
            .build();
        let committed = docker
            .commit_container(options, bollard::models::ContainerConfig::default())
            .await
            .map_err(|e| error::map("commit container", e).with("run", id))?
            .id;
        let commit = ImageGuard {
            docker: docker.clone(),
            image: Some(committed.clone()),
        };
        let (layer, layer_bytes) = self.read_layer(id, &workspace).await?;

        let committed_inspect = docker
            .inspect_image(&committed)
            .await
            .map_err(|e| error::map("inspect image", e).with("image", &committed))?;
        let mut diff_ids = committed_inspect
            .root_fs
            .as_ref()
            .and_then(|r| r.layers.clone())
            .unwrap_or_default();
        let adds = committed_inspect.size.unwrap_or(0) - base.size.unwrap_or(0);
        let size = (adds.max(0) as u64).saturating_add(layer_bytes);

        let mut all_labels = labels.clone();
        all_labels.insert(SNAPSHOT_WORKSPACE.into(), workspace.clone());
        all_labels.insert(BASE_LABEL.into(), base_name.clone());
        all_labels.insert(SIZE_LABEL.into(), size.to_string());
        let snapshot_id = labels
            .get(SNAPSHOT_ID)
            .cloned()
            .ok_or_else(|| backend("snapshot labels without an id"))?;
        let tag = format!("{REPOSITORY}:{snapshot_id}");
        let archive = tokio::task::spawn_blocking({
            let base_config = base.config.clone().unwrap_or_default();
            let (os, arch) = (base.os.clone(), base.architecture.clone());
            let all_labels = all_labels.clone();
            let tag = tag.clone();
            move || {
                let (layer_file, digest) = layer;
                diff_ids.push(digest);
                save_archive(
                    layer_file,
                    base_config,
                    os,
                    arch,
                    diff_ids,
                    &all_labels,
                    &tag,
                )
            }
        })
        .await
        .map_err(|e| backend(format!("snapshot: building the image archive: {e}")))??;
        let loaded = ImageGuard {
            docker: docker.clone(),
            image: Some(tag.clone()),
        };
        self.load(archive).await?;
        let image = docker
            .inspect_image(&tag)
            .await
            .map_err(|e| error::map("inspect image", e).with("image", &tag))?;
        let image_id = image
            .id
            .ok_or_else(|| backend("the loaded snapshot image has no ID"))?;
        commit.remove_now().await;
        let snapshot = Snapshot::from_labels(&all_labels, image_id, base_name, size)
            .ok_or_else(|| backend("snapshot labels incomplete"))?;
        loaded.disarm();
        Ok(snapshot)
    }

    /// The workspace (and the CA files taken back out) as one layer: a temporary file
    /// and its digest (`sha256:...`), and its size.
    async fn read_layer(
        &self,
        id: &str,
        workspace: &str,
    ) -> Result<((std::fs::File, String), u64)> {
        let top = workspace
            .trim_start_matches('/')
            .split('/')
            .next()
            .unwrap_or_default()
            .to_string();
        // The archive of the workspace's top-level directory, whose entries are named from
        // the root (`workspace/...`); only the workspace is kept from it.
        let raw = crate::files::get_archive(&self.docker, id, &format!("/{top}")).await?;
        let mut spool = tempfile::tempfile().map_err(io("a temporary file"))?;
        {
            let mut stream = runcell_core::files::checked_tar_stream(raw);
            let mut out =
                tokio::fs::File::from_std(spool.try_clone().map_err(io("a temporary file"))?);
            while let Some(chunk) = stream.next().await {
                let chunk = chunk.map_err(io("reading the workspace"))?;
                tokio::io::AsyncWriteExt::write_all(&mut out, &chunk)
                    .await
                    .map_err(io("spooling the workspace"))?;
            }
            tokio::io::AsyncWriteExt::flush(&mut out)
                .await
                .map_err(io("spooling the workspace"))?;
        }
        let injected = self.read_text(id, ca::CA_FILE).await;
        let mut bundles = Vec::new();
        if let Some(injected) = &injected {
            for path in ca::SYSTEM_BUNDLES {
                if let Some(text) = self.read_text(id, path).await
                    && let Some(pristine) = text.strip_suffix(injected.as_str())
                {
                    bundles.push((
                        path.trim_start_matches('/').to_string(),
                        pristine.to_string(),
                    ));
                }
            }
        }
        let prefix = workspace
            .trim_start_matches('/')
            .trim_end_matches('/')
            .to_string();
        tokio::task::spawn_blocking(move || {
            spool.rewind().map_err(io("spooling the workspace"))?;
            build_layer(spool, &prefix, &bundles)
        })
        .await
        .map_err(|e| backend(format!("snapshot: building the layer: {e}")))?
    }

    /// A small regular file's text, `None` if absent or unreadable.
    async fn read_text(&self, id: &str, path: &str) -> Option<String> {
        let tar = crate::files::get_archive(&self.docker, id, path)
            .await
            .ok()?;
        let file = runcell_core::files::file_from_tar_stream(tar, path)
            .await
            .ok()?;
        String::from_utf8(file.read_all(1 << 20, path).await.ok()?).ok()
    }

    async fn load(&self, archive: std::fs::File) -> Result<()> {
        let file = tokio::fs::File::from_std(archive);
        let body = tokio_util::io::ReaderStream::new(file);
        let options = ImportImageOptionsBuilder::default().quiet(true).build();
        let mut answers = self.docker.import_image_stream(options, body, None);
        while let Some(answer) = answers.next().await {
            let info = answer.map_err(|e| error::map("load image", e))?;
            if let Some(e) = info.error_detail.and_then(|d| d.message) {
                return Err(backend(format!("loading the snapshot image: {e}")));
            }
        }
        Ok(())
    }

    pub(crate) async fn list_snapshot_images(&self) -> Result<Vec<Snapshot>> {
        if self.podman {
            return Ok(Vec::new());
        }
        let filters = std::collections::HashMap::from([(
            "label".to_string(),
            vec![
                format!("{}={}", labels::MANAGED_BY, labels::MANAGED_BY_VALUE),
                SNAPSHOT_ID.to_string(),
            ],
        )]);
        let options = ListImagesOptionsBuilder::default()
            .filters(&filters)
            .build();
        let images = self
            .docker
            .list_images(Some(options))
            .await
            .map_err(|e| error::map("list images", e))?;
        Ok(images
            .into_iter()
            .filter_map(|i| {
                let labels: BTreeMap<String, String> = i.labels.into_iter().collect();
                // Ours only if tagged as ours: an image of a run from a snapshot that
                // someone committed carries the labels too.
                let tag = format!("{REPOSITORY}:{}", labels.get(SNAPSHOT_ID)?);
                if !i.repo_tags.contains(&tag) {
                    return None;
                }
                let base = labels.get(BASE_LABEL).cloned().unwrap_or_default();
                let size = labels
                    .get(SIZE_LABEL)
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(0);
                Snapshot::from_labels(&labels, i.id, base, size)
            })
            .collect())
    }

    /// The snapshot `id`, `None` if there is none.
    pub(crate) async fn find_snapshot(&self, id: &str) -> Result<Option<Snapshot>> {
        Ok(self
            .list_snapshot_images()
            .await?
            .into_iter()
            .find(|s| s.id == id))
    }

    pub(crate) async fn remove_snapshot_image(&self, id: &str) -> Result<()> {
        let Some(snapshot) = self.find_snapshot(id).await? else {
            return Ok(());
        };
        let options = RemoveImageOptionsBuilder::default().force(false).build();
        let tag = format!("{REPOSITORY}:{id}");
        match self.docker.remove_image(&tag, Some(options), None).await {
            Ok(_) => Ok(()),
            Err(e) if error::status(&e) == Some(404) => Ok(()),
            Err(e) if error::status(&e) == Some(409) => {
                let users = self.runs_from(&snapshot.image).await;
                Err(Error::invalid_spec(
                    "snapshot",
                    format!("{id} is in use by runs {users:?}: stop them first"),
                ))
            }
            Err(e) => Err(error::map("remove image", e).with("snapshot", id)),
        }
    }

    async fn runs_from(&self, image: &str) -> Vec<String> {
        let filters =
            std::collections::HashMap::from([("ancestor".to_string(), vec![image.to_string()])]);
        let options = bollard::query_parameters::ListContainersOptionsBuilder::default()
            .all(true)
            .filters(&filters)
            .build();
        self.docker
            .list_containers(Some(options))
            .await
            .unwrap_or_default()
            .into_iter()
            .flat_map(|c| c.names.unwrap_or_default())
            .map(|n| n.trim_start_matches('/').to_string())
            .collect()
    }

    /// Checks that a run's `image` is snapshot `id`'s, before anything is created.
    pub(crate) async fn check_snapshot_image(&self, id: &str, image: &str) -> Result<()> {
        let gone = || {
            Error::new(
                ErrorKind::NotFound,
                format!("snapshot {id} does not exist (or not with image {image})"),
            )
            .with_field("from_snapshot")
        };
        let found = self.find_snapshot(id).await?.ok_or_else(gone)?;
        if found.image != image {
            return Err(gone());
        }
        Ok(())
    }
}

/// Where the workspace is: the target of the mount that is neither the helper's nor the
/// CA files'.
fn workspace_of(inspect: &bollard::models::ContainerInspectResponse) -> Result<String> {
    inspect
        .mounts
        .iter()
        .flatten()
        .filter_map(|m| m.destination.clone())
        .find(|d| d != runcell_core::HELPER_DIR && d != ca::DIR)
        .ok_or_else(|| backend("the container has no workspace mount"))
}

/// A `Write` that hashes what goes through.
struct Hashing<W> {
    inner: W,
    hash: Sha256,
    len: u64,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Copies, byte for byte (with their PAX and GNU long-name records), the entries of `spool`
/// (a tar named from the root) that are `prefix` or below it; adds an opaque whiteout in
/// `prefix` (the workspace is exactly what it was, whatever the image had there), the
/// whiteouts of the library's CA files and the pristine system `bundles`. Returns the
/// layer, rewound, with its digest and size.
fn build_layer(
    mut spool: std::fs::File,
    prefix: &str,
    bundles: &[(String, String)],
) -> Result<((std::fs::File, String), u64)> {
    let wrap = io("building the layer");
    let layer = tempfile::tempfile().map_err(io("a temporary file"))?;
    let mut out = Hashing {
        inner: std::io::BufWriter::new(layer.try_clone().map_err(&wrap)?),
        hash: Sha256::new(),
        len: 0,
    };
    // Pass 1: which entries to keep, as byte ranges of the spool.
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    {
        let mut archive =
            tar::Archive::new(std::io::BufReader::new(spool.try_clone().map_err(&wrap)?));
        let mut pending: Option<u64> = None;
        let mut long_name: Option<Vec<u8>> = None;
        let mut pax_path: Option<Vec<u8>> = None;
        for entry in archive.entries().map_err(&wrap)?.raw(true) {
            let mut entry = entry.map_err(&wrap)?;
            let start = entry.raw_header_position();
            let end = entry.raw_file_position() + entry.size().div_ceil(512) * 512;
            let kind = entry.header().entry_type();
            if kind.is_gnu_longname() || kind.is_pax_local_extensions() {
                pending.get_or_insert(start);
                let mut data = Vec::new();
                entry.read_to_end(&mut data).map_err(&wrap)?;
                if kind.is_gnu_longname() {
                    while data.last() == Some(&0) {
                        data.pop();
                    }
                    long_name = Some(data);
                } else {
                    for record in tar::PaxExtensions::new(&data) {
                        let record = record.map_err(&wrap)?;
                        if record.key_bytes() == b"path" {
                            pax_path = Some(record.value_bytes().to_vec());
                        }
                    }
                }
                continue;
            }
            if kind.is_gnu_longlink() || kind.is_pax_global_extensions() {
                pending.get_or_insert(start);
                continue;
            }
            let name = pax_path
                .take()
                .or(long_name.take())
                .unwrap_or_else(|| entry.header().path_bytes().into_owned());
            let name = String::from_utf8_lossy(&name);
            let name = name.trim_end_matches('/');
            let keep = name == prefix || name.starts_with(&format!("{prefix}/"));
            let from = pending.take().unwrap_or(start);
            if keep {
                ranges.push((from, end));
            }
        }
    }
    // Pass 2: copy the ranges, then our own entries, then the end of the archive.
    let mut first_dir = true;
    for (from, to) in ranges {
        spool.seek(std::io::SeekFrom::Start(from)).map_err(&wrap)?;
        std::io::copy(&mut (&mut spool).take(to - from), &mut out).map_err(&wrap)?;
        if first_dir {
            // Right after the workspace's own directory entry.
            first_dir = false;
            append_file(&mut out, &format!("{prefix}/.wh..wh..opq"), b"", 0o644)?;
        }
    }
    for whiteout in CA_WHITEOUTS {
        append_file(&mut out, whiteout, b"", 0o644)?;
    }
    for (path, text) in bundles {
        append_file(&mut out, path, text.as_bytes(), 0o644)?;
    }
    out.write_all(&[0u8; 1024]).map_err(&wrap)?;
    out.flush().map_err(&wrap)?;
    let digest = format!("sha256:{}", hex::encode(out.hash.finalize_reset()));
    let len = out.len;
    drop(out);
    let mut layer = layer;
    layer.rewind().map_err(&wrap)?;
    Ok(((layer, digest), len))
}

/// Writes one regular file entry (a GNU long-name record first where the path needs
/// it) without ending the archive.
fn append_file(out: &mut impl Write, path: &str, data: &[u8], mode: u32) -> Result<()> {
    let wrap = io("building the layer");
    let header = |name: &[u8], size: u64, kind: tar::EntryType| -> Result<tar::Header> {
        let mut h = tar::Header::new_gnu();
        h.as_old_mut().name[..name.len()].copy_from_slice(name);
        h.set_size(size);
        h.set_mode(mode);
        h.set_mtime(0);
        h.set_uid(0);
        h.set_gid(0);
        h.set_entry_type(kind);
        h.set_cksum();
        Ok(h)
    };
    let write_data = |out: &mut dyn Write, bytes: &[u8]| -> Result<()> {
        out.write_all(bytes).map_err(&wrap)?;
        let pad = (512 - bytes.len() % 512) % 512;
        out.write_all(&vec![0u8; pad]).map_err(&wrap)
    };
    let name = path.as_bytes();
    if name.len() >= 100 {
        let mut long = name.to_vec();
        long.push(0);
        let h = header(
            b"././@LongLink",
            long.len() as u64,
            tar::EntryType::GNULongName,
        )?;
        out.write_all(h.as_bytes()).map_err(&wrap)?;
        write_data(out, &long)?;
        let h = header(&name[..99], data.len() as u64, tar::EntryType::Regular)?;
        out.write_all(h.as_bytes()).map_err(&wrap)?;
    } else {
        let h = header(name, data.len() as u64, tar::EntryType::Regular)?;
        out.write_all(h.as_bytes()).map_err(&wrap)?;
    }
    write_data(out, data)
}

/// A `docker save`-shaped archive (manifest, configuration, the one new layer) whose
/// configuration is the base image's with the snapshot's labels added.
fn save_archive(
    mut layer: std::fs::File,
    base: bollard::models::ImageConfig,
    os: Option<String>,
    architecture: Option<String>,
    diff_ids: Vec<String>,
    labels: &BTreeMap<String, String>,
    tag: &str,
) -> Result<std::fs::File> {
    let wrap = io("building the image archive");
    let mut config = serde_json::to_value(&base)
        .map_err(|e| backend("snapshot: the base image's configuration").with_source(e))?;
    let mut all: BTreeMap<String, String> = base.labels.unwrap_or_default().into_iter().collect();
    all.extend(labels.clone());
    config["Labels"] = serde_json::json!(all);
    let image = serde_json::json!({
        "architecture": architecture.unwrap_or_else(|| "amd64".into()),
        "os": os.unwrap_or_else(|| "linux".into()),
        "config": config,
        "rootfs": { "type": "layers", "diff_ids": diff_ids },
        "history": [],
    });
    let config_bytes = serde_json::to_vec(&image)
        .map_err(|e| backend("snapshot: the image configuration").with_source(e))?;
    let config_name = format!("{}.json", hex::encode(Sha256::digest(&config_bytes)));
    // Every layer but the last is in the engine's store already: named, never read.
    let layers: Vec<String> = (0..diff_ids.len())
        .map(|i| format!("{i}/layer.tar"))
        .collect();
    let manifest = serde_json::to_vec(&serde_json::json!([{
        "Config": config_name,
        "RepoTags": [tag],
        "Layers": layers,
    }]))
    .map_err(|e| backend("snapshot: the manifest").with_source(e))?;
    let file = tempfile::tempfile().map_err(io("a temporary file"))?;
    let mut builder = tar::Builder::new(std::io::BufWriter::new(file.try_clone().map_err(&wrap)?));
    let len = layer.metadata().map_err(&wrap)?.len();
    let mut header = tar::Header::new_gnu();
    header.set_size(len);
    header.set_mode(0o644);
    header.set_mtime(0);
    builder
        .append_data(
            &mut header,
            layers.last().map(String::as_str).unwrap_or("0/layer.tar"),
            &mut layer,
        )
        .map_err(&wrap)?;
    for (name, data) in [
        (config_name.as_str(), &config_bytes),
        ("manifest.json", &manifest),
    ] {
        let mut header = tar::Header::new_gnu();
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        header.set_mtime(0);
        builder
            .append_data(&mut header, name, data.as_slice())
            .map_err(&wrap)?;
    }
    builder
        .into_inner()
        .map_err(&wrap)?
        .flush()
        .map_err(&wrap)?;
    let mut file = file;
    file.rewind().map_err(&wrap)?;
    Ok(file)
}
