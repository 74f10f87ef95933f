//! What `Store::doctor` reads on PostgreSQL. Statements with binds go through
//! [`on_pool`](super::pinned::on_pool); those without are sent as simple queries (`raw_sql`),
//! one message each, which works behind a pooler in transaction mode too.

use sqlx::{Pool, Postgres, Row as _};

use super::PgSql;
use super::pinned::on_pool;
use crate::backend::health::{Bloat, COUNT_CAP, Catalog, Health};
use crate::backend::sealed::Dialect as _;
use crate::backend::sql::statements;

/// The columns every marker table has.
const MARKER_COLUMNS: &str =
    "('scope', 'key', 'state', 'token', 'locked_until', 'attempts', 'completed_at')";

statements! {
    /// The doctor's statements, made when it runs.
    pub(super) struct HealthSql<Postgres> {
        // PostgreSQL folds unquoted names to lower case.
        tables(name: &str) =
            "SELECT tablename::text FROM pg_tables WHERE schemaname = current_schema() \
             AND (tablename = lower($1) OR left(tablename, length($1) + 1) = lower($1) || '_')";
        indexes(name: &str) =
            "SELECT tablename::text, indexname::text FROM pg_indexes \
             WHERE schemaname = current_schema() \
             AND (tablename = lower($1) OR left(tablename, length($1) + 1) = lower($1) || '_')";
        columns(name: &str) =
            "SELECT table_name::text, column_name::text FROM information_schema.columns \
             WHERE table_schema = current_schema() \
             AND (table_name = lower($1) OR left(table_name, length($1) + 1) = lower($1) || '_')";
        old_in_scope(scope: &str, age_ms: i64, cap: i64) =
            "SELECT COUNT(*) FROM (SELECT 1 FROM {t} WHERE scope = $1 AND state = 'completed' \
             AND completed_at < now() - $2 * interval '1 millisecond' LIMIT $3) s";
        old(age_ms: i64, cap: i64) =
            "SELECT COUNT(*) FROM (SELECT 1 FROM {t} WHERE state = 'completed' \
             AND completed_at < now() - $1 * interval '1 millisecond' \
             AND scope NOT IN (SELECT scope FROM {t}_retention) LIMIT $2) s";
        stuck(age_ms: i64, cap: i64) =
            "SELECT COUNT(*) FROM (SELECT 1 FROM {t} WHERE state = 'in_progress' \
             AND COALESCE(locked_until, created_at) < now() - $1 * interval '1 millisecond' \
             LIMIT $2) s";
        outbox(age_ms: i64) =
            "SELECT COUNT(*) FILTER (WHERE parked), COUNT(*) FILTER (WHERE NOT parked \
             AND next_attempt_at < now() - $1 * interval '1 millisecond') \
             FROM {t}_outbox WHERE sent_at IS NULL";
        bloat(name: &str) =
            "SELECT n_dead_tup, n_live_tup FROM pg_stat_user_tables \
             WHERE schemaname = current_schema() AND relname = lower($1)";
    }
}

impl Health for Postgres {
    async fn catalog<'p>(pool: &'p Pool<Self>, sql: &'p PgSql) -> Result<Catalog, sqlx::Error> {
        let name = Self::table(sql).as_str();
        let statements = HealthSql::new(Self::table(sql));
        let tables = on_pool(pool, sql, async |conn| {
            statements.tables(name).scalar().fetch_all(conn).await
        })
        .await?;
        let indexes = on_pool(pool, sql, async |conn| {
            statements.indexes(name).rows().fetch_all(conn).await
        })
        .await?;
        let columns = on_pool(pool, sql, async |conn| {
            statements.columns(name).rows().fetch_all(conn).await
        })
        .await?;
        Ok((tables, indexes, columns))
    }

    async fn marker_tables(pool: &Pool<Self>) -> Result<Vec<String>, sqlx::Error> {
        let query = format!(
            "SELECT table_name::text FROM information_schema.columns \
             WHERE table_schema = current_schema() AND column_name IN {MARKER_COLUMNS} \
             GROUP BY table_name HAVING COUNT(*) = 7 ORDER BY table_name"
        );
        let rows = sqlx::raw_sql(sqlx::AssertSqlSafe(query))
            .fetch_all(pool)
            .await?;
        rows.iter().map(|row| row.try_get(0)).collect()
    }

    async fn count_old<'p>(
        pool: &'p Pool<Self>,
        sql: &'p PgSql,
        scope: Option<&'p str>,
        age_ms: i64,
    ) -> Result<i64, sqlx::Error> {
        let statements = HealthSql::new(Self::table(sql));
        let query = match scope {
            Some(scope) => statements.old_in_scope(scope, age_ms, COUNT_CAP),
            None => statements.old(age_ms, COUNT_CAP),
        };
        on_pool(pool, sql, async |conn| query.scalar().fetch_one(conn).await).await
    }

    async fn count_stuck<'p>(
        pool: &'p Pool<Self>,
        sql: &'p PgSql,
        age_ms: i64,
    ) -> Result<i64, sqlx::Error> {
        let statements = HealthSql::new(Self::table(sql));
        let query = statements.stuck(age_ms, COUNT_CAP);
        on_pool(pool, sql, async |conn| query.scalar().fetch_one(conn).await).await
    }

    async fn count_outbox<'p>(
        pool: &'p Pool<Self>,
        sql: &'p PgSql,
        age_ms: i64,
    ) -> Result<(i64, i64), sqlx::Error> {
        let statements = HealthSql::new(Self::table(sql));
        on_pool(pool, sql, async |conn| {
            statements.outbox(age_ms).rows().fetch_one(conn).await
        })
        .await
    }

    async fn bloat<'p>(pool: &'p Pool<Self>, sql: &'p PgSql) -> Result<Option<Bloat>, sqlx::Error> {
        let statements = HealthSql::new(Self::table(sql));
        let row: Option<(i64, i64)> = on_pool(pool, sql, async |conn| {
            statements
                .bloat(Self::table(sql).as_str())
                .rows()
                .fetch_optional(conn)
                .await
        })
        .await?;
        Ok(row.map(|(dead, live)| Bloat::Rows { dead, live }))
    }

    async fn clock_ms(pool: &Pool<Self>) -> Result<Option<i64>, sqlx::Error> {
        one(
            pool,
            "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::int8",
        )
        .await
        .map(Some)
    }

    async fn max_connections(pool: &Pool<Self>) -> Result<Option<i64>, sqlx::Error> {
        one(pool, "SELECT current_setting('max_connections')::int8")
            .await
            .map(Some)
    }

    async fn ports(pool: &Pool<Self>) -> Result<Option<(u16, i64)>, sqlx::Error> {
        let server: Option<i32> = one(pool, "SELECT inet_server_port()").await?;
        let ours = pool.connect_options().get_port();
        Ok(server.map(|port| (ours, i64::from(port))))
    }
}

/// The first column of the one row `query` (no binds) answers, as a simple query.
async fn one<T>(pool: &Pool<Postgres>, query: &'static str) -> Result<T, sqlx::Error>
where
    T: for<'r> sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres>,
{
    sqlx::raw_sql(query).fetch_one(pool).await?.try_get(0)
}

#[cfg(test)]
mod tests {
    use crate::backend::sql::{Placeholders, check_binds};

    #[test]
    fn every_statement_has_as_many_placeholders_as_binds() {
        check_binds(&super::HealthSql::templates(), Placeholders::Dollar);
    }
}
