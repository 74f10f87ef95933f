//! Schema version 3 on SQLite: each scope's retention window, and its purge.

use sqlx::{Pool, Sqlite};

use super::{SqliteSql, begin};
use crate::backend::retention::Retentions;
use crate::backend::sealed::Dialect as _;
use crate::backend::sql::statements;

/// One purge batch of a scope: its oldest completed markers before `?2`, at most `?3`.
const SCOPE_BATCH: &str = "SELECT scope, key FROM {t} WHERE scope = ?1 AND state = 'completed' \
    AND completed_at < ?2 ORDER BY completed_at, key LIMIT ?3";

statements! {
    /// The statements of `{t}_retention`, made when an operator's call needs them.
    pub(super) struct RetentionSql<Sqlite> {
        set(scope: &str, keep_ms: i64) =
            "INSERT INTO {t}_retention (scope, keep_ms) VALUES (?1, ?2) \
             ON CONFLICT (scope) DO UPDATE SET keep_ms = excluded.keep_ms, \
             updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')";
        clear(scope: &str) = "DELETE FROM {t}_retention WHERE scope = ?1";
        list() = "SELECT scope, keep_ms FROM {t}_retention ORDER BY scope";
        // As the default purge: the steps of a batch, then its markers, from one cutoff.
        purge_steps(scope: &str, cutoff: &str, limit: i64) =
            format!("DELETE FROM {{t}}_steps WHERE (scope, key) IN ({SCOPE_BATCH})");
        purge(scope: &str, cutoff: &str, limit: i64) =
            format!("DELETE FROM {{t}} WHERE (scope, key) IN ({SCOPE_BATCH})");
    }
}

impl Retentions for Sqlite {
    async fn retention_set<'p>(
        pool: &'p Pool<Self>,
        sql: &'p SqliteSql,
        scope: &'p str,
        keep_ms: i64,
    ) -> Result<(), sqlx::Error> {
        let statements = RetentionSql::new(Self::table(sql));
        statements.set(scope, keep_ms).query().execute(pool).await?;
        Ok(())
    }

    async fn retention_clear<'p>(
        pool: &'p Pool<Self>,
        sql: &'p SqliteSql,
        scope: &'p str,
    ) -> Result<bool, sqlx::Error> {
        let statements = RetentionSql::new(Self::table(sql));
        let done = statements.clear(scope).query().execute(pool).await?;
        Ok(done.rows_affected() > 0)
    }

    async fn retention_list<'p>(
        pool: &'p Pool<Self>,
        sql: &'p SqliteSql,
    ) -> Result<Vec<(String, i64)>, sqlx::Error> {
        let statements = RetentionSql::new(Self::table(sql));
        statements.list().rows().fetch_all(pool).await
    }

    async fn purge_scope_batch<'p>(
        pool: &'p Pool<Self>,
        sql: &'p SqliteSql,
        scope: &'p str,
        age_ms: i64,
        limit: i64,
    ) -> Result<u64, sqlx::Error> {
        let statements = RetentionSql::new(Self::table(sql));
        let mut tx = begin(pool).await?;
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
        check_binds(&super::RetentionSql::templates(), Placeholders::Numbered);
    }
}
