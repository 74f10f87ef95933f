//! The conformance suite on PostgreSQL (`IDEM_POSTGRES_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`).

mod conformance;

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{Connection as _, PgConnection, Postgres};

struct Pg;

const URL_VAR: &str = "IDEM_POSTGRES_URL";

impl conformance::Support for Pg {
    type Db = Postgres;
    const KEY_TEXT: &'static str = "key";
    const BIGINT: &'static str = "BIGINT";
    const TWO_HOURS_AGO: &'static str = "now() - interval '2 hours'";
    // A claim queued behind the key waits on the holder's transaction id: a `Lock` wait.
    const LOCK_WAITERS: Option<&'static str> = Some(
        "SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
         AND query LIKE '%INSERT INTO ' || $1 || ' %'",
    );
    const STATEMENT_AFTER_ROLLBACK_KEPT: bool = false;

    async fn swallow_a_rollback(conn: &mut PgConnection, _: &PgPool, _: &str) {
        // The error aborts the transaction: every later statement fails with 25P02, and
        // `COMMIT` answers with a rollback.
        let err = sqlx::query("SELECT 1 / 0")
            .execute(conn)
            .await
            .expect_err("division by zero");
        assert_eq!(
            conformance::util::db_code(&err).as_deref(),
            Some("22012"),
            "{err}"
        );
    }

    fn url() -> String {
        conformance::server_url(URL_VAR, "postgres://postgres@127.0.0.1:5432/test")
    }

    async fn connect(url: &str, max: u32) -> PgPool {
        let opts: PgConnectOptions = url
            .parse()
            .unwrap_or_else(|e| conformance::unreachable("PostgreSQL", url, URL_VAR, &e));
        // One direct connection first: the pool would retry a refused connection until its
        // acquire timeout instead of failing at once.
        match tokio::time::timeout(Duration::from_secs(10), PgConnection::connect_with(&opts)).await
        {
            Ok(Ok(conn)) => drop(conn.close().await),
            Ok(Err(e)) => conformance::unreachable("PostgreSQL", url, URL_VAR, &e),
            Err(e) => conformance::unreachable("PostgreSQL", url, URL_VAR, &e),
        }
        PgPoolOptions::new()
            .max_connections(max)
            .acquire_timeout(Duration::from_secs(60))
            .connect_lazy_with(opts)
    }
}

impl conformance::Server for Pg {
    const URL_VAR: &'static str = URL_VAR;
    const UNREACHABLE_URL: &'static str = "postgres://postgres@127.0.0.1:1/test";

    async fn connection_id(conn: &mut PgConnection) -> i64 {
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(conn)
            .await
            .expect("pg_backend_pid()");
        i64::from(pid)
    }

    async fn kill(pool: &PgPool, id: i64) {
        // With a timeout, pg_terminate_backend waits until the backend has exited.
        let pid = i32::try_from(id).expect("a backend pid is an int4");
        let gone: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 30000)")
            .bind(pid)
            .fetch_one(pool)
            .await
            .expect("pg_terminate_backend");
        assert!(gone, "backend {pid} did not exit");
    }

    const WIRE: conformance::proxy::Wire = conformance::proxy::Wire::Postgres;
    const SESSIONS_FROM_PORT: &'static str =
        "SELECT COUNT(*) FROM pg_stat_activity WHERE client_port = CAST($1 AS INTEGER)";

    fn address(url: &str) -> String {
        conformance::proxy::upstream(url, 5432)
    }

    fn with_address(url: &str, addr: std::net::SocketAddr) -> String {
        conformance::proxy::with_address(url, addr, "sslmode=disable")
    }
}

conformance::tests!(Pg;
    first_delivery_applies_second_is_duplicate,
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
    serialization_failure_in_the_body_is_an_error_not_applied,
    connection_killed_before_commit_keeps_nothing,
    unreachable_server_fails_the_test_naming_url_and_variable,
    custom_keys_with_two_parts_cannot_collide,
    tuple_keys_of_fields_cannot_collide,
    handler_with_inner_attributes_runs,
    attribute_wait_is_in_progress_then_duplicate,
    commit_cut_before_its_answer_is_an_error_and_redelivery_settles_it,
    commit_never_delivered_is_an_error_and_redelivery_applies,
    connection_cut_after_the_claim_keeps_nothing_and_redelivery_applies,
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
    lease_is_live_for_a_session_in_another_time_zone,
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
    lease_unserialisable_value_completes_nothing_and_next_delivery_applies,
    marker_from_before_replay_is_a_plain_duplicate,
    lease_marker_from_before_replay_is_a_plain_duplicate,
    stored_value_of_another_type_is_a_serialize_error,
    lease_stored_value_of_another_type_is_a_serialize_error,
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
);

/// The worker process of the multi-process cases (this binary, started again by them).
#[tokio::test(flavor = "multi_thread")]
#[ignore = "a worker process: started by four_processes_apply_every_job_exactly_once and \
            worker_killed_inside_the_body_keeps_nothing, with its orders in \
            IDEM_CONFORMANCE_* variables"]
async fn child_process() {
    conformance::worker::child_process::<Pg>().await;
}
