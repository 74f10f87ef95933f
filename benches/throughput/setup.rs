//! Each database's tables: the accounts and the marker tables, made before and dropped after
//! the runs, so that every run starts from the same state.

use std::fmt::Write as _;

use idem::Store;
use sqlx::{AssertSqlSafe, MySql, Pool, Postgres, Sqlite};

use crate::config::config;
use crate::{ACCOUNTS, Res};

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
    let accounts = &config().accounts;
    (0..ACCOUNTS)
        .collect::<Vec<_>>()
        .chunks(1_000)
        .map(|ids| {
            let mut sql = format!("INSERT INTO {accounts} (id, credits) VALUES ");
            for (i, id) in ids.iter().enumerate() {
                let sep = if i == 0 { "" } else { ", " };
                let _ = write!(sql, "{sep}({}, 0)", id + 1);
            }
            sql
        })
        .collect()
}

pub(crate) async fn setup_pg(pool: &Pool<Postgres>) -> Res<()> {
    let c = config();
    let accounts = &c.accounts;
    drop_tables(pool).await?;
    exec(
        pool,
        &format!("CREATE TABLE {accounts} (id bigint PRIMARY KEY, credits bigint NOT NULL)"),
    )
    .await?;
    exec(
        pool,
        &format!(
            "INSERT INTO {accounts} (id, credits) SELECT g, 0 FROM generate_series(1, {ACCOUNTS}) g"
        ),
    )
    .await?;
    for t in [&c.markers, &c.hand, &c.pgbench] {
        Store::new(pool.clone()).with_table(t)?.migrate().await?;
    }
    exec(pool, &format!("VACUUM ANALYZE {accounts}")).await
}

pub(crate) async fn setup_lite(pool: &Pool<Sqlite>) -> Res<()> {
    let c = config();
    let accounts = &c.accounts;
    exec(
        pool,
        &format!("CREATE TABLE {accounts} (id INTEGER PRIMARY KEY, credits INTEGER NOT NULL)"),
    )
    .await?;
    for sql in account_batches() {
        exec(pool, &sql).await?;
    }
    for t in [&c.markers, &c.hand] {
        Store::new(pool.clone()).with_table(t)?.migrate().await?;
    }
    Ok(())
}

pub(crate) async fn setup_my(pool: &Pool<MySql>) -> Res<()> {
    let c = config();
    let accounts = &c.accounts;
    drop_tables(pool).await?;
    exec(
        pool,
        &format!(
            "CREATE TABLE {accounts} (id BIGINT PRIMARY KEY, credits BIGINT NOT NULL) \
             ENGINE = InnoDB"
        ),
    )
    .await?;
    for sql in account_batches() {
        exec(pool, &sql).await?;
    }
    for t in [&c.markers, &c.hand] {
        Store::new(pool.clone()).with_table(t)?.migrate().await?;
    }
    Ok(())
}

/// Drops this run's tables, and only them (their names carry the run's suffix): at the start,
/// in case a run with the same pid left them behind, and at the end, whatever the outcome.
pub(crate) async fn drop_tables<'c, E>(conn: E) -> Res<()>
where
    E: sqlx::Executor<'c>,
{
    exec(
        conn,
        &format!("DROP TABLE IF EXISTS {}", config().all_tables()),
    )
    .await
}
