//! NATS JetStream: each outbox message published to its destination subject with its id as
//! `Nats-Msg-Id`, so that the stream drops a second publish of it inside its duplicate window,
//! and its headers (`content-type`, `traceparent`, yours) beside it; sent once JetStream acked
//! it.

use async_nats::HeaderMap;
use async_nats::header::{HeaderName, HeaderValue};
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

    /// The JetStream message of `message`. Headers were checked when the message was sent; one
    /// a broker still refuses (written by hand into the table) fails this message alone.
    fn message(message: &Message) -> Result<PublishMessage, PublishError> {
        let mut headers = HeaderMap::new();
        for (name, value) in message.headers.all() {
            let bad = || {
                format!(
                    "message {}: header {name:?} is not a NATS header",
                    message.id
                )
            };
            let name = HeaderName::try_from(name).map_err(|_| bad())?;
            let value: HeaderValue = value.parse().map_err(|_| bad())?;
            headers.append(name, value);
        }
        Ok(PublishMessage::build()
            .payload(message.payload.clone().into())
            .headers(headers)
            .message_id(message.id.as_str()))
    }
}

impl Publisher for JetStream {
    async fn publish<'a>(&'a self, message: &'a Message) -> Result<(), PublishError> {
        self.context
            .send_publish(message.destination.clone(), Self::message(message)?)
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
            let sent = match Self::message(message) {
                Ok(built) => self
                    .context
                    .send_publish(message.destination.clone(), built)
                    .await
                    .map_err(PublishError::from),
                Err(e) => Err(e),
            };
            acks.push(sent);
        }
        for ack in acks {
            let answer = match ack {
                Ok(ack) => ack.await.map(drop).map_err(PublishError::from),
                Err(e) => Err(e),
            };
            done.push(answer);
        }
    }
}
