//! Property tests: validation never panics, and what it accepts is safe to use.

use proptest::prelude::*;

use super::*;

fn any_duration() -> impl Strategy<Value = Duration> {
    prop_oneof![
        Just(Duration::MAX),
        Just(Duration::ZERO),
        any::<u64>().prop_map(Duration::from_secs),
        (any::<u64>(), 0u32..1_000_000_000).prop_map(|(s, n)| Duration::new(s, n)),
    ]
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        "[ -~]{0,40}",
        Just("-i".to_string()),
        Just("a\nb".to_string()),
        Just("/".to_string()),
        Just("/a/../b".to_string()),
    ]
}

prop_compose! {
    fn any_run_spec()(
        image in text(),
        env in proptest::collection::vec((text(), text()), 0..4),
        working_dir in proptest::option::of(text()),
        user in proptest::option::of(text()),
        ws_path in text(),
        ttl in proptest::option::of(any_duration()),
        cpus in proptest::option::of(any::<f64>()),
        memory in proptest::option::of(any::<u64>()),
        pids in proptest::option::of(any::<u32>()),
        disk in proptest::option::of(any::<u64>()),
        proxy in proptest::option::of(text()),
        labels in proptest::collection::btree_map(text(), text(), 0..3),
        post in proptest::collection::vec(proptest::collection::vec(text(), 0..3), 0..2),
        ca in proptest::option::of(text()),
    ) -> RunSpec {
        let mut s = RunSpec::new(image);
        s.env = env;
        s.working_dir = working_dir;
        s.user = user;
        s.workspace.path = ws_path;
        s.ttl = ttl;
        s.resources = Resources { memory_bytes: memory, cpus, pids, disk_bytes: disk };
        s.proxy.http = proxy;
        s.labels = labels;
        s.post_create = post;
        s.ca_bundle = ca;
        s
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Validation never panics; what it rejects names a field; and what it accepts
    /// survives the arithmetic drivers do with it.
    #[test]
    fn run_spec_validation_never_panics(spec in any_run_spec()) {
        let _ = format!("{spec:?}");
        match spec.validate() {
            Ok(()) => {
                let labels = crate::labels::run_labels("sbx-0", Some(&crate::labels::Owner::current()), spec.ttl, &spec.labels);
                prop_assert!(labels.contains_key(crate::labels::RUN_ID));
                let _ = spec.run_env();
            }
            Err(e) => prop_assert!(e.field().is_some(), "{e}"),
        }
    }

    #[test]
    fn exec_spec_validation_never_panics(
        argv in proptest::collection::vec(text(), 0..4),
        env in proptest::collection::vec((text(), text()), 0..3),
        dir in proptest::option::of(text()),
        user in proptest::option::of(text()),
        timeout in proptest::option::of(any_duration()),
    ) {
        let spec = ExecSpec { argv, env, working_dir: dir, user, timeout, ..Default::default() };
        let _ = format!("{spec:?}");
        if let Err(e) = spec.validate() {
            prop_assert!(e.field().is_some(), "{e}");
        }
    }
}

/// The exec pump with any timeout: no overflow, and a deadline far away is no deadline.
#[tokio::test(start_paused = true)]
async fn any_timeout_is_safe_in_the_pump() {
    use futures::StreamExt;
    for timeout in [
        Duration::MAX,
        Duration::from_secs(u64::MAX / 2),
        Duration::new(u64::MAX, 999_999_999),
        Duration::from_nanos(1),
    ] {
        let spec = ExecSpec::new(["x"]).timeout(timeout);
        let stream = crate::ExecStream::spawn(
            &spec,
            futures::stream::empty().boxed(),
            None,
            Box::new(Done),
        );
        let status = stream.wait().await;
        prop_assert_ok(&status);
    }
}

fn prop_assert_ok(status: &crate::ExitStatus) {
    assert!(
        matches!(
            status,
            crate::ExitStatus::Exited(0) | crate::ExitStatus::TimedOut
        ),
        "{status}"
    );
}

struct Done;

#[async_trait::async_trait]
impl crate::exec::ExecControl for Done {
    async fn status(&self) -> crate::Result<crate::ExitStatus> {
        Ok(crate::ExitStatus::Exited(0))
    }
    async fn kill(&self) -> crate::Result<()> {
        Ok(())
    }
}
