//! Lease mode on PostgreSQL: the claim is one statement (a fresh marker or a free one taken
//! over), bounded by its own lock wait; the holder's statements are fenced by its token.

use sqlx::{Pool, Postgres};

use super::pinned::{on_conn, on_pool};
use super::{CLOCK_TOKEN, PgSql};
use crate::backend::sealed::{Claims as _, Leases};
use crate::backend::sql::statements;
use crate::backend::{Claimant, Holder, LeaseState};

/// The lock wait of a lease claim without `wait`, in milliseconds: answer at once (`0` would
/// mean no limit).
const AT_ONCE_MS: u64 = 1;

statements! {
    /// The statements of lease mode.
    pub(super) struct LeaseSql<Postgres> {
        // Fresh or free: one statement. Its lock wait comes first (`bound` is read before the
        // row is written), so that it never waits longer than `wait` behind a transaction
        // holding the key; `set_config(.., true)` lasts for this statement's own transaction.
        // A marker that is completed in the statement's snapshot is not written to at all, so
        // that duplicates, the most common redelivery, never queue on its row lock. Concurrent
        // takers of a free lease queue on the row; each re-checks the `WHERE` against the
        // winner's version, so exactly one gets a row back. `now()` is the server's clock. The
        // token is the clock's, or one more than the last holder's. A delivery with another
        // payload's fingerprint never takes over.
        claim(scope: &str, key: &str, lease_ms: i64, fingerprint: Option<&[u8]>, wait_ms: String) = format!(
            "WITH bound AS MATERIALIZED (SELECT set_config('lock_timeout', $5, true)) \
             INSERT INTO {{t}} AS m (scope, key, state, locked_until, token, attempts, \
             completed_at, fingerprint) \
             SELECT $1, $2, 'in_progress', now() + $3 * interval '1 millisecond', \
             {CLOCK_TOKEN}, 1, NULL, $4 FROM bound \
             WHERE NOT EXISTS (SELECT 1 FROM {{t}} WHERE scope = $1 AND key = $2 \
             AND state = 'completed') \
             ON CONFLICT (scope, key) DO UPDATE \
             SET locked_until = EXCLUDED.locked_until, \
             token = GREATEST(COALESCE(m.token, 0) + 1, EXCLUDED.token), \
             attempts = m.attempts + 1, \
             fingerprint = COALESCE(m.fingerprint, EXCLUDED.fingerprint) \
             WHERE m.state = 'in_progress' \
             AND (m.locked_until IS NULL OR m.locked_until <= now()) \
             AND (m.fingerprint IS NULL OR EXCLUDED.fingerprint IS NULL \
             OR m.fingerprint = EXCLUDED.fingerprint) \
             RETURNING token, attempts::bigint"
        );
        complete(scope: &str, key: &str, token: i64, result: Option<&str>) =
            "UPDATE {t} SET state = 'completed', completed_at = now(), locked_until = NULL, \
             result = $4::json WHERE scope = $1 AND key = $2 AND token = $3 \
             AND state = 'in_progress'";
        // A permanent failure: completed, with its error and no value.
        fail(scope: &str, key: &str, token: i64, error: &str) =
            "UPDATE {t} SET state = 'completed', completed_at = now(), locked_until = NULL, \
             result = NULL, error = $4 WHERE scope = $1 AND key = $2 AND token = $3 \
             AND state = 'in_progress'";
        release(scope: &str, key: &str, token: i64) =
            "UPDATE {t} SET locked_until = NULL WHERE scope = $1 AND key = $2 AND token = $3 \
             AND state = 'in_progress'";
        renew(scope: &str, key: &str, token: i64, lease_ms: i64) =
            "UPDATE {t} SET locked_until = now() + $4 * interval '1 millisecond' \
             WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in_progress'";
    }
}

impl Leases for Postgres {
    async fn lease_claim<'p>(
        pool: &'p Pool<Self>,
        sql: &'p PgSql,
        c: Claimant<'p>,
        lease_ms: i64,
    ) -> Result<LeaseState, sqlx::Error> {
        let wait_ms = c.wait.map_or(AT_ONCE_MS, crate::backend::millis);
        let mut conn = pool.acquire().await?;
        let claim = sql
            .lease
            .claim(c.scope, c.key, lease_ms, c.fingerprint, wait_ms.to_string());
        let taken: Option<(i64, i64)> = on_conn(&mut conn, sql, async |conn| {
            claim.rows().fetch_optional(conn).await
        })
        .await?;
        if let Some((token, attempts)) = taken {
            return Ok(LeaseState::Taken { token, attempts });
        }
        // Completed or held: the marker says which.
        let found = Self::marker(&mut conn, sql, c.scope, c.key).await?;
        Ok(found.map_or(LeaseState::Missing, LeaseState::Found))
    }

    async fn lease_complete<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t PgSql,
        h: Holder<'t>,
        result: Option<&'t str>,
    ) -> Result<bool, sqlx::Error> {
        let complete = sql.lease.complete(h.scope, h.key, h.token, result);
        let done = on_conn(conn, sql, async |conn| complete.query().execute(conn).await).await?;
        Ok(done.rows_affected() == 1)
    }

    async fn lease_fail<'p>(
        pool: &'p Pool<Self>,
        sql: &'p PgSql,
        h: Holder<'p>,
        error: &'p str,
    ) -> Result<bool, sqlx::Error> {
        let fail = sql.lease.fail(h.scope, h.key, h.token, error);
        let done = on_pool(pool, sql, async |conn| fail.query().execute(conn).await).await?;
        Ok(done.rows_affected() == 1)
    }

    async fn lease_release<'p>(
        pool: &'p Pool<Self>,
        sql: &'p PgSql,
        h: Holder<'p>,
    ) -> Result<bool, sqlx::Error> {
        let release = sql.lease.release(h.scope, h.key, h.token);
        let done = on_pool(pool, sql, async |conn| release.query().execute(conn).await).await?;
        Ok(done.rows_affected() == 1)
    }

    async fn lease_renew<'p>(
        pool: &'p Pool<Self>,
        sql: &'p PgSql,
        h: Holder<'p>,
        lease_ms: i64,
    ) -> Result<bool, sqlx::Error> {
        let renew = sql.lease.renew(h.scope, h.key, h.token, lease_ms);
        let done = on_pool(pool, sql, async |conn| renew.query().execute(conn).await).await?;
        Ok(done.rows_affected() == 1)
    }
}
