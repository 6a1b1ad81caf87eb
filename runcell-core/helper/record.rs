//! An exec's retained output: the bytes of its record (stdout and stderr together, in the
//! order the helper read them, each byte at an *offset* counted from 0), what of them went
//! out to the connection attached to the exec, and that connection's credit.
//!
//! Pure bookkeeping, no locking, no I/O: the exec's state holds one [`Output`] under its
//! lock; the output thread appends what it reads, and whoever changes what may go out
//! (the output thread, a `CREDIT`, an `ATTACH`) takes the frames it yields
//! ([`Output::next_frame`]) and queues them on the attached connection.
//!
//! Bounds: the bytes retained are at most `keep` (plus, while a connection is attached
//! and has not been sent them, what the last read added, which [`Output::room`] keeps
//! within `keep` too); the stream-kind bookkeeping ([`Output::runs`]) is at most one
//! entry per 16 bytes of `keep`: a command that alternates stdout and stderr in single
//! bytes loses its oldest bytes earlier, never the helper its memory.

use std::collections::VecDeque;

use crate::HEADER;
use crate::proto::{CHUNK, INITIAL_CREDIT, MAX_CREDIT, MAX_KEEP, MIN_KEEP};

/// The retained output of one exec and the flow of it to the attached connection.
#[derive(Debug)]
pub(crate) struct Output {
    /// The bytes from `base` to `end`.
    ring: VecDeque<u8>,
    /// Where each run of one stream kind starts: (offset, `STDOUT` or `STDERR`), in
    /// order; the first may start before `base` (its head was dropped). Not empty while
    /// bytes are retained.
    runs: VecDeque<(u64, u8)>,
    /// Offset of the oldest byte retained.
    base: u64,
    /// Offset after the newest byte (bytes produced so far).
    end: u64,
    /// Bytes below this offset went out to the attached connection (`base..=end`).
    sent: u64,
    /// Bytes kept at most (clamped [`MIN_KEEP`]..=[`MAX_KEEP`]).
    keep: usize,
    /// Output bytes the attached connection may still be sent.
    credit: u64,
}

impl Output {
    /// An empty record keeping `keep` bytes (clamped), with [`INITIAL_CREDIT`].
    pub(crate) fn new(keep: u32) -> Output {
        Output {
            ring: VecDeque::new(),
            runs: VecDeque::new(),
            base: 0,
            end: 0,
            sent: 0,
            keep: keep.clamp(MIN_KEEP, MAX_KEEP) as usize,
            credit: u64::from(INITIAL_CREDIT),
        }
    }

    /// Offset of the oldest byte retained.
    pub(crate) fn base(&self) -> u64 {
        self.base
    }

    /// Offset after the newest byte.
    pub(crate) fn end(&self) -> u64 {
        self.end
    }

    /// Every byte produced went out to the attached connection.
    pub(crate) fn all_sent(&self) -> bool {
        self.sent == self.end
    }

    /// Bytes retained.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.ring.len()
    }

    /// Kind runs held (for the bound on them).
    fn runs(&self) -> usize {
        self.runs.len()
    }

    /// The most kind runs held: one per 16 bytes of `keep`.
    fn max_runs(&self) -> usize {
        self.keep / 16 + 16
    }

    /// How many bytes the output thread may read from the command now. Attached: up to
    /// `keep` not sent yet (0: the command is blocked on its pipe until credit or a
    /// detach makes room). Unattached: any (the oldest bytes make room).
    pub(crate) fn room(&self, attached: bool) -> usize {
        if !attached {
            return usize::MAX;
        }
        if self.runs() > self.max_runs() {
            return 0;
        }
        let unsent = usize::try_from(self.end - self.sent).unwrap_or(usize::MAX);
        self.keep.saturating_sub(unsent)
    }

    /// Appends bytes the command wrote on `kind` (`STDOUT` or `STDERR`), then drops the
    /// oldest bytes the rule allows ([`Output::trim`]).
    pub(crate) fn append(&mut self, kind: u8, data: &[u8], attached: bool) {
        if data.is_empty() {
            return;
        }
        if self.runs.back().map(|r| r.1) != Some(kind) {
            self.runs.push_back((self.end, kind));
        }
        let need = self.ring.len() + data.len();
        if need > self.ring.capacity() {
            // Grows by doubling, never past what the record may hold.
            let target = (self.ring.capacity() * 2).min(self.keep + CHUNK).max(need);
            self.ring.reserve_exact(target - self.ring.len());
        }
        self.ring.extend(data);
        self.end += data.len() as u64;
        self.trim(attached);
    }

    /// Counts bytes that were read and dropped (a discarded exec): nothing is retained.
    pub(crate) fn skip(&mut self, n: usize) {
        self.end += n as u64;
        self.clear();
    }

    /// Drops everything retained (`DISCARD`): the record then starts again at `end`.
    pub(crate) fn clear(&mut self) {
        self.ring = VecDeque::new();
        if let Some(last) = self.runs.pop_back() {
            self.runs.clear();
            self.runs.push_back(last);
        }
        self.base = self.end;
        self.sent = self.end;
    }

    /// Drops the oldest bytes beyond `keep` (and beyond the bound on kind runs). While a
    /// connection is attached only bytes that went out to it are dropped; unattached,
    /// the oldest go whatever they are.
    pub(crate) fn trim(&mut self, attached: bool) {
        let mut drop = self.ring.len().saturating_sub(self.keep);
        if self.runs() > self.max_runs() {
            // Up to where the second run starts: one run less.
            let second = self.runs.get(1).map_or(self.end, |r| r.0);
            drop = drop.max(usize::try_from(second - self.base).unwrap_or(usize::MAX));
        }
        if attached {
            drop = drop.min(usize::try_from(self.sent - self.base).unwrap_or(usize::MAX));
        }
        let drop = drop.min(self.ring.len());
        if drop == 0 {
            return;
        }
        self.ring.drain(..drop);
        self.base += drop as u64;
        self.sent = self.sent.max(self.base);
        while self.runs.len() >= 2 && self.runs[1].0 <= self.base {
            self.runs.pop_front();
        }
        if self.ring.is_empty() && self.ring.capacity() > CHUNK {
            self.ring = VecDeque::new();
        }
    }

    /// A connection attaches from offset `from`: output goes out from the returned
    /// offset on (`from`, or the oldest byte retained when `from` is older, or the end
    /// when it is past it), under a fresh [`INITIAL_CREDIT`].
    pub(crate) fn attach(&mut self, from: u64) -> u64 {
        let at = from.clamp(self.base, self.end);
        self.sent = at;
        self.credit = u64::from(INITIAL_CREDIT);
        at
    }

    /// The credit left.
    #[cfg(test)]
    pub(crate) fn credit(&self) -> u64 {
        self.credit
    }

    /// A `CREDIT` from the attached connection.
    pub(crate) fn grant(&mut self, n: u32) {
        // A host never has more than its window outstanding; more is not taken, so that
        // a peer cannot have the whole record queued for a connection it does not read.
        self.credit = self.credit.saturating_add(u64::from(n)).min(MAX_CREDIT);
    }

    /// The next `STDOUT`/`STDERR` frame of exec `id` that may go out: bytes from `sent`,
    /// of one stream kind, at most [`CHUNK`] and the credit left; taken as sent.
    pub(crate) fn next_frame(&mut self, id: u32) -> Option<Vec<u8>> {
        if self.sent >= self.end || self.credit == 0 || self.sent < self.base {
            return None;
        }
        let i = self
            .runs
            .partition_point(|r| r.0 <= self.sent)
            .checked_sub(1)?;
        let kind = self.runs[i].1;
        let run_end = self.runs.get(i + 1).map_or(self.end, |r| r.0);
        let n = (run_end - self.sent).min(CHUNK as u64).min(self.credit) as usize;
        if n == 0 {
            return None;
        }
        let from = usize::try_from(self.sent - self.base).ok()?;
        let mut frame = Vec::with_capacity(HEADER + n);
        frame.extend_from_slice(&((n + 5) as u32).to_le_bytes());
        frame.push(kind);
        frame.extend_from_slice(&id.to_le_bytes());
        let (a, b) = self.ring.as_slices();
        let to = from + n;
        if from < a.len() {
            frame.extend_from_slice(&a[from..to.min(a.len())]);
        }
        if to > a.len() {
            let lo = from.saturating_sub(a.len());
            frame.extend_from_slice(b.get(lo..to - a.len())?);
        }
        self.sent += n as u64;
        self.credit -= n as u64;
        Some(frame)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{STDERR, STDOUT};
    use crate::testing::Frame;

    /// Takes every frame that may go out: (kind, payload) each.
    fn drain(o: &mut Output) -> Vec<(u8, Vec<u8>)> {
        let mut v = Vec::new();
        while let Some(f) = o.next_frame(7) {
            let f = Frame::parse(&f);
            assert_eq!(f.id, 7);
            assert!(!f.payload.is_empty() && f.payload.len() <= CHUNK);
            v.push((f.kind, f.payload));
        }
        v
    }

    fn bytes(frames: &[(u8, Vec<u8>)]) -> Vec<u8> {
        frames.iter().flat_map(|f| f.1.clone()).collect()
    }

    fn counting(n: usize, from: usize) -> Vec<u8> {
        (from..from + n).map(|i| (i % 251) as u8).collect()
    }

    #[test]
    fn keep_is_clamped() {
        assert_eq!(Output::new(0).keep, MIN_KEEP as usize);
        assert_eq!(Output::new(u32::MAX).keep, MAX_KEEP as usize);
        assert_eq!(Output::new(100_000).keep, 100_000);
    }

    #[test]
    fn frames_keep_their_stream_kind_and_order() {
        let mut o = Output::new(0);
        o.append(STDOUT, b"out1 ", true);
        o.append(STDOUT, b"out2 ", true);
        o.append(STDERR, b"err ", true);
        o.append(STDOUT, b"out3", true);
        let frames = drain(&mut o);
        assert_eq!(
            frames,
            [
                (STDOUT, b"out1 out2 ".to_vec()),
                (STDERR, b"err ".to_vec()),
                (STDOUT, b"out3".to_vec())
            ]
        );
        assert!(o.all_sent());
        assert_eq!((o.base(), o.end()), (0, 18));
        // Sent bytes stay retained while they fit in `keep`.
        assert_eq!(o.len(), 18);
        assert!(o.next_frame(7).is_none());
    }

    #[test]
    fn frames_are_at_most_a_chunk_and_within_the_credit() {
        let mut o = Output::new(4 << 20);
        let data = counting(3 * CHUNK + 10, 0);
        o.append(STDOUT, &data, true);
        let frames = drain(&mut o);
        let sizes: Vec<usize> = frames.iter().map(|f| f.1.len()).collect();
        assert_eq!(sizes, [CHUNK, CHUNK, CHUNK, 10]);
        assert_eq!(bytes(&frames), data);

        // Credit runs out: the rest waits for a grant.
        let mut o = Output::new(4 << 20);
        let big = counting(INITIAL_CREDIT as usize + 100, 0);
        for c in big.chunks(CHUNK) {
            o.append(STDOUT, c, true);
        }
        let first = bytes(&drain(&mut o));
        assert_eq!(first.len(), INITIAL_CREDIT as usize);
        o.grant(30);
        let more = drain(&mut o);
        assert_eq!(bytes(&more).len(), 30);
        o.grant(u32::MAX);
        let rest = bytes(&drain(&mut o));
        assert_eq!([first, bytes(&more), rest].concat(), big);
    }

    #[test]
    fn attached_room_is_what_keep_leaves_unsent() {
        let mut o = Output::new(0); // MIN_KEEP
        let keep = MIN_KEEP as usize;
        assert_eq!(o.room(true), keep);
        o.credit = 0;
        o.append(STDOUT, &counting(keep - 10, 0), true);
        assert_eq!(o.room(true), 10);
        o.append(STDOUT, &counting(10, keep - 10), true);
        assert_eq!(o.room(true), 0, "full of unsent bytes: the command blocks");
        // Nothing unsent is dropped while attached.
        o.trim(true);
        assert_eq!((o.base(), o.len()), (0, keep));
        // Unattached, reading goes on.
        assert_eq!(o.room(false), usize::MAX);
        // Credit lets bytes out, which makes room (they are dropped once newer come).
        o.grant(100);
        assert_eq!(bytes(&drain(&mut o)).len(), 100);
        assert_eq!(o.room(true), 100);
        o.append(STDOUT, &counting(100, keep), true);
        assert_eq!((o.base(), o.end(), o.len()), (100, keep as u64 + 100, keep));
    }

    #[test]
    fn unattached_the_oldest_bytes_beyond_keep_are_dropped() {
        let keep = MIN_KEEP as usize;
        let mut o = Output::new(0);
        let total = 5 * keep + 123;
        let data = counting(total, 0);
        for c in data.chunks(4000) {
            o.append(
                if c[0].is_multiple_of(2) {
                    STDOUT
                } else {
                    STDERR
                },
                c,
                false,
            );
            assert!(o.len() <= keep);
        }
        assert_eq!(o.end(), total as u64);
        assert_eq!(o.base(), (total - keep) as u64);
        // Attached from 0: from the oldest byte retained, the exact tail.
        let at = o.attach(0);
        assert_eq!(at, (total - keep) as u64);
        o.grant(u32::MAX);
        let frames = drain(&mut o);
        assert_eq!(bytes(&frames), data[total - keep..]);
        // Each frame is of the kind its bytes were appended as.
        let mut off = total - keep;
        for (kind, payload) in &frames {
            for i in off..off + payload.len() {
                let want = if data[i - i % 4000].is_multiple_of(2) {
                    STDOUT
                } else {
                    STDERR
                };
                assert_eq!(*kind, want, "at offset {i}");
            }
            off += payload.len();
        }
    }

    #[test]
    fn attach_clamps_its_offset_and_restarts_the_credit() {
        let mut o = Output::new(0);
        o.append(STDOUT, &counting(1000, 0), true);
        o.credit = 0;
        assert_eq!(o.attach(400), 400);
        assert_eq!(o.credit, u64::from(INITIAL_CREDIT));
        assert_eq!(bytes(&drain(&mut o)), counting(600, 400));
        assert_eq!(o.attach(u64::MAX), 1000);
        assert!(drain(&mut o).is_empty());
        assert_eq!(o.attach(5000), 1000);
        // Again from the start: everything retained goes out again.
        assert_eq!(o.attach(0), 0);
        assert_eq!(bytes(&drain(&mut o)), counting(1000, 0));
    }

    #[test]
    fn bytes_across_the_rings_wrap_come_out_whole() {
        let keep = MIN_KEEP as usize;
        let mut o = Output::new(0);
        // Fill, drop the head, append again: the ring wraps around.
        o.append(STDOUT, &counting(keep, 0), false);
        o.append(STDOUT, &counting(keep / 2, keep), false);
        o.append(STDERR, &counting(keep / 3, keep + keep / 2), false);
        let end = keep + keep / 2 + keep / 3;
        assert_eq!(o.attach(0), (end - keep) as u64);
        o.grant(u32::MAX);
        let frames = drain(&mut o);
        assert_eq!(bytes(&frames), counting(keep, end - keep));
        assert_eq!(frames.last().unwrap().0, STDERR);
    }

    #[test]
    fn clear_and_skip_drop_everything_and_count_on() {
        let mut o = Output::new(0);
        o.append(STDERR, b"abc", true);
        o.clear();
        assert_eq!((o.base(), o.end(), o.len()), (3, 3, 0));
        assert!(o.all_sent());
        o.skip(10);
        assert_eq!((o.base(), o.end(), o.len()), (13, 13, 0));
        o.append(STDERR, b"de", true);
        o.append(STDOUT, b"f", true);
        assert_eq!(
            drain(&mut o),
            [(STDERR, b"de".to_vec()), (STDOUT, b"f".to_vec())]
        );
    }

    #[test]
    fn alternating_single_bytes_keep_the_bookkeeping_bounded() {
        let mut o = Output::new(0);
        let max_runs = o.max_runs();
        for i in 0..(4 * max_runs) {
            let kind = if i.is_multiple_of(2) { STDOUT } else { STDERR };
            o.append(kind, &[i as u8], false);
            assert!(o.runs() <= max_runs + 1, "{} runs", o.runs());
        }
        // Attached and never sent: no room once the runs are at their bound.
        let mut o = Output::new(0);
        o.credit = 0;
        let mut i = 0usize;
        while o.room(true) > 0 {
            let kind = if i.is_multiple_of(2) { STDOUT } else { STDERR };
            o.append(kind, &[1], true);
            i += 1;
            assert!(i <= 2 * max_runs, "never full");
        }
        assert!(o.runs() <= max_runs + 1);
        assert_eq!(o.base(), 0, "nothing unsent was dropped");
    }

    #[test]
    fn the_ring_never_holds_much_more_than_keep() {
        let keep = MIN_KEEP as usize;
        let mut o = Output::new(0);
        for i in 0..200 {
            o.append(STDOUT, &counting(3000 + i, i), false);
            assert!(
                o.ring.capacity() <= 2 * (keep + CHUNK),
                "{}",
                o.ring.capacity()
            );
        }
        o.clear();
        assert_eq!(o.ring.capacity(), 0);
    }
}
