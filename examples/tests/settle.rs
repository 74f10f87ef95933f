//! idem's consumer loop (`idem::settle::Runner`) on RabbitMQ through its adapter, in this
//! process, against the real broker and PostgreSQL: each case of the decision settled on the
//! broker, the redelivery cap, a retry that waits, a panic, and a shutdown with every delivery
//! in flight. Effects are rows in a table without a unique index, so one applied twice shows.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem::settle::rabbitmq::{DELIVERY_HEADER, Queue, REASON_HEADER};
use idem::settle::{Runner, Settled, Tally};
use idem::{Disposition, Outcome, Settle, Store};
use lapin::options::{BasicGetOptions, QueueDeleteOptions};
use lapin::types::AMQPValue;
use serde::{Deserialize, Serialize};
use sqlx::{AssertSqlSafe, PgPool, Postgres, Transaction};
use support::{postgres, within};
use tokio::sync::{Notify, watch};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Job {
    id: String,
    credits: i64,
}

/// One row in `effects` per application.
#[idem::idempotent(
    key = "job.id",
    scope = "settle.job",
    wait = "200ms",
    fingerprint = "job"
)]
async fn apply(tx: &mut Transaction<'_, Postgres>, job: &Job, effects: &str) -> sqlx::Result<()> {
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {effects} (job, credits) VALUES ($1, $2)"
    )))
    .bind(&job.id)
    .bind(job.credits)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Where a body stops inside its transaction: it tells `entered`, then waits for `release`.
#[derive(Default)]
struct Gate {
    entered: Notify,
    release: Notify,
}

/// [`apply`], with the body stopping at `gate` (when given) after its `INSERT`, inside the
/// claim's transaction.
#[idem::idempotent(
    key = "job.id",
    scope = "settle.job",
    wait = "200ms",
    fingerprint = "job"
)]
async fn apply_gated(
    tx: &mut Transaction<'_, Postgres>,
    job: &Job,
    effects: &str,
    gate: Option<&Gate>,
) -> sqlx::Result<()> {
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {effects} (job, credits) VALUES ($1, $2)"
    )))
    .bind(&job.id)
    .bind(job.credits)
    .execute(&mut **tx)
    .await?;
    if let Some(gate) = gate {
        gate.entered.notify_one();
        gate.release.notified().await;
    }
    Ok(())
}

/// A test's queue (with its dead letters' and retry queues) and tables, dropped at the end.
struct Case {
    queue: String,
    markers: String,
    store: Store<Postgres>,
    effects: String,
    pool: PgPool,
    amqp: lapin::Connection,
}

impl Case {
    /// `connections`: the pool's size, one for each transaction the case holds open at once.
    async fn new(test: &str, connections: u32) -> Case {
        let id = format!("{test}_{}", std::process::id());
        let pool = postgres(connections).await;
        let (markers, effects) = (
            format!("settle_{id}_markers"),
            format!("settle_{id}_effects"),
        );
        for sql in [
            format!("DROP TABLE IF EXISTS {effects}"),
            format!("DROP TABLE IF EXISTS {markers}"),
            format!("DROP TABLE IF EXISTS {markers}_outbox"),
            format!("CREATE TABLE {effects} (job text NOT NULL, credits bigint NOT NULL)"),
        ] {
            sqlx::query(AssertSqlSafe(sql))
                .execute(&pool)
                .await
                .unwrap();
        }
        let store = Store::new(pool.clone()).with_table(&markers).unwrap();
        store.migrate().await.unwrap();
        let url = rabbitmq_url();
        let amqp = lapin::Connection::connect(&url, Default::default())
            .await
            .unwrap_or_else(|e| panic!("cannot reach RabbitMQ at {url} (set IDEM_AMQP_URL): {e}"));
        let case = Case {
            queue: format!("idem-test-settle-{id}"),
            markers,
            store,
            effects,
            pool,
            amqp,
        };
        case.delete_queues().await;
        Queue::declare(&case.amqp, &case.queue).await.unwrap();
        case
    }

    /// Every queue the case may have used: its own, its dead letters', its retry queues.
    fn queues(&self) -> Vec<String> {
        let mut queues = vec![self.queue.clone(), Queue::dead_letters(&self.queue)];
        for ms in [1, 10, 20, 40, 50, 80, 100, 200, 300, 400, 800, 1_000, 1_600] {
            queues.push(Queue::retry_queue(&self.queue, Duration::from_millis(ms)));
        }
        queues
    }

    async fn delete_queues(&self) {
        let ch = self.amqp.create_channel().await.unwrap();
        for queue in self.queues() {
            ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await
                .unwrap();
        }
        ch.close(200, "deleted".into()).await.unwrap();
    }

    async fn publish(&self, payloads: impl IntoIterator<Item = (Option<String>, Vec<u8>)>) {
        let ch = self.amqp.create_channel().await.unwrap();
        ch.confirm_select(Default::default()).await.unwrap();
        for (id, payload) in payloads {
            let mut properties = lapin::BasicProperties::default().with_delivery_mode(2);
            if let Some(id) = id {
                properties = properties.with_message_id(id.as_str().into());
            }
            let confirm = ch
                .basic_publish(
                    "".into(),
                    self.queue.as_str().into(),
                    Default::default(),
                    &payload,
                    properties,
                )
                .await
                .unwrap()
                .await
                .unwrap();
            assert!(confirm.is_ack(), "the broker refused a message");
        }
        ch.close(200, "published".into()).await.unwrap();
    }

    async fn publish_jobs(&self, jobs: &[Job]) {
        self.publish(
            jobs.iter()
                .map(|j| (Some(j.id.clone()), serde_json::to_vec(j).unwrap())),
        )
        .await;
    }

    /// (rows, distinct jobs) of the effects table.
    async fn effects(&self) -> (i64, i64) {
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT count(*), count(DISTINCT job) FROM {}",
            self.effects
        )))
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }

    /// Every message in `queue`, taken off it (acked).
    async fn take_all(&self, queue: &str) -> Vec<lapin::message::BasicGetMessage> {
        let ch = self.amqp.create_channel().await.unwrap();
        let mut got = Vec::new();
        while let Some(message) = ch
            .basic_get(queue.into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            got.push(message);
        }
        ch.close(200, "taken".into()).await.unwrap();
        got
    }

    async fn consume(&self, prefetch: u16) -> Queue {
        Queue::consume(&self.amqp, &self.queue, prefetch)
            .await
            .unwrap()
    }

    async fn end(self) {
        self.delete_queues().await;
        let markers = &self.markers;
        for t in [
            self.effects.clone(),
            format!("{markers}_outbox"),
            markers.clone(),
        ] {
            sqlx::query(AssertSqlSafe(format!("DROP TABLE IF EXISTS {t}")))
                .execute(&self.pool)
                .await
                .unwrap();
        }
        self.amqp.close(200, "done".into()).await.unwrap();
        self.pool.close().await;
    }
}

fn rabbitmq_url() -> String {
    std::env::var("IDEM_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

fn job(n: usize) -> Job {
    Job {
        id: format!("job-{n}"),
        credits: n as i64,
    }
}

/// What one delivery's settlement looked like.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    id: Option<String>,
    delivery: u32,
    outcome: &'static str,
    disposition: Disposition,
}

/// A runner that records every settlement and wakes `until`'s waiter once `until` holds.
fn recording(
    runner: Runner,
    until: impl Fn(&[Seen]) -> bool + Send + Sync + 'static,
) -> (Runner, Arc<Mutex<Vec<Seen>>>, Arc<Notify>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let done = Arc::new(Notify::new());
    let (log, wake) = (seen.clone(), done.clone());
    let runner = runner.on_settled(move |s: &Settled<'_>| {
        let mut log = log.lock().unwrap();
        log.push(Seen {
            id: s.id.map(str::to_owned),
            delivery: s.delivery,
            outcome: s.outcome,
            disposition: s.disposition.clone(),
        });
        if until(&log) {
            wake.notify_one();
        }
    });
    (runner, seen, done)
}

fn header(message: &lapin::message::BasicGetMessage, name: &str) -> Option<AMQPValue> {
    let headers = message.delivery.properties.headers().as_ref()?;
    headers.inner().get(name).cloned()
}

#[tokio::test(flavor = "multi_thread")]
async fn each_job_applied_once_and_acked_though_published_twice() {
    let case = Case::new("twice", 17).await;
    let jobs: Vec<Job> = (1..=20).map(job).collect();
    case.publish_jobs(&jobs).await;
    case.publish_jobs(&jobs).await;
    let (runner, _, done) = recording(Runner::new(), |seen| seen.len() == 40);
    let (store, effects) = (&case.store, case.effects.as_str());
    let tally = within(
        60,
        "40 deliveries",
        runner.run(
            case.consume(16).await,
            |job: Job| async move { apply(store, &job, effects).await },
            done.notified(),
        ),
    )
    .await
    .unwrap();
    assert_eq!(
        (tally.applied, tally.acked_otherwise),
        (20, 20),
        "{tally:?}"
    );
    assert_eq!(
        (tally.retried, tally.dead_lettered, tally.abandoned),
        (0, 0, 0)
    );
    assert_eq!(case.effects().await, (20, 20));
    assert!(case.take_all(&case.queue).await.is_empty());
    case.end().await;
}

/// A failure of the body's own that a later delivery might get past.
#[derive(Debug)]
struct Flaky;

impl std::fmt::Display for Flaky {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the body's own failure")
    }
}

impl idem::Classify for Flaky {
    fn idem_error(&self) -> Option<&idem::Error> {
        None
    }
}

/// A job whose body fails every time is retried with a growing delay and dead-lettered once,
/// at the cap, with its error and its delivery count in the dead letter's headers.
#[tokio::test(flavor = "multi_thread")]
async fn poison_job_dead_lettered_once_at_the_cap_with_its_error() {
    let case = Case::new("poison", 2).await;
    case.publish_jobs(&[job(1)]).await;
    let settle = Settle::new()
        .max_deliveries(4)
        .backoff(Duration::from_millis(50), Duration::from_millis(100));
    let (runner, seen, done) = recording(Runner::new().settle(settle), |seen| {
        seen.iter()
            .any(|s| matches!(s.disposition, Disposition::DeadLetter { .. }))
    });
    let calls = Mutex::new(Vec::new());
    let calls = &calls;
    let tally = within(
        60,
        "the poison job's dead letter",
        runner.run(
            case.consume(4).await,
            |_: Job| async move {
                calls.lock().unwrap().push(Instant::now());
                Err::<Outcome<()>, _>(Flaky)
            },
            done.notified(),
        ),
    )
    .await
    .unwrap();
    let seen = seen.lock().unwrap().clone();
    let deliveries: Vec<(u32, &str)> = seen
        .iter()
        .map(|s| {
            let what = match s.disposition {
                Disposition::Retry { .. } => "retry",
                Disposition::DeadLetter { .. } => "dead-letter",
                _ => "other",
            };
            (s.delivery, what)
        })
        .collect();
    assert_eq!(
        deliveries,
        [(1, "retry"), (2, "retry"), (3, "retry"), (4, "dead-letter")]
    );
    assert_eq!((tally.retried, tally.dead_lettered), (3, 1));
    // No hot loop: each delivery's handler ran no sooner than its retry queue's delay after
    // the one before (whose retry copy was published after its handler began).
    let calls = calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 4);
    for (n, (pair, ms)) in calls.windows(2).zip([50, 100, 100]).enumerate() {
        let waited = pair[1] - pair[0];
        assert!(
            waited >= Duration::from_millis(ms),
            "delivery {} came {waited:?} after the one before",
            n + 2
        );
    }
    let dead = case.take_all(&Queue::dead_letters(&case.queue)).await;
    assert_eq!(dead.len(), 1, "one dead letter");
    let reason = match header(&dead[0], REASON_HEADER) {
        Some(AMQPValue::LongString(text)) => text.to_string(),
        other => panic!("no reason header: {other:?}"),
    };
    assert!(
        reason.contains("delivered 4 times") && reason.contains("the body's own failure"),
        "{reason}"
    );
    assert_eq!(
        header(&dead[0], DELIVERY_HEADER),
        Some(AMQPValue::LongLongInt(4))
    );
    let payload: Job = serde_json::from_slice(&dead[0].delivery.data).unwrap();
    assert_eq!(payload.id, "job-1");
    assert!(case.take_all(&case.queue).await.is_empty());
    assert_eq!(case.effects().await, (0, 0));
    case.end().await;
}

/// A payload that is not a job, and a job whose key comes again with another payload, are
/// dead-lettered at their first delivery: no retry can succeed.
#[tokio::test(flavor = "multi_thread")]
async fn unparsable_payload_and_reused_key_dead_lettered_at_once() {
    let case = Case::new("permanent", 2).await;
    let reused = Job {
        id: "job-1".into(),
        credits: 999,
    };
    case.publish_jobs(&[job(1)]).await;
    case.publish(
        [(Some("garbage".to_owned()), b"{not json".to_vec())]
            .into_iter()
            .chain([(
                Some(reused.id.clone()),
                serde_json::to_vec(&reused).unwrap(),
            )]),
    )
    .await;
    let (runner, seen, done) = recording(Runner::new().in_flight(1), |seen| seen.len() == 3);
    let (store, effects) = (&case.store, case.effects.as_str());
    let tally = within(
        60,
        "three deliveries",
        runner.run(
            case.consume(1).await,
            |job: Job| async move { apply(store, &job, effects).await },
            done.notified(),
        ),
    )
    .await
    .unwrap();
    let seen: Vec<(Option<String>, u32, &str, bool)> = seen
        .lock()
        .unwrap()
        .iter()
        .map(|s| {
            let dead = matches!(s.disposition, Disposition::DeadLetter { .. });
            (s.id.clone(), s.delivery, s.outcome, dead)
        })
        .collect();
    assert_eq!(
        seen,
        [
            (Some("job-1".into()), 1, "applied", false),
            (Some("garbage".into()), 1, "unparsable", true),
            (Some("job-1".into()), 1, "error", true),
        ]
    );
    assert_eq!((tally.applied, tally.dead_lettered), (1, 2));
    let dead = case.take_all(&Queue::dead_letters(&case.queue)).await;
    let reasons: Vec<String> = dead
        .iter()
        .map(|m| match header(m, REASON_HEADER) {
            Some(AMQPValue::LongString(text)) => text.to_string(),
            other => panic!("no reason header: {other:?}"),
        })
        .collect();
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    assert!(
        reasons[0].starts_with("the payload is not a job"),
        "{reasons:?}"
    );
    assert!(reasons[1].contains("job-1"), "{reasons:?}");
    assert_eq!(dead[0].delivery.data, b"{not json");
    assert_eq!(case.effects().await, (1, 1));
    case.end().await;
}

/// A delivery that meets its key held by another delivery still running is retried after the
/// policy's delay (never requeued at once, never capped) and acked as a duplicate once the
/// holder committed.
#[tokio::test(flavor = "multi_thread")]
async fn in_progress_retried_after_its_delay_then_acked_as_duplicate() {
    let case = Case::new("in_progress", 3).await;
    case.publish_jobs(&[job(1), job(1)]).await;
    let gate = Gate::default();
    let calls = Mutex::new(Vec::new());
    let settle = Settle::new()
        .in_progress_after(Duration::from_millis(300))
        .max_deliveries(1);
    let (runner, seen, done) = recording(Runner::new().settle(settle).in_flight(2), |seen| {
        seen.iter()
            .filter(|s| s.disposition == Disposition::Ack)
            .count()
            == 2
    });
    let (store, effects, gate, calls) = (&case.store, case.effects.as_str(), &gate, &calls);
    let tally = within(
        60,
        "both copies acked",
        runner.run(
            case.consume(2).await,
            |job: Job| async move {
                let call = {
                    let mut calls = calls.lock().unwrap();
                    calls.push(Instant::now());
                    calls.len() - 1
                };
                match call {
                    // The first copy holds the key inside its body...
                    0 => apply_gated(store, &job, effects, Some(gate)).await,
                    // ...until the second has met it, held.
                    1 => {
                        gate.entered.notified().await;
                        let outcome = apply(store, &job, effects).await;
                        gate.release.notify_one();
                        outcome
                    }
                    _ => apply(store, &job, effects).await,
                }
            },
            done.notified(),
        ),
    )
    .await
    .unwrap();
    let seen = seen.lock().unwrap().clone();
    let first_retry = seen
        .iter()
        .position(|s| matches!(s.disposition, Disposition::Retry { .. }))
        .unwrap_or_else(|| panic!("no retry: {seen:?}"));
    assert_eq!(
        seen[first_retry].disposition,
        Disposition::Retry {
            after: Duration::from_millis(300)
        }
    );
    // The cap of 1 does not apply: the holder could still have failed.
    assert_eq!(seen[first_retry].delivery, 1);
    let duplicate = seen
        .iter()
        .find(|s| s.outcome == "duplicate")
        .unwrap_or_else(|| panic!("no duplicate: {seen:?}"));
    assert_eq!(duplicate.delivery, 2);
    // Retried no sooner than the delay: the third call began at least 300 ms after the
    // second, whose retry copy was published after it began.
    let calls = calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 3, "{seen:?}");
    assert!(
        calls[2] - calls[1] >= Duration::from_millis(300),
        "{calls:?}"
    );
    assert_eq!((tally.applied, tally.dead_lettered), (1, 0));
    assert_eq!(case.effects().await, (1, 1));
    case.end().await;
}

/// A handler that panics is retried like one that failed; the next delivery applies the job.
#[tokio::test(flavor = "multi_thread")]
async fn panicking_handler_retried_and_applied_once() {
    let case = Case::new("panic", 2).await;
    case.publish_jobs(&[job(1)]).await;
    let (runner, seen, done) = recording(Runner::new(), |seen| {
        seen.iter().any(|s| s.disposition == Disposition::Ack)
    });
    let panicked = AtomicBool::new(false);
    let (store, effects, panicked) = (&case.store, case.effects.as_str(), &panicked);
    let tally = within(
        60,
        "the job's ack",
        runner.run(
            case.consume(1).await,
            |job: Job| async move {
                let outcome = apply(store, &job, effects).await;
                if !panicked.swap(true, Ordering::SeqCst) {
                    panic!("a bug in the handler, after its commit");
                }
                outcome
            },
            done.notified(),
        ),
    )
    .await
    .unwrap();
    let seen: Vec<(u32, &str)> = seen
        .lock()
        .unwrap()
        .iter()
        .map(|s| (s.delivery, s.outcome))
        .collect();
    // The panic came after the commit: the retry finds the job done.
    assert_eq!(seen, [(1, "panicked"), (2, "duplicate")]);
    assert_eq!((tally.retried, tally.acked_otherwise), (1, 1));
    assert_eq!(case.effects().await, (1, 1));
    case.end().await;
}

/// 50 deliveries in flight when the shutdown comes: the 25 whose bodies end within the bound
/// are settled, the 25 still running are dropped unsettled (their transactions roll back) and
/// delivered again to the next runner. Nothing lost, nothing doubled, nothing acked that was
/// not kept.
#[tokio::test(flavor = "multi_thread")]
async fn shutdown_with_50_in_flight_settles_what_ended_and_leaves_the_rest() {
    const JOBS: usize = 50;
    let case = Case::new("shutdown", 52).await;
    let jobs: Vec<Job> = (1..=JOBS).map(job).collect();
    case.publish_jobs(&jobs).await;
    let (in_flight, all_in) = watch::channel(0_usize);
    let in_flight = &in_flight;
    let never = Gate::default();
    let (store, effects, never) = (&case.store, case.effects.as_str(), &never);
    let (runner, _, _) = recording(
        Runner::new().in_flight(JOBS).drain(Duration::from_secs(2)),
        |_| false,
    );
    let shutdown = {
        let mut all_in = all_in.clone();
        async move {
            all_in.wait_for(|n| *n == JOBS).await.unwrap();
        }
    };
    let first: Tally = within(
        60,
        "the first runner",
        runner.run(
            case.consume(JOBS as u16).await,
            |job: Job| {
                let mut all_in = all_in.clone();
                async move {
                    in_flight.send_modify(|n| *n += 1);
                    // Every body waits until all 50 are running; the even ones then end, the
                    // odd ones hold their transaction past the shutdown's bound.
                    all_in.wait_for(|n| *n == JOBS).await.unwrap();
                    let n: usize = job.id["job-".len()..].parse().unwrap();
                    let gate = (n % 2 == 1).then_some(never);
                    apply_gated(store, &job, effects, gate).await
                }
            },
            shutdown,
        ),
    )
    .await
    .unwrap();
    assert_eq!(
        (
            first.applied,
            first.abandoned,
            first.acked_otherwise,
            first.retried
        ),
        (25, 25, 0, 0),
        "{first:?}"
    );
    // Acked only what was kept.
    assert_eq!(case.effects().await, (25, 25));
    // The first runner closed its channel: the abandoned deliveries are the queue's again.
    let (runner, _, done) = recording(Runner::new(), |seen| seen.len() == 25);
    let second = within(
        60,
        "the second runner",
        runner.run(
            case.consume(16).await,
            |job: Job| async move { apply(store, &job, effects).await },
            done.notified(),
        ),
    )
    .await
    .unwrap();
    // Each one's first run was rolled back: applied now, not a duplicate.
    assert_eq!(
        (second.applied, second.acked_otherwise),
        (25, 0),
        "{second:?}"
    );
    assert_eq!(case.effects().await, (JOBS as i64, JOBS as i64));
    case.end().await;
}
