//! Records per second of a Kafka consumer whose effect is one row per record on PostgreSQL,
//! in the same run: a plain consumer that commits its offsets to Kafka only (no
//! exactly-once), the offset-watermark mode, and the per-message marker mode, each at batch 1
//! (a transaction per record) and batch 100 (one per batch).
//!
//! ```text
//! cargo bench -p idem-example-kafka --bench throughput [-- --quick]
//! ```
//! Needs the broker at `IDEM_KAFKA_URL` and PostgreSQL at `IDEM_POSTGRES_URL`. Each variant
//! reads the same records of one topic in a consumer group of its own, timed from its first
//! record (a group's join, 3 s on tansu, is not counted). The variants run in turns, twice
//! (the second time in the reverse order), and the better of the two is reported: on a shared machine only the ratios within one run
//! mean anything.

use std::time::{Duration, Instant};

use idem::kafka::{Consumer, Record};
use idem::{Key, Store};
use idem_example_kafka::{
    Effects, TopUp, config, create_effects, create_topic, kafka_url, produce, producer,
};
use sqlx::{AssertSqlSafe, PgPool, Postgres};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    /// Effects committed, then offsets committed to Kafka: at least once.
    KafkaOnly,
    /// One offset claim per batch.
    Watermarks,
    /// One marker per record (`Store::claim` at batch 1, `Store::claim_batch` at 100).
    Markers,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::KafkaOnly => "kafka offsets only",
            Variant::Watermarks => "offset watermarks",
            Variant::Markers => "per-message markers",
        }
    }
}

async fn insert(tx: &mut sqlx::Transaction<'static, Postgres>, effects: &str, record: &Record) {
    let job: TopUp = serde_json::from_slice(record.payload().unwrap()).unwrap();
    <Postgres as Effects>::insert(tx, effects, &job, record.partition(), record.offset())
        .await
        .unwrap();
}

/// Handles one batch in `variant`; returns how many records it applied. `scope` is the
/// markers' scope, one per run, so that no run meets another's markers.
async fn handle(
    variant: Variant,
    consumer: &mut Consumer<Postgres>,
    pool: &PgPool,
    effects: &str,
    scope: &str,
    records: &[Record],
) -> usize {
    match variant {
        Variant::KafkaOnly => {
            let mut tx = pool.begin().await.unwrap();
            for record in records {
                insert(&mut tx, effects, record).await;
            }
            tx.commit().await.unwrap();
            consumer.commit(records).unwrap();
            records.len()
        }
        Variant::Watermarks => {
            let mut claim = consumer.claim(records).await.unwrap();
            for (i, record) in records.iter().enumerate() {
                if claim.is_fresh(i) {
                    insert(claim.tx().unwrap(), effects, record).await;
                }
            }
            let done = claim.finish(Ok::<_, idem::Error>(())).await.unwrap();
            done.applied()
        }
        Variant::Markers => {
            let store = consumer.store().clone();
            let keys: Vec<Key> = records.iter().map(Record::offset_key).collect();
            let mut claim = store.claim_batch(scope, &keys).await.unwrap();
            for (i, record) in records.iter().enumerate() {
                if claim.is_fresh(i) {
                    insert(claim.tx().unwrap(), effects, record).await;
                }
            }
            let done = claim.finish(Ok::<_, idem::Error>(())).await.unwrap();
            consumer.commit(records).unwrap();
            done.applied()
        }
    }
}

/// Records per second of `variant` reading the first `records` records of `topic` in
/// batches of `batch`.
async fn run(
    variant: Variant,
    store: &Store<Postgres>,
    url: &str,
    topic: &str,
    batch: usize,
    records: usize,
    round: u32,
) -> f64 {
    let group = format!(
        "bench-{}-{batch}-{round}-{}",
        variant as u8,
        std::process::id()
    );
    let effects = format!(
        "bench_kafka_e_{}_{batch}_{round}_{}",
        variant as u8,
        std::process::id()
    );
    create_effects(store.pool(), &effects).await.unwrap();
    let config = config(url, Some(&group));
    let mut consumer = match variant {
        Variant::Watermarks => Consumer::watermarks(store.clone(), &config),
        _ => Consumer::markers(store.clone(), &config),
    }
    .unwrap();
    consumer.subscribe(&[topic]).unwrap();
    let (mut done, mut applied, mut started) = (0, 0, None);
    while done < records {
        let want = batch.min(records - done);
        let got = consumer
            .next_batch(want, Duration::from_millis(500))
            .await
            .unwrap();
        if got.is_empty() {
            continue;
        }
        started.get_or_insert_with(Instant::now);
        done += got.len();
        applied += handle(variant, &mut consumer, store.pool(), &effects, &group, &got).await;
    }
    // Every variant applies every record once: the check that the figures are of real work.
    assert_eq!(
        applied,
        records,
        "{} applied {applied} of {records}",
        variant.name()
    );
    let secs = started.unwrap().elapsed().as_secs_f64();
    consumer.close().await;
    let sql = format!("DROP TABLE {effects}");
    sqlx::query(AssertSqlSafe(sql))
        .execute(store.pool())
        .await
        .unwrap();
    records as f64 / secs
}

#[tokio::main]
async fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let url = kafka_url();
    let pg = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&pg)
        .await
        .unwrap_or_else(|e| panic!("cannot reach PostgreSQL at {pg} (set IDEM_POSTGRES_URL): {e}"));
    let table = format!("bench_kafka_{}", std::process::id());
    let store = Store::new(pool.clone()).with_table(&table).unwrap();
    store.migrate().await.unwrap();
    let topic = format!("bench-{}", std::process::id());
    create_topic(&url, &topic, 1).await.unwrap();
    let (single, batched) = if quick { (200, 1_000) } else { (1_000, 5_000) };
    let jobs: Vec<TopUp> = (0..batched as i64)
        .map(|i| TopUp {
            id: format!("job-{i}"),
            account: i,
            credits: 1,
        })
        .collect();
    produce(&producer(&url).unwrap(), &topic, &jobs, true)
        .await
        .unwrap();
    let variants = [Variant::KafkaOnly, Variant::Watermarks, Variant::Markers];
    println!("records/s on PostgreSQL, {single} records at batch 1, {batched} at batch 100");
    for (batch, records) in [(1, single), (100, batched)] {
        let mut best = [0.0_f64; 3];
        // The second round runs the variants in the reverse order: a machine whose load
        // drifts during the run favours neither end.
        for round in 0..2 {
            let order: Vec<usize> = match round {
                0 => vec![0, 1, 2],
                _ => vec![2, 1, 0],
            };
            for i in order {
                let rate = run(variants[i], &store, &url, &topic, batch, records, round).await;
                best[i] = best[i].max(rate);
            }
        }
        for (i, variant) in variants.iter().enumerate() {
            println!(
                "batch {batch:>3}  {:<20} {:>8.0} records/s  ({:.2} of kafka offsets only)",
                variant.name(),
                best[i],
                best[i] / best[0]
            );
        }
    }
    for suffix in ["", "_outbox", "_offsets"] {
        let sql = format!("DROP TABLE IF EXISTS {table}{suffix}");
        sqlx::query(AssertSqlSafe(sql))
            .execute(&pool)
            .await
            .unwrap();
    }
}
