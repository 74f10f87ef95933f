//! The brokers the runner's cases run on, each behind the same few calls: publish, consume,
//! read the dead letters, count what is left.

use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use idem::settle::Source;
use idem::settle::nats::Pull;
use idem::settle::rabbitmq::Queue;
use idem::settle::sqs::aws_sdk_sqs::Client;
use idem::settle::sqs::aws_sdk_sqs::types::QueueAttributeName;
use idem::settle::sqs::{self, Queues, Receiver};
use lapin::options::{BasicGetOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};

/// A dead letter as its broker keeps it.
#[derive(Debug)]
pub struct Dead {
    pub payload: Vec<u8>,
    pub reason: String,
    pub delivery: u32,
}

/// A broker with a queue (or stream and consumer) of one test.
pub trait Broker: Sized {
    type Source: Source<Error: std::fmt::Debug>;

    /// The broker's name, in the names of a case's tables: the brokers' copies of a case run
    /// at once.
    const NAME: &str;

    /// The broker's objects for `test`, made fresh.
    async fn new(test: &str) -> Self;
    /// Publishes the payloads in this order, each confirmed.
    async fn publish(&self, payloads: Vec<Vec<u8>>);
    /// The runner's source, `prefetch` deliveries at a time.
    async fn source(&self, prefetch: usize) -> Self::Source;
    /// Every dead letter, in the order it was dead-lettered.
    async fn dead_letters(&self) -> Vec<Dead>;
    /// Messages neither acked nor dead-lettered (waiting, or delivered and not settled).
    async fn left(&self) -> u64;
    async fn end(self);
}

/// A broker that hands an unsettled delivery out again after a time of the test's choosing
/// (JetStream's `ack_wait`, SQS's visibility timeout): the heartbeat's cases.
pub trait Lapsing: Broker {
    /// The broker's objects for `test`, made fresh, an unsettled delivery coming again
    /// `after` it was handed out (whole seconds).
    async fn lapsing(test: &str, after: Duration) -> Self;
}

pub fn rabbitmq_url() -> String {
    std::env::var("IDEM_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

pub fn nats_url() -> String {
    std::env::var("IDEM_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

pub struct RabbitMq {
    queue: String,
    amqp: lapin::Connection,
}

impl RabbitMq {
    /// Every queue the test may have used: its own, its dead letters', its retry queues.
    fn queues(&self) -> Vec<String> {
        let mut queues = vec![self.queue.clone(), Queue::dead_letters(&self.queue)];
        for ms in [1, 10, 20, 40, 50, 80, 100, 200, 300, 400, 800, 1_000, 1_600] {
            queues.push(Queue::retry_queue(&self.queue, Duration::from_millis(ms)));
        }
        queues
    }

    async fn delete_queues(&self) {
        let ch = self.amqp.create_channel().await.unwrap();
        for queue in self.queues() {
            ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await
                .unwrap();
        }
        ch.close(200, "deleted".into()).await.unwrap();
    }
}

impl Broker for RabbitMq {
    type Source = Queue;
    const NAME: &str = "rabbitmq";

    async fn new(test: &str) -> Self {
        let url = rabbitmq_url();
        let amqp = lapin::Connection::connect(&url, Default::default())
            .await
            .unwrap_or_else(|e| panic!("cannot reach RabbitMQ at {url} (set IDEM_AMQP_URL): {e}"));
        let broker = RabbitMq {
            queue: format!("idem-test-settle-{test}-{}", std::process::id()),
            amqp,
        };
        broker.delete_queues().await;
        Queue::declare(&broker.amqp, &broker.queue).await.unwrap();
        broker
    }

    async fn publish(&self, payloads: Vec<Vec<u8>>) {
        let ch = self.amqp.create_channel().await.unwrap();
        ch.confirm_select(Default::default()).await.unwrap();
        for payload in payloads {
            let confirm = ch
                .basic_publish(
                    "".into(),
                    self.queue.as_str().into(),
                    Default::default(),
                    &payload,
                    lapin::BasicProperties::default().with_delivery_mode(2),
                )
                .await
                .unwrap()
                .await
                .unwrap();
            assert!(confirm.is_ack(), "the broker refused a message");
        }
        ch.close(200, "published".into()).await.unwrap();
    }

    async fn source(&self, prefetch: usize) -> Queue {
        let prefetch = u16::try_from(prefetch).unwrap();
        Queue::consume(&self.amqp, &self.queue, prefetch)
            .await
            .unwrap()
    }

    async fn dead_letters(&self) -> Vec<Dead> {
        let ch = self.amqp.create_channel().await.unwrap();
        let mut dead = Vec::new();
        let queue = Queue::dead_letters(&self.queue);
        while let Some(message) = ch
            .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            let headers = message
                .delivery
                .properties
                .headers()
                .clone()
                .unwrap_or_default();
            let header = |name: &str| headers.inner().get(name).cloned();
            let reason = match header(idem::settle::rabbitmq::REASON_HEADER) {
                Some(AMQPValue::LongString(text)) => text.to_string(),
                other => panic!("a dead letter without its reason: {other:?}"),
            };
            let delivery = match header(idem::settle::rabbitmq::DELIVERY_HEADER) {
                Some(AMQPValue::LongLongInt(n)) => u32::try_from(n).unwrap(),
                other => panic!("a dead letter without its delivery count: {other:?}"),
            };
            dead.push(Dead {
                payload: message.delivery.data,
                reason,
                delivery,
            });
        }
        ch.close(200, "read".into()).await.unwrap();
        dead
    }

    async fn left(&self) -> u64 {
        let ch = self.amqp.create_channel().await.unwrap();
        let q = ch
            .queue_declare(
                self.queue.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        ch.close(200, "counted".into()).await.unwrap();
        u64::from(q.message_count())
    }

    async fn end(self) {
        self.delete_queues().await;
        self.amqp.close(200, "done".into()).await.unwrap();
    }
}

pub struct Nats {
    js: jetstream::Context,
    stream: String,
    subject: String,
    consumer: consumer::PullConsumer,
}

impl Nats {
    fn dead_stream(&self) -> String {
        format!("{}_DEAD", self.stream)
    }

    fn dead_subject(&self) -> String {
        format!("{}.dead", self.subject)
    }
}

impl Broker for Nats {
    type Source = Pull;
    const NAME: &str = "nats";

    async fn new(test: &str) -> Self {
        // Longer than any body of these cases runs; the deliveries a shutdown leaves come
        // back after it.
        Nats::lapsing(test, Duration::from_secs(3)).await
    }

    async fn publish(&self, payloads: Vec<Vec<u8>>) {
        for payload in payloads {
            self.js
                .publish(self.subject.clone(), payload.into())
                .await
                .unwrap()
                .await
                .unwrap();
        }
    }

    async fn source(&self, prefetch: usize) -> Pull {
        Pull::consume(&self.consumer, &self.js, prefetch, self.dead_subject())
            .await
            .unwrap()
    }

    async fn dead_letters(&self) -> Vec<Dead> {
        let mut stream = self.js.get_stream(self.dead_stream()).await.unwrap();
        let count = stream.info().await.unwrap().state.messages;
        let mut dead = Vec::new();
        for seq in 1..=count {
            let message = stream.get_raw_message(seq).await.unwrap();
            let header = |name: &str| {
                message
                    .headers
                    .get(name)
                    .unwrap_or_else(|| panic!("a dead letter without {name}"))
                    .to_string()
            };
            dead.push(Dead {
                reason: header(idem::settle::nats::REASON_HEADER),
                delivery: header(idem::settle::nats::DELIVERY_HEADER).parse().unwrap(),
                payload: message.payload.to_vec(),
            });
        }
        dead
    }

    async fn left(&self) -> u64 {
        let mut consumer = self.consumer.clone();
        let info = consumer.info().await.unwrap();
        info.num_pending + u64::try_from(info.num_ack_pending).unwrap()
    }

    async fn end(self) {
        for stream in [self.stream.clone(), self.dead_stream()] {
            drop(self.js.delete_stream(&stream).await);
        }
    }
}

impl Lapsing for Nats {
    async fn lapsing(test: &str, after: Duration) -> Self {
        let url = nats_url();
        let client = async_nats::connect(&url)
            .await
            .unwrap_or_else(|e| panic!("cannot reach NATS at {url} (set IDEM_NATS_URL): {e}"));
        let js = jetstream::new(client);
        let id = format!("{test}_{}", std::process::id()).to_uppercase();
        let name = format!("IDEM_SETTLE_{id}");
        let subject = format!("idem-settle.{id}");
        for stream in [name.clone(), format!("{name}_DEAD")] {
            drop(js.delete_stream(&stream).await);
        }
        let stream = js
            .create_stream(stream::Config {
                name: name.clone(),
                subjects: vec![subject.clone()],
                ..Default::default()
            })
            .await
            .unwrap();
        js.create_stream(stream::Config {
            name: format!("{name}_DEAD"),
            subjects: vec![format!("{subject}.dead")],
            ..Default::default()
        })
        .await
        .unwrap();
        let consumer = stream
            .create_consumer(consumer::pull::Config {
                durable_name: Some("runner".to_owned()),
                ack_policy: consumer::AckPolicy::Explicit,
                ack_wait: after,
                ..Default::default()
            })
            .await
            .unwrap();
        Nats {
            js,
            stream: name,
            subject,
            consumer,
        }
    }
}

pub struct Sqs {
    client: Client,
    queue: idem_example_sqs::Queue,
}

impl Sqs {
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The queue and its dead-letter queue, as a receiver takes them.
    pub fn queues(&self) -> Queues {
        Queues {
            url: self.queue.url.clone(),
            dead_letters: self.queue.dead_letters.clone(),
        }
    }
}

impl Broker for Sqs {
    type Source = Receiver;
    const NAME: &str = "sqs";

    async fn new(test: &str) -> Self {
        // Longer than any body of these cases runs; the deliveries a shutdown leaves come
        // back after it.
        Sqs::lapsing(test, Duration::from_secs(3)).await
    }

    async fn publish(&self, payloads: Vec<Vec<u8>>) {
        for payload in payloads {
            self.client
                .send_message()
                .queue_url(&self.queue.url)
                .message_body(String::from_utf8(payload).unwrap())
                .send()
                .await
                .unwrap();
        }
    }

    async fn source(&self, prefetch: usize) -> Receiver {
        Receiver::consume(&self.client, self.queues(), prefetch, 1)
    }

    async fn dead_letters(&self) -> Vec<Dead> {
        let mut dead = Vec::new();
        loop {
            let out = self
                .client
                .receive_message()
                .queue_url(&self.queue.dead_letters)
                .max_number_of_messages(10)
                .message_attribute_names("All")
                .send()
                .await
                .unwrap();
            let messages = out.messages.unwrap_or_default();
            if messages.is_empty() {
                return dead;
            }
            for m in messages {
                let attribute = |name: &str| {
                    m.message_attributes()
                        .and_then(|a| a.get(name))
                        .and_then(|v| v.string_value())
                        .unwrap_or_else(|| panic!("a dead letter without {name}"))
                        .to_owned()
                };
                dead.push(Dead {
                    reason: attribute(sqs::REASON_ATTRIBUTE),
                    delivery: attribute(sqs::DELIVERY_ATTRIBUTE).parse().unwrap(),
                    payload: m.body().unwrap_or_default().as_bytes().to_vec(),
                });
                self.client
                    .delete_message()
                    .queue_url(&self.queue.dead_letters)
                    .receipt_handle(m.receipt_handle().unwrap_or_default())
                    .send()
                    .await
                    .unwrap();
            }
        }
    }

    async fn left(&self) -> u64 {
        let out = self
            .client
            .get_queue_attributes()
            .queue_url(&self.queue.url)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
            .send()
            .await
            .unwrap();
        let attributes = out.attributes.unwrap_or_default();
        [
            QueueAttributeName::ApproximateNumberOfMessages,
            QueueAttributeName::ApproximateNumberOfMessagesNotVisible,
        ]
        .iter()
        .map(|name| {
            attributes
                .get(name)
                .map_or(0, |n| n.parse::<u64>().unwrap())
        })
        .sum()
    }

    async fn end(self) {
        idem_example_sqs::delete_queue(&self.client, &self.queue)
            .await
            .unwrap();
    }
}

impl Lapsing for Sqs {
    async fn lapsing(test: &str, after: Duration) -> Self {
        let url = idem_example_sqs::sqs_url();
        let client = idem_example_sqs::connect(&url)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let name = format!("idem-test-settle-{test}-{}", std::process::id());
        let visibility = i32::try_from(after.as_secs()).unwrap();
        assert_eq!(Duration::from_secs(after.as_secs()), after, "whole seconds");
        // The redrive only after the runner's cap.
        let queue = idem_example_sqs::create_queue(&client, &name, visibility, 100)
            .await
            .unwrap();
        for url in [&queue.url, &queue.dead_letters] {
            client.purge_queue().queue_url(url).send().await.unwrap();
        }
        Sqs { client, queue }
    }
}
