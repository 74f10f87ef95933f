//! MySQL and MariaDB: one code path serves both servers. Where they differ, the statement
//! text carries both, in MariaDB's executable comments (`/*M! .. */`, run by MariaDB only).

mod batch;

use std::time::Duration;

use sqlx::mysql::MySqlDatabaseError;
use sqlx::{
    AssertSqlSafe, Connection as _, MySql, Pool, Row as _, SqlSafeStr as _, SqlStr, Transaction,
};

use super::sealed::Dialect;
use super::{
    Backend, Check, Claimant, Found, Hold, LeaseOp, LeaseState, MarkerRow, Statements, Table,
    Templates,
};
use crate::outgoing::Pending;
use crate::{ClaimOptions, Message};
use batch::hex;

impl Backend for MySql {}

const ER_DUP_ENTRY: u16 = 1062;
const ER_LOCK_DEADLOCK: u16 = 1213;
const ER_LOCK_WAIT_TIMEOUT: u16 = 1205;

/// The largest `innodb_lock_wait_timeout` MariaDB accepts (MySQL accepts more).
const MAX_LOCK_WAIT_SECONDS: u64 = 100_000_000;

/// MySQL 8 only (a no-op on MariaDB, which bounds each claim statement instead): puts the
/// session's lock wait back to the server's default after a claim that set it.
const RESTORE_WAIT: &str = "SET @@SESSION.innodb_lock_wait_timeout = IF(/*M! 1 OR */ 0, \
    @@SESSION.innodb_lock_wait_timeout, @@GLOBAL.innodb_lock_wait_timeout)";

/// Whether a lease is over, on the server's clock.
const LEASE_OVER: &str = "CAST(locked_until IS NULL OR locked_until <= UTC_TIMESTAMP(6) AS SIGNED)";

// `key` is a reserved word in MySQL. `scope` and `key` are byte strings (the `binary`
// collation), compared byte for byte: keys that differ in case or in trailing spaces stay
// distinct. `utf8mb4_bin` would not do: it is a PAD SPACE collation in MariaDB and MySQL 5.7,
// so `x` and `x ` collide on the primary key. 255 bytes is `MAX_KEY_LEN`; the bytes are the
// UTF-8 that sqlx sends. Index names are per table in MySQL, so the index needs no table
// prefix (which made a 63-character table name exceed the 64-character identifier limit).
const DDL: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS {t} (
        scope VARBINARY(255) NOT NULL,
        `key` VARBINARY(255) NOT NULL,
        state VARCHAR(16) NOT NULL DEFAULT 'completed',
        fingerprint VARBINARY(64) NULL,
        result JSON NULL,
        locked_until DATETIME(6) NULL,
        token BIGINT NULL,
        attempts INT NOT NULL DEFAULT 1,
        created_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
        completed_at DATETIME(6) NULL,
        PRIMARY KEY (scope, `key`),
        KEY idem_completed_at (state, completed_at),
        CHECK (state IN ('in_progress', 'completed'))
    ) ENGINE = InnoDB",
    // Schema version 2: the outbox, written in the claim's transaction, read by the relay.
    // Times are UTC, written by the statements (as the markers' are).
    "CREATE TABLE IF NOT EXISTS {t}_outbox (
        id VARBINARY(255) NOT NULL,
        destination VARBINARY(255) NOT NULL,
        payload LONGBLOB NOT NULL,
        scope VARBINARY(255) NOT NULL,
        `key` VARBINARY(255) NOT NULL,
        seq INT NOT NULL,
        created_at DATETIME(6) NOT NULL,
        attempts INT NOT NULL DEFAULT 0,
        next_attempt_at DATETIME(6) NOT NULL,
        last_error TEXT NULL,
        parked BOOLEAN NOT NULL DEFAULT FALSE,
        sent_at DATETIME(6) NULL,
        PRIMARY KEY (id),
        KEY idem_outbox_due (sent_at, parked, next_attempt_at),
        KEY idem_outbox_sent_at (sent_at)
    ) ENGINE = InnoDB",
];

/// The outbox's statements, bound as on PostgreSQL; the take is two (`batch.rs`): the due
/// messages locked with `SKIP LOCKED` (MariaDB 10.6, MySQL 8), then held by id.
const OUTBOX: [&str; 5] = [
    "INSERT INTO {t}_outbox (id, destination, payload, scope, `key`, seq, created_at, \
     next_attempt_at) VALUES (?, ?, ?, ?, ?, ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6)) \
     ON DUPLICATE KEY UPDATE id = id",
    "SELECT id, destination, payload, seq, attempts FROM {t}_outbox WHERE sent_at IS NULL \
     AND parked = FALSE AND next_attempt_at <= UTC_TIMESTAMP(6) \
     ORDER BY created_at, seq LIMIT ? FOR UPDATE SKIP LOCKED",
    "UPDATE {t}_outbox SET sent_at = UTC_TIMESTAMP(6) WHERE id = ?",
    "UPDATE {t}_outbox SET attempts = attempts + 1, last_error = ?, \
     next_attempt_at = UTC_TIMESTAMP(6) + INTERVAL (? * 1000) MICROSECOND, parked = ? \
     WHERE id = ?",
    "DELETE FROM {t}_outbox WHERE sent_at < UTC_TIMESTAMP(6) - INTERVAL (? * 1000) \
     MICROSECOND ORDER BY sent_at LIMIT ?",
];

/// The outbox's operator statements: list (parked, pending, limit), find (id), requeue (id).
const OUTBOX_COLUMNS: &str = "CONVERT(id USING utf8mb4), CONVERT(destination USING utf8mb4), \
    CONVERT(scope USING utf8mb4), CONVERT(`key` USING utf8mb4), CAST(seq AS SIGNED), \
    CAST(attempts AS SIGNED), last_error, CAST(parked AS SIGNED), \
    CAST(sent_at IS NOT NULL AS SIGNED), DATE_FORMAT(created_at, '%Y-%m-%dT%H:%i:%s.%fZ'), \
    CAST(TIMESTAMPDIFF(MICROSECOND, created_at, UTC_TIMESTAMP(6)) DIV 1000 AS SIGNED), \
    CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), next_attempt_at) DIV 1000 AS SIGNED)";

/// The columns of `Store::inspect`: times as ISO-8601 UTC text (idem writes them in UTC), and
/// the lease's time left on the database's clock.
const MARKER_COLUMNS: &str = "CONVERT(scope USING utf8mb4), CONVERT(`key` USING utf8mb4), state, \
    CAST(attempts AS SIGNED), token, \
    DATE_FORMAT(created_at, '%Y-%m-%dT%H:%i:%s.%fZ'), \
    DATE_FORMAT(completed_at, '%Y-%m-%dT%H:%i:%s.%fZ'), \
    DATE_FORMAT(locked_until, '%Y-%m-%dT%H:%i:%s.%fZ'), \
    CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), locked_until) DIV 1000 AS SIGNED)";

fn number(err: &sqlx::Error) -> Option<u16> {
    err.as_database_error()
        .and_then(|e| e.try_downcast_ref::<MySqlDatabaseError>())
        .map(MySqlDatabaseError::number)
}

/// `statement` with its lock waits bounded by `wait`: on MariaDB by `SET STATEMENT .. FOR`,
/// which lasts for this statement only, so nothing is left on the pooled connection whatever
/// happens next (a cancelled future, a panic, a failed claim). MySQL ignores the comment and
/// runs under the session value [`begin_sql`](Dialect::begin_sql) set.
fn bounded(statement: &str, wait: Option<Duration>) -> SqlStr {
    match wait {
        None => AssertSqlSafe(statement.to_owned()).into_sql_str(),
        Some(wait) => AssertSqlSafe(format!(
            "/*M!100300 SET STATEMENT innodb_lock_wait_timeout = {} FOR */ {statement}",
            seconds(wait)
        ))
        .into_sql_str(),
    }
}

fn seconds(wait: Duration) -> u64 {
    super::whole_seconds(wait).min(MAX_LOCK_WAIT_SECONDS)
}

impl Dialect for MySql {
    const BACKEND: &'static str = "mysql";

    fn statements(table: &Table) -> Statements {
        let inspect = format!("SELECT {MARKER_COLUMNS} FROM {{t}} WHERE scope = ? AND `key` = ?");
        let in_progress = format!(
            "SELECT {MARKER_COLUMNS} FROM {{t}} WHERE scope = ? AND state = 'in_progress' ORDER BY locked_until IS NOT NULL, locked_until LIMIT ?"
        );
        let in_progress_all = format!(
            "SELECT {MARKER_COLUMNS} FROM {{t}} WHERE state = 'in_progress' ORDER BY locked_until IS NOT NULL, locked_until, scope LIMIT ?"
        );
        let marker = format!(
            "SELECT state, {LEASE_OVER}, fingerprint, CAST(result AS CHAR) FROM {{t}} \
             WHERE scope = ? AND `key` = ?"
        );
        // Binds: nonce, fingerprint, scope, key, fingerprint, fingerprint. A free lease
        // becomes this transaction's completed marker, its token this claim's nonce, which
        // fences the old holder out and lets the commit find the marker.
        let take_over = "UPDATE {t} SET state = 'completed', completed_at = UTC_TIMESTAMP(6), \
             locked_until = NULL, token = ?, attempts = attempts + 1, result = NULL, \
             fingerprint = COALESCE(fingerprint, ?) \
             WHERE scope = ? AND `key` = ? AND state = 'in_progress' \
             AND (locked_until IS NULL OR locked_until <= UTC_TIMESTAMP(6)) \
             AND (fingerprint IS NULL OR ? IS NULL OR fingerprint = ?)";
        let lease_state = format!(
            "SELECT state, {LEASE_OVER}, fingerprint, CAST(result AS CHAR), \
             CAST(attempts AS SIGNED) FROM {{t}} WHERE scope = ? AND `key` = ?"
        );
        Templates {
            begin: "BEGIN",
            // A plain INSERT: `INSERT IGNORE` would turn every error into a warning, and
            // `ON DUPLICATE KEY UPDATE` reports a row under sqlx's CLIENT_FOUND_ROWS. Times
            // are UTC whatever the session's time zone: `DATETIME` holds no zone, and workers
            // in different zones must agree when a lease runs out. Binds: scope, key,
            // fingerprint, nonce.
            claim: "INSERT INTO {t} (scope, `key`, fingerprint, token, created_at, \
                    completed_at) VALUES (?, ?, ?, ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))",
            claim_or_read: "",
            marker: &marker,
            take_over,
            // Built per batch (`batch.rs`), which documents them.
            claim_batch: "",
            batch_markers: "",
            take_over_batch: "",
            // Binds: the value, then scope and key.
            record: "UPDATE {t} SET result = ? WHERE scope = ? AND `key` = ?",
            forget: "DELETE FROM {t} WHERE scope = ? AND `key` = ?",
            inspect: &inspect,
            in_progress: &in_progress,
            in_progress_all: &in_progress_all,
            purge: "DELETE FROM {t} WHERE state = 'completed' \
                        AND completed_at < UTC_TIMESTAMP(6) - INTERVAL (? * 1000) MICROSECOND \
                        ORDER BY completed_at LIMIT ?",
            // Binds: scope, key, lease ms, fingerprint. Error 1062 sends the claim to
            // `takeover`.
            lease_claim: "INSERT INTO {t} (scope, `key`, state, locked_until, token, \
                              attempts, completed_at, fingerprint, created_at) \
                              VALUES (?, ?, 'in_progress', \
                              UTC_TIMESTAMP(6) + INTERVAL (? * 1000) MICROSECOND, 1, 1, \
                              NULL, ?, UTC_TIMESTAMP(6))",
            // Binds: lease ms, fingerprint, scope, key, fingerprint, fingerprint. The
            // UPDATE has no RETURNING here, so the new token comes back as the
            // statement's last insert id. Concurrent takers queue on the row lock and
            // re-read it: only the first still matches. Another payload never takes over.
            lease_takeover: "UPDATE {t} SET token = LAST_INSERT_ID(token + 1), \
                                 attempts = attempts + 1, \
                                 locked_until = UTC_TIMESTAMP(6) \
                                 + INTERVAL (? * 1000) MICROSECOND, \
                                 fingerprint = COALESCE(fingerprint, ?) \
                                 WHERE scope = ? AND `key` = ? AND state = 'in_progress' \
                                 AND (locked_until IS NULL \
                                 OR locked_until <= UTC_TIMESTAMP(6)) \
                                 AND (fingerprint IS NULL OR ? IS NULL OR fingerprint = ?)",
            lease_state: &lease_state,
            // Binds: the value, scope, key, token.
            lease_complete: "UPDATE {t} SET state = 'completed', \
                                 completed_at = UTC_TIMESTAMP(6), locked_until = NULL, \
                                 result = ? WHERE scope = ? AND `key` = ? AND token = ? \
                                 AND state = 'in_progress'",
            // Binds: scope, key, token.
            lease_release: "UPDATE {t} SET locked_until = NULL WHERE scope = ? \
                                AND `key` = ? AND token = ? AND state = 'in_progress'",
            // Binds: lease ms, scope, key, token.
            lease_renew: "UPDATE {t} SET locked_until = UTC_TIMESTAMP(6) \
                              + INTERVAL (? * 1000) MICROSECOND \
                              WHERE scope = ? AND `key` = ? AND token = ? \
                              AND state = 'in_progress'",
            outbox: OUTBOX,
            outbox_ops: [
                &format!(
                    "SELECT {OUTBOX_COLUMNS} FROM {{t}}_outbox WHERE sent_at IS NULL \
                     AND ((parked AND ?) OR (NOT parked AND ?)) \
                     ORDER BY parked DESC, created_at, seq LIMIT ?"
                ),
                &format!("SELECT {OUTBOX_COLUMNS} FROM {{t}}_outbox WHERE id = ?"),
                "UPDATE {t}_outbox SET parked = FALSE, attempts = 0, \
                 next_attempt_at = UTC_TIMESTAMP(6) \
                 WHERE id = ? AND parked AND sent_at IS NULL",
            ],
            ddl: DDL,
        }
        .fill(table)
    }

    fn begin_sql(st: &Statements, options: &ClaimOptions) -> SqlStr {
        if options.is_default() {
            return st.begin.clone();
        }
        // One text-protocol message. MySQL 8 has no per-statement lock wait, so there `wait`
        // sets the session's for the transaction, and `commit` and `rollback` put it back;
        // MariaDB keeps its session value (the comment turns the assignment into a no-op) and
        // bounds the claim's statements instead.
        let mut begin = String::new();
        if let Some(wait) = options.wait {
            begin.push_str(&format!(
                "SET @@SESSION.innodb_lock_wait_timeout = \
                 /*M! @@SESSION.innodb_lock_wait_timeout + 0 * */ {}; ",
                seconds(wait)
            ));
        }
        if let Some(level) = options.isolation {
            // Without SESSION, for the next transaction only.
            begin.push_str(&format!(
                "SET TRANSACTION ISOLATION LEVEL {}; ",
                level.sql()
            ));
        }
        begin.push_str("BEGIN");
        AssertSqlSafe(begin).into_sql_str()
    }

    async fn commit<'a>(
        mut tx: Transaction<'a, Self>,
        check: Check<'a>,
        options: &'a ClaimOptions,
    ) -> Result<bool, sqlx::Error> {
        // A deadlock inside the body rolls the whole transaction back, marker included, and
        // later statements run in autocommit; `COMMIT` then succeeds with nothing to commit.
        // What the same message reads first tells the two apart: the marker holding this
        // claim's nonce exists only while its transaction does (or once it committed: an
        // implicit commit by DDL in the body kept marker and effect together, which is what
        // `Applied` says). A transaction of the caller's has no marker of ours: there MariaDB
        // reads `@@in_transaction` and MySQL 8, which lacks it, cannot check. The trailing
        // `BEGIN` is for sqlx's bookkeeping: dropping `tx` queues its `ROLLBACK`, which the
        // pool's ping on release flushes.
        let probe = match check {
            Check::Marker(st, c) => format!(
                "SELECT COUNT(*) FROM {} WHERE scope = {} AND `key` = {} AND token = {}",
                st.table.as_str(),
                hex(c.scope),
                hex(c.key),
                c.nonce
            ),
            Check::Session => "SELECT CAST(1 /*M! * @@in_transaction */ AS SIGNED)".to_owned(),
        };
        let sql = match options.wait {
            None => format!("{probe}; COMMIT; BEGIN"),
            Some(_) => format!("{probe}; COMMIT; {RESTORE_WAIT}; BEGIN"),
        };
        let rows = sqlx::raw_sql(AssertSqlSafe(sql))
            .fetch_all(&mut *tx)
            .await?;
        let open: i64 = match rows.first() {
            Some(row) => row.try_get(0)?,
            None => 0,
        };
        Ok(open == 1)
    }

    async fn rollback<'a>(
        mut tx: Transaction<'a, Self>,
        options: &'a ClaimOptions,
    ) -> Result<(), sqlx::Error> {
        if options.wait.is_none() {
            return tx.rollback().await;
        }
        let sql = format!("ROLLBACK; {RESTORE_WAIT}; BEGIN");
        sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut *tx).await?;
        Ok(())
    }

    async fn abandon<'a>(
        tx: Transaction<'a, Self>,
        options: &'a ClaimOptions,
    ) -> Result<(), sqlx::Error> {
        // MySQL 8: a `wait` changed the session's lock timeout, which only the rollback
        // message restores.
        if options.wait.is_some() {
            return Self::rollback(tx, options).await;
        }
        drop(tx);
        Ok(())
    }

    fn is_lock_timeout(err: &sqlx::Error) -> bool {
        number(err) == Some(ER_LOCK_WAIT_TIMEOUT)
    }

    fn is_transient(err: &sqlx::Error) -> bool {
        // InnoDB may pick a waiter as deadlock victim when the first claimer rolls back.
        number(err) == Some(ER_LOCK_DEADLOCK)
    }

    async fn try_claim<'t>(
        conn: &'t mut Self::Connection,
        st: &'t Statements,
        c: Claimant<'t>,
    ) -> Result<bool, sqlx::Error> {
        let statement = match c.wait {
            None => st.claim.clone(),
            Some(_) => bounded(st.claim.as_str(), c.wait),
        };
        match sqlx::query(statement)
            .bind(c.scope)
            .bind(c.key)
            .bind(c.fingerprint)
            .bind(c.nonce)
            .execute(&mut *conn)
            .await
        {
            Ok(_) => Ok(true),
            Err(e) if number(&e) == Some(ER_DUP_ENTRY) => Ok(false),
            Err(e) => Err(e),
        }
    }

    async fn take_over<'t>(
        conn: &'t mut Self::Connection,
        st: &'t Statements,
        c: Claimant<'t>,
    ) -> Result<bool, sqlx::Error> {
        // CLIENT_FOUND_ROWS counts the rows the WHERE matched, each of which this changed.
        let done = sqlx::query(bounded(st.take_over.as_str(), c.wait))
            .bind(c.nonce)
            .bind(c.fingerprint)
            .bind(c.scope)
            .bind(c.key)
            .bind(c.fingerprint)
            .bind(c.fingerprint)
            .execute(&mut *conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn try_claim_batch<'t>(
        conn: &'t mut Self::Connection,
        st: &'t Statements,
        c: Claimant<'t>,
        keys: &'t [&'t str],
    ) -> Result<Vec<String>, sqlx::Error> {
        batch::claim(conn, st, c, keys).await
    }

    async fn batch_markers<'t>(
        conn: &'t mut Self::Connection,
        st: &'t Statements,
        scope: &'t str,
        keys: &'t [&'t str],
    ) -> Result<Vec<(String, Hold)>, sqlx::Error> {
        batch::markers(conn, st, scope, keys).await
    }

    async fn take_over_batch<'t>(
        conn: &'t mut Self::Connection,
        st: &'t Statements,
        c: Claimant<'t>,
        keys: &'t [&'t str],
    ) -> Result<Vec<String>, sqlx::Error> {
        batch::take_over(conn, st, c, keys).await
    }

    super::shared::outbox_write_each!();
    super::shared::outbox_numbered!();

    async fn outbox_take<'p>(
        pool: &'p Pool<Self>,
        st: &'p Statements,
        limit: i64,
        lease_ms: i64,
    ) -> Result<Vec<Message>, sqlx::Error> {
        batch::outbox_take(pool, st, limit, lease_ms).await
    }

    async fn record<'t>(
        conn: &'t mut Self::Connection,
        st: &'t Statements,
        scope: &'t str,
        key: &'t str,
        json: &'t str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(st.record.clone())
            .bind(json)
            .bind(scope)
            .bind(key)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    async fn migrate<'p>(pool: &'p Pool<Self>, st: &'p Statements) -> Result<(), sqlx::Error> {
        // DDL commits implicitly in MySQL, so a named lock is what makes concurrent workers
        // take turns. The lock belongs to the session: the connection is detached from the
        // pool, so that a cancelled migration closes it (and the server frees the lock)
        // instead of returning it to the pool still holding the lock.
        let mut conn = pool.acquire().await?.detach();
        // MySQL 5.7+ refuses lock names over 64 characters; two long names that share a
        // prefix then share a lock, which only makes them take turns.
        let mut lock = format!("idem.migrate.{}", st.table.as_str());
        lock.truncate(64);
        let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 60)")
            .bind(&lock)
            .fetch_one(&mut conn)
            .await?;
        if got != Some(1) {
            return Err(sqlx::Error::Protocol(format!(
                "GET_LOCK({lock:?}, 60) answered {got:?}: another migration of the table held \
                 the lock for 60 s; try again"
            )));
        }
        let mut result = Ok(());
        for stmt in &st.ddl {
            if let Err(e) = sqlx::query(stmt.clone()).execute(&mut conn).await {
                result = Err(e);
                break;
            }
        }
        // The DDL's own error, if any, is the one worth reporting.
        let released = sqlx::query("SELECT RELEASE_LOCK(?)")
            .bind(&lock)
            .execute(&mut conn)
            .await;
        result?;
        released?;
        conn.close().await
    }

    async fn lease_claim<'p>(
        pool: &'p Pool<Self>,
        st: &'p Statements,
        c: Claimant<'p>,
        lease_ms: i64,
    ) -> Result<LeaseState, sqlx::Error> {
        let inserted = sqlx::query(st.lease_claim.clone())
            .bind(c.scope)
            .bind(c.key)
            .bind(lease_ms)
            .bind(c.fingerprint)
            .execute(pool)
            .await;
        match inserted {
            Ok(_) => {
                return Ok(LeaseState::Taken {
                    token: 1,
                    attempts: 1,
                });
            }
            Err(e) if number(&e) == Some(ER_DUP_ENTRY) => {}
            Err(e) => return Err(e),
        }
        let taken = sqlx::query(st.lease_takeover.clone())
            .bind(lease_ms)
            .bind(c.fingerprint)
            .bind(c.scope)
            .bind(c.key)
            .bind(c.fingerprint)
            .bind(c.fingerprint)
            .execute(pool)
            .await?;
        type Row = (String, i64, Option<Vec<u8>>, Option<String>, i64);
        let row: Option<Row> = sqlx::query_as(st.lease_state.clone())
            .bind(c.scope)
            .bind(c.key)
            .fetch_optional(pool)
            .await?;
        if taken.rows_affected() == 1 {
            let token = i64::try_from(taken.last_insert_id()).unwrap_or(i64::MAX);
            // The lease is ours until it runs out, so the row read back is our own.
            let attempts = row.map_or(1, |(.., attempts)| attempts);
            return Ok(LeaseState::Taken { token, attempts });
        }
        Ok(match row {
            Some((state, over, fingerprint, result, _)) => {
                LeaseState::Found(Found::of_row((state, over, fingerprint, result)))
            }
            None => LeaseState::Missing,
        })
    }

    async fn lease_update<'p>(
        pool: &'p Pool<Self>,
        st: &'p Statements,
        op: LeaseOp,
        scope: &'p str,
        key: &'p str,
        token: i64,
        lease_ms: i64,
        result: Option<&'p str>,
    ) -> Result<bool, sqlx::Error> {
        let query = match op {
            LeaseOp::Complete => sqlx::query(st.lease_complete.clone()).bind(result),
            LeaseOp::Release => sqlx::query(st.lease_release.clone()),
            LeaseOp::Renew => sqlx::query(st.lease_renew.clone()).bind(lease_ms),
        };
        let done = query
            .bind(scope)
            .bind(key)
            .bind(token)
            .execute(pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    super::shared::pool_statements!();
}
