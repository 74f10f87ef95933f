//! The SQS adapter's acks in batches (`Receiver::batch_acks`): each acked message deleted
//! once, in `DeleteMessageBatch` calls of up to 10, a batch sent once full, once its time ran
//! out, or at shutdown with acks still waiting; and one `DeleteMessage` per ack with batching
//! off. The deletes are counted as they leave the SDK's client (an interceptor on the test's
//! own client), so nothing of idem's reports on itself.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem::settle::Runner;
use idem::settle::sqs::Receiver;
use idem::settle::sqs::aws_sdk_sqs::Client;
use idem::settle::sqs::aws_sdk_sqs::config::interceptors::BeforeSerializationInterceptorContextRef;
use idem::settle::sqs::aws_sdk_sqs::config::{ConfigBag, Intercept};
use idem::settle::sqs::aws_sdk_sqs::error::BoxError;
use idem::settle::sqs::aws_sdk_sqs::operation::delete_message::DeleteMessageInput;
use idem::settle::sqs::aws_sdk_sqs::operation::delete_message_batch::DeleteMessageBatchInput;
use idem::{Disposition, Outcome};
use tokio::sync::{Notify, watch};

use super::brokers::{Broker, Sqs};
use super::support::within;
use super::{Case, Job, apply, job, recording};

/// A delete as it left the client, with the receipt handles it carried.
#[derive(Debug, Clone, PartialEq)]
enum Call {
    /// `DeleteMessage`.
    One(String),
    /// `DeleteMessageBatch`.
    Batch(Vec<String>),
}

/// Records each delete the client sends, when it sends it (once per call, not per attempt).
#[derive(Debug, Default, Clone)]
struct Deletes(Arc<Mutex<Vec<(Instant, Call)>>>);

impl Intercept for Deletes {
    fn name(&self) -> &'static str {
        "the test's count of deletes"
    }

    fn read_before_execution(
        &self,
        context: &BeforeSerializationInterceptorContextRef<'_>,
        _: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        let input = context.input();
        let call = if let Some(one) = input.downcast_ref::<DeleteMessageInput>() {
            Call::One(one.receipt_handle().unwrap_or_default().to_owned())
        } else if let Some(batch) = input.downcast_ref::<DeleteMessageBatchInput>() {
            let receipts = batch
                .entries()
                .iter()
                .map(|e| e.receipt_handle().to_owned());
            Call::Batch(receipts.collect())
        } else {
            return Ok(());
        };
        self.0.lock().unwrap().push((Instant::now(), call));
        Ok(())
    }
}

impl Deletes {
    /// A client of `broker`'s SQS that records its deletes here.
    fn client(&self, broker: &Sqs) -> Client {
        let config = broker.client().config().to_builder();
        Client::from_conf(config.interceptor(self.clone()).build())
    }

    fn calls(&self) -> Vec<(Instant, Call)> {
        self.0.lock().unwrap().clone()
    }
}

/// Every receipt handle the deletes carried, each once: panics on one deleted twice.
fn receipts(calls: &[(Instant, Call)]) -> HashSet<String> {
    let mut receipts = HashSet::new();
    for (_, call) in calls {
        let carried = match call {
            Call::One(receipt) => std::slice::from_ref(receipt),
            Call::Batch(receipts) => receipts.as_slice(),
        };
        for receipt in carried {
            assert!(receipts.insert(receipt.clone()), "deleted twice: {calls:?}");
        }
    }
    receipts
}

/// 25 acks, none sent for its time (longer than the test): two batches sent once full, and
/// the last 5 by the shutdown (the source's stop sends the acks waiting). Each message is
/// deleted once, in three calls, and none comes back after the visibility timeout.
#[tokio::test(flavor = "multi_thread")]
async fn acks_sent_ten_at_a_time_and_those_waiting_at_shutdown() {
    const JOBS: usize = 25;
    let case = Case::<Sqs>::new("ack_batches", JOBS as u32 + 1).await;
    case.publish_jobs(&(1..=JOBS).map(job).collect::<Vec<_>>())
        .await;
    let deletes = Deletes::default();
    let client = deletes.client(&case.broker);
    let receiver = Receiver::consume(&client, case.broker.queues(), JOBS, 1)
        .batch_acks(Duration::from_secs(3600));
    let (answered, mut all_answered) = watch::channel(0_usize);
    let (runner, seen, _) = recording(Runner::new().in_flight(JOBS), |_| false);
    let (store, effects, answered) = (&case.store, case.effects.as_str(), &answered);
    let tally = within(
        60,
        "25 jobs and the shutdown",
        runner.run(
            receiver,
            |job: Job| async move {
                let outcome = apply(store, &job, effects).await;
                answered.send_modify(|n| *n += 1);
                outcome
            },
            // Once the last handler answered. Its ack is queued in the same poll of the
            // runner's task, before the runner sees the shutdown: the stop finds 5 waiting.
            async move {
                all_answered.wait_for(|n| *n == JOBS).await.unwrap();
            },
        ),
    )
    .await
    .unwrap();
    assert_eq!(
        (tally.applied, tally.acked(), tally.retried, tally.abandoned),
        (25, 25, 0, 0),
        "{tally:?}"
    );
    // Each settlement returned once its delete was answered: all 25 before the run ended.
    assert_eq!(seen.lock().unwrap().len(), JOBS);
    assert_eq!(case.effects().await, (25, 25));
    let calls = deletes.calls();
    let mut sizes: Vec<usize> = calls
        .iter()
        .map(|(_, call)| match call {
            Call::Batch(receipts) => receipts.len(),
            Call::One(_) => panic!("a DeleteMessage: {calls:?}"),
        })
        .collect();
    sizes.sort_unstable();
    assert_eq!(sizes, [5, 10, 10], "{calls:?}");
    // One delivery each (no duplicate above): 25 receipts are the 25 messages, each once.
    assert_eq!(receipts(&calls).len(), JOBS);
    assert_eq!(case.broker.left().await, 0);
    // Nothing comes back once the visibility timeout (3 s) has passed: a receive that waits
    // longer than it gets nothing.
    let again = case
        .broker
        .client()
        .receive_message()
        .queue_url(case.broker.queues().url)
        .max_number_of_messages(10)
        .wait_time_seconds(4)
        .send()
        .await
        .unwrap();
    assert_eq!(again.messages.unwrap_or_default().len(), 0);
    case.end().await;
}

/// One ack alone, where two could be out at once (a prefetch of 2): its batch (of one) is sent
/// once its time ran out, no sooner, and the settlement returns after that.
#[tokio::test(flavor = "multi_thread")]
async fn a_lone_ack_sent_once_its_time_ran_out() {
    const WITHIN: Duration = Duration::from_millis(300);
    let case = Case::<Sqs>::new("ack_timer", 2).await;
    case.publish_jobs(&[job(1)]).await;
    let deletes = Deletes::default();
    let client = deletes.client(&case.broker);
    let receiver = Receiver::consume(&client, case.broker.queues(), 2, 1).batch_acks(WITHIN);
    let (runner, seen, done) = recording(Runner::new().in_flight(1), |seen| {
        seen.iter().any(|s| s.disposition == Disposition::Ack)
    });
    let answered = Mutex::new(None);
    let (store, effects, answered) = (&case.store, case.effects.as_str(), &answered);
    let tally = within(
        60,
        "the job's ack",
        runner.run(
            receiver,
            |job: Job| async move {
                let outcome: sqlx::Result<Outcome<()>> = apply(store, &job, effects).await;
                *answered.lock().unwrap() = Some(Instant::now());
                outcome
            },
            done.notified(),
        ),
    )
    .await
    .unwrap();
    assert_eq!((tally.applied, tally.acked()), (1, 1), "{tally:?}");
    assert_eq!(seen.lock().unwrap().len(), 1);
    let calls = deletes.calls();
    assert_eq!(calls.len(), 1, "{calls:?}");
    let (sent, call) = &calls[0];
    assert!(matches!(call, Call::Batch(r) if r.len() == 1), "{calls:?}");
    let answered = answered.lock().unwrap().unwrap();
    assert!(
        *sent - answered >= WITHIN,
        "sent {:?} after the handler answered",
        *sent - answered
    );
    assert_eq!(case.broker.left().await, 0);
    case.end().await;
}

/// A prefetch of one: a batch is full at one ack, so each is sent at once however long the
/// window (an hour here; the case's bound is a minute), one `DeleteMessageBatch` a message.
#[tokio::test(flavor = "multi_thread")]
async fn with_a_prefetch_of_one_each_ack_is_sent_at_once() {
    const JOBS: usize = 3;
    let case = Case::<Sqs>::new("ack_one", 2).await;
    let jobs: Vec<Job> = (1..=JOBS).map(job).collect();
    case.publish_jobs(&jobs).await;
    let deletes = Deletes::default();
    let client = deletes.client(&case.broker);
    let receiver = Receiver::consume(&client, case.broker.queues(), 1, 1)
        .batch_acks(Duration::from_secs(3600));
    let (runner, _, done) = recording(Runner::new().in_flight(1), |seen| seen.len() == JOBS);
    let (store, effects) = (&case.store, case.effects.as_str());
    let tally = within(
        60,
        "three acks, each sent at once",
        runner.run(
            receiver,
            |job: Job| async move { apply(store, &job, effects).await },
            done.notified(),
        ),
    )
    .await
    .unwrap();
    assert_eq!((tally.applied, tally.acked()), (3, 3), "{tally:?}");
    let calls = deletes.calls();
    assert_eq!(calls.len(), JOBS, "{calls:?}");
    assert!(
        calls
            .iter()
            .all(|(_, c)| matches!(c, Call::Batch(r) if r.len() == 1)),
        "{calls:?}"
    );
    assert_eq!(receipts(&calls).len(), JOBS);
    assert_eq!(case.effects().await, (JOBS as i64, JOBS as i64));
    assert_eq!(case.broker.left().await, 0);
    case.end().await;
}

/// A batch of two acks, one of whose messages is gone from the queue (purged while its handler
/// ran, so that moto refuses its receipt handle): the other is deleted and settled, the
/// refused one is not reported settled, and the run ends with SQS's code for it.
#[tokio::test(flavor = "multi_thread")]
async fn an_entry_sqs_refuses_is_not_settled_and_the_others_are() {
    let case = Case::<Sqs>::new("ack_refused", 3).await;
    case.publish_jobs(&[job(1)]).await;
    let deletes = Deletes::default();
    let client = deletes.client(&case.broker);
    let receiver = Receiver::consume(&client, case.broker.queues(), 2, 1)
        .batch_acks(Duration::from_secs(3600));
    let (runner, seen, _) = recording(Runner::new().in_flight(2), |_| false);
    let (answered, mut both_answered) = watch::channel(0_usize);
    let second_answered = Notify::new();
    let (store, effects, broker) = (&case.store, case.effects.as_str(), &case.broker);
    let (answered, second_answered) = (&answered, &second_answered);
    let run = within(
        60,
        "two jobs and the shutdown",
        runner.run(
            receiver,
            |job: Job| async move {
                let outcome = apply(store, &job, effects).await;
                if job.id == "job-1" {
                    // Its message leaves the queue by another way than its ack; job 2 comes
                    // after, and answers first.
                    let url = broker.queues().url;
                    broker
                        .client()
                        .purge_queue()
                        .queue_url(&url)
                        .send()
                        .await
                        .unwrap();
                    broker
                        .publish(vec![serde_json::to_vec(&super::job(2)).unwrap()])
                        .await;
                    second_answered.notified().await;
                } else {
                    second_answered.notify_one();
                }
                answered.send_modify(|n| *n += 1);
                outcome
            },
            // Both acks wait (for longer than the test): the stop sends them in one batch.
            async move {
                both_answered.wait_for(|n| *n == 2).await.unwrap();
            },
        ),
    )
    .await;
    let error = run.expect_err("the refused ack ends the run").to_string();
    assert!(
        error.contains("DeleteMessageBatch") && error.contains("ReceiptHandleIsInvalid"),
        "{error}"
    );
    let seen: Vec<(u32, &str)> = seen
        .lock()
        .unwrap()
        .iter()
        .map(|s| (s.delivery, s.outcome))
        .collect();
    assert_eq!(seen, [(1, "applied")]);
    let calls = deletes.calls();
    assert!(
        matches!(&calls[..], [(_, Call::Batch(r))] if r.len() == 2),
        "{calls:?}"
    );
    assert_eq!(case.effects().await, (2, 2));
    // Job 2's message deleted, job 1's purged.
    assert_eq!(case.broker.left().await, 0);
    case.end().await;
}

/// Batching off (`Duration::ZERO`): each ack is a `DeleteMessage` of its own.
#[tokio::test(flavor = "multi_thread")]
async fn batching_off_deletes_each_message_by_itself() {
    const JOBS: usize = 3;
    let case = Case::<Sqs>::new("ack_each", 2).await;
    case.publish_jobs(&(1..=JOBS).map(job).collect::<Vec<_>>())
        .await;
    let deletes = Deletes::default();
    let client = deletes.client(&case.broker);
    let receiver =
        Receiver::consume(&client, case.broker.queues(), 1, 1).batch_acks(Duration::ZERO);
    let (runner, _, done) = recording(Runner::new().in_flight(1), |seen| seen.len() == JOBS);
    let (store, effects) = (&case.store, case.effects.as_str());
    let tally = within(
        60,
        "3 acks",
        runner.run(
            receiver,
            |job: Job| async move { apply(store, &job, effects).await },
            done.notified(),
        ),
    )
    .await
    .unwrap();
    assert_eq!((tally.applied, tally.acked()), (3, 3), "{tally:?}");
    let calls = deletes.calls();
    assert!(
        calls.iter().all(|(_, call)| matches!(call, Call::One(_))),
        "{calls:?}"
    );
    assert_eq!(receipts(&calls).len(), JOBS);
    assert_eq!(case.effects().await, (3, 3));
    assert_eq!(case.broker.left().await, 0);
    case.end().await;
}
