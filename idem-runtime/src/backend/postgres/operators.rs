//! What operators do with the markers on PostgreSQL: migrate, forget, inspect, purge.

use sqlx::{Pool, Postgres, SqlStr};

use super::pinned::on_pool;
use super::{LEASE_OVER, PgSql};
use crate::backend::sealed::Operators;
use crate::backend::sql::statements;
use crate::backend::{MarkerRow, Status};

/// The columns of `Store::inspect`: times as ISO-8601 UTC text, and the lease's time left on the
/// database's clock.
pub(super) const MARKER_COLUMNS: &str = "scope, key, state, attempts::bigint, token, \
    to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), \
    to_char(completed_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), \
    to_char(locked_until AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), \
    (EXTRACT(EPOCH FROM (locked_until - now())) * 1000)::bigint, error";

statements! {
    /// The operators' statements.
    pub(super) struct OperatorSql<Postgres> {
        /// A completed marker is deleted: the next delivery runs the job again.
        forget(scope: &str, key: &str) =
            "DELETE FROM {t} WHERE scope = $1 AND key = $2 AND state = 'completed'";
        /// A marker in progress is let go, not deleted: its token goes up, so that its holder
        /// is fenced out and the next holder's token is larger still.
        release(scope: &str, key: &str) = format!(
            "UPDATE {{t}} SET locked_until = NULL, fingerprint = NULL, \
             token = COALESCE(token, 0) + 1 \
             WHERE scope = $1 AND key = $2 AND state = 'in_progress' AND {LEASE_OVER}"
        );
        release_forced(scope: &str, key: &str) =
            "UPDATE {t} SET locked_until = NULL, fingerprint = NULL, \
             token = COALESCE(token, 0) + 1 \
             WHERE scope = $1 AND key = $2 AND state = 'in_progress'";
        /// Whether the marker is there, and held: `(state, lease over)`.
        status(scope: &str, key: &str) = format!(
            "SELECT state, {LEASE_OVER}::int::int8 FROM {{t}} WHERE scope = $1 AND key = $2"
        );
        inspect(scope: &str, key: &str) =
            format!("SELECT {MARKER_COLUMNS} FROM {{t}} WHERE scope = $1 AND key = $2");
        // Every scope when `$1` is NULL.
        in_progress(scope: Option<&str>, limit: i64) = format!(
            "SELECT {MARKER_COLUMNS} FROM {{t}} WHERE ($1::text IS NULL OR scope = $1) \
             AND state = 'in_progress' ORDER BY locked_until NULLS FIRST, scope LIMIT $2"
        );
        // Selecting the batch by ctid makes each batch a TID scan; an `IN (SELECT scope, key
        // ...)` ran as a hash join over the whole table, every batch. A ctid names a row only
        // within its partition (a partitioned table, `Store::partitions`), so the batch's
        // `tableoid` must match too. The batch's steps go in the same statement (a
        // data-modifying `WITH` runs whatever reads it).
        purge(age_ms: i64, limit: i64) =
            "WITH batch AS MATERIALIZED (SELECT tableoid, ctid, scope, key FROM {t} \
             WHERE state = 'completed' \
             AND completed_at < now() - $1 * interval '1 millisecond' \
             AND scope NOT IN (SELECT scope FROM {t}_retention) LIMIT $2), \
             steps AS (DELETE FROM {t}_steps AS s USING batch AS b \
             WHERE s.scope = b.scope AND s.key = b.key) \
             DELETE FROM {t} WHERE ctid = ANY (ARRAY(SELECT ctid FROM batch)) \
             AND (tableoid, ctid) IN (SELECT tableoid, ctid FROM batch)";
    }
}

impl Operators for Postgres {
    fn ddl(sql: &PgSql) -> &[SqlStr] {
        &sql.ddl
    }

    async fn migrate<'p>(pool: &'p Pool<Self>, sql: &'p PgSql) -> Result<(), sqlx::Error> {
        // Concurrent `CREATE TABLE IF NOT EXISTS` can still fail on the catalog's unique
        // index; a transaction-scoped advisory lock makes the workers take turns.
        // Statements run once per process are not kept prepared (`persistent(false)`): the
        // cache would hold them for nothing, and a named statement left on a server connection
        // that a pooler in transaction mode hands to another client collides with that
        // client's own.
        let mut tx = pool.begin().await?;
        // `IF NOT EXISTS` answers an existing table with a NOTICE, which sqlx logs at INFO:
        // every worker's start-up would say "relation already exists, skipping".
        sqlx::query("SET LOCAL client_min_messages = warning")
            .persistent(false)
            .execute(&mut *tx)
            .await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('idem.migrate.' || $1))")
            .bind(sql.table.as_str())
            .persistent(false)
            .execute(&mut *tx)
            .await?;
        // The tables, then what later versions added to them, then the indexes, some of
        // which are on added columns.
        let (tables, indexes) = super::super::upgrade::tables_first(&sql.ddl);
        for stmt in tables {
            sqlx::query(stmt.clone())
                .persistent(false)
                .execute(&mut *tx)
                .await?;
        }
        // `IF NOT EXISTS`: a table that has the addition already is left as it is.
        for added in &sql.added {
            sqlx::query(added.statement.clone())
                .persistent(false)
                .execute(&mut *tx)
                .await?;
        }
        for stmt in indexes {
            sqlx::query(stmt.clone())
                .persistent(false)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await
    }

    async fn forget<'p>(
        conn: &'p mut Self::Connection,
        sql: &'p PgSql,
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
        sql: &'p PgSql,
        scope: &'p str,
        key: &'p str,
    ) -> Result<Option<Status>, sqlx::Error> {
        let status: Option<(String, i64)> = on_pool(pool, sql, async |conn| {
            sql.ops.status(scope, key).rows().fetch_optional(conn).await
        })
        .await?;
        Ok(status.map(|(state, over)| Status::of(&state, over != 0)))
    }

    async fn inspect<'p>(
        pool: &'p Pool<Self>,
        sql: &'p PgSql,
        scope: &'p str,
        key: &'p str,
    ) -> Result<Option<MarkerRow>, sqlx::Error> {
        on_pool(pool, sql, async |conn| {
            sql.ops
                .inspect(scope, key)
                .rows()
                .fetch_optional(conn)
                .await
        })
        .await
    }

    async fn in_progress<'p>(
        pool: &'p Pool<Self>,
        sql: &'p PgSql,
        scope: Option<&'p str>,
        limit: i64,
    ) -> Result<Vec<MarkerRow>, sqlx::Error> {
        on_pool(pool, sql, async |conn| {
            sql.ops
                .in_progress(scope, limit)
                .rows()
                .fetch_all(conn)
                .await
        })
        .await
    }

    async fn purge_batch<'p>(
        pool: &'p Pool<Self>,
        sql: &'p PgSql,
        age_ms: i64,
        limit: i64,
    ) -> Result<u64, sqlx::Error> {
        let done = on_pool(pool, sql, async |conn| {
            sql.ops.purge(age_ms, limit).query().execute(conn).await
        })
        .await?;
        Ok(done.rows_affected())
    }
}
