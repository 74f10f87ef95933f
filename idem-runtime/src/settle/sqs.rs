//! The consumer loop on Amazon SQS (aws-sdk-sqs): a queue's messages as a [`Source`], each
//! settled as its [`Disposition`] says.
//!
//! - **Ack**: `DeleteMessage`.
//! - **Retry after a delay**: `ChangeMessageVisibility` to the delay, rounded up to whole
//!   seconds (SQS counts in seconds), at most SQS's 12 hours.
//! - **Dead letter**: a copy sent to your dead-letter queue with the reason in its
//!   `idem-reason` message attribute, then `DeleteMessage`. (The queue's redrive policy, if it
//!   has one, moves a message only after its `maxReceiveCount`: give it one above the runner's
//!   cap, so that the cap decides and the reason is kept.)
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
//! back after the queue's visibility timeout.

use std::sync::Arc;
use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::error::DisplayErrorContext;
use aws_sdk_sqs::types::{
    Message, MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName,
};
use tokio::sync::{OnceCell, mpsc};

use super::{Delivery, Disposition, Source};

/// The aws-sdk-sqs this adapter is built on: your `Client` must be this crate's.
pub use aws_sdk_sqs;

/// The message attribute of a dead letter that says why it was dead-lettered.
pub const REASON_ATTRIBUTE: &str = "idem-reason";
/// The message attribute of a dead letter that says how many receives it had.
pub const DELIVERY_ATTRIBUTE: &str = "idem-delivery";

/// The longest receive SQS allows in one call.
const MAX_RECEIVE: usize = 10;
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
        Receiver {
            client: client.clone(),
            queues,
            received,
            visibility: Arc::new(OnceCell::new()),
        }
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
        }))
    }

    /// No receive begins any more; the one under way still hands its messages over.
    async fn stop(&mut self) -> Result<(), SqsError> {
        self.received.close();
        Ok(())
    }

    /// Makes the messages received and not handed out visible again at once, the last
    /// receive's too (waiting for it: at most its `wait_seconds`).
    async fn close(mut self) -> Result<(), SqsError> {
        self.received.close();
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

    async fn settle(self, disposition: &Disposition) -> Result<(), SqsError> {
        match disposition {
            Disposition::Ack => {}
            Disposition::Retry { after } => {
                let (url, receipt) = (&self.queues.url, self.receipt());
                return change_visibility(&self.client, url, receipt, seconds(*after)).await;
            }
            Disposition::DeadLetter { reason } => self.dead_letter(reason).await?,
        }
        self.client
            .delete_message()
            .queue_url(&self.queues.url)
            .receipt_handle(self.receipt())
            .send()
            .await
            .map_err(|e| SqsError::new("DeleteMessage", e))?;
        Ok(())
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
