//! What `Store::doctor` reads on MySQL and MariaDB.

use sqlx::{MySql, Pool};

use super::MySqlSql;
use crate::backend::health::{Bloat, COUNT_CAP, Catalog, Health};
use crate::backend::sealed::Dialect as _;
use crate::backend::sql::statements;

statements! {
    /// The doctor's statements, made when it runs.
    pub(super) struct HealthSql<MySql> {
        // `?` takes one bind per mark: the name is bound three times.
        tables(name: &str, measured: &str, prefix: &str) =
            "SELECT CAST(TABLE_NAME AS CHAR) FROM information_schema.TABLES \
             WHERE TABLE_SCHEMA = DATABASE() \
             AND (TABLE_NAME = ? OR LEFT(TABLE_NAME, CHAR_LENGTH(?) + 1) = CONCAT(?, '_'))";
        indexes(name: &str, measured: &str, prefix: &str) =
            "SELECT DISTINCT CAST(TABLE_NAME AS CHAR), CAST(INDEX_NAME AS CHAR) \
             FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = DATABASE() \
             AND (TABLE_NAME = ? OR LEFT(TABLE_NAME, CHAR_LENGTH(?) + 1) = CONCAT(?, '_'))";
        columns(name: &str, measured: &str, prefix: &str) =
            "SELECT CAST(TABLE_NAME AS CHAR), CAST(COLUMN_NAME AS CHAR) \
             FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() \
             AND (TABLE_NAME = ? OR LEFT(TABLE_NAME, CHAR_LENGTH(?) + 1) = CONCAT(?, '_'))";
        old_in_scope(scope: &str, age_ms: i64, cap: i64) =
            "SELECT CAST(COUNT(*) AS SIGNED) FROM (SELECT 1 FROM {t} WHERE scope = ? \
             AND state = 'completed' \
             AND completed_at < UTC_TIMESTAMP(6) - INTERVAL (? * 1000) MICROSECOND LIMIT ?) s";
        old(age_ms: i64, cap: i64) =
            "SELECT CAST(COUNT(*) AS SIGNED) FROM (SELECT 1 FROM {t} WHERE state = 'completed' \
             AND completed_at < UTC_TIMESTAMP(6) - INTERVAL (? * 1000) MICROSECOND \
             AND scope NOT IN (SELECT scope FROM {t}_retention) LIMIT ?) s";
        stuck(age_ms: i64, cap: i64) =
            "SELECT CAST(COUNT(*) AS SIGNED) FROM (SELECT 1 FROM {t} WHERE state = 'in_progress' \
             AND COALESCE(locked_until, created_at) \
             < UTC_TIMESTAMP(6) - INTERVAL (? * 1000) MICROSECOND LIMIT ?) s";
        outbox(age_ms: i64) =
            "SELECT CAST(COALESCE(SUM(parked), 0) AS SIGNED), \
             CAST(COALESCE(SUM(NOT parked AND next_attempt_at \
             < UTC_TIMESTAMP(6) - INTERVAL (? * 1000) MICROSECOND), 0) AS SIGNED) \
             FROM {t}_outbox WHERE sent_at IS NULL";
        bloat(name: &str) =
            "SELECT CAST(DATA_FREE AS SIGNED), CAST(DATA_LENGTH + INDEX_LENGTH AS SIGNED) \
             FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?";
    }
}

impl Health for MySql {
    async fn catalog<'p>(pool: &'p Pool<Self>, sql: &'p MySqlSql) -> Result<Catalog, sqlx::Error> {
        let name = Self::table(sql).as_str();
        let statements = HealthSql::new(Self::table(sql));
        let tables = statements.tables(name, name, name);
        let tables = tables.scalar().fetch_all(pool).await?;
        let indexes = statements.indexes(name, name, name);
        let indexes = indexes.rows().fetch_all(pool).await?;
        let columns = statements.columns(name, name, name);
        let columns = columns.rows().fetch_all(pool).await?;
        Ok((tables, indexes, columns))
    }

    async fn marker_tables(pool: &Pool<Self>) -> Result<Vec<String>, sqlx::Error> {
        sqlx::query_scalar(
            "SELECT CAST(TABLE_NAME AS CHAR) FROM information_schema.COLUMNS \
             WHERE TABLE_SCHEMA = DATABASE() AND COLUMN_NAME IN ('scope', 'key', 'state', \
             'token', 'locked_until', 'attempts', 'completed_at') \
             GROUP BY TABLE_NAME HAVING COUNT(*) = 7 ORDER BY TABLE_NAME",
        )
        .fetch_all(pool)
        .await
    }

    async fn count_old<'p>(
        pool: &'p Pool<Self>,
        sql: &'p MySqlSql,
        scope: Option<&'p str>,
        age_ms: i64,
    ) -> Result<i64, sqlx::Error> {
        let statements = HealthSql::new(Self::table(sql));
        let query = match scope {
            Some(scope) => statements.old_in_scope(scope, age_ms, COUNT_CAP),
            None => statements.old(age_ms, COUNT_CAP),
        };
        query.scalar().fetch_one(pool).await
    }

    async fn count_stuck<'p>(
        pool: &'p Pool<Self>,
        sql: &'p MySqlSql,
        age_ms: i64,
    ) -> Result<i64, sqlx::Error> {
        let statements = HealthSql::new(Self::table(sql));
        statements
            .stuck(age_ms, COUNT_CAP)
            .scalar()
            .fetch_one(pool)
            .await
    }

    async fn count_outbox<'p>(
        pool: &'p Pool<Self>,
        sql: &'p MySqlSql,
        age_ms: i64,
    ) -> Result<(i64, i64), sqlx::Error> {
        let statements = HealthSql::new(Self::table(sql));
        statements.outbox(age_ms).rows().fetch_one(pool).await
    }

    async fn bloat<'p>(
        pool: &'p Pool<Self>,
        sql: &'p MySqlSql,
    ) -> Result<Option<Bloat>, sqlx::Error> {
        let statements = HealthSql::new(Self::table(sql));
        let row: Option<(i64, i64)> = statements
            .bloat(Self::table(sql).as_str())
            .rows()
            .fetch_optional(pool)
            .await?;
        Ok(row.map(|(free, used)| Bloat::Bytes { free, used }))
    }

    async fn clock_ms(pool: &Pool<Self>) -> Result<Option<i64>, sqlx::Error> {
        sqlx::query_scalar(
            "SELECT CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) \
             DIV 1000 AS SIGNED)",
        )
        .fetch_one(pool)
        .await
        .map(Some)
    }

    async fn max_connections(pool: &Pool<Self>) -> Result<Option<i64>, sqlx::Error> {
        sqlx::query_scalar("SELECT CAST(@@max_connections AS SIGNED)")
            .fetch_one(pool)
            .await
            .map(Some)
    }

    async fn ports(_pool: &Pool<Self>) -> Result<Option<(u16, i64)>, sqlx::Error> {
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::sql::{Placeholders, check_binds};

    #[test]
    fn every_statement_has_as_many_placeholders_as_binds() {
        check_binds(&super::HealthSql::templates(), Placeholders::Question);
    }
}
