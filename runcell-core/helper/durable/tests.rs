//! Unit tests of records across connections.

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::thread;

use super::*;
use crate::proto::{DETACHED, Dec, INITIAL_CREDIT, STDOUT};
use crate::shepherd;
use crate::testing::{Frame, TempDir};

/// An exec registered with `h` (its shepherd a pid no process has, already reaped unless
/// `shepherd_lives`), attached to nothing; and the shepherd's end of its channel.
fn exec(h: &Helper, id: u32, detach: bool, grace_ms: u64) -> (Arc<Exec>, UnixStream) {
    let (mut ex, theirs, _reader, _wake) = Exec::for_tests_with(id, false, detach, 0);
    ex.grace = Duration::from_millis(grace_ms);
    let ex = Arc::new(ex);
    ex.started_for_tests();
    lock(&ex.st).root = Some(1000 + id as i32);
    lock(&ex.st).shepherd_status = Some(0);
    h.register_for_tests(&ex, i32::MAX - id as i32);
    (ex, theirs)
}

fn link() -> Arc<Link> {
    Arc::new(Link::new(None))
}

/// (kind, id) of each frame.
fn heads(frames: &[Frame]) -> Vec<(u8, u32)> {
    frames.iter().map(|f| (f.kind, f.id)).collect()
}

/// The output bytes among `frames`.
fn output(frames: &[Frame]) -> usize {
    frames
        .iter()
        .filter(|f| f.kind == STDOUT)
        .map(|f| f.payload.len())
        .sum()
}

/// The kill orders the shepherd's end received so far.
fn orders(theirs: &mut UnixStream) -> Vec<(u8, Vec<u8>)> {
    theirs.set_nonblocking(true).unwrap();
    let mut inbox = Vec::new();
    let mut buf = [0u8; 256];
    while let Ok(n) = theirs.read(&mut buf) {
        if n == 0 {
            break;
        }
        inbox.extend_from_slice(&buf[..n]);
    }
    shepherd::split_frames(&mut inbox)
}

#[test]
fn wait_statuses_make_exit_kinds() {
    assert_eq!(exit_of(0), (EXITED, 0));
    assert_eq!(exit_of(3 << 8), (EXITED, 3));
    assert_eq!(exit_of(9), (SIGNALED, 9));
    assert_eq!(exit_of(15 | 0x80), (SIGNALED, 15));
}

#[test]
fn output_goes_out_within_the_credit_and_exit_once_all_of_it_went() {
    let dir = TempDir::new();
    let h = Helper::for_tests(false, dir.path());
    let (ex, _theirs) = exec(&h, 1, false, 0);
    let l = link();
    ex.attach_for_tests(&l);
    let data = vec![b'x'; INITIAL_CREDIT as usize + 10];
    for c in data.chunks(50_000) {
        h.append_output(&ex, STDOUT, c);
    }
    assert_eq!(output(&l.take_frames()), INITIAL_CREDIT as usize);
    // Over, with 10 bytes not sent: no EXIT yet, the record stays.
    h.exec_over(&ex, 0);
    assert!(l.take_frames().is_empty());
    assert!(!lock(&ex.st).gone);
    h.grant(&l, 1, 10);
    let f = l.take_frames();
    assert_eq!(heads(&f), [(STDOUT, 1), (EXIT, 1)]);
    // Its EXIT went out: a non-detached record is forgotten (and, its shepherd reaped,
    // removed).
    assert!(lock(&ex.st).gone);
    assert!(h.exec(1).is_none());
}

#[test]
fn nothing_is_taken_as_sent_to_a_broken_connection() {
    let dir = TempDir::new();
    let h = Helper::for_tests(false, dir.path());
    let (ex, _theirs) = exec(&h, 2, false, 0);
    let l = link();
    ex.attach_for_tests(&l);
    l.broke();
    h.append_output(&ex, STDOUT, b"lost?");
    h.exec_over(&ex, 0);
    let st = lock(&ex.st);
    assert!(!st.out.all_sent() && !st.exit_sent && !st.gone);
}

#[test]
fn attach_takes_the_exec_over_and_the_previous_connection_is_told() {
    let dir = TempDir::new();
    let h = Helper::for_tests(false, dir.path());
    let (ex, _theirs) = exec(&h, 3, false, 5000);
    let (a, b) = (link(), link());
    ex.attach_for_tests(&a);
    h.append_output(&ex, STDOUT, b"0123456789");
    assert_eq!(output(&a.take_frames()), 10);
    {
        let mut st = lock(&ex.st);
        st.stdin_taken = 42;
        st.piped = true;
        st.deadline = Some(Instant::now());
    }
    h.attach(&b, 3, 4);
    let f = b.take_frames();
    assert_eq!(heads(&f), [(ATTACHED, 3), (STDOUT, 3)]);
    let att = Attached::decode(&mut Dec::new(&f[0].payload)).unwrap();
    assert_eq!(
        att,
        Attached {
            at: 4,
            end: 10,
            pid: 1003,
            stdin_taken: 42,
            stdin_open: true,
            tty: false,
            detach: false,
        }
    );
    assert_eq!(f[1].payload, b"456789");
    assert_eq!(heads(&a.take_frames()), [(DETACHED, 3)]);
    // An attach clears the deadline; what comes next goes to the new connection only.
    assert_eq!(lock(&ex.st).deadline, None);
    h.append_output(&ex, STDOUT, b"ab");
    assert!(a.take_frames().is_empty());
    assert_eq!(output(&b.take_frames()), 2);
    // Past the end and `u64::MAX`: from the end.
    h.attach(&a, 3, u64::MAX);
    let f = a.take_frames();
    assert_eq!(heads(&f), [(ATTACHED, 3)]);
    assert_eq!(
        Attached::decode(&mut Dec::new(&f[0].payload)).unwrap().at,
        12
    );
    assert_eq!(heads(&b.take_frames()), [(DETACHED, 3)]);
}

#[test]
fn attaching_again_from_the_same_connection_starts_its_output_over() {
    let dir = TempDir::new();
    let h = Helper::for_tests(false, dir.path());
    let (ex, _theirs) = exec(&h, 4, true, 0);
    let l = link();
    ex.attach_for_tests(&l);
    h.append_output(&ex, STDOUT, b"first");
    h.exec_over(&ex, 0);
    // STDOUT and EXIT are queued (not written: no writer runs here).
    h.attach(&l, 4, 2);
    let f = l.take_frames();
    // The old attachment's frames were dropped; no DETACHED to itself.
    assert_eq!(heads(&f), [(ATTACHED, 4), (STDOUT, 4), (EXIT, 4)]);
    assert_eq!(f[1].payload, b"rst");
    // Detached: its record stays after its EXIT went out.
    assert!(!lock(&ex.st).gone);
}

#[test]
fn an_unknown_or_forgotten_exec_is_gone() {
    let dir = TempDir::new();
    let h = Helper::for_tests(false, dir.path());
    let l = link();
    h.attach(&l, 77, 0);
    let (ex, _theirs) = exec(&h, 5, false, 0);
    lock(&ex.st).shepherd_status = None;
    {
        let mut r = lock(&h.reg);
        let mut st = lock(&ex.st);
        r.forget(&ex, &mut st);
    }
    // Still there (its shepherd lives), but its record is not.
    assert!(h.exec(5).is_some());
    h.attach(&l, 5, 0);
    h.list(&l, 9);
    let f = l.take_frames();
    assert_eq!(heads(&f), [(GONE, 77), (GONE, 5), (EXECS, 9)]);
    assert_eq!(f[2].u32(), 0);
}

#[test]
fn an_exec_over_with_everything_sent_attaches_to_its_exit_at_once() {
    let dir = TempDir::new();
    let h = Helper::for_tests(false, dir.path());
    let (ex, _theirs) = exec(&h, 6, false, 1000);
    h.append_output(&ex, STDOUT, b"abc");
    h.exec_over(&ex, 2 << 8);
    let l = link();
    h.attach(&l, 6, u64::MAX);
    let f = l.take_frames();
    assert_eq!(heads(&f), [(ATTACHED, 6), (EXIT, 6)]);
    let mut d = f[1].dec();
    assert_eq!((d.u8().unwrap(), d.i32().unwrap()), (EXITED, 2));
    // Not detached, its EXIT out: forgotten.
    assert!(h.exec(6).is_none());
}

#[test]
fn discard_drains_a_non_detached_exec_and_only_unattaches_a_detached_one() {
    let dir = TempDir::new();
    let h = Helper::for_tests(false, dir.path());
    let (plain, _t1) = exec(&h, 7, false, 0);
    let (detached, _t2) = exec(&h, 8, true, 0);
    let (l, other) = (link(), link());
    for ex in [&plain, &detached] {
        ex.attach_for_tests(&l);
        lock(&ex.st).out.grant(0);
    }
    // From a connection not attached: nothing.
    h.discard_exec(&other, 7);
    h.discard_exec(&other, 8);
    assert!(lock(&plain.st).attached_to(&l) && !lock(&plain.st).discarded);
    assert!(lock(&detached.st).attached_to(&l));
    h.discard_exec(&l, 7);
    h.discard_exec(&l, 8);
    {
        let st = lock(&plain.st);
        assert!(st.discarded && st.attached_to(&l));
    }
    let st = lock(&detached.st);
    assert!(!st.discarded && st.link.is_none());
    drop(st);
    // The discarded exec's output is counted, not kept, not sent; its EXIT still is.
    h.append_output(&plain, STDOUT, b"dropped");
    h.append_output(&detached, STDOUT, b"kept");
    {
        let st = lock(&plain.st);
        assert_eq!((st.out.base(), st.out.end()), (7, 7));
    }
    assert_eq!(lock(&detached.st).out.end(), 4);
    h.exec_over(&plain, 0);
    assert_eq!(heads(&l.take_frames()), [(EXIT, 7)]);
    assert!(h.exec(7).is_none());
}

#[test]
fn credit_counts_only_from_the_connection_attached() {
    let dir = TempDir::new();
    let h = Helper::for_tests(false, dir.path());
    let (ex, _theirs) = exec(&h, 9, false, 0);
    let (l, other) = (link(), link());
    ex.attach_for_tests(&l);
    let initial = u64::from(INITIAL_CREDIT);
    h.grant(&other, 9, 100);
    assert_eq!(lock(&ex.st).out.credit(), initial);
    h.grant(&l, 9, 100);
    assert_eq!(lock(&ex.st).out.credit(), initial + 100);
    h.grant(&l, 99, 100);
}

#[test]
fn release_forgets_an_exec_once_it_is_over() {
    let dir = TempDir::new();
    let h = Helper::for_tests(false, dir.path());
    let (running, _t1) = exec(&h, 10, true, 0);
    h.release(10);
    assert!(lock(&running.st).released && !lock(&running.st).gone);
    h.exec_over(&running, 0);
    assert!(lock(&running.st).gone);
    assert!(h.exec(10).is_none());
    let (over, _t2) = exec(&h, 11, true, 0);
    lock(&over.st).shepherd_status = None;
    h.exec_over(&over, 0);
    assert!(!lock(&over.st).gone, "a detached record stays");
    h.release(11);
    assert!(lock(&over.st).gone);
    // Its shepherd lives: the exec stays (for a KILL), its record does not.
    assert!(h.exec(11).is_some());
    h.release(12);
}

#[test]
fn settle_keeps_what_may_still_be_asked_for() {
    let dir = TempDir::new();
    let h = Helper::for_tests(false, dir.path());
    // Over, unattached, within its grace: kept.
    let (ex, _t) = exec(&h, 13, false, 60_000);
    lock(&ex.st).deadline = Some(Instant::now() + Duration::from_secs(60));
    h.exec_over(&ex, 0);
    assert!(!lock(&ex.st).gone);
    // Its deadline passed: forgotten.
    lock(&ex.st).deadline = Some(Instant::now());
    h.settle(&ex);
    assert!(lock(&ex.st).gone);
    // Not over: nothing.
    let (ex, _t) = exec(&h, 14, false, 0);
    lock(&ex.st).expired = true;
    h.settle(&ex);
    assert!(!lock(&ex.st).gone);
}

#[test]
fn list_shows_every_record_in_the_order_they_were_made() {
    let dir = TempDir::new();
    let h = Helper::for_tests(false, dir.path());
    let (b, _t1) = exec(&h, 20, true, 0);
    let (a, _t2) = exec(&h, 3, false, 0);
    let l = link();
    a.attach_for_tests(&l);
    h.append_output(&b, STDOUT, b"hello");
    lock(&b.st).status = Some(9);
    h.list(&l, 55);
    let f = l.take_frames();
    let f = f.iter().find(|f| f.kind == EXECS).unwrap();
    assert_eq!(f.id, 55);
    let mut d = f.dec();
    assert_eq!(d.u32().unwrap(), 2);
    let first = ExecInfo::decode(&mut d).unwrap();
    let second = ExecInfo::decode(&mut d).unwrap();
    assert!(d.rest().is_empty());
    assert_eq!(
        first,
        ExecInfo {
            id: 20,
            pid: 1020,
            argv: vec![b"test".to_vec()],
            detach: true,
            attached: false,
            exit: Some((SIGNALED, 9)),
            end: 5,
            kept_from: 0,
            started_ms: b.started_ms,
        }
    );
    assert_eq!((second.id, second.attached, second.exit), (3, true, None));
}

#[test]
fn a_list_too_large_for_a_frame_is_cut_to_fit() {
    let big = ExecInfo {
        argv: vec![vec![b'a'; 256]; INFO_ARGS],
        ..ExecInfo::default()
    };
    let mut infos: Vec<ExecInfo> = (0..MAX_RECORDS as u32)
        .map(|id| ExecInfo { id, ..big.clone() })
        .collect();
    let frame = execs_frame(1, &mut infos);
    assert!(frame.len() <= MAX_PAYLOAD + 9, "{}", frame.len());
    let f = Frame::parse(&frame);
    let mut d = f.dec();
    assert_eq!(d.u32().unwrap() as usize, MAX_RECORDS);
    let mut text = 0;
    for id in 0..MAX_RECORDS as u32 {
        let info = ExecInfo::decode(&mut d).unwrap();
        assert_eq!(info.id, id);
        assert!(info.argv.iter().all(|a| big.argv[0].starts_with(a)));
        text += info.argv.iter().map(Vec::len).sum::<usize>();
    }
    // Most of what fits is used.
    assert!(text > MAX_PAYLOAD * 9 / 10, "{text}");
    // A list that fits is left whole.
    let mut few = vec![big.clone(); 3];
    let f = Frame::parse(&execs_frame(2, &mut few));
    let mut d = f.dec();
    d.u32().unwrap();
    assert_eq!(ExecInfo::decode(&mut d).unwrap(), big);
}

#[test]
fn the_end_of_a_connection_sets_deadlines_and_kills_what_has_no_grace() {
    let dir = TempDir::new();
    let h = Helper::for_tests(false, dir.path());
    let (l, other) = (link(), link());
    let (detached, mut t1) = exec(&h, 1, true, 0);
    let (graced, mut t2) = exec(&h, 2, false, 60_000);
    let (no_grace, mut t3) = exec(&h, 3, false, 0);
    let (over, mut t4) = exec(&h, 4, false, 0);
    let (elsewhere, mut t5) = exec(&h, 5, false, 0);
    // Graced, but its `STARTED` not sent yet: no host heard of it.
    let (unannounced, mut t6) = exec(&h, 6, false, 60_000);
    lock(&unannounced.st).started = false;
    for ex in [&detached, &graced, &no_grace, &over, &unannounced] {
        ex.attach_for_tests(&l);
    }
    elsewhere.attach_for_tests(&other);
    lock(&over.st).done = true;
    let before = Instant::now();
    h.connection_ended(&l);
    for ex in [&detached, &graced, &no_grace, &over, &unannounced] {
        assert!(lock(&ex.st).link.is_none(), "exec {}", ex.id);
    }
    assert!(lock(&elsewhere.st).attached_to(&other));
    assert_eq!(lock(&detached.st).deadline, None);
    let d = lock(&graced.st).deadline.unwrap();
    assert!(d >= before + Duration::from_secs(59));
    assert!(lock(&no_grace.st).expired);
    assert!(lock(&unannounced.st).expired);
    assert!(lock(&over.st).deadline.is_some_and(|d| d <= Instant::now()));
    // Only the running exec without grace was killed, at once; the one whose start no
    // host heard of is killed by its spawn once its plan is in (no order now).
    assert_eq!(orders(&mut t3), [(shepherd::KILL_TREE, vec![1])]);
    assert!(orders(&mut t6).is_empty());
    assert_eq!(lock(&unannounced.st).deadline, None);
    for t in [&mut t1, &mut t2, &mut t4, &mut t5] {
        assert!(orders(t).is_empty());
    }
}

#[test]
fn the_janitor_kills_at_the_end_of_the_grace_and_forgets_what_is_over() {
    let dir = TempDir::new();
    let h = Helper::leaked(false, dir.path());
    assert!(crate::start_thread("janitor", move || h.janitor()));
    let l = link();
    let (running, mut t1) = exec(h, 1, false, 300);
    let (over, _t2) = exec(h, 2, false, 300);
    let (attached_again, mut t3) = exec(h, 3, false, 300);
    for ex in [&running, &over, &attached_again] {
        ex.attach_for_tests(&l);
    }
    lock(&over.st).done = true;
    h.connection_ended(&l);
    h.attach(&link(), 3, 0);
    thread::sleep(Duration::from_millis(100));
    assert!(orders(&mut t1).is_empty());
    assert!(!lock(&over.st).gone);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !lock(&over.st).gone {
        assert!(Instant::now() < deadline, "never forgotten");
        thread::sleep(Duration::from_millis(10));
    }
    assert!(h.exec(2).is_none());
    // Killed gracefully (as KILL does); forgotten once it is over.
    let mut got = Vec::new();
    while got.is_empty() {
        assert!(Instant::now() < deadline, "never killed");
        got = orders(&mut t1);
        thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(got, [(shepherd::KILL_TREE, vec![0])]);
    assert!(lock(&running.st).expired && !lock(&running.st).gone);
    h.exec_over(&running, 9);
    assert!(lock(&running.st).gone);
    // The one attached again within its grace: untouched.
    assert!(orders(&mut t3).is_empty());
    assert!(!lock(&attached_again.st).gone);
}
