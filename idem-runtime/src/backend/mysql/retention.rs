//! Schema version 3 on MySQL and MariaDB: each scope's retention window, and its purge.

use sqlx::{MySql, Pool};

use super::MySqlSql;
use crate::backend::retention::Retentions;
use crate::backend::sealed::Dialect as _;
use crate::backend::sql::statements;

statements! {
    /// The statements of `{t}_retention`, made when an operator's call needs them.
    pub(super) struct RetentionSql<MySql> {
        set(scope: &str, keep_ms: i64) =
            "INSERT INTO {t}_retention (scope, keep_ms, updated_at) \
             VALUES (?, ?, UTC_TIMESTAMP(6)) \
             ON DUPLICATE KEY UPDATE keep_ms = VALUES(keep_ms), updated_at = VALUES(updated_at)";
        clear(scope: &str) = "DELETE FROM {t}_retention WHERE scope = ?";
        list() = "SELECT CONVERT(scope USING utf8mb4), keep_ms FROM {t}_retention ORDER BY scope";
        // As the default purge: oldest first, through the index on (state, completed_at), the
        // steps of a batch, then its markers, from one cutoff.
        purge_steps(scope: &str, cutoff: &str, limit: i64) =
            "DELETE s FROM {t}_steps AS s JOIN (SELECT scope, `key` FROM {t} \
             WHERE scope = ? AND state = 'completed' AND completed_at < ? \
             ORDER BY completed_at, `key` LIMIT ?) AS b \
             ON s.scope = b.scope AND s.`key` = b.`key`";
        purge(scope: &str, cutoff: &str, limit: i64) =
            "DELETE FROM {t} WHERE scope = ? AND state = 'completed' AND completed_at < ? \
             ORDER BY completed_at, `key` LIMIT ?";
    }
}

impl Retentions for MySql {
    async fn retention_set<'p>(
        pool: &'p Pool<Self>,
        sql: &'p MySqlSql,
        scope: &'p str,
        keep_ms: i64,
    ) -> Result<(), sqlx::Error> {
        let statements = RetentionSql::new(Self::table(sql));
        statements.set(scope, keep_ms).query().execute(pool).await?;
        Ok(())
    }

    async fn retention_clear<'p>(
        pool: &'p Pool<Self>,
        sql: &'p MySqlSql,
        scope: &'p str,
    ) -> Result<bool, sqlx::Error> {
        let statements = RetentionSql::new(Self::table(sql));
        let done = statements.clear(scope).query().execute(pool).await?;
        Ok(done.rows_affected() > 0)
    }

    async fn retention_list<'p>(
        pool: &'p Pool<Self>,
        sql: &'p MySqlSql,
    ) -> Result<Vec<(String, i64)>, sqlx::Error> {
        let statements = RetentionSql::new(Self::table(sql));
        statements.list().rows().fetch_all(pool).await
    }

    async fn purge_scope_batch<'p>(
        pool: &'p Pool<Self>,
        sql: &'p MySqlSql,
        scope: &'p str,
        age_ms: i64,
        limit: i64,
    ) -> Result<u64, sqlx::Error> {
        let statements = RetentionSql::new(Self::table(sql));
        let mut tx = pool.begin().await?;
        let cutoff: String = sql.ops.cutoff(age_ms).scalar().fetch_one(&mut *tx).await?;
        let steps = statements.purge_steps(scope, &cutoff, limit).query();
        steps.execute(&mut *tx).await?;
        let done = statements.purge(scope, &cutoff, limit).query();
        let done = done.execute(&mut *tx).await?.rows_affected();
        tx.commit().await?;
        Ok(done)
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::sql::{Placeholders, check_binds};

    #[test]
    fn every_statement_has_as_many_placeholders_as_binds() {
        check_binds(&super::RetentionSql::templates(), Placeholders::Question);
    }
}
