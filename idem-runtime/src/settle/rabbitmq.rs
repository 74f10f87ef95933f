//! The consumer loop on RabbitMQ (lapin): a queue's deliveries as a [`Source`], each settled
//! as its [`Disposition`] says.
//!
//! - **Ack**: `basic.ack`.
//! - **Retry after a delay**: a copy goes to a retry queue of that delay,
//!   `<queue>.retry.<ms>ms` (declared on first use: every message in it waits that long, then
//!   RabbitMQ dead-letters it back to `<queue>` through the default exchange), then the
//!   delivery is acked. One queue per delay, so that no message waits behind a longer one.
//! - **Dead letter**: a copy goes to `<queue>.dead` (declared by [`Queue::consume`]) with the
//!   reason in its `x-idem-reason` header, then the delivery is acked.
//! - **Heartbeat** (the runner's, while a handler runs): nothing ([`Delivery::extend`]'s
//!   default). RabbitMQ keeps an unacked delivery for its consumer as long as the channel is
//!   open, up to the broker's `consumer_timeout` (30 minutes by default): past it, RabbitMQ
//!   closes the channel and delivers the message again. Raise it (in `rabbitmq.conf`, or per
//!   queue with the `x-consumer-timeout` argument) for handlers that run longer.
//!
//! Each copy is confirmed by the broker before the delivery is acked: a worker that dies in
//! between leaves both, and the handler's claim answers the second `Duplicate`. A copy carries
//! its delivery number in `x-idem-delivery`, so the redelivery cap counts on classic queues
//! too; on quorum queues RabbitMQ's own `x-delivery-count` adds the redeliveries of a copy.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt as _;
use lapin::message::Delivery as AmqpDelivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, Consumer};

use super::{Delivery, Disposition, Source};

/// The lapin this adapter is built on: your `Connection` must be this crate's.
pub use lapin;

/// The header that carries a copy's delivery number: the delivery a retry's copy will be, the
/// deliveries a dead letter had.
pub const DELIVERY_HEADER: &str = "x-idem-delivery";
/// The header of a dead letter that says why it was dead-lettered.
pub const REASON_HEADER: &str = "x-idem-reason";

/// Why a settlement or a delivery did not reach RabbitMQ.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RabbitMqError {
    /// The connection or the channel failed.
    #[error(transparent)]
    Amqp(#[from] lapin::Error),
    /// RabbitMQ did not keep the copy of a retry or a dead letter; the delivery was not acked
    /// and comes again.
    #[error("RabbitMQ did not keep the {what} copy of a message for queue {queue:?}: {answer}")]
    NotKept {
        /// `retry` or `dead-letter`.
        what: &'static str,
        /// The queue the copy was for.
        queue: String,
        /// What the broker answered.
        answer: String,
    },
}

/// A queue consumed with manual acks, as the runner's [`Source`].
#[derive(Debug)]
pub struct Queue {
    consumer: Consumer,
    channel: Channel,
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    queue: String,
    /// The channel of the copies, in confirm mode.
    copies: Channel,
    /// The retry queues declared so far, by delay in milliseconds.
    declared: Mutex<HashSet<u64>>,
}

impl Queue {
    /// Declares `name` as a durable classic queue, for an application that leaves the
    /// topology to idem (declare your own, e.g. a quorum queue, otherwise).
    pub async fn declare(connection: &Connection, name: &str) -> Result<(), lapin::Error> {
        let channel = connection.create_channel().await?;
        channel
            .queue_declare(
                name.into(),
                QueueDeclareOptions::durable(),
                FieldTable::default(),
            )
            .await?;
        channel.close(200, "declared".into()).await
    }

    /// Consumes `name` on a channel of its own with `prefetch` unacked deliveries at most
    /// (give the runner the same [`in_flight`](super::Runner::in_flight)); declares its dead
    /// letters' queue, [`Queue::dead_letters`].
    pub async fn consume(
        connection: &Connection,
        name: &str,
        prefetch: u16,
    ) -> Result<Queue, lapin::Error> {
        let copies = connection.create_channel().await?;
        copies
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        copies
            .queue_declare(
                Queue::dead_letters(name).as_str().into(),
                QueueDeclareOptions::durable(),
                FieldTable::default(),
            )
            .await?;
        let channel = connection.create_channel().await?;
        channel
            .basic_qos(prefetch, BasicQosOptions::default())
            .await?;
        let consumer = channel
            .basic_consume(
                name.into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok(Queue {
            consumer,
            channel,
            shared: Arc::new(Shared {
                queue: name.to_owned(),
                copies,
                declared: Mutex::new(HashSet::new()),
            }),
        })
    }

    /// The queue that `name`'s dead letters go to: `<name>.dead`.
    pub fn dead_letters(name: &str) -> String {
        format!("{name}.dead")
    }

    /// The queue that holds `name`'s retries of one delay: `<name>.retry.<ms>ms`.
    pub fn retry_queue(name: &str, after: Duration) -> String {
        format!("{name}.retry.{}ms", millis(after))
    }
}

impl Source for Queue {
    type Delivery = Message;
    type Error = RabbitMqError;

    async fn next(&mut self) -> Option<Result<Message, RabbitMqError>> {
        let delivery = match self.consumer.next().await? {
            Ok(delivery) => delivery,
            Err(e) => return Some(Err(e.into())),
        };
        Some(Ok(Message {
            count: count(&delivery),
            delivery,
            shared: self.shared.clone(),
        }))
    }

    async fn stop(&mut self) -> Result<(), RabbitMqError> {
        self.channel
            .basic_cancel(self.consumer.tag(), BasicCancelOptions::default())
            .await?;
        Ok(())
    }

    /// Closes the consumer's channel, which hands its unacked deliveries back to the queue,
    /// and the copies' channel.
    async fn close(self) -> Result<(), RabbitMqError> {
        self.channel
            .close(200, "idem runner stopped".into())
            .await?;
        self.shared
            .copies
            .close(200, "idem runner stopped".into())
            .await?;
        Ok(())
    }
}

/// One delivery of a RabbitMQ message.
#[derive(Debug)]
pub struct Message {
    delivery: AmqpDelivery,
    shared: Arc<Shared>,
    count: u32,
}

impl Message {
    /// The delivery as lapin gave it (its properties, headers, routing key).
    pub fn amqp(&self) -> &AmqpDelivery {
        &self.delivery
    }
}

impl Delivery for Message {
    type Error = RabbitMqError;

    fn payload(&self) -> &[u8] {
        &self.delivery.data
    }

    fn count(&self) -> u32 {
        self.count
    }

    fn id(&self) -> Option<&str> {
        self.delivery
            .properties
            .message_id()
            .as_ref()
            .map(ShortString::as_str)
    }

    fn system(&self) -> &'static str {
        "rabbitmq"
    }

    fn destination(&self) -> Option<&str> {
        Some(&self.shared.queue)
    }

    async fn settle(self, disposition: &Disposition) -> Result<(), RabbitMqError> {
        match disposition {
            Disposition::Ack => {}
            Disposition::Retry { after } => {
                let queue = self.shared.retry_queue(*after).await?;
                self.copy("retry", queue, self.count + 1, None).await?;
            }
            Disposition::DeadLetter { reason } => {
                let queue = Queue::dead_letters(&self.shared.queue);
                self.copy("dead-letter", queue, self.count, Some(reason))
                    .await?;
            }
        }
        self.delivery.acker.ack(BasicAckOptions::default()).await?;
        Ok(())
    }
}

impl Message {
    /// Publishes a copy of the message to `queue` and waits for the broker's confirm:
    /// `delivery` in its headers (a retry's next delivery, a dead letter's deliveries so far),
    /// and `reason` for a dead letter.
    async fn copy(
        &self,
        what: &'static str,
        queue: String,
        delivery: u32,
        reason: Option<&str>,
    ) -> Result<(), RabbitMqError> {
        let mut headers = self
            .delivery
            .properties
            .headers()
            .clone()
            .unwrap_or_default();
        headers.insert(
            DELIVERY_HEADER.into(),
            AMQPValue::LongLongInt(i64::from(delivery)),
        );
        if let Some(reason) = reason {
            headers.insert(
                REASON_HEADER.into(),
                AMQPValue::LongString(LongString::from(reason)),
            );
        }
        let properties = copy_properties(&self.delivery.properties).with_headers(headers);
        let confirm = self
            .shared
            .copies
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &self.delivery.data,
                properties,
            )
            .await?
            .await?;
        let answer = match confirm {
            Confirmation::Ack(None) => return Ok(()),
            Confirmation::Ack(Some(returned)) => {
                format!("routed to no queue: {}", returned.reply_text)
            }
            Confirmation::Nack(_) => "nack".to_owned(),
            Confirmation::NotRequested => "no confirm (the channel left confirm mode)".to_owned(),
        };
        Err(RabbitMqError::NotKept {
            what,
            queue,
            answer,
        })
    }
}

impl Shared {
    /// The retry queue of `after`, declared the first time this process uses it.
    async fn retry_queue(&self, after: Duration) -> Result<String, lapin::Error> {
        let ms = millis(after);
        let name = Queue::retry_queue(&self.queue, after);
        if self
            .declared
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&ms)
        {
            return Ok(name);
        }
        let mut arguments = FieldTable::default();
        arguments.insert(
            "x-message-ttl".into(),
            AMQPValue::LongLongInt(i64::try_from(ms).unwrap_or(i64::MAX)),
        );
        arguments.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(LongString::from("")),
        );
        arguments.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(LongString::from(self.queue.as_str())),
        );
        // No `x-expires`: an unused queue's expiry does not wait for the messages in it.
        self.copies
            .queue_declare(
                name.as_str().into(),
                QueueDeclareOptions::durable(),
                arguments,
            )
            .await?;
        self.declared
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(ms);
        Ok(name)
    }
}

/// A delay in whole milliseconds, at least 1 (a TTL of 0 would drop the message at once where
/// no consumer waits).
fn millis(after: Duration) -> u64 {
    u64::try_from(after.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// A copy's properties: the original's, persistent, and without the two the copy must not
/// keep: an expiration (its retry queue decides when it comes back) and a user id (RabbitMQ
/// refuses one that is not the publishing connection's user).
fn copy_properties(original: &BasicProperties) -> BasicProperties {
    let mut copy = BasicProperties::default().with_delivery_mode(2);
    macro_rules! keep {
        ($($get:ident => $with:ident),*) => {$(
            if let Some(value) = original.$get().clone() {
                copy = copy.$with(value);
            }
        )*};
    }
    keep!(
        content_type => with_content_type,
        content_encoding => with_content_encoding,
        priority => with_priority,
        correlation_id => with_correlation_id,
        reply_to => with_reply_to,
        message_id => with_message_id,
        timestamp => with_timestamp,
        kind => with_type,
        app_id => with_app_id
    );
    copy
}

/// Which delivery this is: the copy's number (1 for the producer's message), plus the
/// redeliveries of this copy (quorum queues count them; classic queues only flag one).
fn count(delivery: &AmqpDelivery) -> u32 {
    let header = |name: &str| {
        let headers = delivery.properties.headers().as_ref()?;
        integer(headers.inner().get(name)?)
    };
    let copy = header(DELIVERY_HEADER).unwrap_or(1).max(1);
    let redeliveries = header("x-delivery-count").unwrap_or(u32::from(delivery.redelivered));
    copy.saturating_add(redeliveries)
}

fn integer(value: &AMQPValue) -> Option<u32> {
    let n = match value {
        AMQPValue::ShortShortInt(n) => i64::from(*n),
        AMQPValue::ShortShortUInt(n) => i64::from(*n),
        AMQPValue::ShortInt(n) => i64::from(*n),
        AMQPValue::ShortUInt(n) => i64::from(*n),
        AMQPValue::LongInt(n) => i64::from(*n),
        AMQPValue::LongUInt(n) => i64::from(*n),
        AMQPValue::LongLongInt(n) => *n,
        _ => return None,
    };
    u32::try_from(n.max(0)).ok()
}
