//! Claims in a transaction on PostgreSQL: `INSERT ... ON CONFLICT DO NOTHING`, the marker it
//! meets read in the same statement, the claim's lock wait bounded by `SET LOCAL` in the
//! `BEGIN` and put back by the claim itself, and the verified commit.

use sqlx::{AssertSqlSafe, Pool, Postgres, SqlSafeStr as _, SqlStr, Transaction};

use super::{IN_FAILED_TRANSACTION, LEASE_OVER, database_code};
use crate::backend::bind::statements;
use crate::backend::claim::{ClaimText, Words};
use crate::backend::{Claimant, Found, Savepoint, Sql};
use crate::options::ClaimOptions;

/// The session's lock wait as it was before a claim with `wait` bounded it
/// (`idem.lock_timeout`, set by the claim's begin): what the claim's last statement puts back.
const UNBOUND: &str = "set_config('lock_timeout', current_setting('idem.lock_timeout'), true)";

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
         VALUES (:scope, :key, :fingerprint, :nonce, now()) ON CONFLICT DO NOTHING RETURNING 1) \
         SELECT m.state, \
         (m.locked_until IS NULL OR m.locked_until <= statement_timestamp())::int::int8, \
         m.fingerprint, CASE WHEN :replay THEN m.result::text END, m.error \
         FROM (SELECT 1 WHERE CASE WHEN EXISTS (SELECT 1 FROM ins) THEN {when_inserted} \
         ELSE true END) AS one LEFT JOIN {{t}} AS m ON m.scope = :scope AND m.key = :key"
    )
}

/// A batch statement's scope, as a value the planner cannot see. Shown the scope itself, it
/// reads the scope's frequency from the table's statistics, which say nothing of a scope that
/// was new or rare at the last `ANALYZE`: it then expects one row, finds scanning the scope
/// alone as cheap as looking up each key (PostgreSQL before 17 prices an `= ANY` on the index's
/// second column by its descents) and filters the keys out of every marker of the scope.
const SCOPE: &str = "(SELECT :scope::text)";

/// The texts of the claim statements every backend runs.
pub(super) fn text() -> ClaimText {
    ClaimText {
        // One statement for the whole batch: the keys travel as one array, so no bind limit
        // applies, and `ORDER BY k` makes every batch take its row locks in the same order, so
        // that two overlapping batches queue instead of deadlocking.
        claim_batch: Some(
            "INSERT INTO {t} (scope, key, token, completed_at) \
             SELECT :scope, k, :nonce, now() FROM unnest(:keys::text[]) AS u(k) ORDER BY k \
             ON CONFLICT DO NOTHING RETURNING key"
                .into(),
        ),
        ..ClaimText::of(Words {
            key: "key",
            now: "now()",
            lease_over: LEASE_OVER,
            lease_over_int: &format!("{LEASE_OVER}::int::int8"),
            result: "result::text",
            json: ":json::json",
            same_payload: "(fingerprint IS NULL OR :fingerprint::bytea IS NULL \
                           OR fingerprint = :fingerprint)",
            batch: Some(&format!("scope = {SCOPE} AND key = ANY(:keys::text[])")),
        })
    }
}

statements! {
    /// PostgreSQL's own claim statements: the claim that reads the marker it meets, and the
    /// forms that put a bounded lock wait back.
    pub(super) struct Statements {
        claim_or_read(scope: &str, key: &str, fingerprint: Option<&[u8]>, nonce: i64, replay: bool) =
            claim_or_read("false");
        /// With `wait`: puts the session's lock wait back once it inserted.
        claim_or_read_bounded(scope: &str, key: &str, fingerprint: Option<&[u8]>, nonce: i64, replay: bool) =
            claim_or_read(&format!("{UNBOUND} IS NULL"));
        /// With `wait`: puts the session's lock wait back once it took the lease.
        take_over_bounded(scope: &str, key: &str, fingerprint: Option<&[u8]>, nonce: i64) =
            format!("{} RETURNING {UNBOUND}", text().take_over);
        /// The session's lock wait back after a batch claimed with `wait`.
        unbind() = format!("SELECT {UNBOUND}");
    }
}

impl Statements<Postgres> {
    /// `Backend::claim_or_read`: one statement, which answers no row on the fresh path.
    pub(super) async fn claim_or_read_in(
        &self,
        conn: &mut sqlx::PgConnection,
        c: Claimant<'_>,
        replay: bool,
    ) -> Result<(bool, Option<Found>), sqlx::Error> {
        type Row = (
            Option<String>,
            Option<i64>,
            Option<Vec<u8>>,
            Option<String>,
            Option<String>,
        );
        let (scope, key, fp, nonce) = (c.scope, c.key, c.fingerprint, c.nonce);
        let statement = match c.wait {
            None => self.claim_or_read(scope, key, fp, nonce, replay),
            Some(_) => self.claim_or_read_bounded(scope, key, fp, nonce, replay),
        };
        let Some((state, over, fingerprint, result, error)) =
            statement.fetch_optional::<Row>(conn).await?
        else {
            return Ok((true, None));
        };
        let found = state
            .map(|state| Found::of_row((state, over.unwrap_or(1), fingerprint, result, error)));
        Ok((false, found))
    }

    /// `Backend::take_over`, putting a bounded lock wait back.
    pub(super) async fn take_over_in(
        &self,
        conn: &mut sqlx::PgConnection,
        sql: &Sql<Postgres>,
        c: Claimant<'_>,
    ) -> Result<bool, sqlx::Error> {
        if c.wait.is_none() {
            return sql.claim.take_over_plain(conn, c).await;
        }
        let take = self.take_over_bounded(c.scope, c.key, c.fingerprint, c.nonce);
        Ok(take.execute(conn).await? == 1)
    }

    /// `Backend::batch_claimed`: a batch's statements leave the wait bounded (which of them is
    /// the last is known only from their answers): one statement more, for a whole batch, and
    /// only with `wait`.
    pub(super) async fn unbound(
        &self,
        conn: &mut sqlx::PgConnection,
        options: &ClaimOptions,
    ) -> Result<(), sqlx::Error> {
        if options.wait.is_some() {
            self.unbind().execute(conn).await?;
        }
        Ok(())
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
pub(super) async fn commit_checked(mut tx: Transaction<'_, Postgres>) -> Result<bool, sqlx::Error> {
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

/// `Backend::begin`: one simple-query message.
pub(super) async fn begin(
    pool: &Pool<Postgres>,
    options: &ClaimOptions,
) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
    if options.is_default() {
        return pool.begin().await;
    }
    pool.begin_with(AssertSqlSafe(begin_sql(options)).into_sql_str())
        .await
}

/// `Backend::savepoint`.
pub(super) async fn savepoint(
    conn: &mut sqlx::PgConnection,
    step: Savepoint,
) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(savepoint_sql(step)).execute(conn).await?;
    Ok(())
}
