//! RabbitMQ: a persistent message per outbox message, its id as the AMQP `message_id`,
//! published to the default exchange with the destination as routing key (a queue's name),
//! confirmed by the broker before it counts as sent.
//!
//! Published `mandatory`: RabbitMQ confirms a message that no queue takes as readily as one
//! that a queue keeps, and drops it. With `mandatory` it returns such a message before the
//! confirm, and the relay keeps it pending (a mistyped destination, a queue not declared yet)
//! instead of marking it sent.

use lapin::options::BasicPublishOptions;
use lapin::{BasicProperties, Channel, Confirmation};

use super::{PublishError, Publisher};
use crate::outgoing::Message;

/// Publishes to RabbitMQ on a channel in confirm mode (`confirm_select`): `Ok` only once the
/// broker acked the message.
#[derive(Debug, Clone)]
pub struct RabbitMq {
    channel: Channel,
    exchange: String,
}

impl RabbitMq {
    /// Publishes on `channel`, which must be in confirm mode, to the default exchange: a
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
}

impl Publisher for RabbitMq {
    async fn publish<'a>(&'a self, message: &'a Message) -> Result<(), PublishError> {
        let confirm = self
            .channel
            .basic_publish(
                self.exchange.as_str().into(),
                message.destination.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &message.payload,
                // Persistent, so that a durable queue keeps it through a broker restart.
                BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_message_id(message.id.as_str().into()),
            )
            .await?
            .await?;
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
            other => Err(format!("RabbitMQ refused message {}: {other:?}", message.id).into()),
        }
    }
}
