//! Lease mode on PostgreSQL: the claim is one statement (a fresh marker or a free one taken
//! over), bounded by its own lock wait; the holder's statements are fenced by its token; a
//! step's value is recorded by one statement that reads its holder's marker under a share
//! lock, so that a takeover of the key and the record never interleave.

use sqlx::{Pool, Postgres};

use super::{CLOCK_TOKEN, ISO};
use crate::backend::bind::statements;
use crate::backend::lease::{LeaseText, StepText, Words, forget_steps};
use crate::backend::{Claimant, LeaseState, Sql};

/// The lock wait of a lease claim without `wait`, in milliseconds: answer at once (`0` would
/// mean no limit).
const AT_ONCE_MS: u64 = 1;

/// The holder's statements.
pub(super) fn text() -> LeaseText {
    LeaseText::of(Words {
        key: "key",
        now: "now()",
        until: "now() + :lease_ms * interval '1 millisecond'",
        result: ":result::json",
    })
}

/// The steps' statements.
pub(super) fn steps() -> StepText {
    StepText {
        read: format!(
            "SELECT name, seq::int8, token, result::text, \
             to_char(created_at AT TIME ZONE 'UTC', {ISO}) \
             FROM {{t}}_steps WHERE scope = :scope AND key = :key ORDER BY seq, name"
        )
        .into(),
        // `FOR SHARE` makes a concurrent takeover wait for this statement (and this
        // statement, if the takeover came first, re-read the marker and find another token),
        // so that no step of an old holder is written after a new one took the key.
        record: "INSERT INTO {t}_steps AS s (scope, key, name, seq, token, result) \
                 SELECT m.scope, m.key, :name, :seq, m.token, :result::json FROM {t} AS m \
                 WHERE m.scope = :scope AND m.key = :key AND m.token = :token \
                 AND m.state = 'in_progress' FOR SHARE \
                 ON CONFLICT (scope, key, name) DO UPDATE SET seq = EXCLUDED.seq, \
                 token = EXCLUDED.token, result = EXCLUDED.result, created_at = now() \
                 WHERE s.token < EXCLUDED.token"
            .into(),
        forget: forget_steps("key").into(),
    }
}

statements! {
    /// The lease claim.
    pub(super) struct Statements {
        // Fresh or free: one statement. Its lock wait comes first (`bound` is read before the
        // row is written), so that it never waits longer than `wait` behind a transaction
        // holding the key; `set_config(.., true)` lasts for this statement's own transaction.
        // A marker that is completed in the statement's snapshot is not written to at all, so
        // that duplicates, the most common redelivery, never queue on its row lock. Concurrent
        // takers of a free lease queue on the row; each re-checks the `WHERE` against the
        // winner's version, so exactly one gets a row back. `now()` is the server's clock. The
        // token is the clock's, or one more than the last holder's. A delivery with another
        // payload's fingerprint never takes over.
        claim(scope: &str, key: &str, lease_ms: i64, fingerprint: Option<&[u8]>, wait_ms: &str) = format!(
            "WITH bound AS MATERIALIZED (SELECT set_config('lock_timeout', :wait_ms, true)) \
             INSERT INTO {{t}} AS m (scope, key, state, locked_until, token, attempts, \
             completed_at, fingerprint) \
             SELECT :scope, :key, 'in_progress', now() + :lease_ms * interval '1 millisecond', \
             {CLOCK_TOKEN}, 1, NULL, :fingerprint FROM bound \
             WHERE NOT EXISTS (SELECT 1 FROM {{t}} WHERE scope = :scope AND key = :key \
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
    }
}

/// `Backend::lease_claim`: the claim, then, if it took nothing, the marker it met.
pub(super) async fn claim(
    pool: &Pool<Postgres>,
    sql: &Sql<Postgres>,
    c: Claimant<'_>,
    lease_ms: i64,
) -> Result<LeaseState, sqlx::Error> {
    let wait_ms = c
        .wait
        .map_or(AT_ONCE_MS, crate::backend::millis)
        .to_string();
    let mut conn = pool.acquire().await?;
    let claim = sql
        .own
        .lease
        .claim(c.scope, c.key, lease_ms, c.fingerprint, &wait_ms);
    if let Some((token, attempts)) = claim.fetch_optional(&mut *conn).await? {
        return Ok(LeaseState::Taken { token, attempts });
    }
    // Completed or held: the marker says which.
    let found = sql.marker(&mut conn, c.scope, c.key).await?;
    Ok(found.map_or(LeaseState::Missing, LeaseState::Found))
}
