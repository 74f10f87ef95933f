//! What each database does differently; everything else is written once in [`Store`](crate::Store).

use std::future::Future;

use sqlx::{Pool, SqlSafeStr as _, SqlStr, Transaction};

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

mod sealed {
    pub trait Sealed {}
}

/// A database idem can keep markers in: `sqlx::Postgres`, `sqlx::Sqlite` or `sqlx::MySql`,
/// each behind the cargo feature of the same name.
///
/// The trait is sealed: its items are the SQL each backend needs and are not a public API.
pub trait Backend: sqlx::Database + sealed::Sealed {
    #[doc(hidden)]
    const BACKEND: &'static str;

    #[doc(hidden)]
    fn sql(table: &str) -> Sql;

    /// Inserts the marker in `tx`; `Ok(false)` means an earlier delivery already committed it.
    #[doc(hidden)]
    fn try_claim<'t>(
        tx: &'t mut Transaction<'static, Self>,
        sql: &'t Sql,
        scope: &'t str,
        key: &'t str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 't;

    /// A race lost to another claimer (serialization failure, deadlock victim): worth retrying.
    #[doc(hidden)]
    fn is_transient(err: &sqlx::Error) -> bool;

    #[doc(hidden)]
    fn migrate<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Sql,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'p;

    #[doc(hidden)]
    fn forget<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Sql,
        scope: &'p str,
        key: &'p str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'p;
}

/// The statements of one backend for one table, built once per [`Store`](crate::Store) so
/// that every call reuses the same strings and hits sqlx's prepared-statement cache.
#[doc(hidden)]
#[derive(Debug)]
pub struct Sql {
    pub(crate) table: String,
    pub(crate) begin: SqlStr,
    pub(crate) claim: SqlStr,
    pub(crate) forget: SqlStr,
    pub(crate) ddl: Vec<SqlStr>,
}

impl Sql {
    /// `table` has been checked to be a plain identifier, so formatting it into SQL is safe.
    fn new(table: &str, begin: &'static str, claim: &str, forget: &str, ddl: &[&str]) -> Sql {
        let fill = |s: &str| sqlx::AssertSqlSafe(s.replace("{t}", table)).into_sql_str();
        Sql {
            table: table.to_owned(),
            begin: begin.into_sql_str(),
            claim: fill(claim),
            forget: fill(forget),
            ddl: ddl.iter().map(|s| fill(s)).collect(),
        }
    }
}
