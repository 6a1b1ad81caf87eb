//! Checking a tar stream as it passes.

use super::*;

/// Follows a tar stream block by block as it passes, so that a short or cut transfer is
/// an error naming the entry it cut, never an archive that merely looks smaller. The
/// engines' archive streams (and `tar` through exec) carry no success marker of their
/// own: the tar format's end-of-archive (two zero blocks) after whole entries is the
/// marker, and [`TarCheck::finish`] requires it.
///
/// Checked: every header's checksum; every entry's data (its header's size, or a PAX
/// `size`) and padding fully present; GNU long names, PAX headers and GNU sparse
/// extension blocks followed; no lone zero block before more entries (readers such as
/// the `tar` crate stop at the first zero block, silently dropping what follows); the
/// stream not ending before the two zero blocks. Bytes after the end-of-archive (record
/// padding) are not looked at.
#[derive(Debug, Default)]
pub struct TarCheck {
    /// A header block being assembled.
    block: Vec<u8>,
    state: CheckState,
    /// The current (or last) entry's name, for messages.
    entry: String,
    /// Zero blocks in a row.
    zeros: u8,
    /// A GNU long name or PAX `path` for the next entry.
    next_name: Option<String>,
    /// A PAX `size` for the next entry.
    next_size: Option<u64>,
}

#[derive(Debug, Default)]
enum CheckState {
    #[default]
    Header,
    /// An entry's data: `left` bytes of it, then `pad` bytes of padding.
    Data {
        size: u64,
        left: u64,
        pad: u64,
        /// Kept for a metadata entry (long name, PAX header), up to [`META_LIMIT`].
        meta: Option<(u8, Vec<u8>)>,
    },
    /// GNU sparse extension blocks before the data.
    SparseExt { size: u64 },
    /// After the end-of-archive.
    End,
}

/// The most of a metadata entry (GNU long name, PAX header) kept to read names from.
const META_LIMIT: usize = 1 << 20;

fn check_error(message: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, message)
}

impl TarCheck {
    /// A check at the start of a stream.
    pub fn new() -> TarCheck {
        TarCheck::default()
    }

    /// The name of the entry being read (or the last one), empty before the first.
    pub fn entry(&self) -> &str {
        &self.entry
    }

    /// Whether the end-of-archive was seen.
    pub fn ended(&self) -> bool {
        matches!(self.state, CheckState::End)
    }

    fn after(&self) -> String {
        if self.entry.is_empty() {
            "before its first entry".to_string()
        } else {
            format!("after {}", self.entry)
        }
    }

    /// Follows the next bytes of the stream.
    pub fn feed(&mut self, mut data: &[u8]) -> std::io::Result<()> {
        while !data.is_empty() {
            match &mut self.state {
                CheckState::End => return Ok(()),
                CheckState::Data {
                    left, pad, meta, ..
                } => {
                    let n = (data.len() as u64).min(left.saturating_add(*pad)) as usize;
                    let body = (n as u64).min(*left) as usize;
                    if let Some((_, buf)) = meta.as_mut() {
                        let keep = body.min(META_LIMIT.saturating_sub(buf.len()));
                        buf.extend_from_slice(&data[..keep]);
                    }
                    *left -= body as u64;
                    *pad -= (n - body) as u64;
                    data = &data[n..];
                    if *left == 0 && *pad == 0 {
                        let state = std::mem::take(&mut self.state);
                        if let CheckState::Data {
                            meta: Some((kind, buf)),
                            ..
                        } = state
                        {
                            self.metadata(kind, &buf);
                        }
                    }
                }
                CheckState::Header | CheckState::SparseExt { .. } => {
                    let n = (BLOCK - self.block.len()).min(data.len());
                    self.block.extend_from_slice(&data[..n]);
                    data = &data[n..];
                    if self.block.len() == BLOCK {
                        let block = std::mem::take(&mut self.block);
                        self.block_done(&block)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// A whole header (or sparse extension) block.
    fn block_done(&mut self, block: &[u8]) -> std::io::Result<()> {
        if let CheckState::SparseExt { size } = self.state {
            // `isextended` of a GNU sparse extension block.
            if block[504] == 0 {
                self.state = data_state(size, None);
            }
            return Ok(());
        }
        if block.iter().all(|b| *b == 0) {
            self.zeros += 1;
            if self.zeros == 2 {
                self.state = CheckState::End;
            }
            return Ok(());
        }
        if self.zeros > 0 {
            return Err(check_error(format!(
                "a lone zero block in the archive {}: what follows would be dropped",
                self.after()
            )));
        }
        let header = tar::Header::from_byte_slice(block);
        let sum: u32 = block
            .iter()
            .enumerate()
            .map(|(i, b)| {
                if (148..156).contains(&i) {
                    32
                } else {
                    u32::from(*b)
                }
            })
            .sum();
        if header.cksum().ok() != Some(sum) {
            return Err(check_error(format!(
                "not a tar header (bad checksum) {}",
                self.after()
            )));
        }
        let kind = header.entry_type();
        let meta = matches!(
            kind,
            tar::EntryType::GNULongName
                | tar::EntryType::GNULongLink
                | tar::EntryType::XHeader
                | tar::EntryType::XGlobalHeader
        );
        // A PAX size is the next real entry's, never an extension header's (as the tar
        // crate reads it).
        let pending = if meta { None } else { self.next_size.take() };
        let size = match pending {
            Some(s) => s,
            None => header
                .entry_size()
                .map_err(|e| check_error(format!("a bad entry size {}: {e}", self.after())))?,
        };
        // No file is larger: a size past it (a base-256 field, a PAX record) is a lie.
        if size > i64::MAX as u64 {
            return Err(check_error(format!(
                "a bad entry size {size} {}",
                self.after()
            )));
        }
        if meta {
            self.state = data_state(size, Some((kind.as_byte(), Vec::new())));
            return Ok(());
        }
        self.entry = match self.next_name.take() {
            Some(name) => name,
            None => String::from_utf8_lossy(&header.path_bytes()).into_owned(),
        };
        // GNU sparse: `isextended` at 482 of the old GNU header.
        self.state = if kind == tar::EntryType::GNUSparse && block[482] != 0 {
            CheckState::SparseExt { size }
        } else {
            data_state(size, None)
        };
        Ok(())
    }

    /// A long name or a PAX header, for the next entry.
    fn metadata(&mut self, kind: u8, buf: &[u8]) {
        match kind {
            b'L' => {
                let name = buf.split(|b| *b == 0).next().unwrap_or_default();
                self.next_name = Some(String::from_utf8_lossy(name).into_owned());
            }
            b'x' => {
                // Records: "<len> <key>=<value>\n".
                let mut rest = buf;
                while let Some(sp) = rest.iter().position(|b| *b == b' ') {
                    let Some(len) = std::str::from_utf8(&rest[..sp])
                        .ok()
                        .and_then(|l| l.parse::<usize>().ok())
                        .filter(|l| *l > sp && *l <= rest.len())
                    else {
                        break;
                    };
                    let record = &rest[sp + 1..len];
                    let record = record.strip_suffix(b"\n").unwrap_or(record);
                    if let Some(eq) = record.iter().position(|b| *b == b'=') {
                        let (key, value) = (&record[..eq], &record[eq + 1..]);
                        match key {
                            b"path" => {
                                self.next_name = Some(String::from_utf8_lossy(value).into_owned())
                            }
                            b"size" => {
                                self.next_size =
                                    std::str::from_utf8(value).ok().and_then(|v| v.parse().ok())
                            }
                            _ => {}
                        }
                    }
                    rest = &rest[len..];
                }
            }
            _ => {}
        }
    }

    /// The stream ended: `Ok` only after the end-of-archive.
    pub fn finish(&self) -> std::io::Result<()> {
        match &self.state {
            CheckState::End => Ok(()),
            CheckState::Data { size, left, .. } if *left > 0 => Err(check_error(format!(
                "the archive was cut inside {}: {} of its {size} bytes arrived",
                self.entry,
                size - left
            ))),
            _ => Err(check_error(format!(
                "the archive was cut {}: its end-of-archive marker never came",
                self.after()
            ))),
        }
    }
}

fn data_state(size: u64, meta: Option<(u8, Vec<u8>)>) -> CheckState {
    if size == 0 {
        // Nothing follows the header; a metadata entry without data names nothing.
        return CheckState::Header;
    }
    CheckState::Data {
        size,
        left: size,
        pad: (BLOCK as u64 - size % BLOCK as u64) % BLOCK as u64,
        meta,
    }
}

/// A stream error with the entry it came in, keeping the error itself as its source (a
/// typed error inside it stays reachable).
#[derive(Debug)]
struct While {
    message: String,
    source: std::io::Error,
}

impl std::fmt::Display for While {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for While {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

/// `tar` passed through a [`TarCheck`]: the same bytes, but a stream that ends before its
/// end-of-archive, inside an entry, or with a malformed header fails with an error naming
/// the entry, instead of ending. An error of `tar` itself is passed on with the entry it
/// interrupted.
pub fn checked_tar_stream(tar: ByteStream) -> ByteStream {
    stream::unfold(Some((tar, TarCheck::new())), |state| async move {
        let (mut tar, mut check) = state?;
        match tar.next().await {
            Some(Ok(chunk)) => match check.feed(&chunk) {
                Ok(()) => Some((Ok(chunk), Some((tar, check)))),
                Err(e) => Some((Err(e), None)),
            },
            Some(Err(e)) => {
                let e = if check.entry().is_empty()
                    || check.ended()
                    || e.to_string().contains(check.entry())
                {
                    e
                } else {
                    let message = format!("{e} (while reading {})", check.entry());
                    std::io::Error::new(e.kind(), While { message, source: e })
                };
                Some((Err(e), None))
            }
            None => check.finish().err().map(|e| (Err(e), None)),
        }
    })
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::files::tests::{archive, check_all};

    #[test]
    fn the_check_passes_whole_archives_in_any_chunking() {
        let long = format!("dir/{}", "n".repeat(300));
        let whole = archive(&[("dir/a", 0), ("dir/b", 1), (&long, 70_000), ("dir/c", 512)]);
        for step in [1, 7, 511, 512, 513, 65536, whole.len()] {
            check_all(&whole, step).unwrap_or_else(|e| panic!("step {step}: {e}"));
        }
        // Record padding after the end is fine.
        let mut padded = whole.clone();
        padded.extend_from_slice(&[0u8; 8192]);
        check_all(&padded, 4096).unwrap();
        // One regular file framed by `file_tar_stream`'s way (GNU long name included).
        let mut check = TarCheck::new();
        check.feed(&archive(&[(&long, 3)])).unwrap();
        assert!(check.ended());
        assert_eq!(check.entry(), long);
    }

    #[test]
    fn the_check_names_the_entry_a_cut_archive_ends_in() {
        let whole = archive(&[("dir/a", 100), ("dir/big", 5000), ("dir/c", 10)]);
        // Cut inside dir/big's data: named, with how much arrived.
        let cut = 512 + 512 + 512 + 1000;
        let e = check_all(&whole[..cut], 333).unwrap_err();
        assert!(e.to_string().contains("dir/big"), "{e}");
        assert!(e.to_string().contains("1000 of its 5000 bytes"), "{e}");
        // Cut at an entry boundary (what a reader that stops at EOF takes for the end).
        let boundary = 512 + 512;
        let e = check_all(&whole[..boundary], 512).unwrap_err();
        assert!(e.to_string().contains("after dir/a"), "{e}");
        // Cut after one of the two end blocks, inside a header, and before anything.
        for n in [whole.len() - 512 - (whole.len() % 512), 512 + 512 + 100, 0] {
            assert!(check_all(&whole[..n], 512).is_err(), "cut at {n}");
        }
        // What a builder dropped on error writes: the end right after a cut entry.
        let mut dropped = whole[..512 + 512 + 512 + 1000].to_vec();
        dropped.extend_from_slice(&[0u8; 1024]);
        let e = check_all(&dropped, 512).unwrap_err();
        assert!(e.to_string().contains("dir/big"), "{e}");
    }

    #[test]
    fn a_lying_entry_size_is_refused_not_looped_on() {
        // A base-256 size of u64::MAX: once `left + pad` wrapped to 0 and the check spun.
        let mut header = tar::Header::new_gnu();
        header.set_path("big").unwrap();
        header.set_mode(0o644);
        header.set_size(0);
        let block = header.as_mut_bytes();
        block[124] = 0x80;
        block[125..136].fill(0xff);
        header.set_cksum();
        let mut data = header.as_bytes().to_vec();
        data.extend_from_slice(&[7u8; 4096]);
        let started = std::time::Instant::now();
        let e = check_all(&data, 512).unwrap_err();
        assert!(e.to_string().contains("bad entry size"), "{e}");
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
    }

    #[test]
    fn the_check_refuses_a_lone_zero_block_and_a_bad_header() {
        let a = archive(&[("a", 10)]);
        let b = archive(&[("b", 10)]);
        // "a", one zero block, then "b": a reader stopping at the zero block drops "b".
        let mut lone = a[..1024].to_vec();
        lone.extend_from_slice(&[0u8; 512]);
        lone.extend_from_slice(&b);
        let e = check_all(&lone, 512).unwrap_err();
        assert!(
            e.to_string()
                .contains("lone zero block in the archive after a"),
            "{e}"
        );
        let mut bad = a.clone();
        bad[0] ^= 1;
        let e = check_all(&bad, 512).unwrap_err();
        assert!(e.to_string().contains("checksum"), "{e}");
    }

    #[test]
    fn the_check_follows_pax_sizes_and_names() {
        // A PAX header naming the entry and giving its size (as Go's writer does).
        let mut builder = tar::Builder::new(Vec::new());
        builder
            .append_pax_extensions([("path", &b"pax/name"[..]), ("size", &b"600"[..])])
            .unwrap();
        let mut header = tar::Header::new_ustar();
        header.set_size(600);
        header.set_mode(0o644);
        header.set_entry_type(tar::EntryType::Regular);
        builder
            .append_data(&mut header, "short", &[1u8; 600][..])
            .unwrap();
        let whole = builder.into_inner().unwrap();
        check_all(&whole, 100).unwrap();
        let e = check_all(&whole[..whole.len() - 1024 - 512], 100).unwrap_err();
        assert!(e.to_string().contains("pax/name"), "{e}");
    }

    #[tokio::test]
    async fn checked_streams_fail_where_the_transfer_was_cut() {
        let whole = archive(&[("d/a", 10), ("d/b", 70_000)]);
        let ok = checked_tar_stream(byte_stream(whole.clone()));
        assert_eq!(collect_bytes(ok, u64::MAX).await.unwrap(), whole);
        let cut = checked_tar_stream(byte_stream(whole[..3000].to_vec()));
        let e = collect_bytes(cut, u64::MAX).await.unwrap_err();
        assert!(e.to_string().contains("d/b"), "{e}");
        // An error of the source names the entry it interrupted.
        let broken = stream::iter(vec![
            Ok(Bytes::from(whole[..3000].to_vec())),
            Err(std::io::Error::other("connection reset")),
        ])
        .boxed();
        let e = collect_bytes(checked_tar_stream(broken), u64::MAX)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("connection reset"), "{e}");
        assert!(e.to_string().contains("d/b"), "{e}");
    }
}
