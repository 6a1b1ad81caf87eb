//! Transfers that fail partway: every archive in or out ends with a success marker the
//! receiver checks (the helper's `DONE`; on the plain path, the tar end-of-archive after
//! whole entries, and for tar through exec its exit status), so a short or cut transfer
//! is an error naming the entry, never a smaller archive or a shorter file.

use anyhow::{bail, ensure};
use bytes::Bytes;
use futures::StreamExt;
use runcell_core::files::{ByteStream, TarCheck, byte_stream, tar_of_files};
use runcell_core::{DriverExt, ErrorKind, ExecPath, RunExt};

use crate::{Context, sh_stdout};

/// Reads an archive stream to its end, as a careful receiver does: `Ok` with the bytes,
/// or the error with the bytes that came before it.
async fn read_archive(mut tar: ByteStream) -> Result<Vec<u8>, (Vec<u8>, std::io::Error)> {
    let mut got = Vec::new();
    while let Some(chunk) = tar.next().await {
        match chunk {
            Ok(c) => got.extend_from_slice(&c),
            Err(e) => return Err((got, e)),
        }
    }
    Ok(got)
}

/// Whether `bytes` hold a whole archive, end-of-archive included.
fn is_whole(bytes: &[u8]) -> bool {
    let mut check = TarCheck::new();
    check.feed(bytes).is_ok() && check.finish().is_ok()
}

/// A directory whose middle file its reader may not read: `get_archive` of it is an error
/// naming that file, and, through the helper, no end-of-archive comes before the error
/// (a receiver that stops at the end would take a shorter directory for the whole). On
/// the plain path an engine that reads archives itself, as root (Docker's and Podman's
/// archive API), can read the file: then the archive must be whole, every file in it.
pub async fn a_directory_get_with_an_unreadable_file_names_it(cx: &Context) -> anyhow::Result<()> {
    // Not root: a file of mode 000 is unreadable to its owner.
    let run = cx.driver.start(&cx.spec().user("1000:1000")).await?;
    sh_stdout(
        &*run,
        "mkdir -p /tmp/d && cd /tmp/d && echo first > a.txt && echo hidden > \
         unreadable.txt && echo last > z.txt && chmod 000 unreadable.txt && id -u",
    )
    .await?;
    match read_archive(run.get_archive("/tmp/d").await?).await {
        Err((before, e)) => {
            ensure!(
                e.to_string().contains("unreadable.txt"),
                "the error does not name the unreadable file: {e}"
            );
            if run.exec_path() == ExecPath::Helper {
                ensure!(
                    !is_whole(&before),
                    "a whole archive ({} bytes) came before the error {e}",
                    before.len()
                );
            }
        }
        Ok(bytes) => {
            ensure!(
                run.exec_path() == ExecPath::Plain,
                "the helper, not root, read a file of mode 000 ({} bytes)",
                bytes.len()
            );
            ensure!(is_whole(&bytes), "the archive is not whole");
            for want in ["first\n", "hidden\n", "last\n"] {
                ensure!(
                    bytes.windows(want.len()).any(|w| w == want.as_bytes()),
                    "the archive read as a success lacks {want:?}"
                );
            }
        }
    }
    // A single file the same: an error naming it (or, read by the engine, its bytes).
    match run.get_file("/tmp/d/unreadable.txt").await {
        Err(e) => ensure!(
            e.kind() != ErrorKind::NotFound && e.to_string().contains("unreadable.txt"),
            "the error does not name the file, or calls it missing: {e}"
        ),
        Ok(data) => ensure!(
            run.exec_path() == ExecPath::Plain && data == b"hidden\n",
            "read {data:?} from a file of mode 000"
        ),
    }
    run.stop().await?;
    Ok(())
}

/// A file cut while it is being read (truncated mid-transfer) fails the transfer with an
/// error naming it: never zeros in its place, never a shorter file. Where the workspace
/// is a host directory the file is cut from the host (Docker's archive API holds the
/// container's lock while its stream is open, so no exec runs meanwhile); else by an
/// exec in the run.
pub async fn a_file_cut_while_it_is_read_fails_the_transfer(cx: &Context) -> anyhow::Result<()> {
    const SIZE: u64 = 256 << 20;
    let host = tempfile::tempdir()?;
    let mut spec = cx.spec();
    let from_host = cx.caps.workspace_mount;
    if from_host {
        spec = spec.workspace_dir(host.path());
    }
    let run = cx.driver.start(&spec).await?;
    let resize = |size: u64| {
        let run = &run;
        let host = host.path().join("t/big");
        async move {
            if from_host {
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(&host)?
                    .set_len(size)?;
            } else {
                sh_stdout(&**run, &format!("truncate -s {size} /workspace/t/big")).await?;
            }
            anyhow::Ok(())
        }
    };
    // Sparse: quick to make and to read.
    sh_stdout(
        &*run,
        "mkdir -p /workspace/t && echo a > /workspace/t/a && touch /workspace/t/big && \
         echo z > /workspace/t/z",
    )
    .await?;
    for single in [false, true] {
        resize(SIZE).await?;
        let mut tar = if single {
            // The one-file reader, which counts the bytes itself.
            let reader = run.get_file_stream("/workspace/t/big").await?;
            ensure!(reader.size() == SIZE, "size {}", reader.size());
            reader_stream(reader)
        } else {
            run.get_archive("/workspace/t").await?
        };
        // Read a little, so that the sender is inside `big` and waits for the reader.
        let mut got = 0usize;
        while got < (1 << 20) {
            match tar.next().await {
                Some(Ok(c)) => got += c.len(),
                other => bail!("the transfer ended after {got} bytes: {other:?}"),
            }
        }
        resize(1000).await?;
        match read_archive(tar).await {
            Ok(rest) => bail!(
                "a transfer of a file cut to 1000 bytes (single: {single}) succeeded with {} bytes",
                got + rest.len()
            ),
            Err((_, e)) => ensure!(
                e.to_string().contains("big"),
                "the error (single: {single}) does not name the file: {e}"
            ),
        }
    }
    run.stop().await?;
    Ok(())
}

/// A file reader as a byte stream.
fn reader_stream(reader: runcell_core::FileReader) -> ByteStream {
    use tokio::io::AsyncReadExt;
    futures::stream::unfold(Some(reader), |state| async move {
        let mut reader = state?;
        let mut buf = vec![0u8; 64 << 10];
        match reader.read(&mut buf).await {
            Ok(0) => None,
            Ok(n) => {
                buf.truncate(n);
                Some((Ok(Bytes::from(buf)), Some(reader)))
            }
            Err(e) => Some((Err(e), None)),
        }
    })
    .boxed()
}

/// An upload whose source is cut (inside an entry, or at an entry boundary without the
/// end-of-archive, or with an error) is an error naming the entry, and through the helper
/// leaves no temporary or partial file in the run.
pub async fn a_cut_upload_is_an_error_and_leaves_no_temporary_file(
    cx: &Context,
) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    sh_stdout(&*run, "mkdir -p /tmp/up").await?;
    let data = vec![0x5a_u8; 300_000];
    let whole = tar_of_files(&[("first.bin", &b"one"[..], 0o644), ("cut.bin", &data, 0o644)])?;
    // Header and data of first.bin: 512 + 512; header of cut.bin: 512.
    let inside = whole[..1536 + 100_000].to_vec();
    let boundary = whole[..1024].to_vec();
    let erroring = futures::stream::iter(vec![
        Ok(Bytes::from(inside.clone())),
        Err(std::io::Error::other("the source broke")),
    ])
    .boxed();
    for (what, tar, names) in [
        ("cut inside an entry", byte_stream(inside), "cut.bin"),
        (
            "cut at an entry boundary",
            byte_stream(boundary),
            "first.bin",
        ),
        ("a source error", erroring, "cut.bin"),
    ] {
        match run.put_archive("/tmp/up", tar).await {
            Ok(()) => bail!("an upload {what} succeeded"),
            Err(e) => ensure!(
                e.to_string().contains(names),
                "an upload {what}: the error does not name {names}: {e}"
            ),
        }
        let left = sh_stdout(&*run, "ls -A /tmp/up").await?;
        ensure!(
            !left.contains(".runcell-tmp"),
            "an upload {what} left a temporary file: {left:?}"
        );
        if run.exec_path() == ExecPath::Helper {
            // Whole entries before the cut are in place; the cut one is not.
            ensure!(
                !left.contains("cut.bin"),
                "an upload {what} left a partial file: {left:?}"
            );
        }
        sh_stdout(&*run, "rm -rf /tmp/up/* /tmp/up/.[!.]*").await?;
    }
    // The whole archive goes in.
    run.put_archive("/tmp/up", byte_stream(whole)).await?;
    ensure!(run.get_file("/tmp/up/cut.bin").await? == data);
    run.stop().await?;
    Ok(())
}

/// A sparse file crosses whole and identical both ways (as its full size: archives carry
/// no holes). Written by the exec helper, it lands with its holes again (whole 4 KiB
/// blocks of zeros are left unwritten); on the plain path the engine's extractor writes
/// the zeros out, so only its content is checked there.
pub async fn a_sparse_file_round_trip_keeps_its_holes(cx: &Context) -> anyhow::Result<()> {
    const SIZE: u64 = 64 << 20;
    let run = cx.driver.start(&cx.spec()).await?;
    sh_stdout(
        &*run,
        &format!(
            "mkdir -p /tmp/s /tmp/back && cd /tmp/s && printf start > sparse && \
             truncate -s {SIZE} sparse && printf end >> sparse"
        ),
    )
    .await?;
    // In memory between the two: Docker's archive API holds the container's lock while
    // a download is open, so an upload cannot start before it ends.
    let tar = read_archive(run.get_archive("/tmp/s").await?)
        .await
        .map_err(|(_, e)| e)?;
    run.put_archive("/tmp/back", byte_stream(tar)).await?;
    let out = sh_stdout(
        &*run,
        "cmp /tmp/s/sparse /tmp/back/s/sparse && stat -c '%s %b %B' /tmp/back/s/sparse",
    )
    .await?;
    let fields: Vec<u64> = out
        .split_whitespace()
        .map(|f| f.parse())
        .collect::<Result<_, _>>()?;
    let [size, blocks, unit] = fields[..] else {
        bail!("stat said {out:?}");
    };
    ensure!(size == SIZE + 3, "size {size}");
    let allocated = blocks * unit;
    if run.exec_path() == ExecPath::Helper {
        ensure!(
            allocated < 1 << 20,
            "{allocated} bytes allocated for a {size}-byte file of two short runs of data"
        );
    }
    run.stop().await?;
    Ok(())
}

/// An archive out of a run keeps what tar keeps, on every path: a file with three names
/// comes as one regular file and two hard links naming it, a fifo as a fifo; put back
/// in, the three names are one file again and the fifo a fifo.
pub async fn archives_keep_hard_links_and_fifos(cx: &Context) -> anyhow::Result<()> {
    let run = cx.driver.start(&cx.spec()).await?;
    sh_stdout(
        &*run,
        "mkdir -p /tmp/hl/sub /tmp/back && cd /tmp/hl && printf ab > a && ln a b && ln a sub/c \
         && mkfifo p",
    )
    .await?;
    let tar = read_archive(run.get_archive("/tmp/hl").await?)
        .await
        .map_err(|(_, e)| e)?;
    let mut archive = tar::Archive::new(&tar[..]);
    let (mut regular, mut links, mut fifos) = (Vec::new(), Vec::new(), Vec::new());
    for entry in archive.entries()? {
        let entry = entry?;
        let path = entry
            .path()?
            .to_string_lossy()
            .trim_end_matches('/')
            .to_string();
        let path = path.trim_start_matches("./").to_string();
        match entry.header().entry_type() {
            tar::EntryType::Regular => regular.push((path, entry.size())),
            tar::EntryType::Link => {
                let to = entry.link_name()?.unwrap_or_default();
                let to = to.to_string_lossy().trim_start_matches("./").to_string();
                links.push((path, to));
            }
            tar::EntryType::Fifo => fifos.push(path),
            _ => {}
        }
    }
    let [(first, 2)] = &regular[..] else {
        bail!("regular files {regular:?} (links {links:?}): not one file of 2 bytes");
    };
    let mut named: Vec<&str> = links.iter().map(|(p, _)| p.as_str()).collect();
    named.push(first);
    named.sort();
    ensure!(
        named == ["hl/a", "hl/b", "hl/sub/c"] && links.iter().all(|(_, to)| to == first),
        "file {first}, hard links {links:?}"
    );
    ensure!(fifos == ["hl/p"], "fifos {fifos:?}");
    run.put_archive("/tmp/back", byte_stream(tar)).await?;
    let seen = sh_stdout(
        &*run,
        "cd /tmp/back/hl && stat -c %i a b sub/c | sort -u | wc -l && echo $(cat sub/c) && test -p p && echo fifo",
    )
    .await?;
    ensure!(seen == "1\nab\nfifo", "put back: {seen}");
    run.stop().await?;
    Ok(())
}
