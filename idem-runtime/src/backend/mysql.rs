use sqlx::mysql::MySqlDatabaseError;
use sqlx::{
    AssertSqlSafe, Connection as _, MySql, Pool, Row as _, SqlSafeStr as _, SqlStr, Transaction,
};

use super::{Backend, LeaseOp, Sql, Statements, sealed};
use crate::ClaimOptions;
use crate::Recorded;
use crate::lease::LeaseState;

impl sealed::Sealed for MySql {}

const ER_DUP_ENTRY: u16 = 1062;
const ER_LOCK_DEADLOCK: u16 = 1213;
const ER_LOCK_WAIT_TIMEOUT: u16 = 1205;

/// The largest `innodb_lock_wait_timeout` MariaDB accepts (MySQL accepts more).
const MAX_LOCK_WAIT_SECONDS: u64 = 100_000_000;

/// Puts the session's lock wait back after a claim that set it (`wait`).
const RESTORE_WAIT: &str = "SET @@SESSION.innodb_lock_wait_timeout = DEFAULT";

// `key` is a reserved word in MySQL. `scope` and `key` are byte strings (the `binary`
// collation), compared byte for byte: keys that differ in case or in trailing spaces stay
// distinct. `utf8mb4_bin` would not do: it is a PAD SPACE collation in MariaDB and MySQL 5.7,
// so `x` and `x ` collide on the primary key. 255 bytes is `MAX_KEY_LEN`; the bytes are the
// UTF-8 that sqlx sends. Index names are per table in MySQL, so the index needs no table
// prefix (which made a 63-character table name exceed the 64-character identifier limit).
const DDL: &[&str] = &["CREATE TABLE IF NOT EXISTS {t} (
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
    ) ENGINE = InnoDB"];

/// `value` as a MySQL hex literal (`X'6a6f62'`): its bytes, with nothing to escape.
fn hex(value: &str) -> String {
    hex_bytes(value.as_bytes())
}

fn hex_bytes(value: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(3 + 2 * value.len());
    out.push_str("X'");
    for b in value {
        let _ = write!(out, "{b:02x}");
    }
    out.push('\'');
    out
}

fn number(err: &sqlx::Error) -> Option<u16> {
    err.as_database_error()
        .and_then(|e| e.try_downcast_ref::<MySqlDatabaseError>())
        .map(MySqlDatabaseError::number)
}

/// The columns of `Store::inspect`: times as ISO-8601 UTC text (idem writes them in UTC), and
/// the lease's time left on the database's clock.
const MARKER_COLUMNS: &str = "CONVERT(scope USING utf8mb4), CONVERT(`key` USING utf8mb4), state, \
    CAST(attempts AS SIGNED), token, \
    DATE_FORMAT(created_at, '%Y-%m-%dT%H:%i:%s.%fZ'), \
    DATE_FORMAT(completed_at, '%Y-%m-%dT%H:%i:%s.%fZ'), \
    DATE_FORMAT(locked_until, '%Y-%m-%dT%H:%i:%s.%fZ'), \
    CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), locked_until) DIV 1000 AS SIGNED)";

impl Backend for MySql {
    const BACKEND: &'static str = "mysql";

    fn sql(table: &str) -> Sql {
        let inspect = format!("SELECT {MARKER_COLUMNS} FROM {{t}} WHERE scope = ? AND `key` = ?");
        let in_progress = format!(
            "SELECT {MARKER_COLUMNS} FROM {{t}} WHERE scope = ? AND state = 'in_progress' ORDER BY locked_until IS NOT NULL, locked_until LIMIT ?"
        );
        let in_progress_all = format!(
            "SELECT {MARKER_COLUMNS} FROM {{t}} WHERE state = 'in_progress' ORDER BY locked_until IS NOT NULL, locked_until, scope LIMIT ?"
        );
        Sql::new(
            table,
            Statements {
                begin: "BEGIN",
                // A plain INSERT: `INSERT IGNORE` would turn every error into a warning, and
                // `ON DUPLICATE KEY UPDATE` reports a row under sqlx's CLIENT_FOUND_ROWS.
                // Times are UTC whatever the session's time zone: `DATETIME` holds no zone,
                // and workers in different zones must agree when a lease runs out.
                claim: "INSERT INTO {t} (scope, `key`, fingerprint, created_at, completed_at) \
                        VALUES (?, ?, ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))",
                // Built per batch by `try_claim_batch`, which documents it.
                claim_batch: "",
                recorded: "SELECT fingerprint, CAST(result AS CHAR) FROM {t} \
                           WHERE scope = ? AND `key` = ?",
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
                lease_state: "SELECT state, fingerprint, CAST(result AS CHAR), \
                              CAST(attempts AS SIGNED) FROM {t} WHERE scope = ? AND `key` = ?",
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
                ddl: DDL,
            },
        )
    }

    fn begin_sql(sql: &Sql, options: &ClaimOptions) -> SqlStr {
        if options.is_default() {
            return sql.begin.clone();
        }
        // One text-protocol message. The lock wait is a session variable: `commit` and
        // `rollback` set it back to the server's default.
        let mut begin = String::new();
        if let Some(wait) = options.wait {
            let secs = super::whole_seconds(wait).min(MAX_LOCK_WAIT_SECONDS);
            begin.push_str(&format!(
                "SET @@SESSION.innodb_lock_wait_timeout = {secs}; "
            ));
        }
        if let Some(level) = options.isolation {
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
        _: &'a Sql,
        options: &'a ClaimOptions,
    ) -> Result<bool, sqlx::Error> {
        // A deadlock inside the body rolls the whole transaction back, marker included, and
        // later statements run in autocommit; `COMMIT` then succeeds with nothing to commit.
        // `@@in_transaction`, read in the same message, tells whether ours was still open.
        // The trailing `BEGIN` is for sqlx's bookkeeping, as on PostgreSQL: dropping `tx`
        // queues its `ROLLBACK`, which the pool's ping on release flushes.
        let sql = match options.wait {
            None => "SELECT CAST(@@in_transaction AS SIGNED); COMMIT; BEGIN",
            Some(_) => {
                "SELECT CAST(@@in_transaction AS SIGNED); COMMIT; \
                 SET @@SESSION.innodb_lock_wait_timeout = DEFAULT; BEGIN"
            }
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
        // A `wait` changed the session's lock timeout: only the rollback message restores it.
        if options.wait.is_some() {
            return Self::rollback(tx, options).await;
        }
        drop(tx);
        Ok(())
    }

    fn is_lock_timeout(err: &sqlx::Error) -> bool {
        number(err) == Some(ER_LOCK_WAIT_TIMEOUT)
    }

    async fn try_claim<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Sql,
        scope: &'t str,
        key: &'t str,
        fingerprint: Option<&'t [u8]>,
    ) -> Result<bool, sqlx::Error> {
        match sqlx::query(sql.claim.clone())
            .bind(scope)
            .bind(key)
            .bind(fingerprint)
            .execute(&mut *conn)
            .await
        {
            Ok(_) => Ok(true),
            Err(e) if number(&e) == Some(ER_DUP_ENTRY) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Two round trips per batch. MySQL has no `RETURNING` (MariaDB has, from 10.5), so the
    /// rows this batch inserted are told apart by a sentinel: `attempts = 0`, which no
    /// committed marker holds. The first message inserts every row (in sorted key order, so
    /// overlapping batches queue instead of deadlocking) and reads back the keys still holding
    /// the sentinel: only this transaction's own, uncommitted rows can. The second sets
    /// `attempts = 1` on exactly those rows, which this transaction already holds; an `UPDATE`
    /// over the whole batch would also lock the duplicates, which `INSERT IGNORE` left under a
    /// shared lock, and two batches upgrading the same shared lock deadlock.
    ///
    /// `INSERT IGNORE` turns errors into warnings, which is why the single claim avoids it;
    /// here every value was validated first (keys and scope are 1 to 255 bytes, the columns'
    /// size), so the only error left for it to ignore is the duplicate key. Lock waits and
    /// deadlocks are not downgraded. The keys are written as hex literals: a multi-statement
    /// message cannot carry binds, and hex leaves nothing to escape.
    async fn try_claim_batch<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Sql,
        scope: &'t str,
        keys: &'t [&'t str],
    ) -> Result<Vec<String>, sqlx::Error> {
        let t = &sql.table;
        let scope = hex(scope);
        let values: Vec<String> = keys
            .iter()
            .map(|key| format!("({scope},{},0,UTC_TIMESTAMP(6),UTC_TIMESTAMP(6))", hex(key)))
            .collect();
        let list: Vec<String> = keys.iter().map(|key| hex(key)).collect();
        let claim = format!(
            "INSERT IGNORE INTO {t} (scope, `key`, attempts, created_at, completed_at) \
             VALUES {}; \
             SELECT `key` FROM {t} WHERE scope = {scope} AND `key` IN ({}) AND attempts = 0",
            values.join(","),
            list.join(",")
        );
        let rows = sqlx::raw_sql(AssertSqlSafe(claim))
            .fetch_all(&mut *conn)
            .await?;
        let mut fresh = Vec::with_capacity(rows.len());
        let mut mine = Vec::with_capacity(rows.len());
        for row in &rows {
            let key: Vec<u8> = row.try_get(0)?;
            mine.push(hex_bytes(&key));
            fresh.push(String::from_utf8(key).map_err(|e| sqlx::Error::Decode(Box::new(e)))?);
        }
        if !mine.is_empty() {
            let settle = format!(
                "UPDATE {t} SET attempts = 1 WHERE scope = {scope} AND `key` IN ({})",
                mine.join(",")
            );
            sqlx::raw_sql(AssertSqlSafe(settle))
                .execute(&mut *conn)
                .await?;
        }
        Ok(fresh)
    }

    super::read_recorded!();

    async fn record<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Sql,
        scope: &'t str,
        key: &'t str,
        json: &'t str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(sql.record.clone())
            .bind(json)
            .bind(scope)
            .bind(key)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    fn is_transient(err: &sqlx::Error) -> bool {
        // InnoDB may pick a waiter as deadlock victim when the first claimer rolls back.
        number(err) == Some(ER_LOCK_DEADLOCK)
    }

    async fn migrate<'p>(pool: &'p Pool<Self>, sql: &'p Sql) -> Result<(), sqlx::Error> {
        // DDL commits implicitly in MySQL, so a named lock is what makes concurrent workers
        // take turns. The lock belongs to the session: the connection is detached from the
        // pool, so that a cancelled migration closes it (and the server frees the lock)
        // instead of returning it to the pool still holding the lock.
        let mut conn = pool.acquire().await?.detach();
        // MySQL 5.7+ refuses lock names over 64 characters; two long names that share a
        // prefix then share a lock, which only makes them take turns.
        let mut lock = format!("idem.migrate.{}", sql.table);
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
        for stmt in &sql.ddl {
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
        sql: &'p Sql,
        scope: &'p str,
        key: &'p str,
        lease_ms: i64,
        fingerprint: Option<&'p [u8]>,
    ) -> Result<LeaseState, sqlx::Error> {
        let inserted = sqlx::query(sql.lease.claim.clone())
            .bind(scope)
            .bind(key)
            .bind(lease_ms)
            .bind(fingerprint)
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
        let taken = sqlx::query(sql.lease.takeover.clone())
            .bind(lease_ms)
            .bind(fingerprint)
            .bind(scope)
            .bind(key)
            .bind(fingerprint)
            .bind(fingerprint)
            .execute(pool)
            .await?;
        type Row = (String, Option<Vec<u8>>, Option<String>, i64);
        let row: Option<Row> = sqlx::query_as(sql.lease.state.clone())
            .bind(scope)
            .bind(key)
            .fetch_optional(pool)
            .await?;
        if taken.rows_affected() == 1 {
            let token = i64::try_from(taken.last_insert_id()).unwrap_or(i64::MAX);
            // The lease is ours until it runs out, so the row read back is our own.
            let attempts = row.map_or(1, |(.., attempts)| attempts);
            return Ok(LeaseState::Taken { token, attempts });
        }
        Ok(super::lease_state(row.map(|(s, f, r, _)| (s, f, r))))
    }

    async fn lease_update<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Sql,
        op: LeaseOp,
        scope: &'p str,
        key: &'p str,
        token: i64,
        lease_ms: i64,
        result: Option<&'p str>,
    ) -> Result<bool, sqlx::Error> {
        let query = match op {
            LeaseOp::Complete => sqlx::query(sql.lease.complete.clone()).bind(result),
            LeaseOp::Release => sqlx::query(sql.lease.release.clone()),
            LeaseOp::Renew => sqlx::query(sql.lease.renew.clone()).bind(lease_ms),
        };
        let done = query
            .bind(scope)
            .bind(key)
            .bind(token)
            .execute(pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    super::pool_statements!();
}
