//! What `Store::doctor` reads on SQLite.

use sqlx::{Pool, Sqlite};

use super::SqliteSql;
use crate::backend::health::{Bloat, COUNT_CAP, Catalog, Health};
use crate::backend::sealed::Dialect as _;
use crate::backend::sql::statements;

/// `now` less `?N` milliseconds, as the marker table writes times.
macro_rules! ago {
    ($n:literal) => {
        concat!(
            "strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-' || (?",
            $n,
            " / 1000.0) || ' seconds')"
        )
    };
}

statements! {
    /// The doctor's statements, made when it runs.
    pub(super) struct HealthSql<Sqlite> {
        tables(name: &str) =
            "SELECT name FROM sqlite_master WHERE type = 'table' \
             AND (name = ?1 OR substr(name, 1, length(?1) + 1) = ?1 || '_')";
        indexes(name: &str) =
            "SELECT tbl_name, name FROM sqlite_master WHERE type = 'index' \
             AND (tbl_name = ?1 OR substr(tbl_name, 1, length(?1) + 1) = ?1 || '_')";
        columns(name: &str) =
            "SELECT m.name, c.name FROM sqlite_master m, pragma_table_info(m.name) c \
             WHERE m.type = 'table' \
             AND (m.name = ?1 OR substr(m.name, 1, length(?1) + 1) = ?1 || '_')";
        old_in_scope(scope: &str, age_ms: i64, cap: i64) = concat!(
            "SELECT COUNT(*) FROM (SELECT 1 FROM {t} WHERE scope = ?1 AND state = 'completed' \
             AND completed_at < ", ago!("2"), " LIMIT ?3)"
        );
        old(age_ms: i64, cap: i64) = concat!(
            "SELECT COUNT(*) FROM (SELECT 1 FROM {t} WHERE state = 'completed' \
             AND completed_at < ", ago!("1"), " \
             AND scope NOT IN (SELECT scope FROM {t}_retention) LIMIT ?2)"
        );
        stuck(age_ms: i64, cap: i64) = concat!(
            "SELECT COUNT(*) FROM (SELECT 1 FROM {t} WHERE state = 'in_progress' \
             AND COALESCE(locked_until, created_at) < ", ago!("1"), " LIMIT ?2)"
        );
        outbox(age_ms: i64) = concat!(
            "SELECT COALESCE(SUM(parked <> 0), 0), \
             COALESCE(SUM(parked = 0 AND next_attempt_at < ", ago!("1"), "), 0) \
             FROM {t}_outbox WHERE sent_at IS NULL"
        );
    }
}

impl Health for Sqlite {
    async fn catalog<'p>(pool: &'p Pool<Self>, sql: &'p SqliteSql) -> Result<Catalog, sqlx::Error> {
        let name = Self::table(sql).as_str();
        let statements = HealthSql::new(Self::table(sql));
        let tables = statements.tables(name).scalar().fetch_all(pool).await?;
        let indexes = statements.indexes(name).rows().fetch_all(pool).await?;
        let columns = statements.columns(name).rows().fetch_all(pool).await?;
        Ok((tables, indexes, columns))
    }

    async fn marker_tables(pool: &Pool<Self>) -> Result<Vec<String>, sqlx::Error> {
        sqlx::query_scalar(
            "SELECT m.name FROM sqlite_master m, pragma_table_info(m.name) c \
             WHERE m.type = 'table' AND c.name IN ('scope', 'key', 'state', 'token', \
             'locked_until', 'attempts', 'completed_at') \
             GROUP BY m.name HAVING COUNT(*) = 7 ORDER BY m.name",
        )
        .fetch_all(pool)
        .await
    }

    async fn count_old<'p>(
        pool: &'p Pool<Self>,
        sql: &'p SqliteSql,
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
        sql: &'p SqliteSql,
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
        sql: &'p SqliteSql,
        age_ms: i64,
    ) -> Result<(i64, i64), sqlx::Error> {
        let statements = HealthSql::new(Self::table(sql));
        statements.outbox(age_ms).rows().fetch_one(pool).await
    }

    async fn bloat<'p>(
        pool: &'p Pool<Self>,
        _sql: &'p SqliteSql,
    ) -> Result<Option<Bloat>, sqlx::Error> {
        // The whole file's: SQLite keeps every table's free pages in one list.
        let (free, total): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT freelist_count FROM pragma_freelist_count), \
             (SELECT page_count FROM pragma_page_count)",
        )
        .fetch_one(pool)
        .await?;
        Ok(Some(Bloat::Pages { free, total }))
    }

    async fn clock_ms(_pool: &Pool<Self>) -> Result<Option<i64>, sqlx::Error> {
        Ok(None)
    }

    async fn max_connections(_pool: &Pool<Self>) -> Result<Option<i64>, sqlx::Error> {
        Ok(None)
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
        check_binds(&super::HealthSql::templates(), Placeholders::Numbered);
    }
}
