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
//! Then the same worker checks orders out: charge -> receipt mail -> ledger row, three steps of
//! one lease-mode job (`examples/src/checkout.rs`), each recorded as it returns, so that a
//! redelivery after a crash resumes after the last recorded step:
//!
//! 4. an order is checked out, and delivered again: the second delivery replays the first
//!    one's result and sends nothing;
//! 5. an order whose card the API declines fails for good: the job is acked, and its
//!    redelivery is answered from the marker without calling anyone.
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
pub use idem_examples::checkout::{Done, LEDGER_DDL, Order, Shop, checkout};
pub use idem_examples::mail::MailSink;
use idem_examples::payments::{DECLINED, PaymentsApi, Receipt, Totals};
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
            Err(e @ ChargeError::Idem(idem::Error::Lease(idem::LeaseError::Timeout { .. }))) => {
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

/// What the checkout part of the story saw: each delivery's outcome, and what each outside
/// system did.
#[derive(Debug)]
pub struct Checkouts {
    pub outcomes: Vec<Outcome<Done>>,
    pub charges: u64,
    pub mails: usize,
    pub ledger_rows: i64,
}

/// The checkout part of the story, on the same SQLite file as [`run`].
pub async fn run_checkouts(
    path: &Path,
    out: &mut impl Write,
) -> Result<Checkouts, Box<dyn std::error::Error>> {
    let options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal);
    let pool = SqlitePoolOptions::new().connect_with(options).await?;
    let store = Store::new(pool.clone());
    store.migrate().await?;
    sqlx::query(LEDGER_DDL).execute(&pool).await?;
    let (payments, mail) = (PaymentsApi::start().await?, MailSink::start().await?);
    let shop = Shop {
        http: reqwest::Client::new(),
        payments_url: payments.url(),
        mail_url: mail.url(),
        stop_at: None,
    };
    let alice = Order {
        id: "order-1".into(),
        customer: "alice".into(),
        email: "alice@example.com".into(),
        amount: 4200,
    };
    let mallory = Order {
        id: "order-2".into(),
        customer: DECLINED.into(),
        email: "mallory@example.com".into(),
        amount: 9900,
    };
    let mut outcomes = Vec::new();
    for order in [&alice, &alice, &mallory, &mallory] {
        let outcome = checkout(&store, order, &shop).await?;
        match &outcome {
            Outcome::Applied(done) => writeln!(
                out,
                "{}: checked out: charge {}, receipt mail {}, ledger row {}",
                order.id, done.receipt.id, done.mail, done.ledger_row
            )?,
            Outcome::Replayed(done) => writeln!(
                out,
                "{}: delivered again: the first delivery's result replayed (charge {}), \
                 nothing sent",
                order.id, done.receipt.id
            )?,
            Outcome::Duplicate => writeln!(out, "{}: duplicate", order.id)?,
            // Failed for good: ack the job, it is never retried.
            Outcome::Failed(failure) => writeln!(out, "{}: {failure}; acked", order.id)?,
        }
        outcomes.push(outcome);
    }
    let ledger_rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM ledger")
        .fetch_one(&pool)
        .await?;
    let checkouts = Checkouts {
        outcomes,
        charges: payments.totals().charges,
        mails: mail.sent().len(),
        ledger_rows,
    };
    writeln!(
        out,
        "the API charged {} time(s), the mail sink sent {} mail(s), the ledger has {} row(s)",
        checkouts.charges, checkouts.mails, checkouts.ledger_rows
    )?;
    pool.close().await;
    Ok(checkouts)
}

#[allow(dead_code)]
#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("idem-charge-once-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let db = dir.join("jobs.db");
    let mut stdout = std::io::stdout();
    let result = match run(&db, &mut stdout).await {
        Ok(_) => run_checkouts(&db, &mut stdout).await.map(|_| ()),
        Err(e) => Err(e),
    };
    std::fs::remove_dir_all(&dir)?;
    result
}
