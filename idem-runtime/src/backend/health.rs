//! What `Store::doctor` reads of a deployment, per backend: the schema's tables and indexes
//! in the catalog, how much of the marker table is dead space, the markers and messages that
//! need an operator, the database's clock, and what sits between the pool and the server.

use std::future::Future;

use sqlx::Pool;

use super::sealed::Dialect;

/// Counts past this are reported as "at least": each count reads at most this many rows.
pub(crate) const COUNT_CAP: i64 = 10_000;

/// The schema's tables (named like the marker table, or with its name and `_` as prefix),
/// their indexes as `(table, index)` and their columns as `(table, column)`.
pub(crate) type Catalog = (Vec<String>, Vec<(String, String)>, Vec<(String, String)>);

/// Dead space in the marker table, as the database measures it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bloat {
    /// PostgreSQL: dead and live row versions (`pg_stat_user_tables`).
    Rows { dead: i64, live: i64 },
    /// MySQL / MariaDB: free bytes in the table's space, and bytes in use (data and indexes).
    Bytes { free: i64, used: i64 },
    /// SQLite: free pages and all pages of the database file.
    Pages { free: i64, total: i64 },
}

/// The doctor's reads.
pub trait Health: Dialect {
    /// The tables of the current schema named like the marker table or with its name and `_`
    /// as prefix, the indexes of those tables and their columns: `(tables, (table, index),
    /// (table, column))`. Names as the catalog spells them.
    fn catalog<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
    ) -> impl Future<Output = Result<Catalog, sqlx::Error>> + Send + 'p;

    /// The tables of the current schema that have a marker table's columns.
    fn marker_tables<'p>(
        pool: &'p Pool<Self>,
    ) -> impl Future<Output = Result<Vec<String>, sqlx::Error>> + Send + 'p;

    /// Completed markers older than `age_ms`, of `scope` (or of every scope without a window
    /// of its own: `None`), at most [`COUNT_CAP`].
    fn count_old<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
        scope: Option<&'p str>,
        age_ms: i64,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send + 'p;

    /// Markers in progress whose lease ran out (or, released, that were claimed) more than
    /// `age_ms` ago, at most [`COUNT_CAP`].
    fn count_stuck<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
        age_ms: i64,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send + 'p;

    /// Outbox messages parked, and pending ones due more than `age_ms` ago.
    fn count_outbox<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
        age_ms: i64,
    ) -> impl Future<Output = Result<(i64, i64), sqlx::Error>> + Send + 'p;

    /// The marker table's dead space, where the database measures it.
    fn bloat<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
    ) -> impl Future<Output = Result<Option<Bloat>, sqlx::Error>> + Send + 'p;

    /// The database's clock in milliseconds since 1970, where it is not this host's (`None`
    /// for SQLite, which runs in this process).
    fn clock_ms<'p>(
        pool: &'p Pool<Self>,
    ) -> impl Future<Output = Result<Option<i64>, sqlx::Error>> + Send + 'p;

    /// The server's connection limit, where it has one.
    fn max_connections<'p>(
        pool: &'p Pool<Self>,
    ) -> impl Future<Output = Result<Option<i64>, sqlx::Error>> + Send + 'p;

    /// The port the pool connects to and the port the server says it listens on, where both
    /// are known (PostgreSQL over TCP): a pooler or proxy in between makes them differ.
    fn ports<'p>(
        pool: &'p Pool<Self>,
    ) -> impl Future<Output = Result<Option<(u16, i64)>, sqlx::Error>> + Send + 'p;
}
