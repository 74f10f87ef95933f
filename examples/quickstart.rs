//! idem in one file, on SQLite: no server, no configuration.
//!
//! A top-up job is delivered twice (the broker redelivers it): it applies once. Then a worker
//! fails after doing the work but before committing: nothing is kept, and the redelivery
//! applies the job exactly once.
//!
//! ```text
//! cargo run --example quickstart
//! ```

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use idem::{Outcome, Store};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{Sqlite, SqlitePool, Transaction};

/// A job as a broker would hand it over: its id is stable across redeliveries.
pub struct TopUp {
    pub id: &'static str,
    pub account: &'static str,
    pub credits: i64,
}

/// The handler's own error type: idem only asks that it can hold an `idem::Error`.
#[derive(Debug)]
pub enum JobError {
    Database(sqlx::Error),
    Idem(idem::Error),
    WorkerDied,
}

impl From<sqlx::Error> for JobError {
    fn from(e: sqlx::Error) -> Self {
        JobError::Database(e)
    }
}

impl From<idem::Error> for JobError {
    fn from(e: idem::Error) -> Self {
        JobError::Idem(e)
    }
}

impl std::fmt::Display for JobError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JobError::Database(e) => write!(f, "{e}"),
            JobError::Idem(e) => write!(f, "{e}"),
            JobError::WorkerDied => f.write_str("the worker died before committing"),
        }
    }
}

/// Adds credits. The marker and the `UPDATE` commit in one transaction.
///
/// `crash_after_effect` stands in for a worker that dies between the work and the commit.
#[idem::idempotent(key = "job.id", scope = "billing.top_up")]
pub async fn apply_top_up(
    tx: &mut Transaction<'_, Sqlite>,
    job: &TopUp,
    crash_after_effect: bool,
) -> Result<(), JobError> {
    sqlx::query("UPDATE accounts SET credits = credits + ?1 WHERE name = ?2")
        .bind(job.credits)
        .bind(job.account)
        .execute(&mut **tx)
        .await?;
    if crash_after_effect {
        return Err(JobError::WorkerDied);
    }
    Ok(())
}

/// Runs the story against the database at `path`, writing it to `out`; returns what each
/// delivery did and the final balances.
pub async fn run(
    path: &Path,
    out: &mut impl Write,
) -> Result<(Vec<String>, Vec<(String, i64)>), Box<dyn std::error::Error>> {
    let options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        // A second writer waits this long for the write lock that `BEGIN IMMEDIATE` takes.
        .busy_timeout(Duration::from_secs(30));
    let pool: SqlitePool = SqlitePoolOptions::new().connect_with(options).await?;
    sqlx::query("CREATE TABLE accounts (name TEXT PRIMARY KEY, credits INTEGER NOT NULL)")
        .execute(&pool)
        .await?;
    sqlx::query("INSERT INTO accounts VALUES ('alice', 100), ('bob', 100)")
        .execute(&pool)
        .await?;
    let store = Store::new(pool.clone());
    store.migrate().await?;

    let first = TopUp {
        id: "top-up-1",
        account: "alice",
        credits: 50,
    };
    let second = TopUp {
        id: "top-up-2",
        account: "bob",
        credits: 25,
    };
    let deliveries = [
        (&first, false),
        (&first, false),
        (&second, true),
        (&second, false),
    ];

    let mut outcomes = Vec::new();
    for (n, (job, crash)) in deliveries.into_iter().enumerate() {
        let what = match apply_top_up(&store, job, crash).await {
            Ok(Outcome::Applied(())) => "applied".to_owned(),
            // `Replayed` only comes with `replay`; a duplicate either way.
            Ok(Outcome::Duplicate | Outcome::Replayed(())) => "duplicate, skipped".to_owned(),
            Err(e) => format!("failed ({e}), rolled back"),
        };
        let credits: i64 = sqlx::query_scalar("SELECT credits FROM accounts WHERE name = ?1")
            .bind(job.account)
            .fetch_one(&pool)
            .await?;
        writeln!(
            out,
            "delivery {} of {} (+{} to {}): {what}; {} has {credits}",
            n + 1,
            job.id,
            job.credits,
            job.account,
            job.account
        )?;
        outcomes.push(what);
    }

    let balances: Vec<(String, i64)> =
        sqlx::query_as("SELECT name, credits FROM accounts ORDER BY name")
            .fetch_all(&pool)
            .await?;
    let shown: Vec<String> = balances.iter().map(|(n, c)| format!("{n} {c}")).collect();
    writeln!(out, "balances: {}", shown.join(", "))?;
    pool.close().await;
    Ok((outcomes, balances))
}

#[allow(dead_code)]
#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("idem-quickstart-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("jobs.db");
    println!("idem quickstart on SQLite at {}", path.display());
    let result = run(&path, &mut std::io::stdout()).await;
    std::fs::remove_dir_all(&dir)?;
    result.map(|_| ())
}
