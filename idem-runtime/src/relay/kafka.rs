//! Kafka: an idempotent producer (`enable.idempotence`, `acks=all`), a record per outbox
//! message to the topic its destination names, keyed by its ordering key so that one key's
//! messages share a partition, with the message's id and its headers (`content-type`,
//! `traceparent`, yours) as record headers; confirmed once the partition's leader acknowledged
//! it.

use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord};

use super::{PublishError, Publisher};
use crate::error::{Error, KafkaError};
use crate::outgoing::Message;

/// The header that carries an outbox message's id: the next consumer's key
/// ([`Record::id_key`](crate::kafka::Record::id_key)).
pub const MESSAGE_ID_HEADER: &str = "idem-message-id";

/// Publishes to Kafka with an idempotent producer: `Ok` only once the broker acknowledged
/// the record (`acks=all`).
///
/// A message's destination is its topic. The record's key is the message's ordering key
/// ([`Message::ordering_key`]: the job's key unless it was sent with one of its own), so
/// Kafka's default partitioner puts one key's messages in one partition, where consumers
/// read them in the order the relay published them: the relay's order per key becomes
/// Kafka's order per partition. The message's [`Headers`](crate::outbox::Headers) are record
/// headers: `content-type`, `traceparent` and yours, after [`MESSAGE_ID_HEADER`], as UTF-8
/// values. The message's id travels in the header [`MESSAGE_ID_HEADER`]:
/// a message published twice (the relay died between the broker's acknowledgement and its
/// mark) is two records with one id, which the next consumer's claim of that id (the
/// per-message marker mode) takes for one. The producer's own retries never make a second
/// record: `enable.idempotence` lets the broker drop them.
pub struct Kafka {
    producer: FutureProducer,
    timeout: Duration,
}

impl std::fmt::Debug for Kafka {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kafka")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl Kafka {
    /// A publisher on a producer made from `config` (at least `bootstrap.servers`), with
    /// `enable.idempotence=true` and `acks=all` set whatever `config` says. A record the
    /// broker has not acknowledged within 30 s (`message.timeout.ms`) counts as failed.
    pub fn new(config: &ClientConfig) -> Result<Self, Error> {
        let timeout = Duration::from_secs(30);
        let mut config = config.clone();
        config
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("message.timeout.ms", timeout.as_millis().to_string());
        let producer = config.create().map_err(|e| {
            Error::Kafka(KafkaError::Client {
                reason: format!("making the relay's producer: {e}"),
            })
        })?;
        Ok(Kafka { producer, timeout })
    }

    /// Queues `message` in the producer: its acknowledgement, to be waited for.
    fn send(&self, message: &Message) -> Result<DeliveryFuture, PublishError> {
        let all = message.headers.all();
        let mut headers = OwnedHeaders::new_with_capacity(1 + all.size_hint().0).insert(Header {
            key: MESSAGE_ID_HEADER,
            value: Some(message.id.as_str()),
        });
        for (key, value) in all {
            headers = headers.insert(Header {
                key,
                value: Some(value),
            });
        }
        let record = FutureRecord::to(&message.destination)
            .key(message.ordering_key.as_str())
            .payload(message.payload.as_slice())
            .headers(headers);
        self.producer
            .send_result(record)
            .map_err(|(e, _)| format!("Kafka refused message {}: {e}", message.id).into())
    }

    /// What the broker said of `message`.
    async fn delivered(message: &Message, delivery: DeliveryFuture) -> Result<(), PublishError> {
        match delivery.await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err((e, _))) => Err(format!(
                "Kafka did not take message {} to topic {:?}: {e}",
                message.id, message.destination
            )
            .into()),
            Err(_) => Err(format!(
                "the producer went away before Kafka answered for message {}",
                message.id
            )
            .into()),
        }
    }
}

impl Publisher for Kafka {
    async fn publish<'a>(&'a self, message: &'a Message) -> Result<(), PublishError> {
        let delivery = self.send(message)?;
        Kafka::delivered(message, delivery).await
    }

    /// Every message of the round is queued in the producer first, in order, and their
    /// acknowledgements are waited for after. The idempotent producer keeps a partition's
    /// records in the order they were queued, retries included.
    async fn publish_all<'a>(
        &'a self,
        messages: &'a [Message],
        done: &'a mut Vec<Result<(), PublishError>>,
    ) {
        let sent: Vec<_> = messages.iter().map(|m| self.send(m)).collect();
        for (message, sent) in messages.iter().zip(sent) {
            let answer = match sent {
                Ok(delivery) => Kafka::delivered(message, delivery).await,
                Err(e) => Err(e),
            };
            done.push(answer);
        }
    }
}
