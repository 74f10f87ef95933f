//! `#[tracing::instrument]` next to `#[idempotent]`: written below it (the recommended order),
//! it instruments the whole call, claim included, so that a `Duplicate` has its span too;
//! written above it, it instruments only the body, which a duplicate never runs.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use idem::{Outcome, Store};
use sqlx::{Sqlite, SqlitePool, Transaction};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// Records the name of every span opened.
#[derive(Default)]
struct Spans {
    next: AtomicU64,
    opened: Mutex<Vec<&'static str>>,
}

impl Subscriber for &'static Spans {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        self.opened.lock().unwrap().push(span.metadata().name());
        Id::from_u64(self.next.fetch_add(1, Ordering::Relaxed) + 1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, _: &Event<'_>) {}
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

struct Job {
    id: u64,
}

/// Recommended: `#[idempotent]` first, `#[tracing::instrument]` under it. It sees the
/// rewritten function, whose transaction parameter is now `store`.
#[idem::idempotent(key = "job.id", scope = "tracing.outer")]
#[tracing::instrument(skip(store), fields(job = job.id))]
async fn outer(tx: &mut Transaction<'_, Sqlite>, job: &Job) -> Result<u64, sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut **tx).await?;
    Ok(job.id)
}

/// The other order: the span is opened inside the body.
#[tracing::instrument(skip(tx), fields(job = job.id))]
#[idem::idempotent(key = "job.id", scope = "tracing.inner")]
async fn inner(tx: &mut Transaction<'_, Sqlite>, job: &Job) -> Result<u64, sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut **tx).await?;
    Ok(job.id)
}

#[tokio::test]
async fn instrument_under_idempotent_spans_every_call() {
    let spans: &'static Spans = Box::leak(Box::default());
    let _guard = tracing::subscriber::set_default(spans);
    let store = Store::new(SqlitePool::connect("sqlite::memory:").await.unwrap());
    store.migrate().await.unwrap();
    let job = Job { id: 1 };

    assert_eq!(outer(&store, &job).await.unwrap(), Outcome::Applied(1));
    assert_eq!(outer(&store, &job).await.unwrap(), Outcome::Duplicate);
    let opened = |name| {
        spans
            .opened
            .lock()
            .unwrap()
            .iter()
            .filter(|n| **n == name)
            .count()
    };
    assert_eq!(
        opened("outer"),
        2,
        "a span for the Applied and the Duplicate call"
    );

    assert_eq!(inner(&store, &job).await.unwrap(), Outcome::Applied(1));
    assert_eq!(inner(&store, &job).await.unwrap(), Outcome::Duplicate);
    assert_eq!(
        opened("inner"),
        1,
        "the body's span only: the Duplicate ran no body"
    );
}
