//! The `idem.claim` span, its events and the metrics of every generated call, per outcome:
//! SQLite for the outcomes one database shows, PostgreSQL for the lost race and the lock wait.
//! A hand-written subscriber and recorder (`observe/capture.rs`) keep what they are given;
//! every test names its own scope, since the recorder is the process's.

#[path = "observe/capture.rs"]
mod capture;

use std::str::FromStr as _;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use capture::{Fields, SpanRec, metrics, subscribe};
use idem::{Error, Key, LeaseOptions, Leased, Outcome, Store};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
use sqlx::{AssertSqlSafe, PgPool, Postgres, Sqlite, Transaction};
use tracing::Level;

struct Job {
    id: i64,
    /// The table the effect goes into.
    table: String,
    fail: bool,
}

impl Job {
    fn new(id: i64, table: &str) -> Self {
        Job {
            id,
            table: table.to_owned(),
            fail: false,
        }
    }

    fn key(&self) -> Key {
        Key::new(&self.id).unwrap()
    }
}

fn failed() -> sqlx::Error {
    sqlx::Error::Protocol("the body failed".into())
}

fn unique(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}_{}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

async fn lite() -> (Store<Sqlite>, SqlitePool) {
    let file = std::env::temp_dir().join(format!("{}.db", unique("idem_observe")));
    let opts = SqliteConnectOptions::from_str(&format!("sqlite://{}", file.display()))
        .unwrap()
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(30));
    let pool = SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(opts)
        .await
        .unwrap();
    let store = Store::new(pool.clone());
    store.migrate().await.unwrap();
    for ddl in [
        "CREATE TABLE effects (id INTEGER NOT NULL)",
        "CREATE TABLE taken (id INTEGER PRIMARY KEY)",
        "INSERT INTO taken (id) VALUES (1)",
    ] {
        sqlx::query(ddl).execute(&pool).await.unwrap();
    }
    (store, pool)
}

async fn count(pool: &SqlitePool, table: &str, id: i64) -> i64 {
    let sql = format!("SELECT COUNT(*) FROM {table} WHERE id = ?");
    sqlx::query_scalar(AssertSqlSafe(sql))
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn lite_effect(tx: &mut Transaction<'_, Sqlite>, job: &Job) -> Result<i64, sqlx::Error> {
    let sql = format!("INSERT INTO {} (id) VALUES (?)", job.table);
    sqlx::query(AssertSqlSafe(sql))
        .bind(job.id)
        .execute(&mut **tx)
        .await?;
    if job.fail {
        return Err(failed());
    }
    Ok(job.id)
}

#[idem::idempotent(key = "job.id", scope = "obs.lite.applied")]
async fn lite_applied(tx: &mut Transaction<'_, Sqlite>, job: &Job) -> Result<i64, sqlx::Error> {
    lite_effect(tx, job).await
}

#[idem::idempotent(key = "job.id", scope = "obs.lite.replayed", replay)]
async fn lite_replayed(tx: &mut Transaction<'_, Sqlite>, job: &Job) -> Result<i64, sqlx::Error> {
    lite_effect(tx, job).await
}

#[idem::idempotent(key = "job.id", scope = "obs.lite.error")]
async fn lite_error(tx: &mut Transaction<'_, Sqlite>, job: &Job) -> Result<i64, sqlx::Error> {
    lite_effect(tx, job).await
}

/// Swallows the error of an `INSERT OR ROLLBACK`, which ended the transaction.
#[idem::idempotent(key = "job.id", scope = "obs.lite.rolled_back")]
async fn lite_rolled_back(tx: &mut Transaction<'_, Sqlite>, job: &Job) -> Result<i64, Error> {
    let id = lite_effect(tx, job).await?;
    let conflict = sqlx::query("INSERT OR ROLLBACK INTO taken (id) VALUES (1)")
        .execute(&mut **tx)
        .await;
    assert!(conflict.is_err(), "id 1 is taken");
    Ok(id)
}

#[idem::idempotent(key = "job.id", scope = "obs.lite.in_progress", wait = "100ms")]
async fn lite_waiting(tx: &mut Transaction<'_, Sqlite>, job: &Job) -> Result<i64, Error> {
    Ok(lite_effect(tx, job).await?)
}

#[idem::idempotent(key = "job.id", scope = "obs.lite.joined")]
async fn lite_joined(tx: &mut Transaction<'_, Sqlite>, job: &Job) -> Result<i64, sqlx::Error> {
    lite_effect(tx, job).await
}

#[idem::idempotent(key = "job.id", scope = "obs.lite.lease", lease = "30s")]
async fn lite_lease(lease: &idem::Lease, job: &Job, pool: &SqlitePool) -> Result<i64, Error> {
    assert_eq!(lease.key(), job.key().as_str());
    let sql = format!("INSERT INTO {} (id) VALUES (?)", job.table);
    sqlx::query(AssertSqlSafe(sql))
        .bind(job.id)
        .execute(pool)
        .await?;
    Ok(job.id)
}

/// The span's fields but `waited_ms`, which is checked apart (it is a measured time).
fn expect(scope: &str, key: &Key, mode: &str, outcome: &str, attempts: u32) -> Fields {
    [
        ("scope", scope.to_owned()),
        ("key", key.as_str().to_owned()),
        ("mode", mode.to_owned()),
        ("outcome", outcome.to_owned()),
        ("attempts", attempts.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

/// The span's fields without `waited_ms`, and `waited_ms` as a number.
fn split(span: &SpanRec) -> (Fields, u64) {
    let mut fields = span.fields.clone();
    let waited = fields
        .remove("waited_ms")
        .unwrap_or_else(|| panic!("no waited_ms in {span:?}"));
    (fields, waited.parse().expect("waited_ms is a number"))
}

/// The `decision` of every `debug` event idem sent inside span `id`.
fn decisions(seen: &capture::Seen, id: u64) -> Vec<String> {
    seen.idem_events(id)
        .into_iter()
        .filter(|e| e.level == Level::DEBUG)
        .map(|e| e.fields["decision"].clone())
        .collect()
}

fn outcomes(scope: &str, outcome: &str) -> u64 {
    let labels = [("scope", scope), ("outcome", outcome)];
    metrics().counter(idem::OUTCOMES_TOTAL, &labels)
}

fn claim_samples(scope: &str) -> Vec<f64> {
    metrics().samples(idem::CLAIM_SECONDS, &[("scope", scope)])
}

#[tokio::test]
async fn applied_then_duplicate() {
    const SCOPE: &str = "obs.lite.applied";
    metrics();
    let (seen, _guard) = subscribe();
    let (store, pool) = lite().await;
    let job = Job::new(7, "effects");

    assert_eq!(
        lite_applied(&store, &job).await.unwrap(),
        Outcome::Applied(7)
    );
    assert_eq!(
        lite_applied(&store, &job).await.unwrap(),
        Outcome::Duplicate
    );
    assert_eq!(count(&pool, "effects", 7).await, 1);

    let claims = seen.claims();
    assert_eq!(claims.len(), 2, "one span per call, the duplicate's too");
    let key = job.key();
    for ((id, span), (outcome, decision)) in claims
        .iter()
        .zip([("applied", "fresh"), ("duplicate", "duplicate")])
    {
        let (fields, _) = split(span);
        assert_eq!(fields, expect(SCOPE, &key, "transaction", outcome, 1));
        assert_eq!(span.parent, None);
        assert_eq!(decisions(&seen, *id), [decision]);
    }
    assert_eq!(outcomes(SCOPE, "applied"), 1);
    assert_eq!(outcomes(SCOPE, "duplicate"), 1);
    let by_label = metrics().counters_with(idem::OUTCOMES_TOTAL, ("scope", SCOPE));
    assert_eq!(
        by_label.len(),
        2,
        "no other outcome of {SCOPE}: {by_label:?}"
    );
    assert_eq!(claim_samples(SCOPE).len(), 2, "a claim latency per call");
}

#[idem::idempotent(key = "job.id", scope = "obs.lite.unobserved")]
async fn lite_unobserved(tx: &mut Transaction<'_, Sqlite>, job: &Job) -> Result<i64, sqlx::Error> {
    lite_effect(tx, job).await
}

/// Metrics do not depend on a subscriber: with none, the span is disabled and the counts go on.
#[tokio::test]
async fn metrics_without_a_subscriber() {
    const SCOPE: &str = "obs.lite.unobserved";
    metrics();
    let (store, pool) = lite().await;
    let job = Job::new(14, "effects");
    assert!(tracing::Span::current().is_disabled());

    assert_eq!(
        lite_unobserved(&store, &job).await.unwrap(),
        Outcome::Applied(14)
    );
    assert_eq!(
        lite_unobserved(&store, &job).await.unwrap(),
        Outcome::Duplicate
    );
    assert_eq!(count(&pool, "effects", 14).await, 1);
    assert_eq!(outcomes(SCOPE, "applied"), 1);
    assert_eq!(outcomes(SCOPE, "duplicate"), 1);
    assert_eq!(claim_samples(SCOPE).len(), 2);
}

#[tokio::test]
async fn replayed() {
    const SCOPE: &str = "obs.lite.replayed";
    metrics();
    let (seen, _guard) = subscribe();
    let (store, pool) = lite().await;
    let job = Job::new(8, "effects");

    assert_eq!(
        lite_replayed(&store, &job).await.unwrap(),
        Outcome::Applied(8)
    );
    assert_eq!(
        lite_replayed(&store, &job).await.unwrap(),
        Outcome::Replayed(8)
    );
    assert_eq!(count(&pool, "effects", 8).await, 1);

    let (id, span) = seen.claims().pop().unwrap();
    let (fields, _) = split(&span);
    assert_eq!(
        fields,
        expect(SCOPE, &job.key(), "transaction", "replayed", 1)
    );
    assert_eq!(decisions(&seen, id), ["replayed"]);
    assert_eq!(outcomes(SCOPE, "applied"), 1);
    assert_eq!(outcomes(SCOPE, "replayed"), 1);
}

#[tokio::test]
async fn body_error() {
    const SCOPE: &str = "obs.lite.error";
    metrics();
    let (seen, _guard) = subscribe();
    let (store, pool) = lite().await;
    let mut job = Job::new(9, "effects");
    job.fail = true;

    let err = lite_error(&store, &job).await.unwrap_err();
    assert!(matches!(err, sqlx::Error::Protocol(_)), "{err}");
    assert_eq!(count(&pool, "effects", 9).await, 0, "rolled back");

    let [(id, span)] = &seen.claims()[..] else {
        panic!("one span")
    };
    let (fields, _) = split(span);
    assert_eq!(fields, expect(SCOPE, &job.key(), "transaction", "error", 1));
    assert_eq!(decisions(&seen, *id), ["fresh"]);
    assert_eq!(outcomes(SCOPE, "error"), 1);
    assert_eq!(claim_samples(SCOPE).len(), 1);
}

#[tokio::test]
async fn swallowed_rollback_is_rolled_back() {
    const SCOPE: &str = "obs.lite.rolled_back";
    metrics();
    let (seen, _guard) = subscribe();
    let (store, pool) = lite().await;
    let job = Job::new(10, "effects");

    let err = lite_rolled_back(&store, &job).await.unwrap_err();
    assert!(matches!(err, Error::RolledBack { .. }), "{err}");

    let [(_, span)] = &seen.claims()[..] else {
        panic!("one span")
    };
    let (fields, _) = split(span);
    assert_eq!(
        fields,
        expect(SCOPE, &job.key(), "transaction", "rolled_back", 1)
    );
    assert_eq!(outcomes(SCOPE, "rolled_back"), 1);
    assert_eq!(outcomes(SCOPE, "applied"), 0);
    // The effect went with the rollback, marker and all.
    assert_eq!(count(&pool, "effects", 10).await, 0);
}

#[tokio::test]
async fn in_progress_behind_a_held_claim() {
    const SCOPE: &str = "obs.lite.in_progress";
    metrics();
    let (seen, _guard) = subscribe();
    let (store, pool) = lite().await;
    let job = Job::new(11, "effects");
    // SQLite's one writer: a hand-held claim keeps the write lock until it ends.
    let held = match store.claim(SCOPE, &job.key()).await.unwrap() {
        idem::Claim::Fresh(guard) => guard,
        other => panic!("{other:?}"),
    };

    let err = lite_waiting(&store, &job).await.unwrap_err();
    assert!(matches!(err, Error::InProgress { .. }), "{err}");
    let finished = held.finish(Ok::<(), Error>(())).await.unwrap();
    assert_eq!(finished, Outcome::Applied(()));
    assert_eq!(count(&pool, "effects", 11).await, 0);

    let [(id, span)] = &seen.claims()[..] else {
        panic!("one span")
    };
    let (fields, waited) = split(span);
    assert_eq!(
        fields,
        expect(SCOPE, &job.key(), "transaction", "in_progress", 1)
    );
    // The busy timeout (`wait`) elapsed before SQLite gave up: the wait is in the field.
    assert!(waited >= 100, "waited_ms = {waited}");
    assert_eq!(decisions(&seen, *id), ["in_progress"]);
    assert_eq!(outcomes(SCOPE, "in_progress"), 1);
    let samples = claim_samples(SCOPE);
    assert!(samples.len() == 1 && samples[0] >= 0.1, "{samples:?}");
}

#[tokio::test]
async fn joined_call() {
    const SCOPE: &str = "obs.lite.joined";
    metrics();
    let (seen, _guard) = subscribe();
    let (store, pool) = lite().await;
    let job = Job::new(12, "effects");

    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    let outcome = lite_joined(store.join(&mut tx), &job).await.unwrap();
    assert_eq!(outcome, Outcome::Applied(12));
    tx.commit().await.unwrap();
    assert_eq!(count(&pool, "effects", 12).await, 1);

    let [(id, span)] = &seen.claims()[..] else {
        panic!("one span")
    };
    let (fields, _) = split(span);
    assert_eq!(fields, expect(SCOPE, &job.key(), "joined", "applied", 1));
    assert_eq!(decisions(&seen, *id), ["fresh"]);
    assert_eq!(outcomes(SCOPE, "applied"), 1);
}

#[tokio::test]
async fn lease_in_progress_then_takeover() {
    const SCOPE: &str = "obs.lite.lease";
    metrics();
    let (seen, _guard) = subscribe();
    let (store, pool) = lite().await;
    let job = Job::new(13, "effects");
    let options = LeaseOptions::new(Duration::from_secs(30));
    let Leased::Fresh(held) = store.lease(SCOPE, &job.key(), options).await.unwrap() else {
        panic!("a fresh lease")
    };

    // A live lease: in progress at once.
    let err = lite_lease(&store, &job, &pool).await.unwrap_err();
    assert!(matches!(err, Error::InProgress { .. }), "{err}");
    // The holder fails: its lease is released, and the next delivery takes the key over.
    let failed = held.finish(Err::<(), sqlx::Error>(failed())).await;
    assert!(failed.is_err());
    assert_eq!(
        lite_lease(&store, &job, &pool).await.unwrap(),
        Outcome::Applied(13)
    );
    assert_eq!(
        lite_lease(&store, &job, &pool).await.unwrap(),
        Outcome::Duplicate
    );
    assert_eq!(count(&pool, "effects", 13).await, 1);

    let claims = seen.claims();
    assert_eq!(claims.len(), 3);
    let key = job.key();
    let expected = [
        ("in_progress", "in_progress"),
        ("applied", "takeover"),
        ("duplicate", "duplicate"),
    ];
    for ((id, span), (outcome, decision)) in claims.iter().zip(expected) {
        let (fields, _) = split(span);
        assert_eq!(fields, expect(SCOPE, &key, "lease", outcome, 1));
        assert_eq!(decisions(&seen, *id), [decision]);
    }
    let warns: Vec<_> = claims
        .iter()
        .map(|(id, _)| {
            let events = seen.idem_events(*id);
            let warns: Vec<_> = events
                .into_iter()
                .filter(|e| e.level == Level::WARN)
                .collect();
            warns
        })
        .collect();
    assert_eq!(warns[0].len(), 0);
    assert_eq!(warns[2].len(), 0);
    let [takeover] = &warns[1][..] else {
        panic!("one warning for the takeover: {:?}", warns[1])
    };
    assert_eq!(takeover.fields["token"], "2");
    assert_eq!(takeover.fields["attempt"], "2");
    assert_eq!(outcomes(SCOPE, "in_progress"), 1);
    assert_eq!(outcomes(SCOPE, "applied"), 1);
    assert_eq!(outcomes(SCOPE, "duplicate"), 1);
    assert_eq!(claim_samples(SCOPE).len(), 3);
}

#[tokio::test]
async fn invalid_key_is_an_error_without_a_claim() {
    metrics();
    let (seen, _guard) = subscribe();
    let (store, _pool) = lite().await;
    let err = lite_by_name(&store, "").await.unwrap_err();
    assert!(err.to_string().contains("key"), "{err}");

    let [(_, span)] = &seen.claims()[..] else {
        panic!("one span")
    };
    let expected: Fields = [
        ("scope", "obs.lite.invalid_key"),
        ("mode", "transaction"),
        ("outcome", "error"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    // No key to show, and no claim: no attempts, no wait, no latency.
    assert_eq!(span.fields, expected);
    assert_eq!(outcomes("obs.lite.invalid_key", "error"), 1);
    assert!(claim_samples("obs.lite.invalid_key").is_empty());
}

#[test]
fn metrics_are_described_with_their_units() {
    metrics();
    idem::describe_metrics();
    let described = metrics().described();
    assert_eq!(
        described.get(idem::OUTCOMES_TOTAL),
        Some(&("counter", Some(metrics::Unit::Count)))
    );
    assert_eq!(
        described.get(idem::CLAIM_SECONDS),
        Some(&("histogram", Some(metrics::Unit::Seconds)))
    );
    assert_eq!(idem::OUTCOMES_TOTAL, "idem_outcomes_total");
    assert_eq!(idem::CLAIM_SECONDS, "idem_claim_seconds");
}

#[idem::idempotent(key = "name", scope = "obs.lite.invalid_key")]
async fn lite_by_name(tx: &mut Transaction<'_, Sqlite>, name: &str) -> Result<(), Error> {
    sqlx::query("SELECT 1").execute(&mut **tx).await?;
    Ok(())
}

#[path = "observe/pg.rs"]
mod pg;

#[derive(Clone)]
struct Item {
    id: i64,
}

#[idem::idempotent(key = "item.id", scope = "obs.lite.batch", batch = "items")]
async fn lite_batch(
    tx: &mut Transaction<'_, Sqlite>,
    items: &[Item],
) -> Result<usize, sqlx::Error> {
    for item in items {
        sqlx::query("INSERT INTO effects (id) VALUES (?)")
            .bind(item.id)
            .execute(&mut **tx)
            .await?;
    }
    Ok(items.len())
}

/// A batch is one span (mode `batch`, no single key, `applied` if any job was) and one
/// claim latency, but the counter counts every job's outcome.
#[tokio::test]
async fn batch_is_one_span_and_counts_each_job() {
    const SCOPE: &str = "obs.lite.batch";
    metrics();
    let (seen, _guard) = subscribe();
    let (store, pool) = lite().await;
    let first = [Item { id: 31 }, Item { id: 32 }];
    let done = lite_batch(&store, &first).await.unwrap();
    assert_eq!(done.applied(), 2);
    // 32 again and 33: one duplicate, one fresh; then all three again: all duplicates.
    let next = [Item { id: 32 }, Item { id: 33 }];
    assert_eq!(lite_batch(&store, &next).await.unwrap().applied(), 1);
    let again = [Item { id: 31 }, Item { id: 32 }, Item { id: 33 }];
    assert_eq!(lite_batch(&store, &again).await.unwrap().applied(), 0);
    for id in [31, 32, 33] {
        assert_eq!(count(&pool, "effects", id).await, 1, "effect of item {id}");
    }

    let claims = seen.claims();
    assert_eq!(claims.len(), 3, "one span per batch");
    for ((id, span), (outcome, decision)) in claims.iter().zip([
        ("applied", "fresh"),
        ("applied", "fresh"),
        ("duplicate", "duplicate"),
    ]) {
        let (fields, _) = split(span);
        let want: Fields = [
            ("scope", SCOPE),
            ("mode", "batch"),
            ("outcome", outcome),
            ("attempts", "1"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        assert_eq!(fields, want);
        assert_eq!(decisions(&seen, *id), [decision]);
    }
    assert_eq!(outcomes(SCOPE, "applied"), 3);
    assert_eq!(outcomes(SCOPE, "duplicate"), 4);
    assert_eq!(claim_samples(SCOPE).len(), 3, "a claim latency per batch");
}
