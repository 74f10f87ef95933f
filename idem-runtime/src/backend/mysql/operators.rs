//! What operators do with the markers on MySQL and MariaDB: migrate, forget, inspect, purge.

use sqlx::{MySql, MySqlConnection, Pool, SqlStr};

use super::{LEASE_OVER, MySqlSql};
use crate::backend::sealed::Operators;
use crate::backend::sql::statements;
use crate::backend::upgrade::Kind;
use crate::backend::{MarkerRow, Status};

/// The columns of `Store::inspect`: times as ISO-8601 UTC text (idem writes them in UTC), and
/// the lease's time left on the database's clock.
pub(super) const MARKER_COLUMNS: &str = "CONVERT(scope USING utf8mb4), CONVERT(`key` USING utf8mb4), state, \
    CAST(attempts AS SIGNED), token, \
    DATE_FORMAT(created_at, '%Y-%m-%dT%H:%i:%s.%fZ'), \
    DATE_FORMAT(completed_at, '%Y-%m-%dT%H:%i:%s.%fZ'), \
    DATE_FORMAT(locked_until, '%Y-%m-%dT%H:%i:%s.%fZ'), \
    CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), locked_until) DIV 1000 AS SIGNED), error";

statements! {
    /// The operators' statements.
    pub(super) struct OperatorSql<MySql> {
        /// A completed marker is deleted: the next delivery runs the job again.
        forget(scope: &str, key: &str) =
            "DELETE FROM {t} WHERE scope = ? AND `key` = ? AND state = 'completed'";
        /// A marker in progress is let go, not deleted: its token goes up, so that its holder
        /// is fenced out and the next holder's token is larger still.
        release(scope: &str, key: &str) = format!(
            "UPDATE {{t}} SET locked_until = NULL, fingerprint = NULL, \
             token = COALESCE(token, 0) + 1 \
             WHERE scope = ? AND `key` = ? AND state = 'in_progress' AND {LEASE_OVER}"
        );
        release_forced(scope: &str, key: &str) =
            "UPDATE {t} SET locked_until = NULL, fingerprint = NULL, \
             token = COALESCE(token, 0) + 1 \
             WHERE scope = ? AND `key` = ? AND state = 'in_progress'";
        /// Whether the marker is there, and held: `(state, lease over)`.
        status(scope: &str, key: &str) =
            format!("SELECT state, {LEASE_OVER} FROM {{t}} WHERE scope = ? AND `key` = ?");
        inspect(scope: &str, key: &str) =
            format!("SELECT {MARKER_COLUMNS} FROM {{t}} WHERE scope = ? AND `key` = ?");
        // Every scope when the scope is NULL.
        in_progress(scope: Option<&str>, same_scope: Option<&str>, limit: i64) = format!(
            "SELECT {MARKER_COLUMNS} FROM {{t}} WHERE (? IS NULL OR scope = ?) \
             AND state = 'in_progress' \
             ORDER BY locked_until IS NOT NULL, locked_until, scope LIMIT ?"
        );
        /// The instant before which completed markers are purged, read once so that a batch's
        /// steps and markers are the same rows.
        cutoff(age_ms: i64) =
            "SELECT DATE_FORMAT(UTC_TIMESTAMP(6) - INTERVAL (? * 1000) MICROSECOND, \
             '%Y-%m-%d %H:%i:%s.%f')";
        // Scopes with a retention window of their own are purged by it (`retention.rs`).
        purge_steps(cutoff: &str, limit: i64) =
            "DELETE s FROM {t}_steps AS s JOIN (SELECT scope, `key` FROM {t} \
             WHERE state = 'completed' AND completed_at < ? \
             AND scope NOT IN (SELECT scope FROM {t}_retention) \
             ORDER BY completed_at, scope, `key` LIMIT ?) AS b \
             ON s.scope = b.scope AND s.`key` = b.`key`";
        purge(cutoff: &str, limit: i64) =
            "DELETE FROM {t} WHERE state = 'completed' AND completed_at < ? \
             AND scope NOT IN (SELECT scope FROM {t}_retention) \
             ORDER BY completed_at, scope, `key` LIMIT ?";
    }
}

impl Operators for MySql {
    fn ddl(sql: &MySqlSql) -> &[SqlStr] {
        &sql.ddl
    }

    async fn migrate<'p>(pool: &'p Pool<Self>, sql: &'p MySqlSql) -> Result<(), sqlx::Error> {
        // DDL commits implicitly in MySQL, so a named lock is what makes concurrent workers
        // take turns. The lock belongs to the session: the connection is detached from the
        // pool, so that a cancelled migration closes it (and the server frees the lock)
        // instead of returning it to the pool still holding the lock.
        let mut conn = pool.acquire().await?.detach();
        // MySQL 5.7+ refuses lock names over 64 characters; two long names that share a
        // prefix then share a lock, which only makes them take turns.
        let mut lock = format!("idem.migrate.{}", sql.table.as_str());
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
        let result = upgrade(&mut conn, sql).await;
        // The DDL's own error, if any, is the one worth reporting.
        let released = sqlx::query("SELECT RELEASE_LOCK(?)")
            .bind(&lock)
            .execute(&mut conn)
            .await;
        result?;
        released?;
        sqlx::Connection::close(conn).await
    }

    async fn forget<'p>(
        conn: &'p mut Self::Connection,
        sql: &'p MySqlSql,
        scope: &'p str,
        key: &'p str,
        force: bool,
    ) -> Result<bool, sqlx::Error> {
        if sql
            .ops
            .forget(scope, key)
            .query()
            .execute(&mut *conn)
            .await?
            .rows_affected()
            > 0
        {
            return Ok(true);
        }
        let release = match force {
            true => sql.ops.release_forced(scope, key),
            false => sql.ops.release(scope, key),
        };
        Ok(release.query().execute(&mut *conn).await?.rows_affected() > 0)
    }

    async fn status<'p>(
        pool: &'p Pool<Self>,
        sql: &'p MySqlSql,
        scope: &'p str,
        key: &'p str,
    ) -> Result<Option<Status>, sqlx::Error> {
        let status: Option<(String, i64)> = sql
            .ops
            .status(scope, key)
            .rows()
            .fetch_optional(pool)
            .await?;
        Ok(status.map(|(state, over)| Status::of(&state, over != 0)))
    }

    async fn inspect<'p>(
        pool: &'p Pool<Self>,
        sql: &'p MySqlSql,
        scope: &'p str,
        key: &'p str,
    ) -> Result<Option<MarkerRow>, sqlx::Error> {
        sql.ops
            .inspect(scope, key)
            .rows()
            .fetch_optional(pool)
            .await
    }

    async fn in_progress<'p>(
        pool: &'p Pool<Self>,
        sql: &'p MySqlSql,
        scope: Option<&'p str>,
        limit: i64,
    ) -> Result<Vec<MarkerRow>, sqlx::Error> {
        let list = sql.ops.in_progress(scope, scope, limit);
        list.rows().fetch_all(pool).await
    }

    async fn purge_batch<'p>(
        pool: &'p Pool<Self>,
        sql: &'p MySqlSql,
        age_ms: i64,
        limit: i64,
    ) -> Result<u64, sqlx::Error> {
        // Steps first, then their markers, in one transaction: a purge never leaves the steps
        // of a deleted marker behind. Both pick the batch in one order from one cutoff.
        let mut tx = pool.begin().await?;
        let cutoff: String = sql.ops.cutoff(age_ms).scalar().fetch_one(&mut *tx).await?;
        let steps = sql.ops.purge_steps(&cutoff, limit);
        steps.query().execute(&mut *tx).await?;
        let done = sql
            .ops
            .purge(&cutoff, limit)
            .query()
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(done.rows_affected())
    }
}

/// The DDL, then what a table made by an earlier version lacks: MySQL 8 has no `ADD COLUMN IF
/// NOT EXISTS` (MariaDB has), so the catalog is asked first. Each statement commits on its
/// own; the caller's named lock keeps other workers out meanwhile.
async fn upgrade(conn: &mut MySqlConnection, sql: &MySqlSql) -> Result<(), sqlx::Error> {
    for stmt in &sql.ddl {
        sqlx::query(stmt.clone()).execute(&mut *conn).await?;
    }
    for added in &sql.added {
        let catalog = match added.kind {
            Kind::Column => {
                "SELECT COUNT(*) FROM information_schema.columns \
                 WHERE table_schema = DATABASE() AND table_name = ? AND column_name = ?"
            }
            Kind::Index => {
                "SELECT COUNT(*) FROM information_schema.statistics \
                 WHERE table_schema = DATABASE() AND table_name = ? AND index_name = ?"
            }
        };
        let there: i64 = sqlx::query_scalar(catalog)
            .bind(&added.table)
            .bind(&added.name)
            .fetch_one(&mut *conn)
            .await?;
        if there == 0 {
            sqlx::query(added.statement.clone())
                .execute(&mut *conn)
                .await?;
        }
    }
    Ok(())
}
