//! Schema version 3: the retention window of each scope, kept in `{t}_retention` so that the
//! code that sets it and the `idem` tool that purges by it read one truth; and the purge of
//! one scope by its window. The default purge (`Operators::purge_batch`) leaves the scopes
//! that have a window of their own to this one.

use std::future::Future;

use sqlx::Pool;

use super::sealed::Dialect;

/// Per-scope retention: the windows, and the purge that honours them.
pub trait Retentions: Dialect {
    /// Sets the window of `scope` to `keep_ms` (a new one, or a change).
    fn retention_set<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
        scope: &'p str,
        keep_ms: i64,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'p;

    /// Removes the window of `scope`; `Ok(true)` if it had one.
    fn retention_clear<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
        scope: &'p str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'p;

    /// Every scope's window, `(scope, keep_ms)`, by scope.
    fn retention_list<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
    ) -> impl Future<Output = Result<Vec<(String, i64)>, sqlx::Error>> + Send + 'p;

    /// Deletes at most `limit` completed markers of `scope` older than `age_ms`; returns how
    /// many.
    fn purge_scope_batch<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
        scope: &'p str,
        age_ms: i64,
        limit: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'p;
}
