//! Statements outside a transaction, behind a pooler in transaction mode.
//!
//! sqlx sends a statement with binds in two steps, each ended by a `Sync`: parse (and
//! describe), then bind and execute. Outside a transaction, a pooler in transaction mode
//! (PgBouncer's `pool_mode = transaction`) takes the server connection back after the first
//! step and may give the second step another one, whose unnamed statement is whatever another
//! client parsed there last: the bind fails, or runs that other statement with these binds.
//! Inside a transaction the pooler keeps the server connection. So behind such a pooler
//! ([`Table::is_unnamed`](crate::backend::sql::Table::is_unnamed)) each statement idem runs
//! outside a transaction runs in a transaction of its own; elsewhere it runs as it is, at no
//! cost.

use sqlx::{Connection as _, PgConnection, Pool, Postgres};

use super::PgSql;

/// Runs `work` on a connection of `pool`, in a transaction of its own behind a pooler.
pub(super) async fn on_pool<T>(
    pool: &Pool<Postgres>,
    sql: &PgSql,
    work: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
) -> Result<T, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    on_conn(&mut conn, sql, work).await
}

/// Runs `work` on `conn`, in a transaction of its own behind a pooler unless `conn` is in one
/// already.
pub(super) async fn on_conn<T>(
    conn: &mut PgConnection,
    sql: &PgSql,
    work: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
) -> Result<T, sqlx::Error> {
    if !sql.table.is_unnamed() || conn.is_in_transaction() {
        return work(conn).await;
    }
    let mut tx = conn.begin().await?;
    let out = work(&mut tx).await?;
    tx.commit().await?;
    Ok(out)
}
