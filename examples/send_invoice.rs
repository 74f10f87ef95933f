//! "Send invoice" through NATS JetStream (async-nats), once, on SQLite in a temporary file.
//!
//! The button is double-clicked: the job is published twice with the same `Nats-Msg-Id`,
//! `idem::job_id("send-invoice", &order_id)`, and JetStream drops the second publish inside
//! its duplicate window (its publish ack says `duplicate`). A pull consumer with explicit acks
//! runs the `#[idempotent]` handler, which records the email in `outbox_emails` in the same
//! transaction as its marker (a mailer sends the outbox; that part is not shown). Then the
//! same job is published again once the window is over: JetStream accepts it this time, and
//! the handler's claim is what stops a second email (`Duplicate`). The loop is idem's
//! [`Runner`] on the consumer's [`Pull`] source, which settles each delivery as
//! [`idem::Settle::decide`] says:
//!
//! - `Applied`, `Duplicate`, `Replayed`: ack (confirmed by JetStream);
//! - `InProgress`, a database error, a rollback: nak with a growing delay;
//! - `KeyReused`, a payload that is not a job, the 10th failed delivery: a copy to the
//!   dead-letter subject, then term: no redelivery can succeed.
//!
//! ```text
//! cargo run --example send_invoice
//! ```
//! It needs NATS with JetStream at `IDEM_NATS_URL`, else `nats://127.0.0.1:4222`.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use std::sync::{Arc, Mutex};

use async_nats::jetstream::{self, consumer, stream};
use idem::settle::Runner;
use idem::settle::nats::{NatsError, Pull};
use idem::{Disposition, Store};
use serde::{Deserialize, Serialize};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{Sqlite, SqlitePool, Transaction};
use tokio::sync::Notify;

/// The server of the example and the tests, unless `IDEM_NATS_URL` says otherwise.
pub const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";

/// `IDEM_NATS_URL`, else [`DEFAULT_NATS_URL`].
pub fn nats_url() -> String {
    std::env::var("IDEM_NATS_URL").unwrap_or_else(|_| DEFAULT_NATS_URL.to_owned())
}

/// Connects to NATS; the error names the URL and the variable that overrides it.
pub async fn connect(url: &str) -> Result<jetstream::Context, String> {
    let client = async_nats::connect(url)
        .await
        .map_err(|e| format!("cannot reach NATS at {url} (set IDEM_NATS_URL): {e}"))?;
    Ok(jetstream::new(client))
}

/// The job the button publishes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SendInvoice {
    pub order_id: String,
    pub email: String,
    pub amount: i64,
}

impl SendInvoice {
    /// The `Nats-Msg-Id` of this job: derived from its order, the same on every click.
    pub fn msg_id(&self) -> idem::JobId {
        idem::job_id("send-invoice", &self.order_id).expect("an order id is never empty")
    }
}

/// Queues the invoice email: one outbox row, committed with the marker.
#[idem::idempotent(key = "job.order_id", scope = "billing.send_invoice", wait = "5s")]
pub async fn send_invoice(tx: &mut Transaction<'_, Sqlite>, job: &SendInvoice) -> sqlx::Result<()> {
    sqlx::query("INSERT INTO outbox_emails (order_id, recipient, amount) VALUES (?1, ?2, ?3)")
        .bind(&job.order_id)
        .bind(&job.email)
        .bind(job.amount)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Opens (creating) the SQLite file at `path` with the marker and outbox tables.
pub async fn open_db(path: &Path) -> Result<SqlitePool, idem::Error> {
    let options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        // The tests' worker process and the test itself write the same file.
        .busy_timeout(Duration::from_secs(30));
    let pool = SqlitePoolOptions::new()
        .connect_with(options)
        .await
        .map_err(idem::Error::Database)?;
    Store::new(pool.clone()).migrate().await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS outbox_emails (id INTEGER PRIMARY KEY, \
         order_id TEXT NOT NULL, recipient TEXT NOT NULL, amount INTEGER NOT NULL)",
    )
    .execute(&pool)
    .await
    .map_err(idem::Error::Database)?;
    Ok(pool)
}

/// Emails in the outbox for `order_id`.
pub async fn emails(pool: &SqlitePool, order_id: &str) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM outbox_emails WHERE order_id = ?1")
        .bind(order_id)
        .fetch_one(pool)
        .await
}

/// A stream of its own for `subject` and its dead letters' subject ([`dead_letters`]),
/// deduplicating publishes within `window`.
pub async fn create_stream(
    js: &jetstream::Context,
    name: &str,
    subject: &str,
    window: Duration,
) -> Result<stream::Stream, async_nats::Error> {
    Ok(js
        .create_stream(stream::Config {
            name: name.to_owned(),
            subjects: vec![subject.to_owned(), dead_letters(subject)],
            duplicate_window: window,
            ..Default::default()
        })
        .await?)
}

/// The subject of `subject`'s dead letters.
pub fn dead_letters(subject: &str) -> String {
    format!("{subject}.dead")
}

/// A durable pull consumer of `subject` with explicit acks; an unacked message is redelivered
/// after `ack_wait`.
pub async fn create_consumer(
    stream: &stream::Stream,
    subject: &str,
    name: &str,
    ack_wait: Duration,
) -> Result<consumer::PullConsumer, async_nats::Error> {
    Ok(stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some(name.to_owned()),
            filter_subject: subject.to_owned(),
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait,
            // Past this many deliveries JetStream stops redelivering: above the runner's cap
            // (10), so that the cap dead-letters the last one; the markers must be kept at
            // least as long as these attempts can take (see docs/brokers.md).
            max_deliver: 11,
            ..Default::default()
        })
        .await?)
}

/// Publishes `job` with its `Nats-Msg-Id`; returns whether JetStream called it a duplicate
/// (dropped) and the stream sequence it has.
pub async fn publish(
    js: &jetstream::Context,
    subject: &str,
    job: &SendInvoice,
) -> Result<(bool, u64), async_nats::Error> {
    let payload = serde_json::to_vec(job)?;
    let ack = js
        .send_publish(
            subject.to_owned(),
            jetstream::message::PublishMessage::build()
                .payload(payload.into())
                .message_id(job.msg_id()),
        )
        .await?
        .await?;
    Ok((ack.duplicate, ack.sequence))
}

/// One settled delivery: which delivery of its message it was (JetStream's count), what the
/// handler answered, and how it was settled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handled {
    pub delivered: u32,
    pub outcome: &'static str,
    pub disposition: Disposition,
}

/// The consumer loop, until `n` deliveries are settled.
pub async fn handle(
    consumer: &consumer::PullConsumer,
    js: &jetstream::Context,
    subject: &str,
    store: &Store<Sqlite>,
    n: usize,
) -> Result<Vec<Handled>, NatsError> {
    let handled = Arc::new(Mutex::new(Vec::new()));
    let enough = Arc::new(Notify::new());
    let (seen, done) = (handled.clone(), enough.clone());
    let deliveries = Pull::consume(consumer, js, 16, dead_letters(subject)).await?;
    Runner::new()
        .in_flight(16)
        .on_settled(move |s| {
            let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
            seen.push(Handled {
                delivered: s.delivery,
                outcome: s.outcome,
                disposition: s.disposition.clone(),
            });
            if seen.len() == n {
                done.notify_one();
            }
        })
        .run(
            deliveries,
            |job: SendInvoice| async move { send_invoice(store, &job).await },
            enough.notified(),
        )
        .await?;
    Ok(std::mem::take(
        &mut *handled.lock().unwrap_or_else(|e| e.into_inner()),
    ))
}

/// Publishes `job` until JetStream no longer calls it a duplicate, i.e. its duplicate window
/// has passed; returns how many publishes were dropped first. Each try is a real publish that
/// JetStream drops while the window lasts, spaced by `every`, at most `tries` of them.
pub async fn publish_after_window(
    js: &jetstream::Context,
    subject: &str,
    job: &SendInvoice,
    every: Duration,
    tries: u32,
) -> Result<u32, async_nats::Error> {
    for dropped in 0..tries {
        if !publish(js, subject, job).await?.0 {
            return Ok(dropped);
        }
        tokio::time::sleep(every).await;
    }
    Err(format!("JetStream still called the publish a duplicate after {tries} tries").into())
}

/// What [`run`] saw.
#[derive(Debug)]
pub struct Report {
    /// `duplicate` of the two clicks' publish acks.
    pub clicks: [bool; 2],
    /// Messages in the stream after the clicks, and after the late publish.
    pub messages: [u64; 2],
    pub handled: Vec<Handled>,
    pub emails: i64,
}

/// The story, on a stream of its own (a 1 s duplicate window) and the SQLite file at `db`.
pub async fn run(nats: &str, db: &Path, out: &mut impl Write) -> Result<Report, async_nats::Error> {
    let pool = open_db(db).await?;
    let store = Store::new(pool.clone());
    let js = connect(nats).await?;
    let name = format!("idem-example-invoices-{}", std::process::id());
    let subject = format!("invoices.example.{}", std::process::id());
    let mut stream = create_stream(&js, &name, &subject, Duration::from_secs(1)).await?;
    let result = async {
        let consumer =
            create_consumer(&stream, &subject, "mailer", Duration::from_secs(30)).await?;
        let job = SendInvoice {
            order_id: "order-42".into(),
            email: "alice@example.com".into(),
            amount: 4200,
        };
        writeln!(out, "Nats-Msg-Id: {}", job.msg_id())?;
        let first = publish(&js, &subject, &job).await?;
        let second = publish(&js, &subject, &job).await?;
        writeln!(
            out,
            "double click: publish 1 duplicate={}, publish 2 duplicate={}",
            first.0, second.0
        )?;
        let after_clicks = stream.info().await?.state.messages;
        let mut handled = handle(&consumer, &js, &subject, &store, 1).await?;

        let dropped =
            publish_after_window(&js, &subject, &job, Duration::from_millis(100), 100).await?;
        let after_late = stream.info().await?.state.messages;
        writeln!(
            out,
            "after the window ({dropped} more publishes dropped first): the stream took the \
             job again, {after_late} messages"
        )?;
        handled.extend(handle(&consumer, &js, &subject, &store, 1).await?);
        for h in &handled {
            writeln!(
                out,
                "delivery {} for {}: {}, {:?}",
                h.delivered, job.order_id, h.outcome, h.disposition
            )?;
        }
        let emails = emails(&pool, &job.order_id).await?;
        writeln!(out, "emails in the outbox for {}: {emails}", job.order_id)?;
        Ok::<_, async_nats::Error>(Report {
            clicks: [first.0, second.0],
            messages: [after_clicks, after_late],
            handled,
            emails,
        })
    }
    .await;
    js.delete_stream(&name).await?;
    pool.close().await;
    result
}

#[allow(dead_code)]
#[tokio::main]
async fn main() -> Result<(), async_nats::Error> {
    let dir = std::env::temp_dir().join(format!("idem-send-invoice-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = run(&nats_url(), &dir.join("jobs.db"), &mut std::io::stdout()).await;
    std::fs::remove_dir_all(&dir)?;
    result.map(|_| ())
}
