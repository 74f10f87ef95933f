//! Schema version 3 on PostgreSQL: each scope's retention window, and its purge.

use sqlx::{Pool, Postgres};

use super::PgSql;
use super::pinned::on_pool;
use crate::backend::retention::Retentions;
use crate::backend::sealed::Dialect as _;
use crate::backend::sql::statements;

statements! {
    /// The statements of `{t}_retention`, made when an operator's call needs them.
    pub(super) struct RetentionSql<Postgres> {
        set(scope: &str, keep_ms: i64) =
            "INSERT INTO {t}_retention (scope, keep_ms) VALUES ($1, $2) \
             ON CONFLICT (scope) DO UPDATE SET keep_ms = EXCLUDED.keep_ms, updated_at = now()";
        clear(scope: &str) = "DELETE FROM {t}_retention WHERE scope = $1";
        list() = "SELECT scope, keep_ms FROM {t}_retention ORDER BY scope";
        // As the default purge: a TID scan per batch, the batch's steps in the same statement.
        purge(scope: &str, age_ms: i64, limit: i64) =
            "WITH batch AS MATERIALIZED (SELECT tableoid, ctid, scope, key FROM {t} \
             WHERE scope = $1 AND state = 'completed' \
             AND completed_at < now() - $2 * interval '1 millisecond' LIMIT $3), \
             steps AS (DELETE FROM {t}_steps AS s USING batch AS b \
             WHERE s.scope = b.scope AND s.key = b.key) \
             DELETE FROM {t} WHERE ctid = ANY (ARRAY(SELECT ctid FROM batch)) \
             AND (tableoid, ctid) IN (SELECT tableoid, ctid FROM batch)";
    }
}

impl Retentions for Postgres {
    async fn retention_set<'p>(
        pool: &'p Pool<Self>,
        sql: &'p PgSql,
        scope: &'p str,
        keep_ms: i64,
    ) -> Result<(), sqlx::Error> {
        let statements = RetentionSql::new(Self::table(sql));
        on_pool(pool, sql, async |conn| {
            statements.set(scope, keep_ms).query().execute(conn).await
        })
        .await?;
        Ok(())
    }

    async fn retention_clear<'p>(
        pool: &'p Pool<Self>,
        sql: &'p PgSql,
        scope: &'p str,
    ) -> Result<bool, sqlx::Error> {
        let statements = RetentionSql::new(Self::table(sql));
        let done = on_pool(pool, sql, async |conn| {
            statements.clear(scope).query().execute(conn).await
        })
        .await?;
        Ok(done.rows_affected() > 0)
    }

    async fn retention_list<'p>(
        pool: &'p Pool<Self>,
        sql: &'p PgSql,
    ) -> Result<Vec<(String, i64)>, sqlx::Error> {
        let statements = RetentionSql::new(Self::table(sql));
        on_pool(pool, sql, async |conn| {
            statements.list().rows().fetch_all(conn).await
        })
        .await
    }

    async fn purge_scope_batch<'p>(
        pool: &'p Pool<Self>,
        sql: &'p PgSql,
        scope: &'p str,
        age_ms: i64,
        limit: i64,
    ) -> Result<u64, sqlx::Error> {
        let statements = RetentionSql::new(Self::table(sql));
        let done = statements.purge(scope, age_ms, limit).query();
        Ok(on_pool(pool, sql, async |conn| done.execute(conn).await)
            .await?
            .rows_affected())
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::sql::{Placeholders, check_binds};

    #[test]
    fn every_statement_has_as_many_placeholders_as_binds() {
        check_binds(&super::RetentionSql::templates(), Placeholders::Dollar);
    }
}
