//! idem on SQLite: no server, no configuration.
//!
//! A top-up job is delivered twice (the broker redelivers it): it applies once. Then a worker
//! fails after doing the work but before committing: nothing is kept, and the redelivery
//! applies the job exactly once.
//!
//! ```text
//! cargo run -p idem-quickstart --example quickstart
//! ```

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use idem::{Outcome, Store};
// The job and its handler live in this package's library, where the test kit's tests use them
// too (`examples/quickstart/src/lib.rs`).
use idem_quickstart::{TopUp, apply_top_up};
use sqlx::SqlitePool;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

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
            // `Replayed` only comes with `replay`, `Failed` only from a lease-mode handler
            // of the same scope that gave up for good; handled before, either way.
            Ok(Outcome::Duplicate | Outcome::Replayed(()) | Outcome::Failed(_)) => {
                "duplicate, skipped".to_owned()
            }
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

// The runtime is built by hand rather than with `#[tokio::main]`, which would compile tokio's
// macro crate into this first build for one line.
#[allow(dead_code)]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("idem-quickstart-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("jobs.db");
    println!("idem quickstart on SQLite at {}", path.display());
    let runtime = tokio::runtime::Runtime::new()?;
    let result = runtime.block_on(run(&path, &mut std::io::stdout()));
    std::fs::remove_dir_all(&dir)?;
    result.map(|_| ())
}
