//! Snapshots on Docker and Podman ([`runcell_core::Snapshot`]): the engine's commit of the
//! container's filesystem, plus one layer of our own with the workspace (a volume or a
//! bind, which no commit holds) and the CA files the library installed taken back out,
//! loaded as an image whose configuration is the base image's (never the run's env,
//! labels or keep-alive, which a commit would copy in).
//!
//! Consistency: nothing is frozen. Docker 20.10 wedges a container for good when an exec
//! starts while it is paused (the shim waits on the frozen exec and cannot resume: seen
//! here with a concurrent plain-path exec), and a run's other tool calls may exec at any
//! time, so the commit does not pause (`pause=false`) and the workspace is read beside
//! it (by the run's exec helper: [`DockerDriver::helper_workspace`]) while the commands
//! go on. A file replaced whole (written aside, renamed into
//! place) is in the snapshot whole, before or after; a file written in place while the
//! snapshot reads it may be captured half-written; the filesystem and the workspace are
//! read beside each other, not at one instant. The image is loaded from a `docker
//! save`-shaped archive that carries only the new layer: Docker takes the layers it
//! already has by their chain ID (the commit's, kept until the load is done) and never
//! reads them; Podman's loader wants every layer, so there the commit's own image
//! archive goes in front of it.

use std::collections::BTreeMap;
use std::io::{Read, Seek, Write};

use bollard::query_parameters::{
    CommitContainerOptionsBuilder, CreateImageOptionsBuilder, ImportImageOptionsBuilder,
    ListImagesOptionsBuilder, PushImageOptionsBuilder, RemoveImageOptionsBuilder,
    TagImageOptionsBuilder,
};
use futures::StreamExt;
use runcell_core::snapshot_labels::{
    SNAPSHOT_ID, SNAPSHOT_OWNER_HOST, SNAPSHOT_OWNER_PID, SNAPSHOT_OWNER_START, SNAPSHOT_WORKSPACE,
};
use runcell_core::{Error, ErrorKind, Result, Snapshot, ca, labels};
use sha2::{Digest, Sha256};

use crate::DockerDriver;
use crate::body::WORKSPACE_LABEL;
use crate::error;

/// The repository snapshot images are tagged in (`runcell-snapshot:<id>`), so that a
/// prune of dangling images never takes one (`docker image prune -a` does, when no run
/// uses it).
const REPOSITORY: &str = "runcell-snapshot";
/// On a commit made for a snapshot: the snapshot's id.
const COMMIT_LABEL: &str = "sandbox.dev/snapshot-commit";
/// On a listed snapshot (never on an image): a commit its dead taker left, to remove.
pub const PARTIAL_LABEL: &str = "sandbox.dev/snapshot-partial";
/// Labels with the base image and the size (Docker labels take any value).
const BASE_LABEL: &str = "sandbox.dev/snapshot-base";
const SIZE_LABEL: &str = "sandbox.dev/snapshot-size";
/// On a snapshot image whose layer carries the exec helper at its place: which build
/// ([`runcell_core::raw::helper_build`]).
const HELPER_LABEL: &str = "sandbox.dev/snapshot-helper";
/// The timeout of the requests that move the changes.
const SLOW: std::time::Duration = std::time::Duration::from_secs(6 * 3600);
/// The most the workspace's directory may hold (as the archive API sends it: a sparse
/// file counts whole): past it the snapshot is refused, not spooled to the host's disk.
pub const MAX_WORKSPACE_BYTES: u64 = 8 << 30;
/// How long the workspace's archive may send nothing before the snapshot fails.
const STALL: std::time::Duration = std::time::Duration::from_secs(120);
/// How long pulling a snapshot may take in all.
const PULL_DEADLINE: std::time::Duration = std::time::Duration::from_secs(60 * 60);
/// How long reading the workspace's archive may take in all (8 GiB at 5 MB/s).
const WORKSPACE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30 * 60);

/// The largest image archive of a commit spooled on Podman (whose loader takes no layer
/// it holds already, so the whole image goes through the host).
pub const MAX_IMAGE_BYTES: u64 = 64 << 30;

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
    /// The archive of the workspace's top-level directory as the run's exec helper reads
    /// it; `None` on Docker's plain path (the engine's archive is read then).
    ///
    /// The engines' own archives skip what they fail to stat while they walk, and say
    /// nothing (moby's `TarWithOptions` logs and goes on): Podman's archive of a workspace
    /// whose files were renamed while it was read lacked a whole directory 1 try in 3 (the
    /// suite's `a_snapshot_of_files_being_written_has_each_whole`). A snapshot that
    /// silently lost files is worse than none, so a Podman run without the helper has
    /// none; Docker's plain path keeps its engine's archive (README, Snapshots).
    pub(crate) async fn helper_workspace(
        &self,
        id: &str,
        run: &dyn runcell_core::raw::RunFiles,
    ) -> Result<Option<runcell_core::files::ByteStream>> {
        let inspect = self
            .docker
            .inspect_container(id, None)
            .await
            .map_err(|e| error::map("inspect container", e).with("run", id))?;
        let top = top_of(&workspace_of(&inspect)?);
        match run.helper_archive(&format!("/{top}")).await? {
            None if self.podman => Err(Error::unsupported(
                "snapshot",
                "snapshots on Podman need the exec helper (Podman's own archive of a changing workspace can lose files)",
            )),
            read => Ok(read),
        }
    }

    /// `workspace_archive`: the archive of the workspace's top directory as the helper
    /// reads it ([`Self::helper_workspace`]); `None`: the engine's archive is read.
    pub(crate) async fn snapshot_container(
        &self,
        id: &str,
        labels: &BTreeMap<String, String>,
        workspace_archive: Option<runcell_core::files::ByteStream>,
    ) -> Result<Snapshot> {
        let docker = &self.docker;
        let began = std::time::Instant::now();
        // The commit, the workspace's read and the load take as long as the changes are
        // big: not the client's per-request timeout.
        let slow = self.docker.clone().with_timeout(SLOW);
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

        // The commit carries the snapshot's labels, owned by this process whatever the
        // snapshot will be, and a mark of its own: should this process die before the
        // commit is removed, `reap` finds it (see `list_snapshot_images`).
        let mut commit_labels = labels.clone();
        let me = labels::Owner::current();
        commit_labels.insert(SNAPSHOT_OWNER_HOST.into(), me.host);
        commit_labels.insert(SNAPSHOT_OWNER_PID.into(), me.pid.to_string());
        commit_labels.insert(SNAPSHOT_OWNER_START.into(), me.start.to_string());
        commit_labels.insert(SNAPSHOT_WORKSPACE.into(), workspace.clone());
        commit_labels.insert(COMMIT_LABEL.into(), snapshot_id_of(labels)?);
        let changes = label_instruction(&commit_labels)?;
        let options = CommitContainerOptionsBuilder::default()
            .container(id)
            .pause(false)
            .changes(&changes)
            .build();
        // The commit and the workspace's layer side by side (the helper reads the
        // workspace; dockerd's archive, on the plain path, waits for the commit's lock).
        let commit = async {
            let made = slow
                .commit_container(options, bollard::models::ContainerConfig::default())
                .await
                .map_err(|e| error::map("commit container", e).with("run", id));
            tracing::debug!(
                run = id,
                ms = began.elapsed().as_millis() as u64,
                "snapshot: committed"
            );
            made
        };
        let (committed, layer) =
            tokio::join!(commit, self.read_layer(id, &workspace, workspace_archive));
        let committed = committed?.id;
        let commit = ImageGuard {
            docker: docker.clone(),
            image: Some(committed.clone()),
        };
        let (layer, layer_bytes) = layer?;
        tracing::debug!(
            run = id,
            ms = began.elapsed().as_millis() as u64,
            bytes = layer_bytes,
            "snapshot: workspace layer written"
        );

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
        if !runcell_core::raw::helper_binary().is_empty() {
            all_labels.insert(HELPER_LABEL.into(), runcell_core::raw::helper_build());
        }
        let snapshot_id = snapshot_id_of(labels)?;
        let tag = format!("{REPOSITORY}:{snapshot_id}");
        let ((layer_file, digest), layer_len) = (layer, layer_bytes);
        // Docker loads an archive that names the layers it holds without carrying them;
        // Podman's loader wants every layer in it: the commit's own archive gives them.
        let (kept, earlier) = if self.podman {
            let (file, names) = self.layers_of(&committed).await?;
            ensure_same_len(&names, &diff_ids)?;
            (Some(file), names)
        } else {
            let names = (0..diff_ids.len())
                .map(|i| format!("{i}/layer.tar"))
                .collect();
            (None, names)
        };
        diff_ids.push(digest);
        let (head, tail) = save_archive(
            layer_len,
            base.config.clone().unwrap_or_default(),
            base.os.clone(),
            base.architecture.clone(),
            committed_inspect.created.clone(),
            diff_ids,
            earlier,
            &all_labels,
            &tag,
        )?;
        let loaded = ImageGuard {
            docker: docker.clone(),
            image: Some(tag.clone()),
        };
        self.load(kept, (head, layer_file, tail)).await?;
        tracing::debug!(
            run = id,
            ms = began.elapsed().as_millis() as u64,
            "snapshot: loaded"
        );
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

    /// The workspace (and the CA files the library installed taken back out) as one
    /// layer: a temporary file, its digest (`sha256:...`) and its size.
    async fn read_layer(
        &self,
        id: &str,
        workspace: &str,
        archive: Option<runcell_core::files::ByteStream>,
    ) -> Result<((std::fs::File, String), u64)> {
        let top = top_of(workspace);
        // The archive of the workspace's top-level directory, whose entries are named from
        // the root (`workspace/...`); the workspace and its ancestors are kept from it.
        let raw = match archive {
            Some(a) => a,
            None => {
                let slow = self.docker.clone().with_timeout(SLOW);
                crate::files::get_archive(&slow, id, &format!("/{top}")).await?
            }
        };
        let too_big = || {
            Error::unsupported(
                "snapshot",
                format!(
                    "/{top} holds more than {} GiB (sparse files count whole): too big for a snapshot",
                    MAX_WORKSPACE_BYTES >> 30
                ),
            )
        };
        let stream = runcell_core::files::checked_tar_stream(raw);
        // The helper's archive comes from the run, whose code may have replaced the
        // helper: one that answers pings and sends nothing, or a byte now and then, must
        // not hold the snapshot (and its commit) for ever.
        let spooled = spool(
            stream,
            MAX_WORKSPACE_BYTES,
            Some(STALL),
            io("reading the workspace"),
            too_big,
        );
        let mut spool = tokio::time::timeout(WORKSPACE_DEADLINE, spooled)
            .await
            .map_err(|_| {
                Error::new(
                    ErrorKind::Backend,
                    format!(
                        "snapshot: the workspace was not read within {} min",
                        WORKSPACE_DEADLINE.as_secs() / 60
                    ),
                )
            })??;
        let mut extra = self.ca_extra(id).await?;
        extra.extend(helper_entries(self.podman)?);
        let prefix = workspace
            .trim_start_matches('/')
            .trim_end_matches('/')
            .to_string();
        tokio::task::spawn_blocking(move || {
            spool.rewind().map_err(io("spooling the workspace"))?;
            build_layer(spool, &prefix, &extra)
        })
        .await
        .map_err(|e| backend(format!("snapshot: building the layer: {e}")))?
    }

    /// The entries that take back what the library installed for the run's CA, each
    /// after its directories' own entries (as the target has them: a layer's missing
    /// directory would come out 0755 root). Evidence of what the library wrote: the
    /// injected file in `/etc/sandbox` (then its two files go) and the
    /// `update-ca-certificates` source file (written only when the library appended to a
    /// system bundle: then it goes, and the last copy of each injected certificate comes
    /// out of the bundle; an image's own copy of the same certificate stays).
    async fn ca_extra(&self, id: &str) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        let mut dirs_done = std::collections::BTreeSet::new();
        if self.read_file(id, ca::CA_FILE).await.is_some() {
            for file in [ca::CA_FILE, ca::BUNDLE_FILE] {
                self.add_dirs(id, file, &mut dirs_done, &mut out).await?;
                append_whiteout(&mut out, file)?;
            }
        }
        let Some((_, injected)) = self.read_file(id, ca::SYSTEM_EXTRA_DIR_FILE).await else {
            return Ok(out);
        };
        self.add_dirs(id, ca::SYSTEM_EXTRA_DIR_FILE, &mut dirs_done, &mut out)
            .await?;
        append_whiteout(&mut out, ca::SYSTEM_EXTRA_DIR_FILE)?;
        for path in ca::SYSTEM_BUNDLES {
            let Some((mode, text)) = self.read_file(id, path).await else {
                continue;
            };
            let pristine = ca::without_last_copies(&text, &injected);
            if pristine != text {
                self.add_dirs(id, path, &mut dirs_done, &mut out).await?;
                append_file(
                    &mut out,
                    path.trim_start_matches('/'),
                    pristine.as_bytes(),
                    mode,
                )?;
            }
        }
        Ok(out)
    }

    /// The entries of `path`'s directories (from `/` down), each once, as the target has
    /// them: the first header of the archive of each, renamed to its full path.
    async fn add_dirs(
        &self,
        id: &str,
        path: &str,
        done: &mut std::collections::BTreeSet<String>,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        for i in 1..parts.len() {
            let dir = parts[..i].join("/");
            if !done.insert(dir.clone()) {
                continue;
            }
            let stream = crate::files::get_archive(&self.docker, id, &format!("/{dir}")).await?;
            let mut head = Vec::new();
            let mut stream = stream;
            while head.len() < 512 {
                match stream.next().await {
                    Some(Ok(chunk)) => head.extend_from_slice(&chunk),
                    Some(Err(e)) => return Err(io("reading a directory")(e)),
                    None => break,
                }
            }
            drop(stream);
            let mut first = [0u8; 512];
            if head.len() < 512 {
                return Err(backend(format!("snapshot: no entry for /{dir}")));
            }
            first.copy_from_slice(&head[..512]);
            let found = tar::Header::from_byte_slice(&first);
            let mode = found.mode().map_err(io("reading a directory"))?;
            let (uid, gid) = (
                found.uid().map_err(io("reading a directory"))?,
                found.gid().map_err(io("reading a directory"))?,
            );
            let mtime = found.mtime().unwrap_or(0);
            append_entry(
                out,
                &format!("{dir}/"),
                b"",
                mode,
                (uid, gid, mtime),
                tar::EntryType::Directory,
            )?;
        }
        Ok(())
    }

    /// A small regular file's mode and text, `None` if absent or unreadable.
    async fn read_file(&self, id: &str, path: &str) -> Option<(u32, String)> {
        let tar = crate::files::get_archive(&self.docker, id, path)
            .await
            .ok()?;
        let file = runcell_core::files::file_from_tar_stream(tar, path)
            .await
            .ok()?;
        let mode = file.mode();
        let text = String::from_utf8(file.read_all(1 << 20, path).await.ok()?).ok()?;
        Some((mode & 0o7777, text))
    }

    /// The login for registry `host`, as pulls take it ([`crate::credentials::for_image`]).
    async fn registry_login(&self, host: &str) -> Result<Option<bollard::auth::DockerCredentials>> {
        let (explicit, dir) = (self.credentials.clone(), self.docker_config_dir.clone());
        let image = format!("{host}/x");
        tokio::task::spawn_blocking(move || {
            crate::credentials::for_image(&image, &explicit, dir.as_deref())
        })
        .await
        .map_err(|e| backend(format!("the registry login lookup failed: {e}")))?
        .map_err(|e| e.with("registry", host))
    }

    /// [`runcell_core::Driver::push_snapshot`]: the snapshot's image pushed by the engine
    /// as `repository:<id>` (a tag made for the push and removed after it).
    pub(crate) async fn push_snapshot_image(&self, id: &str, repository: &str) -> Result<String> {
        // Checked here too: the name goes into the engine's URL path.
        runcell_core::check_snapshot_id(id)?;
        runcell_core::check_repository(repository)?;
        let host = repository.split('/').next().unwrap_or_default();
        let login = self.registry_login(host).await?;
        let snapshot = self
            .find_snapshot(id)
            .await?
            .filter(|s| !s.labels.contains_key(PARTIAL_LABEL))
            .ok_or_else(|| {
                Error::new(ErrorKind::NotFound, format!("snapshot {id} does not exist"))
                    .with_field("snapshot")
            })?;
        let target = format!("{repository}:{id}");
        let options = TagImageOptionsBuilder::default()
            .repo(repository)
            .tag(id)
            .build();
        self.docker
            .tag_image(&snapshot.image, Some(options))
            .await
            .map_err(|e| error::map("tag image", e).with("snapshot", id))?;
        // The push's own name goes whatever happens (the snapshot's tag keeps the image).
        let pushed_name = ImageGuard {
            docker: self.docker.clone(),
            image: Some(target.clone()),
        };
        let slow = self.docker.clone().with_timeout(SLOW);
        let options = PushImageOptionsBuilder::default().tag(id).build();
        let pushed = async {
            let mut pushing = slow.push_image(repository, Some(options), login);
            while let Some(step) = pushing.next().await {
                step.map_err(|e| registry_error("push", &target, e))?;
            }
            Ok(())
        }
        .await;
        // Removed before the answer, success or not (a dropped future leaves it to the
        // guard's drop).
        pushed_name.remove_now().await;
        pushed.map(|()| target)
    }

    /// [`runcell_core::Driver::pull_snapshot`]: the image pulled by the engine, checked to
    /// be snapshot `<id>` of this library, and tagged as the snapshot (the pulled name
    /// removed). A snapshot already here with that id is answered as it is.
    pub(crate) async fn pull_snapshot_image(&self, reference: &str) -> Result<Snapshot> {
        let (repository, id) = runcell_core::split_snapshot_reference(reference)?;
        if let Some(found) = self.find_snapshot(id).await?
            && !found.labels.contains_key(PARTIAL_LABEL)
        {
            return Ok(found);
        }
        let host = repository.split('/').next().unwrap_or_default();
        let login = self.registry_login(host).await?;
        let slow = self.docker.clone().with_timeout(SLOW);
        let options = CreateImageOptionsBuilder::default()
            .from_image(repository)
            .tag(id)
            .build();
        // The pulled name goes whatever happens: a failed check removes the image with it.
        let pulled = ImageGuard {
            docker: self.docker.clone(),
            image: Some(reference.to_string()),
        };
        let checked = async {
            // Bounded: a registry that sends nothing for `STALL`, or takes longer than
            // `PULL_DEADLINE` in all, fails the pull.
            let pull = async {
                let mut pulling = slow.create_image(Some(options), None, login);
                loop {
                    match tokio::time::timeout(STALL, pulling.next()).await {
                        Err(_) => {
                            return Err(Error::new(
                                ErrorKind::Unavailable,
                                format!(
                                    "snapshot pull of {reference}: nothing came for {} s",
                                    STALL.as_secs()
                                ),
                            )
                            .with("reference", reference));
                        }
                        Ok(None) => return Ok(()),
                        Ok(Some(step)) => {
                            step.map_err(|e| registry_error("pull", reference, e))?;
                        }
                    }
                }
            };
            tokio::time::timeout(PULL_DEADLINE, pull)
                .await
                .map_err(|_| {
                    Error::new(
                        ErrorKind::Timeout,
                        format!(
                            "snapshot pull of {reference}: not done within {} min",
                            PULL_DEADLINE.as_secs() / 60
                        ),
                    )
                    .with("reference", reference)
                })??;
            self.check_pulled(reference, id).await
        }
        .await;
        // The pulled name goes before the answer, success or not (with the image when
        // it was no snapshot: then nothing else names it).
        pulled.remove_now().await;
        let image_id = checked?;
        match self.find_snapshot(id).await {
            Ok(Some(found)) if found.image == image_id => Ok(found),
            found => {
                // Listed as another image (a pull of the same id beside it), or not at
                // all: the tag goes, never left where nothing lists it.
                remove_image(&self.docker, &format!("{REPOSITORY}:{id}")).await;
                found?;
                Err(backend(format!(
                    "the pulled snapshot {id} is not listed as the image pulled"
                )))
            }
        }
    }

    /// Checks that the image pulled as `reference` is snapshot `id` of this library, as
    /// the listing reads one (every label it needs), and tags it as the snapshot; its
    /// image ID.
    async fn check_pulled(&self, reference: &str, id: &str) -> Result<String> {
        let image = self
            .docker
            .inspect_image(reference)
            .await
            .map_err(|e| error::map("inspect image", e).with("reference", reference))?;
        let labels: BTreeMap<String, String> = image
            .config
            .as_ref()
            .and_then(|c| c.labels.clone())
            .unwrap_or_default()
            .into_iter()
            .collect();
        let image_id = image.id.clone().unwrap_or_default();
        let listed = snapshot_of(
            labels.clone(),
            image_id.clone(),
            &[format!("{REPOSITORY}:{id}")],
        );
        let ours = listed.is_some_and(|s| s.id == id && !s.labels.contains_key(PARTIAL_LABEL));
        if !ours || image_id.is_empty() {
            return Err(Error::invalid_spec(
                "reference",
                format!("{reference} is not snapshot {id} of this library"),
            ));
        }
        let options = TagImageOptionsBuilder::default()
            .repo(REPOSITORY)
            .tag(id)
            .build();
        self.docker
            .tag_image(&image_id, Some(options))
            .await
            .map_err(|e| error::map("tag image", e).with("reference", reference))?;
        Ok(image_id)
    }

    /// Whether `image` is a snapshot image whose layer carries this build's exec helper
    /// (see [`helper_entries`]); any doubt is no.
    pub(crate) async fn image_carries_helper(&self, image: &str) -> bool {
        let build = runcell_core::raw::helper_build();
        match self.docker.inspect_image(image).await {
            Ok(found) => found
                .config
                .and_then(|c| c.labels)
                .and_then(|l| l.get(HELPER_LABEL).cloned())
                .is_some_and(|v| v == build),
            Err(_) => false,
        }
    }

    /// Loads the archive `kept` (entries without an end) + `head` + the layer file +
    /// `tail` as one stream: the layer is never copied again on the host.
    async fn load(
        &self,
        kept: Option<std::fs::File>,
        (head, layer, tail): (Vec<u8>, std::fs::File, Vec<u8>),
    ) -> Result<()> {
        let kept = futures::stream::iter(kept)
            .flat_map(|f| tokio_util::io::ReaderStream::new(tokio::fs::File::from_std(f)));
        let file = tokio_util::io::ReaderStream::new(tokio::fs::File::from_std(layer));
        let body = kept
            .chain(futures::stream::iter([Ok(bytes::Bytes::from(head))]))
            .chain(file)
            .chain(futures::stream::iter([Ok(bytes::Bytes::from(tail))]));
        let options = ImportImageOptionsBuilder::default().quiet(true).build();
        let slow = self.docker.clone().with_timeout(SLOW);
        let mut answers = slow.import_image_stream(options, body, None);
        while let Some(answer) = answers.next().await {
            let info = answer.map_err(|e| error::map("load image", e))?;
            if let Some(e) = info.error_detail.and_then(|d| d.message) {
                return Err(backend(format!("loading the snapshot image: {e}")));
            }
        }
        Ok(())
    }

    /// The layers of image `id` as the engine's own archive of it has them (Podman): a
    /// temporary file with their entries (and no end-of-archive), and their names in
    /// the image's order. The archive is spooled to the host's disk (capped).
    async fn layers_of(&self, id: &str) -> Result<(std::fs::File, Vec<String>)> {
        let slow = self.docker.clone().with_timeout(SLOW);
        let raw = slow.export_image(id);
        let read = |e| error::map("export image", e).with("image", id);
        let too_big = || {
            Error::unsupported(
                "snapshot",
                format!(
                    "the image of the run's changes is over {} GiB: too big for a snapshot",
                    MAX_IMAGE_BYTES >> 30
                ),
            )
        };
        // The engine's own export (trusted; Podman saves the whole image before it sends
        // a byte): no stall bound.
        let mut spool = spool(raw, MAX_IMAGE_BYTES, None, read, too_big).await?;
        tokio::task::spawn_blocking(move || {
            spool.rewind().map_err(io("spooling the image"))?;
            keep_layers(spool)
        })
        .await
        .map_err(|e| backend(format!("snapshot: reading the image's archive: {e}")))?
    }

    /// Every snapshot, and the commits of snapshots whose taker died before it removed
    /// them (untagged, marked [`COMMIT_LABEL`], their owner gone: listed with
    /// [`PARTIAL_LABEL`] so that `reap` removes them; one of a live owner is a snapshot
    /// being taken, and not listed).
    pub(crate) async fn list_snapshot_images(&self) -> Result<Vec<Snapshot>> {
        // One label filter: Podman 4.3 answers none to two (the other is checked here).
        let filters =
            std::collections::HashMap::from([("label".to_string(), vec![SNAPSHOT_ID.to_string()])]);
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
            .filter_map(|i| snapshot_of(i.labels.into_iter().collect(), i.id, &i.repo_tags))
            .collect())
    }

    /// The snapshot `id`, `None` if there is none. (From the list: an inspect by tag was
    /// one call instead of a list, but Podman 4.3 answers it 500 "image not known" while
    /// another image is being removed, which left a snapshot nobody waited for.)
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
        if snapshot.labels.contains_key(PARTIAL_LABEL) {
            // What a dead taker left: its commit, by ID (no run uses it).
            let options = RemoveImageOptionsBuilder::default().force(false).build();
            return match self
                .docker
                .remove_image(&snapshot.image, Some(options), None)
                .await
            {
                Ok(_) => Ok(()),
                Err(e) if error::status(&e) == Some(404) => Ok(()),
                Err(e) => Err(error::map("remove image", e).with("snapshot", id)),
            };
        }
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
        if found.labels.contains_key(PARTIAL_LABEL) {
            return Err(gone());
        }
        if found.image != image {
            return Err(gone());
        }
        Ok(())
    }
}

/// A registry's refusal of a push or pull of `reference`, typed: a login refused or
/// missing is `Config` naming `repository`, a registry not there `Unavailable`.
fn registry_error(what: &'static str, reference: &str, e: bollard::errors::Error) -> Error {
    let text = e.to_string();
    let lower = text.to_ascii_lowercase();
    let kind = if [
        "unauthorized",
        "authentication required",
        "denied: requested access",
        "no basic auth",
    ]
    .iter()
    .any(|w| lower.contains(w))
    {
        ErrorKind::Config
    } else if [
        "connection refused",
        "no such host",
        "i/o timeout",
        "dial tcp",
    ]
    .iter()
    .any(|w| lower.contains(w))
    {
        ErrorKind::Unavailable
    } else if let bollard::errors::Error::DockerResponseServerError { .. } = e {
        return error::map(what, e).with("reference", reference);
    } else {
        ErrorKind::Backend
    };
    let mut err = Error::new(
        kind,
        format!(
            "snapshot {what} of {reference}: {}",
            runcell_core::Shown(&text)
        ),
    )
    .with("reference", reference);
    if kind == ErrorKind::Config {
        err = err.with_field(if what == "push" {
            "repository"
        } else {
            "reference"
        });
    }
    err
}

/// The top-level directory of absolute path `workspace` (`srv` of `/srv/app`).
fn top_of(workspace: &str) -> String {
    workspace
        .trim_start_matches('/')
        .split('/')
        .next()
        .unwrap_or_default()
        .to_string()
}

/// Where the workspace is: the label the driver set at create ([`WORKSPACE_LABEL`]); for
/// a container made before it had one (Docker only), the first mount the library asked
/// for (`body.rs`), in the order the engine keeps (`inspect`'s own list of mounts is in
/// no stable order).
fn workspace_of(inspect: &bollard::models::ContainerInspectResponse) -> Result<String> {
    let labelled = inspect
        .config
        .as_ref()
        .and_then(|c| c.labels.as_ref())
        .and_then(|l| l.get(WORKSPACE_LABEL))
        .filter(|p| p.starts_with('/'));
    if let Some(path) = labelled {
        return Ok(path.clone());
    }
    inspect
        .host_config
        .as_ref()
        .and_then(|h| h.mounts.as_ref())
        .and_then(|m| m.first())
        .and_then(|m| m.target.clone())
        .filter(|t| t != runcell_core::HELPER_DIR && t != ca::DIR)
        .ok_or_else(|| backend("the container has no workspace mount"))
}

/// Copies, byte for byte (with their PAX and GNU long-name records), the entries of `spool`
/// (a tar named from the root) that are `prefix`, below it, or its ancestors (so that the
/// layer does not make those directories anew); adds an opaque whiteout right after the
/// workspace's own entry (the workspace is exactly what it was, whatever the image had
/// there), then `extra`. A workspace file named like a whiteout (`.wh.*`) is refused:
/// a layer cannot carry it. Returns the layer, rewound, with its digest and size.
fn build_layer(
    mut spool: std::fs::File,
    prefix: &str,
    extra: &[u8],
) -> Result<((std::fs::File, String), u64)> {
    let wrap = io("building the layer");
    let layer = tempfile::tempfile().map_err(io("a temporary file"))?;
    let mut out = runcell_core::files::Sha256Writer::new(std::io::BufWriter::new(
        layer.try_clone().map_err(&wrap)?,
    ));
    // Pass 1: which entries to keep, as byte ranges of the spool, and which is the
    // workspace's own.
    let mut ranges: Vec<(u64, u64, bool)> = Vec::new();
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
            let from = pending.take().unwrap_or(start);
            let own = name == prefix;
            let below = name.starts_with(&format!("{prefix}/"));
            let ancestor = prefix.starts_with(&format!("{name}/"));
            if below
                && name
                    .rsplit('/')
                    .next()
                    .is_some_and(|b| b.starts_with(".wh."))
            {
                return Err(Error::unsupported(
                    "snapshot",
                    format!(
                        "/{} is named like a layer whiteout (.wh.*): a snapshot cannot carry it",
                        name.chars().take(200).collect::<String>()
                    ),
                ));
            }
            if own || below || ancestor {
                ranges.push((from, end, own));
            }
        }
    }
    // Pass 2: copy the ranges, then our own entries, then the end of the archive.
    for (from, to, own) in ranges {
        spool.seek(std::io::SeekFrom::Start(from)).map_err(&wrap)?;
        std::io::copy(&mut (&mut spool).take(to - from), &mut out).map_err(&wrap)?;
        if own {
            append_file(&mut out, &format!("{prefix}/.wh..wh..opq"), b"", 0o644)?;
        }
    }
    drop(spool);
    out.write_all(extra).map_err(&wrap)?;
    out.write_all(&[0u8; 1024]).map_err(&wrap)?;
    out.flush().map_err(&wrap)?;
    let (_, digest, len) = out.finish();
    let mut layer = layer;
    layer.rewind().map_err(&wrap)?;
    Ok(((layer, digest), len))
}

/// The exec helper's place as a run from the snapshot finds it: its directory, only
/// what this layer puts there (opaque), and this build's helper. The engine fills the
/// run's helper volume from the image when it makes the container, so core starts the
/// helper without uploading it ([`DockerDriver::image_carries_helper`]). Empty for a
/// build without a helper.
///
/// On Podman the directory is `1777`: Podman gives a new volume the owner and mode of
/// the image's directory at its place, where a fresh run's volume is the run's user's,
/// and a run as another user than root must be able to make its daemon's private
/// directory there (the sticky bit keeps the helper, root's, from being renamed or
/// removed by anyone else). Docker's fresh volume is root's `0755`, as this one.
fn helper_entries(podman: bool) -> Result<Vec<u8>> {
    let binary = runcell_core::raw::helper_binary();
    let mut out = Vec::new();
    if binary.is_empty() {
        return Ok(out);
    }
    let dir = runcell_core::HELPER_DIR.trim_start_matches('/');
    let path = runcell_core::raw::HELPER_PATH.trim_start_matches('/');
    append_entry(
        &mut out,
        &format!("{dir}/"),
        b"",
        if podman { 0o1777 } else { 0o755 },
        (0, 0, 0),
        tar::EntryType::Directory,
    )?;
    append_file(&mut out, &format!("{dir}/.wh..wh..opq"), b"", 0o644)?;
    append_file(&mut out, path, binary, 0o755)?;
    Ok(out)
}

/// Writes the whiteout of the absolute `path` (`dir/.wh.name`).
fn append_whiteout(out: &mut impl Write, path: &str) -> Result<()> {
    let (dir, name) = path.rsplit_once('/').unwrap_or(("", path));
    append_file(
        out,
        &format!("{}/.wh.{name}", dir.trim_start_matches('/')),
        b"",
        0o644,
    )
}

/// Writes one regular file entry owned by root (see [`append_entry`]).
fn append_file(out: &mut impl Write, path: &str, data: &[u8], mode: u32) -> Result<()> {
    append_entry(out, path, data, mode, (0, 0, 0), tar::EntryType::Regular)
}

/// Writes one entry (a GNU long-name record first where the path needs it) without
/// ending the archive.
fn append_entry(
    out: &mut impl Write,
    path: &str,
    data: &[u8],
    mode: u32,
    (uid, gid, mtime): (u64, u64, u64),
    kind: tar::EntryType,
) -> Result<()> {
    let wrap = io("building the layer");
    let header = |name: &[u8], size: u64, kind: tar::EntryType| -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.as_old_mut().name[..name.len()].copy_from_slice(name);
        h.set_size(size);
        h.set_mode(mode);
        h.set_mtime(mtime);
        h.set_uid(uid);
        h.set_gid(gid);
        h.set_entry_type(kind);
        h.set_cksum();
        h
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
        );
        out.write_all(h.as_bytes()).map_err(&wrap)?;
        write_data(out, &long)?;
        let h = header(&name[..99], data.len() as u64, kind);
        out.write_all(h.as_bytes()).map_err(&wrap)?;
    } else {
        let h = header(name, data.len() as u64, kind);
        out.write_all(h.as_bytes()).map_err(&wrap)?;
    }
    write_data(out, data)
}

/// The snapshot an image is, from its labels, ID and tags: ours only if tagged as ours
/// (an image of a run from a snapshot that someone committed carries the labels too), or
/// the commit of a snapshot whose taker died (see `list_snapshot_images`).
fn snapshot_of(
    labels: BTreeMap<String, String>,
    image: String,
    tags: &[String],
) -> Option<Snapshot> {
    if labels.get(labels::MANAGED_BY).map(String::as_str) != Some(labels::MANAGED_BY_VALUE) {
        return None;
    }
    let tag = format!("{REPOSITORY}:{}", labels.get(SNAPSHOT_ID)?);
    // Podman names a loaded image's short name under `localhost/`.
    let ours = |t: &String| t == &tag || t.strip_prefix("localhost/") == Some(&tag);
    let base = labels.get(BASE_LABEL).cloned().unwrap_or_default();
    if !tags.iter().any(ours) {
        if labels.get(COMMIT_LABEL) != labels.get(SNAPSHOT_ID) {
            return None;
        }
        let mut left = labels.clone();
        left.insert(PARTIAL_LABEL.into(), "true".into());
        let snapshot = Snapshot::from_labels(&left, image, base, 0)?;
        let gone = snapshot.owner().and_then(|o| o.is_alive()) == Some(false);
        return gone.then_some(snapshot);
    }
    let size = labels
        .get(SIZE_LABEL)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Snapshot::from_labels(&labels, image, base, size)
}

/// `stream` written to a temporary file (not rewound), at most `cap` bytes (past it,
/// `too_big`); a read error mapped by `read`.
async fn spool<E>(
    stream: impl futures::Stream<Item = std::result::Result<bytes::Bytes, E>>,
    cap: u64,
    stall: Option<std::time::Duration>,
    read: impl Fn(E) -> Error,
    too_big: impl Fn() -> Error,
) -> Result<std::fs::File> {
    let spool = tempfile::tempfile().map_err(io("a temporary file"))?;
    let mut out = tokio::fs::File::from_std(spool.try_clone().map_err(io("a temporary file"))?);
    let mut stream = std::pin::pin!(stream);
    let mut total = 0u64;
    loop {
        let next = match stall {
            Some(stall) => tokio::time::timeout(stall, stream.next())
                .await
                .map_err(|_| {
                    Error::new(
                        ErrorKind::Backend,
                        format!(
                            "snapshot: nothing came for {} s while reading an archive",
                            stall.as_secs()
                        ),
                    )
                })?,
            None => stream.next().await,
        };
        let Some(chunk) = next else { break };
        let chunk = chunk.map_err(&read)?;
        total += chunk.len() as u64;
        if total > cap {
            return Err(too_big());
        }
        tokio::io::AsyncWriteExt::write_all(&mut out, &chunk)
            .await
            .map_err(io("spooling to a temporary file"))?;
    }
    tokio::io::AsyncWriteExt::flush(&mut out)
        .await
        .map_err(io("spooling to a temporary file"))?;
    Ok(spool)
}

/// The snapshot id among its labels.
fn snapshot_id_of(labels: &BTreeMap<String, String>) -> Result<String> {
    labels
        .get(SNAPSHOT_ID)
        .cloned()
        .ok_or_else(|| backend("snapshot labels without an id"))
}

/// A Dockerfile `LABEL` instruction setting `labels` (keys and values quoted as JSON
/// strings, which the instruction's parser reads).
fn label_instruction(labels: &BTreeMap<String, String>) -> Result<String> {
    let mut out = String::from("LABEL");
    for (k, v) in labels {
        let quoted = |t: &str| {
            serde_json::to_string(t).map_err(|e| backend("snapshot: a label").with_source(e))
        };
        out.push(' ');
        out.push_str(&quoted(k)?);
        out.push('=');
        out.push_str(&quoted(v)?);
    }
    Ok(out)
}

/// The layers named in `archive`'s `manifest.json` (an image archive as engines write
/// it), their entries copied to a temporary file without an end-of-archive, and their
/// names in order.
fn keep_layers(mut archive: std::fs::File) -> Result<(std::fs::File, Vec<String>)> {
    let bad = |what: &str| backend(format!("snapshot: the engine's image archive {what}"));
    let mut names: Option<Vec<String>> = None;
    {
        let mut tar = tar::Archive::new(&mut archive);
        for entry in tar.entries().map_err(io("reading the image's archive"))? {
            let mut entry = entry.map_err(io("reading the image's archive"))?;
            if entry.path_bytes().as_ref() == b"manifest.json" {
                if entry.size() > 1 << 20 {
                    return Err(bad("has a manifest over 1 MiB"));
                }
                let mut text = Vec::new();
                entry
                    .read_to_end(&mut text)
                    .map_err(io("reading the image's archive"))?;
                let manifest: serde_json::Value = serde_json::from_slice(&text)
                    .map_err(|e| bad("has a manifest that is not JSON").with_source(e))?;
                let Some([one]) = manifest.as_array().map(Vec::as_slice) else {
                    return Err(bad("holds other than one image"));
                };
                let layers = one["Layers"]
                    .as_array()
                    .ok_or_else(|| bad("has a manifest without layers"))?
                    .iter()
                    .map(|l| l.as_str().map(str::to_string))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| bad("names a layer by other than a string"))?;
                names = Some(layers);
            }
        }
    }
    let names = names.ok_or_else(|| bad("has no manifest"))?;
    archive
        .rewind()
        .map_err(io("reading the image's archive"))?;
    // Entries written as they are (a `tar::Builder` would end the archive).
    let mut out = tempfile::tempfile().map_err(io("a temporary file"))?;
    let mut found = 0;
    let mut tar = tar::Archive::new(&mut archive);
    for entry in tar.entries().map_err(io("reading the image's archive"))? {
        let mut entry = entry.map_err(io("reading the image's archive"))?;
        let path = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        if !names.contains(&path) || entry.header().entry_type() != tar::EntryType::Regular {
            continue;
        }
        // Named in the header itself (no long-name record to carry along).
        if entry.header().path_bytes().as_ref() != path.as_bytes() {
            return Err(bad("names a layer with a long-name record"));
        }
        found += 1;
        out.write_all(entry.header().as_bytes())
            .map_err(io("copying the image's layers"))?;
        let n = std::io::copy(&mut entry, &mut out).map_err(io("copying the image's layers"))?;
        if n != entry.size() {
            return Err(bad("ends inside a layer"));
        }
        out.write_all(&vec![0u8; ((512 - n % 512) % 512) as usize])
            .map_err(io("copying the image's layers"))?;
    }
    if found != names.len() {
        return Err(bad("lacks some of its layers"));
    }
    out.rewind().map_err(io("copying the image's layers"))?;
    Ok((out, names))
}

/// The layers an archive carries are the image's, one for one.
fn ensure_same_len(names: &[String], diff_ids: &[String]) -> Result<()> {
    if names.len() == diff_ids.len() {
        Ok(())
    } else {
        Err(backend(format!(
            "snapshot: the engine's archive of the commit has {} layers, its image {}",
            names.len(),
            diff_ids.len()
        )))
    }
}

/// A `docker save`-shaped archive (the one new layer, the configuration, the manifest),
/// as the bytes before the layer file and those after it; `earlier` names the image's
/// other layers. The configuration is the base image's with the snapshot's labels added.
#[allow(clippy::too_many_arguments)]
fn save_archive(
    layer_len: u64,
    base: bollard::models::ImageConfig,
    os: Option<String>,
    architecture: Option<String>,
    created: Option<String>,
    diff_ids: Vec<String>,
    earlier: Vec<String>,
    labels: &BTreeMap<String, String>,
    tag: &str,
) -> Result<(Vec<u8>, Vec<u8>)> {
    let mut config = serde_json::to_value(&base)
        .map_err(|e| backend("snapshot: the base image's configuration").with_source(e))?;
    // The base's labels but the library's own (a snapshot of a run from a snapshot must
    // not inherit the first one's id, owner or expiry).
    let mut all: BTreeMap<String, String> = base
        .labels
        .unwrap_or_default()
        .into_iter()
        .filter(|(k, _)| !k.starts_with(labels::PREFIX))
        .collect();
    all.extend(labels.clone());
    config["Labels"] = serde_json::json!(all);
    let mut image = serde_json::json!({
        "architecture": architecture.unwrap_or_else(|| "amd64".into()),
        "os": os.unwrap_or_else(|| "linux".into()),
        "config": config,
        "rootfs": { "type": "layers", "diff_ids": diff_ids },
        "history": [],
    });
    if let Some(created) = created {
        image["created"] = serde_json::json!(created);
    }
    let config_bytes = serde_json::to_vec(&image)
        .map_err(|e| backend("snapshot: the image configuration").with_source(e))?;
    let config_name = format!("{}.json", hex::encode(Sha256::digest(&config_bytes)));
    // Every layer but the last is in the engine's store already (Docker: named, never
    // read) or in the archive before `head` (Podman).
    let mut layers = earlier;
    layers.push(format!("{}/layer.tar", layers.len()));
    let manifest = serde_json::to_vec(&serde_json::json!([{
        "Config": config_name,
        "RepoTags": [tag],
        "Layers": layers,
    }]))
    .map_err(|e| backend("snapshot: the manifest").with_source(e))?;
    let last = layers.last().cloned().unwrap_or_default();
    let mut head = Vec::new();
    let mut h = tar::Header::new_gnu();
    h.as_old_mut().name[..last.len()].copy_from_slice(last.as_bytes());
    h.set_size(layer_len);
    h.set_mode(0o644);
    h.set_mtime(0);
    h.set_entry_type(tar::EntryType::Regular);
    h.set_cksum();
    head.extend_from_slice(h.as_bytes());
    let mut tail = vec![0u8; ((512 - layer_len % 512) % 512) as usize];
    append_file(&mut tail, &config_name, &config_bytes, 0o644)?;
    append_file(&mut tail, "manifest.json", &manifest, 0o644)?;
    tail.extend_from_slice(&[0u8; 1024]);
    Ok((head, tail))
}
