//! The outbox relay against the real brokers: RabbitMQ with publisher confirms and the id as
//! `message_id`, NATS JetStream with the id as `Nats-Msg-Id`. A message published twice (the
//! relay confirmed it but died before its mark, replayed here by clearing the mark in SQL)
//! carries one id: JetStream drops the second inside its duplicate window, and on RabbitMQ the
//! consumer's `#[idempotent]` claim of that id makes it a duplicate, so the downstream effect
//! exists once. A message's headers (content type, `traceparent`, the user's) reach each
//! broker as they were sent.

#[allow(dead_code)]
#[path = "../rabbitmq_worker.rs"]
mod rabbitmq_worker;
#[allow(dead_code)]
#[path = "../send_invoice.rs"]
mod send_invoice;

use std::collections::BTreeMap;
use std::time::Duration;

use futures_util::StreamExt as _;
use idem::outbox::{JetStream, RabbitMq, Relay};
use idem::{Outbox, Outcome, Store};
use lapin::options::{BasicAckOptions, BasicConsumeOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use sqlx::{Sqlite, SqlitePool, Transaction};

/// An order's effect and its shipping messages, sent with it.
#[idem::idempotent(key = "order", scope = "orders.place")]
async fn place(
    tx: &mut Transaction<'_, Sqlite>,
    order: &str,
    outbox: &mut Outbox,
    destination: &str,
) -> Result<(), idem::Error> {
    sqlx::query("INSERT INTO orders (id) VALUES (?1)")
        .bind(order)
        .execute(&mut **tx)
        .await?;
    outbox.send(destination, &format!("ship {order}"))?;
    outbox.send(destination, &format!("bill {order}"))?;
    Ok(())
}

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// An order's effect and one message with headers: a content type, a `traceparent` and two of
/// the user's own.
#[idem::idempotent(key = "order", scope = "orders.place")]
async fn place_with_headers(
    tx: &mut Transaction<'_, Sqlite>,
    order: &str,
    outbox: &mut Outbox,
    destination: &str,
) -> Result<(), idem::Error> {
    sqlx::query("INSERT INTO orders (id) VALUES (?1)")
        .bind(order)
        .execute(&mut **tx)
        .await?;
    outbox
        .message(destination)
        .bytes(format!("ship {order}"))
        .content_type("text/plain; charset=utf-8")
        .traceparent(TRACEPARENT)
        .header("tenant", "acme")
        .header("X-Note", "caf\u{e9} \"au lait\"")
        .send()?;
    Ok(())
}

/// The headers every broker gets from `place_with_headers`, but the content type (RabbitMQ's
/// is a property of its own).
fn sent_headers() -> BTreeMap<String, String> {
    [
        ("traceparent", TRACEPARENT),
        ("tenant", "acme"),
        ("X-Note", "caf\u{e9} \"au lait\""),
    ]
    .into_iter()
    .map(|(n, v)| (n.to_owned(), v.to_owned()))
    .collect()
}

/// The next consumer: claims the message's id, the key the outbox gave it.
#[idem::idempotent(key = "id", scope = "shipping.handle")]
async fn handle(tx: &mut Transaction<'_, Sqlite>, id: &str, body: &str) -> Result<(), idem::Error> {
    sqlx::query("INSERT INTO handled (id, body) VALUES (?1, ?2)")
        .bind(id)
        .bind(body)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

async fn store(tag: &str) -> (Store<Sqlite>, SqlitePool, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("idem-outbox-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let opts = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(dir.join("db.sqlite"))
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(30));
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(opts)
        .await
        .unwrap();
    let store = Store::new(pool.clone());
    store.migrate().await.unwrap();
    for ddl in [
        "CREATE TABLE orders (id TEXT NOT NULL)",
        "CREATE TABLE handled (id TEXT NOT NULL, body TEXT NOT NULL)",
    ] {
        sqlx::query(ddl).execute(&pool).await.unwrap();
    }
    (store, pool, dir)
}

/// As if the relay had died between the broker's confirm and its mark, and its hold on the
/// messages had run out since.
async fn forget_marks(pool: &SqlitePool) {
    sqlx::query(
        "UPDATE idem_processed_outbox SET sent_at = NULL, \
         next_attempt_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')",
    )
    .execute(pool)
    .await
    .unwrap();
}

/// How many messages `queue` holds; then deletes it.
async fn drain(channel: &lapin::Channel, queue: &str) -> u32 {
    let passive = lapin::options::QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let queued = channel
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
        .unwrap();
    channel
        .queue_delete(queue.into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    queued.message_count()
}

async fn count(pool: &SqlitePool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn rabbitmq_carries_each_message_once_end_to_end() {
    let (store, pool, dir) = store("rmq").await;
    let url = rabbitmq_worker::amqp_url();
    let connection = rabbitmq_worker::connect(&url).await.unwrap();
    let channel = rabbitmq_worker::confirming_channel(&connection)
        .await
        .unwrap();
    let queue = format!("idem-outbox-{}", std::process::id());
    rabbitmq_worker::declare_queue(&channel, &queue)
        .await
        .unwrap();

    for order in ["o-1", "o-2"] {
        assert!(place(&store, order, &queue).await.unwrap().is_applied());
    }
    let relay = Relay::new(store.clone(), RabbitMq::new(channel.clone()));
    assert_eq!(relay.relay_once().await.unwrap().sent, 4);
    forget_marks(&pool).await;
    assert_eq!(
        relay.relay_once().await.unwrap().sent,
        4,
        "published again, same ids"
    );

    // The next consumer: 8 deliveries, 4 ids; each handled once, in each order's order.
    let mut consumer = channel
        .basic_consume(
            queue.as_str().into(),
            "idem-outbox-test".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut outcomes = Vec::new();
    for _ in 0..8 {
        let delivery = tokio::time::timeout(Duration::from_secs(30), consumer.next())
            .await
            .expect("a delivery within 30 s")
            .expect("the consumer is open")
            .unwrap();
        let id = delivery
            .properties
            .message_id()
            .as_ref()
            .expect("the outbox's id")
            .to_string();
        let body: String = serde_json::from_slice(&delivery.data).unwrap();
        let outcome = handle(&store, &id, &body).await.unwrap();
        delivery.ack(BasicAckOptions::default()).await.unwrap();
        outcomes.push((body, outcome.is_applied()));
    }
    let applied: Vec<&str> = outcomes
        .iter()
        .filter(|(_, a)| *a)
        .map(|(b, _)| b.as_str())
        .collect();
    // In order per ordering key (each order's key); across keys the relay promises no order.
    assert_eq!(applied.len(), 4, "{applied:?}");
    for order in ["o-1", "o-2"] {
        let of_order: Vec<&str> = applied
            .iter()
            .copied()
            .filter(|b| b.ends_with(order))
            .collect();
        assert_eq!(of_order, [format!("ship {order}"), format!("bill {order}")]);
    }
    assert_eq!(count(&pool, "SELECT COUNT(*) FROM handled").await, 4);
    assert_eq!(
        count(&pool, "SELECT COUNT(DISTINCT id) FROM handled").await,
        4
    );
    channel
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn jetstream_drops_a_message_published_twice() {
    let (store, pool, dir) = store("nats").await;
    let js = send_invoice::connect(&send_invoice::nats_url())
        .await
        .unwrap();
    let name = format!("IDEM_OUTBOX_{}", std::process::id());
    let subject = format!("idem.outbox.{}", std::process::id());
    let mut stream = send_invoice::create_stream(&js, &name, &subject, Duration::from_secs(120))
        .await
        .unwrap();
    assert!(place(&store, "o-9", &subject).await.unwrap().is_applied());
    let duplicate = place(&store, "o-9", &subject).await.unwrap();
    assert_eq!(duplicate, Outcome::Duplicate);
    let relay = Relay::new(store.clone(), JetStream::new(js.clone()));
    assert_eq!(relay.relay_once().await.unwrap().sent, 2);
    forget_marks(&pool).await;
    assert_eq!(relay.relay_once().await.unwrap().sent, 2);
    let info = stream.info().await.unwrap();
    assert_eq!(info.state.messages, 2, "JetStream kept one of each id");
    assert_eq!(count(&pool, "SELECT COUNT(*) FROM orders").await, 1);
    js.delete_stream(&name).await.unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

/// A message that no queue takes is returned by RabbitMQ (it is published `mandatory`), not
/// confirmed as sent: it stays pending with the broker's reason (the order's next message
/// waits behind it), and both go out once their queue exists.
#[tokio::test(flavor = "multi_thread")]
async fn rabbitmq_keeps_a_message_no_queue_takes_pending() {
    let (store, pool, dir) = store("rmq-unrouted").await;
    let url = rabbitmq_worker::amqp_url();
    let connection = rabbitmq_worker::connect(&url).await.unwrap();
    let channel = rabbitmq_worker::confirming_channel(&connection)
        .await
        .unwrap();
    // Not declared yet: a destination mistyped, or a consumer deployed after the producer.
    let queue = format!("idem-outbox-unrouted-{}", std::process::id());
    assert!(place(&store, "o-1", &queue).await.unwrap().is_applied());

    let relay = Relay::new(store.clone(), RabbitMq::new(channel.clone()));
    let round = relay.relay_once().await.unwrap();
    // The order's second message waits for its first, which failed: one ordering key.
    assert_eq!((round.sent, round.failed, round.waiting), (0, 1, 1));
    let unsent = "SELECT COUNT(*) FROM idem_processed_outbox WHERE sent_at IS NULL";
    assert_eq!(count(&pool, unsent).await, 2);
    let reasons: Vec<String> = sqlx::query_scalar(
        "SELECT last_error FROM idem_processed_outbox WHERE last_error IS NOT NULL",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(reasons.len(), 1, "{reasons:?}");
    for reason in &reasons {
        assert!(reason.contains("routed message"), "{reason}");
        assert!(reason.contains(&queue), "{reason}");
    }

    rabbitmq_worker::declare_queue(&channel, &queue)
        .await
        .unwrap();
    // Due again after the relay's backoff: made due now, as the next poll would find it.
    sqlx::query(
        "UPDATE idem_processed_outbox \
         SET next_attempt_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')",
    )
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(relay.relay_once().await.unwrap().sent, 2);
    assert_eq!(count(&pool, unsent).await, 0);
    assert_eq!(drain(&channel, &queue).await, 2);
    std::fs::remove_dir_all(dir).unwrap();
}

/// A channel the user did not put in confirm mode: the publisher selects confirms itself
/// before its first publish, so each message is confirmed, marked sent and in the queue once
/// (without confirms every publish would count as failed and be published again).
#[tokio::test(flavor = "multi_thread")]
async fn rabbitmq_on_a_channel_without_confirms_publishes_each_message_once() {
    let (store, pool, dir) = store("rmq-plain").await;
    let url = rabbitmq_worker::amqp_url();
    let connection = rabbitmq_worker::connect(&url).await.unwrap();
    let channel = connection.create_channel().await.unwrap();
    assert!(!channel.status().confirm());
    let queue = format!("idem-outbox-plain-{}", std::process::id());
    rabbitmq_worker::declare_queue(&channel, &queue)
        .await
        .unwrap();
    assert!(place(&store, "o-1", &queue).await.unwrap().is_applied());

    let relay = Relay::new(store.clone(), RabbitMq::new(channel.clone()));
    let round = relay.relay_once().await.unwrap();
    assert_eq!((round.sent, round.failed), (2, 0), "{round:?}");
    assert!(channel.status().confirm());
    assert_eq!(relay.relay_once().await.unwrap().sent, 0);
    let unsent = "SELECT COUNT(*) FROM idem_processed_outbox WHERE sent_at IS NULL";
    assert_eq!(count(&pool, unsent).await, 0);
    assert_eq!(drain(&channel, &queue).await, 2);
    std::fs::remove_dir_all(dir).unwrap();
}

/// A message's content type reaches RabbitMQ as its `content_type` property, its id as its
/// `message_id`, and its `traceparent` and the user's headers as long strings in its headers
/// table, exactly.
#[tokio::test(flavor = "multi_thread")]
async fn rabbitmq_carries_a_messages_headers() {
    let (store, _pool, dir) = store("rmq-headers").await;
    let url = rabbitmq_worker::amqp_url();
    let connection = rabbitmq_worker::connect(&url).await.unwrap();
    let channel = rabbitmq_worker::confirming_channel(&connection)
        .await
        .unwrap();
    let queue = format!("idem-outbox-headers-{}", std::process::id());
    rabbitmq_worker::declare_queue(&channel, &queue)
        .await
        .unwrap();
    assert!(
        place_with_headers(&store, "o-1", &queue)
            .await
            .unwrap()
            .is_applied()
    );
    let relay = Relay::new(store.clone(), RabbitMq::new(channel.clone()));
    assert_eq!(relay.relay_once().await.unwrap().sent, 1);

    let mut consumer = channel
        .basic_consume(
            queue.as_str().into(),
            "idem-outbox-headers".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let delivery = tokio::time::timeout(Duration::from_secs(30), consumer.next())
        .await
        .expect("a delivery within 30 s")
        .expect("the consumer is open")
        .unwrap();
    let properties = &delivery.properties;
    assert_eq!(
        properties.content_type().as_ref().map(|c| c.to_string()),
        Some("text/plain; charset=utf-8".to_owned())
    );
    let id = idem::job_id("orders.place", &("o-1", 0_u32)).unwrap();
    assert_eq!(
        properties.message_id().as_ref().map(|i| i.to_string()),
        Some(id.as_str().to_owned())
    );
    let table = properties.headers().as_ref().expect("a headers table");
    let got: BTreeMap<String, String> = table
        .inner()
        .iter()
        .map(|(name, value)| {
            let AMQPValue::LongString(value) = value else {
                panic!("header {name} is {value:?}, not a long string");
            };
            let value = String::from_utf8(value.as_bytes().to_vec()).unwrap();
            (name.to_string(), value)
        })
        .collect();
    assert_eq!(got, sent_headers());
    assert_eq!(delivery.data, b"ship o-1");
    delivery.ack(BasicAckOptions::default()).await.unwrap();
    channel
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

/// A message's headers reach JetStream beside its `Nats-Msg-Id`: `content-type`,
/// `traceparent` and the user's, exactly, read back from the stream.
#[tokio::test(flavor = "multi_thread")]
async fn jetstream_carries_a_messages_headers() {
    let (store, _pool, dir) = store("nats-headers").await;
    let js = send_invoice::connect(&send_invoice::nats_url())
        .await
        .unwrap();
    let name = format!("IDEM_OUTBOX_HEADERS_{}", std::process::id());
    let subject = format!("idem.outbox.headers.{}", std::process::id());
    let stream = send_invoice::create_stream(&js, &name, &subject, Duration::from_secs(120))
        .await
        .unwrap();
    assert!(
        place_with_headers(&store, "o-1", &subject)
            .await
            .unwrap()
            .is_applied()
    );
    let relay = Relay::new(store.clone(), JetStream::new(js.clone()));
    assert_eq!(relay.relay_once().await.unwrap().sent, 1);

    let message = stream.get_raw_message(1).await.unwrap();
    let mut got: BTreeMap<String, String> = BTreeMap::new();
    for (name, values) in message.headers.iter() {
        assert_eq!(values.len(), 1, "{name}: {values:?}");
        got.insert(name.to_string(), values[0].as_str().to_owned());
    }
    let mut want = sent_headers();
    want.insert(
        "content-type".to_owned(),
        "text/plain; charset=utf-8".to_owned(),
    );
    let id = idem::job_id("orders.place", &("o-1", 0_u32)).unwrap();
    want.insert("Nats-Msg-Id".to_owned(), id.as_str().to_owned());
    assert_eq!(got, want);
    assert_eq!(&message.payload[..], b"ship o-1");
    js.delete_stream(&name).await.unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}
