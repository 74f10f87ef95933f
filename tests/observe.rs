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
use idem::{Claimed, Error, Key, LeaseError, LeaseOptions, NotKept, Outcome, Store};
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

#[path = "observe/batch.rs"]
mod batch;
#[path = "observe/errors.rs"]
mod errors;
#[path = "observe/link.rs"]
mod link;
#[path = "observe/outcomes.rs"]
mod outcomes;
#[path = "observe/pg.rs"]
mod pg;
