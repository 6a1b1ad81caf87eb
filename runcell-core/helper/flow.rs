//! Output credit of a `GET`: what the helper may still send for it, and whether the
//! host still reads it at all (`CREDIT`, `DISCARD`). (An exec's credit is in its record:
//! `record.rs`.)

use std::sync::atomic::AtomicBool;
use std::sync::{Condvar, Mutex};

use crate::link::Link;
use crate::proto::INITIAL_CREDIT;
use crate::{lock, wait};

/// Output credit of a `GET`, and whether the host still reads it.
pub(crate) struct Flow {
    st: Mutex<FlowState>,
    cv: Condvar,
    /// A `GET` is over.
    pub(crate) finished: AtomicBool,
}

/// The mutable part of a [`Flow`].
struct FlowState {
    /// Payload bytes (`STDOUT`, `ENTRY`) the helper may still send.
    credit: u64,
    /// `DISCARD` (or `KILL`): nothing more is sent under this flow.
    discarded: bool,
}

impl Flow {
    /// [`INITIAL_CREDIT`] to start with.
    pub(crate) fn new() -> Flow {
        Flow {
            st: Mutex::new(FlowState {
                credit: u64::from(INITIAL_CREDIT),
                discarded: false,
            }),
            cv: Condvar::new(),
            finished: AtomicBool::new(false),
        }
    }

    /// A `CREDIT` from the host.
    pub(crate) fn grant(&self, n: u32) {
        let mut st = lock(&self.st);
        // Capped as an exec's is (`MAX_CREDIT`).
        st.credit = st
            .credit
            .saturating_add(u64::from(n))
            .min(crate::proto::MAX_CREDIT);
        self.cv.notify_all();
    }

    /// `DISCARD`: wakes whoever waits for credit; nothing is sent under the flow any more.
    pub(crate) fn discard(&self) {
        lock(&self.st).discarded = true;
        self.cv.notify_all();
    }

    /// Blocks until at least `n` bytes of credit are left: the credit, or `None` once the
    /// flow is discarded.
    pub(crate) fn wait_credit(&self, n: u64) -> Option<u64> {
        let mut st = lock(&self.st);
        while !st.discarded && st.credit < n {
            st = wait(&self.cv, st);
        }
        (!st.discarded).then_some(st.credit)
    }

    /// Queues `frame` once `cost` bytes of credit are left and takes them; false (and
    /// nothing queued) once the flow is discarded. Checked and queued under the flow's
    /// lock: after [`Flow::discard`] returns, no frame of the flow is queued any more.
    pub(crate) fn send(&self, link: &Link, frame: Vec<u8>, cost: u64) -> bool {
        let mut st = lock(&self.st);
        while !st.discarded && st.credit < cost {
            st = wait(&self.cv, st);
        }
        if st.discarded {
            return false;
        }
        st.credit -= cost;
        link.send(frame);
        true
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::mpsc::channel;
    use std::thread;
    use std::time::Duration;

    use super::*;
    use crate::proto::{Enc, STDOUT};

    fn frame(id: u32, n: usize) -> Vec<u8> {
        let mut e = Enc::frame(STDOUT, id);
        e.raw(&vec![b'x'; n]);
        e.finish()
    }

    #[test]
    fn credit_starts_at_the_initial_credit_and_grows_with_grants_up_to_the_cap() {
        let f = Flow::new();
        assert_eq!(f.wait_credit(1), Some(u64::from(INITIAL_CREDIT)));
        f.grant(10);
        assert_eq!(f.wait_credit(0), Some(u64::from(INITIAL_CREDIT) + 10));
        f.grant(u32::MAX);
        f.grant(u32::MAX);
        assert_eq!(f.wait_credit(0), Some(crate::proto::MAX_CREDIT));
    }

    #[test]
    fn send_takes_its_cost_and_queues_the_frame() {
        let link = Link::new(None);
        let f = Flow::new();
        assert!(f.send(&link, frame(1, 100), 100));
        assert!(f.send(&link, frame(1, 0), 0));
        assert_eq!(f.wait_credit(0), Some(u64::from(INITIAL_CREDIT) - 100));
        let sent = link.take_frames();
        assert_eq!(sent.len(), 2);
        assert_eq!(sent[0].payload.len(), 100);
    }

    #[test]
    fn send_waits_for_credit_and_a_grant_releases_it() {
        let h = Arc::new(Link::new(None));
        let f = Arc::new(Flow::new());
        let all = u64::from(INITIAL_CREDIT);
        assert!(f.send(&h, frame(1, 0), all));
        assert_eq!(f.wait_credit(0), Some(0));
        let (tx, rx) = channel();
        let sender = f.clone();
        let link = h.clone();
        thread::spawn(move || tx.send(sender.send(&link, frame(1, 5), 5)).unwrap());
        // No credit: nothing is queued.
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err());
        assert_eq!(h.take_frames().len(), 1);
        f.grant(4);
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err());
        f.grant(1);
        assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap());
        assert_eq!(h.take_frames().len(), 1);
        assert_eq!(f.wait_credit(0), Some(0));
    }

    #[test]
    fn discard_wakes_waiters_and_nothing_is_queued_after_it() {
        let h = Link::new(None);
        let f = Arc::new(Flow::new());
        let (tx, rx) = channel();
        let waiter = f.clone();
        let more = u64::from(INITIAL_CREDIT) + 1;
        thread::spawn(move || tx.send(waiter.wait_credit(more)).unwrap());
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err());
        f.discard();
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap(), None);
        assert_eq!(f.wait_credit(0), None);
        assert!(!f.send(&h, frame(1, 1), 1));
        assert!(!f.send(&h, frame(1, 0), 0));
        f.grant(100);
        assert_eq!(f.wait_credit(0), None);
        assert!(h.take_frames().is_empty());
    }
}
