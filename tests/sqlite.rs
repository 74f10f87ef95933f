//! The conformance suite on SQLite: a new database file per test in the temporary directory,
//! in WAL mode with a busy timeout (several connections and processes share it).

mod conformance;

use std::str::FromStr as _;
use std::time::Duration;

use sqlx::Sqlite;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

struct Lite;

impl conformance::Support for Lite {
    type Db = Sqlite;
    const KEY_TEXT: &'static str = "key";
    const BIGINT: &'static str = "INTEGER";
    const TWO_HOURS_AGO: &'static str = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-7200 seconds')";

    fn url() -> String {
        let file =
            std::env::temp_dir().join(format!("{}.db", conformance::unique_name("idem", "sqlite")));
        format!("sqlite://{}", file.display())
    }

    async fn connect(url: &str, max: u32) -> SqlitePool {
        let opts = SqliteConnectOptions::from_str(url)
            .unwrap_or_else(|e| panic!("bad SQLite URL {url}: {e}"))
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            // Writers wait for each other (BEGIN IMMEDIATE) up to this long.
            .busy_timeout(Duration::from_secs(60));
        SqlitePoolOptions::new()
            .max_connections(max)
            .acquire_timeout(Duration::from_secs(60))
            .connect_with(opts)
            .await
            .unwrap_or_else(|e| panic!("cannot open the SQLite database {url}: {e}"))
    }

    fn remove(url: &str) {
        let path = url.trim_start_matches("sqlite://");
        for suffix in ["", "-wal", "-shm"] {
            drop(std::fs::remove_file(format!("{path}{suffix}")));
        }
    }
}

conformance::suite!(Lite);
