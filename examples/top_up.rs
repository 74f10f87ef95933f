//! The classic top-up on PostgreSQL: one job delivered three times, applied once.
//!
//! ```text
//! cargo run --example top_up
//! ```
//! The database is `DATABASE_URL` if set, else `IDEM_POSTGRES_URL` (the variable the tests
//! read), else the local server `postgres://postgres@127.0.0.1:5432/test`.

use std::io::Write;

use idem::{Outcome, Store};
// The job and its handler live in the examples' library, where the test kit's tests use them
// too (`examples/src/top_up.rs`).
pub use idem_examples::top_up::database_url;
use idem_examples::top_up::{TopUp, apply_top_up};
use sqlx::Postgres;

/// Opens a fresh account, delivers one top-up of 50 credits three times and returns the
/// balance after each delivery.
pub async fn run(url: &str, out: &mut impl Write) -> Result<Vec<i64>, Box<dyn std::error::Error>> {
    // The pool a worker wants (see `Store`'s docs): no ping before each job, and a spare
    // connection. This example runs one job at a time.
    let pool = Store::<Postgres>::pool_options(1)
        .connect(url)
        .await
        .map_err(|e| {
            format!("cannot reach PostgreSQL at {url} (set DATABASE_URL or IDEM_POSTGRES_URL): {e}")
        })?;
    let store = Store::new(pool.clone());
    store.migrate().await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS accounts (id bigserial PRIMARY KEY, credits bigint NOT NULL)",
    )
    .execute(&pool)
    .await?;
    let account_id: i64 =
        sqlx::query_scalar("INSERT INTO accounts (credits) VALUES (100) RETURNING id")
            .fetch_one(&pool)
            .await?;
    // A job id as a producer would assign it: unique per job, stable across deliveries.
    let job = TopUp {
        id: format!("top-up-for-account-{account_id}"),
        account_id,
        credits: 50,
    };
    writeln!(out, "account {account_id} starts with 100 credits")?;

    let mut balances = Vec::new();
    for delivery in 1..=3 {
        let outcome = match apply_top_up(&store, &job).await? {
            Outcome::Applied(()) => "applied",
            Outcome::Duplicate | Outcome::Replayed(()) | Outcome::Failed(_) => {
                "duplicate, nothing ran"
            }
        };
        let credits: i64 = sqlx::query_scalar("SELECT credits FROM accounts WHERE id = $1")
            .bind(account_id)
            .fetch_one(&pool)
            .await?;
        writeln!(
            out,
            "delivery {delivery} of {}: {outcome}; balance {credits}",
            job.id
        )?;
        balances.push(credits);
    }
    pool.close().await;
    Ok(balances)
}

#[allow(dead_code)]
#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = database_url();
    run(&url, &mut std::io::stdout()).await.map(|_| ())
}
