//! Exec records across connections (protocol version 3): what goes out of a record and
//! to which connection, `ATTACH`, `RELEASE`, `LIST`, `DISCARD` and `CREDIT` of an exec,
//! the end of a connection, and the janitor that kills execs whose grace passed and
//! forgets expired records.
//!
//! Every frame of an exec goes to the connection attached to it ([`ExecState::link`]),
//! queued under the exec's lock, so that after an `ATTACH` took the exec over (and sent
//! the previous connection its `DETACHED`) nothing more of it reaches the previous one.
//! The answers to a request go to the connection that asked: `ATTACHED`/`GONE`,
//! `EXECS`, `KILLED`, and a `STDIN_ACK` to the connection whose data it acknowledges.
//!
//! A record is forgotten ([`Registry::forget`]) once its exec is over and: a `RELEASE`
//! came; or, not detached, its `EXIT` went out; or, not detached and unattached, its
//! deadline passed (the grace after its connection ended). Detached records that
//! exited are also forgotten, oldest first, to make room for a new one at
//! [`MAX_RECORDS`].
//!
//! [`Registry::forget`]: crate::exec::Registry::forget

use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use crate::exec::{Exec, ExecState};
use crate::link::Link;
use crate::proto::{
    ATTACHED, Attached, DETACHED, EXECS, EXIT, EXITED, Enc, ExecInfo, GONE, INFO_ARGS, MAX_PAYLOAD,
    MAX_RECORDS, SIGNALED,
};
use crate::{Helper, diag, lock, wait};

/// `EXIT`'s kind and value for a wait status.
pub(crate) fn exit_of(status: i32) -> (u8, i32) {
    if status & 0x7f == 0 {
        (EXITED, (status >> 8) & 0xff)
    } else {
        (SIGNALED, status & 0x7f)
    }
}

/// Queues on the attached connection what may go out of the record: output within the
/// credit, then `EXIT` once the exec is over and every byte went out (a discarded exec:
/// at once). True when `EXIT` went out now (the caller then [`Helper::settle`]s the
/// exec, with no lock held). A connection whose stream broke is taken as unattached:
/// nothing is taken as sent to it.
pub(crate) fn pump(ex: &Exec, st: &mut ExecState) -> bool {
    let Some(link) = st.link.clone() else {
        return false;
    };
    if link.is_broken() {
        return false;
    }
    if !st.discarded {
        while let Some(frame) = st.out.next_frame(ex.id) {
            link.send(frame);
        }
    }
    match st.exit {
        Some((kind, value)) if !st.exit_sent && (st.discarded || st.out.all_sent()) => {
            let mut e = Enc::frame(EXIT, ex.id);
            e.u8(kind).u32(value as u32);
            link.send(e.finish());
            st.exit_sent = true;
            true
        }
        _ => false,
    }
}

impl Helper {
    /// Output the command wrote on `kind` (the output thread): retained, and sent as
    /// far as the credit goes; a discarded exec's is only counted.
    pub(crate) fn append_output(&self, ex: &Exec, kind: u8, data: &[u8]) {
        let mut st = lock(&ex.st);
        if st.discarded || st.gone {
            st.out.skip(data.len());
            return;
        }
        let attached = st.link.is_some();
        st.out.append(kind, data, attached);
        pump(ex, &mut st);
        st.out.trim(attached);
    }

    /// The exec's output thread ended: `EXIT` is ready (it goes out now if a connection
    /// is attached and has everything before it), then the record is settled.
    pub(crate) fn exec_over(&self, ex: &Exec, status: i32) {
        {
            let mut st = lock(&ex.st);
            st.exit = Some(exit_of(status));
            st.done = true;
            pump(ex, &mut st);
        }
        ex.cv.notify_all();
        self.settle(ex);
    }

    /// Forgets the exec's record if it is over and nothing keeps it any more (see the
    /// module docs).
    pub(crate) fn settle(&self, ex: &Exec) {
        let mut r = lock(&self.reg);
        let mut st = lock(&ex.st);
        if st.gone || !st.done {
            return;
        }
        let expired = st.expired || st.deadline.is_some_and(|d| d <= Instant::now());
        let forget = st.released
            || (!ex.detach && st.exit_sent)
            || (!ex.detach && st.link.is_none() && expired);
        if forget {
            r.forget(ex, &mut st);
        }
    }

    /// `ATTACH` from `link`: `ATTACHED`, then the output from the offset it names under
    /// a fresh credit, then `EXIT` once over; the connection attached before (if another)
    /// gets `DETACHED`. `GONE` when no record of `id` exists.
    pub(crate) fn attach(&self, link: &Arc<Link>, id: u32, from: u64) {
        let Some(ex) = self.exec(id) else {
            link.send_empty(GONE, id);
            return;
        };
        let exit_sent = {
            let mut st = lock(&ex.st);
            if st.gone {
                drop(st);
                link.send_empty(GONE, id);
                return;
            }
            match st.link.replace(link.clone()) {
                // Its output starts over: what is still queued of it here goes.
                Some(prev) if Arc::ptr_eq(&prev, link) => link.purge(id),
                Some(prev) => prev.send_empty(DETACHED, id),
                None => {}
            }
            st.discarded = false;
            st.deadline = None;
            st.expired = false;
            st.exit_sent = false;
            let at = st.out.attach(from);
            let mut e = Enc::frame(ATTACHED, id);
            Attached {
                at,
                end: st.out.end(),
                pid: st.root.unwrap_or(0) as u32,
                stdin_taken: st.stdin_taken,
                stdin_open: st.piped && !st.eof,
                tty: ex.tty.is_some(),
                detach: ex.detach,
            }
            .encode(&mut e);
            link.send(e.finish());
            let sent = pump(&ex, &mut st);
            ex.kick_if_starved(&mut st);
            sent
        };
        if exit_sent {
            self.settle(&ex);
        }
    }

    /// `RELEASE`: the record is forgotten once the exec is over (at once if it is).
    pub(crate) fn release(&self, id: u32) {
        if let Some(ex) = self.exec(id) {
            lock(&ex.st).released = true;
            self.settle(&ex);
        }
    }

    /// `DISCARD` (or the `DISCARD` a `KILL` implies) from `link`, of an exec attached to
    /// it (else nothing: its output does not come here anyway). A detached exec is only
    /// unattached (its output is kept); any other is drained, its output dropped, its
    /// `EXIT` still sent here.
    pub(crate) fn discard_exec(&self, link: &Arc<Link>, id: u32) {
        let Some(ex) = self.exec(id) else {
            return;
        };
        let exit_sent = {
            let mut st = lock(&ex.st);
            if st.gone || !st.attached_to(link) {
                return;
            }
            let sent = if ex.detach {
                st.link = None;
                false
            } else {
                st.discarded = true;
                st.out.clear();
                pump(&ex, &mut st)
            };
            ex.kick_if_starved(&mut st);
            sent
        };
        if exit_sent {
            self.settle(&ex);
        }
    }

    /// `CREDIT` from `link` for an exec: counts only from the connection attached.
    pub(crate) fn grant(&self, link: &Arc<Link>, id: u32, n: u32) {
        let Some(ex) = self.exec(id) else {
            return;
        };
        let exit_sent = {
            let mut st = lock(&ex.st);
            if st.gone || !st.attached_to(link) {
                return;
            }
            st.out.grant(n);
            let sent = pump(&ex, &mut st);
            ex.kick_if_starved(&mut st);
            sent
        };
        if exit_sent {
            self.settle(&ex);
        }
    }

    /// `LIST` from `link` (request id `id`): `EXECS` with every record, in the order
    /// they were made.
    pub(crate) fn list(&self, link: &Link, id: u32) {
        let mut infos: Vec<(u64, ExecInfo)> = {
            let r = lock(&self.reg);
            r.execs
                .values()
                .filter_map(|ex| {
                    let st = lock(&ex.st);
                    (!st.gone).then(|| {
                        (
                            ex.seq,
                            ExecInfo {
                                id: ex.id,
                                pid: st.root.unwrap_or(0) as u32,
                                argv: ex.argv.clone(),
                                detach: ex.detach,
                                attached: st.link.is_some(),
                                exit: st.status.map(exit_of),
                                end: st.out.end(),
                                kept_from: st.out.base(),
                                started_ms: ex.started_ms,
                            },
                        )
                    })
                })
                .collect()
        };
        infos.sort_by_key(|(seq, _)| *seq);
        infos.truncate(MAX_RECORDS);
        let mut infos: Vec<ExecInfo> = infos.into_iter().map(|(_, i)| i).collect();
        link.send(execs_frame(id, &mut infos));
    }

    /// The connection `link` ended: each exec attached to it is unattached (see
    /// [`Helper::unattach`]).
    pub(crate) fn connection_ended(&self, link: &Arc<Link>) {
        let now = Instant::now();
        let mut kill = Vec::new();
        {
            let r = lock(&self.reg);
            for ex in r.execs.values() {
                let mut st = lock(&ex.st);
                if st.attached_to(link) {
                    self.unattach(ex, &mut st, now, &mut kill);
                }
            }
        }
        self.janitor_cv.notify_all();
        if !kill.is_empty() {
            self.kill_at_once(&kill);
        }
    }

    /// `LEAVE` from `link`: the exec attached to it is unattached, as if the connection
    /// had ended for it alone; ignored from any other connection.
    pub(crate) fn leave(&self, link: &Arc<Link>, id: u32) {
        let Some(ex) = self.exec(id) else {
            return;
        };
        let mut kill = Vec::new();
        {
            let mut st = lock(&ex.st);
            if st.gone || !st.attached_to(link) {
                return;
            }
            // What is still queued of it here goes: no more frames of it come here.
            link.purge(id);
            self.unattach(&ex, &mut st, Instant::now(), &mut kill);
        }
        self.janitor_cv.notify_all();
        if !kill.is_empty() {
            self.kill_at_once(&kill);
        }
        self.settle(&ex);
    }

    /// Unattaches `ex` from its connection. A detached one runs on; any other gets its
    /// deadline, the end of its grace (a running one with no grace goes into `kill`, to
    /// be killed at once, as version 2 did; the wait for its shepherds is bounded).
    fn unattach(
        &self,
        ex: &Arc<Exec>,
        st: &mut ExecState,
        now: Instant,
        kill: &mut Vec<Arc<Exec>>,
    ) {
        st.link = None;
        ex.kick_if_starved(st);
        if ex.detach {
            return;
        }
        // One whose start was not announced on its connection (no `STARTED` sent yet)
        // has no grace either: no host heard of it, so none will attach to it. (A daemon
        // stopped while a host gave up on its spawn reads the `SPAWN` and the end of the
        // connection together once it goes on: the command must not run on after the
        // host reported it killed.) Its plan may be on its way to its shepherd, where a
        // kill order now could land inside it: the spawn kills it once the plan is in
        // (`Helper::finish_spawn`), unless a connection attached to it meanwhile.
        if !st.done && !st.started {
            st.expired = true;
        } else if !st.done && ex.grace.is_zero() {
            st.expired = true;
            kill.push(ex.clone());
        } else {
            // An exec over keeps its record as long (so that a host that reconnects
            // still gets its `EXIT`).
            st.deadline = Some(now.checked_add(ex.grace).unwrap_or(now + FAR));
        }
    }

    /// The janitor thread (the daemon's): at each deadline, kills the exec if it still
    /// runs (through its shepherd, gracefully, as `KILL` does; its record is forgotten
    /// once it is over) or forgets its record if it is over. An `ATTACH` clears the
    /// deadline.
    pub(crate) fn janitor(&'static self) {
        let mut r = lock(&self.reg);
        loop {
            let now = Instant::now();
            let mut next: Option<Instant> = None;
            let mut kill = Vec::new();
            let mut over = Vec::new();
            for ex in r.execs.values() {
                let mut st = lock(&ex.st);
                let Some(d) = st.deadline else {
                    continue;
                };
                if st.gone || st.link.is_some() {
                    st.deadline = None;
                } else if d > now {
                    next = Some(next.map_or(d, |n| n.min(d)));
                } else {
                    st.deadline = None;
                    st.expired = true;
                    if st.done {
                        over.push(ex.clone());
                    } else {
                        kill.push(ex.clone());
                    }
                }
            }
            for ex in &over {
                let mut st = lock(&ex.st);
                r.forget(ex, &mut st);
            }
            if !kill.is_empty() {
                drop(r);
                for ex in &kill {
                    diag(format_args!(
                        "exec {}: no connection attached within its grace ({:?}): killed",
                        ex.id, ex.grace
                    ));
                    self.continue_shepherd(ex);
                    ex.order_kill(false);
                }
                r = lock(&self.reg);
                continue;
            }
            r = match next {
                Some(d) => {
                    self.janitor_cv
                        .wait_timeout(r, d.saturating_duration_since(now))
                        .unwrap_or_else(PoisonError::into_inner)
                        .0
                }
                None => wait(&self.janitor_cv, r),
            };
        }
    }
}

/// A deadline beyond any grace (`u32` milliseconds is 49 days).
const FAR: Duration = Duration::from_secs(100 * 24 * 3600);

/// Bytes an [`ExecInfo`] takes on the wire besides its arguments' bytes.
fn info_overhead(info: &ExecInfo) -> usize {
    // id, pid, argv count, 4 per argument, detach, attached, exit, end, kept_from,
    // started_ms.
    4 + 4 + 4 + 4 * info.argv.len() + 1 + 1 + (1 + 5) + 8 + 8 + 8
}

/// The `EXECS` frame. Should the list not fit in a frame (the contract's bounds allow
/// [`MAX_RECORDS`] records of [`INFO_ARGS`] full-length arguments, a little more than
/// [`MAX_PAYLOAD`]), each record's arguments are cut to an equal share of what fits.
fn execs_frame(id: u32, infos: &mut [ExecInfo]) -> Vec<u8> {
    let size: usize = 4 + infos
        .iter()
        .map(|i| info_overhead(i) + i.argv.iter().map(Vec::len).sum::<usize>())
        .sum::<usize>();
    if size > MAX_PAYLOAD && !infos.is_empty() {
        let fixed = 4 + infos.len() * (info_overhead(&ExecInfo::default()) + 4 * INFO_ARGS);
        let share = MAX_PAYLOAD.saturating_sub(fixed) / infos.len();
        for info in infos.iter_mut() {
            let mut left = share;
            info.argv.retain_mut(|a| {
                a.truncate(left);
                left -= a.len();
                !a.is_empty() || left > 0
            });
        }
    }
    let mut e = Enc::frame(EXECS, id);
    e.u32(infos.len() as u32);
    for info in infos.iter() {
        info.encode(&mut e);
    }
    e.finish()
}

#[cfg(test)]
mod tests;
