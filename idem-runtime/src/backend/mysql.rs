use sqlx::mysql::MySqlDatabaseError;
use sqlx::{AssertSqlSafe, MySql, Pool, Row as _, SqlSafeStr as _, SqlStr, Transaction};

use super::{Backend, Sql, sealed};
use crate::ClaimOptions;

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

fn number(err: &sqlx::Error) -> Option<u16> {
    err.as_database_error()
        .and_then(|e| e.try_downcast_ref::<MySqlDatabaseError>())
        .map(MySqlDatabaseError::number)
}

impl Backend for MySql {
    const BACKEND: &'static str = "mysql";

    fn sql(table: &str) -> Sql {
        Sql::new(
            table,
            "BEGIN",
            // A plain INSERT: `INSERT IGNORE` would turn every error into a warning, and
            // `ON DUPLICATE KEY UPDATE` reports a row under sqlx's CLIENT_FOUND_ROWS.
            [
                "INSERT INTO {t} (scope, `key`, completed_at) VALUES (?, ?, CURRENT_TIMESTAMP(6))",
                "DELETE FROM {t} WHERE scope = ? AND `key` = ?",
                "DELETE FROM {t} WHERE state = 'completed' \
                 AND completed_at < CURRENT_TIMESTAMP(6) - INTERVAL (? * 1000) MICROSECOND \
                 ORDER BY completed_at LIMIT ?",
            ],
            DDL,
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
        mut tx: Transaction<'static, Self>,
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

    async fn rollback(
        mut tx: Transaction<'static, Self>,
        options: &ClaimOptions,
    ) -> Result<(), sqlx::Error> {
        if options.wait.is_none() {
            return tx.rollback().await;
        }
        let sql = format!("ROLLBACK; {RESTORE_WAIT}; BEGIN");
        sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut *tx).await?;
        Ok(())
    }

    fn is_lock_timeout(err: &sqlx::Error) -> bool {
        number(err) == Some(ER_LOCK_WAIT_TIMEOUT)
    }

    async fn try_claim<'t>(
        tx: &'t mut Transaction<'static, Self>,
        sql: &'t Sql,
        scope: &'t str,
        key: &'t str,
    ) -> Result<bool, sqlx::Error> {
        match sqlx::query(sql.claim.clone())
            .bind(scope)
            .bind(key)
            .execute(&mut **tx)
            .await
        {
            Ok(_) => Ok(true),
            Err(e) if number(&e) == Some(ER_DUP_ENTRY) => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn is_transient(err: &sqlx::Error) -> bool {
        // InnoDB may pick a waiter as deadlock victim when the first claimer rolls back.
        number(err) == Some(ER_LOCK_DEADLOCK)
    }

    async fn migrate<'p>(pool: &'p Pool<Self>, sql: &'p Sql) -> Result<(), sqlx::Error> {
        // DDL commits implicitly in MySQL, so a named lock (held by this connection) is what
        // makes concurrent workers take turns.
        let mut conn = pool.acquire().await?;
        // MySQL 5.7+ refuses lock names over 64 characters; two long names that share a
        // prefix then share a lock, which only makes them take turns.
        let mut lock = format!("idem.migrate.{}", sql.table);
        lock.truncate(64);
        sqlx::query("SELECT GET_LOCK(?, 60)")
            .bind(&lock)
            .execute(&mut *conn)
            .await?;
        let mut result = Ok(());
        for stmt in &sql.ddl {
            if let Err(e) = sqlx::query(stmt.clone()).execute(&mut *conn).await {
                result = Err(e);
                break;
            }
        }
        sqlx::query("SELECT RELEASE_LOCK(?)")
            .bind(&lock)
            .execute(&mut *conn)
            .await?;
        result
    }

    super::pool_statements!();
}
