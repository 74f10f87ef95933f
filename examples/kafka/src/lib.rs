//! What the `kafka_worker` example and its tests share: the broker's address, topics, an
//! idempotent producer of top-up jobs, and the worker loop in both modes (offset watermarks,
//! per-message markers), which reports what it does as [`Event`]s.

use std::path::PathBuf;
use std::time::Duration;

use idem::kafka::{Consumer, Record};
use idem::{Outcome, Store};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde::{Deserialize, Serialize};
use sqlx::{AssertSqlSafe, Database, Pool, Transaction};

/// The broker of the example and the tests, unless `IDEM_KAFKA_URL` says otherwise.
pub const DEFAULT_KAFKA_URL: &str = "127.0.0.1:9092";

/// The header in which the producer puts a job's id: the marker mode's key.
pub const JOB_ID: &str = "job-id";

/// `IDEM_KAFKA_URL` (`host:port`), else [`DEFAULT_KAFKA_URL`].
pub fn kafka_url() -> String {
    std::env::var("IDEM_KAFKA_URL").unwrap_or_else(|_| DEFAULT_KAFKA_URL.to_owned())
}

/// A client configuration for `bootstrap`: consumers of `group`, if given.
///
/// The session timeout is 6 s (Kafka's smallest by default): a member that died is noticed
/// after it. The broker of the tests (tansu) also holds a group's join open for half the
/// session timeout, waiting for other members, so a join takes 3 s rather than librdkafka's
/// default 45 s / 2.
pub fn config(bootstrap: &str, group: Option<&str>) -> ClientConfig {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", bootstrap)
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "1000")
        .set("socket.timeout.ms", "10000");
    if let Some(group) = group {
        config.set("group.id", group);
    }
    config
}

/// Makes `topic` with `partitions` partitions; the error names the broker and the variable
/// that overrides it.
pub async fn create_topic(bootstrap: &str, topic: &str, partitions: i32) -> Result<(), String> {
    let admin: AdminClient<DefaultClientContext> = config(bootstrap, None)
        .create()
        .map_err(|e| format!("cannot make a Kafka admin client for {bootstrap}: {e}"))?;
    let new = NewTopic::new(topic, partitions, TopicReplication::Fixed(1));
    let made = admin
        .create_topics(&[new], &AdminOptions::new())
        .await
        .map_err(|e| format!("cannot reach Kafka at {bootstrap} (set IDEM_KAFKA_URL): {e}"))?;
    for answer in made {
        answer.map_err(|(t, e)| format!("Kafka did not make topic {t}: {e}"))?;
    }
    Ok(())
}

/// A top-up job as the producer publishes it (JSON). `id` is stable across a producer's
/// retries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopUp {
    pub id: String,
    pub account: i64,
    pub credits: i64,
}

/// An idempotent producer (its own retries never make a second record).
pub fn producer(bootstrap: &str) -> Result<FutureProducer, String> {
    config(bootstrap, None)
        .set("enable.idempotence", "true")
        .create()
        .map_err(|e| format!("cannot make a Kafka producer for {bootstrap}: {e}"))
}

/// Produces each job to `topic`, keyed by its account (one account's jobs share a
/// partition), its id in the header [`JOB_ID`] unless `with_id` is false; returns each job's
/// (partition, offset).
pub async fn produce(
    producer: &FutureProducer,
    topic: &str,
    jobs: &[TopUp],
    with_id: bool,
) -> Result<Vec<(i32, i64)>, String> {
    let mut placed = Vec::with_capacity(jobs.len());
    for job in jobs {
        let payload = serde_json::to_vec(job).expect("a job serialises");
        let account = job.account.to_string();
        let mut record = FutureRecord::to(topic).key(&account).payload(&payload);
        if with_id {
            let headers = OwnedHeaders::new().insert(Header {
                key: JOB_ID,
                value: Some(job.id.as_str()),
            });
            record = record.headers(headers);
        }
        let delivery = producer
            .send(record, Duration::from_secs(30))
            .await
            .map_err(|(e, _)| format!("Kafka did not take job {}: {e}", job.id))?;
        placed.push((delivery.partition, delivery.offset));
    }
    Ok(placed)
}

/// How the worker keeps its records' effects exactly once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The offset-watermark mode: one claim per batch, the watermark moved with the effects.
    Watermarks,
    /// The per-message marker mode: one `#[idempotent]` call per record, keyed by the job's
    /// id (header [`JOB_ID`]); offsets committed to Kafka after the batch.
    Markers,
}

/// What the worker did, in the order it happened; one line each, which the tests' parent
/// process reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A batch of records came (`partition:offset` of each).
    Batch(Vec<(i32, i64)>),
    /// A record's effect was committed by this delivery.
    Applied {
        id: String,
        partition: i32,
        offset: i64,
    },
    /// A record was handled before (below the watermark, or a marker of its job).
    Duplicate {
        id: String,
        partition: i32,
        offset: i64,
    },
    /// A record that cannot be handled (not a job; no id header in the marker mode):
    /// skipped, and its offset committed with the batch's.
    Refused {
        partition: i32,
        offset: i64,
        why: String,
    },
    /// The batch's transaction committed (the watermark mode) or its handlers returned
    /// (the marker mode); Kafka's commit has not been made yet.
    Committed,
    /// The batch failed; nothing of it was kept, its records come again.
    Failed(String),
    /// The worker stopped inside its first batch, its transaction open (a test's hold).
    Holding,
    /// An error of the consumer (a partition it will not consume, a broker it cannot reach).
    Error(String),
}

impl std::fmt::Display for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Event::Batch(records) => {
                let at: Vec<String> = records.iter().map(|(p, o)| format!("{p}:{o}")).collect();
                write!(f, "BATCH {}", at.join(","))
            }
            Event::Applied {
                id,
                partition,
                offset,
            } => {
                write!(f, "APPLIED {id} {partition}:{offset}")
            }
            Event::Duplicate {
                id,
                partition,
                offset,
            } => {
                write!(f, "DUPLICATE {id} {partition}:{offset}")
            }
            Event::Refused {
                partition,
                offset,
                why,
            } => {
                write!(f, "REFUSED {partition}:{offset} {why}")
            }
            Event::Committed => f.write_str("COMMITTED"),
            Event::Failed(e) => write!(f, "FAILED {e}"),
            Event::Holding => f.write_str("HOLDING"),
            Event::Error(e) => write!(f, "ERROR {e}"),
        }
    }
}

/// Where the worker stops for a test, until the file `gate` exists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hold {
    /// After its first batch's effects ran, before their commit (a batch in flight).
    BeforeCommit(PathBuf),
    /// After its first batch committed, before Kafka's offset commit (a kill window).
    AfterCommit(PathBuf),
}

/// The worker's settings.
#[derive(Debug, Clone)]
pub struct Options {
    pub mode: Mode,
    /// The most records a batch takes.
    pub batch: usize,
    /// The effects' table: one row per applied job, with no unique index, so that a job
    /// applied twice shows.
    pub effects: String,
    pub hold: Option<Hold>,
}

/// The handler of the marker mode: one effect row per job, the marker in the same
/// transaction.
#[idem::idempotent(key = "job.id", scope = "kafka.top_up")]
pub async fn apply_top_up<DB: Effects>(
    tx: &mut Transaction<'_, DB>,
    job: &TopUp,
    effects: &str,
) -> Result<(), idem::Error> {
    DB::insert(tx, effects, job, -1, -1).await?;
    Ok(())
}

/// The effects' statement, on each database the example runs on.
pub trait Effects: idem::Backend {
    /// `CREATE TABLE` of the effects' table.
    fn create(effects: &str) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {effects} (job TEXT NOT NULL, account BIGINT NOT NULL, \
             credits BIGINT NOT NULL, part INTEGER NOT NULL, pos BIGINT NOT NULL)"
        )
    }

    /// Inserts one effect row.
    fn insert<'a>(
        tx: &'a mut Transaction<'_, Self>,
        effects: &'a str,
        job: &'a TopUp,
        partition: i32,
        offset: i64,
    ) -> impl std::future::Future<Output = Result<(), sqlx::Error>> + Send + 'a;
}

macro_rules! effects {
    ($($db:ty => $sql:literal),*) => {$(
        impl Effects for $db {
            async fn insert<'a>(
                tx: &'a mut Transaction<'_, Self>,
                effects: &'a str,
                job: &'a TopUp,
                partition: i32,
                offset: i64,
            ) -> Result<(), sqlx::Error> {
                let sql = format!($sql, effects);
                sqlx::query(AssertSqlSafe(sql))
                    .bind(&job.id)
                    .bind(job.account)
                    .bind(job.credits)
                    .bind(partition)
                    .bind(offset)
                    .execute(&mut **tx)
                    .await?;
                Ok(())
            }
        }
    )*};
}

effects!(
    sqlx::Postgres => "INSERT INTO {} (job, account, credits, part, pos) VALUES ($1, $2, $3, $4, $5)",
    sqlx::Sqlite => "INSERT INTO {} (job, account, credits, part, pos) VALUES (?1, ?2, ?3, ?4, ?5)"
);

/// Makes the effects' table.
pub async fn create_effects<DB: Effects>(pool: &Pool<DB>, effects: &str) -> Result<(), sqlx::Error>
where
    for<'c> &'c mut <DB as Database>::Connection: sqlx::Executor<'c, Database = DB>,
    <DB as Database>::Arguments: for<'q> sqlx::IntoArguments<DB>,
{
    let mut conn = pool.acquire().await?;
    sqlx::query(AssertSqlSafe(DB::create(effects)))
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Waits for the file `gate` (a test opens it); polling a file is the worker's business, not a
/// test's synchronisation.
async fn wait_for(gate: &std::path::Path) {
    while !gate.exists() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Runs the worker on `consumer` until `stop` resolves, telling each [`Event`] to `tell`.
/// A consumer's error is told and ends the loop with it.
pub async fn work<DB: Effects>(
    consumer: &mut Consumer<DB>,
    options: &Options,
    mut tell: impl FnMut(Event),
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), idem::Error> {
    let mut stop = std::pin::pin!(stop);
    let mut hold = options.hold.clone();
    loop {
        let records = tokio::select! {
            () = &mut stop => return Ok(()),
            got = consumer.next_batch(options.batch, Duration::from_millis(200)) => got,
        };
        let records = match records {
            Ok(records) if records.is_empty() => continue,
            Ok(records) => records,
            Err(e) => {
                tell(Event::Error(e.to_string()));
                return Err(e);
            }
        };
        tell(Event::Batch(
            records
                .iter()
                .map(|r| (r.partition(), r.offset()))
                .collect(),
        ));
        let kept = match options.mode {
            Mode::Watermarks => {
                watermark_batch(consumer, options, &records, &mut hold, &mut tell).await
            }
            Mode::Markers => marker_batch(consumer, options, &records, &mut tell).await,
        };
        match kept {
            Ok(()) => {
                tell(Event::Committed);
                if let Some(Hold::AfterCommit(gate)) = &hold {
                    wait_for(gate).await;
                    hold = None;
                }
                if options.mode == Mode::Markers {
                    consumer.commit(&records)?;
                }
            }
            Err(e) => tell(Event::Failed(e.to_string())),
        }
    }
}

/// The job a record carries, or why it carries none.
fn job_of(record: &Record) -> Result<TopUp, String> {
    let payload = record.payload().ok_or("no value")?;
    serde_json::from_slice(payload).map_err(|e| format!("not a job: {e}"))
}

/// One claim for the whole batch; the fresh records' effects in its transaction.
async fn watermark_batch<DB: Effects>(
    consumer: &mut Consumer<DB>,
    options: &Options,
    records: &[Record],
    hold: &mut Option<Hold>,
    tell: &mut impl FnMut(Event),
) -> Result<(), idem::Error> {
    let mut claim = consumer.claim(records).await?;
    let mut told = Vec::new();
    let ran: Result<(), idem::Error> = async {
        for (i, record) in records.iter().enumerate() {
            let (partition, offset) = (record.partition(), record.offset());
            let job = match job_of(record) {
                Ok(job) => job,
                Err(why) => {
                    told.push(Event::Refused {
                        partition,
                        offset,
                        why,
                    });
                    continue;
                }
            };
            let event = match claim.is_fresh(i) {
                true => {
                    let tx = claim.tx().expect("a fresh record has the transaction");
                    DB::insert(tx, &options.effects, &job, partition, offset).await?;
                    Event::Applied {
                        id: job.id,
                        partition,
                        offset,
                    }
                }
                false => Event::Duplicate {
                    id: job.id,
                    partition,
                    offset,
                },
            };
            told.push(event);
        }
        Ok(())
    }
    .await;
    if let Some(Hold::BeforeCommit(gate)) = hold.as_ref() {
        tell(Event::Holding);
        wait_for(gate).await;
        *hold = None;
    }
    let _batch = claim.finish(ran).await?;
    for event in told {
        tell(event);
    }
    Ok(())
}

/// One `#[idempotent]` call per record, keyed by the job's id; a failed one moves the
/// partitions back to it and ends the batch.
async fn marker_batch<DB: Effects>(
    consumer: &mut Consumer<DB>,
    options: &Options,
    records: &[Record],
    tell: &mut impl FnMut(Event),
) -> Result<(), idem::Error> {
    let store: Store<DB> = consumer.store().clone();
    for (i, record) in records.iter().enumerate() {
        let (partition, offset) = (record.partition(), record.offset());
        let job = match (job_of(record), record.id_key(JOB_ID)) {
            (Ok(job), Ok(_)) => job,
            (Err(why), _) => {
                tell(Event::Refused {
                    partition,
                    offset,
                    why,
                });
                continue;
            }
            (_, Err(e)) => {
                tell(Event::Refused {
                    partition,
                    offset,
                    why: e.to_string(),
                });
                continue;
            }
        };
        match apply_top_up(&store, &job, &options.effects).await {
            Ok(Outcome::Applied(())) => tell(Event::Applied {
                id: job.id,
                partition,
                offset,
            }),
            Ok(_) => tell(Event::Duplicate {
                id: job.id,
                partition,
                offset,
            }),
            Err(e) => {
                consumer.rewind(&records[i..]).await?;
                return Err(e);
            }
        }
    }
    Ok(())
}
