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

    fn message(message: &Message) -> PublishMessage {
        PublishMessage::build()
            .payload(message.payload.clone().into())
            .message_id(message.id.as_str())
    }
}

impl Publisher for JetStream {
    async fn publish<'a>(&'a self, message: &'a Message) -> Result<(), PublishError> {
        self.context
            .send_publish(message.destination.clone(), Self::message(message))
            .await?
            .await?;
        Ok(())
    }

    /// Every message of the round is sent first, in order, and the stream's acks are waited
    /// for after: one round trip for the round.
    async fn publish_all<'a>(
        &'a self,
        messages: &'a [Message],
        done: &'a mut Vec<Result<(), PublishError>>,
    ) {
        let mut acks = Vec::with_capacity(messages.len());
        for message in messages {
            let sent = self
                .context
                .send_publish(message.destination.clone(), Self::message(message))
                .await;
            acks.push(sent);
        }
        for ack in acks {
            let answer = match ack {
                Ok(ack) => ack.await.map(drop).map_err(PublishError::from),
                Err(e) => Err(e.into()),
            };
            done.push(answer);
        }
    }
}
