//! A `tracing` subscriber and a `metrics` recorder written for the tests: they keep everything
//! they are given, so that the tests can compare span fields, events and metric values.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use metrics::{
    Counter, CounterFn, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
    SharedString, Unit,
};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::subscriber::Interest;
use tracing::{Event, Level, Subscriber};

pub type Fields = BTreeMap<String, String>;

/// Field values as text: strings as they are, everything else as `Debug` shows it.
struct Text<'a>(&'a mut Fields);

impl Visit for Text<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
}

#[derive(Clone, Debug)]
pub struct SpanRec {
    pub name: &'static str,
    pub parent: Option<u64>,
    pub fields: Fields,
}

#[derive(Clone, Debug)]
pub struct EventRec {
    pub level: Level,
    pub target: String,
    pub span: Option<u64>,
    pub fields: Fields,
}

/// What one test's subscriber saw. The tests run on current-thread runtimes, so one stack of
/// entered spans is enough.
#[derive(Default)]
pub struct Seen {
    spans: Mutex<BTreeMap<u64, SpanRec>>,
    events: Mutex<Vec<EventRec>>,
    stack: Mutex<Vec<u64>>,
}

impl Seen {
    /// The `idem.claim` spans, in the order they were opened, with their ids.
    pub fn claims(&self) -> Vec<(u64, SpanRec)> {
        let spans = self.spans.lock().unwrap();
        spans
            .iter()
            .filter(|(_, s)| s.name == "idem.claim")
            .map(|(id, s)| (*id, s.clone()))
            .collect()
    }

    /// idem's events inside span `id`.
    pub fn idem_events(&self, id: u64) -> Vec<EventRec> {
        let events = self.events.lock().unwrap();
        events
            .iter()
            .filter(|e| e.target == "idem" && e.span == Some(id))
            .cloned()
            .collect()
    }

    /// Every event of the test, in order, inside a span or not.
    pub fn events(&self) -> Vec<EventRec> {
        self.events.lock().unwrap().clone()
    }

    fn current(&self) -> Option<u64> {
        self.stack.lock().unwrap().last().copied()
    }
}

thread_local! {
    /// The test of this thread's `Seen`: each test runs on its own thread.
    static SEEN: RefCell<Option<Arc<Seen>>> = const { RefCell::new(None) };
}

/// Keeps what this thread's spans and events do in a fresh `Seen` until dropped.
///
/// One global subscriber sends each thread's spans to that thread's test. With a scoped
/// subscriber per test (`tracing::subscriber::set_default`) spans went missing now and then
/// (a batch test saw one of its three in about one run of three) while other threads' tests
/// installed and dropped theirs: tracing caches each callsite's interest over every live
/// dispatcher, and one global subscriber that asks at every call leaves nothing to cache.
pub fn subscribe() -> (Arc<Seen>, Watching) {
    static INSTALLED: OnceLock<()> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        tracing::subscriber::set_global_default(Sub).expect("no other global subscriber");
    });
    let seen = Arc::new(Seen::default());
    SEEN.with(|s| *s.borrow_mut() = Some(seen.clone()));
    (seen, Watching(()))
}

/// Returned by [`subscribe`]: the thread's spans go nowhere once it is dropped.
pub struct Watching(());

impl Drop for Watching {
    fn drop(&mut self) {
        SEEN.with(|s| *s.borrow_mut() = None);
    }
}

fn with_seen(f: impl FnOnce(&Seen)) {
    if let Some(seen) = SEEN.with(|s| s.borrow().clone()) {
        f(&seen);
    }
}

/// Span ids are unique in the process, whichever test opened the span.
static NEXT_SPAN: AtomicU64 = AtomicU64::new(1);

struct Sub;

impl Subscriber for Sub {
    // Asked again at every span and event: a thread whose test watches nothing sees idem's
    // spans disabled, as with no subscriber at all.
    fn register_callsite(&self, _: &'static tracing::Metadata<'static>) -> Interest {
        Interest::sometimes()
    }
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        SEEN.with(|s| s.borrow().is_some())
    }
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let id = NEXT_SPAN.fetch_add(1, Ordering::Relaxed);
        with_seen(|seen| {
            let parent = match span.parent() {
                Some(p) => Some(p.into_u64()),
                None if span.is_contextual() => seen.current(),
                None => None,
            };
            let mut fields = Fields::new();
            span.record(&mut Text(&mut fields));
            let rec = SpanRec {
                name: span.metadata().name(),
                parent,
                fields,
            };
            seen.spans.lock().unwrap().insert(id, rec);
        });
        Id::from_u64(id)
    }
    fn record(&self, id: &Id, values: &Record<'_>) {
        with_seen(|seen| {
            if let Some(rec) = seen.spans.lock().unwrap().get_mut(&id.into_u64()) {
                values.record(&mut Text(&mut rec.fields));
            }
        });
    }
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        with_seen(|seen| {
            let span = match event.parent() {
                Some(p) => Some(p.into_u64()),
                None if event.is_contextual() => seen.current(),
                None => None,
            };
            let mut fields = Fields::new();
            event.record(&mut Text(&mut fields));
            seen.events.lock().unwrap().push(EventRec {
                level: *event.metadata().level(),
                target: event.metadata().target().to_owned(),
                span,
                fields,
            });
        });
    }
    fn enter(&self, id: &Id) {
        with_seen(|seen| seen.stack.lock().unwrap().push(id.into_u64()));
    }
    fn exit(&self, id: &Id) {
        with_seen(|seen| {
            let top = seen.stack.lock().unwrap().pop();
            assert_eq!(top, Some(id.into_u64()), "spans exit in the order entered");
        });
    }
}

type MetricId = (String, Vec<(String, String)>);

fn metric_id(key: &Key) -> MetricId {
    let mut labels: Vec<_> = key
        .labels()
        .map(|l| (l.key().to_owned(), l.value().to_owned()))
        .collect();
    labels.sort();
    (key.name().to_owned(), labels)
}

fn wanted(name: &str, labels: &[(&str, &str)]) -> MetricId {
    let mut labels: Vec<_> = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    labels.sort();
    (name.to_owned(), labels)
}

/// Every counter and histogram sample recorded in this process.
#[derive(Default)]
pub struct Metrics {
    counters: Mutex<HashMap<MetricId, u64>>,
    histograms: Mutex<HashMap<MetricId, Vec<f64>>>,
    descriptions: Mutex<BTreeMap<String, (&'static str, Option<Unit>)>>,
}

impl Metrics {
    /// The kind (`counter`, `histogram`) and unit each described metric was given.
    pub fn described(&self) -> BTreeMap<String, (&'static str, Option<Unit>)> {
        self.descriptions.lock().unwrap().clone()
    }

    pub fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        let counters = self.counters.lock().unwrap();
        counters.get(&wanted(name, labels)).copied().unwrap_or(0)
    }

    /// The counters named `name` whose labels include `label`, by their labels.
    pub fn counters_with(&self, name: &str, label: (&str, &str)) -> BTreeMap<String, u64> {
        let counters = self.counters.lock().unwrap();
        counters
            .iter()
            .filter(|((n, labels), _)| {
                n == name && labels.iter().any(|(k, v)| k == label.0 && v == label.1)
            })
            .map(|((_, labels), v)| (format!("{labels:?}"), *v))
            .collect()
    }

    pub fn samples(&self, name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
        let histograms = self.histograms.lock().unwrap();
        histograms
            .get(&wanted(name, labels))
            .cloned()
            .unwrap_or_default()
    }
}

/// The process's recorder, installed by the first call (recorders are global).
pub fn metrics() -> &'static Metrics {
    static METRICS: OnceLock<&'static Metrics> = OnceLock::new();
    METRICS.get_or_init(|| {
        let metrics: &'static Metrics = Box::leak(Box::default());
        metrics::set_global_recorder(Rec(metrics))
            .unwrap_or_else(|_| panic!("no other recorder in this test binary"));
        metrics
    })
}

struct Rec(&'static Metrics);

struct Handle(&'static Metrics, MetricId);

impl CounterFn for Handle {
    fn increment(&self, value: u64) {
        *self
            .0
            .counters
            .lock()
            .unwrap()
            .entry(self.1.clone())
            .or_default() += value;
    }
    fn absolute(&self, value: u64) {
        self.0
            .counters
            .lock()
            .unwrap()
            .insert(self.1.clone(), value);
    }
}

impl HistogramFn for Handle {
    fn record(&self, value: f64) {
        let mut histograms = self.0.histograms.lock().unwrap();
        histograms.entry(self.1.clone()).or_default().push(value);
    }
}

impl Recorder for Rec {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, help: SharedString) {
        assert!(!help.is_empty(), "{key:?} has a help text");
        let mut descriptions = self.0.descriptions.lock().unwrap();
        descriptions.insert(key.as_str().to_owned(), ("counter", unit));
    }
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, help: SharedString) {
        assert!(!help.is_empty(), "{key:?} has a help text");
        let mut descriptions = self.0.descriptions.lock().unwrap();
        descriptions.insert(key.as_str().to_owned(), ("histogram", unit));
    }
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(Arc::new(Handle(self.0, metric_id(key))))
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(Arc::new(Handle(self.0, metric_id(key))))
    }
}
