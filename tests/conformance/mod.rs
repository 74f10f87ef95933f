//! The conformance suite: every behaviour idem promises, written once as generic async
//! functions and run against every backend on a real database.
//!
//! A backend joins with one trait impl and a list of tests (see `tests/postgres.rs`):
//!
//! ```text
//! struct Pg;
//! impl conformance::Support for Pg { ... }        // connect, SQL dialect
//! impl conformance::Server for Pg { ... }         // only for servers: kill a connection
//! conformance::tests!(Pg; first_delivery_applies_second_is_duplicate, ...);
//! ```
//!
//! Every test makes its own tables (unique names), so tests run in parallel and reruns never
//! collide; a test that passes drops them again. A server that cannot be reached fails the test
//! with the URL and the environment variable that overrides it: the suite never skips.
//!
//! - `util`: names, the seeded shuffle, the hang guard `within`;
//! - `db`: the statements handlers run, generic over the database;
//! - `handlers`: the job, the error type, the handlers;
//! - `ctx`: one test's pool, store and tables, and counts read back from the database;
//! - `worker`: the worker processes of the multi-process cases;
//! - `cases/*`: the cases, grouped by concern.

// Each test binary includes this module and lists the cases its backend runs: SQLite skips the
// server-only ones, so some items are unused in some binaries.
#![allow(
    dead_code,
    unused_imports,
    reason = "each backend runs its own subset of the cases"
)]

pub(crate) mod batch_handlers;
pub(crate) mod cases;
pub(crate) mod ctx;
pub(crate) mod db;
pub(crate) mod each_handlers;
pub(crate) mod group_handlers;
pub(crate) mod handlers;
pub(crate) mod lease_handlers;
pub(crate) mod proxy;
pub(crate) mod replay_handlers;
pub(crate) mod step_handlers;
pub(crate) mod util;
pub(crate) mod worker;

use std::future::Future;

use sqlx::{Database, Pool};

pub(crate) use db::TestDb;
pub(crate) use util::{question_marks, server_url, unique_name, unreachable};

/// What the suite needs to know about one database.
pub(crate) trait Support: Send + Sync + 'static {
    /// The sqlx database type handlers run on.
    type Db: TestDb;

    /// A database URL for one test: the server's (from the environment variable or the default)
    /// or, for an embedded database, a new file.
    fn url() -> String;

    /// A pool of at most `max` connections to `url`. Panics, naming the URL and the variable
    /// that overrides it, when the database cannot be reached.
    fn connect(url: &str, max: u32) -> impl Future<Output = Pool<Self::Db>> + Send;

    /// An SQL expression that reads the marker table's `key` column as text.
    const KEY_TEXT: &'static str;

    /// The type to `CAST` an aggregate to so that it decodes as `i64`.
    const BIGINT: &'static str;

    /// An SQL expression for the time two hours ago, in the marker table's time format.
    const TWO_HOURS_AGO: &'static str;

    /// A query counting the sessions blocked on a row lock of the marker table named `$1`
    /// (claims queued behind a key), or `None` where waiters cannot be seen from SQL (SQLite: they wait
    /// in the busy handler of `BEGIN IMMEDIATE`, invisible to other connections).
    const LOCK_WAITERS: Option<&'static str>;

    /// Whether a statement that runs after the database rolled the body's transaction back
    /// (in [`swallow_a_rollback`](Support::swallow_a_rollback)) is kept: MySQL and SQLite run
    /// it in autocommit, PostgreSQL refuses it in the aborted transaction.
    const STATEMENT_AFTER_ROLLBACK_KEPT: bool;

    /// Makes a test's marker table: [`Store::migrate`](idem::Store::migrate), or what the run
    /// asks of the backend instead (PostgreSQL's partitioned table).
    fn migrate(store: &idem::Store<Self::Db>) -> impl Future<Output = ()> + Send + '_ {
        async move { store.migrate().await.expect("migrate the marker table") }
    }

    /// Inside a body, on its transaction's connection: makes the database roll the whole
    /// transaction back by a failing statement, and swallows that statement's error (what a
    /// careless body does). `rows` is a table `(id BIGINT PRIMARY KEY, v BIGINT)` holding ids
    /// 1 to 100; `other` is a pool for a second session.
    fn swallow_a_rollback<'a>(
        conn: &'a mut <Self::Db as Database>::Connection,
        other: &'a Pool<Self::Db>,
        rows: &'a str,
    ) -> impl Future<Output = ()> + Send + 'a;

    /// Whether any failed statement aborts the transaction (or the savepoint it runs in)
    /// until it is rolled back: PostgreSQL. Elsewhere a failed statement undoes only itself.
    const FAILED_STATEMENT_ABORTS: bool = false;

    /// What drops the index of failed markers (`{table}` for the marker table) where a column
    /// it names cannot be dropped while it is there: SQLite. PostgreSQL drops it with the
    /// column; MySQL has none.
    const DROP_FAILED_INDEX: Option<&'static str> = None;

    /// Where a claim with `wait` changes a session setting that outlives the transaction
    /// unless put back (MySQL's `innodb_lock_wait_timeout`): a query for the session's id,
    /// and one answering 1 when the setting is back to the server's default. `None` where the
    /// wait ends with the transaction (PostgreSQL's `SET LOCAL`) or stays set by design
    /// (SQLite's busy timeout).
    const WAIT_RESTORED: Option<(&'static str, &'static str)> = None;

    /// A query for the session's lock wait in milliseconds: PostgreSQL's `lock_timeout`,
    /// MySQL's `innodb_lock_wait_timeout`, SQLite's busy timeout.
    const LOCK_WAIT_MS: &'static str;

    /// A query counting the sessions that have been running an `UPDATE` of the table named `$1`
    /// for more than `$2` milliseconds (a statement queued behind another session's row lock),
    /// or `None` where other sessions' statements cannot be seen (SQLite).
    const UPDATES_RUNNING_LONGER_THAN: Option<&'static str> = None;

    /// [`connect`](Support::connect) with the database's own lock wait: SQLite's connections
    /// keep sqlx's busy timeout (5 s) instead of `connect`'s minute.
    fn connect_default_wait(url: &str, max: u32) -> impl Future<Output = Pool<Self::Db>> + Send {
        Self::connect(url, max)
    }

    /// The published schema of version 2, as it was (`idem_processed` for the table's name).
    const SCHEMA_V2: &'static str;

    /// The published upgrade from version 2 to version 3 (`schema/<db>.v2-to-v3.sql`).
    const UPGRADE_V2_TO_V3: &'static str;

    /// The published upgrade from version 3 to version 4 (`schema/<db>.v3-to-v4.sql`).
    const UPGRADE_V3_TO_V4: &'static str;

    /// The published upgrade from version 4 to version 5 (`schema/<db>.v4-to-v5.sql`).
    const UPGRADE_V4_TO_V5: &'static str;

    /// The published upgrade from version 5 to version 6 (`schema/<db>.v5-to-v6.sql`).
    const UPGRADE_V5_TO_V6: &'static str;

    /// A query of one text column describing each column of the table `{table}`: its name,
    /// type, nullability and default.
    const COLUMNS_OF: &'static str;

    /// A query of one text column describing each index of the table `{table}`: its name and
    /// columns.
    const INDEXES_OF: &'static str;

    /// Removes what [`url`](Support::url) created outside the database (files), if anything.
    fn remove(_url: &str) {}
}

/// What the suite needs from a database server (not from an embedded database).
pub(crate) trait Server: Support {
    /// The environment variable that overrides the server's URL.
    const URL_VAR: &'static str;

    /// A URL of this scheme on which no server listens.
    const UNREACHABLE_URL: &'static str;

    /// The id by which another session can kill this connection.
    fn connection_id(
        conn: &mut <Self::Db as Database>::Connection,
    ) -> impl Future<Output = i64> + Send + '_;

    /// Kills the connection `id` from another session of `pool`.
    fn kill(pool: &Pool<Self::Db>, id: i64) -> impl Future<Output = ()> + Send + '_;

    /// The wire protocol, which the proxy of the ambiguous-commit cases frames.
    const WIRE: proxy::Wire;

    /// `host:port` of the server `url` names.
    fn address(url: &str) -> String;

    /// `url` connecting to `addr` instead (the proxy), in plain text: the proxy reads the
    /// messages, so the client must not negotiate TLS.
    fn with_address(url: &str, addr: std::net::SocketAddr) -> String;

    /// A query counting the server's sessions whose client port is `$1` (an integer).
    const SESSIONS_FROM_PORT: &'static str;
}

/// One `#[tokio::test]` per listed case, each a call of the generic case on `$support`.
macro_rules! tests {
    ($support:ty; $($case:ident),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread")]
        async fn $case() {
            $crate::conformance::cases::$case::<$support>().await;
        }
    )*};
}

pub(crate) use tests;

/// The cases every backend runs; each backend file adds its own (`tests!`) after this.
macro_rules! every_backend_tests {
    ($support:ty) => {
        $crate::conformance::tests!($support;
            first_delivery_applies_second_is_duplicate,
            job_error_handlers_keep_idem_kinds_and_settle_as_them,
            runner_settles_job_errors_as_the_errors_they_hold,
            offset_claims_apply_each_record_once_and_the_watermark_only_rises,
            failed_offset_claim_keeps_nothing_and_redelivery_applies,
            revoked_consumer_never_moves_the_watermark_back,
            watermark_never_moves_back_under_random_consumers,
            offset_claim_rolled_back_under_its_body_is_not_applied,
            offset_claim_outbox_commits_with_its_watermark,
            offsets_refuse_bad_input_before_any_io,
            grouped_offset_claims_of_partitions_share_one_commit,
            failing_grouped_offset_member_keeps_only_its_watermark_back,
            grouped_offset_claims_of_one_partition_keep_its_order,
            grouped_and_plain_offset_claims_of_one_partition_apply_once,
            set_watermark_replays_and_forget_starts_over,
            every_mode_reads_a_completed_marker_of_every_mode_as_a_duplicate,
            a_live_lease_is_in_progress_to_every_mode_then_released,
            an_expired_lease_is_taken_over_by_every_mode,
            a_transaction_holding_the_key_keeps_every_mode_waiting,
            lease_outside_its_bounds_is_refused_before_any_io,
            a_handler_takes_a_store_a_reference_or_an_arc,
            commit_of_a_transaction_the_database_rolled_back_is_not_committed,
            outbox_messages_exist_exactly_when_the_effect_does,
            relay_publishes_each_message_once_and_marks_it_sent,
            relay_retries_a_failing_message_then_parks_it,
            two_relays_publish_each_message_once,
            relays_beside_a_stalled_one_publish_each_message_once,
            forget_lets_a_rerun_publish_its_new_message,
            a_megabyte_of_error_text_is_stored_bounded,
            relay_keeps_each_keys_order_across_interleaved_jobs,
            failing_message_holds_back_only_its_own_key,
            two_relays_never_publish_one_key_at_once,
            rounds_in_flight_never_publish_one_key_at_once,
            relay_of_its_own_store_wakes_at_each_commit_of_messages,
            migrate_gives_an_old_outbox_its_ordering_keys,
            outbox_headers_reach_the_publisher_as_they_were_sent,
            outbox_refuses_bad_headers_before_any_io,
            migrate_gives_an_old_outbox_its_headers,
            outbox_refuses_a_bad_message_and_nothing_is_kept,
            migrate_adds_the_outbox_to_a_version_1_schema,
            migrate_brings_a_version_2_schema_to_the_current_one,
            outbox_of_a_joined_call_goes_with_the_callers_transaction,
            outbox_of_a_lease_is_written_as_it_completes,
            batch_outbox_messages_commit_with_the_batch,
            batch_outbox_refuses_a_job_that_is_not_fresh,
            batch_outbox_of_a_panicking_body_keeps_nothing,
            worker_killed_in_a_batch_with_an_outbox_keeps_nothing,
            handler_error_keeps_nothing_and_next_delivery_applies,
            handler_panic_rolls_back_and_next_delivery_applies,
            concurrent_deliveries_of_one_key_apply_once,
            concurrent_deliveries_after_failed_holders_apply_once,
            same_key_in_two_scopes_runs_once_in_each,
            invalid_keys_are_refused_and_write_nothing,
            four_processes_apply_every_job_exactly_once,
            worker_killed_inside_the_body_keeps_nothing,
            every_handler_shape_runs_under_tokio_spawn,
            destructured_and_impl_trait_parameters_run_under_tokio_spawn,
            failing_effect_statement_unique_violation_releases_the_claim,
            failing_effect_statement_check_violation_releases_the_claim,
            longest_multibyte_key_round_trips,
            keys_differing_in_case_or_trailing_space_are_distinct,
            concurrent_migrations_of_a_fresh_table_succeed,
            table_names_that_are_not_identifiers_are_refused,
            longest_table_name_works,
            forget_lets_a_job_run_again,
            purge_deletes_only_markers_older_than_the_retention,
            body_that_swallows_a_rollback_is_rolled_back_not_applied,
            concurrent_serializable_deliveries_apply_once,
            concurrent_repeatable_read_deliveries_apply_once,
            delivery_that_stops_waiting_is_in_progress_and_runs_nothing,
            store_refuses_bad_scopes_and_writes_nothing,
            purge_with_the_longest_retention_deletes_nothing,
            inspect_shows_each_marker_and_the_leases_in_progress,
            custom_keys_with_two_parts_cannot_collide,
            tuple_keys_of_fields_cannot_collide,
            handler_with_inner_attributes_runs,
            attribute_wait_is_in_progress_then_duplicate,
            lease_first_delivery_applies_second_is_duplicate,
            lease_live_lease_is_in_progress_without_running_the_body,
            lease_stalled_call_times_out_releases_and_redelivery_applies,
            lease_handler_error_releases_at_once_and_redelivery_applies,
            lease_expired_lease_is_taken_over_by_exactly_one_of_32,
            lease_renew_keeps_the_lease_and_fails_after_a_takeover,
            lease_renewing_body_outlives_its_timeout,
            lease_claims_use_the_database_clock,
            lease_invalid_key_is_refused_before_any_io,
            lease_panicking_body_releases_the_key,
            lease_worker_killed_in_its_call_is_taken_over_with_the_same_key,
            lease_paused_holder_resumed_after_a_takeover_gets_lease_lost,
            joined_claim_is_kept_only_if_the_caller_commits,
            joined_duplicate_leaves_the_caller_transaction_as_it_was,
            joined_body_error_leaves_the_caller_transaction_usable,
            nested_handler_joins_the_outer_transaction,
            nested_call_with_a_store_is_refused_and_writes_nothing,
            replay_by_hand_returns_the_first_value_in_transaction_mode,
            replay_by_hand_returns_the_first_value_in_lease_mode,
            replay_returns_the_first_value_byte_for_byte,
            lease_replay_returns_the_first_value_byte_for_byte,
            concurrent_replay_deliveries_apply_once_and_replay_its_value,
            lease_concurrent_deliveries_with_replay_apply_once,
            stored_json_null_is_replayed_not_duplicate,
            lease_stored_json_null_is_replayed_not_duplicate,
            unserialisable_value_commits_nothing_and_next_delivery_applies,
            lease_unstorable_value_completes_without_it,
            marker_from_before_replay_is_a_plain_duplicate,
            lease_marker_from_before_replay_is_a_plain_duplicate,
            stored_value_of_another_type_is_a_duplicate,
            lease_stored_value_of_another_type_is_a_duplicate,
            replayed_text_keeps_every_character,
            lease_replayed_text_keeps_every_character,
            fingerprint_same_payload_is_duplicate_other_payload_is_key_reused,
            lease_fingerprint_same_payload_is_duplicate_other_payload_is_key_reused,
            fingerprint_other_payload_behind_a_held_key_is_key_reused,
            lease_held_by_one_payload_refuses_another_with_key_reused,
            failed_delivery_leaves_no_fingerprint_in_transaction_mode,
            lease_released_attempt_keeps_its_fingerprint,
            replayed_text_with_a_nul_character_is_stored_or_refused,
            lease_replayed_text_with_a_nul_character_is_stored_or_refused,
            batch_with_duplicates_applies_only_the_fresh_jobs,
            batch_with_the_same_key_twice_claims_it_at_its_first_position,
            failed_batch_keeps_nothing_and_redelivery_applies_each_once,
            batch_body_that_swallows_a_rollback_is_rolled_back_not_applied,
            batch_keys_are_checked_before_any_io,
            overlapping_batches_wait_for_each_other_and_apply_each_job_once,
            batch_that_stops_waiting_is_in_progress_and_claims_nothing,
            worker_killed_inside_a_batch_keeps_nothing,
            four_processes_in_overlapping_batches_apply_every_job_once,
            forgotten_lease_taken_again_gets_a_larger_token_and_fences_the_old_holder,
            fenced_holder_of_a_forgotten_lease_cannot_release_the_new_one,
            lease_claims_behind_a_rolled_back_transaction_claim_are_fresh_at_most_once,
            lease_claim_behind_an_open_transaction_claim_is_in_progress,
            lease_handler_inside_a_transaction_body_is_refused_as_nested,
            wait_does_not_reach_the_body,
            wait_does_not_outlive_the_call_on_the_pooled_connection,
            outbox_message_of_a_body_that_swallows_a_rollback_is_not_kept,
            outbox_of_a_guard_by_hand_is_written_only_by_finish_ok,
            outbox_of_a_joined_guard_by_hand_is_kept_only_if_the_caller_commits,
            outbox_of_a_batch_guard_by_hand_is_written_only_by_finish_ok,
            outbox_of_a_lease_by_hand_is_written_only_when_it_completes,
            outbox_of_a_lease_handler_is_written_only_when_its_lease_completes,
            body_run_refuses_a_nested_claim_of_every_kind_before_any_io,
            claims_side_by_side_in_one_task_are_not_nested,
            lease_with_wait_behind_a_hand_held_transaction_claim_waits_then_applies,
            lease_without_wait_behind_a_hand_held_transaction_claim_is_in_progress,
            forget_refuses_a_live_lease_and_its_holder_still_completes,
            forget_deletes_a_completed_marker_and_lets_go_of_a_free_lease,
            forced_forget_of_a_live_lease_fences_out_the_old_holder,
            poison_job_rolls_back_alone_and_its_batch_commits,
            poison_jobs_by_hand_fail_alone_beside_duplicates,
            failed_job_gives_back_the_lease_it_took_over,
            job_that_swallows_a_statement_error,
            job_that_takes_the_transaction_with_it_fails_the_batch,
            dropped_job_guard_is_rolled_back_alone,
            job_messages_exist_exactly_for_the_kept_jobs,
            group_commits_concurrent_deliveries_of_each_key_once,
            group_member_failure_rolls_back_only_its_savepoint,
            group_member_that_swallows_a_statement_error,
            cancelled_caller_in_a_group_keeps_nothing_and_others_commit,
            group_left_by_a_cancelled_call_commits_at_its_delay_bound,
            group_body_past_its_bound_fails_alone_and_the_group_commits,
            group_beside_transaction_and_lease_mode_applies_each_key_once,
            group_keeps_replay_fingerprint_and_outbox,
            group_on_its_defaults_applies_hot_rows_without_deadlock,
            group_lanes_by_account_apply_hot_rows_without_deadlock,
            // Retention per scope (schema version 3).
            retention_per_scope_decides_what_purge_deletes,
            retention_refuses_bad_windows_before_any_io,
            // `Store::doctor`.
            doctor_finds_a_healthy_deployment_healthy,
            doctor_finds_each_breakage_and_says_what_to_do,
        );
        // Lease steps.
        $crate::conformance::tests!($support;
            steps_of_a_failed_attempt_are_replayed_not_run_again,
            steps_are_replayed_after_the_worker_is_killed_after_each_step,
            stale_holder_cannot_record_a_step,
            steps_out_of_order_or_repeated_are_refused_before_they_run,
            steps_with_replay_and_fingerprint,
            database_step_keeps_its_writes_only_with_its_record,
            forget_and_purge_remove_steps_with_their_marker,
        );
        // Error classes.
        $crate::conformance::tests!($support;
            permanent_error_completes_the_marker_as_failed_for_every_mode,
            requeued_failed_job_runs_again_after_its_recorded_steps,
            unknown_error_keeps_the_lease_until_it_runs_out,
            unknown_error_with_a_verify_step_is_decided_at_once,
            takeover_verifies_a_step_its_predecessor_may_have_run,
        );
        // Keep-alive.
        $crate::conformance::tests!($support;
            keep_alive_outlives_the_lease_and_its_timeout,
            keep_alive_stops_the_call_once_the_lease_is_taken,
        );
    };
}

pub(crate) use every_backend_tests;
