//! Claims in a transaction on PostgreSQL: `INSERT ... ON CONFLICT DO NOTHING`, the marker it
//! meets read in the same statement, and the verified commit.

use sqlx::{AssertSqlSafe, Pool, Postgres, SqlSafeStr as _, SqlStr, Transaction};

use super::pinned::on_conn;
use super::{IN_FAILED_TRANSACTION, LEASE_OVER, PgSql, UNBOUND, database_code};
use crate::backend::rows::MarkerState;
use crate::backend::sealed::Claims;
use crate::backend::sql::statements;
use crate::backend::{Check, Claimant, Found, Savepoint};
use crate::options::ClaimOptions;

// The claim and, when it inserts nothing, the marker it met, in one statement. A claim that
// inserted answers no row at all: the fresh path, every job's, decodes nothing. One that
// inserted nothing answers one row, the marker's columns read by the `LEFT JOIN` with the
// statement's snapshot, which holds a marker committed before the statement began; a marker
// committed while the insert waited for it is not in that snapshot (its columns are NULL), and
// the claim reads it with a statement of its own. `when_inserted` runs only when the insert
// did (with `wait`, it puts the session's lock wait back: a claim that goes on to take a
// lease over still waits on the row) and is never true, so that the fresh claim's row is
// dropped. The `WITH` runs to completion before the `SELECT` reads its count.
fn claim_or_read(when_inserted: &str) -> String {
    format!(
        "WITH ins AS (INSERT INTO {{t}} (scope, key, fingerprint, token, completed_at) \
         VALUES ($1, $2, $3, $4, now()) ON CONFLICT DO NOTHING RETURNING 1) \
         SELECT m.state, \
         (m.locked_until IS NULL OR m.locked_until <= statement_timestamp())::int::int8, \
         m.fingerprint, CASE WHEN $5 THEN m.result::text END, m.error \
         FROM (SELECT 1 WHERE CASE WHEN EXISTS (SELECT 1 FROM ins) THEN {when_inserted} \
         ELSE true END) AS one LEFT JOIN {{t}} AS m ON m.scope = $1 AND m.key = $2"
    )
}

// A free lease becomes this transaction's completed marker holding the claim's nonce; its old
// holder's token no longer matches, so it can neither complete nor renew. Another payload
// never takes over.
fn take_over(returning: &str) -> String {
    format!(
        "UPDATE {{t}} SET state = 'completed', completed_at = now(), locked_until = NULL, \
         token = $4, attempts = attempts + 1, result = NULL, \
         fingerprint = COALESCE(fingerprint, $3) \
         WHERE scope = $1 AND key = $2 AND state = 'in_progress' AND {LEASE_OVER} \
         AND (fingerprint IS NULL OR $3::bytea IS NULL OR fingerprint = $3){returning}"
    )
}

/// A batch statement's scope, as a value the planner cannot see. Shown the scope itself, it
/// reads the scope's frequency from the table's statistics, which say nothing of a scope that
/// was new or rare at the last `ANALYZE`: it then expects one row, finds scanning the scope
/// alone as cheap as looking up each key (PostgreSQL before 17 prices an `= ANY` on the index's
/// second column by its descents) and filters the keys out of every marker of the scope: 4 to
/// 7 ms for one key among 8,000 to 20,000 markers of a scope the statistics missed, against
/// 0.02 to 0.04 ms by the index.
const SCOPE: &str = "(SELECT $1::text)";

statements! {
    /// The statements of a claim in a transaction.
    pub(super) struct ClaimSql<Postgres> {
        claim_or_read(scope: &str, key: &str, fingerprint: Option<&[u8]>, nonce: i64, replay: bool) =
            claim_or_read("false");
        /// With `wait`: puts the session's lock wait back once it inserted.
        claim_or_read_bounded(scope: &str, key: &str, fingerprint: Option<&[u8]>, nonce: i64, replay: bool) =
            claim_or_read(&format!("{UNBOUND} IS NULL"));
        marker(scope: &str, key: &str) = format!(
            "SELECT state, {LEASE_OVER}::int::int8, fingerprint, result::text, error FROM {{t}} \
             WHERE scope = $1 AND key = $2"
        );
        take_over(scope: &str, key: &str, fingerprint: Option<&[u8]>, nonce: i64) =
            take_over("");
        /// With `wait`: puts the session's lock wait back once it took the lease.
        take_over_bounded(scope: &str, key: &str, fingerprint: Option<&[u8]>, nonce: i64) =
            take_over(&format!(" RETURNING {UNBOUND}"));
        record(scope: &str, key: &str, json: &str) =
            "UPDATE {t} SET result = $3::json WHERE scope = $1 AND key = $2";
        // One statement for the whole batch: the keys travel as one array, so no bind limit
        // applies, and `ORDER BY k` makes every batch take its row locks in the same order, so
        // that two overlapping batches queue instead of deadlocking.
        claim_batch(scope: &str, keys: &[&str], nonce: i64) =
            "INSERT INTO {t} (scope, key, token, completed_at) \
             SELECT $1, k, $3, now() FROM unnest($2::text[]) AS u(k) ORDER BY k \
             ON CONFLICT DO NOTHING RETURNING key";
        batch_markers(scope: &str, keys: &[&str]) = format!(
            "SELECT key, state, {LEASE_OVER}::int::int8, error FROM {{t}} \
             WHERE scope = {SCOPE} AND key = ANY($2::text[])"
        );
        take_over_batch(scope: &str, keys: &[&str], nonce: i64) = format!(
            "UPDATE {{t}} SET state = 'completed', completed_at = now(), locked_until = NULL, \
             token = $3, attempts = attempts + 1, result = NULL \
             WHERE scope = {SCOPE} AND key = ANY($2::text[]) AND state = 'in_progress' \
             AND {LEASE_OVER} RETURNING key"
        );
        /// The session's lock wait back after a batch claimed with `wait`.
        unbind() = format!("SELECT {UNBOUND}");
        // A job of a batch that failed alone: the marker the claim inserted goes, a lease it
        // took over is free again (its attempt counted, its old holder still fenced out).
        unclaim_inserted(scope: &str, keys: &[&str], nonce: i64) = format!(
            "DELETE FROM {{t}} WHERE scope = {SCOPE} AND key = ANY($2::text[]) AND token = $3"
        );
        unclaim_taken(scope: &str, keys: &[&str], nonce: i64) = format!(
            "UPDATE {{t}} SET state = 'in_progress', completed_at = NULL, locked_until = NULL, \
             result = NULL WHERE scope = {SCOPE} AND key = ANY($2::text[]) AND token = $3"
        );
    }
}

/// `BEGIN` with the options' isolation level and, for `wait`, the session's lock wait kept in
/// `idem.lock_timeout` and bounded for the claim: one simple-query message. `SET LOCAL` lasts
/// until the end of this transaction, so nothing leaks to the pooled connection's next user,
/// and the claim's last statement puts the session's value back before the body runs.
fn begin_sql(options: &ClaimOptions) -> String {
    let mut begin = String::from("BEGIN");
    if let Some(level) = options.isolation {
        begin.push_str(" ISOLATION LEVEL ");
        begin.push_str(level.sql());
    }
    if let Some(wait) = options.wait {
        begin.push_str(&format!(
            "; SELECT set_config('idem.lock_timeout', current_setting('lock_timeout'), true); \
             SET LOCAL lock_timeout = {}",
            crate::backend::millis(wait)
        ));
    }
    begin
}

/// A job's savepoint; opening one with `wait` bounds the claim that follows as the begin
/// statement does (`begin_sql`), inside the savepoint, so that a rollback to it undoes that
/// too.
fn savepoint_sql(step: Savepoint) -> SqlStr {
    match step {
        Savepoint::Open(Some(wait)) | Savepoint::Next(Some(wait)) => AssertSqlSafe(format!(
            "{}; SELECT set_config('idem.lock_timeout', current_setting('lock_timeout'), true); \
             SET LOCAL lock_timeout = {}",
            step.ansi(),
            crate::backend::millis(wait)
        ))
        .into_sql_str(),
        _ => step.ansi().into_sql_str(),
    }
}

/// The verified commit of `tx`, in one round trip: `Ok(false)` if the database rolled it back.
async fn commit_checked(mut tx: Transaction<'_, Postgres>) -> Result<bool, sqlx::Error> {
    // PostgreSQL answers `COMMIT` of an aborted transaction with a silent `ROLLBACK`, and
    // sqlx reports that as success. Any other statement fails in an aborted transaction, so
    // a `SAVEPOINT` first tells the two apart in the same message (one round trip): if it
    // fails, the rest of the message is skipped. It answers with its command tag alone (no
    // row to decode, unlike a `SELECT`), and the commit discards it. `AND CHAIN` opens the
    // next transaction at once (sqlx's bookkeeping still counts this one as open): dropping
    // `tx` queues the `ROLLBACK` that ends it, which the pool sends with the ping it makes
    // when the connection comes back, so it costs no round trip of its own.
    match sqlx::raw_sql("SAVEPOINT idem_commit; COMMIT AND CHAIN")
        .execute(&mut *tx)
        .await
    {
        Ok(_) => Ok(true),
        Err(e) if database_code(&e).as_deref() == Some(IN_FAILED_TRANSACTION) => Ok(false),
        Err(e) => Err(e),
    }
}

impl Claims for Postgres {
    async fn begin<'p>(
        pool: &'p Pool<Self>,
        _: &'p PgSql,
        options: &'p ClaimOptions,
    ) -> Result<Transaction<'static, Self>, sqlx::Error> {
        if options.is_default() {
            return pool.begin().await;
        }
        pool.begin_with(AssertSqlSafe(begin_sql(options)).into_sql_str())
            .await
    }

    fn commit<'a>(
        tx: Transaction<'a, Self>,
        _: Check<'a>,
        _: &'a ClaimOptions,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a {
        // Whoever committed knows whether it wrote outbox messages (a claim's hold, a group's
        // generation) and wakes the relays itself: the commit reads nothing more. Its future
        // is the commit's own (a layer awaiting it would copy it once more per call).
        commit_checked(tx)
    }

    async fn rollback<'a>(
        tx: Transaction<'a, Self>,
        _: &'a ClaimOptions,
    ) -> Result<(), sqlx::Error> {
        tx.rollback().await
    }

    async fn discard<'a>(
        tx: Transaction<'a, Self>,
        _: &'a ClaimOptions,
    ) -> Result<(), sqlx::Error> {
        // `SET LOCAL` ends with the transaction: nothing to put back.
        drop(tx);
        Ok(())
    }

    async fn claim_or_read<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t PgSql,
        c: Claimant<'t>,
        replay: bool,
        _own: bool,
    ) -> Result<(bool, Option<Found>), sqlx::Error> {
        type Row = (
            Option<String>,
            Option<i64>,
            Option<Vec<u8>>,
            Option<String>,
            Option<String>,
        );
        let statement = match c.wait {
            None => sql
                .claim
                .claim_or_read(c.scope, c.key, c.fingerprint, c.nonce, replay),
            Some(_) => {
                let s = &sql.claim;
                s.claim_or_read_bounded(c.scope, c.key, c.fingerprint, c.nonce, replay)
            }
        };
        let row: Option<Row> = statement.rows().fetch_optional(&mut *conn).await?;
        let Some((state, over, fingerprint, result, error)) = row else {
            return Ok((true, None));
        };
        let found = state
            .map(|state| Found::of_row((state, over.unwrap_or(1), fingerprint, result, error)));
        Ok((false, found))
    }

    async fn marker<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t PgSql,
        scope: &'t str,
        key: &'t str,
    ) -> Result<Option<Found>, sqlx::Error> {
        // Also read outside a transaction (a lease's claim, `inspect`).
        let marker = sql.claim.marker(scope, key);
        let row: Option<MarkerState> = on_conn(conn, sql, async |conn| {
            marker.rows().fetch_optional(conn).await
        })
        .await?;
        Ok(row.map(Found::of_row))
    }

    async fn take_over<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t PgSql,
        c: Claimant<'t>,
    ) -> Result<bool, sqlx::Error> {
        let statement = match c.wait {
            None => sql.claim.take_over(c.scope, c.key, c.fingerprint, c.nonce),
            Some(_) => sql
                .claim
                .take_over_bounded(c.scope, c.key, c.fingerprint, c.nonce),
        };
        let done = statement.query().execute(&mut *conn).await?;
        Ok(done.rows_affected() == 1)
    }

    async fn record<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t PgSql,
        scope: &'t str,
        key: &'t str,
        json: &'t str,
    ) -> Result<(), sqlx::Error> {
        sql.claim
            .record(scope, key, json)
            .query()
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    async fn claim_batch<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t PgSql,
        c: Claimant<'t>,
        keys: &'t [&'t str],
    ) -> Result<Vec<String>, sqlx::Error> {
        sql.claim
            .claim_batch(c.scope, keys, c.nonce)
            .scalar()
            .fetch_all(&mut *conn)
            .await
    }

    async fn batch_markers<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t PgSql,
        scope: &'t str,
        keys: &'t [&'t str],
    ) -> Result<Vec<(String, Found)>, sqlx::Error> {
        let rows: Vec<(String, String, i64, Option<String>)> = sql
            .claim
            .batch_markers(scope, keys)
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
        sql: &'t PgSql,
        c: Claimant<'t>,
        keys: &'t [&'t str],
    ) -> Result<Vec<String>, sqlx::Error> {
        sql.claim
            .take_over_batch(c.scope, keys, c.nonce)
            .scalar()
            .fetch_all(&mut *conn)
            .await
    }

    async fn savepoint(conn: &mut Self::Connection, step: Savepoint) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(savepoint_sql(step))
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    async fn unclaim<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t PgSql,
        c: Claimant<'t>,
        inserted: &'t [&'t str],
        taken: &'t [&'t str],
    ) -> Result<(), sqlx::Error> {
        if !inserted.is_empty() {
            let gone = sql.claim.unclaim_inserted(c.scope, inserted, c.nonce);
            gone.query().execute(&mut *conn).await?;
        }
        if !taken.is_empty() {
            let freed = sql.claim.unclaim_taken(c.scope, taken, c.nonce);
            freed.query().execute(&mut *conn).await?;
        }
        Ok(())
    }

    async fn batch_claimed<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t PgSql,
        options: &'t ClaimOptions,
    ) -> Result<(), sqlx::Error> {
        // A batch's statements leave the wait bounded (which of them is the last is known only
        // from their answers): one statement more, for a whole batch, and only with `wait`.
        if options.wait.is_some() {
            sql.claim.unbind().query().execute(&mut *conn).await?;
        }
        Ok(())
    }
}
