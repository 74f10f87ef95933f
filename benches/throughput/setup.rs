//! Each database's tables: the accounts and the marker tables, made before and dropped after
//! the runs, so that every run starts from the same state.

use std::fmt::Write as _;

use idem::Store;
use sqlx::{AssertSqlSafe, MySql, Pool, Postgres, Sqlite};

use crate::{ACCOUNTS, ALL_TABLES, Res, T_ACCOUNTS, T_HAND, T_MACRO, T_PGBENCH};

pub(crate) async fn exec<'c, E>(conn: E, sql: &str) -> Res<()>
where
    E: sqlx::Executor<'c>,
{
    conn.execute(sqlx::raw_sql(AssertSqlSafe(sql.to_owned())))
        .await?;
    Ok(())
}

/// `INSERT ... VALUES` of the accounts in batches (MySQL and SQLite).
pub(crate) fn account_batches() -> Vec<String> {
    (0..ACCOUNTS)
        .collect::<Vec<_>>()
        .chunks(1_000)
        .map(|ids| {
            let mut sql = format!("INSERT INTO {T_ACCOUNTS} (id, credits) VALUES ");
            for (i, id) in ids.iter().enumerate() {
                let sep = if i == 0 { "" } else { ", " };
                let _ = write!(sql, "{sep}({}, 0)", id + 1);
            }
            sql
        })
        .collect()
}

pub(crate) async fn setup_pg(pool: &Pool<Postgres>) -> Res<()> {
    exec(
        pool,
        &format!("DROP TABLE IF EXISTS {}", ALL_TABLES.join(", ")),
    )
    .await?;
    exec(
        pool,
        &format!("CREATE TABLE {T_ACCOUNTS} (id bigint PRIMARY KEY, credits bigint NOT NULL)"),
    )
    .await?;
    exec(
        pool,
        &format!(
            "INSERT INTO {T_ACCOUNTS} (id, credits) SELECT g, 0 FROM generate_series(1, {ACCOUNTS}) g"
        ),
    )
    .await?;
    for t in [T_MACRO, T_HAND, T_PGBENCH] {
        Store::new(pool.clone()).with_table(t)?.migrate().await?;
    }
    exec(pool, &format!("VACUUM ANALYZE {T_ACCOUNTS}")).await
}

pub(crate) async fn setup_lite(pool: &Pool<Sqlite>) -> Res<()> {
    exec(
        pool,
        &format!("CREATE TABLE {T_ACCOUNTS} (id INTEGER PRIMARY KEY, credits INTEGER NOT NULL)"),
    )
    .await?;
    for sql in account_batches() {
        exec(pool, &sql).await?;
    }
    for t in [T_MACRO, T_HAND] {
        Store::new(pool.clone()).with_table(t)?.migrate().await?;
    }
    Ok(())
}

pub(crate) async fn setup_my(pool: &Pool<MySql>) -> Res<()> {
    exec(
        pool,
        &format!("DROP TABLE IF EXISTS {}", ALL_TABLES.join(", ")),
    )
    .await?;
    exec(
        pool,
        &format!(
            "CREATE TABLE {T_ACCOUNTS} (id BIGINT PRIMARY KEY, credits BIGINT NOT NULL) \
             ENGINE = InnoDB"
        ),
    )
    .await?;
    for sql in account_batches() {
        exec(pool, &sql).await?;
    }
    for t in [T_MACRO, T_HAND] {
        Store::new(pool.clone()).with_table(t)?.migrate().await?;
    }
    Ok(())
}
