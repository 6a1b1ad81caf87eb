//! The cases, grouped by concern. Each is a public async function of a [`Context`].

use runcell_core::Capabilities;

use crate::{Case, Context};

mod capabilities;
mod devcontainer;
mod durable;
mod env;
mod exec;
mod files;
mod helper;
mod honesty;
mod host_files;
mod hostile;
mod hostile_helper;
mod isolation;
mod lifecycle;
mod pool;
mod races;
mod robustness;
mod snapshots;
mod terminal;
mod transfers;
mod workspace;

pub use capabilities::*;
pub use devcontainer::*;
pub use durable::*;
pub use env::*;
pub use exec::*;
pub use files::*;
pub use helper::*;
pub use honesty::*;
pub use host_files::*;
pub use hostile::*;
pub use hostile_helper::*;
pub use isolation::*;
pub use lifecycle::*;
pub use pool::*;
pub use races::*;
pub use robustness::*;
pub use snapshots::*;
pub use terminal::*;
pub use transfers::*;
pub use workspace::*;

macro_rules! case {
    ($f:ident) => {
        case!($f, |_| true)
    };
    ($f:ident, $applies:expr) => {
        Case {
            name: stringify!($f),
            applies: $applies,
            run: |cx: &Context| Box::pin($f(cx)),
        }
    };
}

fn files(c: &Capabilities) -> bool {
    c.files
}

fn pool(c: &Capabilities) -> bool {
    c.pool
}

fn snapshots(c: &Capabilities) -> bool {
    c.snapshots
}

/// Every case, with the capabilities it needs.
pub static CASES: &[Case] = &[
    case!(invalid_specs_are_rejected_before_anything_exists),
    case!(hostile_run_specs_are_typed_errors),
    case!(hostile_exec_specs_are_typed_errors),
    case!(hostile_file_paths_are_typed_errors, files),
    case!(durations_at_the_extremes_are_safe),
    case!(keepalive_that_cannot_run_fails_create),
    case!(progress_is_reported_and_detached_runs_have_no_owner),
    case!(entrypoint_never_runs),
    case!(missing_image_is_not_found),
    case!(image_names_never_match_an_image_id_prefix),
    case!(workspace_persists_across_execs),
    case!(workspace_host_dir_is_shared, |c| c.workspace_mount
        || c.workspace_seed),
    case!(working_dir_is_the_same_on_every_exec),
    case!(env_is_injected_and_exec_env_wins),
    case!(unusual_env_names_reach_the_command),
    case!(proxy_is_set_in_both_cases),
    case!(ca_variables_point_at_the_injected_cert),
    case!(read_only_root_with_ca, |c| c.read_only_rootfs),
    case!(post_create_effects_are_visible),
    case!(failing_post_create_leaves_nothing),
    case!(devcontainer_spec_starts_and_is_used, |c| c.workspace_mount
        || c.workspace_seed),
    case!(exit_codes_are_distinct),
    case!(missing_program_reports_on_stderr),
    case!(exec_working_dir_and_user_are_checked),
    case!(the_exit_status_cannot_be_forged),
    case!(stdout_and_stderr_are_apart_and_binary_safe, files),
    case!(stdin_round_trips_with_eof),
    case!(files_round_trip, files),
    case!(file_operations_never_replace_directories, files),
    case!(large_files_stream_in_bounded_memory, files),
    case!(a_directory_get_with_an_unreadable_file_names_it, files),
    case!(a_file_cut_while_it_is_read_fails_the_transfer, files),
    case!(a_cut_upload_is_an_error_and_leaves_no_temporary_file, files),
    case!(a_sparse_file_round_trip_keeps_its_holes, files),
    case!(archives_keep_hard_links_and_fifos, files),
    case!(
        file_operations_never_follow_a_link_another_user_swaps_in,
        files
    ),
    case!(stop_is_idempotent_and_leaves_nothing),
    case!(dropped_guard_cleans_up),
    case!(guard_cleans_up_on_panic),
    case!(cancelled_create_leaves_nothing),
    case!(attach_sees_the_same_run, |c| c.attach),
    case!(malformed_run_ids_and_selectors_are_refused),
    case!(removed_target_is_run_lost),
    case!(a_target_whose_keepalive_dies_is_run_lost),
    case!(an_idle_run_answers_at_once_with_its_background_alive),
    case!(timeout_kills_the_process_tree),
    case!(a_timed_out_exec_is_killed_or_says_it_was_not, |c| c
        .pids_limit),
    case!(a_stopped_shepherd_cannot_hide_a_kill),
    case!(an_exec_that_kills_its_shepherd_leaves_nothing),
    case!(timeout_kills_descendants_that_cleared_their_env),
    case!(cancellation_kills_the_process_tree),
    case!(background_stdout_holder_returns),
    case!(buffered_output_is_capped),
    case!(large_output_streams_in_bounded_memory),
    case!(concurrent_execs_keep_their_output),
    case!(orphans_do_not_become_zombies),
    case!(stop_is_fast),
    case!(reap_removes_runs_of_a_killed_owner),
    case!(a_pooled_run_gets_its_own_settings, pool),
    case!(concurrent_claims_from_two_processes_never_share, pool),
    case!(an_exhausted_pool_errors_or_falls_back, pool),
    case!(a_spec_of_another_shape_is_refused_or_cold, pool),
    case!(dropping_a_pool_leaves_nothing, pool),
    case!(idle_pooled_targets_are_replaced, pool),
    case!(reap_removes_the_pool_of_a_killed_owner, pool),
    case!(signal_to_owner_stops_its_runs),
    case!(ttl_expired_runs_are_reaped, |c| c.ttl),
    case!(memory_limit_is_honoured_or_unsupported),
    case!(cpu_limit_is_honoured_or_unsupported),
    case!(pids_limit_is_honoured_or_unsupported),
    case!(
        a_run_at_its_pids_limit_refuses_execs_with_a_typed_error,
        |c| c.pids_limit
    ),
    case!(disk_limit_is_enforced_or_unsupported),
    case!(a_detached_exec_outlives_its_stream_and_is_read_elsewhere),
    case!(a_stream_resumes_when_its_connection_breaks),
    case!(a_command_without_grace_dies_with_its_connection),
    case!(output_lost_while_detached_is_reported_exactly),
    case!(stop_ends_detached_commands),
    case!(no_exec_reaches_the_run_s_daemon),
    case!(a_stream_that_leaves_its_exec_lets_another_read_it),
    case!(a_killed_reader_process_leaves_the_rest_to_another),
    case!(a_terminal_exec_sees_its_terminal_and_resizes),
    case!(
        ctrl_c_interrupts_a_terminal_exec_and_timeouts_still_kill,
        |c| c.tty
    ),
    case!(cap_drop_is_honoured_or_unsupported),
    case!(no_new_privileges_is_honoured_or_unsupported),
    case!(read_only_rootfs_is_honoured_or_unsupported),
    case!(exec_user_is_honoured_or_unsupported),
    case!(user_names_are_honoured_or_unsupported),
    case!(stdin_streaming_is_honoured_or_unsupported),
    case!(network_none_is_honoured_or_unsupported),
    case!(exec_path_follows_the_mode),
    case!(signals_and_exit_codes_are_told_apart),
    case!(files_move_without_tar_in_the_image, files),
    case!(a_dead_helper_loses_execs_and_recovers),
    case!(unread_floods_time_out_and_leave_nothing),
    case!(background_processes_outlive_the_run_handle, |c| c.attach),
    case!(a_stopped_helper_cannot_stretch_a_timeout),
    case!(garbage_on_the_helpers_streams_costs_only_its_session),
    case!(a_hostile_helper_binary_cannot_stall_or_bloat_the_host),
    case!(a_new_session_runs_the_shipped_helper),
    case!(
        a_forged_settings_file_never_chooses_a_host_path,
        attach_and_host_dir
    ),
    case!(
        setuid_files_from_the_run_land_on_the_host_without_it,
        host_dir
    ),
    case!(a_system_folder_as_workspace_is_refused_before_anything_exists),
    case!(
        a_devcontainer_mount_outside_the_project_needs_an_opt_in,
        host_dir
    ),
    case!(
        an_exec_that_joins_another_execs_group_cannot_take_it_down,
        files
    ),
    case!(
        a_daemon_that_escaped_its_exec_dies_with_it_while_another_runs,
        files
    ),
    case!(one_execs_kill_never_reaches_another_execs_processes, files),
    case!(
        a_snapshot_starts_runs_with_its_files_and_nothing_else,
        snapshots
    ),
    case!(a_snapshot_of_files_being_written_has_each_whole, snapshots),
    case!(what_is_not_a_snapshot_is_refused, snapshots),
    case!(a_snapshot_keeps_odd_files_and_refuses_whiteouts, snapshots),
    case!(
        a_run_from_a_snapshot_as_another_user_keeps_exec_records,
        |c| snapshots(c) && c.exec_user
    ),
    case!(snapshots_are_unsupported_where_there_are_none, |c| !c
        .snapshots),
];

#[cfg(test)]
mod tests {
    /// Every case written is run: each `pub async fn name(cx: &Context)` in `cases/` is
    /// in [`super::CASES`] once, and every entry there is such a function.
    #[test]
    fn every_case_is_registered_once() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/cases");
        let mut written = Vec::new();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let text = std::fs::read_to_string(&path).unwrap();
            // Signatures may wrap: join the lines between `pub async fn` and `{`.
            for (i, _) in text.match_indices("pub async fn ") {
                let rest = &text[i + "pub async fn ".len()..];
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                let head = &rest[..rest.find('{').unwrap_or(rest.len())];
                if head.contains("cx: &Context") && head.contains("anyhow::Result<()>") {
                    written.push(name);
                }
            }
        }
        written.sort();
        let mut registered: Vec<String> = super::CASES.iter().map(|c| c.name.to_string()).collect();
        registered.sort();
        let mut dupes = registered.clone();
        dupes.dedup();
        assert_eq!(dupes.len(), registered.len(), "a case is registered twice");
        let missing: Vec<_> = written.iter().filter(|n| !registered.contains(n)).collect();
        let stray: Vec<_> = registered.iter().filter(|n| !written.contains(n)).collect();
        assert!(
            missing.is_empty() && stray.is_empty(),
            "cases not in CASES: {missing:?}; CASES entries with no case function: {stray:?}"
        );
        assert!(written.len() > 50, "found only {} cases", written.len());
    }
}
