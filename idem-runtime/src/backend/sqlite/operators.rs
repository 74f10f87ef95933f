//! What operators do with the markers on SQLite: migrate, forget, inspect, purge.

use sqlx::{Pool, SqlStr, Sqlite};

use super::{LEASE_OVER, SqliteSql, begin};
use crate::backend::sealed::Operators;
use crate::backend::sql::statements;
use crate::backend::upgrade::Kind;
use crate::backend::{MarkerRow, Status};

/// The columns of `Store::inspect`: times are already ISO-8601 UTC text here; the lease's time
/// left on the database's clock.
pub(super) const MARKER_COLUMNS: &str = "scope, key, state, attempts, token, created_at, completed_at, \
    locked_until, CAST((julianday(locked_until) - julianday('now')) * 86400000.0 AS INTEGER), \
    error";

/// One purge batch: the oldest completed markers before `?1`, at most `?2`, in one order.
const PURGE_BATCH: &str = "SELECT scope, key FROM {t} WHERE state = 'completed' \
    AND completed_at < ?1 AND scope NOT IN (SELECT scope FROM {t}_retention) \
    ORDER BY completed_at, scope, key LIMIT ?2";

statements! {
    /// The operators' statements.
    pub(super) struct OperatorSql<Sqlite> {
        /// A completed marker is deleted: the next delivery runs the job again.
        forget(scope: &str, key: &str) =
            "DELETE FROM {t} WHERE scope = ?1 AND key = ?2 AND state = 'completed'";
        /// A marker in progress is let go, not deleted: its token goes up, so that its holder
        /// is fenced out and the next holder's token is larger still.
        release(scope: &str, key: &str) = format!(
            "UPDATE {{t}} SET locked_until = NULL, fingerprint = NULL, \
             token = COALESCE(token, 0) + 1 \
             WHERE scope = ?1 AND key = ?2 AND state = 'in_progress' AND {LEASE_OVER}"
        );
        release_forced(scope: &str, key: &str) =
            "UPDATE {t} SET locked_until = NULL, fingerprint = NULL, \
             token = COALESCE(token, 0) + 1 \
             WHERE scope = ?1 AND key = ?2 AND state = 'in_progress'";
        /// Whether the marker is there, and held: `(state, lease over)`.
        status(scope: &str, key: &str) =
            format!("SELECT state, {LEASE_OVER} FROM {{t}} WHERE scope = ?1 AND key = ?2");
        inspect(scope: &str, key: &str) =
            format!("SELECT {MARKER_COLUMNS} FROM {{t}} WHERE scope = ?1 AND key = ?2");
        // Every scope when `?1` is NULL.
        in_progress(scope: Option<&str>, limit: i64) = format!(
            "SELECT {MARKER_COLUMNS} FROM {{t}} WHERE (?1 IS NULL OR scope = ?1) \
             AND state = 'in_progress' \
             ORDER BY locked_until IS NOT NULL, locked_until, scope LIMIT ?2"
        );
        /// The instant before which completed markers are purged, read once so that a batch's
        /// steps and markers are the same rows.
        cutoff(age_ms: i64) =
            "SELECT strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-' || (?1 / 1000.0) || ' seconds')";
        purge_steps(cutoff: &str, limit: i64) = format!(
            "DELETE FROM {{t}}_steps WHERE (scope, key) IN ({PURGE_BATCH})"
        );
        purge(cutoff: &str, limit: i64) =
            format!("DELETE FROM {{t}} WHERE (scope, key) IN ({PURGE_BATCH})");
    }
}

impl Operators for Sqlite {
    fn ddl(sql: &SqliteSql) -> &[SqlStr] {
        &sql.ddl
    }

    async fn migrate<'p>(pool: &'p Pool<Self>, sql: &'p SqliteSql) -> Result<(), sqlx::Error> {
        let mut tx = begin(pool).await?;
        // The tables, then what later versions added to them, then the indexes, some of
        // which are on added columns.
        let (tables, indexes) = super::super::upgrade::tables_first(&sql.ddl);
        for stmt in tables {
            sqlx::query(stmt.clone()).execute(&mut *tx).await?;
        }
        // SQLite's `ADD COLUMN` cannot skip a column that exists: the catalog is asked first.
        for added in &sql.added {
            let catalog = match added.kind {
                Kind::Column => "SELECT COUNT(*) FROM pragma_table_info(?1) WHERE name = ?2",
                Kind::Index => "SELECT COUNT(*) FROM pragma_index_list(?1) WHERE name = ?2",
            };
            let there: i64 = sqlx::query_scalar(catalog)
                .bind(&added.table)
                .bind(&added.name)
                .fetch_one(&mut *tx)
                .await?;
            if there == 0 {
                sqlx::query(added.statement.clone())
                    .execute(&mut *tx)
                    .await?;
            }
        }
        for stmt in indexes {
            sqlx::query(stmt.clone()).execute(&mut *tx).await?;
        }
        tx.commit().await
    }

    async fn forget<'p>(
        conn: &'p mut Self::Connection,
        sql: &'p SqliteSql,
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
        sql: &'p SqliteSql,
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
        sql: &'p SqliteSql,
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
        sql: &'p SqliteSql,
        scope: Option<&'p str>,
        limit: i64,
    ) -> Result<Vec<MarkerRow>, sqlx::Error> {
        sql.ops
            .in_progress(scope, limit)
            .rows()
            .fetch_all(pool)
            .await
    }

    async fn purge_batch<'p>(
        pool: &'p Pool<Self>,
        sql: &'p SqliteSql,
        age_ms: i64,
        limit: i64,
    ) -> Result<u64, sqlx::Error> {
        // Steps first, then their markers, in one transaction: a purge never leaves the steps
        // of a deleted marker behind.
        let mut tx = begin(pool).await?;
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
