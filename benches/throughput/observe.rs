//! `--observe`: the run with a `tracing` subscriber that takes idem's spans (target `idem`,
//! `INFO` and above, as `RUST_LOG=idem=info` would) and a `metrics` recorder, both doing the
//! least a real one does (an id per span, an atomic add per sample), so that the ratio shows
//! what turning observability on costs next to the run without them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use metrics::{
    Counter, CounterFn, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
    SharedString, Unit,
};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Subscriber};

struct Spans(AtomicU64);

impl Subscriber for Spans {
    fn enabled(&self, meta: &tracing::Metadata<'_>) -> bool {
        meta.target() == "idem" && *meta.level() <= Level::INFO
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(self.0.fetch_add(1, Ordering::Relaxed) + 1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, _: &Event<'_>) {}
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

struct Sum(AtomicU64);

impl CounterFn for Sum {
    fn increment(&self, value: u64) {
        self.0.fetch_add(value, Ordering::Relaxed);
    }
    fn absolute(&self, value: u64) {
        self.0.store(value, Ordering::Relaxed);
    }
}

impl HistogramFn for Sum {
    fn record(&self, value: f64) {
        let _ = value;
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

struct Samples(Arc<Sum>);

impl Recorder for Samples {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(self.0.clone())
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }
    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(self.0.clone())
    }
}

/// Installs both for the rest of the process.
pub(crate) fn install() {
    tracing::subscriber::set_global_default(Spans(AtomicU64::new(0)))
        .expect("no other subscriber in the bench");
    metrics::set_global_recorder(Samples(Arc::new(Sum(AtomicU64::new(0)))))
        .unwrap_or_else(|_| panic!("no other recorder in the bench"));
    idem::describe_metrics();
}
