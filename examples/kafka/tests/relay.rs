//! The outbox relay's Kafka publisher against a real Kafka-protocol broker (`IDEM_KAFKA_URL`,
//! tansu in CI), on PostgreSQL: each message once per id, with its ordering key as the
//! record's key and its headers as record headers.

mod common;

use std::time::Duration;

use common::World;
use common::support::within;
use idem::outbox::{Kafka, MESSAGE_ID_HEADER, Relay};
use idem_example_kafka::{Effects, TopUp, kafka_url};
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::message::{Headers as _, Message as _};
use rdkafka::{Offset, TopicPartitionList};

/// The relay publishes each outbox message once, its ordering key (here the job's key) as the
/// record's key and its id in the `idem-message-id` header. Replayed (the relay confirmed but died before its mark, made
/// here by clearing the marks in SQL), each message is on the topic twice with one id, and the
/// next consumer's claim of that id applies it once.
#[tokio::test(flavor = "multi_thread")]
async fn relay_publishes_each_message_once_per_id() {
    let world = World::new(&kafka_url(), 2).await;
    let mut ids = Vec::new();
    for i in 0..10 {
        let key = idem::Key::new(&format!("order-{i}")).unwrap();
        let idem::Claimed::Fresh(mut guard) =
            world.store.claim("orders.place", &key).await.unwrap()
        else {
            panic!("fresh");
        };
        let job = TopUp {
            id: format!("order-{i}"),
            account: i,
            credits: 1,
        };
        ids.push(guard.outbox().send(&world.topic, &job).unwrap().to_owned());
        assert!(
            guard
                .finish(Ok::<_, idem::Error>(()))
                .await
                .unwrap()
                .is_applied()
        );
    }
    let relay = Relay::new(
        world.store.clone(),
        Kafka::new(&idem_example_kafka::config(&world.url, None)).unwrap(),
    );
    relay_all(&relay, 10).await;
    let records = read_topic(&world, 10).await;
    let mut got: Vec<String> = records.iter().map(|r| r.0.clone()).collect();
    got.sort();
    let mut want = ids.clone();
    want.sort();
    assert_eq!(got, want, "each message once, by its id");
    for (id, key) in &records {
        let job = ids
            .iter()
            .position(|sent| sent == id)
            .expect("a message sent");
        assert_eq!(
            key,
            &format!("order-{job}"),
            "the record's key is the job's key"
        );
    }
    assert_eq!(
        relay.relay_once().await.unwrap().sent,
        0,
        "nothing left to send"
    );
    // The relay's mark lost: every message published again, under its id.
    let sql = format!("UPDATE {}_outbox SET sent_at = NULL", world.markers);
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .execute(&world.pool)
        .await
        .unwrap();
    relay_all(&relay, 10).await;
    let records = read_topic(&world, 20).await;
    let (mut applied, mut duplicate) = (0, 0);
    for (id, _) in &records {
        let key = idem::Key::new(id.as_str()).unwrap();
        match world.store.claim("shipping.handle", &key).await.unwrap() {
            idem::Claimed::Fresh(mut guard) => {
                let job = TopUp {
                    id: id.clone(),
                    account: 0,
                    credits: 1,
                };
                <sqlx::Postgres as Effects>::insert(guard.tx(), &world.effects, &job, 0, 0)
                    .await
                    .unwrap();
                assert!(
                    guard
                        .finish(Ok::<_, idem::Error>(()))
                        .await
                        .unwrap()
                        .is_applied()
                );
                applied += 1;
            }
            _ => duplicate += 1,
        }
    }
    assert_eq!((applied, duplicate), (10, 10));
    assert_eq!(world.not_once().await, []);
    world.cleanup().await;
}

/// A message's headers are record headers after its id, in their order: `content-type`,
/// `traceparent`, then the user's, exactly; its ordering key is the record's key.
#[tokio::test(flavor = "multi_thread")]
async fn relay_carries_a_messages_headers_as_record_headers() {
    const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let world = World::new(&kafka_url(), 2).await;
    let key = idem::Key::new("order-1").unwrap();
    let idem::Claimed::Fresh(mut guard) = world.store.claim("orders.place", &key).await.unwrap()
    else {
        panic!("fresh");
    };
    let id = guard
        .outbox()
        .message(&world.topic)
        .json(&serde_json::json!({"order": 1}))
        .key("customer-7")
        .content_type("application/vnd.top-up+json")
        .traceparent(TRACEPARENT)
        .header("tenant", "acme")
        .header("X-Note", "caf\u{e9} \"au lait\"")
        .send()
        .unwrap()
        .to_owned();
    assert!(
        guard
            .finish(Ok::<_, idem::Error>(()))
            .await
            .unwrap()
            .is_applied()
    );
    let relay = Relay::new(
        world.store.clone(),
        Kafka::new(&idem_example_kafka::config(&world.url, None)).unwrap(),
    );
    relay_all(&relay, 1).await;
    let records = read_records(&world, 1).await;
    let want: Vec<(String, String)> = [
        (MESSAGE_ID_HEADER, id.as_str()),
        ("content-type", "application/vnd.top-up+json"),
        ("traceparent", TRACEPARENT),
        ("tenant", "acme"),
        ("X-Note", "caf\u{e9} \"au lait\""),
    ]
    .into_iter()
    .map(|(n, v)| (n.to_owned(), v.to_owned()))
    .collect();
    assert_eq!(records, [(want, "customer-7".to_owned())]);
    world.cleanup().await;
}

/// Rounds of the relay until `n` messages were sent (bounded).
async fn relay_all<P: idem::outbox::Publisher>(relay: &Relay<sqlx::Postgres, P>, n: usize) {
    within(60, "the relay's rounds", async {
        let mut sent = 0;
        while sent < n {
            let round = relay.relay_once().await.unwrap();
            assert_eq!((round.failed, round.parked), (0, 0), "{round:?}");
            sent += round.sent;
        }
        assert_eq!(sent, n);
    })
    .await;
}

/// The `(message id header, record key)` of the first `n` records of the world's topic.
async fn read_topic(world: &World, n: usize) -> Vec<(String, String)> {
    read_records(world, n)
        .await
        .into_iter()
        .map(|(headers, key)| {
            let id = headers
                .into_iter()
                .find(|(name, _)| name == MESSAGE_ID_HEADER)
                .map(|(_, id)| id)
                .expect("the message id header");
            (id, key)
        })
        .collect()
}

/// The `(headers in their order, record key)` of the first `n` records of the world's topic.
async fn read_records(world: &World, n: usize) -> Vec<(Vec<(String, String)>, String)> {
    let consumer: BaseConsumer =
        idem_example_kafka::config(&world.url, Some(&common::unique("reader")))
            .create()
            .unwrap();
    let mut tpl = TopicPartitionList::new();
    for p in 0..2 {
        tpl.add_partition_offset(&world.topic, p, Offset::Beginning)
            .unwrap();
    }
    consumer.assign(&tpl).unwrap();
    tokio::task::spawn_blocking(move || {
        let mut got = Vec::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while got.len() < n {
            assert!(
                std::time::Instant::now() < deadline,
                "{} of {n} records within 60 s",
                got.len()
            );
            if let Some(message) = consumer.poll(Duration::from_millis(200)) {
                let message = message.unwrap();
                let headers = message
                    .headers()
                    .map(|h| {
                        h.iter()
                            .map(|h| {
                                let value = h.value.expect("a header with a value");
                                (h.key.to_owned(), String::from_utf8(value.to_vec()).unwrap())
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                let key = String::from_utf8(message.key().unwrap().to_vec()).unwrap();
                got.push((headers, key));
            }
        }
        got
    })
    .await
    .unwrap()
}
