//! `--runner`: idem's consumer loop (`idem::settle::Runner` on its RabbitMQ source) against the
//! loop the examples wrote by hand before it (lapin's consumer stream, `for_each_concurrent`,
//! an ack or a nack per delivery), RabbitMQ to PostgreSQL, in one run.
//!
//! Each run publishes `JOBS` top-up jobs (persistent, to a durable queue of the run, not
//! timed), then times one loop consuming them until all are acked, the prefetch equal to the
//! jobs in flight (8 and 32): jobs/s, and the client's CPU time a job (this process's, which
//! also publishes nothing while timed). The handler is the same `#[idem::idempotent]` top-up on
//! 1,000 accounts in both. Each round runs both loops, every other round in the reverse order;
//! the report gives the medians and each ratio runner / by hand. Every run checks that each
//! job's effect landed once.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures_util::StreamExt as _;
use idem::settle::Runner;
use idem::settle::rabbitmq::Queue;
use idem::{Outcome, Store};
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection};
use sqlx::{AssertSqlSafe, PgPool, Postgres, Transaction};
use tokio::sync::Notify;

use crate::Res;
use crate::config::config;

const ACCOUNTS: i64 = 1_000;
const IN_FLIGHT: [u16; 2] = [8, 32];

#[derive(serde::Serialize, serde::Deserialize)]
struct Job {
    id: String,
    account: i64,
}

#[idem::idempotent(key = "job.id", scope = "bench.runner", wait = "5s")]
async fn top_up(tx: &mut Transaction<'_, Postgres>, job: &Job, table: &str) -> sqlx::Result<()> {
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {table} SET credits = credits + 1 WHERE id = $1"
    )))
    .bind(job.account)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

#[derive(Clone, Copy, PartialEq)]
enum Loop {
    ByHand,
    Runner,
}

/// One timed run: jobs/s and client CPU microseconds a job.
struct Run {
    rate: f64,
    cpu_us: f64,
}

pub(crate) async fn run(quick: bool) -> Res<()> {
    let (jobs, rounds) = if quick {
        (1_000_u64, 2)
    } else {
        (5_000_u64, 5)
    };
    let cfg = config();
    let accounts = format!("idem_bench_runner_accounts_{}", cfg.suffix);
    let markers = format!("idem_bench_runner_markers_{}", cfg.suffix);
    let queue = format!("idem-bench-runner-{}", cfg.suffix);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(40)
        .test_before_acquire(false)
        .connect(&cfg.pg_url)
        .await?;
    let url = std::env::var("IDEM_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    let amqp = Connection::connect(&url, Default::default())
        .await
        .map_err(|e| format!("cannot reach RabbitMQ at {url} (set IDEM_AMQP_URL): {e}"))?;
    let store = Store::new(pool.clone()).with_table(&markers)?;
    let mut table = Vec::new();
    for prefetch in IN_FLIGHT {
        let mut runs: Vec<(Loop, Run)> = Vec::new();
        for round in 0..rounds {
            let order = if round % 2 == 0 {
                [Loop::ByHand, Loop::Runner]
            } else {
                [Loop::Runner, Loop::ByHand]
            };
            for which in order {
                reset(&pool, &store, &accounts, &markers).await?;
                publish(&amqp, &queue, jobs).await?;
                let run = time(which, &amqp, &queue, &store, &accounts, prefetch, jobs).await?;
                check(&pool, &accounts, jobs).await?;
                eprintln!(
                    "runner: {} in flight, {}: {:.0} jobs/s, {:.0} µs CPU a job",
                    prefetch,
                    name(which),
                    run.rate,
                    run.cpu_us
                );
                runs.push((which, run));
            }
        }
        let median = |which: Loop, f: fn(&Run) -> f64| {
            let mut v: Vec<f64> = runs
                .iter()
                .filter(|r| r.0 == which)
                .map(|r| f(&r.1))
                .collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (hand, runner) = (
            median(Loop::ByHand, |r| r.rate),
            median(Loop::Runner, |r| r.rate),
        );
        let (hand_cpu, runner_cpu) = (
            median(Loop::ByHand, |r| r.cpu_us),
            median(Loop::Runner, |r| r.cpu_us),
        );
        table.push(format!(
            "| {prefetch} | {hand:.0} | {runner:.0} | {:.2} | {hand_cpu:.0} | {runner_cpu:.0} | {:.2} |",
            runner / hand,
            runner_cpu / hand_cpu
        ));
    }
    let ch = amqp.create_channel().await?;
    for q in [queue.clone(), Queue::dead_letters(&queue)] {
        ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await?;
    }
    amqp.close(200, "done".into()).await?;
    for t in [accounts, markers.clone(), format!("{markers}_outbox")] {
        sqlx::query(AssertSqlSafe(format!("DROP TABLE IF EXISTS {t}")))
            .execute(&pool)
            .await?;
    }
    println!(
        "## The consumer loop: idem's runner against the loop by hand (RabbitMQ to PostgreSQL, \
         {jobs} jobs a run, medians of {rounds} rounds)\n"
    );
    println!(
        "| in flight (= prefetch) | by hand, jobs/s | runner, jobs/s | ratio | by hand, µs CPU a job | runner, µs CPU a job | ratio |"
    );
    println!("|---|---|---|---|---|---|---|");
    for row in table {
        println!("{row}");
    }
    Ok(())
}

fn name(which: Loop) -> &'static str {
    match which {
        Loop::ByHand => "by hand",
        Loop::Runner => "runner",
    }
}

async fn reset(pool: &PgPool, store: &Store<Postgres>, accounts: &str, markers: &str) -> Res<()> {
    for sql in [
        format!("DROP TABLE IF EXISTS {accounts}"),
        format!("DROP TABLE IF EXISTS {markers}"),
        format!("DROP TABLE IF EXISTS {markers}_outbox"),
        format!("CREATE TABLE {accounts} (id bigint PRIMARY KEY, credits bigint NOT NULL)"),
        format!("INSERT INTO {accounts} SELECT g, 0 FROM generate_series(1, {ACCOUNTS}) g"),
    ] {
        sqlx::query(AssertSqlSafe(sql)).execute(pool).await?;
    }
    store.migrate().await?;
    Ok(())
}

async fn publish(amqp: &Connection, queue: &str, jobs: u64) -> Res<()> {
    let ch = amqp.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions::durable(),
        FieldTable::default(),
    )
    .await?;
    let mut confirms = Vec::new();
    for n in 0..jobs {
        let job = Job {
            id: format!("job-{n}"),
            account: 1 + (n as i64 % ACCOUNTS),
        };
        confirms.push(
            ch.basic_publish(
                "".into(),
                queue.into(),
                Default::default(),
                &serde_json::to_vec(&job)?,
                BasicProperties::default().with_delivery_mode(2),
            )
            .await?,
        );
    }
    for confirm in confirms {
        if !confirm.await?.is_ack() {
            return Err("RabbitMQ refused a job".into());
        }
    }
    ch.close(200, "published".into()).await?;
    Ok(())
}

/// Consumes the queue with `which` until `jobs` acks, timed.
async fn time(
    which: Loop,
    amqp: &Connection,
    queue: &str,
    store: &Store<Postgres>,
    accounts: &str,
    prefetch: u16,
    jobs: u64,
) -> Res<Run> {
    let acked = Arc::new(AtomicU64::new(0));
    let done = Arc::new(Notify::new());
    let count = {
        let (acked, done) = (acked.clone(), done.clone());
        move || {
            if acked.fetch_add(1, Ordering::SeqCst) + 1 == jobs {
                done.notify_one();
            }
        }
    };
    let handler = |job: Job| async move { top_up(store, &job, accounts).await };
    let cpu = cpu_time::ProcessTime::now();
    let started = Instant::now();
    match which {
        Loop::Runner => {
            let deliveries = Queue::consume(amqp, queue, prefetch).await?;
            Runner::new()
                .in_flight(prefetch.into())
                .on_settled(move |s| {
                    if s.disposition == &idem::Disposition::Ack {
                        count();
                    }
                })
                .run(deliveries, handler, done.notified())
                .await?;
        }
        Loop::ByHand => by_hand(amqp, queue, prefetch, handler, done.notified(), count).await?,
    }
    let elapsed = started.elapsed().max(Duration::from_micros(1));
    let cpu = cpu.elapsed();
    let n = acked.load(Ordering::SeqCst);
    Ok(Run {
        rate: n as f64 / elapsed.as_secs_f64(),
        cpu_us: cpu.as_secs_f64() * 1e6 / n as f64,
    })
}

/// The loop the examples wrote by hand: lapin's consumer, `for_each_concurrent`, an ack on
/// every outcome and a nack with requeue on every error.
async fn by_hand<F, Fut>(
    amqp: &Connection,
    queue: &str,
    prefetch: u16,
    handler: F,
    stop: impl Future<Output = ()>,
    acked: impl Fn(),
) -> Res<()>
where
    F: Fn(Job) -> Fut,
    Fut: Future<Output = Result<Outcome<()>, sqlx::Error>>,
{
    let ch = amqp.create_channel().await?;
    ch.basic_qos(prefetch, BasicQosOptions::default()).await?;
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let (handler, acked) = (&handler, &acked);
    (&mut consumer)
        .take_until(stop)
        .for_each_concurrent(usize::from(prefetch), |delivery| async move {
            let Ok(delivery) = delivery else { return };
            let Ok(job) = serde_json::from_slice::<Job>(&delivery.data) else {
                let nack = BasicNackOptions {
                    requeue: false,
                    ..Default::default()
                };
                drop(delivery.acker.nack(nack).await);
                return;
            };
            match handler(job).await {
                Ok(_) => {
                    if delivery.acker.ack(BasicAckOptions::default()).await.is_ok() {
                        acked();
                    }
                }
                Err(_) => {
                    let nack = BasicNackOptions {
                        requeue: true,
                        ..Default::default()
                    };
                    drop(delivery.acker.nack(nack).await);
                }
            }
        })
        .await;
    // Cancelled before the close, not by the consumer's drop: lapin sends a dropped active
    // consumer's cancel in the background, which can reach the server after the close, and
    // a frame on a closed channel is a connection error (every other channel dies with it).
    ch.basic_cancel(consumer.tag(), BasicCancelOptions::default())
        .await?;
    ch.close(200, "done".into()).await?;
    drop(consumer);
    Ok(())
}

async fn check(pool: &PgPool, accounts: &str, jobs: u64) -> Res<()> {
    let sum: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT coalesce(sum(credits), 0)::bigint FROM {accounts}"
    )))
    .fetch_one(pool)
    .await?;
    if sum != jobs as i64 {
        return Err(format!("{sum} effects for {jobs} jobs").into());
    }
    Ok(())
}
