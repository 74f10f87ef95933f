//! The `rabbitmq_worker` example's loop (idem's runner on the RabbitMQ adapter) against the
//! real RabbitMQ, with worker processes that are SIGKILLed at chosen points, and PostgreSQL as
//! the database the workers share. Every effect is a row in a table without a unique index, so
//! an effect applied twice shows.

#[allow(dead_code)]
#[path = "../rabbitmq_worker.rs"]
mod rabbitmq_worker;

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use idem::settle::rabbitmq::Queue;
use idem::settle::{Runner, Settled, Tally};
use idem::{Disposition, Outcome, Settle, Store};
use lapin::options::QueueDeleteOptions;
use rabbitmq_worker::{TopUp, amqp_url, connect};
use sqlx::{AssertSqlSafe, PgPool, Postgres, Transaction};
use support::{CHILD_MODE, Lines, Worker, child_env, postgres, stop_signal, within};

const CHILD_QUEUE: &str = "IDEM_RMQ_QUEUE";
const CHILD_MARKERS: &str = "IDEM_RMQ_MARKERS";
const CHILD_EFFECTS: &str = "IDEM_RMQ_EFFECTS";

/// The top-up of these tests: one row per application in `effects`, and, for the crash
/// test, a body that prints a line and waits to be killed after its `INSERT`.
#[idem::idempotent(key = "job.id", scope = "rmq.top_up", wait = "5s")]
async fn apply_pg(
    tx: &mut Transaction<'_, Postgres>,
    job: &TopUp,
    effects: &str,
    hang: bool,
) -> sqlx::Result<()> {
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {effects} (job, credits) VALUES ($1, $2)"
    )))
    .bind(&job.id)
    .bind(job.credits)
    .execute(&mut **tx)
    .await?;
    if hang {
        println!("IN BODY {}", job.id);
        std::future::pending::<()>().await;
    }
    Ok(())
}

/// A queue and two tables of one test, named after it and this process; dropped at the end,
/// also when the test fails.
struct Names {
    queue: String,
    markers: String,
    effects: String,
}

impl Names {
    async fn create(test: &str) -> Names {
        let id = format!("{test}_{}", std::process::id());
        let names = Names {
            queue: format!("idem-test-{id}"),
            markers: format!("rmq_{id}_markers"),
            effects: format!("rmq_{id}_effects"),
        };
        let pool = postgres(2).await;
        for sql in [
            format!("DROP TABLE IF EXISTS {}", names.effects),
            format!("DROP TABLE IF EXISTS {}", names.markers),
            format!("DROP TABLE IF EXISTS {}_outbox", names.markers),
            format!(
                "CREATE TABLE {} (job text NOT NULL, credits bigint NOT NULL)",
                names.effects
            ),
        ] {
            sqlx::query(AssertSqlSafe(sql))
                .execute(&pool)
                .await
                .unwrap();
        }
        names.store(pool).migrate().await.unwrap();
        let conn = amqp().await;
        let ch = conn.create_channel().await.unwrap();
        for queue in queues(&names.queue) {
            ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await
                .unwrap();
        }
        rabbitmq_worker::declare_queue(&ch, &names.queue)
            .await
            .unwrap();
        conn.close(200, "declared".into()).await.unwrap();
        names
    }

    fn store(&self, pool: PgPool) -> Store<Postgres> {
        Store::new(pool).with_table(&self.markers).unwrap()
    }

    fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            (CHILD_QUEUE, self.queue.clone()),
            (CHILD_MARKERS, self.markers.clone()),
            (CHILD_EFFECTS, self.effects.clone()),
        ]
    }

    /// Messages ready in the queue (not those a live consumer holds unacked).
    async fn ready(&self) -> u32 {
        let conn = amqp().await;
        let ch = conn.create_channel().await.unwrap();
        let ready = rabbitmq_worker::declare_queue(&ch, &self.queue)
            .await
            .unwrap();
        conn.close(200, "counted".into()).await.unwrap();
        ready
    }

    /// (rows, distinct jobs, sum of credits) of the effects table.
    async fn effects(&self) -> (i64, i64, i64) {
        let pool = postgres(1).await;
        let row = effects(&pool, &self.effects).await;
        pool.close().await;
        row
    }
}

impl Drop for Names {
    fn drop(&mut self) {
        // Taken, not cloned: a clone would be dropped on the cleanup thread and run this again.
        let names = (
            std::mem::take(&mut self.queue),
            std::mem::take(&mut self.markers),
            std::mem::take(&mut self.effects),
        );
        // Drop cannot await; a runtime of its own on another thread can, also while the test
        // unwinds from a failed assertion.
        let done = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                if let Ok(conn) = connect(&amqp_url()).await {
                    if let Ok(ch) = conn.create_channel().await {
                        for queue in queues(&names.0) {
                            drop(
                                ch.queue_delete(queue.as_str().into(), Default::default())
                                    .await,
                            );
                        }
                    }
                    drop(conn.close(200, "cleanup".into()).await);
                }
                let pool = postgres(1).await;
                let outbox = format!("{}_outbox", names.1);
                for t in [&names.2, &names.1, &outbox] {
                    drop(
                        sqlx::query(AssertSqlSafe(format!("DROP TABLE IF EXISTS {t}")))
                            .execute(&pool)
                            .await,
                    );
                }
                pool.close().await;
            });
        });
        drop(done.join());
    }
}

/// The test's queue, its dead letters' and every retry queue the default policy can use.
fn queues(queue: &str) -> Vec<String> {
    let settle = Settle::new();
    let mut delays: Vec<Duration> = (1..=settle.get_max_deliveries())
        .filter_map(|n| match settle.decide(&failed(), n) {
            Disposition::Retry { after } => Some(after),
            _ => None,
        })
        .collect();
    delays.push(match settle.decide(&in_progress(), 1) {
        Disposition::Retry { after } => after,
        other => panic!("InProgress is not retried: {other:?}"),
    });
    let mut names: Vec<String> = delays
        .iter()
        .map(|d| Queue::retry_queue(queue, *d))
        .collect();
    names.extend([queue.to_owned(), Queue::dead_letters(queue)]);
    names
}

fn failed() -> Result<Outcome<()>, idem::Error> {
    Err(idem::Error::Database(sqlx::Error::PoolTimedOut))
}

fn in_progress() -> Result<Outcome<()>, idem::Error> {
    Err(idem::Error::InProgress {
        scope: "rmq.top_up".into(),
        key: "-".into(),
    })
}

/// A worker's line for a settled delivery: `ACKED applied id delivery=N`, `RETRIED id
/// delivery=N: error`, `DEAD id delivery=N: reason`.
fn settled_line(s: &Settled<'_>) -> String {
    let id = s.id.unwrap_or("-");
    match s.disposition {
        Disposition::Ack => format!("ACKED {} {id} delivery={}", s.outcome, s.delivery),
        Disposition::Retry { .. } => format!(
            "RETRIED {id} delivery={}: {}",
            s.delivery,
            s.error.unwrap_or("-")
        ),
        Disposition::DeadLetter { reason } => {
            format!("DEAD {id} delivery={}: {reason}", s.delivery)
        }
        other => format!("OTHER {other:?}"),
    }
}

/// The runner of the worker processes: the example's settings, the lines above.
fn runner() -> Runner {
    Runner::new()
        .in_flight(16)
        .on_settled(|s| println!("{}", settled_line(s)))
}

/// (rows, distinct jobs, sum of credits) of an effects table.
async fn effects(pool: &PgPool, table: &str) -> (i64, i64, i64) {
    sqlx::query_as(AssertSqlSafe(format!(
        "SELECT count(*), count(DISTINCT job), coalesce(sum(credits), 0)::bigint FROM {table}"
    )))
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn amqp() -> lapin::Connection {
    let url = amqp_url();
    connect(&url).await.unwrap_or_else(|e| panic!("{e}"))
}

fn job(n: i64) -> TopUp {
    TopUp {
        id: format!("top-up-{n}"),
        account: n,
        credits: n,
    }
}

/// Publishes `jobs` in this order with publisher confirms, awaited after all were sent.
async fn publish_all(queue: &str, jobs: impl IntoIterator<Item = TopUp>) {
    let conn = amqp().await;
    let ch = rabbitmq_worker::confirming_channel(&conn).await.unwrap();
    let mut confirms = Vec::new();
    for job in jobs {
        let payload = serde_json::to_vec(&job).unwrap();
        let confirm = ch
            .basic_publish(
                "".into(),
                queue.into(),
                Default::default(),
                &payload,
                lapin::BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_message_id(job.id.as_str().into()),
            )
            .await
            .unwrap();
        confirms.push(confirm);
    }
    for confirm in confirms {
        assert!(confirm.await.unwrap().is_ack(), "the broker refused a job");
    }
    conn.close(200, "published".into()).await.unwrap();
}

/// The worker process: consumes the test's queue with the runner until told to stop.
/// Modes: `work`; `pause_after_commit` (prints `COMMITTED id` once the transaction committed,
/// before the ack, and waits to be killed); `hang_in_body` (the body prints `IN BODY id` after
/// its `INSERT` and waits to be killed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a worker process that the tests start themselves"]
async fn child_process() {
    let Ok(mode) = std::env::var(CHILD_MODE) else {
        panic!("child_process is a worker process that the tests start with {CHILD_MODE} set")
    };
    let (queue, markers, effects) = (
        child_env(CHILD_QUEUE),
        child_env(CHILD_MARKERS),
        child_env(CHILD_EFFECTS),
    );
    let pause = mode == "pause_after_commit";
    let hang = mode == "hang_in_body";
    let store = Store::new(postgres(8).await).with_table(&markers).unwrap();
    let conn = amqp().await;
    let deliveries = Queue::consume(&conn, &queue, 16).await.unwrap();
    println!("READY");
    let (store, effects) = (&store, &effects);
    let handler = |job: TopUp| async move {
        println!("DELIVERED {}", job.id);
        let outcome = apply_pg(store, &job, effects, hang).await;
        // Printed before the settlement: a kill can repeat it, never lose it.
        match &outcome {
            Ok(Outcome::Applied(())) => println!("HANDLED applied {}", job.id),
            Ok(_) => println!("HANDLED duplicate {}", job.id),
            Err(_) => {}
        }
        if pause && matches!(outcome, Ok(Outcome::Applied(()))) {
            println!("COMMITTED {}", job.id);
            std::future::pending::<()>().await;
        }
        outcome
    };
    let tally = runner().run(deliveries, handler, stop_signal()).await;
    // On stdout, where the parent reads it.
    let tally = tally.unwrap_or_else(|e| {
        println!("RUNNER FAILED: {e:?}");
        panic!("the runner failed: {e}")
    });
    conn.close(200, "stopped".into()).await.unwrap();
    println!("STOPPED {tally:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn example_applies_each_job_once_though_published_twice() {
    let dir = std::env::temp_dir().join(format!("idem-test-rabbitmq-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut out = Vec::new();
    let url = amqp_url();
    let report = within(
        120,
        "the rabbitmq_worker example",
        rabbitmq_worker::run(&url, &dir.join("jobs.db"), &mut out),
    )
    .await;
    std::fs::remove_dir_all(&dir).unwrap();
    let text = String::from_utf8(out).unwrap();
    let report = report.unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(
        (
            report.tally.applied,
            report.tally.acked_otherwise,
            report.tally.retried,
            report.tally.dead_lettered
        ),
        (5, 5, 0, 0),
        "{text}"
    );
    assert_eq!(report.balances, [(1, 160), (2, 190)], "{text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_between_commit_and_ack_the_redelivery_is_a_duplicate() {
    let names = Names::create("commit_ack").await;
    publish_all(&names.queue, [job(1)]).await;

    let mut lines = Lines::new();
    let first = Worker::spawn(0, "pause_after_commit", &names.env(), lines.tx.clone());
    lines.expect("COMMITTED top-up-1", 60).await;
    // Committed and not acked: the effect is in, the message is still RabbitMQ's.
    assert_eq!(names.effects().await, (1, 1, 1));
    assert!(!first.kill().await.success());

    let mut second = Worker::spawn(1, "work", &names.env(), lines.tx.clone());
    let (_, acked) = lines.expect("ACKED", 60).await;
    // RabbitMQ's flag made it the second delivery.
    assert_eq!(
        acked,
        "ACKED duplicate top-up-1 delivery=2",
        "{}",
        lines.dump()
    );
    second.stop().await;
    lines.expect("STOPPED", 60).await;
    second.succeed().await;

    assert_eq!(names.effects().await, (1, 1, 1), "{}", lines.dump());
    assert_eq!(names.ready().await, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_inside_the_body_the_redelivery_applies_once() {
    let names = Names::create("in_body").await;
    publish_all(&names.queue, [job(1)]).await;

    let mut lines = Lines::new();
    let first = Worker::spawn(0, "hang_in_body", &names.env(), lines.tx.clone());
    lines.expect("IN BODY top-up-1", 60).await;
    // The INSERT ran but did not commit: nobody else sees it.
    assert_eq!(names.effects().await, (0, 0, 0));
    assert!(!first.kill().await.success());

    let mut second = Worker::spawn(1, "work", &names.env(), lines.tx.clone());
    // A claim that meets the dead worker's transaction before PostgreSQL rolled it back gets
    // `InProgress` after `wait` and is retried a second later: only an ack ends the wait.
    let (_, acked) = lines.expect("ACKED", 60).await;
    let delivery: u32 = acked
        .strip_prefix("ACKED applied top-up-1 delivery=")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{acked}\n{}", lines.dump()));
    assert!(delivery >= 2, "{acked}\n{}", lines.dump());
    second.stop().await;
    lines.expect("STOPPED", 60).await;
    second.succeed().await;

    assert_eq!(names.effects().await, (1, 1, 1), "{}", lines.dump());
    assert_eq!(names.ready().await, 0);
}

/// What the worker processes' lines tell.
#[derive(Debug, Default)]
struct Counts {
    delivered: u64,
    /// Acked at their second delivery or later.
    redelivered: u64,
    duplicates: u64,
    acked: u64,
    retried: u64,
}

impl Counts {
    fn add(&mut self, line: &str) {
        if line.starts_with("DELIVERED") {
            self.delivered += 1;
        } else if line.starts_with("HANDLED duplicate") {
            // Printed before the ack: a kill can repeat it, never lose it.
            self.duplicates += 1;
        } else if line.starts_with("ACKED") {
            self.acked += 1;
            self.redelivered += u64::from(!line.ends_with(" delivery=1"));
        } else if line.starts_with("RETRIED") {
            self.retried += 1;
        }
    }
}

/// 2,000 jobs published twice each, three worker processes, one SIGKILLed every 250 acks and
/// replaced; at the end the queue is empty and each job's effect is in exactly once.
#[tokio::test(flavor = "multi_thread")]
async fn soak_three_workers_killed_repeatedly_apply_every_job_once() {
    const JOBS: i64 = 2_000;
    const KILL_EVERY: u64 = 250;
    const WORKERS: usize = 3;
    let started = Instant::now();
    let names = Names::create("soak").await;
    // Each job's copy follows it three messages later, so that both copies are often in
    // flight at once in different workers (one of them waits on the other's claim).
    let order = (0..JOBS + 3).flat_map(|i| {
        let first = (i < JOBS).then(|| job(i + 1));
        let copy = (i >= 3).then(|| job(i - 2));
        first.into_iter().chain(copy)
    });
    publish_all(&names.queue, order).await;
    let published = 2 * JOBS as u64;

    let soak = async {
        let mut lines = Lines::new();
        let mut workers: Vec<Option<Worker>> = (0..WORKERS)
            .map(|i| Some(Worker::spawn(i, "work", &names.env(), lines.tx.clone())))
            .collect();
        let mut counts = Counts::default();
        let mut kills = 0_u64;
        let mut next_kill = KILL_EVERY;
        // Until every job's effect is in the database. Ack lines do not tell: a SIGKILL can
        // lose a printed ack (the message comes back) or an ack's line (the ack landed).
        let pool = postgres(1).await;
        loop {
            let next = lines.next_or_quiet(Duration::from_secs(3)).await;
            // Asked every 20 acks past the first copy of every job, and whenever the workers
            // go quiet (bounded: the whole soak runs under `within`).
            if (next.is_none() || (counts.acked >= JOBS as u64 && counts.acked % 20 == 0))
                && effects(&pool, &names.effects).await.1 == JOBS
            {
                break;
            }
            let Some((index, line)) = next else { continue };
            counts.add(&line);
            // Synchronised on the line just read: the worker that printed it has more of the
            // queue prefetched and probably a transaction open.
            // (A line a worker printed just before it was killed may still come: skip those.)
            if line.starts_with("ACKED")
                && counts.acked >= next_kill
                && counts.acked + KILL_EVERY < published
                && kills < 15
                && let Some(victim) = workers[index].take()
            {
                next_kill += KILL_EVERY;
                assert!(!victim.kill().await.success());
                kills += 1;
                let replacement = workers.len();
                workers.push(Some(Worker::spawn(
                    replacement,
                    "work",
                    &names.env(),
                    lines.tx.clone(),
                )));
            }
        }
        // Stop the live workers; they finish and settle what they hold, then print STOPPED.
        let mut live: Vec<Worker> = workers.into_iter().flatten().collect();
        for w in &mut live {
            w.stop().await;
        }
        let mut stopped = 0;
        while stopped < live.len() {
            let (_, line) = lines.next(60).await;
            stopped += usize::from(line.starts_with("STOPPED"));
            counts.add(&line);
        }
        for w in live {
            w.succeed().await;
        }
        (counts, kills, lines)
    };
    let (mut counts, kills, lines) = within(180, "the soak", soak).await;

    // A message whose ack a SIGKILL lost came back to the queue; drain it in this process
    // with the same runner, so that the test ends on an empty queue either way.
    let left = names.ready().await;
    let mut drained = 0;
    if left > 0 {
        let store = names.store(postgres(4).await);
        let conn = amqp().await;
        let deliveries = Queue::consume(&conn, &names.queue, 16).await.unwrap();
        let acks = Arc::new(AtomicU32::new(0));
        let done = Arc::new(tokio::sync::Notify::new());
        let (seen, all) = (acks.clone(), done.clone());
        let (store, effects) = (&store, &names.effects);
        let tally: Tally = within(
            60,
            "draining the queue",
            Runner::new()
                .in_flight(16)
                .on_settled(move |s| {
                    if s.disposition == &Disposition::Ack
                        && seen.fetch_add(1, Ordering::SeqCst) + 1 == left
                    {
                        all.notify_one();
                    }
                })
                .run(
                    deliveries,
                    |job: TopUp| async move { apply_pg(store, &job, effects, false).await },
                    done.notified(),
                ),
        )
        .await
        .unwrap();
        conn.close(200, "drained".into()).await.unwrap();
        assert_eq!(tally.applied, 0, "a lost ack's job was already applied");
        counts.duplicates += tally.acked_otherwise;
        drained = tally.acked();
    }

    let wall = started.elapsed();
    println!(
        "rabbitmq soak: {JOBS} jobs published twice ({published} messages), {WORKERS} worker \
         processes; {} deliveries, {} acked past their first delivery, {} duplicates skipped, \
         {} retries, {kills} SIGKILLs, {drained} drained after the stop; {:.1} s wall",
        counts.delivered,
        counts.redelivered,
        counts.duplicates,
        counts.retried,
        wall.as_secs_f64()
    );
    assert_eq!(names.ready().await, 0, "the queue is not empty");
    let expected_sum = JOBS * (JOBS + 1) / 2;
    assert_eq!(
        names.effects().await,
        (JOBS, JOBS, expected_sum),
        "(rows, distinct jobs, sum of credits)"
    );
    // Per row: each job's own credits, once.
    let pool = postgres(1).await;
    let wrong: Vec<(String, i64, i64)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT job, count(*), sum(credits)::bigint FROM {} GROUP BY job \
         HAVING count(*) <> 1 OR sum(credits) <> substr(job, 8)::bigint",
        names.effects
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    let markers: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {} WHERE scope = 'rmq.top_up'",
        names.markers
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    pool.close().await;
    assert!(wrong.is_empty(), "jobs applied other than once: {wrong:?}");
    assert_eq!(markers, JOBS);
    assert!(
        counts.acked + drained >= published - kills * 16,
        "acks lost beyond the kills' share"
    );
    assert!(
        counts.duplicates >= JOBS as u64,
        "every job's second copy is a duplicate: {} counted for {JOBS} jobs",
        counts.duplicates
    );
    // Up to 14 (one per 250 printed acks until the last 250); lines lost to the kills
    // themselves and an early end on the database's count make it vary.
    assert!(kills >= 5, "only {kills} kills\n{}", lines.dump());
    assert!(counts.redelivered >= 1, "no redelivery after {kills} kills");
}
