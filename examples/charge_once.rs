//! Lease mode: charging a card through a payments API, once per job, on SQLite with no server.
//!
//! The charge cannot share a transaction with the marker, so the handler claims the job's key
//! for a lease, calls the API with the key as its `Idempotency-Key` and the lease's remaining
//! time as the request's timeout, and records the job as done afterwards. The story:
//!
//! 1. a charge job is delivered twice: the API charges once, the second delivery is a
//!    duplicate and sends nothing;
//! 2. the API records a second charge but stalls before answering: the handler times out, the
//!    key is released, the worker nacks;
//! 3. the redelivery sends the same `Idempotency-Key`: the API answers with the charge it
//!    already made, and nothing is charged twice.
//!
//! ```text
//! cargo run --example charge_once
//! ```

use std::io::Write;
use std::path::Path;

use idem::{Outcome, Store};
// The job and its handler live in the examples' library, where the test kit's tests use them
// too (`examples/src/charge.rs`).
pub use idem_examples::charge::{Api, Charge, ChargeError, charge_once};
use idem_examples::payments::{PaymentsApi, Receipt, Totals};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

/// What one delivery did, as the story prints it.
#[derive(Debug, PartialEq, Eq)]
pub enum Delivery {
    Applied(Receipt),
    Duplicate,
    TimedOut,
}

/// Runs the story against a SQLite file at `path`; returns each delivery's outcome and what
/// the API charged.
pub async fn run(
    path: &Path,
    out: &mut impl Write,
) -> Result<(Vec<Delivery>, Totals), Box<dyn std::error::Error>> {
    let options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal);
    let pool = SqlitePoolOptions::new().connect_with(options).await?;
    let store = Store::new(pool.clone());
    store.migrate().await?;
    let api = Api {
        http: reqwest::Client::new(),
        payments: PaymentsApi::start().await?,
    };

    let first = Charge {
        id: "charge-1".into(),
        customer: "alice".into(),
        amount: 4200,
    };
    let second = Charge {
        id: "charge-2".into(),
        customer: "bob".into(),
        amount: 5700,
    };
    let mut deliveries = Vec::new();
    for (job, stall) in [
        (&first, false),
        (&first, false),
        (&second, true),
        (&second, false),
    ] {
        if stall {
            api.payments.stall_next_charge();
        }
        let outcome = charge_once(&store, job, &api).await;
        let delivery = match outcome {
            Ok(Outcome::Applied(receipt)) => {
                writeln!(
                    out,
                    "{} ({} to {}): applied, receipt {} for {}",
                    job.id, job.amount, job.customer, receipt.id, receipt.amount
                )?;
                Delivery::Applied(receipt)
            }
            Ok(Outcome::Duplicate | Outcome::Replayed(_)) => {
                writeln!(out, "{}: duplicate, nothing sent to the API", job.id)?;
                Delivery::Duplicate
            }
            Ok(Outcome::Failed(failure)) => return Err(failure.to_string().into()),
            // The call's own timeout is what the body had left (`lease.remaining()`), so it
            // gives up by the time idem would cut the body off; either way the key was
            // released and the redelivery sends the same idempotency key.
            Err(e @ ChargeError::Idem(idem::Error::Timeout { .. })) => {
                writeln!(out, "{}: {e}", job.id)?;
                // The API had charged before it stalled; let it answer its (gone) client.
                api.payments.release();
                Delivery::TimedOut
            }
            Err(ChargeError::Http(e)) if e.is_timeout() => {
                writeln!(out, "{}: the payments call timed out: {e}", job.id)?;
                api.payments.release();
                Delivery::TimedOut
            }
            Err(e) => return Err(e.to_string().into()),
        };
        deliveries.push(delivery);
    }
    let totals = api.payments.totals();
    writeln!(
        out,
        "the API charged {} times, {} in total ({} answer replayed for a repeated \
         Idempotency-Key)",
        totals.charges, totals.amount, totals.replayed
    )?;
    pool.close().await;
    Ok((deliveries, totals))
}

#[allow(dead_code)]
#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("idem-charge-once-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = run(&dir.join("jobs.db"), &mut std::io::stdout()).await;
    std::fs::remove_dir_all(&dir)?;
    result.map(|_| ())
}
