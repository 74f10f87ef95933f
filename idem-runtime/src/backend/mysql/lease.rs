//! Lease mode on MySQL and MariaDB: an `INSERT`, and on a duplicate key an `UPDATE` taking a
//! free lease over, each bounded in its lock wait; the holder's statements are fenced by its
//! token, and a step's record reads the holder's marker under a share lock.

use std::time::Duration;

use sqlx::{MySql, Pool};

use super::{CLOCK_TOKEN, ER_DUP_ENTRY, LEASE_OVER, bounded, number};
use crate::backend::bind::Bound;
use crate::backend::bind::statements;
use crate::backend::lease::{LeaseText, StepText, Words, forget_steps};
use crate::backend::{Claimant, Found, LeaseState, Sql, Status};

/// The lock wait of a lease claim without `wait`: the shortest MariaDB counts (it counts lock
/// waits in whole seconds, from one).
const AT_ONCE: Duration = Duration::from_secs(1);

/// `:lease_ms` (or another bind) milliseconds from now, on the server's clock.
fn from_now(ms: &str) -> String {
    format!("UTC_TIMESTAMP(6) + INTERVAL ({ms} * 1000) MICROSECOND")
}

/// The holder's statements.
pub(super) fn text() -> LeaseText {
    LeaseText::of(Words {
        key: "`key`",
        now: "UTC_TIMESTAMP(6)",
        until: &from_now(":lease_ms"),
        result: ":result",
    })
}

/// The steps' statements.
pub(super) fn steps() -> StepText {
    StepText {
        read: "SELECT name, CAST(seq AS SIGNED), token, CAST(result AS CHAR), \
               DATE_FORMAT(created_at, '%Y-%m-%dT%H:%i:%s.%fZ') FROM {t}_steps \
               WHERE scope = :scope AND `key` = :key ORDER BY seq, name"
            .into(),
        // The locking read makes a concurrent takeover wait for this statement (and reads the
        // latest marker if the takeover came first). sqlx asks for found rows: a new row
        // counts 1, a replaced one 2, and a row with a token as large as this holder's (which
        // no holder of the key writes twice) would count 1 unchanged. The token is set last,
        // as the assignments read the row as the earlier ones left it.
        record: "INSERT INTO {t}_steps (scope, `key`, name, seq, token, result, created_at) \
                 SELECT m.scope, m.`key`, :name, :seq, m.token, :result, UTC_TIMESTAMP(6) \
                 FROM {t} AS m WHERE m.scope = :scope AND m.`key` = :key \
                 AND m.token = :token AND m.state = 'in_progress' LOCK IN SHARE MODE \
                 ON DUPLICATE KEY UPDATE \
                 seq = IF({t}_steps.token < VALUES(token), VALUES(seq), {t}_steps.seq), \
                 result = IF({t}_steps.token < VALUES(token), VALUES(result), {t}_steps.result), \
                 created_at = IF({t}_steps.token < VALUES(token), VALUES(created_at), \
                 {t}_steps.created_at), \
                 token = GREATEST({t}_steps.token, VALUES(token))"
            .into(),
        forget: forget_steps("`key`").into(),
    }
}

statements! {
    /// The lease claim.
    pub(super) struct Statements {
        // The UPDATE has no RETURNING here, so the token comes back as the statement's last
        // insert id: `LAST_INSERT_ID(expr)` sets it. Error 1062 sends the claim to `take`.
        insert(scope: &str, key: &str, lease_ms: i64, fingerprint: Option<&[u8]>) = format!(
            "INSERT INTO {{t}} (scope, `key`, state, locked_until, token, attempts, \
             completed_at, fingerprint, created_at) VALUES (:scope, :key, 'in_progress', \
             {}, LAST_INSERT_ID({CLOCK_TOKEN}), 1, NULL, :fingerprint, UTC_TIMESTAMP(6))",
            from_now(":lease_ms")
        );
        // Concurrent takers queue on the row lock and re-read it: only the first still
        // matches. The token is the clock's, or one more than the last holder's. Another
        // payload never takes over.
        take(scope: &str, key: &str, lease_ms: i64, fingerprint: Option<&[u8]>) = format!(
            "UPDATE {{t}} SET token = LAST_INSERT_ID(GREATEST(COALESCE(token, 0) + 1, \
             {CLOCK_TOKEN})), attempts = attempts + 1, locked_until = {}, \
             fingerprint = COALESCE(fingerprint, :fingerprint) \
             WHERE scope = :scope AND `key` = :key AND state = 'in_progress' \
             AND (locked_until IS NULL OR locked_until <= UTC_TIMESTAMP(6)) \
             AND (fingerprint IS NULL OR fingerprint = COALESCE(:fingerprint, fingerprint))",
            from_now(":lease_ms")
        );
        state(scope: &str, key: &str) = format!(
            "SELECT state, {LEASE_OVER}, fingerprint, CAST(result AS CHAR), error, \
             CAST(attempts AS SIGNED) FROM {{t}} WHERE scope = :scope AND `key` = :key"
        );
    }
}

/// A lease claim's statement, never waiting longer than its `wait` (or [`AT_ONCE`]) behind
/// another holder of the key (MariaDB; MySQL 8 waits the session's lock wait).
fn bounded_by(statement: Bound<MySql>, c: &Claimant<'_>) -> Bound<MySql> {
    let text = bounded(statement.text(), Some(c.wait.unwrap_or(AT_ONCE)));
    statement.on(text)
}

/// `Backend::lease_claim`: the insert; on a duplicate key, the marker read before anything is
/// written to it (a completed marker or a live lease, the most common answers, is never
/// written to, so that duplicates do not queue on its row lock), then a free one taken over.
pub(super) async fn claim(
    pool: &Pool<MySql>,
    sql: &Sql<MySql>,
    c: Claimant<'_>,
    lease_ms: i64,
) -> Result<LeaseState, sqlx::Error> {
    let insert = sql
        .own
        .lease
        .insert(c.scope, c.key, lease_ms, c.fingerprint);
    match bounded_by(insert, &c).result(pool).await {
        Ok(done) => {
            let token = i64::try_from(done.last_insert_id()).unwrap_or(i64::MAX);
            return Ok(LeaseState::Taken { token, attempts: 1 });
        }
        Err(e) if number(&e) == Some(ER_DUP_ENTRY) => {}
        Err(e) => return Err(e),
    }
    type Row = (
        String,
        i64,
        Option<Vec<u8>>,
        Option<String>,
        Option<String>,
        i64,
    );
    let row: Option<Row> = sql
        .own
        .lease
        .state(c.scope, c.key)
        .fetch_optional(pool)
        .await?;
    let Some((state, over, fingerprint, result, error, attempts)) = row else {
        return Ok(LeaseState::Missing);
    };
    let found = Found::of_row((state, over, fingerprint, result, error));
    if found.status != Status::Free {
        return Ok(LeaseState::Found(found));
    }
    let take = sql.own.lease.take(c.scope, c.key, lease_ms, c.fingerprint);
    let taken = bounded_by(take, &c).result(pool).await?;
    if taken.rows_affected() == 1 {
        let token = i64::try_from(taken.last_insert_id()).unwrap_or(i64::MAX);
        return Ok(LeaseState::Taken {
            token,
            attempts: attempts + 1,
        });
    }
    // Taken by another delivery (or refused for another payload) between the statements: the
    // claim asks again, and decides on what it reads then.
    Ok(LeaseState::Found(found))
}
