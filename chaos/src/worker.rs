//! A worker process: consumes the RabbitMQ queue and the JetStream stream at once, runs each
//! job's handler, acks after `Applied` or `Duplicate` and nacks on any error (a group that
//! failed as a whole included: its redelivery settles each job by its marker). It reconnects to
//! whatever went away and runs until it is killed; it prints one line per event on stdout,
//! which the harness reads.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use futures_util::StreamExt as _;
use idem::{Group, GroupOptions, Outcome, Store};
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use serde::{Deserialize, Serialize};
use sqlx::mysql::MySqlPoolOptions;
use sqlx::postgres::PgPoolOptions;
use sqlx::{MySql, Postgres};

use crate::jobs::{self, Db, Job, JobError, Mode};

/// The variable that carries a worker's configuration (JSON).
pub const CONFIG_VAR: &str = "IDEM_CHAOS_WORKER";

/// Deliveries in flight at once per broker.
const PREFETCH: u16 = 8;
/// A delivery gives up after this long and is nacked: a connection the proxy left half-open
/// never answers, and the job must come back rather than hang the worker.
const JOB_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Config {
    pub index: usize,
    pub pg_url: String,
    pub my_url: String,
    pub amqp_url: String,
    pub nats_urls: Vec<String>,
    pub queue: String,
    pub stream: String,
    pub consumer: String,
    pub payments_url: String,
}

struct Ctx {
    pg: Store<Postgres>,
    my: Store<MySql>,
    /// Group commit on the same pools: the deliveries in flight at once (a prefetch, a
    /// fetch's jobs) share transactions.
    pg_group: Group<Postgres>,
    my_group: Group<MySql>,
    http: reqwest::Client,
    payments_url: String,
}

/// One line on stdout; `println!` flushes at the newline, so a line printed before a kill has
/// reached the harness.
fn event(line: std::fmt::Arguments<'_>) {
    println!("EV {line}");
}

pub async fn run(config: Config) -> ! {
    // Lazy pools: a worker starts (and restarts) while a database is down, and a dead
    // connection fails its delivery instead of being pinged before each one.
    let pg = PgPoolOptions::new()
        .max_connections(u32::from(PREFETCH) * 2 + 1)
        .acquire_timeout(Duration::from_secs(5))
        .test_before_acquire(false)
        .connect_lazy(&config.pg_url)
        .expect("the PostgreSQL URL parses");
    let my = MySqlPoolOptions::new()
        .max_connections(u32::from(PREFETCH) * 2 + 1)
        .acquire_timeout(Duration::from_secs(5))
        .test_before_acquire(false)
        .connect_lazy(&config.my_url)
        .expect("the MariaDB URL parses");
    let (pg, my) = (Store::new(pg), Store::new(my));
    // One lane: the few deliveries of one database in flight at once in a worker all meet
    // in one group, instead of splitting over two.
    let options = GroupOptions::new().lanes(1);
    let ctx = Arc::new(Ctx {
        pg_group: pg
            .group(options)
            .expect("the default group options are valid"),
        my_group: my
            .group(options)
            .expect("the default group options are valid"),
        pg,
        my,
        http: reqwest::Client::new(),
        payments_url: config.payments_url.clone(),
    });
    event(format_args!("STARTED {}", config.index));
    let rabbit = {
        let (ctx, config) = (ctx.clone(), config.clone());
        tokio::spawn(async move {
            loop {
                if let Err(e) = rabbit_session(&ctx, &config).await {
                    eprintln!("worker {}: RabbitMQ: {e}", config.index);
                }
                // A pause between reconnections, not a synchronisation.
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    let nats = tokio::spawn(async move {
        loop {
            if let Err(e) = nats_session(&ctx, &config).await {
                eprintln!("worker {}: JetStream: {e}", config.index);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    let _ = tokio::join!(rabbit, nats);
    unreachable!("the worker loops never end")
}

/// Runs one job's handler; `Ok(true)` applied, `Ok(false)` duplicate.
async fn handle(ctx: &Ctx, job: &Job, via: &str) -> Result<bool, JobError> {
    let outcome = match (job.mode, job.db) {
        (Mode::Tx, Db::Pg) => jobs::effect_pg(&ctx.pg, job, via).await?,
        (Mode::Tx, Db::My) => jobs::effect_my(&ctx.my, job, via).await?,
        (Mode::Group, Db::Pg) => jobs::effect_grouped_pg(&ctx.pg_group, job, via).await?,
        (Mode::Group, Db::My) => jobs::effect_grouped_my(&ctx.my_group, job, via).await?,
        (Mode::Lease, Db::Pg) => jobs::charge(&ctx.pg, job, &ctx.http, &ctx.payments_url).await?,
        (Mode::Lease, Db::My) => jobs::charge(&ctx.my, job, &ctx.http, &ctx.payments_url).await?,
    };
    Ok(matches!(outcome, Outcome::Applied(())))
}

fn report(job: &Job, via: &str, result: &Result<bool, JobError>) {
    match result {
        Ok(true) => event(format_args!("APPLIED {} {via}", job.id)),
        Ok(false) => event(format_args!("DUPLICATE {} {via}", job.id)),
        Err(e) => event(format_args!("NACK {} {} {e}", job.id, e.kind())),
    }
}

async fn bounded(f: impl Future<Output = Result<bool, JobError>>) -> Result<bool, JobError> {
    tokio::time::timeout(JOB_TIMEOUT, f)
        .await
        .unwrap_or(Err(JobError::Deadline))
}

async fn rabbit_session(ctx: &Ctx, config: &Config) -> Result<(), lapin::Error> {
    let connection = Connection::connect(&config.amqp_url, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel
        .basic_qos(PREFETCH, BasicQosOptions::default())
        .await?;
    let consumer = channel
        .basic_consume(
            config.queue.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let failed: std::sync::Mutex<Option<lapin::Error>> = std::sync::Mutex::new(None);
    let failed = &failed;
    consumer
        .for_each_concurrent(usize::from(PREFETCH), |delivery| async move {
            let delivery = match delivery {
                Ok(d) => d,
                Err(e) => {
                    failed
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .get_or_insert(e);
                    return;
                }
            };
            let Ok(job) = serde_json::from_slice::<Job>(&delivery.data) else {
                event(format_args!("GARBAGE rabbit"));
                drop(delivery.acker.nack(BasicNackOptions::default()).await);
                return;
            };
            event(format_args!(
                "DELIVERED {} rabbit {}",
                job.id, delivery.redelivered
            ));
            let result = bounded(handle(ctx, &job, "rabbit")).await;
            // A lost ack or nack: the broker redelivers once the channel is gone, and the
            // redelivery is a duplicate.
            let sent = if result.is_ok() {
                delivery.acker.ack(BasicAckOptions::default()).await
            } else {
                // A short backoff, as a real worker has: a database that is down would
                // otherwise see the same messages again at once, thousands of times.
                tokio::time::sleep(Duration::from_millis(100)).await;
                let requeue = BasicNackOptions {
                    requeue: true,
                    ..Default::default()
                };
                delivery.acker.nack(requeue).await
            };
            // Told once the ack or nack is written: a delivery the harness saw end is no
            // longer unacked at the broker (the harness's drain counts on it).
            report(&job, "rabbit", &result);
            if let Err(e) = sent {
                failed
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get_or_insert(e);
            }
        })
        .await;
    match failed.lock().unwrap_or_else(|e| e.into_inner()).take() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

async fn nats_session(ctx: &Ctx, config: &Config) -> Result<(), async_nats::Error> {
    let client = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connect(config.nats_urls.clone())
        .await?;
    let js = jetstream::new(client);
    let stream = js.get_stream(&config.stream).await?;
    let consumer: jetstream::consumer::PullConsumer = stream.get_consumer(&config.consumer).await?;
    loop {
        let mut fetched = consumer
            .fetch()
            .max_messages(usize::from(PREFETCH) * 2)
            .expires(Duration::from_secs(1))
            .messages()
            .await?;
        let mut batch = Vec::new();
        while let Some(message) = fetched.next().await {
            let message = message?;
            match serde_json::from_slice::<Job>(&message.payload) {
                Ok(job) => {
                    let redelivered = message.info().map(|i| i.delivered > 1).unwrap_or(false);
                    event(format_args!("DELIVERED {} nats {redelivered}", job.id));
                    batch.push((job, message));
                }
                Err(_) => {
                    event(format_args!("GARBAGE nats"));
                    drop(message.ack_with(AckKind::Term).await);
                }
            }
        }
        handle_fetch(ctx, batch).await;
    }
}

/// The transaction-mode jobs of a fetch go in one batch claim per database; the lease-mode
/// and group-commit ones one by one, concurrently (the group-commit ones meet in groups).
async fn handle_fetch(ctx: &Ctx, batch: Vec<(Job, jetstream::Message)>) {
    let (mut pg, mut my, mut single) = (Vec::new(), Vec::new(), Vec::new());
    for (job, message) in batch {
        match (job.mode, job.db) {
            (Mode::Tx, Db::Pg) => pg.push((job, message)),
            (Mode::Tx, Db::My) => my.push((job, message)),
            (Mode::Lease | Mode::Group, _) => single.push((job, message)),
        }
    }
    let pg_batch = async {
        let jobs: Vec<Job> = pg.iter().map(|(j, _)| j.clone()).collect();
        let outcomes = bounded_batch(async { jobs::effects_pg(&ctx.pg, &jobs).await }).await;
        settle_batch(&pg, outcomes).await;
    };
    let my_batch = async {
        let jobs: Vec<Job> = my.iter().map(|(j, _)| j.clone()).collect();
        let outcomes = bounded_batch(async { jobs::effects_my(&ctx.my, &jobs).await }).await;
        settle_batch(&my, outcomes).await;
    };
    let singles = futures_util::future::join_all(single.iter().map(|(job, message)| async move {
        let result = bounded(handle(ctx, job, "nats")).await;
        settle(message, result.is_ok()).await;
        report(job, "nats", &result);
    }));
    tokio::join!(pg_batch, my_batch, singles);
}

async fn bounded_batch(
    f: impl Future<Output = Result<idem::Batch<()>, JobError>>,
) -> Result<Vec<bool>, JobError> {
    match tokio::time::timeout(JOB_TIMEOUT, f).await {
        Ok(Ok(batch)) => Ok(batch.outcomes().iter().map(Outcome::is_applied).collect()),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(JobError::Deadline),
    }
}

async fn settle_batch(items: &[(Job, jetstream::Message)], outcomes: Result<Vec<bool>, JobError>) {
    if items.is_empty() {
        return;
    }
    match outcomes {
        Ok(applied) => {
            for ((job, message), applied) in items.iter().zip(applied) {
                settle(message, true).await;
                report(job, "batch", &Ok(applied));
            }
        }
        Err(e) => {
            for (job, message) in items {
                settle(message, false).await;
                event(format_args!("NACK {} {} {e}", job.id, e.kind()));
            }
        }
    }
}

/// Acks (confirmed by the server) or naks with a short delay. A lost ack is redelivered after
/// the consumer's `ack_wait`, and that delivery is a duplicate.
async fn settle(message: &jetstream::Message, ok: bool) {
    let sent = if ok {
        message.double_ack().await
    } else {
        message
            .ack_with(AckKind::Nak(Some(Duration::from_millis(300))))
            .await
    };
    if let Err(e) = sent {
        eprintln!("JetStream: the ack was lost: {e}");
    }
}
