//! The Kafka consumer continues the producers' traces: records produced inside two producer
//! spans, each with its span's `traceparent` header, are claimed in one batch whose
//! `idem.claim` span links to both producer spans, once each (trace and span ids compared
//! exactly), through a real OpenTelemetry SDK pipeline exported in memory. A record whose
//! header is no traceparent, and one without the header, are applied all the same.

use std::time::Duration;

use idem::kafka::{Consumer, Record};
use idem::{Store, TRACEPARENT, TraceParent};
use idem_example_kafka::{config, create_topic, kafka_url, producer};
use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use sqlx::Sqlite;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
use tracing_subscriber::layer::SubscriberExt as _;

/// A name no other test or run uses.
fn unique(kind: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!("{kind}_{}_{nanos:x}", std::process::id())
}

#[test]
fn a_batch_links_to_each_producer_span_once() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    // Global: the consumer's thread and the runtime's threads see the same subscriber.
    tracing::subscriber::set_global_default(
        tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("idem-kafka-link"))),
    )
    .expect("the only subscriber of this test binary");

    let first = tracing::info_span!("orders.produce.first");
    let sent_first = first.in_scope(TraceParent::current).expect("a context");
    drop(first);
    let second = tracing::info_span!("orders.produce.second");
    let sent_second = second.in_scope(TraceParent::current).expect("a context");
    drop(second);
    assert_ne!(sent_first, sent_second);

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    let url = kafka_url();
    let topic = unique("link-orders");
    let group = unique("link-billing");
    let file = std::env::temp_dir().join(format!("{}.db", unique("idem_kafka_link")));
    runtime.block_on(async {
        let options = SqliteConnectOptions::new()
            .filename(&file)
            .create_if_missing(true);
        let pool = SqlitePoolOptions::new()
            .max_connections(2)
            .connect_with(options)
            .await
            .unwrap();
        sqlx::query("CREATE TABLE effects (record INTEGER NOT NULL)")
            .execute(&pool)
            .await
            .unwrap();
        let store: Store<Sqlite> = Store::new(pool.clone());
        store.migrate().await.unwrap();

        create_topic(&url, &topic, 1).await.unwrap();
        let producer = producer(&url).unwrap();
        let garbage = sent_first.to_string().to_uppercase();
        let headers = [
            Some(sent_first.to_string()),
            Some(sent_first.to_string()),
            Some(sent_second.to_string()),
            Some(garbage),
            None,
        ];
        for (i, traceparent) in headers.iter().enumerate() {
            let payload = i.to_string();
            let mut record = FutureRecord::<str, str>::to(&topic).payload(&payload);
            if let Some(value) = traceparent {
                record = record.headers(OwnedHeaders::new().insert(Header {
                    key: TRACEPARENT,
                    value: Some(value.as_str()),
                }));
            }
            producer
                .send(record, Duration::from_secs(30))
                .await
                .map_err(|(e, _)| e)
                .unwrap();
        }

        let mut consumer =
            Consumer::watermarks(store.clone(), &config(&url, Some(&group))).unwrap();
        consumer.subscribe(&[&topic]).unwrap();
        let mut records: Vec<Record> = Vec::new();
        tokio::time::timeout(Duration::from_secs(60), async {
            while records.len() < headers.len() {
                let got = consumer
                    .next_batch(headers.len() - records.len(), Duration::from_millis(500))
                    .await
                    .unwrap();
                records.extend(got);
            }
        })
        .await
        .expect("the five records within 60 s");
        assert_eq!(records[0].traceparent(), Some(sent_first));
        assert_eq!(
            records[3].traceparent(),
            None,
            "upper-case digits are refused"
        );

        let mut claim = consumer.claim(&records).await.unwrap();
        assert!(claim.fresh().iter().all(|f| *f));
        for record in &records {
            sqlx::query("INSERT INTO effects (record) VALUES (?1)")
                .bind(record.offset())
                .execute(&mut **claim.tx().unwrap())
                .await
                .unwrap();
        }
        let batch = claim.finish(Ok::<(), idem::Error>(())).await.unwrap();
        assert_eq!(batch.applied(), headers.len());
        let counted: i64 = sqlx::query_scalar("SELECT COUNT(DISTINCT record) FROM effects")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(counted, 5);
        consumer.close().await;
        pool.close().await;
    });
    drop(std::fs::remove_file(&file));

    provider.force_flush().unwrap();
    let spans = exporter.get_finished_spans().unwrap();
    let ids = |name: &str| {
        let span = spans
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no span {name}"));
        (span.span_context.trace_id(), span.span_context.span_id())
    };
    let producers = [ids("orders.produce.first"), ids("orders.produce.second")];
    let as_sent = |sent: TraceParent| {
        (
            TraceId::from_bytes(sent.trace_id()),
            SpanId::from_bytes(sent.span_id()),
        )
    };
    assert_eq!(producers, [as_sent(sent_first), as_sent(sent_second)]);
    let claims: Vec<_> = spans.iter().filter(|s| s.name == "idem.claim").collect();
    let [claim] = &claims[..] else {
        panic!("one claim span: {claims:#?}")
    };
    let links: Vec<(TraceId, SpanId)> = claim
        .links
        .iter()
        .map(|l| (l.span_context.trace_id(), l.span_context.span_id()))
        .collect();
    assert_eq!(links, producers);
    assert!(claim.links.iter().all(|l| l.span_context.is_remote()));
}
