//! "Send invoice" through NATS JetStream (async-nats), once, on SQLite in a temporary file.
//!
//! The button is double-clicked: the job is published twice with the same `Nats-Msg-Id`,
//! `idem::job_id("send-invoice", &order_id)`, and JetStream drops the second publish inside
//! its duplicate window (its publish ack says `duplicate`). A pull consumer with explicit acks
//! runs the `#[idempotent]` handler, which records the email in `outbox_emails` in the same
//! transaction as its marker (a mailer sends the outbox; that part is not shown). Then the
//! same job is published again once the window is over: JetStream accepts it this time, and
//! the handler's claim is what stops a second email (`Duplicate`). Acks:
//!
//! - `Applied`, `Duplicate`, `Replayed`: ack (and wait for JetStream to confirm it);
//! - `InProgress`: nak with a delay, another delivery is still on it;
//! - `KeyReused` or a payload that is not a job: term, no redelivery can succeed;
//! - any other error (database, rollback): nak, redelivered at once.
//!
//! ```text
//! cargo run --example send_invoice
//! ```
//! It needs NATS with JetStream at `IDEM_NATS_URL`, else `nats://127.0.0.1:4222`.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind, consumer, stream};
use futures_util::StreamExt as _;
use idem::{Outcome, Store};
use serde::{Deserialize, Serialize};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{Sqlite, SqlitePool, Transaction};

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

/// The handler's error.
#[derive(Debug)]
pub enum JobError {
    Database(sqlx::Error),
    Idem(idem::Error),
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
        }
    }
}

/// Queues the invoice email: one outbox row, committed with the marker.
#[idem::idempotent(key = "job.order_id", scope = "billing.send_invoice", wait = "5s")]
pub async fn send_invoice(
    tx: &mut Transaction<'_, Sqlite>,
    job: &SendInvoice,
) -> Result<(), JobError> {
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

/// A stream of its own for `subject`, deduplicating publishes within `window`.
pub async fn create_stream(
    js: &jetstream::Context,
    name: &str,
    subject: &str,
    window: Duration,
) -> Result<stream::Stream, async_nats::Error> {
    Ok(js
        .create_stream(stream::Config {
            name: name.to_owned(),
            subjects: vec![subject.to_owned()],
            duplicate_window: window,
            ..Default::default()
        })
        .await?)
}

/// A durable pull consumer with explicit acks; an unacked message is redelivered after
/// `ack_wait`.
pub async fn create_consumer(
    stream: &stream::Stream,
    name: &str,
    ack_wait: Duration,
) -> Result<consumer::PullConsumer, async_nats::Error> {
    Ok(stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some(name.to_owned()),
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait,
            // Past this many deliveries JetStream stops redelivering: the markers must be kept
            // at least as long as these attempts can take (see docs/brokers.md).
            max_deliver: 10,
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

/// What the consumer did with one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handled {
    pub order_id: String,
    pub stream_sequence: u64,
    /// JetStream's delivery count: 1 for the first delivery, 2 for a redelivery.
    pub delivered: i64,
    pub what: What,
}

/// The handler's outcome and the ack it led to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum What {
    Applied,
    Duplicate,
    /// Nak'd or term'd, with the error.
    Refused {
        term: bool,
        error: String,
    },
}

/// The consumer loop, one batch: fetches up to `max` messages, waiting at most `expires` for
/// them, and handles each one. Bounded in both count and time.
pub async fn handle_batch(
    consumer: &consumer::PullConsumer,
    store: &Store<Sqlite>,
    max: usize,
    expires: Duration,
) -> Result<Vec<Handled>, async_nats::Error> {
    let mut batch = consumer
        .fetch()
        .max_messages(max)
        .expires(expires)
        .messages()
        .await?;
    let mut handled = Vec::new();
    while let Some(message) = batch.next().await {
        let message = message?;
        let (stream_sequence, delivered) = {
            let info = message.info()?;
            (info.stream_sequence, info.delivered)
        };
        let job: SendInvoice = match serde_json::from_slice(&message.payload) {
            Ok(job) => job,
            Err(e) => {
                message.ack_with(AckKind::Term).await?;
                handled.push(Handled {
                    order_id: String::new(),
                    stream_sequence,
                    delivered,
                    what: What::Refused {
                        term: true,
                        error: format!("not a send-invoice job: {e}"),
                    },
                });
                continue;
            }
        };
        let what = match send_invoice(store, &job).await {
            Ok(Outcome::Applied(())) => What::Applied,
            Ok(Outcome::Duplicate | Outcome::Replayed(()) | Outcome::Failed(_)) => What::Duplicate,
            Err(e) => {
                let (kind, term) = match &e {
                    // Another delivery still holds the key: come back once it is likely done.
                    JobError::Idem(idem::Error::InProgress { .. }) => {
                        (AckKind::Nak(Some(Duration::from_secs(1))), false)
                    }
                    JobError::Idem(idem::Error::KeyReused { .. }) => (AckKind::Term, true),
                    _ => (AckKind::Nak(None), false),
                };
                message.ack_with(kind).await?;
                What::Refused {
                    term,
                    error: e.to_string(),
                }
            }
        };
        if matches!(what, What::Applied | What::Duplicate) {
            // Confirmed by the server: a plain ack is fire-and-forget, and a lost one means a
            // redelivery after `ack_wait` (harmless, it would be a `Duplicate`).
            message.double_ack().await?;
        }
        handled.push(Handled {
            order_id: job.order_id,
            stream_sequence,
            delivered,
            what,
        });
    }
    Ok(handled)
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
        let consumer = create_consumer(&stream, "mailer", Duration::from_secs(30)).await?;
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
        let mut handled = handle_batch(&consumer, &store, 10, Duration::from_secs(2)).await?;

        let dropped =
            publish_after_window(&js, &subject, &job, Duration::from_millis(100), 100).await?;
        let after_late = stream.info().await?.state.messages;
        writeln!(
            out,
            "after the window ({dropped} more publishes dropped first): the stream took the \
             job again, {after_late} messages"
        )?;
        handled.extend(handle_batch(&consumer, &store, 10, Duration::from_secs(2)).await?);
        for h in &handled {
            writeln!(
                out,
                "message {} (delivery {}) for {}: {:?}",
                h.stream_sequence, h.delivered, h.order_id, h.what
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
