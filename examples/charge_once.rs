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
use idem_examples::payments::{ChargeRequest, PaymentsApi, Receipt, Totals};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

/// A charge job as the broker hands it over.
pub struct Charge {
    pub id: String,
    pub customer: String,
    pub amount: i64,
}

/// The worker's error: a failed HTTP call, or idem's (timeout, lease lost, in progress).
#[derive(Debug)]
pub enum ChargeError {
    Http(reqwest::Error),
    Idem(idem::Error),
}

impl From<reqwest::Error> for ChargeError {
    fn from(e: reqwest::Error) -> Self {
        ChargeError::Http(e)
    }
}

impl From<idem::Error> for ChargeError {
    fn from(e: idem::Error) -> Self {
        ChargeError::Idem(e)
    }
}

impl std::fmt::Display for ChargeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChargeError::Http(e) => write!(f, "the payments API failed: {e}"),
            ChargeError::Idem(e) => write!(f, "{e}"),
        }
    }
}

/// The outside system and how to reach it.
pub struct Api {
    pub http: reqwest::Client,
    pub payments: PaymentsApi,
}

/// Charges the job's customer once, however often the job is delivered.
///
/// The body has 5 s (`timeout`) and the lease 30 s: a delivery that finds the key held by a
/// live lease gets `InProgress`, and only a lease that ran out can be taken over.
#[idem::idempotent(
    key = "job.id",
    scope = "billing.charge",
    lease = "30s",
    timeout = "5s"
)]
pub async fn charge_once(
    lease: &idem::Lease,
    job: &Charge,
    api: &Api,
) -> Result<Receipt, ChargeError> {
    let request = ChargeRequest {
        customer: job.customer.clone(),
        amount: job.amount,
    };
    let receipt = api
        .http
        .post(api.payments.charges_url())
        .header("Idempotency-Key", lease.idempotency_key())
        .timeout(lease.remaining())
        .json(&request)
        .send()
        .await?
        .error_for_status()?
        .json::<Receipt>()
        .await?;
    Ok(receipt)
}

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
            Err(ChargeError::Idem(e @ idem::Error::Timeout { .. })) => {
                writeln!(out, "{}: {e}", job.id)?;
                // The API had charged before it stalled; let it answer its (gone) client.
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
