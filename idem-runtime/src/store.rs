//! The store: a pool and the statements of one marker table, and what operators do with the
//! markers (create the table, forget one, purge old ones). The claims are the modes'.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use sqlx::Pool;

use crate::backend::{Backend, Statements, Table};
use crate::key::check_scope;
use crate::{Error, Key};

/// The table of markers that [`Store::new`] uses.
pub const DEFAULT_TABLE: &str = "idem_processed";

pub use crate::backend::MAX_TABLE_LEN;

/// The most rows one statement of [`Store::purge`] deletes.
pub const PURGE_BATCH: i64 = 5_000;

/// Retentions from here on purge nothing (see [`Store::purge`]).
const MAX_RETENTION: Duration = Duration::from_secs(100 * 366 * 24 * 3600);

/// Where the markers live: a connection pool plus the name of the marker table.
///
/// Cheap to clone (the pool and the prepared SQL are shared). Create one per process, call
/// [`migrate`](Store::migrate) once at start-up, and pass `&store` to every idempotent handler.
///
/// ```no_run
/// # use idem_runtime as idem;
/// # async fn f() -> Result<(), idem::Error> {
/// # #[cfg(feature = "sqlite")] {
/// let pool = sqlx::SqlitePool::connect("sqlite://jobs.db?mode=rwc").await?;
/// let store = idem::Store::new(pool);
/// store.migrate().await?;
/// # }
/// # Ok(()) }
/// ```
///
/// # Backends
///
/// - **PostgreSQL**: the claim is `INSERT ... ON CONFLICT DO NOTHING`; a concurrent delivery of
///   the same key waits on the primary key until the first one commits (then it is a
///   duplicate) or rolls back (then it claims). Under `REPEATABLE READ` or `SERIALIZABLE` a
///   lost race (`40001`, `40P01`) is retried, a few times at most. `wait` is `SET LOCAL
///   lock_timeout` in the begin statement, so it bounds every lock wait of the transaction.
/// - **MySQL / MariaDB**: the claim is a plain `INSERT`; duplicate-key error 1062 is the
///   duplicate signal, and a deadlock victim (1213) among waiters retries its claim. Keys are
///   stored as bytes, so `"Job-A"`, `"job-a"` and `"job-a "` are three keys. On MariaDB,
///   `wait` bounds each claim statement with `SET STATEMENT innodb_lock_wait_timeout = N FOR`
///   (whole seconds), so nothing of it reaches the pooled connection, whatever happens to the
///   call; the body's own statements keep the session's wait. MySQL 8 has no per-statement
///   form for this variable: there `wait` sets the session's for the transaction and every
///   end of the call puts the server's default back, except a call dropped mid-transaction (a
///   panic, a cancelled future), whose connection keeps it. (MySQL 8 was not tested: no
///   server can be installed where idem is built; MariaDB 10.11 is.)
/// - **SQLite**: every call begins with `BEGIN IMMEDIATE`, taking the write lock up front (a
///   deferred transaction could deadlock on the lock upgrade). Another writer waits for it up to
///   the connection's busy timeout (sqlx's default is 5 s; set it with
///   `SqliteConnectOptions::busy_timeout`, or per handler with `wait`, which sets it on the
///   pooled connection) and then gets [`Error::InProgress`]: nothing was written, the job can
///   be redelivered. SQLite has one writer at a time, so on SQLite that wait is for any
///   writer, not only a delivery of the same key. Use WAL (`journal_mode(Wal)`) so readers do
///   not wait on writers.
///
/// # Applied means committed
///
/// [`Outcome::Applied`](crate::Outcome::Applied) is returned only when the database confirmed the commit. A body that
/// ignores a failed statement and returns `Ok` gets [`Error::RolledBack`] where the database
/// threw the transaction away: PostgreSQL aborts the transaction at the first failed statement
/// (and answers `COMMIT` with a rollback), MySQL rolls the whole transaction back on a
/// deadlock (1213) and runs later statements in autocommit, SQLite on `INSERT OR ROLLBACK`
/// and I/O errors. The check rides in the commit's own message (PostgreSQL `SELECT 1;
/// COMMIT`; MySQL and MariaDB count the marker holding the claim's own nonce, which exists only
/// while the claim's transaction does), at no extra round trip. Statements a MySQL or SQLite
/// body ran in autocommit after such a rollback are kept, marker or not: a body must return
/// database errors (with `?`), never ignore or retry them. (On MySQL and SQLite most failed
/// statements, a constraint violation say, undo only themselves: a body that ignores one and
/// returns `Ok` commits the rest of its work with the marker, which is then what it chose to
/// keep.) A MySQL body whose DDL commits implicitly commits marker and effect there; that is
/// `Applied`, and whatever it ran after the DDL ran in autocommit.
///
/// # Modes meet on a scope
///
/// Every mode reads a marker the same way: a completed one is a duplicate (replayed with
/// `replay`); a lease another delivery still holds is [`Error::InProgress`], never a duplicate
/// (its job may still fail: nack and let the broker redeliver); a lease that was released or
/// ran out is taken over (a transaction claim makes it its own completed marker, which fences
/// the old holder out: it gets [`Error::LeaseLost`]). Only a claim that finds a marker pays for
/// reading it.
///
/// # Pool settings
///
/// A job costs a handful of round trips, and with sqlx's default pool two of them are the
/// pool's own: a ping before each acquire (`test_before_acquire`, on by default) and a ping as
/// the connection goes back (always; it also flushes the `ROLLBACK` of a dropped transaction,
/// which is how a duplicate ends without waiting for it). For a worker, set:
///
/// ```no_run
/// # async fn f(workers: u32) -> Result<(), sqlx::Error> {
/// # #[cfg(feature = "postgres")] {
/// let pool = sqlx::postgres::PgPoolOptions::new()
///     // A dead connection then fails the claim (an error: the job is redelivered, nothing
///     // was written) instead of being replaced before it; idem never mistakes it for a
///     // duplicate.
///     .test_before_acquire(false)
///     // One spare connection: the release ping of the job that just ended overlaps the next
///     // job instead of delaying it.
///     .max_connections(workers + 1)
///     .connect("postgres://localhost/app")
///     .await?;
/// # }
/// # Ok(()) }
/// ```
///
/// Measured on PostgreSQL with `cargo bench --bench throughput -- --pool lean` against
/// `--pool sqlx` (`docs/BENCHMARKS.md`): a fresh job then waits for 5 answers instead of 6 and
/// a duplicate for 4 instead of 5; one worker ran about 40 % more fresh jobs (1.2× pgbench's
/// same transaction instead of 0.85×) and 2.5× the duplicates.
pub struct Store<DB: Backend> {
    pool: Pool<DB>,
    st: Arc<Statements>,
}

impl<DB: Backend> Clone for Store<DB> {
    fn clone(&self) -> Self {
        Store {
            pool: self.pool.clone(),
            st: self.st.clone(),
        }
    }
}

impl<DB: Backend> fmt::Debug for Store<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store")
            .field("backend", &DB::BACKEND)
            .field("table", &self.table())
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> Store<DB> {
    /// A store keeping its markers in [`DEFAULT_TABLE`] (`idem_processed`).
    pub fn new(pool: Pool<DB>) -> Self {
        let table = Table::new(DEFAULT_TABLE).expect("the default table is a plain identifier");
        Store {
            pool,
            st: Arc::new(DB::statements(&table)),
        }
    }

    /// Keeps the markers in `table` instead.
    ///
    /// The name is written into SQL, so anything but a plain identifier (a letter or `_`, then
    /// letters, digits or `_`, at most [`MAX_TABLE_LEN`] characters) is refused with
    /// [`Error::InvalidTable`].
    pub fn with_table(self, table: &str) -> Result<Self, Error> {
        let table = Table::new(table)?;
        Ok(Store {
            pool: self.pool,
            st: Arc::new(DB::statements(&table)),
        })
    }

    /// The connection pool.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    pub(crate) fn statements(&self) -> &Arc<Statements> {
        &self.st
    }

    /// The name of the marker table.
    pub fn table(&self) -> &str {
        self.st.table.as_str()
    }

    /// The statements [`migrate`](Store::migrate) runs, for migration tools of your own.
    pub fn ddl(&self) -> Vec<String> {
        self.st.ddl.iter().map(|s| s.as_str().to_owned()).collect()
    }

    /// Creates the marker table and its index if they are missing.
    ///
    /// Safe to call from every worker at start-up at the same time: the backends serialise it
    /// (an advisory lock on PostgreSQL, a named lock on MySQL, the write lock on SQLite).
    pub async fn migrate(&self) -> Result<(), Error> {
        DB::migrate(&self.pool, &self.st).await?;
        Ok(())
    }

    /// Deletes the marker of `(scope, key)`, so that the next delivery of that job runs again.
    ///
    /// For operators: a job whose effect was undone by hand can be let through once more.
    /// Returns whether a marker was there.
    pub async fn forget<K: crate::IntoKey + ?Sized>(
        &self,
        scope: &str,
        key: &K,
    ) -> Result<bool, Error> {
        check_scope(scope)?;
        let key = Key::new(key)?;
        let done = DB::forget(&self.pool, &self.st, scope, key.as_str()).await?;
        Ok(done)
    }

    /// Deletes the markers of jobs completed more than `older_than` ago, in batches of at most
    /// [`PURGE_BATCH`] rows (each its own short statement, so a purge never holds many locks);
    /// returns how many it deleted.
    ///
    /// Retention must outlast the longest time the broker may still redeliver a job (SQS
    /// visibility timeouts and retention, RabbitMQ requeues, JetStream `max_deliver` with
    /// back-off, a replay from a dead-letter queue): a redelivery that arrives after its marker
    /// was purged runs again.
    pub async fn purge(&self, older_than: Duration) -> Result<u64, Error> {
        // No marker is older than a century; a longer retention (up to `Duration::MAX`) would
        // overflow the databases' interval arithmetic, and purges nothing anyway.
        if older_than >= MAX_RETENTION {
            return Ok(0);
        }
        let age_ms = i64::try_from(older_than.as_millis()).expect("below MAX_RETENTION");
        let mut total = 0;
        loop {
            let n = DB::purge_batch(&self.pool, &self.st, age_ms, PURGE_BATCH).await?;
            total += n;
            if n < PURGE_BATCH as u64 {
                return Ok(total);
            }
        }
    }
}
