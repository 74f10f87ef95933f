//! A RabbitMQ worker (lapin) applying top-up jobs exactly once, on SQLite in a temporary file.
//!
//! RabbitMQ delivers every message at least once: a worker that dies after its transaction
//! committed but before its ack reaches the broker gets the message redelivered (with the
//! `redelivered` flag) to another worker. Here the producer even publishes every job twice
//! (a retried publish). The worker consumes a durable queue with manual acks and a prefetch of
//! 16, runs the `#[idempotent]` handler and:
//!
//! - acks on `Applied`, `Duplicate` and `Replayed`: the job's effect is committed, by this
//!   delivery or an earlier one;
//! - nacks with `requeue = true` on any other error (`InProgress`, a database error, a
//!   rollback): nothing was kept, the broker hands the message out again;
//! - nacks with `requeue = false` on `KeyReused` and on a payload that is not a job: no retry
//!   can succeed, so the message goes to the queue's dead-letter exchange if it has one.
//!
//! ```text
//! cargo run --example rabbitmq_worker
//! ```
//! It needs RabbitMQ at `IDEM_AMQP_URL`, else `amqp://guest:guest@127.0.0.1:5672/%2f`.

use std::future::Future;
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use futures_util::StreamExt as _;
use idem::{Outcome, Store};
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use serde::{Deserialize, Serialize};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{Sqlite, Transaction};

/// Deliveries in flight at once, each handled concurrently.
const PREFETCH: u16 = 16;

/// The broker of the example and the tests, unless `IDEM_AMQP_URL` says otherwise.
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// `IDEM_AMQP_URL`, else [`DEFAULT_AMQP_URL`].
pub fn amqp_url() -> String {
    std::env::var("IDEM_AMQP_URL").unwrap_or_else(|_| DEFAULT_AMQP_URL.to_owned())
}

/// Connects to RabbitMQ; the error names the URL and the variable that overrides it.
pub async fn connect(url: &str) -> Result<Connection, String> {
    Connection::connect(url, ConnectionProperties::default())
        .await
        .map_err(|e| format!("cannot reach RabbitMQ at {url} (set IDEM_AMQP_URL): {e}"))
}

/// A top-up job as the producer publishes it (JSON). `id` is stable across redeliveries.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TopUp {
    pub id: String,
    pub account: i64,
    pub credits: i64,
}

/// The handler's error: idem's own, or the database's.
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

/// Adds the job's credits to the account; the marker commits in the same transaction.
///
/// `wait = "5s"`: a second delivery of a job that another worker is still running waits at
/// most this long for it, then gets `InProgress` and is nacked, instead of holding a
/// connection for as long as the first one takes.
#[idem::idempotent(key = "job.id", scope = "billing.top_up", wait = "5s")]
pub async fn apply_top_up(tx: &mut Transaction<'_, Sqlite>, job: &TopUp) -> Result<(), JobError> {
    sqlx::query("UPDATE accounts SET credits = credits + ?1 WHERE id = ?2")
        .bind(job.credits)
        .bind(job.account)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// What the worker did with one delivery, in the order it happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A message arrived; `redelivered` is RabbitMQ's flag (an earlier delivery was not acked).
    Delivered { id: String, redelivered: bool },
    /// The handler returned `Applied` (`applied`) or `Duplicate`/`Replayed`; the ack follows.
    /// Seen before the ack, so that a worker killed in between has still told it (its message
    /// comes back and is told again).
    Handled { id: String, applied: bool },
    /// Acked after the handler returned `Applied` (`applied`) or `Duplicate`/`Replayed`.
    Acked {
        id: String,
        applied: bool,
        redelivered: bool,
    },
    /// Nacked: `requeue` for errors a later delivery may get past, else dead-lettered.
    Nacked {
        id: String,
        requeue: bool,
        error: String,
    },
}

impl std::fmt::Display for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // One line per event, stable enough for the tests' worker processes to be read by
        // their parent.
        match self {
            Event::Delivered { id, redelivered } => {
                write!(f, "DELIVERED {id} redelivered={redelivered}")
            }
            Event::Handled { id, applied } => {
                let what = if *applied { "applied" } else { "duplicate" };
                write!(f, "HANDLED {what} {id}")
            }
            Event::Acked {
                id,
                applied,
                redelivered,
            } => {
                let what = if *applied { "applied" } else { "duplicate" };
                write!(f, "ACKED {what} {id} redelivered={redelivered}")
            }
            Event::Nacked { id, requeue, error } => {
                write!(f, "NACKED {id} requeue={requeue}: {error}")
            }
        }
    }
}

/// Counts of a worker's events.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    pub delivered: u64,
    pub redelivered: u64,
    pub applied: u64,
    pub duplicates: u64,
    pub nacked: u64,
}

impl Tally {
    /// Adds one event.
    pub fn add(&mut self, event: &Event) {
        match event {
            Event::Delivered { redelivered, .. } => {
                self.delivered += 1;
                self.redelivered += u64::from(*redelivered);
            }
            Event::Handled { .. } => {}
            Event::Acked { applied: true, .. } => self.applied += 1,
            Event::Acked { applied: false, .. } => self.duplicates += 1,
            Event::Nacked { .. } => self.nacked += 1,
        }
    }

    /// Messages acked, applied or not.
    pub fn acked(&self) -> u64 {
        self.applied + self.duplicates
    }
}

/// Declares the durable queue the jobs go through.
pub async fn declare_queue(channel: &Channel, queue: &str) -> Result<u32, lapin::Error> {
    let q = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await?;
    Ok(q.message_count())
}

/// Publishes `job` as a persistent message and waits for the broker's confirm (the channel
/// must be in confirm mode: [`confirming_channel`]).
pub async fn publish(channel: &Channel, queue: &str, job: &TopUp) -> Result<(), String> {
    let payload = serde_json::to_vec(job).map_err(|e| e.to_string())?;
    let confirm = channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            &payload,
            // Persistent, so that the job survives a broker restart in the durable queue.
            BasicProperties::default()
                .with_delivery_mode(2)
                .with_message_id(job.id.as_str().into()),
        )
        .await
        .map_err(|e| e.to_string())?
        .await
        .map_err(|e| e.to_string())?;
    if confirm.is_ack() {
        Ok(())
    } else {
        Err(format!("the broker refused job {}: {confirm:?}", job.id))
    }
}

/// A channel with publisher confirms on.
pub async fn confirming_channel(connection: &Connection) -> Result<Channel, lapin::Error> {
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(channel)
}

/// The worker loop: consumes `queue` with manual acks, `prefetch` messages in flight (and
/// handled concurrently), until `stop` resolves; then finishes (and acks) the deliveries it
/// is handling, cancels its consumer and returns what it did. Deliveries the broker had sent
/// but the loop had not started are requeued by RabbitMQ when the channel closes.
///
/// `handle` runs the `#[idempotent]` handler; `on_event` sees every delivery, ack and nack.
pub async fn work<H, Fut>(
    channel: &Channel,
    queue: &str,
    prefetch: u16,
    handle: H,
    stop: impl Future<Output = ()>,
    on_event: impl Fn(&Event) + Sync,
) -> Result<Tally, lapin::Error>
where
    H: Fn(TopUp) -> Fut + Sync,
    Fut: Future<Output = Result<Outcome<()>, JobError>>,
{
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await?;
    let consumer = channel
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let tag = consumer.tag();
    let tally = Mutex::new(Tally::default());
    let note = |event: Event| {
        on_event(&event);
        tally.lock().unwrap_or_else(|e| e.into_inner()).add(&event);
    };
    let first_error: Mutex<Option<lapin::Error>> = Mutex::new(None);
    // Shared by reference with every delivery's future.
    let (first_error_ref, note, handle) = (&first_error, &note, &handle);
    consumer
        .take_until(stop)
        .for_each_concurrent(usize::from(prefetch), move |delivery| async move {
            let first_error = first_error_ref;
            let delivery = match delivery {
                Ok(d) => d,
                Err(e) => {
                    first_error
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .get_or_insert(e);
                    return;
                }
            };
            let redelivered = delivery.redelivered;
            let job: TopUp = match serde_json::from_slice(&delivery.data) {
                Ok(job) => job,
                Err(e) => {
                    let nack = BasicNackOptions {
                        requeue: false,
                        ..Default::default()
                    };
                    let id = format!("tag-{}", delivery.delivery_tag);
                    if let Err(e) = delivery.acker.nack(nack).await {
                        first_error
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .get_or_insert(e);
                    }
                    note(Event::Nacked {
                        id,
                        requeue: false,
                        error: format!("not a top-up job: {e}"),
                    });
                    return;
                }
            };
            let id = job.id.clone();
            note(Event::Delivered {
                id: id.clone(),
                redelivered,
            });
            let result = match handle(job).await {
                // Committed, by this delivery or an earlier one: the job is done.
                Ok(Outcome::Applied(())) => Ok(true),
                // Or failed for good by an earlier delivery: never retried either.
                Ok(Outcome::Duplicate | Outcome::Replayed(()) | Outcome::Failed(_)) => Ok(false),
                // The same key with another payload: no redelivery can fix it.
                Err(e @ JobError::Idem(idem::Error::KeyReused { .. })) => Err((false, e)),
                // Nothing was kept (a rollback, a lost connection, another delivery still
                // running the job): let the broker hand it out again.
                Err(e) => Err((true, e)),
            };
            if let Ok(applied) = result {
                note(Event::Handled {
                    id: id.clone(),
                    applied,
                });
            }
            let sent = match result {
                Ok(applied) => delivery
                    .acker
                    .ack(BasicAckOptions::default())
                    .await
                    .map(|_| Event::Acked {
                        id,
                        applied,
                        redelivered,
                    }),
                Err((requeue, error)) => delivery
                    .acker
                    .nack(BasicNackOptions {
                        requeue,
                        ..Default::default()
                    })
                    .await
                    .map(|_| Event::Nacked {
                        id,
                        requeue,
                        error: error.to_string(),
                    }),
            };
            match sent {
                Ok(event) => note(event),
                Err(e) => {
                    first_error
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .get_or_insert(e);
                }
            }
        })
        .await;
    if let Some(e) = first_error.into_inner().unwrap_or_else(|e| e.into_inner()) {
        return Err(e);
    }
    channel
        .basic_cancel(tag, BasicCancelOptions::default())
        .await?;
    Ok(tally.into_inner().unwrap_or_else(|e| e.into_inner()))
}

/// What [`run`] reports: the worker's counts and the final balances.
pub struct Report {
    pub tally: Tally,
    pub balances: Vec<(i64, i64)>,
}

/// Publishes five top-ups, each twice, to a queue of its own, consumes them with [`work`]
/// against the SQLite file at `db`, and deletes the queue.
pub async fn run(
    amqp: &str,
    db: &Path,
    out: &mut (impl Write + Send),
) -> Result<Report, Box<dyn std::error::Error>> {
    let options = SqliteConnectOptions::new()
        .filename(db)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(30));
    // No ping before each job (a dead connection fails the claim: the delivery is nacked and
    // redelivered), and one connection more than the prefetch, so that a connection going
    // back to the pool never holds up the next delivery (see `Store`'s docs).
    let pool = SqlitePoolOptions::new()
        .test_before_acquire(false)
        .max_connections(u32::from(PREFETCH) + 1)
        .connect_with(options)
        .await?;
    let store = Store::new(pool.clone());
    store.migrate().await?;
    sqlx::query("CREATE TABLE accounts (id INTEGER PRIMARY KEY, credits INTEGER NOT NULL)")
        .execute(&pool)
        .await?;
    sqlx::query("INSERT INTO accounts VALUES (1, 100), (2, 100)")
        .execute(&pool)
        .await?;

    let connection = connect(amqp).await?;
    let channel = confirming_channel(&connection).await?;
    let queue = format!("idem-example-top-ups-{}", std::process::id());
    declare_queue(&channel, &queue).await?;
    let jobs: Vec<TopUp> = (1..=5)
        .map(|n| TopUp {
            id: format!("top-up-{n}"),
            account: 1 + n % 2,
            credits: 10 * n,
        })
        .collect();
    // The producer retried every publish: each job is in the queue twice.
    for job in jobs.iter().chain(&jobs) {
        publish(&channel, &queue, job).await?;
    }
    writeln!(out, "published {} jobs twice to {queue}", jobs.len())?;

    let expected = 2 * jobs.len() as u64;
    let acked = std::sync::atomic::AtomicU64::new(0);
    let all_acked = tokio::sync::Notify::new();
    let lines = Mutex::new(Vec::new());
    let consuming = connection.create_channel().await?;
    let tally = work(
        &consuming,
        &queue,
        PREFETCH,
        |job| {
            let store = &store;
            async move { apply_top_up(store, &job).await }
        },
        all_acked.notified(),
        |event| {
            lines
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(event.to_string());
            if matches!(event, Event::Acked { .. })
                && acked.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1 == expected
            {
                // `notify_one` keeps the wake-up if `stop` is not being polled yet.
                all_acked.notify_one();
            }
        },
    )
    .await?;
    for line in lines.into_inner().unwrap_or_else(|e| e.into_inner()) {
        writeln!(out, "{line}")?;
    }
    consuming.close(200, "done".into()).await?;
    channel
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await?;
    connection.close(200, "done".into()).await?;

    let balances: Vec<(i64, i64)> = sqlx::query_as("SELECT id, credits FROM accounts ORDER BY id")
        .fetch_all(&pool)
        .await?;
    writeln!(
        out,
        "{} delivered, {} applied, {} duplicates acked without running; balances: {}",
        tally.delivered,
        tally.applied,
        tally.duplicates,
        balances
            .iter()
            .map(|(id, c)| format!("account {id} has {c}"))
            .collect::<Vec<_>>()
            .join(", ")
    )?;
    pool.close().await;
    Ok(Report { tally, balances })
}

#[allow(dead_code)]
#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("idem-rabbitmq-worker-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = run(&amqp_url(), &dir.join("jobs.db"), &mut std::io::stdout()).await;
    std::fs::remove_dir_all(&dir)?;
    result.map(|_| ())
}
