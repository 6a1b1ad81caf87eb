//! Durable execs, host side: the options a spawn carries for its record in the run's
//! helper daemon, `ATTACH`/`LIST`/`RELEASE`, and the resume of an exec's output through a
//! new connection when its connection broke (protocol version 3, `proto.rs`).
//!
//! An exec's *link* is the session it is reached through now: its kill, resize and
//! output follow it when the output resumes through another session.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::time::Instant;

use super::proto::{self, Attached, Enc};
pub(crate) use super::session::HelperStatus as SharedStatus;
use super::session::{ANSWER_TIMEOUT, Event, Receiver, Session, lost};
use crate::error::{Error, ErrorKind, Result};
use crate::spec::{DEFAULT_GRACE, DEFAULT_OUTPUT_BUFFER, ExecSpec};

/// How long one reconnect may take (a new engine exec, an upload, the greeting) before
/// the next is tried.
const RECONNECT_BOUND: Duration = Duration::from_secs(15);

/// What a `SPAWN` carries besides the command.
#[derive(Debug, Clone, Default)]
pub(crate) struct SpawnOpts {
    pub(crate) tty: Option<(u16, u16)>,
    pub(crate) detach: bool,
    pub(crate) keep: u32,
    pub(crate) grace_ms: u32,
}

impl SpawnOpts {
    /// From a validated spec (its buffer and grace are within the protocol's bounds).
    pub(crate) fn of(spec: &ExecSpec) -> SpawnOpts {
        let keep = spec.output_buffer.unwrap_or(DEFAULT_OUTPUT_BUFFER);
        let grace = spec.grace.unwrap_or(DEFAULT_GRACE);
        SpawnOpts {
            tty: spec.tty.map(|t| (t.rows, t.cols)),
            detach: spec.detach,
            keep: u32::try_from(keep).unwrap_or(proto::MAX_KEEP),
            grace_ms: u32::try_from(grace.as_millis()).unwrap_or(u32::MAX),
        }
    }

    /// How long a broken connection may be reconnected for this exec.
    fn resume_bound(&self) -> Duration {
        if self.detach {
            DEFAULT_GRACE
        } else {
            Duration::from_millis(self.grace_ms.into())
        }
    }
}

/// A new live session of the run (the run's current one, or a new one through a new
/// engine exec): what a resume reconnects with.
pub(crate) type Reconnect = Arc<dyn Fn() -> BoxFuture<'static, Result<Arc<Session>>> + Send + Sync>;

/// The session exec `id` is reached through now.
pub(crate) struct ExecLink {
    pub(crate) id: u32,
    session: Mutex<Arc<Session>>,
    /// What became of this stream's hold on the exec.
    handover: Arc<Handover>,
}

/// What became of a stream's hold on its exec, shared by its parts (its receiver, each
/// one a resume makes, and its control).
#[derive(Default)]
pub(crate) struct Handover {
    /// Another reader attached to the exec (`DETACHED` came): the command is that
    /// reader's now, and this stream's end must not kill it.
    pub(crate) taken_over: AtomicBool,
    /// The stream left the exec ([`crate::ExecStream::leave`]): its end sends `LEAVE`
    /// (the command runs on for its grace), never a kill.
    pub(crate) left: AtomicBool,
}

impl ExecLink {
    pub(crate) fn new(id: u32, session: Arc<Session>, handover: Arc<Handover>) -> Arc<ExecLink> {
        Arc::new(ExecLink {
            id,
            session: Mutex::new(session),
            handover,
        })
    }

    /// True once another reader took the exec over, or this stream left it: its end
    /// must not kill it.
    pub(crate) fn let_go(&self) -> bool {
        self.handover.taken_over.load(Ordering::SeqCst) || self.handover.left.load(Ordering::SeqCst)
    }

    /// This stream leaves the exec (see [`Handover::left`]).
    pub(crate) fn leave(&self) {
        self.handover.left.store(true, Ordering::SeqCst);
    }

    /// The session to reach the exec through.
    pub(crate) fn session(&self) -> Arc<Session> {
        self.session
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn set(&self, session: Arc<Session>) {
        *self
            .session
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = session;
    }
}

/// What an exec's output needs to resume through a new connection.
pub(crate) struct Resume {
    link: Arc<ExecLink>,
    reconnect: Reconnect,
    /// How long reconnecting is tried after a break (the exec's grace: past it the
    /// helper killed it).
    bound: Duration,
    /// Output bytes received so far (the offset to attach from).
    pub(super) offset: u64,
    /// The exec's stdin was piped from this process (it is not resumed: see
    /// [`Resume::resume`]).
    stdin: bool,
}

impl Resume {
    pub(super) fn new(
        link: Arc<ExecLink>,
        reconnect: Reconnect,
        opts: &SpawnOpts,
        stdin: bool,
    ) -> Resume {
        Resume {
            link,
            reconnect,
            bound: opts.resume_bound(),
            offset: 0,
            stdin,
        }
    }

    /// For a reattached exec, read from `offset` on.
    pub(crate) fn reattached(link: Arc<ExecLink>, reconnect: Reconnect, offset: u64) -> Resume {
        Resume {
            link,
            reconnect,
            bound: DEFAULT_GRACE,
            offset,
            stdin: false,
        }
    }

    /// The connection broke (`why`): reconnects (trying again with a growing pause
    /// until the bound) and attaches the exec from the offset reached. Returns the new
    /// receiver and the output bytes the helper no longer had (dropped while nobody
    /// was attached). A piped stdin is not resumed (bytes in flight when the connection
    /// broke may or may not have arrived): the command gets end of input.
    pub(super) async fn resume(
        &mut self,
        why: &str,
    ) -> std::result::Result<(Receiver, u64), String> {
        let until = Instant::now() + self.bound;
        let mut pause = Duration::from_millis(100);
        tracing::info!(
            exec = self.link.id,
            "the exec's connection broke ({why}); resuming it"
        );
        loop {
            let attempt = tokio::time::timeout(RECONNECT_BOUND, (self.reconnect)()).await;
            let attempt = attempt.unwrap_or_else(|_| {
                Err(Error::new(
                    ErrorKind::Timeout,
                    format!("a reconnect took over {RECONNECT_BOUND:?}"),
                ))
            });
            let last = match attempt {
                Ok(session) => match session.attach(self.link.id, self.offset).await {
                    Ok(Some((attached, mut events))) => {
                        events.handover = self.link.handover.clone();
                        if attached.at < self.offset {
                            return Err(format!(
                                "{why}; the helper resumed the exec at offset {} before {}",
                                attached.at, self.offset
                            ));
                        }
                        if self.stdin && attached.stdin_open {
                            let _ = session
                                .send_frame(Enc::frame(proto::STDIN_EOF, self.link.id).finish());
                        }
                        self.stdin = false;
                        self.link.set(session);
                        tracing::info!(exec = self.link.id, at = attached.at, "exec resumed");
                        return Ok((events, attached.at - self.offset));
                    }
                    Ok(None) => {
                        return Err(format!(
                            "{why}; the run's helper no longer has the exec (its grace \
                             passed, or the helper was restarted)"
                        ));
                    }
                    Err(e) => e,
                },
                // The target is gone, or the run has no helper any more: no retry helps.
                Err(e) if matches!(e.kind(), ErrorKind::RunLost | ErrorKind::Unsupported) => {
                    return Err(format!("{why}; {e}"));
                }
                Err(e) => e,
            };
            if Instant::now() + pause >= until {
                return Err(format!(
                    "{why}; could not reconnect within {:?}: {last}",
                    self.bound
                ));
            }
            tracing::debug!(
                exec = self.link.id,
                "reconnecting failed ({last}); trying again"
            );
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(5));
        }
    }
}

impl Session {
    /// Attaches this connection to exec `id` from output offset `from`
    /// ([`crate::FROM_NOW`]: from its end): the helper's answer and the receiver of the
    /// exec's output from [`Attached::at`] on; `None` when the helper has no record of
    /// it. Bounded by [`ANSWER_TIMEOUT`] (a silent helper is retired).
    pub(crate) async fn attach(&self, id: u32, from: u64) -> Result<Option<(Attached, Receiver)>> {
        let (mut events, _) = self.open_id_at(Some(id), false, true)?;
        let mut frame = Enc::frame(proto::ATTACH, id);
        frame.u64(from);
        self.send_frame(frame.finish())?;
        match self.answer(&mut events, "an attach").await? {
            Event::Attached(a) if a.at > a.end => {
                let why = format!(
                    "the helper attached exec {id} at {} past its end {}",
                    a.at, a.end
                );
                self.retire(&why);
                Err(lost(why))
            }
            Event::Attached(a) => Ok(Some((a, events))),
            Event::Gone => Ok(None),
            other => Err(self.unexpected("an attach", &other)),
        }
    }

    /// Every exec record of the run's helper.
    pub(crate) async fn list(&self) -> Result<Vec<proto::ExecInfo>> {
        let (mut events, _) = self.open_id_at(None, false, false)?;
        let id = events.id;
        self.send_frame(Enc::frame(proto::LIST, id).finish())?;
        match self.answer(&mut events, "a list").await? {
            Event::Execs(list) => Ok(list),
            other => Err(self.unexpected("a list", &other)),
        }
    }

    /// The answer to a request (`what`), bounded by [`ANSWER_TIMEOUT`] (a silent helper
    /// is retired); a broken connection is an error.
    async fn answer(&self, events: &mut Receiver, what: &str) -> Result<Event> {
        match tokio::time::timeout(ANSWER_TIMEOUT, events.next()).await {
            Ok(Some(Event::Lost(why))) => Err(lost(why)),
            Ok(Some(event)) => Ok(event),
            Ok(None) => Err(lost("the helper connection closed")),
            Err(_) => {
                let why = format!("the helper did not answer {what} within {ANSWER_TIMEOUT:?}");
                self.retire(&why);
                Err(lost(why))
            }
        }
    }

    /// A request answered with something else: the session is retired.
    fn unexpected(&self, what: &str, event: &Event) -> Error {
        let why = format!("the helper answered {what} with {event:?}");
        self.retire(&why);
        lost(why)
    }

    /// `RELEASE`: the helper forgets exec `id`'s record once it ended.
    pub(crate) fn release(&self, id: u32) -> Result<()> {
        self.send_frame(Enc::frame(proto::RELEASE, id).finish())
    }
}
