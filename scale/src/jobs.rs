//! The jobs the tests deliver, one handler per mode, and the effects counted back from the
//! database. Every effect is a row of the test's own effects table, which has no unique key:
//! a job that ran twice shows as two rows.

use std::sync::atomic::{AtomicBool, Ordering};

use idem::{Lease, Outbox, Outcome};
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Postgres, Transaction};
use tokio::sync::Notify;

/// The handlers' error type: idem asks only for `From<idem::Error>`.
#[derive(Debug)]
pub enum AppError {
    Idem(idem::Error),
    Db(sqlx::Error),
}

impl From<idem::Error> for AppError {
    fn from(e: idem::Error) -> Self {
        AppError::Idem(e)
    }
}

impl From<sqlx::Error> for AppError {
    fn from(e: sqlx::Error) -> Self {
        AppError::Db(e)
    }
}

impl AppError {
    /// The idem error, or a panic naming what came instead.
    pub fn idem(self) -> idem::Error {
        match self {
            AppError::Idem(e) => e,
            AppError::Db(e) => panic!("expected an idem error, got the body's own: {e}"),
        }
    }
}

/// One job: its key, its amount, and the effects table its handlers write to.
#[derive(Clone, Debug)]
pub struct Job {
    pub key: String,
    pub amount: i64,
    pub effects: String,
}

/// `n` jobs `job-0` .. `job-{n-1}` writing to `effects`.
pub fn jobs(n: usize, effects: &str) -> Vec<Job> {
    (0..n)
        .map(|i| Job {
            key: format!("job-{i}"),
            amount: i as i64,
            effects: effects.to_owned(),
        })
        .collect()
}

/// A table name no other test uses.
pub fn unique(prefix: &str) -> String {
    use std::sync::atomic::AtomicU32;
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default();
    format!(
        "{prefix}_{}_{nanos}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Creates an effects table (no unique key: a second run of a job is a second row). A simple
/// query, one message: it works through a pooler in transaction mode outside a transaction.
pub async fn create_effects(pool: &PgPool, effects: &str) {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {effects} (key text NOT NULL, mode text NOT NULL)"
    )))
    .execute(pool)
    .await
    .expect("create the effects table");
}

/// Drops the test's tables (the marker table and the ones named after it, the effects).
pub async fn drop_tables(pool: &PgPool, tables: &[&str]) {
    for table in tables {
        for suffix in ["", "_outbox", "_retention", "_steps", "_offsets"] {
            drop(
                sqlx::query(AssertSqlSafe(format!(
                    "DROP TABLE IF EXISTS {table}{suffix}"
                )))
                .persistent(false)
                .execute(pool)
                .await,
            );
        }
    }
}

/// The effect: one row. Sent unnamed (`persistent(false)`), as a handler's own statements
/// must be behind a pooler in transaction mode that does not track prepared statements.
pub async fn effect(conn: &mut PgConnection, job: &Job, mode: &str) -> Result<(), sqlx::Error> {
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {} (key, mode) VALUES ($1, $2)",
        job.effects
    )))
    .bind(&job.key)
    .bind(mode)
    .persistent(false)
    .execute(conn)
    .await?;
    Ok(())
}

/// `(distinct keys with an effect, keys with more than one effect)` in `effects`.
pub async fn counts(pool: &PgPool, effects: &str) -> (i64, i64) {
    sqlx::query_as(AssertSqlSafe(format!(
        "SELECT (SELECT COUNT(DISTINCT key) FROM {effects}), \
         (SELECT COUNT(*) FROM (SELECT key FROM {effects} GROUP BY key HAVING COUNT(*) > 1) d)"
    )))
    .persistent(false)
    .fetch_one(pool)
    .await
    .expect("count the effects")
}

/// The number of rows in `table`.
pub async fn rows(pool: &PgPool, table: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!("SELECT COUNT(*) FROM {table}")))
        .persistent(false)
        .fetch_one(pool)
        .await
        .expect("count the rows")
}

/// Transaction mode.
#[idem::idempotent(key = "job.key", scope = "scale.transaction")]
pub async fn in_transaction(
    tx: &mut Transaction<'_, Postgres>,
    job: &Job,
) -> Result<i64, AppError> {
    effect(tx, job, "transaction").await?;
    Ok(job.amount)
}

/// Joined to a transaction the caller holds (`store.join(&mut tx)`).
#[idem::idempotent(key = "job.key", scope = "scale.joined")]
pub async fn joined(tx: &mut Transaction<'_, Postgres>, job: &Job) -> Result<i64, AppError> {
    effect(tx, job, "joined").await?;
    Ok(job.amount)
}

/// Transaction mode with `replay`: a later delivery gets the first one's value back.
#[idem::idempotent(key = "job.key", scope = "scale.replay", replay)]
pub async fn replayed(tx: &mut Transaction<'_, Postgres>, job: &Job) -> Result<i64, AppError> {
    effect(tx, job, "replay").await?;
    Ok(job.amount)
}

/// Lease mode: the effect is written outside the claim's transaction, as a call to another
/// system would be, in a transaction of its own: behind a pooler in transaction mode a
/// statement with binds outside a transaction may have its two steps (parse, bind) run on two
/// server connections.
#[idem::idempotent(key = "job.key", scope = "scale.lease", lease = "30s")]
pub async fn leased(lease: &Lease, job: &Job, pool: &PgPool) -> Result<i64, AppError> {
    let _ = lease;
    let mut tx = pool.begin().await?;
    effect(&mut tx, job, "lease").await?;
    tx.commit().await?;
    Ok(job.amount)
}

/// A batch: one effect per fresh job, all in the batch's transaction.
#[idem::idempotent(key = "job.key", scope = "scale.batch", batch = "jobs")]
pub async fn batch(tx: &mut Transaction<'_, Postgres>, jobs: &[Job]) -> Result<usize, AppError> {
    for job in jobs {
        effect(tx, job, "batch").await?;
    }
    Ok(jobs.len())
}

/// Transaction mode with `wait`: a claim that waits longer than 5 s for the key gives up.
#[idem::idempotent(key = "job.key", scope = "scale.wait", wait = "5s")]
pub async fn waiting(tx: &mut Transaction<'_, Postgres>, job: &Job) -> Result<i64, AppError> {
    effect(tx, job, "wait").await?;
    Ok(job.amount)
}

/// `waiting`'s scope with a short `wait`: it gives up on a key another delivery holds.
#[idem::idempotent(key = "job.key", scope = "scale.wait", wait = "100ms")]
pub async fn waiting_briefly(
    tx: &mut Transaction<'_, Postgres>,
    job: &Job,
) -> Result<i64, AppError> {
    effect(tx, job, "wait").await?;
    Ok(job.amount)
}

/// `waiting`'s scope, its body parked on `hold` (holding the key) until the test lets it go.
#[idem::idempotent(key = "job.key", scope = "scale.wait", wait = "5s")]
pub async fn waiting_held(
    tx: &mut Transaction<'_, Postgres>,
    job: &Job,
    hold: &Hold,
) -> Result<i64, AppError> {
    effect(tx, job, "wait").await?;
    hold.park().await;
    Ok(job.amount)
}

/// A body that ignores a failed statement and returns `Ok`: the verified commit must find
/// the transaction rolled back.
#[idem::idempotent(key = "job.key", scope = "scale.verified")]
pub async fn swallowing(tx: &mut Transaction<'_, Postgres>, job: &Job) -> Result<i64, AppError> {
    effect(tx, job, "verified").await?;
    let failed = sqlx::query("SELECT 1 / 0")
        .persistent(false)
        .execute(&mut **tx)
        .await;
    assert!(failed.is_err(), "division by zero must fail");
    Ok(job.amount)
}

/// Transaction mode with an outbox message per job.
#[idem::idempotent(key = "job.key", scope = "scale.outbox")]
pub async fn sending(
    tx: &mut Transaction<'_, Postgres>,
    outbox: &mut Outbox,
    job: &Job,
) -> Result<i64, AppError> {
    effect(tx, job, "outbox").await?;
    outbox.send_bytes("scale.sent", job.key.clone().into_bytes())?;
    Ok(job.amount)
}

/// Parks the first body that enters until the test releases it.
#[derive(Default)]
pub struct Hold {
    taken: AtomicBool,
    entered: Notify,
    release: Notify,
}

impl Hold {
    /// In a body: the first caller signals [`entered`](Hold::entered) and waits for
    /// [`release`](Hold::release).
    pub async fn park(&self) {
        if !self.taken.swap(true, Ordering::SeqCst) {
            self.entered.notify_one();
            self.release.notified().await;
        }
    }

    /// Resolves once a body is parked.
    pub async fn entered(&self) {
        self.entered.notified().await;
    }

    /// Lets the parked body go on.
    pub fn release(&self) {
        self.release.notify_one();
    }
}

/// Whether an outcome is the job's first run.
pub fn is_applied<T>(outcome: &Result<Outcome<T>, AppError>) -> bool {
    matches!(outcome, Ok(Outcome::Applied(_)))
}
