//! The SQS side of the `sqs_worker` example: a client for a loopback SQS (moto's server in the
//! tests), queues with a dead-letter queue, and a worker loop that long-polls up to ten
//! messages at a time, hands them to a handler and deletes, delays or dead-letters each by
//! what the handler answered. Nothing here knows the handler's database: the example and the
//! tests bring their own `#[idempotent]` handlers.
//!
//! The rule of docs/brokers.md, for SQS:
//!
//! | the handler answered | the loop |
//! |---|---|
//! | `Applied`, `Duplicate`, `Replayed` | deletes the message (`DeleteMessageBatch`) |
//! | `InProgress`, a lease that ran out or was lost | `ChangeMessageVisibility` to a short delay: the message comes back soon, not after the whole visibility timeout |
//! | any other error (a database error, a rollback) | nothing: the message comes back after its visibility timeout, and the redrive policy moves it to the dead-letter queue after `maxReceiveCount` receives |
//! | `KeyReused`, a body that is not a job | sends it to the dead-letter queue and deletes it: no retry can succeed, so it should not spend `maxReceiveCount` receives first |

use std::future::Future;
use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
use aws_sdk_sqs::error::DisplayErrorContext;
use aws_sdk_sqs::types::{
    ChangeMessageVisibilityBatchRequestEntry, DeleteMessageBatchRequestEntry,
    MessageAttributeValue, MessageSystemAttributeName,
};
use futures_util::FutureExt as _;
use idem::{Batch, Lease, Outcome};
use serde::{Deserialize, Serialize};

/// The SQS endpoint of the example and the tests, unless `IDEM_SQS_URL` says otherwise.
pub const DEFAULT_SQS_URL: &str = "http://127.0.0.1:5000";

/// At most this many messages per `ReceiveMessage` (SQS's own limit).
pub const MAX_MESSAGES: i32 = 10;

/// `IDEM_SQS_URL`, else [`DEFAULT_SQS_URL`].
pub fn sqs_url() -> String {
    std::env::var("IDEM_SQS_URL").unwrap_or_else(|_| DEFAULT_SQS_URL.to_owned())
}

/// An SQS call that failed, with the SDK's whole chain of causes.
#[derive(Debug)]
pub struct SqsError(pub String);

impl std::fmt::Display for SqsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SqsError {}

fn sqs_error(what: &str, e: impl std::error::Error) -> SqsError {
    SqsError(format!("{what}: {}", DisplayErrorContext(&e)))
}

/// A client of the SQS at `url` with static test credentials, checked with a `ListQueues`;
/// the error names the URL and the variable that overrides it.
///
/// The HTTP client is plain HTTP (hyper, no TLS stack compiled in): enough for a loopback
/// server. Against AWS itself, use `aws-config` and the SDK's default HTTPS client instead.
pub async fn connect(url: &str) -> Result<Client, SqsError> {
    let config = aws_sdk_sqs::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .endpoint_url(url)
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new("test", "test", None, None, "idem-example"))
        .http_client(aws_smithy_http_client::Builder::new().build_http())
        .build();
    let client = Client::from_conf(config);
    client.list_queues().send().await.map_err(|e| {
        SqsError(format!(
            "cannot reach SQS at {url} (set IDEM_SQS_URL): {}",
            DisplayErrorContext(&e)
        ))
    })?;
    Ok(client)
}

/// A top-up job as the producer sends it (JSON). `id` is stable across redeliveries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopUp {
    pub id: String,
    pub account: i64,
    pub credits: i64,
}

/// The handlers' error: idem's own, the database's, or an outside call's.
#[derive(Debug)]
pub enum JobError {
    Database(sqlx::Error),
    Idem(idem::Error),
    Outside(String),
}

impl From<sqlx::Error> for JobError {
    fn from(e: sqlx::Error) -> Self {
        JobError::Database(e)
    }
}

impl From<idem::Error> for JobError {
    fn from(e: idem::Error) -> Self {
        JobError::Idem(e)
    }
}

impl std::fmt::Display for JobError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JobError::Database(e) => write!(f, "{e}"),
            JobError::Idem(e) => write!(f, "{e}"),
            JobError::Outside(e) => write!(f, "{e}"),
        }
    }
}

mod queue;

pub use queue::{
    MAX_DEDUP_ID, Queue, create_queue, dedup_id, delete_queue, messages_left, send_jobs,
};

/// A received message that parsed as a job.
#[derive(Debug, Clone)]
pub struct Received {
    pub job: TopUp,
    pub message_id: String,
    pub receipt: String,
    /// `ApproximateReceiveCount`: 1 on the first receive, one more on each redelivery.
    pub receive_count: u32,
}

/// What to do with one message, the handler's answer turned into SQS calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Committed, by this delivery (`applied`) or an earlier one: delete it.
    Done { applied: bool },
    /// Nothing was kept. `Some(s)`: make it visible again in `s` seconds; `None`: leave it
    /// invisible until its visibility timeout runs out.
    Retry { after: Option<i32>, error: String },
    /// No retry can succeed: send it to the dead-letter queue and delete it.
    DeadLetter { reason: String },
}

/// The verdicts of a batch handler's answer, one per job in the batch's order: all of them
/// done (`Applied` or `Duplicate`), or all retried (nothing of the batch was kept). A batch
/// handler cannot take a `fingerprint`, so `KeyReused` does not come out of one.
pub fn batch_verdicts<T>(
    result: &Result<Batch<T>, JobError>,
    jobs: usize,
    retry_after: i32,
) -> Vec<Verdict> {
    match result {
        Ok(batch) => batch
            .outcomes()
            .iter()
            .map(|o| Verdict::Done {
                applied: matches!(o, Outcome::Applied(())),
            })
            .collect(),
        Err(e) => vec![retry(e, retry_after); jobs],
    }
}

/// The verdict of one job's answer (transaction or lease mode).
pub fn verdict<T>(result: &Result<Outcome<T>, JobError>, retry_after: i32) -> Verdict {
    match result {
        Ok(Outcome::Applied(_)) => Verdict::Done { applied: true },
        // A job failed for good in an earlier delivery is settled too: delete it.
        Ok(Outcome::Duplicate | Outcome::Replayed(_) | Outcome::Failed(_)) => {
            Verdict::Done { applied: false }
        }
        Err(e @ JobError::Idem(idem::Error::KeyReused { .. })) => Verdict::DeadLetter {
            reason: e.to_string(),
        },
        Err(e) => retry(e, retry_after),
    }
}

fn retry(e: &JobError, retry_after: i32) -> Verdict {
    // Another delivery holds the key, or this one's lease ended: the key is free or will be
    // soon, so come back after a short delay rather than the whole visibility timeout.
    let soon = matches!(
        e,
        JobError::Idem(
            idem::Error::InProgress { .. }
                | idem::Error::Lease(idem::LeaseError::Timeout { .. })
                | idem::Error::Lease(idem::LeaseError::Lost { .. })
        )
    );
    Verdict::Retry {
        after: soon.then_some(retry_after),
        error: e.to_string(),
    }
}

/// What the worker did with one message, in the order it happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Received {
        id: String,
        receive_count: u32,
    },
    /// The handler's answer was `Done`; the delete follows. Told before the delete, so that a
    /// worker killed in between has told it (the message comes back and is told again).
    Handled {
        id: String,
        applied: bool,
    },
    Deleted {
        id: String,
        applied: bool,
    },
    /// A delete SQS refused (a stale receipt handle): the message comes back, a `Duplicate`.
    NotDeleted {
        id: String,
        error: String,
    },
    Retried {
        id: String,
        after: Option<i32>,
        error: String,
    },
    DeadLettered {
        id: String,
        reason: String,
    },
    /// A lease-mode handler renewed its lease and (`extended`) its message's visibility.
    Heartbeat {
        id: String,
        extended: bool,
    },
}

impl std::fmt::Display for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // One line per event, read by the tests from their worker processes' stdout.
        let what = |applied: &bool| if *applied { "applied" } else { "duplicate" };
        match self {
            Event::Received { id, receive_count } => {
                write!(f, "RECEIVED {id} count={receive_count}")
            }
            Event::Handled { id, applied } => write!(f, "HANDLED {} {id}", what(applied)),
            Event::Deleted { id, applied } => write!(f, "DELETED {} {id}", what(applied)),
            Event::NotDeleted { id, error } => write!(f, "NOT DELETED {id}: {error}"),
            Event::Retried { id, after, error } => match after {
                Some(s) => write!(f, "RETRY {id} after={s}s: {error}"),
                None => write!(f, "RETRY {id} after=timeout: {error}"),
            },
            Event::DeadLettered { id, reason } => write!(f, "DEAD {id}: {reason}"),
            Event::Heartbeat { id, extended } => write!(f, "HEARTBEAT {id} extended={extended}"),
        }
    }
}

/// How a [`Worker`] talks to its queue.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// `WaitTimeSeconds` of each receive (long polling, at most 20): the loop also sees its
    /// stop signal between receives, so this bounds how long a stop takes.
    pub wait_seconds: i32,
    /// The visibility timeout the heartbeat sets again (seconds); the queue's own applies to
    /// each receive.
    pub visibility: i32,
    /// The visibility a retried message gets (seconds).
    pub retry_after: i32,
    /// How often a lease-mode handler's heartbeat renews its lease and extends its message's
    /// visibility: shorter than both, with room for the two round trips.
    pub heartbeat: Duration,
}

/// One receive loop on one queue.
pub struct Worker<'a> {
    pub client: &'a Client,
    pub queue: &'a Queue,
    pub options: Options,
    pub on_event: &'a (dyn Fn(&Event) + Sync),
}

impl Worker<'_> {
    /// Receives up to ten messages at a time until `stop` resolves (seen between receives),
    /// hands the jobs of each receive to `handle`, which answers one [`Verdict`] per job in
    /// their order, and carries the verdicts out. A body that is not a job is dead-lettered
    /// without reaching `handle`.
    pub async fn run<H, Fut>(
        &self,
        handle: H,
        stop: impl Future<Output = ()>,
    ) -> Result<(), SqsError>
    where
        H: Fn(Vec<Received>) -> Fut,
        Fut: Future<Output = Vec<Verdict>>,
    {
        let mut stop = std::pin::pin!(stop);
        // A receive is never cancelled: the messages of a dropped response would stay
        // invisible for the whole visibility timeout.
        while stop.as_mut().now_or_never().is_none() {
            let received = self
                .client
                .receive_message()
                .queue_url(&self.queue.url)
                .max_number_of_messages(MAX_MESSAGES)
                .wait_time_seconds(self.options.wait_seconds)
                .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
                .send()
                .await
                .map_err(|e| sqs_error("ReceiveMessage", e))?;
            let mut jobs = Vec::new();
            for message in received.messages() {
                let receipt = message.receipt_handle().unwrap_or_default().to_owned();
                let body = message.body().unwrap_or_default();
                let receive_count = message
                    .attributes()
                    .and_then(|a| a.get(&MessageSystemAttributeName::ApproximateReceiveCount))
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0);
                match serde_json::from_str::<TopUp>(body) {
                    Ok(job) => {
                        (self.on_event)(&Event::Received {
                            id: job.id.clone(),
                            receive_count,
                        });
                        jobs.push(Received {
                            job,
                            message_id: message.message_id().unwrap_or_default().to_owned(),
                            receipt,
                            receive_count,
                        });
                    }
                    Err(e) => {
                        let id = message.message_id().unwrap_or_default();
                        let reason = format!("not a top-up job: {e}");
                        self.dead_letter(id, id, body, &receipt, &reason).await?;
                    }
                }
            }
            if jobs.is_empty() {
                continue;
            }
            let verdicts = handle(jobs.clone()).await;
            assert_eq!(verdicts.len(), jobs.len(), "one verdict per job");
            self.carry_out(&jobs, verdicts).await?;
        }
        Ok(())
    }

    async fn carry_out(&self, jobs: &[Received], verdicts: Vec<Verdict>) -> Result<(), SqsError> {
        let mut delete = Vec::new();
        let mut delay = Vec::new();
        for (i, (r, verdict)) in jobs.iter().zip(verdicts).enumerate() {
            let id = r.job.id.clone();
            match verdict {
                Verdict::Done { applied } => {
                    (self.on_event)(&Event::Handled {
                        id: id.clone(),
                        applied,
                    });
                    delete.push((i, applied));
                }
                Verdict::Retry { after, error } => {
                    if after.is_some() {
                        delay.push(i);
                    }
                    (self.on_event)(&Event::Retried { id, after, error });
                }
                Verdict::DeadLetter { reason } => {
                    let body =
                        serde_json::to_string(&r.job).map_err(|e| SqsError(e.to_string()))?;
                    self.dead_letter(&id, &r.message_id, &body, &r.receipt, &reason)
                        .await?;
                }
            }
        }
        if !delete.is_empty() {
            let entries = delete
                .iter()
                .map(|&(i, _)| {
                    DeleteMessageBatchRequestEntry::builder()
                        .id(i.to_string())
                        .receipt_handle(&jobs[i].receipt)
                        .build()
                        .map_err(|e| sqs_error("a batch entry", e))
                })
                .collect::<Result<Vec<_>, _>>()?;
            let out = self
                .client
                .delete_message_batch()
                .queue_url(&self.queue.url)
                .set_entries(Some(entries))
                .send()
                .await
                .map_err(|e| sqs_error("DeleteMessageBatch", e))?;
            for (i, applied) in delete {
                let id = jobs[i].job.id.clone();
                let entry = i.to_string();
                match out.failed().iter().find(|f| f.id == entry) {
                    None => (self.on_event)(&Event::Deleted { id, applied }),
                    Some(f) => (self.on_event)(&Event::NotDeleted {
                        id,
                        error: format!("{}: {}", f.code, f.message.clone().unwrap_or_default()),
                    }),
                }
            }
        }
        if !delay.is_empty() {
            let entries = delay
                .iter()
                .map(|&i| {
                    ChangeMessageVisibilityBatchRequestEntry::builder()
                        .id(i.to_string())
                        .receipt_handle(&jobs[i].receipt)
                        .visibility_timeout(self.options.retry_after)
                        .build()
                        .map_err(|e| sqs_error("a batch entry", e))
                })
                .collect::<Result<Vec<_>, _>>()?;
            // A failed entry only means the message keeps its visibility timeout.
            self.client
                .change_message_visibility_batch()
                .queue_url(&self.queue.url)
                .set_entries(Some(entries))
                .send()
                .await
                .map_err(|e| sqs_error("ChangeMessageVisibilityBatch", e))?;
        }
        Ok(())
    }

    /// Sends the message to the dead-letter queue (with the reason as a message attribute),
    /// then deletes it here.
    async fn dead_letter(
        &self,
        id: &str,
        message_id: &str,
        body: &str,
        receipt: &str,
        reason: &str,
    ) -> Result<(), SqsError> {
        let mut send = self
            .client
            .send_message()
            .queue_url(&self.queue.dead_letters)
            .message_body(body)
            .message_attributes(
                "idem-dead-letter-reason",
                MessageAttributeValue::builder()
                    .data_type("String")
                    .string_value(reason)
                    .build()
                    .map_err(|e| sqs_error("a message attribute", e))?,
            );
        if self.queue.dead_letters.ends_with(".fifo") {
            // The message id of the original: unique, and stable if this send is retried.
            send = send
                .message_group_id(id)
                .message_deduplication_id(message_id);
        }
        send.send()
            .await
            .map_err(|e| sqs_error("SendMessage (dead letters)", e))?;
        self.client
            .delete_message()
            .queue_url(&self.queue.url)
            .receipt_handle(receipt)
            .send()
            .await
            .map_err(|e| sqs_error("DeleteMessage", e))?;
        (self.on_event)(&Event::DeadLettered {
            id: id.to_owned(),
            reason: reason.to_owned(),
        });
        Ok(())
    }

    /// A lease-mode body's heartbeat, run beside its outside call (`tokio::select!`): every
    /// [`Options::heartbeat`] it renews the lease and, only if that succeeded, sets the
    /// message's visibility to [`Options::visibility`] again from now. It returns only when the
    /// renewal failed ([`idem::LeaseError::Lost`]: another delivery took the key over), which ends
    /// the body.
    ///
    /// Tied to `renew`, and in this order, so that a worker extends its message's invisibility
    /// only while it holds the key: one that lost the key stops hiding the message from the
    /// delivery that can finish the job. A visibility change SQS refuses (the message was
    /// handed out again, under a new receipt handle) stops the extensions and not the body,
    /// which still holds the lease: the other delivery gets `InProgress` and retries later.
    pub async fn keep_invisible(&self, lease: &Lease, received: &Received) -> JobError {
        let mut extending = true;
        loop {
            tokio::time::sleep(self.options.heartbeat).await;
            if let Err(e) = lease.renew().await {
                return e.into();
            }
            if !extending {
                continue;
            }
            let extended = self
                .client
                .change_message_visibility()
                .queue_url(&self.queue.url)
                .receipt_handle(&received.receipt)
                .visibility_timeout(self.options.visibility)
                .send()
                .await;
            extending = extended.is_ok();
            (self.on_event)(&Event::Heartbeat {
                id: received.job.id.clone(),
                extended: extending,
            });
        }
    }
}
