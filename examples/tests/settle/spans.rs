//! The runner's span of each delivery: OpenTelemetry's messaging names on it, the handler's
//! outcome and the delivery's disposition recorded when it is settled, and the handler's
//! `idem.claim` span inside it.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};

use idem::settle::{DELIVERY_SPAN, Runner};
use tracing::Subscriber;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt as _};
use tracing_subscriber::registry::LookupSpan;

use super::brokers::Broker;
use super::{Case, job, recording};

/// A closed span: its name, its fields as text, and its parent's name and fields.
#[derive(Debug, Clone, Default)]
struct Closed {
    name: &'static str,
    fields: BTreeMap<String, String>,
    parent: Option<(&'static str, BTreeMap<String, String>)>,
}

impl Visit for Closed {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.fields.insert(
            field.name().to_owned(),
            format!("{value:?}").trim_matches('"').to_owned(),
        );
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.fields
            .insert(field.name().to_owned(), value.to_owned());
    }
}

/// Every span of the process, kept once closed. The brokers' cases run at once in this binary,
/// so it is installed for all of them, and each case picks its own spans by its destination.
#[derive(Default)]
struct Recorder {
    closed: Mutex<Vec<Closed>>,
}

static RECORDER: OnceLock<&'static Recorder> = OnceLock::new();

fn recorder() -> &'static Recorder {
    RECORDER.get_or_init(|| {
        let recorder: &'static Recorder = Box::leak(Box::default());
        let subscriber = tracing_subscriber::registry().with(Recording(recorder));
        tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
        recorder
    })
}

struct Recording(&'static Recorder);

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Recording {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let span = ctx.span(id).expect("a new span is in the registry");
        let mut closed = Closed {
            name: attrs.metadata().name(),
            ..Closed::default()
        };
        attrs.record(&mut closed);
        closed.parent = span.parent().map(|parent| {
            let fields = parent
                .extensions()
                .get::<Closed>()
                .map(|c| c.fields.clone());
            (parent.name(), fields.unwrap_or_default())
        });
        span.extensions_mut().insert(closed);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let span = ctx.span(id).expect("a recorded span is in the registry");
        if let Some(closed) = span.extensions_mut().get_mut::<Closed>() {
            values.record(closed);
        }
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let span = ctx.span(&id).expect("a closing span is in the registry");
        if let Some(closed) = span.extensions_mut().remove::<Closed>() {
            self.0.closed.lock().unwrap().push(closed);
        }
    }
}

/// Whether `fields` are those of a delivery span of the case `test` on the broker `system`.
fn of_case(fields: &BTreeMap<String, String>, test: &str, system: &str) -> bool {
    let destination = fields.get("messaging.destination.name");
    fields.get("messaging.system").is_some_and(|s| s == system)
        && destination.is_some_and(|d| d.to_lowercase().contains(test))
}

/// A job delivered twice and a payload that is not a job, one at a time: three delivery
/// spans, each with the messaging names, its outcome and its disposition; the two handled
/// deliveries' `idem.claim` spans inside theirs.
pub(super) async fn each_delivery_has_its_span_with_its_outcome_and_disposition<B: Broker>(
    system: &str,
) {
    let recorder = recorder();
    let case = Case::<B>::new("spans", 3).await;
    case.publish_jobs(&[job(1), job(1)]).await;
    case.broker.publish(vec![b"not a job".to_vec()]).await;
    let (runner, _, done) = recording(Runner::new().in_flight(1), |seen| seen.len() == 3);
    case.apply_until(runner, 1, &done, "3 deliveries").await;
    let closed = recorder.closed.lock().unwrap().clone();
    let deliveries: Vec<&Closed> = closed
        .iter()
        .filter(|c| c.name == DELIVERY_SPAN && of_case(&c.fields, "spans", system))
        .collect();
    let settled: Vec<(&str, &str)> = deliveries
        .iter()
        .map(|c| {
            (
                c.fields["idem.outcome"].as_str(),
                c.fields["idem.disposition"].as_str(),
            )
        })
        .collect();
    assert_eq!(
        settled,
        [
            ("applied", "ack"),
            ("duplicate", "ack"),
            ("unparsable", "dead_letter")
        ]
    );
    for span in &deliveries {
        let field = |name: &str| span.fields.get(name).map(String::as_str);
        assert_eq!(field("messaging.system"), Some(system), "{span:?}");
        assert_eq!(
            field("messaging.operation.type"),
            Some("process"),
            "{span:?}"
        );
        assert_eq!(field("idem.delivery_count"), Some("1"), "{span:?}");
        let destination = field("messaging.destination.name").unwrap();
        assert_eq!(
            field("otel.name"),
            Some(format!("process {destination}").as_str())
        );
    }
    let claims = closed.iter().filter(|c| {
        c.name == "idem.claim"
            && c.parent
                .as_ref()
                .is_some_and(|(name, f)| *name == DELIVERY_SPAN && of_case(f, "spans", system))
    });
    assert_eq!(
        claims.count(),
        2,
        "the handled deliveries' claims inside their spans"
    );
    case.end().await;
}
