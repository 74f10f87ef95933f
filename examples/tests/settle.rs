//! idem's consumer loop (`idem::settle::Runner`) on each broker through its adapter, in this
//! process, against the real brokers and PostgreSQL: each case of the decision settled on the
//! broker, the redelivery cap, a retry that waits, a panic, and a shutdown with every delivery
//! in flight. Each case runs on RabbitMQ, on NATS JetStream and on SQS (moto's server); the
//! heartbeat's, a handler that runs past the broker's ack wait, on JetStream and SQS
//! (`settle/heartbeat.rs`); each delivery's span (`settle/spans.rs`); SQS's acks in batches
//! (`settle/sqs_acks.rs`). Effects are rows in a table without a unique index, so one
//! applied twice shows.

#[path = "settle/brokers.rs"]
mod brokers;
#[path = "settle/heartbeat.rs"]
mod heartbeat;
#[path = "settle/spans.rs"]
mod spans;
#[path = "settle/sqs_acks.rs"]
mod sqs_acks;
mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use brokers::{Broker, Nats, RabbitMq, Sqs};
use idem::settle::{Runner, Settled, Tally};
use idem::{Disposition, Outcome, Settle, Store};
use serde::{Deserialize, Serialize};
use sqlx::{AssertSqlSafe, PgPool, Postgres, Transaction};
use support::{postgres, within};
use tokio::sync::{Notify, watch};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Job {
    id: String,
    credits: i64,
}

/// One row in `effects` per application: [`apply_gated`] without a gate.
async fn apply(store: &Store<Postgres>, job: &Job, effects: &str) -> sqlx::Result<Outcome<()>> {
    apply_gated(store, job, effects, None).await
}

/// Where a body stops inside its transaction: it tells `entered`, then waits for `release`.
#[derive(Default)]
struct Gate {
    entered: Notify,
    release: Notify,
}

/// One row in `effects` per application, the body stopping at `gate` (when given) after its
/// `INSERT`, inside the claim's transaction.
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

/// A test's broker objects and tables, dropped at the end.
struct Case<B> {
    broker: B,
    markers: String,
    store: Store<Postgres>,
    effects: String,
    pool: PgPool,
}

impl<B: Broker> Case<B> {
    /// `connections`: the pool's size, one for each transaction the case holds open at once.
    async fn new(test: &str, connections: u32) -> Case<B> {
        Case::on(B::new(test).await, test, connections).await
    }

    /// [`Case::new`] on a broker made for `test` already.
    async fn on(broker: B, test: &str, connections: u32) -> Case<B> {
        let id = format!("{test}_{}_{}", B::NAME, std::process::id());
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
        Case {
            broker,
            markers,
            store,
            effects,
            pool,
        }
    }

    async fn publish_jobs(&self, jobs: &[Job]) {
        let payloads = jobs.iter().map(|j| serde_json::to_vec(j).unwrap());
        self.broker.publish(payloads.collect()).await;
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

    /// Runs `runner` with [`apply`] as the handler, `prefetch` at a time, until `done`.
    async fn apply_until(
        &self,
        runner: Runner,
        prefetch: usize,
        done: &Notify,
        what: &str,
    ) -> Tally {
        let (store, effects) = (&self.store, self.effects.as_str());
        let deliveries = self.broker.source(prefetch).await;
        let run = runner.run(
            deliveries,
            |job: Job| async move { apply(store, &job, effects).await },
            done.notified(),
        );
        within(60, what, run).await.unwrap()
    }

    async fn end(self) {
        self.broker.end().await;
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
        self.pool.close().await;
    }
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

async fn each_job_applied_once_and_acked_though_published_twice<B: Broker>() {
    let case = Case::<B>::new("twice", 17).await;
    let jobs: Vec<Job> = (1..=20).map(job).collect();
    case.publish_jobs(&jobs).await;
    case.publish_jobs(&jobs).await;
    let (runner, _, done) = recording(Runner::new(), |seen| seen.len() == 40);
    let tally = case.apply_until(runner, 16, &done, "40 deliveries").await;
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
    assert_eq!(case.broker.left().await, 0);
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
async fn poison_job_dead_lettered_once_at_the_cap_with_its_error<B: Broker>() {
    let case = Case::<B>::new("poison", 2).await;
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
            case.broker.source(4).await,
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
    let dead = case.broker.dead_letters().await;
    assert_eq!(dead.len(), 1, "one dead letter: {dead:?}");
    let reason = &dead[0].reason;
    assert!(
        reason.contains("delivered 4 times") && reason.contains("the body's own failure"),
        "{reason}"
    );
    assert_eq!(dead[0].delivery, 4);
    let payload: Job = serde_json::from_slice(&dead[0].payload).unwrap();
    assert_eq!(payload.id, "job-1");
    assert_eq!(case.broker.left().await, 0);
    assert_eq!(case.effects().await, (0, 0));
    case.end().await;
}

/// A payload that is not a job, and a job whose key comes again with another payload, are
/// dead-lettered at their first delivery: no retry can succeed.
async fn unparsable_payload_and_reused_key_dead_lettered_at_once<B: Broker>() {
    let case = Case::<B>::new("permanent", 2).await;
    let reused = Job {
        id: "job-1".into(),
        credits: 999,
    };
    case.broker
        .publish(vec![
            serde_json::to_vec(&job(1)).unwrap(),
            b"{not json".to_vec(),
            serde_json::to_vec(&reused).unwrap(),
        ])
        .await;
    let (runner, seen, done) = recording(Runner::new().in_flight(1), |seen| seen.len() == 3);
    let tally = case.apply_until(runner, 1, &done, "three deliveries").await;
    let seen: Vec<(u32, &str, bool)> = seen
        .lock()
        .unwrap()
        .iter()
        .map(|s| {
            let dead = matches!(s.disposition, Disposition::DeadLetter { .. });
            (s.delivery, s.outcome, dead)
        })
        .collect();
    assert_eq!(
        seen,
        [
            (1, "applied", false),
            (1, "unparsable", true),
            (1, "error", true)
        ]
    );
    assert_eq!((tally.applied, tally.dead_lettered), (1, 2));
    let dead = case.broker.dead_letters().await;
    let reasons: Vec<&str> = dead.iter().map(|d| d.reason.as_str()).collect();
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    assert!(
        reasons[0].starts_with("the payload is not a job"),
        "{reasons:?}"
    );
    assert!(reasons[1].contains("job-1"), "{reasons:?}");
    assert_eq!(dead[0].payload, b"{not json");
    assert_eq!(case.broker.left().await, 0);
    assert_eq!(case.effects().await, (1, 1));
    case.end().await;
}

/// A delivery that meets its key held by another delivery still running is retried after the
/// policy's delay (never requeued at once, never capped) and acked as a duplicate once the
/// holder committed.
async fn in_progress_retried_after_its_delay_then_acked_as_duplicate<B: Broker>() {
    let case = Case::<B>::new("in_progress", 3).await;
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
            case.broker.source(2).await,
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
async fn panicking_handler_retried_and_applied_once<B: Broker>() {
    let case = Case::<B>::new("panic", 2).await;
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
            case.broker.source(1).await,
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
async fn shutdown_with_50_in_flight_settles_what_ended_and_leaves_the_rest<B: Broker>() {
    const JOBS: usize = 50;
    // One broker's case at a time: each holds 50 transactions open, and two at once would
    // pass PostgreSQL's 100 connections.
    static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _turn = ONE_AT_A_TIME.lock().await;
    let case = Case::<B>::new("shutdown", 52).await;
    let jobs: Vec<Job> = (1..=JOBS).map(job).collect();
    case.publish_jobs(&jobs).await;
    let (in_flight, all_in) = watch::channel(0_usize);
    let in_flight = &in_flight;
    let never = Gate::default();
    let (store, effects, never) = (&case.store, case.effects.as_str(), &never);
    // A beat a second keeps the bodies' deliveries theirs while all 50 gather (SQS's
    // visibility timeout here is 3 s, and gathering took longer on a loaded machine: a
    // delivery handed out again then came back to the second runner as a duplicate).
    let runner = Runner::new()
        .in_flight(JOBS)
        .drain(Duration::from_secs(2))
        .heartbeat(Duration::from_secs(1));
    let (runner, _, _) = recording(runner, |_| false);
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
            case.broker.source(JOBS).await,
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
    let second = case
        .apply_until(runner, 16, &done, "the second runner")
        .await;
    // Each one's first run was rolled back: applied now, not a duplicate.
    assert_eq!(
        (second.applied, second.acked_otherwise),
        (25, 0),
        "{second:?}"
    );
    assert_eq!(case.effects().await, (JOBS as i64, JOBS as i64));
    case.end().await;
}

async fn delivery_spans<B: Broker>() {
    let system = match B::NAME {
        "sqs" => "aws_sqs",
        name => name,
    };
    spans::each_delivery_has_its_span_with_its_outcome_and_disposition::<B>(system).await;
}

/// Each case, as a test on each broker.
macro_rules! on_brokers {
    ($($case:ident),* $(,)?) => {
        mod rabbitmq {
            $(
                #[tokio::test(flavor = "multi_thread")]
                async fn $case() {
                    super::$case::<super::RabbitMq>().await;
                }
            )*
        }
        mod nats {
            $(
                #[tokio::test(flavor = "multi_thread")]
                async fn $case() {
                    super::$case::<super::Nats>().await;
                }
            )*
        }
        mod sqs {
            $(
                #[tokio::test(flavor = "multi_thread")]
                async fn $case() {
                    super::$case::<super::Sqs>().await;
                }
            )*
        }
    };
}

on_brokers!(
    delivery_spans,
    each_job_applied_once_and_acked_though_published_twice,
    poison_job_dead_lettered_once_at_the_cap_with_its_error,
    unparsable_payload_and_reused_key_dead_lettered_at_once,
    in_progress_retried_after_its_delay_then_acked_as_duplicate,
    panicking_handler_retried_and_applied_once,
    shutdown_with_50_in_flight_settles_what_ended_and_leaves_the_rest,
);
