//! The conformance suite on SQLite: a new database file per test in the temporary directory,
//! in WAL mode with a busy timeout (several connections and processes share it).

mod conformance;

use std::str::FromStr as _;
use std::time::Duration;

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{Sqlite, SqliteConnection};

struct Lite;

impl conformance::Support for Lite {
    type Db = Sqlite;
    const KEY_TEXT: &'static str = "key";
    const BIGINT: &'static str = "INTEGER";
    const TWO_HOURS_AGO: &'static str = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-7200 seconds')";
    // Writers queue in the busy handler of `BEGIN IMMEDIATE`, which no other connection sees.
    const LOCK_WAITERS: Option<&'static str> = None;
    const STATEMENT_AFTER_ROLLBACK_KEPT: bool = true;
    const SCHEMA_V2: &'static str = include_str!("conformance/schema_v2/sqlite.sql");
    const UPGRADE_V2_TO_V3: &'static str = include_str!("../schema/sqlite.v2-to-v3.sql");
    const UPGRADE_V3_TO_V4: &'static str = include_str!("../schema/sqlite.v3-to-v4.sql");
    const UPGRADE_V4_TO_V5: &'static str = include_str!("../schema/sqlite.v4-to-v5.sql");
    const DROP_FAILED_INDEX: Option<&'static str> = Some("DROP INDEX {table}_failed");
    const UPGRADE_V5_TO_V6: &'static str = include_str!("../schema/sqlite.v5-to-v6.sql");
    const COLUMNS_OF: &'static str = "SELECT name || ' ' || type || ' ' || \"notnull\" || ' ' \
         || pk || ' ' || coalesce(dflt_value, '') FROM pragma_table_info('{table}')";
    const INDEXES_OF: &'static str = "SELECT sql FROM sqlite_master WHERE type = 'index' AND tbl_name = '{table}' \
         AND sql IS NOT NULL";
    const LOCK_WAIT_MS: &'static str = "PRAGMA busy_timeout";

    async fn swallow_a_rollback(conn: &mut SqliteConnection, _: &SqlitePool, rows: &str) {
        // Id 1 exists: the conflict resolution `ROLLBACK` ends the whole transaction, and the
        // connection is back in autocommit.
        let sql = format!("INSERT OR ROLLBACK INTO {rows} (id, v) VALUES (1, 0)");
        let err = sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(conn)
            .await
            .expect_err("a primary-key conflict");
        let kind = err.as_database_error().map(|e| e.kind());
        assert_eq!(kind, Some(sqlx::error::ErrorKind::UniqueViolation), "{err}");
    }

    fn url() -> String {
        let file =
            std::env::temp_dir().join(format!("{}.db", conformance::unique_name("idem", "sqlite")));
        format!("sqlite://{}", file.display())
    }

    async fn connect(url: &str, max: u32) -> SqlitePool {
        // Writers wait for each other (BEGIN IMMEDIATE) up to this long.
        open(url, max, options(url).busy_timeout(Duration::from_secs(60))).await
    }

    async fn connect_default_wait(url: &str, max: u32) -> SqlitePool {
        open(url, max, options(url)).await
    }

    fn remove(url: &str) {
        let path = url.trim_start_matches("sqlite://");
        for suffix in ["", "-wal", "-shm"] {
            drop(std::fs::remove_file(format!("{path}{suffix}")));
        }
    }
}

fn options(url: &str) -> SqliteConnectOptions {
    SqliteConnectOptions::from_str(url)
        .unwrap_or_else(|e| panic!("bad SQLite URL {url}: {e}"))
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Normal)
}

async fn open(url: &str, max: u32, opts: SqliteConnectOptions) -> SqlitePool {
    SqlitePoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(60))
        .connect_with(opts)
        .await
        .unwrap_or_else(|e| panic!("cannot open the SQLite database {url}: {e}"))
}

conformance::every_backend_tests!(Lite);

/// The worker process of the multi-process cases (this binary, started again by them).
#[tokio::test(flavor = "multi_thread")]
#[ignore = "a worker process: started by four_processes_apply_every_job_exactly_once and \
            worker_killed_inside_the_body_keeps_nothing, with its orders in \
            IDEM_CONFORMANCE_* variables"]
async fn child_process() {
    conformance::worker::child_process::<Lite>().await;
}
