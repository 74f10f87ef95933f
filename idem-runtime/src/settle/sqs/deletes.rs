//! The receiver's acks, gathered into `DeleteMessageBatch` calls by a task of their own.

use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::DeleteMessageBatchRequestEntry;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::{MAX_VISIBILITY, SqsError};

/// The most deletes SQS takes in one `DeleteMessageBatch`.
const MAX_BATCH: usize = 10;

/// Where the receiver's acks go: the task that gathers them into batches, or, with
/// `batch_acks(Duration::ZERO)`, a `DeleteMessage` each.
#[derive(Debug, Clone)]
pub(super) struct Deletes {
    client: Client,
    url: String,
    batcher: Option<mpsc::UnboundedSender<Command>>,
}

/// What the batcher is asked.
#[derive(Debug)]
enum Command {
    Delete(Delete),
    /// Send every delete waiting, answer once SQS answered every batch sent, and from then on
    /// wait for no more deletes before sending one.
    Flush(oneshot::Sender<()>),
}

/// One ack waiting for its batch.
#[derive(Debug)]
struct Delete {
    receipt: String,
    /// The message's, for the log of a refusal.
    id: Option<String>,
    answer: oneshot::Sender<Result<(), SqsError>>,
}

impl Deletes {
    pub(super) fn start(client: &Client, url: &str, within: Duration, prefetch: usize) -> Deletes {
        let batcher = (!within.is_zero()).then(|| {
            // No ack is worth holding longer than SQS can keep its message invisible; and the
            // timer must not overflow.
            let within = within.min(Duration::from_secs(MAX_VISIBILITY));
            let (tx, commands) = mpsc::unbounded_channel();
            // It ends once every sender is gone (the receiver and its deliveries), after its
            // last batches were answered.
            let full = prefetch.clamp(1, MAX_BATCH);
            tokio::spawn(batch(
                client.clone(),
                url.to_owned(),
                (within, full),
                commands,
            ));
            tx
        });
        Deletes {
            client: client.clone(),
            url: url.to_owned(),
            batcher,
        }
    }

    /// Deletes the message, in a batch when there is a batcher; returns once SQS answered.
    pub(super) async fn delete(&self, receipt: String, id: Option<String>) -> Result<(), SqsError> {
        let Some(batcher) = &self.batcher else {
            self.client
                .delete_message()
                .queue_url(&self.url)
                .receipt_handle(receipt)
                .send()
                .await
                .map_err(|e| SqsError::new("DeleteMessage", e))?;
            return Ok(());
        };
        let (answer, answered) = oneshot::channel();
        let gone = || SqsError {
            call: "DeleteMessageBatch",
            message: "the receiver's task of deletes ended before it answered this one".to_owned(),
        };
        batcher
            .send(Command::Delete(Delete {
                receipt,
                id,
                answer,
            }))
            .map_err(|_| gone())?;
        answered.await.map_err(|_| gone())?
    }

    /// Sends the deletes waiting and returns once SQS answered every batch sent so far.
    pub(super) async fn flush(&self) {
        let Some(batcher) = &self.batcher else { return };
        let (done, flushed) = oneshot::channel();
        if batcher.send(Command::Flush(done)).is_ok() {
            // An error is a batcher gone, with nothing left to send.
            let _ = flushed.await;
        }
    }
}

/// The batcher: gathers deletes into batches of `full` (at most [`MAX_BATCH`]), each sent once
/// it is full or `within` after its first delete came (at once after a flush).
async fn batch(
    client: Client,
    url: String,
    (mut within, full): (Duration, usize),
    mut commands: mpsc::UnboundedReceiver<Command>,
) {
    let mut waiting: Vec<Delete> = Vec::with_capacity(MAX_BATCH);
    // Each batch is a task of its own: its call is under way while the next batch gathers.
    let mut sending = JoinSet::new();
    let due = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(due);
    let send = |sending: &mut JoinSet<()>, waiting: &mut Vec<Delete>| {
        let batch = std::mem::replace(waiting, Vec::with_capacity(MAX_BATCH));
        sending.spawn(delete_batch(client.clone(), url.clone(), batch));
    };
    loop {
        while sending.try_join_next().is_some() {}
        tokio::select! {
            // The deletes already queued before the timer: after a flush (a timer due at once)
            // they still share a batch.
            biased;
            command = commands.recv() => match command {
                Some(Command::Delete(delete)) => {
                    if waiting.is_empty() {
                        due.as_mut().reset(Instant::now() + within);
                    }
                    waiting.push(delete);
                    if waiting.len() >= full {
                        send(&mut sending, &mut waiting);
                    }
                }
                Some(Command::Flush(done)) => {
                    within = Duration::ZERO;
                    if !waiting.is_empty() {
                        send(&mut sending, &mut waiting);
                    }
                    while sending.join_next().await.is_some() {}
                    let _ = done.send(());
                }
                None => {
                    if !waiting.is_empty() {
                        send(&mut sending, &mut waiting);
                    }
                    while sending.join_next().await.is_some() {}
                    return;
                }
            },
            () = &mut due, if !waiting.is_empty() => send(&mut sending, &mut waiting),
        }
    }
}

/// Sends one `DeleteMessageBatch` and gives each delete its answer: `Ok` only for an entry SQS
/// says it deleted.
async fn delete_batch(client: Client, url: String, batch: Vec<Delete>) {
    // An entry's id is its place in the batch: unique within it, as SQS requires.
    let entries = batch.iter().enumerate().map(|(n, delete)| {
        DeleteMessageBatchRequestEntry::builder()
            .id(n.to_string())
            .receipt_handle(&delete.receipt)
            .build()
    });
    let entries = match entries.collect::<Result<Vec<_>, _>>() {
        Ok(entries) => entries,
        Err(e) => return answer_all(batch, &SqsError::new("DeleteMessageBatch", e)),
    };
    let out = client
        .delete_message_batch()
        .queue_url(&url)
        .set_entries(Some(entries))
        .send()
        .await;
    let out = match out {
        Ok(out) => out,
        Err(e) => return answer_all(batch, &SqsError::new("DeleteMessageBatch", e)),
    };
    let mut answers: Vec<Option<Result<(), SqsError>>> = Vec::new();
    answers.resize_with(batch.len(), || None);
    for deleted in &out.successful {
        if let Some(answer) = deleted
            .id
            .parse()
            .ok()
            .and_then(|n: usize| answers.get_mut(n))
        {
            *answer = Some(Ok(()));
        }
    }
    for refused in &out.failed {
        let Some(n) = refused.id.parse().ok().filter(|n: &usize| *n < batch.len()) else {
            continue;
        };
        let message = refused.message.as_deref().unwrap_or("(no message)");
        tracing::warn!(
            message.id = batch[n].id.as_deref(),
            code = refused.code.as_str(),
            error = message,
            sender_fault = refused.sender_fault,
            "idem: SQS refused an ack's delete; the message comes back after its visibility \
             timeout, and that delivery is a duplicate"
        );
        answers[n] = Some(Err(SqsError {
            call: "DeleteMessageBatch",
            message: format!("SQS refused the delete: {}: {message}", refused.code),
        }));
    }
    for (delete, answer) in batch.into_iter().zip(answers) {
        let answer = answer.unwrap_or_else(|| {
            Err(SqsError {
                call: "DeleteMessageBatch",
                message: "SQS's answer names this delete neither deleted nor refused".to_owned(),
            })
        });
        // A settlement dropped half-way (the runner's drain ran out) no longer waits for it.
        let _ = delete.answer.send(answer);
    }
}

/// Gives every delete of a batch that did not reach SQS the same error.
fn answer_all(batch: Vec<Delete>, error: &SqsError) {
    for delete in batch {
        let _ = delete.answer.send(Err(SqsError {
            call: error.call,
            message: error.message.clone(),
        }));
    }
}
