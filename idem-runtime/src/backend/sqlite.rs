use sqlx::{AssertSqlSafe, Pool, SqlSafeStr as _, SqlStr, Sqlite, Transaction};

use super::sealed::Dialect;
use super::{
    Backend, Check, Claimant, Found, Hold, LeaseOp, LeaseState, MarkerRow, Statements, Table,
    Templates,
};
use crate::outgoing::Pending;
use crate::{ClaimOptions, Message};

/// `SQLITE_BUSY`: the busy timeout ran out waiting for the write lock.
const SQLITE_BUSY: &str = "5";

impl Backend for Sqlite {}

// Text compares with the BINARY collation, so keys differing in case or trailing spaces stay
// distinct. Times are ISO-8601 UTC text, SQLite's own convention.
const DDL: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS {t} (
        scope TEXT NOT NULL,
        key TEXT NOT NULL,
        state TEXT NOT NULL DEFAULT 'completed' CHECK (state IN ('in_progress', 'completed')),
        fingerprint BLOB,
        result TEXT,
        locked_until TEXT,
        token INTEGER,
        attempts INTEGER NOT NULL DEFAULT 1,
        created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
        completed_at TEXT,
        PRIMARY KEY (scope, key)
    ) WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS {t}_completed_at ON {t} (completed_at) WHERE state = 'completed'",
    // Schema version 2: the outbox, written in the claim's transaction, read by the relay.
    "CREATE TABLE IF NOT EXISTS {t}_outbox (
        id TEXT PRIMARY KEY,
        destination TEXT NOT NULL,
        payload BLOB NOT NULL,
        scope TEXT NOT NULL,
        key TEXT NOT NULL,
        seq INTEGER NOT NULL,
        created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
        attempts INTEGER NOT NULL DEFAULT 0,
        next_attempt_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
        last_error TEXT,
        parked INTEGER NOT NULL DEFAULT 0,
        sent_at TEXT
    )",
    "CREATE INDEX IF NOT EXISTS {t}_outbox_due ON {t}_outbox (next_attempt_at) \
     WHERE sent_at IS NULL AND parked = 0",
    "CREATE INDEX IF NOT EXISTS {t}_outbox_sent_at ON {t}_outbox (sent_at) \
     WHERE sent_at IS NOT NULL",
];

/// The outbox's statements, bound as on PostgreSQL. Writers are serialised, so the take needs
/// no row locks: one statement takes and holds the due messages.
const OUTBOX: [&str; 5] = [
    "INSERT INTO {t}_outbox (id, destination, payload, scope, key, seq) \
     VALUES (?1, ?2, ?3, ?4, ?5, ?6) ON CONFLICT DO NOTHING",
    "UPDATE {t}_outbox SET next_attempt_at = \
     strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '+' || (?2 / 1000.0) || ' seconds') \
     WHERE id IN (SELECT id FROM {t}_outbox WHERE sent_at IS NULL AND parked = 0 \
     AND next_attempt_at <= strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
     ORDER BY created_at, seq LIMIT ?1) \
     RETURNING id, destination, payload, seq, attempts, created_at",
    "UPDATE {t}_outbox SET sent_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') WHERE id = ?1",
    "UPDATE {t}_outbox SET attempts = attempts + 1, last_error = ?1, next_attempt_at = \
     strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '+' || (?2 / 1000.0) || ' seconds'), parked = ?3 \
     WHERE id = ?4",
    "DELETE FROM {t}_outbox WHERE id IN (SELECT id FROM {t}_outbox WHERE sent_at < \
     strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-' || (?1 / 1000.0) || ' seconds') LIMIT ?2)",
];

/// The outbox's operator statements: list (parked, pending, limit), find (id), requeue (id).
const OUTBOX_COLUMNS: &str = "id, destination, scope, key, seq, attempts, last_error, \
    parked <> 0, sent_at IS NOT NULL, created_at, \
    CAST((julianday('now') - julianday(created_at)) * 86400000.0 AS INTEGER), \
    CAST((julianday(next_attempt_at) - julianday('now')) * 86400000.0 AS INTEGER)";

/// The columns of `Store::inspect`: times are already ISO-8601 UTC text here; the lease's time
/// left on the database's clock.
const MARKER_COLUMNS: &str = "scope, key, state, attempts, token, created_at, completed_at, \
    locked_until, CAST((julianday(locked_until) - julianday('now')) * 86400000.0 AS INTEGER)";

/// Whether a lease is over: ISO-8601 text compares in time order.
const LEASE_OVER: &str =
    "(locked_until IS NULL OR locked_until <= strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))";

impl Dialect for Sqlite {
    const BACKEND: &'static str = "sqlite";

    fn statements(table: &Table) -> Statements {
        let inspect = format!("SELECT {MARKER_COLUMNS} FROM {{t}} WHERE scope = ?1 AND key = ?2");
        let in_progress = format!(
            "SELECT {MARKER_COLUMNS} FROM {{t}} WHERE scope = ?1 AND state = 'in_progress' ORDER BY locked_until IS NOT NULL, locked_until LIMIT ?2"
        );
        let in_progress_all = format!(
            "SELECT {MARKER_COLUMNS} FROM {{t}} WHERE state = 'in_progress' ORDER BY locked_until IS NOT NULL, locked_until, scope LIMIT ?1"
        );
        let marker = format!(
            "SELECT state, {LEASE_OVER}, fingerprint, result FROM {{t}} \
             WHERE scope = ?1 AND key = ?2"
        );
        // As on PostgreSQL: a free lease becomes this transaction's completed marker.
        let take_over = format!(
            "UPDATE {{t}} SET state = 'completed', \
             completed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), locked_until = NULL, \
             token = COALESCE(token, 0) + 1, attempts = attempts + 1, result = NULL, \
             fingerprint = COALESCE(fingerprint, ?3) \
             WHERE scope = ?1 AND key = ?2 AND state = 'in_progress' AND {LEASE_OVER} \
             AND (fingerprint IS NULL OR ?3 IS NULL OR fingerprint = ?3)"
        );
        let batch_markers = format!(
            "SELECT key, state, {LEASE_OVER} FROM {{t}} \
             WHERE scope = ?1 AND key IN (SELECT value FROM json_each(?2))"
        );
        let take_over_batch = format!(
            "UPDATE {{t}} SET state = 'completed', \
             completed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), locked_until = NULL, \
             token = COALESCE(token, 0) + 1, attempts = attempts + 1, result = NULL \
             WHERE scope = ?1 AND key IN (SELECT value FROM json_each(?2)) \
             AND state = 'in_progress' AND {LEASE_OVER} RETURNING key"
        );
        Templates {
            claim_or_read: "",
            marker: &marker,
            take_over: &take_over,
            batch_markers: &batch_markers,
            take_over_batch: &take_over_batch,
            // A deferred transaction that reads first and writes later can deadlock with
            // another one on the lock upgrade; IMMEDIATE takes the write lock up front,
            // and the connection's busy timeout decides how long a second writer waits.
            begin: "BEGIN IMMEDIATE",
            claim: "INSERT INTO {t} (scope, key, fingerprint, completed_at) \
                        VALUES (?1, ?2, ?3, strftime('%Y-%m-%dT%H:%M:%fZ', 'now')) \
                        ON CONFLICT DO NOTHING",
            // The keys travel as one JSON array, so SQLite's bind limit does not apply.
            // `WHERE true`: without it SQLite would read `ON CONFLICT` as a join
            // constraint of the `SELECT`. Writers are serialised, so the order of the
            // keys cannot deadlock here.
            claim_batch: "INSERT INTO {t} (scope, key, completed_at) \
                              SELECT ?1, value, strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
                              FROM json_each(?2) WHERE true \
                              ON CONFLICT DO NOTHING RETURNING key",
            record: "UPDATE {t} SET result = ?3 WHERE scope = ?1 AND key = ?2",
            forget: "DELETE FROM {t} WHERE scope = ?1 AND key = ?2",
            inspect: &inspect,
            in_progress: &in_progress,
            in_progress_all: &in_progress_all,
            purge: "DELETE FROM {t} WHERE (scope, key) IN (SELECT scope, key FROM {t} \
                        WHERE state = 'completed' AND completed_at < \
                        strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-' || (?1 / 1000.0) || ' seconds') \
                        LIMIT ?2)",
            // As on PostgreSQL; writers are serialised, so there is no race to lose.
            // Times are ISO-8601 text, which compares in time order.
            lease_claim: "INSERT INTO {t} AS m (scope, key, state, locked_until, token, \
                              attempts, completed_at, fingerprint) \
                              VALUES (?1, ?2, 'in_progress', \
                              strftime('%Y-%m-%dT%H:%M:%fZ', 'now', \
                              '+' || (?3 / 1000.0) || ' seconds'), 1, 1, NULL, ?4) \
                              ON CONFLICT (scope, key) DO UPDATE \
                              SET locked_until = excluded.locked_until, \
                              token = m.token + 1, attempts = m.attempts + 1, \
                              fingerprint = COALESCE(m.fingerprint, excluded.fingerprint) \
                              WHERE m.state = 'in_progress' AND (m.locked_until IS NULL \
                              OR m.locked_until <= strftime('%Y-%m-%dT%H:%M:%fZ', 'now')) \
                              AND (m.fingerprint IS NULL OR excluded.fingerprint IS NULL \
                              OR m.fingerprint = excluded.fingerprint) \
                              RETURNING token, attempts",
            lease_takeover: "",
            lease_state: "",
            lease_complete: "UPDATE {t} SET state = 'completed', \
                                 completed_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), \
                                 locked_until = NULL, result = ?4 \
                                 WHERE scope = ?1 AND key = ?2 \
                                 AND token = ?3 AND state = 'in_progress'",
            lease_release: "UPDATE {t} SET locked_until = NULL WHERE scope = ?1 \
                                AND key = ?2 AND token = ?3 AND state = 'in_progress'",
            lease_renew: "UPDATE {t} SET locked_until = strftime('%Y-%m-%dT%H:%M:%fZ', \
                              'now', '+' || (?4 / 1000.0) || ' seconds') \
                              WHERE scope = ?1 AND key = ?2 AND token = ?3 \
                              AND state = 'in_progress'",
            outbox: OUTBOX,
            outbox_ops: [
                &format!(
                    "SELECT {OUTBOX_COLUMNS} FROM {{t}}_outbox WHERE sent_at IS NULL \
                     AND ((parked <> 0 AND ?1) OR (parked = 0 AND ?2)) \
                     ORDER BY parked DESC, created_at, seq LIMIT ?3"
                ),
                &format!("SELECT {OUTBOX_COLUMNS} FROM {{t}}_outbox WHERE id = ?1"),
                "UPDATE {t}_outbox SET parked = 0, attempts = 0, \
                 next_attempt_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
                 WHERE id = ?1 AND parked <> 0 AND sent_at IS NULL",
            ],
            ddl: DDL,
        }
        .fill(table)
    }

    fn begin_sql(st: &Statements, options: &ClaimOptions) -> SqlStr {
        // SQLite's transactions are always serializable, so `isolation` changes nothing. The
        // only lock a claim waits for is the database's write lock, for the connection's busy
        // timeout: `wait` sets that (it stays set on the pooled connection).
        match options.wait {
            None => st.begin.clone(),
            Some(wait) => AssertSqlSafe(format!(
                "PRAGMA busy_timeout = {}; BEGIN IMMEDIATE",
                super::millis(wait)
            ))
            .into_sql_str(),
        }
    }

    async fn commit<'a>(
        mut tx: Transaction<'a, Self>,
        _: Check<'a>,
        _: &'a ClaimOptions,
    ) -> Result<bool, sqlx::Error> {
        // A statement that rolled the whole transaction back (`INSERT OR ROLLBACK`, a full
        // disk) leaves nothing to commit, and SQLite says so. sqlx's own `commit` would then
        // keep counting the transaction as open and hand the connection back to the pool in
        // that state, so the commit is ours, followed (as on the other backends) by a `BEGIN`
        // that dropping `tx` rolls back, leaving sqlx's count right either way.
        match sqlx::raw_sql("COMMIT; BEGIN").execute(&mut *tx).await {
            Ok(_) => Ok(true),
            Err(e) if e.to_string().contains("no transaction is active") => {
                sqlx::raw_sql("BEGIN").execute(&mut *tx).await?;
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    fn is_lock_timeout(err: &sqlx::Error) -> bool {
        err.as_database_error()
            .and_then(|e| e.code())
            .is_some_and(|c| c == SQLITE_BUSY)
    }

    super::shared::claim_on_conflict!();
    super::shared::outbox_write_each!();
    super::shared::outbox_numbered!();

    async fn outbox_take<'p>(
        pool: &'p Pool<Self>,
        st: &'p Statements,
        limit: i64,
        lease_ms: i64,
    ) -> Result<Vec<Message>, sqlx::Error> {
        type Row = (String, String, Vec<u8>, i64, i64, String);
        // `BEGIN IMMEDIATE`, as every writer here: the statement runs in a transaction of
        // its own, waiting for the write lock like a claim.
        let mut tx = pool.begin_with(st.begin.clone()).await?;
        let mut rows: Vec<Row> = sqlx::query_as(st.outbox.due.clone())
            .bind(limit)
            .bind(lease_ms)
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        rows.sort_by(|a, b| (&a.5, a.3).cmp(&(&b.5, b.3)));
        Ok(rows
            .into_iter()
            .map(|(id, destination, payload, seq, attempts, _)| {
                super::shared::message(id, destination, payload, seq, attempts)
            })
            .collect())
    }
    super::shared::batch_one_bind!(
        |keys| serde_json::to_string(keys).expect("strings always serialise")
    );
    super::shared::lease_on_conflict!();

    fn is_transient(_: &sqlx::Error) -> bool {
        // Writers are serialised by the write lock taken at BEGIN IMMEDIATE; a busy timeout
        // running out is the user's configured limit, not a race to retry.
        false
    }

    async fn migrate<'p>(pool: &'p Pool<Self>, st: &'p Statements) -> Result<(), sqlx::Error> {
        let mut tx = pool.begin_with(st.begin.clone()).await?;
        for stmt in &st.ddl {
            sqlx::query(stmt.clone()).execute(&mut *tx).await?;
        }
        tx.commit().await
    }

    super::shared::pool_statements!();
}
