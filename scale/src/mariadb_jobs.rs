//! The jobs delivered to MariaDB (the Galera cluster's nodes), one handler per mode, and the
//! effects counted back. As in [`jobs`](crate::jobs), every effect is a row of the test's own
//! effects table, which has no unique key on the job: a job that ran twice shows as two rows.
//! Its primary key is a counter of its own, as Galera wants of every replicated table.

use idem::Lease;
use sqlx::mysql::{MySqlConnection, MySqlDatabaseError};
use sqlx::{AssertSqlSafe, Connection as _, MySql, MySqlPool, Transaction};
use tokio::sync::Barrier;

use crate::jobs::{AppError, Hold, Job};

/// MariaDB's deadlock error, which Galera also answers when certification aborted a
/// transaction (`WSREP detected deadlock/conflict and aborted the transaction`).
pub const ER_LOCK_DEADLOCK: u16 = 1213;

/// The MySQL error number of an error, whether idem's or the body's own.
pub fn number(err: &AppError) -> Option<u16> {
    match err {
        AppError::Idem(e) => number_of(e),
        AppError::Db(e) => number_of_sqlx(e),
    }
}

/// The MySQL error number of an [`idem::Error::Database`].
pub fn number_of(err: &idem::Error) -> Option<u16> {
    match err {
        idem::Error::Database(e) => number_of_sqlx(e),
        _ => None,
    }
}

fn number_of_sqlx(err: &sqlx::Error) -> Option<u16> {
    err.as_database_error()
        .and_then(|e| e.try_downcast_ref::<MySqlDatabaseError>())
        .map(MySqlDatabaseError::number)
}

/// Whether `err` is a transaction aborted by a conflict (a deadlock, or Galera's
/// certification).
pub fn is_conflict(err: &AppError) -> bool {
    number(err) == Some(ER_LOCK_DEADLOCK)
}

/// Creates an effects table.
pub async fn create_effects(pool: &MySqlPool, effects: &str) {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {effects} (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
         `key` VARCHAR(64) NOT NULL, mode VARCHAR(16) NOT NULL) ENGINE = InnoDB"
    )))
    .execute(pool)
    .await
    .expect("create the effects table");
}

/// Drops the test's tables (the marker table and the ones named after it, the effects).
pub async fn drop_tables(pool: &MySqlPool, tables: &[&str]) {
    for table in tables {
        for suffix in ["", "_outbox", "_retention", "_steps", "_offsets"] {
            drop(
                sqlx::raw_sql(AssertSqlSafe(format!(
                    "DROP TABLE IF EXISTS {table}{suffix}"
                )))
                .execute(pool)
                .await,
            );
        }
    }
}

/// A connection to `url` whose reads wait until the node applied every write the cluster
/// committed before them (`wsrep_sync_wait = 1`): counts read through it see every node's
/// commits.
pub async fn synced(url: &str) -> MySqlConnection {
    let mut conn = MySqlConnection::connect(url)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}"));
    sqlx::raw_sql("SET SESSION wsrep_sync_wait = 1")
        .execute(&mut conn)
        .await
        .expect("wsrep_sync_wait");
    conn
}

/// `(distinct keys with an effect, keys with more than one effect)` in `effects`.
pub async fn counts(conn: &mut MySqlConnection, effects: &str) -> (i64, i64) {
    sqlx::query_as(AssertSqlSafe(format!(
        "SELECT (SELECT COUNT(DISTINCT `key`) FROM {effects}), \
         (SELECT COUNT(*) FROM (SELECT `key` FROM {effects} GROUP BY `key` \
         HAVING COUNT(*) > 1) d)"
    )))
    .fetch_one(conn)
    .await
    .expect("count the effects")
}

/// The keys with an effect in `effects`.
pub async fn keys(conn: &mut MySqlConnection, effects: &str) -> Vec<String> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT DISTINCT `key` FROM {effects}"
    )))
    .fetch_all(conn)
    .await
    .expect("read the effects")
}

/// The effect: one row.
pub async fn effect(conn: &mut MySqlConnection, job: &Job, mode: &str) -> Result<(), sqlx::Error> {
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {} (`key`, mode) VALUES (?, ?)",
        job.effects
    )))
    .bind(&job.key)
    .bind(mode)
    .execute(conn)
    .await?;
    Ok(())
}

/// Transaction mode.
#[idem::idempotent(key = "job.key", scope = "galera.transaction")]
pub async fn in_transaction(tx: &mut Transaction<'_, MySql>, job: &Job) -> Result<i64, AppError> {
    effect(tx, job, "transaction").await?;
    Ok(job.amount)
}

/// Transaction mode, the body parked after its effect until every delivery of its barrier's
/// party wrote its own: none of them has committed when they all commit.
#[idem::idempotent(key = "job.key", scope = "galera.together")]
pub async fn together(
    tx: &mut Transaction<'_, MySql>,
    job: &Job,
    barrier: &Barrier,
) -> Result<i64, AppError> {
    effect(tx, job, "together").await?;
    barrier.wait().await;
    Ok(job.amount)
}

/// Joined to a transaction the caller holds (`store.join(&mut tx)`).
#[idem::idempotent(key = "job.key", scope = "galera.joined")]
pub async fn joined(tx: &mut Transaction<'_, MySql>, job: &Job) -> Result<i64, AppError> {
    effect(tx, job, "joined").await?;
    Ok(job.amount)
}

/// Transaction mode with `replay`: a later delivery gets the first one's value back.
#[idem::idempotent(key = "job.key", scope = "galera.replay", replay)]
pub async fn replayed(tx: &mut Transaction<'_, MySql>, job: &Job) -> Result<i64, AppError> {
    effect(tx, job, "replay").await?;
    Ok(job.amount)
}

/// Lease mode: the effect is written outside the claim's transaction, as a call to another
/// system would be, through the same node.
#[idem::idempotent(key = "job.key", scope = "galera.lease", lease = "30s")]
pub async fn leased(lease: &Lease, job: &Job, pool: &MySqlPool) -> Result<i64, AppError> {
    let _ = lease;
    let mut conn = pool.acquire().await?;
    effect(&mut conn, job, "lease").await?;
    Ok(job.amount)
}

/// Lease mode, the first body parked on `hold` before its effect (holding the lease) until
/// the test lets it go; the others run at once.
#[idem::idempotent(key = "job.key", scope = "galera.lease_held", lease = "30s")]
pub async fn lease_held(
    lease: &Lease,
    job: &Job,
    pool: &MySqlPool,
    hold: &Hold,
) -> Result<i64, AppError> {
    let _ = lease;
    hold.park().await;
    let mut conn = pool.acquire().await?;
    effect(&mut conn, job, "lease_held").await?;
    Ok(job.amount)
}

/// A batch: one effect per fresh job, all in the batch's transaction.
#[idem::idempotent(key = "job.key", scope = "galera.batch", batch = "jobs")]
pub async fn batch(tx: &mut Transaction<'_, MySql>, jobs: &[Job]) -> Result<usize, AppError> {
    for job in jobs {
        effect(tx, job, "batch").await?;
    }
    Ok(jobs.len())
}

/// Group commit: concurrent calls through one node's group share its transaction.
#[idem::idempotent(key = "job.key", scope = "galera.group", group)]
pub async fn grouped(tx: &mut Transaction<'_, MySql>, job: &Job) -> Result<i64, AppError> {
    effect(tx, job, "group").await?;
    Ok(job.amount)
}

/// Transaction mode for the workers of the node-kill case.
#[idem::idempotent(key = "job.key", scope = "galera.kill")]
pub async fn worked(tx: &mut Transaction<'_, MySql>, job: &Job) -> Result<i64, AppError> {
    effect(tx, job, "kill").await?;
    Ok(job.amount)
}
