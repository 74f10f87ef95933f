//! An SQS worker (aws-sdk-sqs) applying top-up jobs exactly once, on SQLite in a temporary
//! file, and sending a receipt for each exactly once (an effect outside the database).
//!
//! SQS hides a received message for the queue's **visibility timeout**; a worker that dies
//! after its transaction committed but before its `DeleteMessage` reached SQS gets the message
//! handed to another worker once that timeout ran out (`ApproximateReceiveCount` 2). Here the
//! producer even sends every job twice (a retried send). Two loops, each on a queue of its own
//! with a dead-letter queue (redrive policy, `maxReceiveCount` 5):
//!
//! - **top-ups, a batch handler**: each long-polling `ReceiveMessage` (up to 10 messages) is
//!   one `#[idempotent(batch = ..)]` call, one transaction for the whole batch; the jobs that
//!   came back `Applied` or `Duplicate` are deleted with one `DeleteMessageBatch`. On
//!   `InProgress` (another worker's transaction holds one of the keys past `wait`) the batch's
//!   messages are made visible again in a second (`ChangeMessageVisibility`).
//! - **receipts, a lease-mode handler**: the mail provider is outside the database, so the
//!   handler holds a lease on the key while it calls it, and a heartbeat beside the call
//!   renews the lease and, only then, extends the message's visibility. A job whose id comes
//!   back with another payload is `KeyReused` (`fingerprint`) and goes to the dead-letter
//!   queue at once, as does a body that is not a job.
//!
//! ```text
//! cargo run --example sqs_worker
//! ```
//! It needs an SQS endpoint at `IDEM_SQS_URL`, else `http://127.0.0.1:5000`: moto's server
//! (`pip install "moto[server]"; moto_server -H 127.0.0.1 -p 5000`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use idem::{Lease, Store};
use idem_example_sqs::{
    Event, JobError, Options, Received, TopUp, Worker, batch_verdicts, connect, create_queue,
    delete_queue, send_jobs, sqs_url, verdict,
};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{Sqlite, Transaction};

/// The queues' visibility timeout (seconds): longer than a batch's transaction takes, and no
/// shorter than the receipts' lease, so that SQS hands out no message whose job still runs.
const VISIBILITY: i32 = 10;
/// A retried message's visibility (seconds).
const RETRY_AFTER: i32 = 1;

/// Adds each fresh job's credits to its account; the markers commit in the same transaction.
///
/// `wait = "2s"`, well below the visibility timeout: a batch that meets a key another worker's
/// transaction holds gives up (`InProgress`, retried in a second) instead of holding its
/// connection while its messages' visibility runs out.
#[idem::idempotent(key = "job.id", scope = "sqs.top_up", batch = "jobs", wait = "2s")]
pub async fn apply_top_ups(
    tx: &mut Transaction<'_, Sqlite>,
    jobs: &[TopUp],
) -> Result<usize, JobError> {
    for job in jobs {
        sqlx::query("UPDATE accounts SET credits = credits + ?1 WHERE id = ?2")
            .bind(job.credits)
            .bind(job.account)
            .execute(&mut **tx)
            .await?;
    }
    Ok(jobs.len())
}

/// Stands in for a mail provider's API: it appends each receipt to a file, and would take the
/// idempotency key as its `Idempotency-Key` header.
pub struct Mailer {
    pub log: PathBuf,
}

impl Mailer {
    async fn send(&self, idempotency_key: &str, job: &TopUp) -> Result<(), JobError> {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| JobError::Outside(e.to_string()))?;
        writeln!(
            file,
            "receipt for {} ({} credits to account {}), key {idempotency_key}",
            job.id, job.credits, job.account
        )
        .map_err(|e| JobError::Outside(e.to_string()))
    }
}

/// Sends the job's receipt once. The heartbeat renews the lease (10 s; the body is cut off 8 s
/// after the claim or the last renewal) every 3 s, then sets the message's visibility back to
/// 10 s: both cover the time to the next heartbeat with room for its round trips. The
/// visibility is no shorter than the lease, so SQS hands the message out again only once the
/// lease of a worker that died has run out too: the next delivery takes the key over at once
/// instead of spending receives on `InProgress`.
#[idem::idempotent(
    key = "job.id",
    scope = "sqs.receipt",
    lease = "10s",
    fingerprint = "job"
)]
pub async fn send_receipt(
    lease: &Lease,
    job: &TopUp,
    mailer: &Mailer,
    worker: &Worker<'_>,
    received: &Received,
) -> Result<(), JobError> {
    tokio::select! {
        sent = mailer.send(lease.idempotency_key(), job) => sent,
        lost = worker.keep_invisible(lease, received) => Err(lost),
    }
}

/// Counts of a loop's events.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    pub received: u64,
    pub applied: u64,
    pub duplicates: u64,
    pub retried: u64,
    pub dead_lettered: u64,
}

impl Tally {
    fn add(&mut self, event: &Event) {
        match event {
            Event::Received { .. } => self.received += 1,
            Event::Deleted { applied: true, .. } => self.applied += 1,
            Event::Deleted { applied: false, .. } => self.duplicates += 1,
            Event::Retried { .. } => self.retried += 1,
            Event::DeadLettered { .. } => self.dead_lettered += 1,
            _ => {}
        }
    }
}

/// What [`run`] reports.
pub struct Report {
    pub top_ups: Tally,
    pub receipts: Tally,
    pub balances: Vec<(i64, i64)>,
    pub receipts_sent: Vec<String>,
}

/// A loop's tally, and the signal that it handled all it was sent.
struct Counter<'a> {
    tally: Mutex<Tally>,
    finished: tokio::sync::Notify,
    /// Messages to delete and to dead-letter before the loop stops.
    target: Mutex<(u64, u64)>,
    lines: &'a Mutex<Vec<String>>,
}

impl Counter<'_> {
    fn new(target: (u64, u64), lines: &Mutex<Vec<String>>) -> Counter<'_> {
        Counter {
            tally: Mutex::default(),
            finished: tokio::sync::Notify::new(),
            target: Mutex::new(target),
            lines,
        }
    }

    fn note(&self, event: &Event) {
        self.lines
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(event.to_string());
        let mut t = self.tally.lock().unwrap_or_else(|e| e.into_inner());
        t.add(event);
        if (t.applied + t.duplicates, t.dead_lettered)
            == *self.target.lock().unwrap_or_else(|e| e.into_inner())
        {
            // `notify_one` keeps the wake-up for a loop not waiting yet.
            self.finished.notify_one();
        }
    }

    /// The tally so far; counting starts again from zero towards `next`.
    fn restart(&self, next: (u64, u64)) -> Tally {
        *self.target.lock().unwrap_or_else(|e| e.into_inner()) = next;
        std::mem::take(&mut *self.tally.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// How both loops talk to SQS. A receive waits at most a second for messages, so a loop sees
/// its stop within about a second.
const OPTIONS: Options = Options {
    wait_seconds: 1,
    visibility: VISIBILITY,
    retry_after: RETRY_AFTER,
    heartbeat: Duration::from_secs(3),
};

/// Sends five top-ups twice and a body that is not a job to a queue of its own, applies them
/// with the batch handler against the SQLite file at `db`; then sends a receipt job for
/// three of them twice, and one with a reused id, through the lease-mode handler; deletes the
/// queues.
pub async fn run(
    sqs: &str,
    db: &Path,
    out: &mut (impl Write + Send),
) -> Result<Report, Box<dyn std::error::Error>> {
    let options = SqliteConnectOptions::new()
        .filename(db)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(30));
    let pool = SqlitePoolOptions::new()
        .max_connections(4)
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

    let client = connect(sqs).await?;
    let pid = std::process::id();
    let top_up_queue = create_queue(
        &client,
        &format!("idem-example-top-ups-{pid}"),
        VISIBILITY,
        5,
    )
    .await?;
    let jobs: Vec<TopUp> = (1..=5)
        .map(|n| TopUp {
            id: format!("top-up-{n}"),
            account: 1 + n % 2,
            credits: 10 * n,
        })
        .collect();
    // The producer retried every send: each job is in the queue twice.
    send_jobs(&client, &top_up_queue.url, jobs.iter().chain(&jobs)).await?;
    client
        .send_message()
        .queue_url(&top_up_queue.url)
        .message_body("{ not a job")
        .send()
        .await?;
    writeln!(out, "sent {} top-ups twice and one broken body", jobs.len())?;

    let lines = Mutex::new(Vec::new());
    let counter = Counter::new((10, 1), &lines);
    let on_event = |event: &Event| counter.note(event);
    let worker = Worker {
        client: &client,
        queue: &top_up_queue,
        options: OPTIONS,
        on_event: &on_event,
    };
    let handle = |batch: Vec<Received>| {
        let store = &store;
        async move {
            let jobs: Vec<TopUp> = batch.iter().map(|r| r.job.clone()).collect();
            batch_verdicts(&apply_top_ups(store, &jobs).await, jobs.len(), RETRY_AFTER)
        }
    };
    worker.run(handle, counter.finished.notified()).await?;
    let top_ups = counter.restart((0, 0));

    let receipt_queue = create_queue(
        &client,
        &format!("idem-example-receipts-{pid}"),
        VISIBILITY,
        5,
    )
    .await?;
    let receipts: Vec<TopUp> = jobs[..3].iter().chain(&jobs[..3]).cloned().collect();
    send_jobs(&client, &receipt_queue.url, &receipts).await?;
    let mailer = Mailer {
        log: db.with_extension("receipts"),
    };
    let counter = Counter::new((6, 0), &lines);
    let on_event = |event: &Event| counter.note(event);
    let worker = Worker {
        client: &client,
        queue: &receipt_queue,
        options: OPTIONS,
        on_event: &on_event,
    };
    let handle = |batch: Vec<Received>| {
        let (store, mailer, worker) = (&store, &mailer, &worker);
        async move {
            // The lease-mode calls of one receive run concurrently, each with its heartbeat.
            let calls = batch.iter().map(|r| async move {
                verdict(
                    &send_receipt(store, &r.job, mailer, worker, r).await,
                    RETRY_AFTER,
                )
            });
            futures_util::future::join_all(calls).await
        }
    };
    worker.run(&handle, counter.finished.notified()).await?;
    let mut receipts_tally = counter.restart((0, 1));
    // Then the same id with other credits, once the first ones are done (sent together, either
    // could claim the key first): the fingerprint refuses it.
    let reused = TopUp {
        credits: 999,
        ..jobs[0].clone()
    };
    send_jobs(&client, &receipt_queue.url, [&reused]).await?;
    worker.run(&handle, counter.finished.notified()).await?;
    receipts_tally.dead_lettered += counter.restart((0, 0)).dead_lettered;
    for line in lines.into_inner().unwrap_or_else(|e| e.into_inner()) {
        writeln!(out, "{line}")?;
    }
    for queue in [&top_up_queue, &receipt_queue] {
        delete_queue(&client, queue).await?;
    }

    let balances: Vec<(i64, i64)> = sqlx::query_as("SELECT id, credits FROM accounts ORDER BY id")
        .fetch_all(&pool)
        .await?;
    let receipts_sent: Vec<String> = std::fs::read_to_string(&mailer.log)?
        .lines()
        .map(str::to_owned)
        .collect();
    writeln!(
        out,
        "top-ups: {} received, {} applied, {} duplicates deleted without running; balances: {}",
        top_ups.received,
        top_ups.applied,
        top_ups.duplicates,
        balances
            .iter()
            .map(|(id, c)| format!("account {id} has {c}"))
            .collect::<Vec<_>>()
            .join(", ")
    )?;
    writeln!(
        out,
        "receipts: {} sent, {} duplicates, {} dead-lettered",
        receipts_sent.len(),
        receipts_tally.duplicates,
        receipts_tally.dead_lettered
    )?;
    pool.close().await;
    Ok(Report {
        top_ups,
        receipts: receipts_tally,
        balances,
        receipts_sent,
    })
}

#[allow(dead_code)]
#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("idem-sqs-worker-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = run(&sqs_url(), &dir.join("jobs.db"), &mut std::io::stdout()).await;
    std::fs::remove_dir_all(&dir)?;
    result.map(|_| ())
}
