//! `#[tracing::instrument]` next to `#[idempotent]`: written below it (the recommended order),
//! it instruments the whole call, claim included, so that a `Duplicate` has its span too, and
//! idem's own `idem.claim` span is its child; written above it, it instruments only the body,
//! which a duplicate never runs, inside the `idem.claim` span.

use std::sync::Mutex;

use idem::{Outcome, Store};
use sqlx::{Sqlite, SqlitePool, Transaction};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// Records the name of every span opened, and the name of its parent (the span entered when
/// it was opened; the tests run on one thread).
#[derive(Default)]
struct Spans {
    opened: Mutex<Vec<(&'static str, Option<&'static str>)>>,
    entered: Mutex<Vec<&'static str>>,
}

impl Subscriber for &'static Spans {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let parent = self.entered.lock().unwrap().last().copied();
        let mut opened = self.opened.lock().unwrap();
        opened.push((span.metadata().name(), parent));
        // The id is the span's index in `opened`, plus one.
        Id::from_u64(opened.len() as u64)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, _: &Event<'_>) {}
    fn enter(&self, id: &Id) {
        let name = self.opened.lock().unwrap()[id.into_u64() as usize - 1].0;
        self.entered.lock().unwrap().push(name);
    }
    fn exit(&self, _: &Id) {
        self.entered.lock().unwrap().pop();
    }
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
    // Each span opened under `name`, with its parent's name.
    let opened = |name| {
        spans
            .opened
            .lock()
            .unwrap()
            .iter()
            .filter(|(n, _)| *n == name)
            .map(|(_, parent)| *parent)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        opened("outer"),
        [None, None],
        "a span for the Applied and the Duplicate call"
    );
    assert_eq!(
        opened("idem.claim"),
        [Some("outer"), Some("outer")],
        "idem's span inside the user's, for both calls"
    );

    assert_eq!(inner(&store, &job).await.unwrap(), Outcome::Applied(1));
    assert_eq!(inner(&store, &job).await.unwrap(), Outcome::Duplicate);
    assert_eq!(
        opened("inner"),
        [Some("idem.claim")],
        "the body's span only, inside idem's: the Duplicate ran no body"
    );
    assert_eq!(
        opened("idem.claim"),
        [Some("outer"), Some("outer"), None, None],
        "idem's span around every call, the Duplicate's too"
    );
}
