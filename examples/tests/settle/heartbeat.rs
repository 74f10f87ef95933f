//! The runner's heartbeat, on the brokers that hand an unsettled delivery out again after a
//! while (JetStream's `ack_wait`, SQS's visibility timeout; RabbitMQ waits for its consumer):
//! a handler that runs three times that long is delivered once with the heartbeat on, and
//! delivered again while it runs without it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem::settle::Runner;
use idem::{Disposition, Outcome, Settle, Store};
use sqlx::Postgres;

use super::brokers::Lapsing;
use super::support::within;
use super::{Case, Gate, Job, apply, apply_gated, job, recording};

/// [`apply_gated`] whose body holds its transaction for `hold` after its `INSERT`: a handler
/// that runs long. Wall time passing is what the heartbeat is for, so a timer ends it.
async fn held(
    store: &Store<Postgres>,
    job: &Job,
    effects: &str,
    hold: Duration,
) -> sqlx::Result<Outcome<()>> {
    let gate = Gate::default();
    let (outcome, ()) = tokio::join!(apply_gated(store, job, effects, Some(&gate)), async {
        gate.entered.notified().await;
        tokio::time::sleep(hold).await;
        gate.release.notify_one();
    });
    outcome
}

/// A handler that runs three times the broker's `lapse` (its ack wait or visibility timeout),
/// with a heartbeat every quarter of it: the message is delivered once, applied once and
/// acked. Two deliveries may run at once, so a redelivery while the first runs would be
/// handled (and seen) at once.
async fn held_past_the_lapse_with_a_heartbeat_delivered_and_applied_once<B: Lapsing>(
    lapse: Duration,
) {
    let test = "beat_on";
    let case = Case::on(B::lapsing(test, lapse).await, test, 3).await;
    case.publish_jobs(&[job(1)]).await;
    let runner = Runner::new().in_flight(2).heartbeat(lapse / 4);
    let (runner, seen, done) = recording(runner, |seen| {
        seen.iter().any(|s| s.disposition == Disposition::Ack)
    });
    let calls = AtomicUsize::new(0);
    let (store, effects, calls) = (&case.store, case.effects.as_str(), &calls);
    let tally = within(
        60,
        "the held job's ack",
        runner.run(
            case.broker.source(2).await,
            |job: Job| async move {
                match calls.fetch_add(1, Ordering::SeqCst) {
                    0 => held(store, &job, effects, 3 * lapse).await,
                    _ => apply(store, &job, effects).await,
                }
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
    assert_eq!(calls.load(Ordering::SeqCst), 1, "delivered again: {seen:?}");
    assert_eq!(seen, [(1, "applied")]);
    assert_eq!((tally.applied, tally.retried, tally.acked()), (1, 0, 1));
    assert_eq!(case.effects().await, (1, 1));
    assert_eq!(case.broker.left().await, 0);
    case.end().await;
}

/// The same handler without the heartbeat: the broker hands the message out again while the
/// first delivery runs (the first body holds its transaction until the second delivery's
/// handler begins, so that it is necessarily one of a message not settled). idem still keeps
/// one effect: the redelivery meets the key held, or the job done.
async fn held_past_the_lapse_without_a_heartbeat_delivered_again_while_it_runs<B: Lapsing>(
    lapse: Duration,
) {
    let test = "beat_off";
    let case = Case::on(B::lapsing(test, lapse).await, test, 3).await;
    case.publish_jobs(&[job(1)]).await;
    let settle = Settle::new().in_progress_after(Duration::from_millis(100));
    let runner = Runner::new()
        .in_flight(2)
        .settle(settle)
        .heartbeat(Duration::ZERO);
    let (runner, seen, done) = recording(runner, |seen| {
        seen.iter().any(|s| s.outcome == "applied") && seen.iter().any(|s| s.delivery >= 2)
    });
    let gate = Gate::default();
    let calls = AtomicUsize::new(0);
    let (store, effects, gate, calls) = (&case.store, case.effects.as_str(), &gate, &calls);
    within(
        60,
        "a second delivery and the first's ack",
        runner.run(
            case.broker.source(2).await,
            |job: Job| async move {
                if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                    return apply_gated(store, &job, effects, Some(gate)).await;
                }
                gate.release.notify_one();
                apply(store, &job, effects).await
            },
            done.notified(),
        ),
    )
    .await
    .unwrap();
    let seen = seen.lock().unwrap().clone();
    let applied: Vec<u32> = seen
        .iter()
        .filter(|s| s.outcome == "applied")
        .map(|s| s.delivery)
        .collect();
    assert_eq!(applied, [1], "{seen:?}");
    assert!(seen.iter().any(|s| s.delivery == 2), "{seen:?}");
    assert_eq!(case.effects().await, (1, 1));
    case.end().await;
}

/// Each case, as a test on each broker that lets a delivery lapse: JetStream with an
/// `ack_wait` of 1 s, SQS with a visibility timeout of 2 s (it counts in whole seconds, and
/// moto answers slower than NATS).
macro_rules! on_lapsing_brokers {
    ($($case:ident),* $(,)?) => {
        mod nats {
            $(
                #[tokio::test(flavor = "multi_thread")]
                async fn $case() {
                    super::$case::<super::super::brokers::Nats>(
                        std::time::Duration::from_secs(1),
                    )
                    .await;
                }
            )*
        }
        mod sqs {
            $(
                #[tokio::test(flavor = "multi_thread")]
                async fn $case() {
                    super::$case::<super::super::brokers::Sqs>(
                        std::time::Duration::from_secs(2),
                    )
                    .await;
                }
            )*
        }
    };
}

on_lapsing_brokers!(
    held_past_the_lapse_with_a_heartbeat_delivered_and_applied_once,
    held_past_the_lapse_without_a_heartbeat_delivered_again_while_it_runs,
);
