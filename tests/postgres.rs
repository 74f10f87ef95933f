//! The conformance suite on PostgreSQL (`IDEM_POSTGRES_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`).

mod conformance;

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{Connection as _, PgConnection, Postgres};

struct Pg;

const URL_VAR: &str = "IDEM_POSTGRES_URL";

/// Runs the suite on partitioned marker tables.
const PARTITIONED_VAR: &str = "IDEM_CONFORMANCE_PARTITIONED";

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
    const FAILED_STATEMENT_ABORTS: bool = true;
    const SCHEMA_V2: &'static str = include_str!("conformance/schema_v2/postgres.sql");
    const UPGRADE_V2_TO_V3: &'static str = include_str!("../schema/postgres.v2-to-v3.sql");
    const UPGRADE_V3_TO_V4: &'static str = include_str!("../schema/postgres.v3-to-v4.sql");
    const UPGRADE_V4_TO_V5: &'static str = include_str!("../schema/postgres.v4-to-v5.sql");
    const UPGRADE_V5_TO_V6: &'static str = include_str!("../schema/postgres.v5-to-v6.sql");
    const COLUMNS_OF: &'static str = "SELECT column_name || ' ' || data_type || ' ' || is_nullable \
         || ' ' || coalesce(column_default, '') FROM information_schema.columns \
         WHERE table_schema = current_schema() AND table_name = '{table}'";
    const INDEXES_OF: &'static str = "SELECT indexdef FROM pg_indexes WHERE schemaname = current_schema() \
         AND tablename = '{table}'";
    const LOCK_WAIT_MS: &'static str = "SELECT CAST(EXTRACT(EPOCH FROM \
         current_setting('lock_timeout')::interval) * 1000 AS BIGINT)";
    // `query_start` is when the session's running statement began; a `Lock` wait is a row lock.
    const UPDATES_RUNNING_LONGER_THAN: Option<&'static str> = Some(
        "SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
         AND query LIKE 'UPDATE ' || $1 || ' %' \
         AND now() - query_start > $2 * interval '1 millisecond'",
    );

    /// With `IDEM_CONFORMANCE_PARTITIONED` set, every test's marker table is partitioned by
    /// day (`Store::partitions`): the suite's keys carry no time, so they are written to its
    /// default partition, through the same statements.
    async fn migrate(store: &idem::Store<Postgres>) {
        if std::env::var_os(PARTITIONED_VAR).is_none() {
            return store.migrate().await.expect("migrate the marker table");
        }
        store
            .partitions(idem::partitions::KeyTime::UuidV7)
            .migrate(1)
            .await
            .expect("migrate the marker table partitioned");
    }

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

conformance::every_backend_tests!(Pg);

// The cases SQLite cannot run: a connection to cut, a server to miss, a session's own settings,
// a second writer's serialization failure, a named lock, a second writer beside an open group.
conformance::tests!(Pg;
    job_begun_first_and_committed_last_is_published_second,
    killed_connection_fails_its_group_and_redelivery_applies_once,
    group_claim_that_stops_waiting_is_in_progress,
    group_calls_naming_the_same_rows_take_turns_in_one_lane,
    connection_killed_in_a_job_fails_the_batch_and_keeps_nothing,
    serialization_failure_in_the_body_is_an_error_not_applied,
    connection_killed_before_commit_keeps_nothing,
    unreachable_server_fails_the_test_naming_url_and_variable,
    commit_cut_before_its_answer_is_an_error_and_redelivery_settles_it,
    commit_never_delivered_is_an_error_and_redelivery_applies,
    group_commit_cut_before_its_answer_fails_every_member_as_may_be_kept,
    group_commit_never_delivered_fails_every_member_and_redelivery_applies,
    grouped_offset_commit_cut_fails_every_member_as_may_be_kept,
    grouped_offset_commit_never_delivered_fails_every_member,
    connection_cut_after_the_claim_keeps_nothing_and_redelivery_applies,
    lease_is_live_for_a_session_in_another_time_zone,
    waiting_relay_wakes_at_the_commit_of_a_message,
    relay_of_another_store_wakes_at_its_announcement,
    relay_that_does_not_listen_polls,
    body_statement_waits_longer_than_the_claims_wait,
    batch_statements_look_up_keys_in_a_scope_the_statistics_miss,
);

/// The worker process of the multi-process cases (this binary, started again by them).
#[tokio::test(flavor = "multi_thread")]
#[ignore = "a worker process: started by four_processes_apply_every_job_exactly_once and \
            worker_killed_inside_the_body_keeps_nothing, with its orders in \
            IDEM_CONFORMANCE_* variables"]
async fn child_process() {
    conformance::worker::child_process::<Pg>().await;
}
