//! A RabbitMQ worker (lapin) applying top-up jobs exactly once, on SQLite in a temporary file.
//!
//! RabbitMQ delivers every message at least once: a worker that dies after its transaction
//! committed but before its ack reaches the broker gets the message redelivered to another
//! worker. Here the producer even publishes every job twice (a retried publish). The loop is
//! idem's [`Runner`] on the queue's [`Queue`] source: 16 deliveries in flight, each parsed,
//! handled by the `#[idempotent]` handler and settled as [`idem::Settle::decide`] says:
//!
//! - acked on `Applied`, `Duplicate` and `Replayed`: the job's effect is committed, by this
//!   delivery or an earlier one;
//! - retried after a delay (a copy through a retry queue) on an error a later delivery may get
//!   past (`InProgress`, a database error, a rollback), dead-lettered at the 10th delivery;
//! - dead-lettered (to `<queue>.dead`, with the reason) on `KeyReused` and on a payload that is
//!   not a job: no retry can succeed.
//!
//! ```text
//! cargo run --example rabbitmq_worker
//! ```
//! It needs RabbitMQ at `IDEM_AMQP_URL`, else `amqp://guest:guest@127.0.0.1:5672/%2f`.

use std::future::Future;
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem::Disposition;
use idem::Store;
use idem::settle::rabbitmq::{Queue, RabbitMqError};
use idem::settle::{Runner, Settled, Tally};
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use serde::{Deserialize, Serialize};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode};
use sqlx::{Sqlite, Transaction};
use tokio::sync::Notify;

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

/// Adds the job's credits to the account; the marker commits in the same transaction.
///
/// `wait = "5s"`: a second delivery of a job that another worker is still running waits at
/// most this long for it, then gets `InProgress` and is nacked, instead of holding a
/// connection for as long as the first one takes.
#[idem::idempotent(key = "job.id", scope = "billing.top_up", wait = "5s")]
pub async fn apply_top_up(tx: &mut Transaction<'_, Sqlite>, job: &TopUp) -> sqlx::Result<()> {
    sqlx::query("UPDATE accounts SET credits = credits + ?1 WHERE id = ?2")
        .bind(job.credits)
        .bind(job.account)
        .execute(&mut **tx)
        .await?;
    Ok(())
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

/// The worker: consumes `queue` until `stop` resolves, then lets the jobs in flight end and
/// settles them (see [`Runner`]). `on_settled` sees each delivery once it is settled.
pub async fn work(
    connection: &Connection,
    queue: &str,
    store: &Store<Sqlite>,
    stop: impl Future<Output = ()>,
    on_settled: impl Fn(&Settled<'_>) + Send + Sync + 'static,
) -> Result<Tally, RabbitMqError> {
    let deliveries = Queue::consume(connection, queue, PREFETCH).await?;
    Runner::new()
        .in_flight(PREFETCH.into())
        .on_settled(on_settled)
        .run(
            deliveries,
            |job: TopUp| async move { apply_top_up(store, &job).await },
            stop,
        )
        .await
}

/// One line per settled delivery, e.g. `ack applied top-up-1 delivery=1`.
pub fn line(settled: &Settled<'_>) -> String {
    let what = match settled.disposition {
        Disposition::Ack => "ack".to_owned(),
        Disposition::Retry { after } => format!("retry after {after:?}"),
        Disposition::DeadLetter { reason } => format!("dead-letter ({reason})"),
        _ => format!("{:?}", settled.disposition),
    };
    format!(
        "{what} {} {} delivery={}",
        settled.outcome,
        settled.id.unwrap_or("-"),
        settled.delivery
    )
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
    // A worker's pool for the prefetch's deliveries in flight (see `Store`'s docs).
    let pool = Store::<Sqlite>::pool_options(u32::from(PREFETCH))
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

    // Stopped once every copy was acked.
    let expected = 2 * jobs.len() as u64;
    let acked = Arc::new(AtomicU64::new(0));
    let all_acked = Arc::new(Notify::new());
    let lines = Arc::new(Mutex::new(Vec::new()));
    let (seen, count, done) = (lines.clone(), acked.clone(), all_acked.clone());
    let tally = work(
        &connection,
        &queue,
        &store,
        all_acked.notified(),
        move |settled| {
            seen.lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(line(settled));
            if settled.disposition == &Disposition::Ack
                && count.fetch_add(1, Ordering::SeqCst) + 1 == expected
            {
                // `notify_one` keeps the wake-up if `stop` is not being polled yet.
                done.notify_one();
            }
        },
    )
    .await?;
    for line in lines.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        writeln!(out, "{line}")?;
    }
    for q in [queue.clone(), Queue::dead_letters(&queue)] {
        channel
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await?;
    }
    connection.close(200, "done".into()).await?;

    let balances: Vec<(i64, i64)> = sqlx::query_as("SELECT id, credits FROM accounts ORDER BY id")
        .fetch_all(&pool)
        .await?;
    writeln!(
        out,
        "{} applied, {} duplicates acked without running; balances: {}",
        tally.applied,
        tally.acked_otherwise,
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
