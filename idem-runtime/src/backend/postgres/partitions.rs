//! A marker table partitioned by the time its keys carry, on PostgreSQL: its DDL, its
//! partitions' creation, listing and removal (the `partitions` module says why it is sound).
//!
//! The marker table and the lease steps' table are partitioned by range of `key`, with the
//! same bounds: a key that carries its time (a UUIDv7, a ULID) sorts among the keys of its
//! day. Their primary keys hold `key`, the partition column, so PostgreSQL enforces
//! `(scope, key)` across the whole table: a key lands in one partition, whichever delivery
//! writes it. `key` is compared bytewise (`COLLATE "C"`), as the bounds are written.

use sqlx::{AssertSqlSafe, PgConnection, Pool, Postgres, Row as _, SqlSafeStr, Transaction};

use super::{DDL, database_code};
use crate::backend::Sql;
use crate::backend::Table;

/// `check_violation`: a new partition's range holds rows of the default partition.
const CHECK_VIOLATION: &str = "23514";

/// What made the partitioned form impossible, for the caller's error.
#[derive(Debug)]
pub(crate) enum Refused {
    /// The marker table exists and is not partitioned (`relkind`).
    NotPartitioned(String),
    Database(sqlx::Error),
}

impl From<sqlx::Error> for Refused {
    fn from(e: sqlx::Error) -> Self {
        Refused::Database(e)
    }
}

/// One day's partition: its name's suffix and its bounds, as keys sort.
#[derive(Debug, Clone)]
pub(crate) struct Range {
    pub(crate) suffix: String,
    pub(crate) from: String,
    pub(crate) to: String,
}

/// `create` with `key` compared bytewise and the table partitioned by it.
fn partitioned(create: &str) -> String {
    const KEY: &str = "key text NOT NULL,";
    assert!(create.contains(KEY), "the table has a text key: {create}");
    let create = create.replacen(KEY, "key text COLLATE \"C\" NOT NULL,", 1);
    format!("{} PARTITION BY RANGE (key)", create.trim_end())
}

/// The `CREATE TABLE` of the marker table and of the steps' table, as `migrate` makes them.
fn creates() -> [&'static str; 2] {
    let of = |prefix: &str| {
        *DDL.iter()
            .find(|s| s.starts_with(prefix))
            .expect("the DDL creates the table")
    };
    [
        of("CREATE TABLE IF NOT EXISTS {t} ("),
        of("CREATE TABLE IF NOT EXISTS {t}_steps ("),
    ]
}

/// The tables partitioned alike: the markers and their lease steps.
const PARENTS: [&str; 2] = ["{t}", "{t}_steps"];

/// A transaction that holds `migrate`'s lock of `table`, which serialises the partitions' DDL
/// with `migrate`'s.
async fn locked(
    pool: &Pool<Postgres>,
    table: &Table,
) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('idem.migrate.' || $1))")
        .bind(table.as_str())
        .persistent(false)
        .execute(&mut *tx)
        .await?;
    Ok(tx)
}

/// Runs `statement` in `conn` unnamed, as every statement here (none is kept prepared).
async fn run(conn: &mut PgConnection, statement: impl SqlSafeStr) -> Result<(), sqlx::Error> {
    sqlx::query(statement)
        .persistent(false)
        .execute(conn)
        .await?;
    Ok(())
}

/// Creates the marker and steps tables partitioned, each with a default partition for keys
/// that carry no time, unless the marker table is partitioned already; refuses a marker table
/// that exists and is not.
pub(crate) async fn create_parents(
    pool: &Pool<Postgres>,
    sql: &Sql<Postgres>,
) -> Result<(), Refused> {
    let table = &sql.table;
    let mut tx = locked(pool, table).await?;
    for parent in PARENTS {
        let name = parent.replace("{t}", table.as_str());
        let kind: Option<String> =
            sqlx::query_scalar("SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)")
                .bind(&name)
                .persistent(false)
                .fetch_optional(&mut *tx)
                .await?;
        match kind.as_deref() {
            Some("p") => continue,
            Some(_) => return Err(Refused::NotPartitioned(name)),
            None => {}
        }
    }
    for (parent, create) in PARENTS.into_iter().zip(creates()) {
        for stmt in [
            partitioned(create),
            format!("CREATE TABLE IF NOT EXISTS {parent}_default PARTITION OF {parent} DEFAULT"),
        ] {
            run(&mut tx, table.fill(&stmt)).await?;
        }
    }
    tx.commit().await?;
    Ok(())
}

/// Creates the partitions of `days` that are missing; returns the suffixes of those made,
/// and of those skipped because the default partition holds keys of their range already
/// (keys written while the day had no partition of its own).
pub(crate) async fn create(
    pool: &Pool<Postgres>,
    sql: &Sql<Postgres>,
    days: &[Range],
) -> Result<(Vec<String>, Vec<String>), sqlx::Error> {
    let table = &sql.table;
    let mut tx = locked(pool, table).await?;
    run(&mut tx, "SET LOCAL client_min_messages = warning").await?;
    let existing = list_in(&mut tx, sql).await?;
    let (mut made, mut skipped) = (Vec::new(), Vec::new());
    for day in days.iter().filter(|d| !existing.contains(&d.suffix)) {
        // A range the default partition already holds rows of cannot be split off it: that
        // day stays in the default partition, purged row by row.
        run(&mut tx, "SAVEPOINT idem_partition").await?;
        let mut refused = false;
        for parent in PARENTS {
            let stmt = format!(
                "CREATE TABLE {parent}_{} PARTITION OF {parent} FOR VALUES FROM ('{}') TO ('{}')",
                day.suffix, day.from, day.to
            );
            match run(&mut tx, table.fill(&stmt)).await {
                Ok(_) => {}
                Err(e) if database_code(&e).as_deref() == Some(CHECK_VIOLATION) => {
                    refused = true;
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        let end = match refused {
            true => "ROLLBACK TO SAVEPOINT idem_partition",
            false => "RELEASE SAVEPOINT idem_partition",
        };
        run(&mut tx, end).await?;
        match refused {
            true => skipped.push(day.suffix.clone()),
            false => made.push(day.suffix.clone()),
        }
    }
    tx.commit().await?;
    Ok((made, skipped))
}

/// The suffixes of the marker table's day partitions (not its default one), in order.
pub(crate) async fn list(
    pool: &Pool<Postgres>,
    sql: &Sql<Postgres>,
) -> Result<Vec<String>, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    list_in(&mut conn, sql).await
}

async fn list_in(conn: &mut PgConnection, sql: &Sql<Postgres>) -> Result<Vec<String>, sqlx::Error> {
    let table = sql.table.as_str();
    let rows = sqlx::query(
        "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = to_regclass($1) \
         AND pg_get_expr(c.relpartbound, c.oid) <> 'DEFAULT' ORDER BY 1",
    )
    .bind(table)
    .persistent(false)
    .fetch_all(conn)
    .await?;
    let prefix = format!("{table}_");
    Ok(rows
        .iter()
        .filter_map(|r| {
            let name: String = r.get(0);
            name.strip_prefix(&prefix).map(str::to_owned)
        })
        .collect())
}

/// Drops the day partitions `suffixes` of both tables, in one transaction that waits at most
/// `lock_ms` for the tables' lock (a drop waiting longer would queue every claim behind it).
pub(crate) async fn drop(
    pool: &Pool<Postgres>,
    sql: &Sql<Postgres>,
    suffixes: &[String],
    lock_ms: u64,
) -> Result<(), sqlx::Error> {
    if suffixes.is_empty() {
        return Ok(());
    }
    let table = &sql.table;
    let mut tx = locked(pool, table).await?;
    run(
        &mut tx,
        AssertSqlSafe(format!("SET LOCAL lock_timeout = {lock_ms}")),
    )
    .await?;
    for suffix in suffixes {
        for parent in PARENTS {
            let stmt = format!("DROP TABLE IF EXISTS {parent}_{suffix}");
            run(&mut tx, table.fill(&stmt)).await?;
        }
    }
    tx.commit().await
}

#[cfg(test)]
mod tests {
    #[test]
    fn both_tables_are_partitioned_by_a_bytewise_key() {
        for create in super::creates() {
            let made = super::partitioned(create);
            assert!(made.contains("key text COLLATE \"C\" NOT NULL,"), "{made}");
            assert!(made.ends_with(") PARTITION BY RANGE (key)"), "{made}");
            assert!(made.contains("PRIMARY KEY (scope, key"), "{made}");
        }
    }
}
