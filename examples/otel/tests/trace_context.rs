//! W3C trace context through a real OpenTelemetry SDK pipeline, exported in memory: the
//! producer's `traceparent` is its span's context, and a consumer's `idem.claim` span, made by
//! hand, by a transaction-mode handler or by a lease-mode handler, links to that span (trace id
//! and span id compared exactly) while it starts a trace of its own. A traceparent that does
//! not parse links nothing and fails nothing: the jobs are applied, counted in the database.

use idem::{ClaimOptions, Claimed, Key, Lease, Outcome, Store, TraceParent};
use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use sqlx::{Sqlite, SqlitePool, Transaction};
use tracing_subscriber::layer::SubscriberExt as _;

/// A message as a consumer receives it, its `traceparent` header as it came.
struct Message {
    id: String,
    traceparent: Option<String>,
}

#[idem::idempotent(key = "msg.id", scope = "link.handler", link = "msg.traceparent")]
async fn consume(tx: &mut Transaction<'_, Sqlite>, msg: &Message) -> Result<(), idem::Error> {
    sqlx::query("INSERT INTO effects (id) VALUES (?1)")
        .bind(&msg.id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

#[idem::idempotent(
    key = "msg.id",
    scope = "link.lease",
    lease = "30s",
    link = "msg.traceparent.as_deref()"
)]
async fn consume_leased(
    lease: &Lease,
    msg: &Message,
    pool: &SqlitePool,
) -> Result<(), idem::Error> {
    let _ = lease;
    sqlx::query("INSERT INTO effects (id) VALUES (?1)")
        .bind(&msg.id)
        .execute(pool)
        .await?;
    Ok(())
}

/// The claim spans of `scope`.
fn claims<'s>(spans: &'s [SpanData], scope: &str) -> Vec<&'s SpanData> {
    spans
        .iter()
        .filter(|s| s.name == "idem.claim")
        .filter(|s| {
            s.attributes
                .iter()
                .any(|kv| kv.key.as_str() == "scope" && kv.value.as_str() == scope)
        })
        .collect()
}

/// The (trace id, span id) of each of a span's links.
fn links(span: &SpanData) -> Vec<(TraceId, SpanId)> {
    span.links
        .links
        .iter()
        .map(|l| (l.span_context.trace_id(), l.span_context.span_id()))
        .collect()
}

async fn effects(pool: &SqlitePool, id: &str) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM effects WHERE id = ?1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[test]
fn a_consumer_claim_links_to_the_producer_span() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("idem-link-test")));
    let _guard = tracing::subscriber::set_default(subscriber);

    // Outside any span there is no context to send.
    assert_eq!(TraceParent::current(), None);

    // The producer: what it puts in its message's header is its span's context.
    let producer = tracing::info_span!("orders.send");
    let sent = producer
        .in_scope(TraceParent::current)
        .expect("the producer's span has a context");
    drop(producer);
    let header = sent.to_string();
    assert_eq!(TraceParent::parse(&header), Ok(sent));

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let pool = runtime.block_on(async {
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(1)
            .connect("sqlite::memory:")
            .await
            .unwrap();
        sqlx::query("CREATE TABLE effects (id TEXT)")
            .execute(&pool)
            .await
            .unwrap();
        let store = Store::new(pool.clone());
        store.migrate().await.unwrap();

        // By hand: the header read leniently, given to the claim's options.
        let key = Key::new("order-1").unwrap();
        let options = ClaimOptions::new().link(TraceParent::from_header(header.as_bytes()));
        match store
            .claim_with("link.by_hand", &key, options)
            .await
            .unwrap()
        {
            Claimed::Fresh(mut guard) => {
                sqlx::query("INSERT INTO effects (id) VALUES ('order-1')")
                    .execute(&mut **guard.tx())
                    .await
                    .unwrap();
                let done = guard.finish(Ok::<(), idem::Error>(())).await.unwrap();
                assert_eq!(done, Outcome::Applied(()));
            }
            other => panic!("order-1 was claimed before: {other:?}"),
        }

        // The attribute: a delivery and its redelivery both link to the producer.
        let msg = Message {
            id: "order-2".into(),
            traceparent: Some(header.clone()),
        };
        assert_eq!(consume(&store, &msg).await.unwrap(), Outcome::Applied(()));
        assert_eq!(consume(&store, &msg).await.unwrap(), Outcome::Duplicate);

        // Lease mode.
        let leased = Message {
            id: "order-3".into(),
            traceparent: Some(header.clone()),
        };
        assert_eq!(
            consume_leased(&store, &leased, &pool).await.unwrap(),
            Outcome::Applied(())
        );

        // A header that is no traceparent (upper-case digits, garbage), and none at all:
        // nothing linked, every job applied.
        for (id, traceparent) in [
            ("bad-1", Some(header.to_uppercase())),
            ("bad-2", Some("00-not-a-traceparent".to_owned())),
            ("bad-3", None),
        ] {
            let msg = Message {
                id: id.into(),
                traceparent,
            };
            assert_eq!(consume(&store, &msg).await.unwrap(), Outcome::Applied(()));
        }
        let key = Key::new("bad-4").unwrap();
        let options = ClaimOptions::new().link(TraceParent::from_header("garbage"));
        match store
            .claim_with("link.by_hand", &key, options)
            .await
            .unwrap()
        {
            Claimed::Fresh(mut guard) => {
                sqlx::query("INSERT INTO effects (id) VALUES ('bad-4')")
                    .execute(&mut **guard.tx())
                    .await
                    .unwrap();
                let done = guard.finish(Ok::<(), idem::Error>(())).await.unwrap();
                assert_eq!(done, Outcome::Applied(()));
            }
            other => panic!("bad-4 was claimed before: {other:?}"),
        }
        pool
    });
    runtime.block_on(async {
        for id in [
            "order-1", "order-2", "order-3", "bad-1", "bad-2", "bad-3", "bad-4",
        ] {
            assert_eq!(effects(&pool, id).await, 1, "{id}");
        }
    });

    provider.force_flush().unwrap();
    let spans = exporter.get_finished_spans().unwrap();
    let producer = spans
        .iter()
        .find(|s| s.name == "orders.send")
        .expect("the producer's span");
    let producer_ids = (
        producer.span_context.trace_id(),
        producer.span_context.span_id(),
    );
    assert_eq!(
        (
            producer_ids.0.to_bytes(),
            producer_ids.1.to_bytes(),
            producer.span_context.trace_flags().to_u8()
        ),
        (sent.trace_id(), sent.span_id(), sent.flags())
    );

    let by_hand = claims(&spans, "link.by_hand");
    assert_eq!(by_hand.len(), 2, "{spans:#?}");
    let handler = claims(&spans, "link.handler");
    assert_eq!(handler.len(), 5, "{spans:#?}");
    let leased = claims(&spans, "link.lease");
    assert_eq!(leased.len(), 1, "{spans:#?}");
    let key_of = |span: &SpanData| {
        span.attributes
            .iter()
            .find(|kv| kv.key.as_str() == "key")
            .map(|kv| kv.value.as_str().into_owned())
            .expect("a claim's span names its key")
    };
    for span in by_hand.iter().chain(&handler).chain(&leased) {
        let key = key_of(span);
        let expected = match key.starts_with("order-") {
            true => vec![producer_ids],
            false => vec![],
        };
        assert_eq!(links(span), expected, "{key}: {span:#?}");
        // Linked, not parented: the consumer's span starts a trace of its own.
        assert_ne!(span.span_context.trace_id(), producer_ids.0, "{key}");
        assert!(!span.parent_span_is_remote, "{key}");
    }
}
