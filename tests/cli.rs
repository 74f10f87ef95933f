//! The `idem` binary against real databases: markers are made through the runtime, then read,
//! listed, forgotten and purged through the command line, and every change is checked in the
//! database. Each case runs on SQLite (a new file), PostgreSQL and MariaDB, each in a table
//! of its own, so cases run in parallel.

mod cli_support;

use std::future::Future;
use std::str::FromStr as _;

use sqlx::mysql::MySqlPoolOptions;
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
use sqlx::{MySql, Pool, Postgres, Sqlite};

/// What the cases need to know about one database.
pub(crate) trait Db: 'static {
    type D: idem::Backend;
    /// A URL for one case: the server's, or a new SQLite file.
    fn url() -> String;
    /// A URL of this scheme where no database can be reached, with a password to hide.
    fn unreachable_url() -> String;
    fn pool(url: &str) -> impl Future<Output = Pool<Self::D>>;
    fn exec(pool: &Pool<Self::D>, sql: &str) -> impl Future<Output = ()>;
    fn count(pool: &Pool<Self::D>, sql: &str) -> impl Future<Output = i64>;
    /// The marker table's `key` column in SQL.
    const KEY: &'static str;
    /// The time two hours ago, in the marker table's format.
    const TWO_HOURS_AGO: &'static str;
    /// Runs a real handler for job `order` that sends `n` messages to `mail` with its
    /// effect; returns their ids.
    fn place(
        store: &idem::Store<Self::D>,
        order: &str,
        n: u32,
    ) -> impl Future<Output = Vec<String>>;
    /// Removes what [`url`](Db::url) made outside the database.
    fn remove(_url: &str) {}
}

macro_rules! statements {
    ($db:ty) => {
        async fn exec(pool: &Pool<$db>, sql: &str) {
            sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
                .execute(pool)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
        }

        async fn count(pool: &Pool<$db>, sql: &str) -> i64 {
            sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
                .fetch_one(pool)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"))
        }
    };
}

macro_rules! place {
    ($db:ty) => {
        async fn place(store: &idem::Store<$db>, order: &str, n: u32) -> Vec<String> {
            #[idem::idempotent(key = "order", scope = "orders.place")]
            async fn send(
                tx: &mut sqlx::Transaction<'_, $db>,
                order: &str,
                n: u32,
                outbox: &mut idem::Outbox,
            ) -> Result<Vec<String>, idem::Error> {
                sqlx::query("SELECT 1").execute(&mut **tx).await?;
                let mut ids = Vec::new();
                for i in 0..n {
                    ids.push(outbox.send("mail", &format!("{order} #{i}"))?.to_owned());
                }
                Ok(ids)
            }
            match send(store, order, n).await {
                Ok(idem::Outcome::Applied(ids)) => ids,
                other => panic!("{order} was not applied: {other:?}"),
            }
        }
    };
}

fn server(var: &str, default: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| default.to_owned())
}

fn cannot_connect(url: &str, e: &dyn std::fmt::Display) -> ! {
    panic!("cannot connect to {url}: {e}. Start the server, or set its IDEM_*_URL variable")
}

pub(crate) struct Lite;

impl Db for Lite {
    type D = Sqlite;
    const KEY: &'static str = "key";
    const TWO_HOURS_AGO: &'static str = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-7200 seconds')";

    fn url() -> String {
        let file = std::env::temp_dir().join(format!("{}.db", cli_support::unique("idem_cli")));
        format!("sqlite:{}", file.display())
    }

    fn unreachable_url() -> String {
        // A directory that does not exist: SQLite cannot open (or create) the file.
        let dir = std::env::temp_dir().join(cli_support::unique("idem_cli_missing"));
        format!("sqlite:{}", dir.join("jobs.db").display())
    }

    async fn pool(url: &str) -> Pool<Sqlite> {
        let opts = SqliteConnectOptions::from_str(url)
            .unwrap_or_else(|e| cannot_connect(url, &e))
            .create_if_missing(true);
        SqlitePoolOptions::new()
            .max_connections(2)
            .connect_with(opts)
            .await
            .unwrap_or_else(|e| cannot_connect(url, &e))
    }

    statements!(Sqlite);
    place!(Sqlite);

    fn remove(url: &str) {
        let path = url.trim_start_matches("sqlite:");
        for suffix in ["", "-wal", "-shm"] {
            drop(std::fs::remove_file(format!("{path}{suffix}")));
        }
    }
}

pub(crate) struct Pg;

impl Db for Pg {
    type D = Postgres;
    const KEY: &'static str = "key";
    const TWO_HOURS_AGO: &'static str = "now() - interval '2 hours'";

    fn url() -> String {
        server(
            "IDEM_POSTGRES_URL",
            "postgres://postgres@127.0.0.1:5432/test",
        )
    }

    fn unreachable_url() -> String {
        // Port 1: nothing listens there, so the connection is refused at once.
        "postgres://postgres:hunter2@127.0.0.1:1/test".to_owned()
    }

    async fn pool(url: &str) -> Pool<Postgres> {
        PgPoolOptions::new()
            .max_connections(2)
            .connect(url)
            .await
            .unwrap_or_else(|e| cannot_connect(url, &e))
    }

    statements!(Postgres);
    place!(Postgres);
}

pub(crate) struct My;

impl Db for My {
    type D = MySql;
    const KEY: &'static str = "`key`";
    const TWO_HOURS_AGO: &'static str = "UTC_TIMESTAMP(6) - INTERVAL 2 HOUR";

    fn url() -> String {
        server("IDEM_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")
    }

    fn unreachable_url() -> String {
        "mariadb://root:hunter2@127.0.0.1:1/test".to_owned()
    }

    async fn pool(url: &str) -> Pool<MySql> {
        MySqlPoolOptions::new()
            .max_connections(2)
            .connect(url)
            .await
            .unwrap_or_else(|e| cannot_connect(url, &e))
    }

    statements!(MySql);
    place!(MySql);
}

macro_rules! every_backend {
    ($($case:ident),* $(,)?) => {
        mod sqlite {
            $(#[tokio::test] async fn $case() { crate::cli_support::$case::<crate::Lite>().await })*
        }
        mod postgres {
            $(#[tokio::test] async fn $case() { crate::cli_support::$case::<crate::Pg>().await })*
        }
        mod mysql {
            $(#[tokio::test] async fn $case() { crate::cli_support::$case::<crate::My>().await })*
        }
    };
}

every_backend!(
    inspect_prints_the_stored_marker,
    stuck_lists_leases_in_progress,
    forget_deletes_one_marker,
    forget_of_a_live_lease_exits_5_unless_forced,
    purge_deletes_what_completed_before_the_age,
    bad_input_exits_2_and_writes_nothing,
    unreachable_database_exits_1_naming_the_url,
    idem_table_names_the_table,
    outbox_lists_and_requeues_parked_messages,
    doctor_exits_0_healthy_6_warnings_7_problems,
    retention_windows_are_shared_by_the_code_and_the_tool,
    failed_jobs_are_listed_requeued_and_their_steps_shown,
    bulk_requeue_acts_on_one_group_behind_a_dry_run_and_a_confirmation,
    bulk_requeue_refuses_bad_input_before_connecting,
    outbox_requeue_all_acts_on_the_filter_behind_a_dry_run_and_a_confirmation,
    forget_stuck_forces_only_with_force_behind_a_dry_run_and_a_confirmation,
    bulk_outbox_and_forget_refuse_bad_input_before_connecting,
    console_requeues_a_failure_group_for_an_admin_only,
    console_requeues_a_parked_message_that_the_relay_then_sends,
    console_forgets_the_stuck_leases_no_delivery_holds,
);
