//! The consumer loop on Amazon SQS (aws-sdk-sqs): a queue's messages as a [`Source`], each
//! settled as its [`Disposition`] says.
//!
//! - **Ack**: `DeleteMessageBatch`, up to 10 acks in one call. A task of the receiver's own
//!   gathers them and sends a batch once 10 wait, or [`batch_acks`](Receiver::batch_acks)
//!   (50 ms by default) after the first of them; each delivery's settlement returns once SQS
//!   answered for its entry. An entry SQS refuses is logged with its code and message, and
//!   its settlement fails as any that did not reach SQS (the runner ends with the error): the
//!   message comes back after its visibility timeout, and that delivery is a `Duplicate`. A
//!   delete is sent only once the runner decided the ack, after the handler's commit.
//!   (`batch_acks(Duration::ZERO)`: one `DeleteMessage` per ack.)
//! - **Retry after a delay**: `ChangeMessageVisibility` to the delay, rounded up to whole
//!   seconds (SQS counts in seconds), at most SQS's 12 hours.
//! - **Dead letter**: a copy sent to your dead-letter queue with the reason in its
//!   `idem-reason` message attribute, then deleted as an ack is. (The queue's redrive policy,
//!   if it has one, moves a message only after its `maxReceiveCount`: give it one above the
//!   runner's cap, so that the cap decides and the reason is kept.)
//! - **Heartbeat** (the runner's, while a handler runs): `ChangeMessageVisibility` to the
//!   receiver's [visibility](Receiver::visibility), by default the queue's own
//!   `VisibilityTimeout` (read once, at the first heartbeat), so that a handler may run longer
//!   than the visibility timeout. SQS refuses to keep a message invisible past 12 hours after
//!   its receive; the refusal is logged and the message comes back then.
//!
//! The delivery count is SQS's `ApproximateReceiveCount`. Messages are received by a task of
//! the source's own into a buffer of `prefetch`, so that a receive is never cut off half-way
//! (its messages would stay invisible for the whole visibility timeout). At shutdown no receive
//! begins any more, the one under way ends (within its `wait_seconds`), and the messages
//! received and not handed out are made visible again at once; those dropped unsettled come
//! back after the queue's visibility timeout. The acks waiting are sent at once: the source's
//! stop returns once SQS answered them, and from then on no ack waits for others, so that the
//! deliveries the runner drains settle without delay. Its close sends whatever was acked after
//! that before it returns, the acks of deliveries dropped half-way through their settlement
//! too.

use std::sync::Arc;
use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::error::DisplayErrorContext;
use aws_sdk_sqs::types::{
    Message, MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName,
};
use tokio::sync::{OnceCell, mpsc};

mod deletes;

use deletes::Deletes;

use super::{Delivery, Disposition, Source};

/// The aws-sdk-sqs this adapter is built on: your `Client` must be this crate's.
pub use aws_sdk_sqs;

/// The message attribute of a dead letter that says why it was dead-lettered.
pub const REASON_ATTRIBUTE: &str = "idem-reason";
/// The message attribute of a dead letter that says how many receives it had.
pub const DELIVERY_ATTRIBUTE: &str = "idem-delivery";

/// The longest receive SQS allows in one call.
const MAX_RECEIVE: usize = 10;
/// How long an ack waits for others by default ([`Receiver::batch_acks`]).
pub const DEFAULT_BATCH_ACKS: Duration = Duration::from_millis(50);
/// SQS's longest visibility timeout, in seconds (12 hours).
const MAX_VISIBILITY: u64 = 12 * 60 * 60;

/// Why a receive or a settlement did not reach SQS.
#[derive(Debug, thiserror::Error)]
#[error("SQS {call}: {message}")]
pub struct SqsError {
    call: &'static str,
    message: String,
}

impl SqsError {
    fn new(call: &'static str, e: impl std::error::Error) -> SqsError {
        // The SDK's own `Display` says only "service error"; its context names the cause.
        SqsError {
            call,
            message: DisplayErrorContext(&e).to_string(),
        }
    }
}

/// Where a queue is and where its dead letters go.
#[derive(Debug, Clone)]
pub struct Queues {
    /// The queue's URL.
    pub url: String,
    /// The dead-letter queue's URL.
    pub dead_letters: String,
}

/// A queue's messages, as the runner's [`Source`].
#[derive(Debug)]
pub struct Receiver {
    client: Client,
    queues: Queues,
    received: mpsc::Receiver<Result<Message, SqsError>>,
    /// The heartbeat's visibility timeout in seconds: set by [`Receiver::visibility`], else
    /// the queue's, read at the first heartbeat. Shared by the receives, so it is read once.
    visibility: Arc<OnceCell<i32>>,
    deletes: Deletes,
    /// The most deliveries handed out at once: a batch is full at this many (at most 10).
    prefetch: usize,
}

impl Receiver {
    /// Receives `queues.url`'s messages into a buffer of `prefetch` (give the runner the
    /// same [`in_flight`](super::Runner::in_flight)), each receive waiting at most
    /// `wait_seconds` (SQS's long polling, 0 to 20) for messages.
    pub fn consume(client: &Client, queues: Queues, prefetch: usize, wait_seconds: i32) -> Self {
        let (tx, received) = mpsc::channel(prefetch.max(1));
        // It ends once the buffer is closed (at shutdown) and its last receive is handed over.
        tokio::spawn(receive(
            client.clone(),
            queues.url.clone(),
            wait_seconds,
            tx,
        ));
        let prefetch = prefetch.max(1);
        let deletes = Deletes::start(client, &queues.url, DEFAULT_BATCH_ACKS, prefetch);
        Receiver {
            client: client.clone(),
            queues,
            received,
            visibility: Arc::new(OnceCell::new()),
            deletes,
            prefetch,
        }
    }

    /// How long an ack waits for others to share its `DeleteMessageBatch` (SQS takes up to 10
    /// deletes in one call): a batch is sent once it is full, or `within` after the first of
    /// its acks. A batch is full at 10 acks, or at the receiver's `prefetch` if that is
    /// smaller: a consumer with fewer deliveries out than 10 never waits for acks that cannot
    /// come (with a prefetch of 1, each ack is sent at once). By default
    /// [`DEFAULT_BATCH_ACKS`], 50 ms. `Duration::ZERO`: each ack is a `DeleteMessage` of its
    /// own, sent at once.
    ///
    /// A delivery's settlement returns once SQS answered for its delete, so the delivery holds
    /// its place among the runner's [`in_flight`](super::Runner::in_flight) until then: up to
    /// `within` longer than with a delete of its own while fewer deliveries end together than
    /// a full batch. When messages keep coming, the places held fill the batch, which is then
    /// sent at once.
    pub fn batch_acks(mut self, within: Duration) -> Self {
        // The task it replaces ends once its last sender is gone: here, unless deliveries
        // were handed out before (they keep it).
        self.deletes = Deletes::start(&self.client, &self.queues.url, within, self.prefetch);
        self
    }

    /// How long each [heartbeat](super::Runner::heartbeat) keeps a message whose handler runs
    /// invisible, from the heartbeat on: rounded up to whole seconds (SQS counts in seconds),
    /// from 1 s to 12 hours. By default the queue's own `VisibilityTimeout`, which the first
    /// heartbeat reads (`GetQueueAttributes`). Keep the runner's heartbeat well under it.
    pub fn visibility(mut self, timeout: Duration) -> Self {
        self.visibility = Arc::new(OnceCell::new_with(Some(seconds(timeout).max(1))));
        self
    }
}

/// `d` in whole seconds, rounded up, at most SQS's 12 hours.
fn seconds(d: Duration) -> i32 {
    // At most 43,200: fits.
    d.as_millis().div_ceil(1000).min(MAX_VISIBILITY.into()) as i32
}

/// The queue's `VisibilityTimeout`, in seconds.
async fn queue_visibility(client: &Client, url: &str) -> Result<i32, SqsError> {
    let out = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::VisibilityTimeout)
        .send()
        .await
        .map_err(|e| SqsError::new("GetQueueAttributes", e))?;
    let value = out
        .attributes
        .and_then(|mut a| a.remove(&QueueAttributeName::VisibilityTimeout));
    value
        .as_deref()
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| SqsError {
            call: "GetQueueAttributes",
            message: format!("the queue's VisibilityTimeout is {value:?}, not a number"),
        })
}

/// Makes a received message invisible for `seconds` from now (visible at once for 0).
async fn change_visibility(
    client: &Client,
    url: &str,
    receipt: &str,
    seconds: i32,
) -> Result<(), SqsError> {
    client
        .change_message_visibility()
        .queue_url(url)
        .receipt_handle(receipt)
        .visibility_timeout(seconds)
        .send()
        .await
        .map_err(|e| SqsError::new("ChangeMessageVisibility", e))?;
    Ok(())
}

/// Receives as many messages as the buffer has room for, until the buffer is gone or a
/// receive fails.
async fn receive(
    client: Client,
    url: String,
    wait_seconds: i32,
    tx: mpsc::Sender<Result<Message, SqsError>>,
) {
    loop {
        let room = tx.capacity().clamp(1, MAX_RECEIVE);
        let Ok(permits) = tx.reserve_many(room).await else {
            return;
        };
        let answer = client
            .receive_message()
            .queue_url(&url)
            .max_number_of_messages(room as i32)
            .wait_time_seconds(wait_seconds)
            .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
            .send()
            .await;
        match answer {
            Ok(out) => {
                for (permit, message) in permits.zip(out.messages.unwrap_or_default()) {
                    permit.send(Ok(message));
                }
            }
            Err(e) => {
                if let Some(permit) = permits.into_iter().next() {
                    permit.send(Err(SqsError::new("ReceiveMessage", e)));
                }
                return;
            }
        }
    }
}

impl Source for Receiver {
    type Delivery = Received;
    type Error = SqsError;

    async fn next(&mut self) -> Option<Result<Received, SqsError>> {
        let message = match self.received.recv().await? {
            Ok(message) => message,
            Err(e) => return Some(Err(e)),
        };
        let count = message
            .attributes()
            .and_then(|a| a.get(&MessageSystemAttributeName::ApproximateReceiveCount))
            .and_then(|n| n.parse().ok())
            .unwrap_or(1);
        Some(Ok(Received {
            message,
            count,
            client: self.client.clone(),
            queues: self.queues.clone(),
            visibility: self.visibility.clone(),
            deletes: self.deletes.clone(),
        }))
    }

    /// No receive begins any more; the one under way still hands its messages over. The acks
    /// waiting are sent at once, and it returns once SQS answered them; from then on no ack
    /// waits for others.
    async fn stop(&mut self) -> Result<(), SqsError> {
        self.received.close();
        self.deletes.flush().await;
        Ok(())
    }

    /// Sends the acks that came since the stop (and returns once SQS answered them), then
    /// makes the messages received and not handed out visible again at once, the last
    /// receive's too (waiting for it: at most its `wait_seconds`).
    async fn close(mut self) -> Result<(), SqsError> {
        self.received.close();
        self.deletes.flush().await;
        while let Some(message) = self.received.recv().await {
            let Ok(message) = message else { continue };
            let receipt = message.receipt_handle().unwrap_or_default();
            change_visibility(&self.client, &self.queues.url, receipt, 0).await?;
        }
        Ok(())
    }
}

/// One receive of an SQS message.
#[derive(Debug)]
pub struct Received {
    message: Message,
    count: u32,
    client: Client,
    queues: Queues,
    visibility: Arc<OnceCell<i32>>,
    deletes: Deletes,
}

impl Received {
    /// The message as aws-sdk-sqs gave it (its attributes, receipt handle).
    pub fn message(&self) -> &Message {
        &self.message
    }

    fn receipt(&self) -> &str {
        self.message.receipt_handle().unwrap_or_default()
    }
}

impl Delivery for Received {
    type Error = SqsError;

    fn payload(&self) -> &[u8] {
        self.message.body().unwrap_or_default().as_bytes()
    }

    fn count(&self) -> u32 {
        self.count
    }

    fn id(&self) -> Option<&str> {
        self.message.message_id()
    }

    fn system(&self) -> &'static str {
        "aws_sqs"
    }

    fn destination(&self) -> Option<&str> {
        Some(&self.queues.url)
    }

    /// `ChangeMessageVisibility` to the receiver's [visibility](Receiver::visibility) (the
    /// queue's own unless set), counted from now.
    async fn extend(&self) -> Result<(), SqsError> {
        let seconds = *self
            .visibility
            .get_or_try_init(|| queue_visibility(&self.client, &self.queues.url))
            .await?;
        change_visibility(&self.client, &self.queues.url, self.receipt(), seconds).await
    }

    /// An ack (and a dead letter once its copy was sent) returns once SQS answered for the
    /// message's delete, in a `DeleteMessageBatch` it may share with other acks
    /// ([`Receiver::batch_acks`]): `Ok` when SQS deleted it, `Err` when the call failed or SQS
    /// refused this entry (then the message comes back after its visibility timeout).
    async fn settle(self, disposition: &Disposition) -> Result<(), SqsError> {
        match disposition {
            Disposition::Ack => {}
            Disposition::Retry { after } => {
                let (url, receipt) = (&self.queues.url, self.receipt());
                return change_visibility(&self.client, url, receipt, seconds(*after)).await;
            }
            Disposition::DeadLetter { reason } => self.dead_letter(reason).await?,
        }
        let receipt = self.receipt().to_owned();
        let id = self.message.message_id;
        self.deletes.delete(receipt, id).await
    }
}

impl Received {
    /// Sends a copy to the dead-letter queue, the reason and the receive count as attributes.
    async fn dead_letter(&self, reason: &str) -> Result<(), SqsError> {
        let attribute = |value: String| {
            MessageAttributeValue::builder()
                .data_type("String")
                .string_value(value)
                .build()
                .map_err(|e| SqsError::new("a message attribute", e))
        };
        let mut send = self
            .client
            .send_message()
            .queue_url(&self.queues.dead_letters)
            .message_body(self.message.body().unwrap_or_default())
            .message_attributes(REASON_ATTRIBUTE, attribute(reason.to_owned())?)
            .message_attributes(DELIVERY_ATTRIBUTE, attribute(self.count.to_string())?);
        if self.queues.dead_letters.ends_with(".fifo") {
            // The original's id: unique, and the same if this send is retried.
            let id = self.message.message_id().unwrap_or_default();
            send = send.message_group_id(id).message_deduplication_id(id);
        }
        send.send()
            .await
            .map_err(|e| SqsError::new("SendMessage (dead letters)", e))?;
        Ok(())
    }
}
