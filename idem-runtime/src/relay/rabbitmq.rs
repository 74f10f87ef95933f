//! RabbitMQ: a persistent message per outbox message, its id as the AMQP `message_id`,
//! published to the default exchange with the destination as routing key (a queue's name),
//! confirmed by the broker before it counts as sent.

use lapin::options::BasicPublishOptions;
use lapin::{BasicProperties, Channel};

use super::{PublishError, Publisher};
use crate::Message;

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
                BasicPublishOptions::default(),
                &message.payload,
                // Persistent, so that a durable queue keeps it through a broker restart.
                BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_message_id(message.id.as_str().into()),
            )
            .await?
            .await?;
        if confirm.is_ack() {
            Ok(())
        } else {
            Err(format!("RabbitMQ refused message {}: {confirm:?}", message.id).into())
        }
    }
}
