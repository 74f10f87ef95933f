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

/// The span's fields but `waited_ms`, which is checked apart (it is a measured time);
/// `retries` counts the claims retried after a lost race.
fn expect(scope: &str, key: &Key, mode: &str, outcome: &str, retries: u32) -> Fields {
    [
        ("scope", scope.to_owned()),
        ("key", key.as_str().to_owned()),
        ("mode", mode.to_owned()),
        ("outcome", outcome.to_owned()),
        ("retries", retries.to_string()),
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

/// The `decision` of every `trace` event idem sent inside span `id`.
fn decisions(seen: &capture::Seen, id: u64) -> Vec<String> {
    seen.idem_events(id)
        .into_iter()
        .filter(|e| e.level == Level::TRACE)
        .map(|e| e.fields["decision"].clone())
        .collect()
}

/// The one `idem call finished` event in span `id`: its level and its fields.
fn finished(seen: &capture::Seen, id: u64) -> (Level, Fields) {
    let events: Vec<_> = seen
        .idem_events(id)
        .into_iter()
        .filter(|e| e.fields.get("message").map(String::as_str) == Some("idem call finished"))
        .collect();
    let [event] = &events[..] else {
        panic!("one `idem call finished` event in span {id}: {events:?}")
    };
    let mut fields = event.fields.clone();
    fields.remove("message");
    (event.level, fields)
}

/// The fields of a call's end: its outcome, and the text of idem's error if one ended it.
fn ended(outcome: &str, error: Option<&str>) -> Fields {
    let mut fields = Fields::new();
    fields.insert("outcome".to_owned(), outcome.to_owned());
    if let Some(error) = error {
        fields.insert("error".to_owned(), error.to_owned());
    }
    fields
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
        assert_eq!(fields, expect(SCOPE, &key, "transaction", outcome, 0));
        assert_eq!(span.parent, None);
        assert_eq!(decisions(&seen, *id), [decision]);
        // The routine outcomes end at DEBUG: a healthy worker logs nothing per job at INFO.
        assert_eq!(finished(&seen, *id), (Level::DEBUG, ended(outcome, None)));
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
        expect(SCOPE, &job.key(), "transaction", "replayed", 0)
    );
    assert_eq!(decisions(&seen, id), ["replayed"]);
    assert_eq!(finished(&seen, id), (Level::DEBUG, ended("replayed", None)));
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
    assert_eq!(fields, expect(SCOPE, &job.key(), "transaction", "error", 0));
    assert_eq!(decisions(&seen, *id), ["fresh"]);
    // The body's own error is the caller's to log: idem says only how the call ended.
    assert_eq!(finished(&seen, *id), (Level::DEBUG, ended("error", None)));
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

    let [(id, span)] = &seen.claims()[..] else {
        panic!("one span")
    };
    let (fields, _) = split(span);
    assert_eq!(
        fields,
        expect(SCOPE, &job.key(), "transaction", "rolled_back", 0)
    );
    let text = "the transaction of \"obs.lite.rolled_back\" / \"10\" was rolled back by the \
                database although the body returned Ok: a statement in the body failed and its \
                error was ignored. Nothing was kept; let the job be redelivered, and return \
                database errors from the body with `?` instead of ignoring or retrying them";
    assert_eq!(err.to_string(), text);
    assert_eq!(
        finished(&seen, *id),
        (Level::WARN, ended("rolled_back", Some(text)))
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
    let held = held.finish(Ok::<(), Error>(())).await.unwrap();
    assert_eq!(held, Outcome::Applied(()));
    assert_eq!(count(&pool, "effects", 11).await, 0);

    let [(id, span)] = &seen.claims()[..] else {
        panic!("one span")
    };
    let (fields, waited) = split(span);
    assert_eq!(
        fields,
        expect(SCOPE, &job.key(), "transaction", "in_progress", 0)
    );
    // The busy timeout (`wait`) elapsed before SQLite gave up: the wait is in the field.
    assert!(waited >= 100, "waited_ms = {waited}");
    assert_eq!(decisions(&seen, *id), ["in_progress"]);
    // Another delivery holding the key is a nack, not a fault: INFO, with idem's text once.
    let text = "another delivery of \"obs.lite.in_progress\" / \"11\" is still in progress: \
                nothing ran; nack the job so that it is redelivered later (do not ack it: the \
                other delivery may still fail)";
    assert_eq!(err.to_string(), text);
    assert_eq!(
        finished(&seen, *id),
        (Level::INFO, ended("in_progress", Some(text)))
    );
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
    assert_eq!(fields, expect(SCOPE, &job.key(), "joined", "applied", 0));
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
        assert_eq!(fields, expect(SCOPE, &key, "lease", outcome, 0));
        assert_eq!(decisions(&seen, *id), [decision]);
    }
    // Nothing at WARN: a live lease is a nack, a released lease taken over is the recovery
    // working (INFO), and the rest are routine.
    let by_level = |id: u64, level: Level| -> Vec<Fields> {
        seen.idem_events(id)
            .into_iter()
            .filter(|e| e.level == level)
            .map(|e| e.fields)
            .collect()
    };
    for (id, _) in &claims {
        assert_eq!(by_level(*id, Level::WARN), Vec::<Fields>::new());
    }
    let in_progress = format!(
        "another delivery of \"{SCOPE}\" / \"13\" is still in progress: nothing ran; nack \
         the job so that it is redelivered later (do not ack it: the other delivery may still \
         fail)"
    );
    let mut ended_in_progress = ended("in_progress", Some(&in_progress));
    ended_in_progress.insert("message".into(), "idem call finished".into());
    assert_eq!(by_level(claims[0].0, Level::INFO), [ended_in_progress]);
    // The takeover's `attempt` is the lease's (`Lease::attempt`, the marker's `attempts`);
    // the span's `retries` is another count (claims retried after a lost race).
    let takeover: Fields = [
        (
            "message",
            "idem lease taken over from an earlier delivery whose lease expired or was released",
        ),
        ("token", "2"),
        ("attempt", "2"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    assert_eq!(by_level(claims[1].0, Level::INFO), [takeover]);
    assert_eq!(by_level(claims[2].0, Level::INFO), Vec::<Fields>::new());
    assert_eq!(
        finished(&seen, claims[1].0),
        (Level::DEBUG, ended("applied", None))
    );
    assert_eq!(
        finished(&seen, claims[2].0),
        (Level::DEBUG, ended("duplicate", None))
    );
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
    let text = "invalid idempotency key: the key is empty: every job needs a stable, non-empty \
                id (check that the key expression reads the job's id)";
    assert_eq!(err.to_string(), text);

    let [(id, span)] = &seen.claims()[..] else {
        panic!("one span")
    };
    let expected: Fields = [
        ("scope", "obs.lite.invalid_key"),
        ("mode", "transaction"),
        ("outcome", "invalid"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    // No key to show, and no claim: no attempts, no wait, no latency.
    assert_eq!(span.fields, expected);
    assert_eq!(
        finished(&seen, *id),
        (Level::WARN, ended("invalid", Some(text)))
    );
    assert_eq!(outcomes("obs.lite.invalid_key", "invalid"), 1);
    assert_eq!(outcomes("obs.lite.invalid_key", "error"), 0);
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

/// A batch is one span (mode `batch`, no single key, `applied` if any job was, its jobs
/// counted in `jobs`, `applied` and `duplicate`) and one
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
    for ((id, span), (outcome, decision, jobs, applied, duplicate)) in claims.iter().zip([
        ("applied", "fresh", "2", "2", "0"),
        ("applied", "fresh", "2", "1", "1"),
        ("duplicate", "duplicate", "3", "0", "3"),
    ]) {
        let (fields, _) = split(span);
        let want: Fields = [
            ("scope", SCOPE),
            ("mode", "batch"),
            ("outcome", outcome),
            ("retries", "0"),
            ("jobs", jobs),
            ("applied", applied),
            ("duplicate", duplicate),
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

/// A job with a payload, for the fingerprinted and lease-mode handlers below.
struct Payload {
    id: i64,
    body: String,
}

#[idem::idempotent(
    key = "job.id",
    scope = "obs.lite.key_reused",
    fingerprint = "job.body"
)]
async fn lite_fingerprinted(tx: &mut Transaction<'_, Sqlite>, job: &Payload) -> Result<(), Error> {
    sqlx::query("INSERT INTO effects (id) VALUES (?)")
        .bind(job.id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Never finishes: its timeout ends it.
#[idem::idempotent(
    key = "job.id",
    scope = "obs.lite.timeout",
    lease = "1s",
    timeout = "50ms"
)]
async fn lite_stalls(_lease: &idem::Lease, job: &Payload) -> Result<(), Error> {
    let _ = &job.body;
    std::future::pending().await
}

/// Forgets its own marker, as an operator might while it runs: its result is not recorded.
#[idem::idempotent(key = "job.id", scope = "obs.lite.lease_lost", lease = "30s")]
async fn lite_forgotten(
    lease: &idem::Lease,
    job: &Payload,
    store: &Store<Sqlite>,
) -> Result<(), Error> {
    let key = Key::new(&job.id)?;
    assert!(store.forget("obs.lite.lease_lost", &key).await?);
    assert_eq!(lease.key(), key.as_str());
    Ok(())
}

/// Returns a value too long to store for `replay`.
#[idem::idempotent(
    key = "job.id",
    scope = "obs.lite.value_not_stored",
    lease = "30s",
    replay
)]
async fn lite_too_long(_lease: &idem::Lease, job: &Payload) -> Result<String, Error> {
    Ok(job.body.repeat(idem::MAX_REPLAY_LEN + 1))
}

/// The span's `outcome`, the counter's label and the call's event for one failed call, which
/// must be the only call of `scope`: the label is the kind's own, the text is idem's, once, at
/// WARN.
fn one_failure(seen: &capture::Seen, scope: &str, mode: &str, key: &Key, label: &str, err: &Error) {
    let [(id, span)] = &seen.claims()[..] else {
        panic!("one span: {:?}", seen.claims())
    };
    let (fields, _) = split(span);
    assert_eq!(fields, expect(scope, key, mode, label, 0));
    let text = err.to_string();
    assert_eq!(
        finished(seen, *id),
        (Level::WARN, ended(label, Some(&text)))
    );
    let warnings = seen
        .idem_events(*id)
        .into_iter()
        .filter(|e| e.level == Level::WARN)
        .count();
    assert_eq!(warnings, 1, "the error's text is logged once");
    let by_label = metrics().counters_with(idem::OUTCOMES_TOTAL, ("scope", scope));
    assert_eq!(
        by_label.into_values().collect::<Vec<_>>(),
        [1],
        "one outcome of {scope}"
    );
    assert_eq!(outcomes(scope, label), 1);
}

#[tokio::test]
async fn key_reused_has_its_own_outcome() {
    const SCOPE: &str = "obs.lite.key_reused";
    metrics();
    let (store, pool) = lite().await;
    let job = Payload {
        id: 41,
        body: "first".into(),
    };
    assert_eq!(
        lite_fingerprinted(&store, &job).await.unwrap(),
        Outcome::Applied(())
    );
    let (seen, _guard) = subscribe();
    let other = Payload {
        id: 41,
        body: "second".into(),
    };

    let err = lite_fingerprinted(&store, &other).await.unwrap_err();
    assert!(matches!(err, Error::KeyReused { .. }), "{err}");
    assert_eq!(count(&pool, "effects", 41).await, 1);
    // The first call was counted before the subscriber: one `applied`, one `key_reused`.
    let [(id, span)] = &seen.claims()[..] else {
        panic!("one span")
    };
    let (fields, _) = split(span);
    assert_eq!(
        fields,
        expect(
            SCOPE,
            &Key::new(&41).unwrap(),
            "transaction",
            "key_reused",
            0
        )
    );
    let text = "the key \"41\" of \"obs.lite.key_reused\" was already used for another payload: \
                nothing ran; this is a different job under a reused id, so give it its own key \
                (do not retry it)";
    assert_eq!(err.to_string(), text);
    assert_eq!(
        finished(&seen, *id),
        (Level::WARN, ended("key_reused", Some(text)))
    );
    assert_eq!(outcomes(SCOPE, "key_reused"), 1);
    assert_eq!(outcomes(SCOPE, "applied"), 1);
    assert_eq!(outcomes(SCOPE, "error"), 0);
}

#[tokio::test]
async fn timeout_has_its_own_outcome() {
    const SCOPE: &str = "obs.lite.timeout";
    metrics();
    let (seen, _guard) = subscribe();
    let (store, _pool) = lite().await;
    let job = Payload {
        id: 42,
        body: String::new(),
    };

    let err = lite_stalls(&store, &job).await.unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    one_failure(
        &seen,
        SCOPE,
        "lease",
        &Key::new(&42).unwrap(),
        "timeout",
        &err,
    );
}

#[tokio::test]
async fn lease_lost_has_its_own_outcome() {
    const SCOPE: &str = "obs.lite.lease_lost";
    metrics();
    let (seen, _guard) = subscribe();
    let (store, _pool) = lite().await;
    let job = Payload {
        id: 43,
        body: String::new(),
    };

    let err = lite_forgotten(&store, &job, &store).await.unwrap_err();
    assert!(matches!(err, Error::LeaseLost { .. }), "{err}");
    one_failure(
        &seen,
        SCOPE,
        "lease",
        &Key::new(&43).unwrap(),
        "lease_lost",
        &err,
    );
}

#[tokio::test]
async fn value_not_stored_has_its_own_outcome() {
    const SCOPE: &str = "obs.lite.value_not_stored";
    metrics();
    let (seen, _guard) = subscribe();
    let (store, _pool) = lite().await;
    let job = Payload {
        id: 44,
        body: "x".into(),
    };

    let err = lite_too_long(&store, &job).await.unwrap_err();
    assert!(matches!(err, Error::ValueNotStored { .. }), "{err}");
    one_failure(
        &seen,
        SCOPE,
        "lease",
        &Key::new(&44).unwrap(),
        "value_not_stored",
        &err,
    );
    // The marker completed without a value: the next delivery is a plain duplicate.
    assert_eq!(
        lite_too_long(&store, &job).await.unwrap(),
        Outcome::Duplicate
    );
}
