//! NATS JetStream: each outbox message published to its destination subject with its id as
//! `Nats-Msg-Id`, so that the stream drops a second publish of it inside its duplicate window;
//! sent once JetStream acked it.

use async_nats::jetstream::{self, message::PublishMessage};

use super::{PublishError, Publisher};
use crate::outgoing::Message;

/// Publishes to NATS JetStream: `Ok` only once the stream acked the message (a duplicate
/// JetStream dropped is acked too: it holds the first one).
#[derive(Debug, Clone)]
pub struct JetStream {
    context: jetstream::Context,
}

impl JetStream {
    /// Publishes through `context`; a message's destination is its subject, which a stream
    /// must capture.
    pub fn new(context: jetstream::Context) -> Self {
        JetStream { context }
    }
}

impl Publisher for JetStream {
    async fn publish<'a>(&'a self, message: &'a Message) -> Result<(), PublishError> {
        self.context
            .send_publish(
                message.destination.clone(),
                PublishMessage::build()
                    .payload(message.payload.clone().into())
                    .message_id(message.id.as_str()),
            )
            .await?
            .await?;
        Ok(())
    }
}
