//! What the Kafka tests share: one test's topic, group and tables on PostgreSQL, the counts
//! read back, and the worker process the tests start and SIGKILL (a copy of the test binary
//! running its `#[ignore]`d `child_process` test, as for the RabbitMQ, NATS and SQS tests).

#![allow(dead_code)]

#[path = "../../../tests/support/mod.rs"]
pub mod support;

use std::path::PathBuf;
use std::time::Duration;

use idem::Store;
use idem::kafka::Consumer;
use idem_example_kafka::{
    Hold, Mode, Options, TopUp, config, create_effects, create_topic, kafka_url, produce, producer,
    work,
};
use sqlx::{AssertSqlSafe, PgPool, Postgres};
use support::{CHILD_MODE, Lines, Worker, child_env, postgres, stop_signal};

const CHILD_TOPIC: &str = "IDEM_KAFKA_TOPIC";
const CHILD_GROUP: &str = "IDEM_KAFKA_GROUP";
const CHILD_MARKERS: &str = "IDEM_KAFKA_MARKERS";
const CHILD_EFFECTS: &str = "IDEM_KAFKA_EFFECTS";
const CHILD_BATCH: &str = "IDEM_KAFKA_BATCH";
const CHILD_HOLD: &str = "IDEM_KAFKA_HOLD";
const CHILD_INSTANCE: &str = "IDEM_KAFKA_INSTANCE";

/// One test's topic, consumer group and tables.
pub struct World {
    pub url: String,
    pub topic: String,
    pub group: String,
    pub markers: String,
    pub effects: String,
    pub pool: PgPool,
    pub store: Store<Postgres>,
    pub dir: PathBuf,
}

/// A name no other test or run uses.
pub fn unique(kind: &str) -> String {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!("{kind}_{}_{n}_{nanos:x}", std::process::id())
}

impl World {
    /// A new topic of `partitions` partitions on the broker at `url`, a group, a marker table
    /// (with its offset watermarks) and an effects table.
    pub async fn new(url: &str, partitions: i32) -> World {
        let pool = postgres(8).await;
        let markers = unique("kafka_m");
        let store = Store::new(pool.clone()).with_table(&markers).unwrap();
        store.migrate().await.unwrap();
        let effects = unique("kafka_e");
        create_effects(&pool, &effects).await.unwrap();
        let topic = unique("top-ups");
        create_topic(url, &topic, partitions).await.unwrap();
        let dir = std::env::temp_dir().join(unique("idem-kafka-test"));
        std::fs::create_dir_all(&dir).unwrap();
        World {
            url: url.to_owned(),
            topic,
            group: unique("billing"),
            markers,
            effects,
            pool,
            store,
            dir,
        }
    }

    /// Produces `n` jobs (ids `{prefix}-0`..) with their id header; their places.
    pub async fn produce(&self, prefix: &str, n: i64) -> Vec<(i32, i64)> {
        let jobs: Vec<TopUp> = (0..n)
            .map(|i| TopUp {
                id: format!("{prefix}-{i}"),
                account: i,
                credits: 1,
            })
            .collect();
        let producer = producer(&self.url).unwrap();
        produce(&producer, &self.topic, &jobs, true).await.unwrap()
    }

    /// Effect rows in all.
    pub async fn effects(&self) -> i64 {
        let sql = format!("SELECT COUNT(*) FROM {}", self.effects);
        sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    /// Jobs whose effect is not there exactly once, with their counts.
    pub async fn not_once(&self) -> Vec<(String, i64)> {
        let sql = format!(
            "SELECT job, COUNT(*) FROM {} GROUP BY job HAVING COUNT(*) <> 1 ORDER BY job",
            self.effects
        );
        sqlx::query_as(AssertSqlSafe(sql))
            .fetch_all(&self.pool)
            .await
            .unwrap()
    }

    /// Waits until `n` effect rows are there (each worker's loop is what moves them).
    pub async fn until_effects(&self, n: i64, lines: &mut Lines) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        loop {
            let got = self.effects().await;
            if got >= n {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{got} of {n} effects within 120 s; the workers said:\n{}",
                lines.dump()
            );
            // Read what the workers say meanwhile (for the failure message); bounded.
            drop(lines.next_or_quiet(Duration::from_millis(200)).await);
        }
    }

    /// The environment of a worker process of this world.
    pub fn child_env(
        &self,
        mode: Mode,
        batch: usize,
        hold: Option<&str>,
        instance: Option<&str>,
    ) -> Vec<(&'static str, String)> {
        let mode = match mode {
            Mode::Watermarks => "watermarks",
            Mode::Markers => "markers",
        };
        let mut env = vec![
            (CHILD_TOPIC, self.topic.clone()),
            (CHILD_GROUP, self.group.clone()),
            (CHILD_MARKERS, self.markers.clone()),
            (CHILD_EFFECTS, self.effects.clone()),
            (CHILD_BATCH, batch.to_string()),
            ("IDEM_KAFKA_URL", self.url.clone()),
            (CHILD_MODE, mode.to_owned()),
        ];
        if let Some(hold) = hold {
            env.push((CHILD_HOLD, hold.to_owned()));
        }
        if let Some(instance) = instance {
            env.push((CHILD_INSTANCE, instance.to_owned()));
        }
        env
    }

    /// Starts worker `index` of this world.
    pub fn spawn(&self, index: usize, env: &[(&str, String)], lines: &Lines) -> Worker {
        let mode = env
            .iter()
            .find(|(k, _)| *k == CHILD_MODE)
            .map(|(_, v)| v.clone())
            .unwrap();
        Worker::spawn(index, &mode, env, lines.tx.clone())
    }

    pub async fn cleanup(self) {
        for table in [
            self.effects.clone(),
            self.markers.clone(),
            format!("{}_outbox", self.markers),
            format!("{}_offsets", self.markers),
        ] {
            let sql = format!("DROP TABLE IF EXISTS {table}");
            sqlx::query(AssertSqlSafe(sql))
                .execute(&self.pool)
                .await
                .unwrap();
        }
        drop(std::fs::remove_dir_all(&self.dir));
        self.pool.close().await;
    }
}

/// The worker process: the example's loop in the mode of `CHILD_MODE`, on PostgreSQL, one line
/// per event on stdout, until the parent says `STOP`.
pub async fn child_main() {
    let mode = match child_env(CHILD_MODE).as_str() {
        "watermarks" => Mode::Watermarks,
        "markers" => Mode::Markers,
        other => panic!("unknown worker mode {other:?}"),
    };
    let pool = postgres(4).await;
    let store = Store::new(pool)
        .with_table(&child_env(CHILD_MARKERS))
        .unwrap();
    let mut config = config(&kafka_url(), Some(&child_env(CHILD_GROUP)));
    if let Ok(instance) = std::env::var(CHILD_INSTANCE) {
        config.set("group.instance.id", instance);
    }
    let mut consumer = match mode {
        Mode::Watermarks => Consumer::watermarks(store, &config),
        Mode::Markers => Consumer::markers(store, &config),
    }
    .unwrap();
    consumer.subscribe(&[&child_env(CHILD_TOPIC)]).unwrap();
    let hold = std::env::var(CHILD_HOLD)
        .ok()
        .map(|h| match h.split_once(':') {
            Some(("before", gate)) => Hold::BeforeCommit(gate.into()),
            Some(("after", gate)) => Hold::AfterCommit(gate.into()),
            _ => panic!("unknown hold {h:?}"),
        });
    let options = Options {
        mode,
        batch: child_env(CHILD_BATCH).parse().unwrap(),
        effects: child_env(CHILD_EFFECTS),
        hold,
    };
    let tell = |event| println!("{event}");
    let done = work(&mut consumer, &options, tell, stop_signal()).await;
    consumer.close().await;
    done.unwrap();
    println!("STOPPED");
}
