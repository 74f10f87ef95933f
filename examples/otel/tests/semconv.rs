//! idem's span and metrics through a real OpenTelemetry SDK pipeline, exported in memory: a
//! handler whose scope names its broker, a hand-written claim given its broker, and a request
//! behind the HTTP layer each carry the attributes of OpenTelemetry's semantic conventions,
//! and the consumers' calls record `messaging.process.duration` beside idem's own metrics.

use std::collections::BTreeMap;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use idem::http::{ClaimedTx, IdempotencyLayer};
use idem::{ClaimOptions, Claimed, Key, Messaging, Outcome, Store};
use opentelemetry::metrics::MeterProvider as _;
use opentelemetry::trace::{SpanKind, TracerProvider as _};
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData};
use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use sqlx::{Sqlite, Transaction};
use tower::ServiceExt as _;
use tracing_subscriber::layer::SubscriberExt as _;

struct Order {
    id: String,
}

#[idem::idempotent(key = "order.id", scope = "orders.process")]
async fn process(tx: &mut Transaction<'_, Sqlite>, order: &Order) -> Result<(), idem::Error> {
    sqlx::query("INSERT INTO effects (id) VALUES (?1)")
        .bind(&order.id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

async fn invoice(mut tx: ClaimedTx<Sqlite>) -> StatusCode {
    match sqlx::query("INSERT INTO effects (id) VALUES ('invoice')")
        .execute(tx.conn())
        .await
    {
        Ok(_) => StatusCode::CREATED,
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// A span's attributes, as text.
fn attributes(span: &opentelemetry_sdk::trace::SpanData) -> BTreeMap<String, String> {
    span.attributes
        .iter()
        .map(|kv| (kv.key.as_str().to_owned(), kv.value.as_str().into_owned()))
        .collect()
}

#[test]
fn idem_speaks_opentelemetry_semantic_conventions() {
    let spans = InMemorySpanExporter::default();
    let tracer_provider = SdkTracerProvider::builder()
        .with_simple_exporter(spans.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(tracer_provider.tracer("idem-test")));
    let metrics_out = InMemoryMetricExporter::default();
    let meter_provider = SdkMeterProvider::builder()
        .with_reader(PeriodicReader::builder(metrics_out.clone()).build())
        .build();
    let recorder = metrics_exporter_otel::OpenTelemetryRecorder::new(meter_provider.meter("idem"));
    metrics::set_global_recorder(recorder).expect("the only recorder of this process");
    idem::describe_metrics();

    let _guard = tracing::subscriber::set_default(subscriber);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(1)
            .connect("sqlite::memory:")
            .await
            .unwrap();
        sqlx::query("CREATE TABLE effects (id TEXT)")
            .execute(&pool)
            .await
            .unwrap();
        let store = Store::new(pool);
        store.migrate().await.unwrap();

        // The attribute's handler: its scope says which broker its jobs come from.
        idem::observe_messaging(
            "orders.process",
            Messaging::new("rabbitmq").destination("orders"),
        );
        let order = Order {
            id: "order-7".into(),
        };
        assert_eq!(process(&store, &order).await.unwrap(), Outcome::Applied(()));
        assert_eq!(process(&store, &order).await.unwrap(), Outcome::Duplicate);

        // A hand-written claim, told by its options.
        let kafka = ClaimOptions::new().messaging(Messaging::new("kafka").destination("payments"));
        let key = Key::new("payment-1").unwrap();
        match store
            .claim_with("payments.settle", &key, kafka)
            .await
            .unwrap()
        {
            Claimed::Fresh(guard) => {
                let done = guard.finish(Ok::<(), idem::Error>(())).await.unwrap();
                assert_eq!(done, Outcome::Applied(()));
            }
            other => panic!("payment-1 was claimed before: {other:?}"),
        }

        // A request behind the HTTP layer.
        let app = axum::Router::new().route(
            "/invoices",
            post(invoice).layer(
                IdempotencyLayer::new(store.clone(), "invoices.send")
                    .single_tenant()
                    .route("/invoices"),
            ),
        );
        let request = Request::post("/invoices")
            .header("idempotency-key", "\"inv-1\"")
            .body(Body::empty())
            .unwrap();
        let response = app.oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::CREATED);
    });

    tracer_provider.force_flush().unwrap();
    let finished = spans.get_finished_spans().unwrap();
    let claims: Vec<_> = finished.iter().filter(|s| s.name == "idem.claim").collect();
    assert_eq!(claims.len(), 4, "{finished:#?}");

    let orders: Vec<_> = claims
        .iter()
        .filter(|s| attributes(s).get("scope").map(String::as_str) == Some("orders.process"))
        .collect();
    assert_eq!(orders.len(), 2);
    for span in &orders {
        let a = attributes(span);
        assert_eq!(span.span_kind, SpanKind::Consumer, "{a:?}");
        assert_eq!(a["messaging.system"], "rabbitmq");
        assert_eq!(a["messaging.operation.type"], "process");
        assert_eq!(a["messaging.destination.name"], "orders");
        assert_eq!(a["messaging.message.id"], "order-7");
    }
    let payment = claims
        .iter()
        .find(|s| attributes(s).get("scope").map(String::as_str) == Some("payments.settle"))
        .expect("the hand-written claim's span");
    let a = attributes(payment);
    assert_eq!(
        (
            a["messaging.system"].as_str(),
            a["messaging.destination.name"].as_str()
        ),
        ("kafka", "payments")
    );
    assert_eq!(a["messaging.message.id"], "payment-1");
    let http = claims
        .iter()
        .find(|s| attributes(s).get("scope").map(String::as_str) == Some("invoices.send"))
        .expect("the layer's span");
    let a = attributes(http);
    assert_eq!(a["http.request.method"], "POST");
    assert_eq!(a["http.route"], "/invoices");
    assert!(!a.contains_key("messaging.system"), "{a:?}");

    meter_provider.force_flush().unwrap();
    let exported = metrics_out.get_finished_metrics().unwrap();
    let mut durations = BTreeMap::new();
    let mut names = Vec::new();
    for resource in &exported {
        for scope in resource.scope_metrics() {
            for metric in scope.metrics() {
                names.push(metric.name().to_owned());
                if metric.name() != idem::MESSAGING_PROCESS_DURATION {
                    continue;
                }
                let AggregatedMetrics::F64(MetricData::Histogram(histogram)) = metric.data() else {
                    panic!("{} is not an f64 histogram", metric.name());
                };
                assert_eq!(metric.unit(), "s");
                for point in histogram.data_points() {
                    let labels: BTreeMap<String, String> = point
                        .attributes()
                        .map(|kv| (kv.key.as_str().to_owned(), kv.value.as_str().into_owned()))
                        .collect();
                    *durations.entry(labels).or_insert(0) += point.count();
                }
            }
        }
    }
    for name in [
        "idem_outcomes_total",
        "idem_claim_seconds",
        "messaging.process.duration",
    ] {
        assert!(names.iter().any(|n| n == name), "{name} not in {names:?}");
    }
    let labels = |system: &str, destination: &str| {
        BTreeMap::from([
            (
                "messaging.destination.name".to_owned(),
                destination.to_owned(),
            ),
            ("messaging.operation.name".to_owned(), "process".to_owned()),
            ("messaging.system".to_owned(), system.to_owned()),
        ])
    };
    assert_eq!(
        durations,
        BTreeMap::from([
            (labels("kafka", "payments"), 1),
            (labels("rabbitmq", "orders"), 2)
        ])
    );
}
