//! Lease mode on MySQL and MariaDB: an `INSERT`, and on a duplicate key an `UPDATE` taking a
//! free lease over, each bounded in its lock wait; the holder's statements are fenced by its
//! token.

use std::time::Duration;

use sqlx::{MySql, Pool};

use super::{CLOCK_TOKEN, ER_DUP_ENTRY, LEASE_OVER, MySqlSql, bounded, number};
use crate::backend::sealed::Leases;
use crate::backend::sql::{Bound, statements};
use crate::backend::{Claimant, Found, Holder, LeaseState, Status};

/// The lock wait of a lease claim without `wait`: the shortest MariaDB counts (it counts lock
/// waits in whole seconds, from one).
const AT_ONCE: Duration = Duration::from_secs(1);

statements! {
    /// The statements of lease mode.
    pub(super) struct LeaseSql<MySql> {
        // The UPDATE has no RETURNING here, so the token comes back as the statement's last
        // insert id: `LAST_INSERT_ID(expr)` sets it. Error 1062 sends the claim to `take`.
        insert(scope: &str, key: &str, lease_ms: i64, fingerprint: Option<&[u8]>) = format!(
            "INSERT INTO {{t}} (scope, `key`, state, locked_until, token, attempts, \
             completed_at, fingerprint, created_at) VALUES (?, ?, 'in_progress', \
             UTC_TIMESTAMP(6) + INTERVAL (? * 1000) MICROSECOND, LAST_INSERT_ID({CLOCK_TOKEN}), \
             1, NULL, ?, UTC_TIMESTAMP(6))"
        );
        // Concurrent takers queue on the row lock and re-read it: only the first still
        // matches. The token is the clock's, or one more than the last holder's. Another
        // payload never takes over.
        take(lease_ms: i64, fingerprint: Option<&[u8]>, scope: &str, key: &str, same_fingerprint: Option<&[u8]>) = format!(
            "UPDATE {{t}} SET token = LAST_INSERT_ID(GREATEST(COALESCE(token, 0) + 1, \
             {CLOCK_TOKEN})), attempts = attempts + 1, \
             locked_until = UTC_TIMESTAMP(6) + INTERVAL (? * 1000) MICROSECOND, \
             fingerprint = COALESCE(fingerprint, ?) \
             WHERE scope = ? AND `key` = ? AND state = 'in_progress' \
             AND (locked_until IS NULL OR locked_until <= UTC_TIMESTAMP(6)) \
             AND (fingerprint IS NULL OR fingerprint = COALESCE(?, fingerprint))"
        );
        state(scope: &str, key: &str) = format!(
            "SELECT state, {LEASE_OVER}, fingerprint, CAST(result AS CHAR), error, \
             CAST(attempts AS SIGNED) FROM {{t}} WHERE scope = ? AND `key` = ?"
        );
        complete(result: Option<&str>, scope: &str, key: &str, token: i64) =
            "UPDATE {t} SET state = 'completed', completed_at = UTC_TIMESTAMP(6), \
             locked_until = NULL, result = ? WHERE scope = ? AND `key` = ? AND token = ? \
             AND state = 'in_progress'";
        // A permanent failure: completed, with its error and no value.
        fail(error: &str, scope: &str, key: &str, token: i64) =
            "UPDATE {t} SET state = 'completed', completed_at = UTC_TIMESTAMP(6), \
             locked_until = NULL, result = NULL, error = ? WHERE scope = ? AND `key` = ? \
             AND token = ? AND state = 'in_progress'";
        release(scope: &str, key: &str, token: i64) =
            "UPDATE {t} SET locked_until = NULL WHERE scope = ? AND `key` = ? AND token = ? \
             AND state = 'in_progress'";
        renew(lease_ms: i64, scope: &str, key: &str, token: i64) =
            "UPDATE {t} SET locked_until = UTC_TIMESTAMP(6) + INTERVAL (? * 1000) MICROSECOND \
             WHERE scope = ? AND `key` = ? AND token = ? AND state = 'in_progress'";
    }
}

/// A lease claim's statement, never waiting longer than its `wait` (or [`AT_ONCE`]) behind
/// another holder of the key (MariaDB; MySQL 8 waits the session's lock wait).
fn bounded_by(statement: Bound<MySql>, c: &Claimant<'_>) -> Bound<MySql> {
    let text = bounded(statement.text(), Some(c.wait.unwrap_or(AT_ONCE)));
    statement.on(text)
}

impl Leases for MySql {
    async fn lease_claim<'p>(
        pool: &'p Pool<Self>,
        sql: &'p MySqlSql,
        c: Claimant<'p>,
        lease_ms: i64,
    ) -> Result<LeaseState, sqlx::Error> {
        let insert = bounded_by(
            sql.lease.insert(c.scope, c.key, lease_ms, c.fingerprint),
            &c,
        );
        match insert.query().execute(pool).await {
            Ok(done) => {
                let token = i64::try_from(done.last_insert_id()).unwrap_or(i64::MAX);
                return Ok(LeaseState::Taken { token, attempts: 1 });
            }
            Err(e) if number(&e) == Some(ER_DUP_ENTRY) => {}
            Err(e) => return Err(e),
        }
        // Read before writing: a completed marker or a live lease (the most common answers)
        // is never written to, so that duplicates do not queue on its row lock.
        type Row = (
            String,
            i64,
            Option<Vec<u8>>,
            Option<String>,
            Option<String>,
            i64,
        );
        let row: Option<Row> = sql
            .lease
            .state(c.scope, c.key)
            .rows()
            .fetch_optional(pool)
            .await?;
        let Some((state, over, fingerprint, result, error, attempts)) = row else {
            return Ok(LeaseState::Missing);
        };
        let found = Found::of_row((state, over, fingerprint, result, error));
        if found.status != Status::Free {
            return Ok(LeaseState::Found(found));
        }
        let fp = c.fingerprint;
        let take = bounded_by(sql.lease.take(lease_ms, fp, c.scope, c.key, fp), &c);
        let taken = take.query().execute(pool).await?;
        if taken.rows_affected() == 1 {
            let token = i64::try_from(taken.last_insert_id()).unwrap_or(i64::MAX);
            return Ok(LeaseState::Taken {
                token,
                attempts: attempts + 1,
            });
        }
        // Taken by another delivery (or refused for another payload) between the statements:
        // the claim asks again, and decides on what it reads then.
        Ok(LeaseState::Found(found))
    }

    async fn lease_complete<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t MySqlSql,
        h: Holder<'t>,
        result: Option<&'t str>,
    ) -> Result<bool, sqlx::Error> {
        let done = sql
            .lease
            .complete(result, h.scope, h.key, h.token)
            .query()
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn lease_fail<'p>(
        pool: &'p Pool<Self>,
        sql: &'p MySqlSql,
        h: Holder<'p>,
        error: &'p str,
    ) -> Result<bool, sqlx::Error> {
        let fail = sql.lease.fail(error, h.scope, h.key, h.token);
        Ok(fail.query().execute(pool).await?.rows_affected() == 1)
    }

    async fn lease_release<'p>(
        pool: &'p Pool<Self>,
        sql: &'p MySqlSql,
        h: Holder<'p>,
    ) -> Result<bool, sqlx::Error> {
        let release = sql.lease.release(h.scope, h.key, h.token);
        Ok(release.query().execute(pool).await?.rows_affected() == 1)
    }

    async fn lease_renew<'p>(
        pool: &'p Pool<Self>,
        sql: &'p MySqlSql,
        h: Holder<'p>,
        lease_ms: i64,
    ) -> Result<bool, sqlx::Error> {
        let renew = sql.lease.renew(lease_ms, h.scope, h.key, h.token);
        Ok(renew.query().execute(pool).await?.rows_affected() == 1)
    }
}
