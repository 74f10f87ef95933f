//! What each database does differently: its SQL and the rows it returns. Nothing here knows a
//! mode; the claim core (`claim`) decides what the rows mean.
//!
//! [`Backend`] is the public, sealed name of a database idem supports. Its statements sit on
//! the supertrait [`Dialect`], which no other crate can name, and take the table as
//! [`Statements`], which only a [`Store`](crate::Store) builds from a validated [`Table`]: no
//! caller outside idem can get a statement run, let alone one on a table name of its own.

use std::future::Future;
use std::time::Duration;

use sqlx::{Pool, SqlStr, Transaction};

use crate::ClaimOptions;

mod listen;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
mod rows;
mod shared;
#[cfg(feature = "sqlite")]
mod sqlite;
mod statements;

pub(crate) use listen::Listen;
pub(crate) use rows::{Found, Hold, LeaseState, MarkerRow, OutboxRow};
pub use statements::MAX_TABLE_LEN;
pub(crate) use statements::{Statements, Table, Templates};

/// A database idem can keep markers in: `sqlx::Postgres`, `sqlx::Sqlite` or `sqlx::MySql`,
/// each behind the cargo feature of the same name.
///
/// The trait is sealed: the SQL each backend runs is not a public API.
#[diagnostic::on_unimplemented(
    message = "idem cannot keep markers in `{Self}`: this build of idem does not have that database",
    label = "a store or handler on `{Self}`",
    note = "enable idem's cargo feature for it: `postgres`, `mysql` or `sqlite` (the default), e.g. `idem = {{ version = \"..\", features = [\"postgres\"] }}`"
)]
pub trait Backend: sealed::Dialect {}

/// One claim's identity in the statements that write its marker.
#[derive(Debug, Clone, Copy)]
pub struct Claimant<'a> {
    pub(crate) scope: &'a str,
    pub(crate) key: &'a str,
    pub(crate) fingerprint: Option<&'a [u8]>,
    /// This claim's own id (negative): MySQL writes it as the marker's `token`, so that the
    /// commit can tell whether the transaction holding it is still the one that claimed.
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    pub(crate) nonce: i64,
    /// MariaDB bounds the claim's lock waits per statement.
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    pub(crate) wait: Option<Duration>,
}

/// What a commit checks to tell a commit from a transaction the database threw away.
#[derive(Debug, Clone, Copy)]
pub enum Check<'a> {
    /// The marker a claim of this transaction wrote (MySQL counts it by its nonce).
    Marker(&'a Statements, Claimant<'a>),
    /// No marker of ours: a caller's transaction (`idem::commit`).
    Session,
}

/// What a lease holder does with its marker after the claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseOp {
    /// `Ok`: `completed`, if the token still matches.
    Complete,
    /// `Err`, timeout, panic: expire the lease now (attempts are kept).
    Release,
    /// Extend the lease by its length from the database's now.
    Renew,
}

pub(crate) mod sealed {
    use super::*;

    /// The statements of one database. Every method takes [`Statements`], which only a
    /// [`Store`](crate::Store) can build.
    pub trait Dialect: sqlx::Database {
        /// The backend's name in `Debug` output and the CLI.
        const BACKEND: &'static str;

        /// The statements of this backend for `table`.
        fn statements(table: &Table) -> Statements;

        /// The statement that begins a claim's transaction: `BEGIN` with the options'
        /// isolation level and lock wait, in one round trip.
        fn begin_sql(st: &Statements, options: &ClaimOptions) -> SqlStr;

        /// Commits `tx`, in one round trip; `Ok(false)` means the database rolled the
        /// transaction back instead (a failed statement aborted it, or a deadlock undid it),
        /// so nothing of it was kept.
        fn commit<'a>(
            tx: Transaction<'a, Self>,
            check: Check<'a>,
            options: &'a ClaimOptions,
        ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

        /// Rolls `tx` back (and undoes what [`begin_sql`](Dialect::begin_sql) set on the
        /// session).
        fn rollback<'a>(
            tx: Transaction<'a, Self>,
            options: &'a ClaimOptions,
        ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a {
            let _ = options;
            tx.rollback()
        }

        /// Ends a transaction that wrote nothing (the claim found an earlier delivery's
        /// marker) without waiting for the database's answer: sqlx queues the `ROLLBACK` when
        /// the transaction is dropped and sends it as the connection goes back to the pool,
        /// so a duplicate costs one round trip less. A connection whose rollback fails is
        /// closed by the pool, not reused. Backends that set session state in
        /// [`begin_sql`](Dialect::begin_sql) restore it and wait.
        fn abandon<'a>(
            tx: Transaction<'a, Self>,
            options: &'a ClaimOptions,
        ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a {
            let _ = options;
            drop(tx);
            std::future::ready(Ok(()))
        }

        /// The claim waited longer than the `wait` it was given.
        fn is_lock_timeout(err: &sqlx::Error) -> bool;

        /// A race lost to another claimer (serialization failure, deadlock victim): worth
        /// retrying.
        fn is_transient(err: &sqlx::Error) -> bool;

        /// Inserts the marker (`completed`, with the payload's fingerprint, if any) in the
        /// transaction; `Ok(false)` means a marker is there already (or being written).
        fn try_claim<'t>(
            conn: &'t mut Self::Connection,
            st: &'t Statements,
            claimant: Claimant<'t>,
        ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 't;

        /// [`try_claim`](Dialect::try_claim), and when it inserted nothing, what
        /// [`marker`](Dialect::marker) reads: `(inserted, the marker found)`. PostgreSQL does
        /// both in one statement, so that a duplicate costs no round trip more than the
        /// insert; there the marker can be missing from the answer although the insert found
        /// one (a delivery that committed it while this claim waited), and the caller reads
        /// it again. The stored value is read only with `replay`.
        fn claim_or_read<'t>(
            conn: &'t mut Self::Connection,
            st: &'t Statements,
            claimant: Claimant<'t>,
            replay: bool,
        ) -> impl Future<Output = Result<(bool, Option<Found>), sqlx::Error>> + Send + 't {
            let _ = replay;
            async move {
                if Self::try_claim(&mut *conn, st, claimant).await? {
                    return Ok((true, None));
                }
                let found = Self::marker(conn, st, claimant.scope, claimant.key).await?;
                Ok((false, found))
            }
        }

        /// Reads the marker a claim found: its state on the database's clock, fingerprint
        /// and stored value; `None` if it is gone.
        fn marker<'t>(
            conn: &'t mut Self::Connection,
            st: &'t Statements,
            scope: &'t str,
            key: &'t str,
        ) -> impl Future<Output = Result<Option<Found>, sqlx::Error>> + Send + 't;

        /// Takes a released or expired lease over in the transaction, as a completed marker
        /// (fencing out its holder); `Ok(false)` if it is no longer free.
        fn take_over<'t>(
            conn: &'t mut Self::Connection,
            st: &'t Statements,
            claimant: Claimant<'t>,
        ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 't;

        /// Batch claim: inserts the markers of `keys` (distinct, sorted, so that overlapping
        /// batches lock rows in one order) with one statement; returns the keys this
        /// transaction inserted.
        fn try_claim_batch<'t>(
            conn: &'t mut Self::Connection,
            st: &'t Statements,
            claimant: Claimant<'t>,
            keys: &'t [&'t str],
        ) -> impl Future<Output = Result<Vec<String>, sqlx::Error>> + Send + 't;

        /// The state of each marker of `keys` that exists (batch claims).
        fn batch_markers<'t>(
            conn: &'t mut Self::Connection,
            st: &'t Statements,
            scope: &'t str,
            keys: &'t [&'t str],
        ) -> impl Future<Output = Result<Vec<(String, Hold)>, sqlx::Error>> + Send + 't;

        /// [`take_over`](Dialect::take_over) for the free markers among `keys`; returns the
        /// keys taken.
        fn take_over_batch<'t>(
            conn: &'t mut Self::Connection,
            st: &'t Statements,
            claimant: Claimant<'t>,
            keys: &'t [&'t str],
        ) -> impl Future<Output = Result<Vec<String>, sqlx::Error>> + Send + 't;

        /// Stores the handler's value (JSON) with the marker, in the claim's transaction.
        fn record<'t>(
            conn: &'t mut Self::Connection,
            st: &'t Statements,
            scope: &'t str,
            key: &'t str,
            json: &'t str,
        ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 't;

        /// Writes the outbox's messages in the claim's transaction.
        fn outbox_write<'t>(
            conn: &'t mut Self::Connection,
            st: &'t Statements,
            outbox: &'t crate::outgoing::Pending,
        ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 't;

        /// The relay's take: at most `limit` due messages, oldest first (a job's in their
        /// order), none another relay holds; held for `lease_ms`, after which a relay that
        /// died with them lets another take them again.
        fn outbox_take<'p>(
            pool: &'p Pool<Self>,
            st: &'p Statements,
            limit: i64,
            lease_ms: i64,
        ) -> impl Future<Output = Result<Vec<crate::Message>, sqlx::Error>> + Send + 'p;

        /// The broker confirmed the message.
        fn outbox_sent<'p>(
            pool: &'p Pool<Self>,
            st: &'p Statements,
            id: &'p str,
        ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'p;

        /// Publishing failed: try again in `retry_ms`, or never (`park`).
        fn outbox_failed<'p>(
            pool: &'p Pool<Self>,
            st: &'p Statements,
            id: &'p str,
            error: &'p str,
            retry_ms: i64,
            park: bool,
        ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'p;

        /// Deletes at most `limit` messages sent more than `age_ms` ago; returns how many.
        fn outbox_purge<'p>(
            pool: &'p Pool<Self>,
            st: &'p Statements,
            age_ms: i64,
            limit: i64,
        ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'p;

        /// Unsent messages for operators: parked ones if `parked`, pending ones if `pending`,
        /// parked first, then oldest first.
        fn outbox_list<'p>(
            pool: &'p Pool<Self>,
            st: &'p Statements,
            parked: bool,
            pending: bool,
            limit: i64,
        ) -> impl Future<Output = Result<Vec<OutboxRow>, sqlx::Error>> + Send + 'p;

        /// One message by id, sent or not.
        fn outbox_find<'p>(
            pool: &'p Pool<Self>,
            st: &'p Statements,
            id: &'p str,
        ) -> impl Future<Output = Result<Option<OutboxRow>, sqlx::Error>> + Send + 'p;

        /// Makes a parked message due again with no failed attempts; `Ok(false)` if no
        /// unsent message of that id is parked.
        fn outbox_requeue<'p>(
            pool: &'p Pool<Self>,
            st: &'p Statements,
            id: &'p str,
        ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'p;

        /// What a relay waits on when a round found nothing to send: the commits of new
        /// messages, where the database announces them (PostgreSQL); `None` polls.
        fn outbox_listen<'p>(
            pool: &'p Pool<Self>,
            st: &'p Statements,
        ) -> impl Future<Output = Result<Option<Listen>, sqlx::Error>> + Send + 'p {
            let _ = (pool, st);
            std::future::ready(Ok(None))
        }

        fn migrate<'p>(
            pool: &'p Pool<Self>,
            st: &'p Statements,
        ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'p;

        fn forget<'p>(
            pool: &'p Pool<Self>,
            st: &'p Statements,
            scope: &'p str,
            key: &'p str,
        ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'p;

        /// Lease mode: claims `(scope, key)` for `lease_ms` of the database's clock, taking a
        /// free lease over (token + 1, attempts + 1), in as few statements as the backend
        /// allows; autocommit, outside any transaction.
        fn lease_claim<'p>(
            pool: &'p Pool<Self>,
            st: &'p Statements,
            claimant: Claimant<'p>,
            lease_ms: i64,
        ) -> impl Future<Output = Result<LeaseState, sqlx::Error>> + Send + 'p;

        /// Lease mode: completes (storing `result`, if any), releases or renews the lease of
        /// the holder of `token`; `Ok(true)` if that holder still had the key.
        #[allow(clippy::too_many_arguments, reason = "one statement's binds")]
        fn lease_update<'p>(
            pool: &'p Pool<Self>,
            st: &'p Statements,
            op: LeaseOp,
            scope: &'p str,
            key: &'p str,
            token: i64,
            lease_ms: i64,
            result: Option<&'p str>,
        ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'p;

        /// One marker, for operators.
        fn inspect<'p>(
            pool: &'p Pool<Self>,
            st: &'p Statements,
            scope: &'p str,
            key: &'p str,
        ) -> impl Future<Output = Result<Option<MarkerRow>, sqlx::Error>> + Send + 'p;

        /// At most `limit` in-progress markers of `scope`, expired or released leases first.
        fn in_progress<'p>(
            pool: &'p Pool<Self>,
            st: &'p Statements,
            scope: &'p str,
            limit: i64,
        ) -> impl Future<Output = Result<Vec<MarkerRow>, sqlx::Error>> + Send + 'p;

        /// [`in_progress`](Dialect::in_progress) in every scope.
        fn in_progress_all<'p>(
            pool: &'p Pool<Self>,
            st: &'p Statements,
            limit: i64,
        ) -> impl Future<Output = Result<Vec<MarkerRow>, sqlx::Error>> + Send + 'p;

        /// Deletes at most `limit` completed markers older than `age_ms`; returns how many.
        fn purge_batch<'p>(
            pool: &'p Pool<Self>,
            st: &'p Statements,
            age_ms: i64,
            limit: i64,
        ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'p;
    }
}

/// `ms` rounded up to whole seconds (at least one), for databases that count lock waits in
/// seconds.
#[cfg(feature = "mysql")]
fn whole_seconds(wait: Duration) -> u64 {
    wait.as_millis()
        .div_ceil(1000)
        .max(1)
        .try_into()
        .unwrap_or(u64::MAX)
}

/// Milliseconds for a `SET`, capped where databases stop accepting them (`i32::MAX`).
#[cfg(any(feature = "postgres", feature = "sqlite"))]
fn millis(wait: Duration) -> u64 {
    wait.as_millis().clamp(1, i32::MAX as u128) as u64
}
