//! RabbitMQ: a persistent message per outbox message, its id as the AMQP `message_id`, its
//! content type as `content_type` and its other headers (the `traceparent`, yours) in the
//! `headers` table, published to the default exchange with the destination as routing key (a
//! queue's name), confirmed by the broker before it counts as sent.
//!
//! Published `mandatory`: RabbitMQ confirms a message that no queue takes as readily as one
//! that a queue keeps, and drops it. With `mandatory` it returns such a message before the
//! confirm, and the relay keeps it pending (a mistyped destination, a queue not declared yet)
//! instead of marking it sent.

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, PublisherConfirm};

use super::{PublishError, Publisher};
use crate::outgoing::Message;

/// Publishes to RabbitMQ with publisher confirms: `Ok` only once the broker acked the message.
///
/// A channel not in confirm mode yet is put in it (`confirm_select`) before its first publish:
/// without confirms the broker's answer could not be waited for, and a message it took would
/// count as failed and be published again.
#[derive(Debug, Clone)]
pub struct RabbitMq {
    channel: Channel,
    exchange: String,
}

impl RabbitMq {
    /// Publishes on `channel` (put in confirm mode if it is not) to the default exchange: a
    /// message's destination is the queue it goes to.
    pub fn new(channel: Channel) -> Self {
        RabbitMq {
            channel,
            exchange: String::new(),
        }
    }

    /// Publishes to `exchange` instead, the destination as routing key.
    pub fn exchange(mut self, exchange: &str) -> Self {
        exchange.clone_into(&mut self.exchange);
        self
    }

    /// Confirms are selected on a channel that is not in confirm mode yet; selecting them again
    /// on one that is would be allowed and change nothing.
    async fn confirming(&self) -> Result<(), PublishError> {
        if !self.channel.status().confirm() {
            self.channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
        }
        Ok(())
    }

    /// Sends `message` and hands back its confirm, to be waited for.
    async fn send(&self, message: &Message) -> Result<PublisherConfirm, lapin::Error> {
        self.channel
            .basic_publish(
                self.exchange.as_str().into(),
                message.destination.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &message.payload,
                properties(message),
            )
            .await
    }

    /// What the broker's confirm of `message` says.
    fn confirmed(&self, message: &Message, confirm: Confirmation) -> Result<(), PublishError> {
        match confirm {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(returned)) => Err(format!(
                "RabbitMQ routed message {} to no queue (exchange {:?}, routing key {:?}): \
                 {} {}; declare the queue or fix the destination",
                message.id,
                self.exchange,
                message.destination,
                returned.reply_code,
                returned.reply_text
            )
            .into()),
            Confirmation::NotRequested => Err(format!(
                "RabbitMQ gave no confirm for message {}: the channel left confirm mode; \
                 the message may have been taken and is published again",
                message.id
            )
            .into()),
            Confirmation::Nack(_) => {
                Err(format!("RabbitMQ refused message {} (nack)", message.id).into())
            }
        }
    }
}

/// The AMQP properties of `message`: persistent, so that a durable queue keeps it through a
/// broker restart; its id; its content type; its `traceparent` and your headers as long
/// strings in the headers table (none for a message written before headers).
fn properties(message: &Message) -> BasicProperties {
    let mut properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_message_id(message.id.as_str().into());
    let headers = &message.headers;
    if let Some(content_type) = headers.content_type() {
        properties = properties.with_content_type(content_type.into());
    }
    let traceparent = headers.traceparent().map(|v| ("traceparent", v));
    let mut table = FieldTable::default();
    for (name, value) in traceparent.into_iter().chain(headers.iter()) {
        table.insert(
            ShortString::from(name),
            AMQPValue::LongString(LongString::from(value)),
        );
    }
    if table.inner().is_empty() {
        properties
    } else {
        properties.with_headers(table)
    }
}

impl Publisher for RabbitMq {
    async fn publish<'a>(&'a self, message: &'a Message) -> Result<(), PublishError> {
        self.confirming().await?;
        let confirm = self.send(message).await?.await?;
        self.confirmed(message, confirm)
    }

    /// Every message of the round is sent on the channel first, in order, and their confirms
    /// are waited for after: one round trip for the round. A channel keeps its messages'
    /// order, so a job's messages reach their queue in the order it sent them.
    async fn publish_all<'a>(
        &'a self,
        messages: &'a [Message],
        done: &'a mut Vec<Result<(), PublishError>>,
    ) {
        if let Err(e) = self.confirming().await {
            let reason = e.to_string();
            done.extend(messages.iter().map(|_| Err(reason.clone().into())));
            return;
        }
        let mut confirms = Vec::with_capacity(messages.len());
        for message in messages {
            confirms.push(self.send(message).await);
        }
        for (message, confirm) in messages.iter().zip(confirms) {
            let answer = match confirm {
                Ok(confirm) => match confirm.await {
                    Ok(confirm) => self.confirmed(message, confirm),
                    Err(e) => Err(e.into()),
                },
                Err(e) => Err(e.into()),
            };
            done.push(answer);
        }
    }
}
