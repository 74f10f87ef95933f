//! Lease mode on SQLite: one statement (a fresh marker or a free one taken over), waiting for
//! the database's write lock up to the connection's busy timeout, or `wait`; the holder's
//! statements are fenced by its token, and so is a step's record (writers take turns, so
//! nothing interleaves with it). Times are ISO-8601 text, which compares in time order.

use sqlx::{AssertSqlSafe, Pool, Sqlite};

use super::{Armed, CLOCK_TOKEN, NOW, busy_timeout};
use crate::backend::bind::statements;
use crate::backend::lease::{LeaseText, StepText, Words, forget_steps};
use crate::backend::{Claimant, LeaseState, Sql};

/// `ms` milliseconds from now, as the markers' times are written.
fn from_now(ms: &str) -> String {
    format!("strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '+' || ({ms} / 1000.0) || ' seconds')")
}

/// The holder's statements.
pub(super) fn text() -> LeaseText {
    LeaseText::of(Words {
        key: "key",
        now: NOW,
        until: &from_now(":lease_ms"),
        result: ":result",
    })
}

/// The steps' statements.
pub(super) fn steps() -> StepText {
    StepText {
        read: "SELECT name, seq, token, result, created_at FROM {t}_steps \
               WHERE scope = :scope AND key = :key ORDER BY seq, name"
            .into(),
        record: format!(
            "INSERT INTO {{t}}_steps AS s (scope, key, name, seq, token, result) \
             SELECT m.scope, m.key, :name, :seq, m.token, :result FROM {{t}} AS m \
             WHERE m.scope = :scope AND m.key = :key AND m.token = :token \
             AND m.state = 'in_progress' \
             ON CONFLICT (scope, key, name) DO UPDATE SET seq = excluded.seq, \
             token = excluded.token, result = excluded.result, created_at = {NOW} \
             WHERE s.token < excluded.token"
        )
        .into(),
        forget: forget_steps("key").into(),
    }
}

statements! {
    /// The lease claim. Writers are serialised, so there is no race to lose.
    pub(super) struct Statements {
        claim(scope: &str, key: &str, lease_ms: i64, fingerprint: Option<&[u8]>) = format!(
            "INSERT INTO {{t}} AS m (scope, key, state, locked_until, token, attempts, \
             completed_at, fingerprint) \
             VALUES (:scope, :key, 'in_progress', {}, {CLOCK_TOKEN}, 1, NULL, :fingerprint) \
             ON CONFLICT (scope, key) DO UPDATE \
             SET locked_until = excluded.locked_until, \
             token = MAX(COALESCE(m.token, 0) + 1, excluded.token), \
             attempts = m.attempts + 1, \
             fingerprint = COALESCE(m.fingerprint, excluded.fingerprint) \
             WHERE m.state = 'in_progress' AND (m.locked_until IS NULL \
             OR m.locked_until <= {NOW}) \
             AND (m.fingerprint IS NULL OR excluded.fingerprint IS NULL \
             OR m.fingerprint = excluded.fingerprint) \
             RETURNING token, attempts",
            from_now(":lease_ms")
        );
    }
}

/// `Backend::lease_claim`. The statement waits for the database's write lock, held by any
/// writer (SQLite has one at a time), not only by a holder of this key: answering at once
/// would refuse most claims under load. So it waits the connection's busy timeout, or `wait`,
/// set for this statement and put back on every path.
pub(super) async fn claim(
    pool: &Pool<Sqlite>,
    sql: &Sql<Sqlite>,
    c: Claimant<'_>,
    lease_ms: i64,
) -> Result<LeaseState, sqlx::Error> {
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
    let claim = sql.own.lease.claim(c.scope, c.key, lease_ms, c.fingerprint);
    let taken: Result<Option<(i64, i64)>, sqlx::Error> = claim.fetch_optional(conn.get()).await;
    if let Some(restore) = restore {
        sqlx::raw_sql(AssertSqlSafe(restore))
            .execute(conn.get())
            .await?;
    }
    let mut conn = conn.disarm();
    if let Some((token, attempts)) = taken? {
        return Ok(LeaseState::Taken { token, attempts });
    }
    let found = sql.marker(&mut conn, c.scope, c.key).await?;
    Ok(found.map_or(LeaseState::Missing, LeaseState::Found))
}
