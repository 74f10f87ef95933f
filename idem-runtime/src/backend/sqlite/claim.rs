//! Claims in a transaction on SQLite: `BEGIN IMMEDIATE` (with `wait`, under a busy timeout
//! of its own, put back before anything else runs), `INSERT ... ON CONFLICT DO NOTHING` then
//! a read of the marker it met, and the commit, which SQLite answers with an error when a
//! statement had already rolled the transaction back.

use sqlx::{AssertSqlSafe, Pool, SqlSafeStr as _, Sqlite, Transaction};
use sqlx_core::transaction::TransactionManager as _;

use super::{Armed, BEGIN, LEASE_OVER, NOW, acquire, begin, busy_timeout};
use crate::backend::bind::statements;
use crate::backend::claim::{ClaimText, Words};
use crate::backend::{Claimant, Found, Savepoint, Sql};
use crate::options::ClaimOptions;

/// The claim statements every backend runs. A batch's keys travel as one JSON array, so
/// SQLite's bind limit does not apply; writers are serialised, so their order cannot deadlock
/// here.
pub(super) fn text() -> ClaimText {
    ClaimText {
        // `WHERE true`: without it SQLite would read `ON CONFLICT` as a join constraint of the
        // `SELECT`.
        claim_batch: Some(
            format!(
                "INSERT INTO {{t}} (scope, key, token, completed_at) \
                 SELECT :scope, value, :nonce, {NOW} FROM json_each(:keys) WHERE true \
                 ON CONFLICT DO NOTHING RETURNING key"
            )
            .into(),
        ),
        ..ClaimText::of(Words {
            key: "key",
            now: NOW,
            lease_over: LEASE_OVER,
            lease_over_int: LEASE_OVER,
            result: "result",
            json: ":json",
            same_payload: "(fingerprint IS NULL OR :fingerprint IS NULL \
                           OR fingerprint = :fingerprint)",
            batch: Some("scope = :scope AND key IN (SELECT value FROM json_each(:keys))"),
        })
    }
}

statements! {
    /// The claim: an insert, whose answer says whether it met a marker.
    pub(super) struct Statements {
        claim(scope: &str, key: &str, fingerprint: Option<&[u8]>, nonce: i64) = format!(
            "INSERT INTO {{t}} (scope, key, fingerprint, token, completed_at) \
             VALUES (:scope, :key, :fingerprint, :nonce, {NOW}) ON CONFLICT DO NOTHING"
        );
    }
}

/// `Backend::claim_or_read`: the insert, then, if it met a marker, a read of it.
pub(super) async fn claim_or_read(
    conn: &mut sqlx::SqliteConnection,
    sql: &Sql<Sqlite>,
    c: Claimant<'_>,
) -> Result<(bool, Option<Found>), sqlx::Error> {
    let claim = sql.own.claim.claim(c.scope, c.key, c.fingerprint, c.nonce);
    if claim.execute(&mut *conn).await? == 1 {
        return Ok((true, None));
    }
    Ok((false, sql.marker(conn, c.scope, c.key).await?))
}

/// `Backend::begin`.
pub(super) async fn begin_bounded(
    pool: &Pool<Sqlite>,
    options: &ClaimOptions,
) -> Result<Transaction<'static, Sqlite>, sqlx::Error> {
    // SQLite's transactions are always serializable, so `isolation` changes nothing. The
    // only lock a claim waits for is the database's write lock, for the connection's busy
    // timeout: `wait` sets that for the `BEGIN` and puts the connection's own back, on
    // every path, before anything else runs on it.
    let Some(wait) = options.wait else {
        return begin(pool).await;
    };
    let mut conn = Armed::new(acquire(pool).await?);
    let own = busy_timeout(conn.get()).await?;
    let bounded = format!(
        "PRAGMA busy_timeout = {}; {BEGIN}",
        crate::backend::millis(wait)
    );
    let restore = format!("PRAGMA busy_timeout = {own}");
    if let Err(e) = sqlx::raw_sql(AssertSqlSafe(bounded))
        .execute(conn.get())
        .await
    {
        sqlx::raw_sql(AssertSqlSafe(restore))
            .execute(conn.get())
            .await?;
        conn.disarm();
        return Err(e);
    }
    // The transaction is open: sqlx's begin (which keeps its count of open transactions)
    // runs only the restore and a savepoint, neither of which waits. `COMMIT` and
    // `ROLLBACK` end the savepoint with the transaction. From the first poll of sqlx's
    // begin on, a dropped future leaves its rollback to sqlx's worker.
    let rest = format!("{restore}; SAVEPOINT idem_claim");
    let conn = conn.disarm();
    Transaction::begin(conn, Some(AssertSqlSafe(rest).into_sql_str())).await
}

/// `Backend::commit`.
pub(super) async fn commit(mut tx: Transaction<'_, Sqlite>) -> Result<bool, sqlx::Error> {
    // A statement that rolled the whole transaction back (`INSERT OR ROLLBACK`, a full
    // disk) leaves nothing to commit, and SQLite says so. sqlx's `commit` is called on the
    // connection rather than on `tx`, which it would consume: on that error sqlx still
    // counts the transaction as open, and a `BEGIN` then gives the `ROLLBACK` that
    // dropping `tx` sends something to end, leaving sqlx's count right. On success the
    // count is zero and that `ROLLBACK` is a no-op of sqlx's worker that reaches no
    // statement.
    match <Sqlite as sqlx::Database>::TransactionManager::commit(&mut tx).await {
        Ok(()) => Ok(true),
        Err(e) if e.to_string().contains("no transaction is active") => {
            resync(&mut tx).await?;
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

/// `Backend::savepoint`.
pub(super) async fn savepoint(
    conn: &mut sqlx::SqliteConnection,
    step: Savepoint,
) -> Result<(), sqlx::Error> {
    // One writer at a time: the transaction holds the write lock, so a claim in it never
    // waits, and `wait` has nothing to bound.
    let Err(e) = sqlx::raw_sql(step.ansi()).execute(&mut *conn).await else {
        return Ok(());
    };
    // A savepoint is gone only with its transaction (a job's `INSERT OR ROLLBACK`): the
    // batch fails, and whoever ends it (a rollback, or sqlx when the guard is dropped)
    // must find a transaction to end, or the connection goes back to the pool counted
    // as in one, and its next `BEGIN IMMEDIATE` fails.
    if e.to_string().contains("no such savepoint") {
        resync(conn).await?;
    }
    Err(e)
}

/// Rolls `tx` back, also when SQLite already ended it (a statement that rolled the whole
/// transaction back, as in `commit`). sqlx's own rollback fails then and keeps counting the
/// transaction as open, so the connection would go back to the pool with a count that makes
/// its next user's `BEGIN IMMEDIATE` fail (`InvalidSavePointStatement`). As in `commit`, a
/// `BEGIN` gives sqlx's rollback something to end, which sets its count right.
pub(super) async fn end(mut tx: Transaction<'_, Sqlite>) -> Result<(), sqlx::Error> {
    match <Sqlite as sqlx::Database>::TransactionManager::rollback(&mut tx).await {
        Ok(()) => Ok(()),
        Err(e) if e.to_string().contains("no transaction is active") => {
            resync(&mut tx).await?;
            <Sqlite as sqlx::Database>::TransactionManager::rollback(&mut tx).await
        }
        Err(e) => Err(e),
    }
}

/// Opens a transaction again where SQLite ended the one sqlx still counts as open, so that
/// sqlx's rollback (its own when `tx` is dropped, or ours) ends a real one and its count
/// comes back to zero. A `BEGIN` refused because a transaction is open means nothing was
/// out of step.
async fn resync(conn: &mut sqlx::SqliteConnection) -> Result<(), sqlx::Error> {
    match sqlx::raw_sql("BEGIN").execute(conn).await {
        Ok(_) => Ok(()),
        Err(e) if e.to_string().contains("within a transaction") => Ok(()),
        Err(e) => Err(e),
    }
}
