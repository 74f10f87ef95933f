//! What each database does differently; everything else is written once in [`Store`](crate::Store).

use std::future::Future;

use sqlx::{Pool, SqlSafeStr as _, SqlStr, Transaction};

use crate::ClaimOptions;
use crate::Recorded;
use crate::inspect::MarkerRow;
use crate::lease::LeaseState;

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

    /// The statement that begins a claim's transaction: `BEGIN` with the options' isolation
    /// level and lock wait, in one round trip.
    #[doc(hidden)]
    fn begin_sql(sql: &Sql, options: &ClaimOptions) -> SqlStr;

    /// Commits `tx`, in one round trip; `Ok(false)` means the database rolled the transaction
    /// back instead (a failed statement aborted it, or a deadlock undid it), so nothing of it
    /// was kept.
    #[doc(hidden)]
    fn commit<'a>(
        tx: Transaction<'a, Self>,
        sql: &'a Sql,
        options: &'a ClaimOptions,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// Rolls `tx` back (and undoes what [`begin_sql`](Backend::begin_sql) set on the session).
    #[doc(hidden)]
    fn rollback<'a>(
        tx: Transaction<'a, Self>,
        options: &'a ClaimOptions,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Ends a transaction that wrote nothing (the claim found an earlier delivery's marker)
    /// without waiting for the database's answer: sqlx queues the `ROLLBACK` when the
    /// transaction is dropped and sends it as the connection goes back to the pool, so a
    /// duplicate costs one round trip less. Nothing the rollback could lose was written, and a
    /// connection whose rollback fails is closed by the pool, not reused. Backends that set
    /// session state in [`begin_sql`](Backend::begin_sql) restore it and wait.
    #[doc(hidden)]
    fn abandon<'a>(
        tx: Transaction<'a, Self>,
        options: &'a ClaimOptions,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a {
        let _ = options;
        drop(tx);
        std::future::ready(Ok(()))
    }

    /// The claim waited longer than the `wait` it was given.
    #[doc(hidden)]
    fn is_lock_timeout(err: &sqlx::Error) -> bool;

    /// Inserts the marker (with the payload's fingerprint, if any) in `tx`; `Ok(false)` means
    /// an earlier delivery already committed it.
    #[doc(hidden)]
    fn try_claim<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Sql,
        scope: &'t str,
        key: &'t str,
        fingerprint: Option<&'t [u8]>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 't;

    /// Batch claim: inserts the markers of `keys` (distinct, sorted, so that overlapping
    /// batches lock rows in one order) in `tx` with one statement; returns the keys this
    /// transaction inserted, the others were committed earlier.
    #[doc(hidden)]
    fn try_claim_batch<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Sql,
        scope: &'t str,
        keys: &'t [&'t str],
    ) -> impl Future<Output = Result<Vec<String>, sqlx::Error>> + Send + 't;

    /// Reads the fingerprint and stored value of a marker another delivery committed.
    #[doc(hidden)]
    fn recorded<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Sql,
        scope: &'t str,
        key: &'t str,
    ) -> impl Future<Output = Result<Recorded, sqlx::Error>> + Send + 't;

    /// Stores the handler's value (JSON) with the marker, in the claim's transaction.
    #[doc(hidden)]
    fn record<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Sql,
        scope: &'t str,
        key: &'t str,
        json: &'t str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 't;

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

    /// Lease mode: claims `(scope, key)` for `lease_ms` of the database's clock, taking an
    /// expired lease over (token + 1, attempts + 1), in as few statements as the backend
    /// allows; autocommit, outside any transaction.
    #[doc(hidden)]
    fn lease_claim<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Sql,
        scope: &'p str,
        key: &'p str,
        lease_ms: i64,
        fingerprint: Option<&'p [u8]>,
    ) -> impl Future<Output = Result<LeaseState, sqlx::Error>> + Send + 'p;

    /// Lease mode: completes (storing `result`, if any), releases or renews the lease of the
    /// holder of `token`; `Ok(true)` if that holder still had the key.
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments, reason = "one statement's binds")]
    fn lease_update<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Sql,
        op: LeaseOp,
        scope: &'p str,
        key: &'p str,
        token: i64,
        lease_ms: i64,
        result: Option<&'p str>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'p;

    /// One marker, for operators.
    #[doc(hidden)]
    fn inspect<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Sql,
        scope: &'p str,
        key: &'p str,
    ) -> impl Future<Output = Result<Option<MarkerRow>, sqlx::Error>> + Send + 'p;

    /// At most `limit` in-progress markers of `scope`, expired or released leases first.
    #[doc(hidden)]
    fn in_progress<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Sql,
        scope: &'p str,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<MarkerRow>, sqlx::Error>> + Send + 'p;

    /// [`in_progress`](Backend::in_progress) in every scope.
    #[doc(hidden)]
    fn in_progress_all<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Sql,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<MarkerRow>, sqlx::Error>> + Send + 'p;

    /// Deletes at most `limit` completed markers older than `age_ms`; returns how many.
    #[doc(hidden)]
    fn purge_batch<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Sql,
        age_ms: i64,
        limit: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'p;
}

/// `forget` and `purge_batch` read the same on every backend but for the concrete types, which
/// sqlx's generic API cannot name without a wall of bounds.
macro_rules! pool_statements {
    () => {
        async fn forget<'p>(
            pool: &'p Pool<Self>,
            sql: &'p Sql,
            scope: &'p str,
            key: &'p str,
        ) -> Result<bool, sqlx::Error> {
            let done = sqlx::query(sql.forget.clone())
                .bind(scope)
                .bind(key)
                .execute(pool)
                .await?;
            Ok(done.rows_affected() > 0)
        }

        async fn inspect<'p>(
            pool: &'p Pool<Self>,
            sql: &'p Sql,
            scope: &'p str,
            key: &'p str,
        ) -> Result<Option<crate::inspect::MarkerRow>, sqlx::Error> {
            sqlx::query_as(sql.inspect.clone())
                .bind(scope)
                .bind(key)
                .fetch_optional(pool)
                .await
        }

        async fn in_progress<'p>(
            pool: &'p Pool<Self>,
            sql: &'p Sql,
            scope: &'p str,
            limit: i64,
        ) -> Result<Vec<crate::inspect::MarkerRow>, sqlx::Error> {
            sqlx::query_as(sql.in_progress.clone())
                .bind(scope)
                .bind(limit)
                .fetch_all(pool)
                .await
        }

        async fn in_progress_all<'p>(
            pool: &'p Pool<Self>,
            sql: &'p Sql,
            limit: i64,
        ) -> Result<Vec<crate::inspect::MarkerRow>, sqlx::Error> {
            sqlx::query_as(sql.in_progress_all.clone())
                .bind(limit)
                .fetch_all(pool)
                .await
        }

        async fn purge_batch<'p>(
            pool: &'p Pool<Self>,
            sql: &'p Sql,
            age_ms: i64,
            limit: i64,
        ) -> Result<u64, sqlx::Error> {
            let done = sqlx::query(sql.purge.clone())
                .bind(age_ms)
                .bind(limit)
                .execute(pool)
                .await?;
            Ok(done.rows_affected())
        }
    };
}
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
use pool_statements;

/// `ms` rounded up to whole seconds (at least one), for databases that count lock waits in
/// seconds.
#[cfg(feature = "mysql")]
fn whole_seconds(wait: std::time::Duration) -> u64 {
    wait.as_millis()
        .div_ceil(1000)
        .max(1)
        .try_into()
        .unwrap_or(u64::MAX)
}

/// Milliseconds for a `SET`, capped where databases stop accepting them (`i32::MAX`).
#[cfg(any(feature = "postgres", feature = "sqlite"))]
fn millis(wait: std::time::Duration) -> u64 {
    wait.as_millis().clamp(1, i32::MAX as u128) as u64
}

/// The claim of the backends with `INSERT ... ON CONFLICT DO NOTHING`: one row inserted means
/// this delivery holds the key, none means an earlier one committed it.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
macro_rules! claim_on_conflict {
    () => {
        async fn try_claim<'t>(
            conn: &'t mut Self::Connection,
            sql: &'t Sql,
            scope: &'t str,
            key: &'t str,
            fingerprint: Option<&'t [u8]>,
        ) -> Result<bool, sqlx::Error> {
            let done = sqlx::query(sql.claim.clone())
                .bind(scope)
                .bind(key)
                .bind(fingerprint)
                .execute(&mut *conn)
                .await?;
            Ok(done.rows_affected() == 1)
        }

        async fn record<'t>(
            conn: &'t mut Self::Connection,
            sql: &'t Sql,
            scope: &'t str,
            key: &'t str,
            json: &'t str,
        ) -> Result<(), sqlx::Error> {
            sqlx::query(sql.record.clone())
                .bind(scope)
                .bind(key)
                .bind(json)
                .execute(&mut *conn)
                .await?;
            Ok(())
        }
    };
}
#[cfg(any(feature = "postgres", feature = "sqlite"))]
use claim_on_conflict;

/// What a duplicate reads back of the marker (fingerprint, stored value): the same statement
/// shape on every backend, binding scope then key.
macro_rules! read_recorded {
    () => {
        async fn recorded<'t>(
            conn: &'t mut Self::Connection,
            sql: &'t Sql,
            scope: &'t str,
            key: &'t str,
        ) -> Result<Recorded, sqlx::Error> {
            let row: Option<(Option<Vec<u8>>, Option<String>)> =
                sqlx::query_as(sql.recorded.clone())
                    .bind(scope)
                    .bind(key)
                    .fetch_optional(&mut *conn)
                    .await?;
            let (fingerprint, result) = row.unwrap_or_default();
            Ok(Recorded {
                fingerprint,
                result,
            })
        }
    };
}
#[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
use read_recorded;

/// Lease claim of the backends with `INSERT ... ON CONFLICT DO UPDATE ... WHERE ...
/// RETURNING`: one statement inserts a fresh marker or takes an expired one over; no row back
/// means the marker is completed or held, which one more statement tells apart.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
macro_rules! lease_claim_on_conflict {
    () => {
        async fn lease_claim<'p>(
            pool: &'p Pool<Self>,
            sql: &'p Sql,
            scope: &'p str,
            key: &'p str,
            lease_ms: i64,
            fingerprint: Option<&'p [u8]>,
        ) -> Result<LeaseState, sqlx::Error> {
            let taken: Option<(i64, i64)> = sqlx::query_as(sql.lease.claim.clone())
                .bind(scope)
                .bind(key)
                .bind(lease_ms)
                .bind(fingerprint)
                .fetch_optional(pool)
                .await?;
            if let Some((token, attempts)) = taken {
                return Ok(LeaseState::Taken { token, attempts });
            }
            let row: Option<(String, Option<Vec<u8>>, Option<String>)> =
                sqlx::query_as(sql.lease.state.clone())
                    .bind(scope)
                    .bind(key)
                    .fetch_optional(pool)
                    .await?;
            Ok(super::lease_state(row))
        }
    };
}
#[cfg(any(feature = "postgres", feature = "sqlite"))]
use lease_claim_on_conflict;

/// Lease updates of the backends with numbered placeholders: scope, key and token are `$1` to
/// `$3` of every statement, the lease `$4` of `renew`, the stored value `$4` of `complete`.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
macro_rules! lease_update_numbered {
    () => {
        async fn lease_update<'p>(
            pool: &'p Pool<Self>,
            sql: &'p Sql,
            op: LeaseOp,
            scope: &'p str,
            key: &'p str,
            token: i64,
            lease_ms: i64,
            result: Option<&'p str>,
        ) -> Result<bool, sqlx::Error> {
            let query = sqlx::query(op.statement(sql).clone())
                .bind(scope)
                .bind(key)
                .bind(token);
            let query = match op {
                LeaseOp::Renew => query.bind(lease_ms),
                LeaseOp::Complete => query.bind(result),
                LeaseOp::Release => query,
            };
            Ok(query.execute(pool).await?.rows_affected() == 1)
        }
    };
}
#[cfg(any(feature = "postgres", feature = "sqlite"))]
use lease_update_numbered;

/// What a lease holder does with its marker after the claim.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseOp {
    /// `Ok`: `completed`, if the token still matches.
    Complete,
    /// `Err`, timeout, panic: expire the lease now (attempts are kept).
    Release,
    /// Extend the lease by its length from the database's now.
    Renew,
}

impl LeaseOp {
    #[cfg(any(feature = "postgres", feature = "sqlite"))]
    fn statement(self, sql: &Sql) -> &SqlStr {
        match self {
            LeaseOp::Complete => &sql.lease.complete,
            LeaseOp::Release => &sql.lease.release,
            LeaseOp::Renew => &sql.lease.renew,
        }
    }
}

/// What a marker that could not be taken says: `(state, fingerprint, result)`.
fn lease_state(row: Option<(String, Option<Vec<u8>>, Option<String>)>) -> LeaseState {
    match row {
        Some((state, fingerprint, result)) => {
            let recorded = Recorded {
                fingerprint,
                result,
            };
            if state == "completed" {
                LeaseState::Completed(recorded)
            } else {
                LeaseState::Held(recorded)
            }
        }
        None => LeaseState::Missing,
    }
}

/// The statements of one backend for one table, built once per [`Store`](crate::Store) so
/// that every call reuses the same strings and hits sqlx's prepared-statement cache.
#[doc(hidden)]
#[derive(Debug)]
pub struct Sql {
    pub(crate) table: String,
    pub(crate) begin: SqlStr,
    pub(crate) claim: SqlStr,
    #[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
    pub(crate) claim_batch: SqlStr,
    pub(crate) recorded: SqlStr,
    pub(crate) record: SqlStr,
    pub(crate) forget: SqlStr,
    pub(crate) purge: SqlStr,
    pub(crate) inspect: SqlStr,
    pub(crate) in_progress: SqlStr,
    pub(crate) in_progress_all: SqlStr,
    pub(crate) lease: LeaseSql,
    pub(crate) ddl: Vec<SqlStr>,
}

/// Lease mode's statements (see each backend for their binds).
#[derive(Debug)]
pub(crate) struct LeaseSql {
    /// Inserts an `in_progress` marker, or takes an expired one over where the backend can do
    /// both in one statement.
    pub(crate) claim: SqlStr,
    /// Takes an expired marker over (MySQL, whose claim only inserts).
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    pub(crate) takeover: SqlStr,
    /// Reads `state`, `fingerprint` and `result` of one marker.
    pub(crate) state: SqlStr,
    pub(crate) complete: SqlStr,
    pub(crate) release: SqlStr,
    pub(crate) renew: SqlStr,
}

/// The text of a backend's statements, `{t}` standing for the table.
pub(crate) struct Statements<'a> {
    pub(crate) begin: &'static str,
    pub(crate) claim: &'a str,
    pub(crate) claim_batch: &'a str,
    pub(crate) recorded: &'a str,
    pub(crate) record: &'a str,
    pub(crate) forget: &'a str,
    pub(crate) purge: &'a str,
    pub(crate) inspect: &'a str,
    pub(crate) in_progress: &'a str,
    pub(crate) in_progress_all: &'a str,
    pub(crate) lease_claim: &'a str,
    pub(crate) lease_takeover: &'a str,
    pub(crate) lease_state: &'a str,
    pub(crate) lease_complete: &'a str,
    pub(crate) lease_release: &'a str,
    pub(crate) lease_renew: &'a str,
    pub(crate) ddl: &'a [&'a str],
}

impl Sql {
    /// `table` has been checked to be a plain identifier, so formatting it into SQL is safe.
    fn new(table: &str, s: Statements<'_>) -> Sql {
        let fill = |s: &str| sqlx::AssertSqlSafe(s.replace("{t}", table)).into_sql_str();
        Sql {
            table: table.to_owned(),
            begin: s.begin.into_sql_str(),
            claim: fill(s.claim),
            claim_batch: fill(s.claim_batch),
            recorded: fill(s.recorded),
            record: fill(s.record),
            forget: fill(s.forget),
            inspect: fill(s.inspect),
            in_progress: fill(s.in_progress),
            in_progress_all: fill(s.in_progress_all),
            purge: fill(s.purge),
            lease: LeaseSql {
                claim: fill(s.lease_claim),
                takeover: fill(s.lease_takeover),
                state: fill(s.lease_state),
                complete: fill(s.lease_complete),
                release: fill(s.lease_release),
                renew: fill(s.lease_renew),
            },
            ddl: s.ddl.iter().map(|s| fill(s)).collect(),
        }
    }
}
