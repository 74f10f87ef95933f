//! Claims in a transaction on SQLite: `BEGIN IMMEDIATE`, `INSERT ... ON CONFLICT DO NOTHING`,
//! and the commit, which SQLite answers with an error when a statement had already rolled the
//! transaction back.

use sqlx::{AssertSqlSafe, Pool, SqlSafeStr as _, Sqlite, Transaction};
use sqlx_core::transaction::TransactionManager as _;

use super::{Armed, BEGIN, LEASE_OVER, SqliteSql, acquire, begin, busy_timeout};
use crate::backend::rows::MarkerState;
use crate::backend::sealed::Claims;
use crate::backend::sql::statements;
use crate::backend::{Check, Claimant, Found, Savepoint};
use crate::options::ClaimOptions;

statements! {
    /// The statements of a claim in a transaction. A batch's keys travel as one JSON array, so
    /// SQLite's bind limit does not apply; writers are serialised, so their order cannot
    /// deadlock here.
    pub(super) struct ClaimSql<Sqlite> {
        claim(scope: &str, key: &str, fingerprint: Option<&[u8]>, nonce: i64) =
            "INSERT INTO {t} (scope, key, fingerprint, token, completed_at) \
             VALUES (?1, ?2, ?3, ?4, strftime('%Y-%m-%dT%H:%M:%fZ', 'now')) \
             ON CONFLICT DO NOTHING";
        marker(scope: &str, key: &str) = format!(
            "SELECT state, {LEASE_OVER}, fingerprint, result, error FROM {{t}} \
             WHERE scope = ?1 AND key = ?2"
        );
        // As on PostgreSQL: a free lease becomes this transaction's completed marker.
        take_over(scope: &str, key: &str, fingerprint: Option<&[u8]>, nonce: i64) = format!(
            "UPDATE {{t}} SET state = 'completed', \
             completed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), locked_until = NULL, \
             token = ?4, attempts = attempts + 1, result = NULL, \
             fingerprint = COALESCE(fingerprint, ?3) \
             WHERE scope = ?1 AND key = ?2 AND state = 'in_progress' AND {LEASE_OVER} \
             AND (fingerprint IS NULL OR ?3 IS NULL OR fingerprint = ?3)"
        );
        record(scope: &str, key: &str, json: &str) =
            "UPDATE {t} SET result = ?3 WHERE scope = ?1 AND key = ?2";
        // `WHERE true`: without it SQLite would read `ON CONFLICT` as a join constraint of the
        // `SELECT`.
        claim_batch(scope: &str, keys: String, nonce: i64) =
            "INSERT INTO {t} (scope, key, token, completed_at) \
             SELECT ?1, value, ?3, strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
             FROM json_each(?2) WHERE true ON CONFLICT DO NOTHING RETURNING key";
        batch_markers(scope: &str, keys: String) = format!(
            "SELECT key, state, {LEASE_OVER}, error FROM {{t}} \
             WHERE scope = ?1 AND key IN (SELECT value FROM json_each(?2))"
        );
        take_over_batch(scope: &str, keys: String, nonce: i64) = format!(
            "UPDATE {{t}} SET state = 'completed', \
             completed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), locked_until = NULL, \
             token = ?3, attempts = attempts + 1, result = NULL \
             WHERE scope = ?1 AND key IN (SELECT value FROM json_each(?2)) \
             AND state = 'in_progress' AND {LEASE_OVER} RETURNING key"
        );
        // A job of a batch that failed alone: the marker the claim inserted goes, a lease it
        // took over is free again (its attempt counted, its old holder still fenced out).
        unclaim_inserted(scope: &str, keys: String, nonce: i64) =
            "DELETE FROM {t} WHERE scope = ?1 AND key IN (SELECT value FROM json_each(?2)) \
             AND token = ?3";
        unclaim_taken(scope: &str, keys: String, nonce: i64) =
            "UPDATE {t} SET state = 'in_progress', completed_at = NULL, locked_until = NULL, \
             result = NULL WHERE scope = ?1 AND key IN (SELECT value FROM json_each(?2)) \
             AND token = ?3";
    }
}

/// The keys of a batch as the JSON array the statements read.
pub(super) fn json(keys: &[&str]) -> String {
    serde_json::to_string(keys).expect("strings always serialise")
}

impl Claims for Sqlite {
    async fn begin_primed<'p>(
        pool: &'p Pool<Self>,
        _: &'p SqliteSql,
    ) -> Result<(Transaction<'static, Self>, bool), sqlx::Error> {
        Ok((begin(pool).await?, false))
    }

    async fn begin<'p>(
        pool: &'p Pool<Self>,
        _: &'p SqliteSql,
        options: &'p ClaimOptions,
    ) -> Result<Transaction<'static, Self>, sqlx::Error> {
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

    async fn commit<'a>(
        mut tx: Transaction<'a, Self>,
        _: Check<'a>,
        _: &'a ClaimOptions,
    ) -> Result<bool, sqlx::Error> {
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

    async fn rollback<'a>(
        tx: Transaction<'a, Self>,
        _: &'a ClaimOptions,
    ) -> Result<(), sqlx::Error> {
        end(tx).await
    }

    async fn discard<'a>(
        tx: Transaction<'a, Self>,
        _: &'a ClaimOptions,
    ) -> Result<(), sqlx::Error> {
        // The busy timeout was put back at the begin: nothing to restore.
        end(tx).await
    }

    async fn claim_or_read<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t SqliteSql,
        c: Claimant<'t>,
        _replay: bool,
        _own: bool,
    ) -> Result<(bool, Option<Found>), sqlx::Error> {
        let claim = sql.claim.claim(c.scope, c.key, c.fingerprint, c.nonce);
        if claim.query().execute(&mut *conn).await?.rows_affected() == 1 {
            return Ok((true, None));
        }
        let found = Self::marker(conn, sql, c.scope, c.key).await?;
        Ok((false, found))
    }

    async fn marker<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t SqliteSql,
        scope: &'t str,
        key: &'t str,
    ) -> Result<Option<Found>, sqlx::Error> {
        let row: Option<MarkerState> = sql
            .claim
            .marker(scope, key)
            .rows()
            .fetch_optional(&mut *conn)
            .await?;
        Ok(row.map(Found::of_row))
    }

    async fn take_over<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t SqliteSql,
        c: Claimant<'t>,
    ) -> Result<bool, sqlx::Error> {
        let take = sql.claim.take_over(c.scope, c.key, c.fingerprint, c.nonce);
        Ok(take.query().execute(&mut *conn).await?.rows_affected() == 1)
    }

    async fn record<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t SqliteSql,
        scope: &'t str,
        key: &'t str,
        json: &'t str,
    ) -> Result<(), sqlx::Error> {
        let record = sql.claim.record(scope, key, json);
        record.query().execute(&mut *conn).await?;
        Ok(())
    }

    async fn claim_batch<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t SqliteSql,
        c: Claimant<'t>,
        keys: &'t [&'t str],
    ) -> Result<Vec<String>, sqlx::Error> {
        let claim = sql.claim.claim_batch(c.scope, json(keys), c.nonce);
        claim.scalar().fetch_all(&mut *conn).await
    }

    async fn batch_markers<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t SqliteSql,
        scope: &'t str,
        keys: &'t [&'t str],
    ) -> Result<Vec<(String, Found)>, sqlx::Error> {
        let rows: Vec<(String, String, i64, Option<String>)> = sql
            .claim
            .batch_markers(scope, json(keys))
            .rows()
            .fetch_all(&mut *conn)
            .await?;
        Ok(rows
            .into_iter()
            .map(|(key, state, over, error)| (key, Found::of_status(&state, over, error)))
            .collect())
    }

    async fn take_over_batch<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t SqliteSql,
        c: Claimant<'t>,
        keys: &'t [&'t str],
    ) -> Result<Vec<String>, sqlx::Error> {
        let take = sql.claim.take_over_batch(c.scope, json(keys), c.nonce);
        take.scalar().fetch_all(&mut *conn).await
    }

    async fn savepoint(conn: &mut Self::Connection, step: Savepoint) -> Result<(), sqlx::Error> {
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

    async fn unclaim<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t SqliteSql,
        c: Claimant<'t>,
        inserted: &'t [&'t str],
        taken: &'t [&'t str],
    ) -> Result<(), sqlx::Error> {
        if !inserted.is_empty() {
            let gone = sql.claim.unclaim_inserted(c.scope, json(inserted), c.nonce);
            gone.query().execute(&mut *conn).await?;
        }
        if !taken.is_empty() {
            let freed = sql.claim.unclaim_taken(c.scope, json(taken), c.nonce);
            freed.query().execute(&mut *conn).await?;
        }
        Ok(())
    }

    async fn batch_claimed<'t>(
        _: &'t mut Self::Connection,
        _: &'t SqliteSql,
        _: &'t ClaimOptions,
    ) -> Result<(), sqlx::Error> {
        // The wait was the begin's, and its busy timeout was put back there.
        Ok(())
    }
}

/// Rolls `tx` back, also when SQLite already ended it (a statement that rolled the whole
/// transaction back, as in `commit`). sqlx's own rollback fails then and keeps counting the
/// transaction as open, so the connection would go back to the pool with a count that makes
/// its next user's `BEGIN IMMEDIATE` fail (`InvalidSavePointStatement`). As in `commit`, a
/// `BEGIN` gives sqlx's rollback something to end, which sets its count right.
async fn end(mut tx: Transaction<'_, Sqlite>) -> Result<(), sqlx::Error> {
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
