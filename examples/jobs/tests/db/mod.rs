//! A PostgreSQL database of its own per test: the job frameworks keep their tables in fixed
//! schemas (`apalis`) or in one schema per deployment, so each test runs their migrations on a
//! fresh database, dropped at the end (also when the test fails).

#![allow(dead_code)]

use std::str::FromStr as _;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};

use crate::support::postgres_url;

/// The variable that gives a worker process its test's database.
pub const CHILD_DB: &str = "IDEM_JOBS_DB";

/// Connects to database `name` on the server of `IDEM_POSTGRES_URL`; panics naming the URL.
pub async fn pool(name: &str, max: u32) -> PgPool {
    let url = postgres_url();
    let options = PgConnectOptions::from_str(&url)
        .unwrap_or_else(|e| panic!("IDEM_POSTGRES_URL={url} is not a PostgreSQL URL: {e}"))
        .database(name);
    PgPoolOptions::new()
        // Workers of these tests run one job at a time; the frameworks' heartbeats need one
        // connection besides.
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(options)
        .await
        .unwrap_or_else(|e| {
            panic!("cannot reach PostgreSQL at {url}, database {name} (set IDEM_POSTGRES_URL): {e}")
        })
}

/// `IDEM_POSTGRES_URL` with its database replaced by `name`.
pub fn url_of(name: &str) -> String {
    let url = postgres_url();
    let authority = url.find("://").map_or(0, |i| i + 3);
    let path = url[authority..]
        .find('/')
        .map_or(url.len(), |i| authority + i);
    let query = url[path..].find('?').map_or(url.len(), |i| path + i);
    format!("{}/{name}{}", &url[..path], &url[query..])
}

/// A database named after the test and this process.
pub struct TestDb {
    pub name: String,
}

impl TestDb {
    pub async fn create(test: &str) -> TestDb {
        let name = format!("idem_jobs_{test}_{}", std::process::id());
        let admin = crate::support::postgres(1).await;
        for sql in [
            format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
            format!("CREATE DATABASE {name}"),
        ] {
            sqlx::query(AssertSqlSafe(sql))
                .execute(&admin)
                .await
                .unwrap();
        }
        admin.close().await;
        TestDb { name }
    }

    pub async fn pool(&self, max: u32) -> PgPool {
        pool(&self.name, max).await
    }

    pub fn url(&self) -> String {
        url_of(&self.name)
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let name = std::mem::take(&mut self.name);
        // Drop cannot await; a runtime of its own on another thread can, also while the test
        // unwinds from a failed assertion. `FORCE` ends the sessions of workers still running.
        let done = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                let admin = crate::support::postgres(1).await;
                let sql = format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)");
                drop(sqlx::query(AssertSqlSafe(sql)).execute(&admin).await);
                admin.close().await;
            });
        });
        drop(done.join());
    }
}

/// (rows in the effect table `table`, idem markers of `scope`).
pub async fn counts(pool: &PgPool, table: &str, scope: &str) -> (i64, i64) {
    sqlx::query_as(AssertSqlSafe(format!(
        "SELECT (SELECT count(*) FROM {table}), \
         (SELECT count(*) FROM idem_processed WHERE scope = $1)"
    )))
    .bind(scope)
    .fetch_one(pool)
    .await
    .unwrap()
}
