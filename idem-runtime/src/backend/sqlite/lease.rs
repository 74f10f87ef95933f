//! Lease mode on SQLite: one statement (a fresh marker or a free one taken over), waiting for
//! the database's write lock up to the connection's busy timeout, or `wait`; the holder's
//! statements are fenced by its token.

use sqlx::{AssertSqlSafe, Pool, Sqlite};

use super::{Armed, CLOCK_TOKEN, SqliteSql, busy_timeout};
use crate::backend::sealed::{Claims as _, Leases};
use crate::backend::sql::statements;
use crate::backend::{Claimant, Holder, LeaseState};

statements! {
    /// The statements of lease mode. Writers are serialised, so there is no race to lose.
    /// Times are ISO-8601 text, which compares in time order.
    pub(super) struct LeaseSql<Sqlite> {
        claim(scope: &str, key: &str, lease_ms: i64, fingerprint: Option<&[u8]>) = format!(
            "INSERT INTO {{t}} AS m (scope, key, state, locked_until, token, attempts, \
             completed_at, fingerprint) \
             VALUES (?1, ?2, 'in_progress', \
             strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '+' || (?3 / 1000.0) || ' seconds'), \
             {CLOCK_TOKEN}, 1, NULL, ?4) \
             ON CONFLICT (scope, key) DO UPDATE \
             SET locked_until = excluded.locked_until, \
             token = MAX(COALESCE(m.token, 0) + 1, excluded.token), \
             attempts = m.attempts + 1, \
             fingerprint = COALESCE(m.fingerprint, excluded.fingerprint) \
             WHERE m.state = 'in_progress' AND (m.locked_until IS NULL \
             OR m.locked_until <= strftime('%Y-%m-%dT%H:%M:%fZ', 'now')) \
             AND (m.fingerprint IS NULL OR excluded.fingerprint IS NULL \
             OR m.fingerprint = excluded.fingerprint) \
             RETURNING token, attempts"
        );
        complete(scope: &str, key: &str, token: i64, result: Option<&str>) =
            "UPDATE {t} SET state = 'completed', \
             completed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), locked_until = NULL, \
             result = ?4 WHERE scope = ?1 AND key = ?2 AND token = ?3 \
             AND state = 'in_progress'";
        // A permanent failure: completed, with its error and no value.
        fail(scope: &str, key: &str, token: i64, error: &str) =
            "UPDATE {t} SET state = 'completed', \
             completed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), locked_until = NULL, \
             result = NULL, error = ?4 WHERE scope = ?1 AND key = ?2 AND token = ?3 \
             AND state = 'in_progress'";
        release(scope: &str, key: &str, token: i64) =
            "UPDATE {t} SET locked_until = NULL WHERE scope = ?1 AND key = ?2 AND token = ?3 \
             AND state = 'in_progress'";
        renew(scope: &str, key: &str, token: i64, lease_ms: i64) =
            "UPDATE {t} SET locked_until = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', \
             '+' || (?4 / 1000.0) || ' seconds') \
             WHERE scope = ?1 AND key = ?2 AND token = ?3 AND state = 'in_progress'";
    }
}

impl Leases for Sqlite {
    async fn lease_claim<'p>(
        pool: &'p Pool<Self>,
        sql: &'p SqliteSql,
        c: Claimant<'p>,
        lease_ms: i64,
    ) -> Result<LeaseState, sqlx::Error> {
        // The statement waits for the database's write lock, held by any writer (SQLite has
        // one at a time), not only by a holder of this key: answering at once would refuse
        // most claims under load. So it waits the connection's busy timeout, or `wait`, set for
        // this statement and put back on every path.
        let mut conn = Armed::new(pool.acquire().await?);
        let restore = match c.wait {
            None => None,
            Some(wait) => {
                let own = busy_timeout(conn.get()).await?;
                let bounded = format!("PRAGMA busy_timeout = {}", crate::backend::millis(wait));
                sqlx::raw_sql(AssertSqlSafe(bounded))
                    .execute(conn.get())
                    .await?;
                Some(format!("PRAGMA busy_timeout = {own}"))
            }
        };
        let claim = sql.lease.claim(c.scope, c.key, lease_ms, c.fingerprint);
        let taken: Result<Option<(i64, i64)>, sqlx::Error> =
            claim.rows().fetch_optional(conn.get()).await;
        if let Some(restore) = restore {
            sqlx::raw_sql(AssertSqlSafe(restore))
                .execute(conn.get())
                .await?;
        }
        let mut conn = conn.disarm();
        if let Some((token, attempts)) = taken? {
            return Ok(LeaseState::Taken { token, attempts });
        }
        let found = Self::marker(&mut conn, sql, c.scope, c.key).await?;
        Ok(found.map_or(LeaseState::Missing, LeaseState::Found))
    }

    async fn lease_complete<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t SqliteSql,
        h: Holder<'t>,
        result: Option<&'t str>,
    ) -> Result<bool, sqlx::Error> {
        let complete = sql.lease.complete(h.scope, h.key, h.token, result);
        Ok(complete.query().execute(conn).await?.rows_affected() == 1)
    }

    async fn lease_fail<'p>(
        pool: &'p Pool<Self>,
        sql: &'p SqliteSql,
        h: Holder<'p>,
        error: &'p str,
    ) -> Result<bool, sqlx::Error> {
        let fail = sql.lease.fail(h.scope, h.key, h.token, error);
        Ok(fail.query().execute(pool).await?.rows_affected() == 1)
    }

    async fn lease_release<'p>(
        pool: &'p Pool<Self>,
        sql: &'p SqliteSql,
        h: Holder<'p>,
    ) -> Result<bool, sqlx::Error> {
        let release = sql.lease.release(h.scope, h.key, h.token);
        Ok(release.query().execute(pool).await?.rows_affected() == 1)
    }

    async fn lease_renew<'p>(
        pool: &'p Pool<Self>,
        sql: &'p SqliteSql,
        h: Holder<'p>,
        lease_ms: i64,
    ) -> Result<bool, sqlx::Error> {
        let renew = sql.lease.renew(h.scope, h.key, h.token, lease_ms);
        Ok(renew.query().execute(pool).await?.rows_affected() == 1)
    }
}
