//! The store: a pool and the statements of one marker table, and what operators do with the
//! markers (create the table, forget one, purge old ones). The claims are the modes'.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use sqlx::Pool;
use sqlx::pool::PoolOptions;

use crate::backend::{Backend, Sql, Status, Table};
use crate::error::{Error, LeaseError};
use crate::key::{IntoKey, Key};
use crate::scope::check_scope;

/// The table of markers that [`Store::new`] uses.
pub const DEFAULT_TABLE: &str = "idem_processed";

pub use crate::backend::MAX_TABLE_LEN;

/// The most rows one statement of [`Store::purge`] deletes.
pub const PURGE_BATCH: i64 = 5_000;

/// Retentions from here on purge nothing (see [`Store::purge`]).
pub(crate) const MAX_RETENTION: Duration = Duration::from_secs(100 * 366 * 24 * 3600);

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
/// # Its methods, by concern
///
/// Each mode's claim lives with the mode; every one of them returns a
/// [`Claimed`](crate::Claimed) whose fresh holder ends with `finish` (or gives up with
/// `release`), with the same span, metrics, nested-call check and outbox as the attribute:
///
/// | concern | methods |
/// |---|---|
/// | the table | [`new`](Store::new), [`with_table`](Store::with_table), [`migrate`](Store::migrate), [`ddl`](Store::ddl), [`pool`](Store::pool), [`table`](Store::table) |
/// | transaction mode | [`claim`](Store::claim), [`claim_with`](Store::claim_with) |
/// | joined to a transaction you hold | [`join`](Store::join) |
/// | lease mode | [`lease`](Store::lease) |
/// | batches | [`claim_batch`](Store::claim_batch), [`claim_batch_with`](Store::claim_batch_with) |
/// | operators | [`inspect`](Store::inspect), [`steps`](Store::steps), [`list_failed`](Store::list_failed), [`requeue`](Store::requeue), [`list_in_progress`](Store::list_in_progress), [`list_all_in_progress`](Store::list_all_in_progress), [`forget`](Store::forget), [`forget_forced`](Store::forget_forced), [`purge`](Store::purge) |
/// | retention per scope | [`set_retention`](Store::set_retention), [`clear_retention`](Store::clear_retention), [`retentions`](Store::retentions), [`purge_by_retention`](Store::purge_by_retention) |
/// | the outbox's operators | [`list_outbox`](Store::list_outbox), [`outbox_message`](Store::outbox_message), [`requeue_outbox`](Store::requeue_outbox), [`purge_outbox`](Store::purge_outbox) |
///
/// # Backends
///
/// - **PostgreSQL**: the claim is `INSERT ... ON CONFLICT DO NOTHING`; a concurrent delivery of
///   the same key waits on the primary key until the first one commits (then it is a
///   duplicate) or rolls back (then it claims). Under `REPEATABLE READ` or `SERIALIZABLE` a
///   lost race (`40001`, `40P01`) is retried, a few times at most. `wait` is `SET LOCAL
///   lock_timeout` in the begin statement, put back to the session's value by the claim's
///   last statement, so it bounds the claim and not the body.
/// - **MySQL / MariaDB**: the claim is an `INSERT`. In a transaction of its own, its `ON
///   DUPLICATE KEY UPDATE` changes nothing but sets `LAST_INSERT_ID` to what the marker it
///   met holds, so a duplicate answers in the claim's own OK packet; in a caller's or a
///   group's transaction a plain `INSERT`'s duplicate-key error 1062 is the signal (it locks
///   the marker for reading only, for as long as that transaction lasts). A deadlock victim
///   (1213) among waiters retries its claim. Keys are stored as bytes, so `"Job-A"`,
///   `"job-a"` and `"job-a "` are three keys. On MariaDB, `wait` bounds each claim
///   statement with `SET STATEMENT innodb_lock_wait_timeout = N FOR` (whole seconds), so
///   nothing of it reaches the body or the pooled connection, whatever
///   happens to the call. MySQL 8 has no per-statement form for this variable: there `wait`
///   sets the session's for the transaction (the body's statements included) and every end of
///   the call puts the server's default back, except a call dropped mid-transaction (a panic,
///   a cancelled future), whose connection keeps it. (MySQL 8 was not tested: no server can be
///   installed where idem is built; MariaDB 10.11 is.)
/// - **SQLite**: every call begins with `BEGIN IMMEDIATE`, taking the write lock up front (a
///   deferred transaction could deadlock on the lock upgrade). Another writer waits for it up to
///   the connection's busy timeout (sqlx's default is 5 s; set it with
///   `SqliteConnectOptions::busy_timeout`, or per handler with `wait`, which sets it for the
///   `BEGIN` and puts the connection's own back) and then gets [`Error::InProgress`]: nothing
///   was written, the job can be redelivered. SQLite has one writer at a time, so on SQLite
///   that wait is for any writer, not only a delivery of the same key. Use WAL
///   (`journal_mode(Wal)`) so readers do not wait on writers.
///
/// # Applied means committed
///
/// [`Outcome::Applied`](crate::Outcome::Applied) is returned only when the database confirmed
/// the commit. A body that ignores a failed statement and returns `Ok` gets
/// [`NotKept::RolledBack`](crate::NotKept::RolledBack) where the database threw the transaction
/// away: PostgreSQL aborts the transaction at the first failed statement (and answers `COMMIT` with
/// a rollback), MySQL rolls the whole transaction back on a deadlock (1213) and runs later
/// statements in autocommit, SQLite on `INSERT OR ROLLBACK` and I/O errors. The check rides in the
/// commit's own message (PostgreSQL `SAVEPOINT idem_commit; COMMIT AND CHAIN`, whose savepoint
/// fails in an aborted transaction; MySQL and MariaDB find the marker holding the claim's own
/// nonce, which exists only while the claim's transaction does; SQLite's `COMMIT` fails when there
/// is nothing to commit), at no extra round trip. The outbox's messages are written only while that
/// marker is there, so none outlives such a rollback. Statements a MySQL or SQLite body ran in
/// autocommit after such a rollback are kept, marker or not: a body must return database errors
/// (with `?`), never ignore or retry them. (On MySQL and SQLite most failed statements, a
/// constraint violation say, undo only themselves: a body that ignores one and returns `Ok` commits
/// the rest of its work with the marker, which is then what it chose to keep.) A MySQL body whose
/// DDL commits implicitly commits marker and effect there; that is `Applied`, and whatever it ran
/// after the DDL ran in autocommit.
///
/// # Modes meet on a scope
///
/// Every mode reads a marker the same way: a completed one is a duplicate (replayed with
/// `replay`); a lease another delivery still holds is [`Error::InProgress`], never a duplicate
/// (its job may still fail: nack and let the broker redeliver); a lease that was released or
/// ran out is taken over (a transaction claim makes it its own completed marker, which fences the
/// old holder out: it gets [`LeaseError::Lost`]). Only a claim that finds a marker pays for reading
/// it.
///
/// # Pool settings
///
/// A job costs a handful of round trips, and with sqlx's default pool two of them are the
/// pool's own: a ping before each acquire (`test_before_acquire`, on by default) and a ping as
/// the connection goes back (always; it also flushes the `ROLLBACK` of a dropped transaction,
/// which is how a duplicate ends without waiting for it). For a worker,
/// [`Store::pool_options`] sets the pool up without them (and
/// [`GroupOptions::pool_options`](crate::GroupOptions::pool_options) for group commit):
///
/// ```no_run
/// # async fn f(in_flight: u32) -> Result<(), sqlx::Error> {
/// # #[cfg(feature = "postgres")] {
/// use idem::Store;
/// use sqlx::Postgres;
/// # use idem_runtime as idem;
///
/// let pool = Store::<Postgres>::pool_options(in_flight)
///     .connect("postgres://localhost/app")
///     .await?;
/// let store = Store::new(pool);
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
    sql: Arc<Sql<DB>>,
}

impl<DB: Backend> Clone for Store<DB> {
    fn clone(&self) -> Self {
        Store {
            pool: self.pool.clone(),
            sql: self.sql.clone(),
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
    /// The pool options of a worker that runs `in_flight` jobs at once, each on a transaction
    /// of its own: no ping before each acquire, and one connection more than the jobs. Chain
    /// more of sqlx's settings (timeouts, `min_connections`) before `connect`; see
    /// [Pool settings](Store#pool-settings) for what they save.
    ///
    /// - `test_before_acquire(false)`: a dead connection then fails the claim (an error: the
    ///   job is redelivered, nothing was written) instead of being replaced before it; idem
    ///   never mistakes it for a duplicate.
    /// - `max_connections(in_flight + 1)`: the spare connection lets the release ping of the
    ///   job that just ended overlap the next job instead of delaying it.
    ///
    /// ```
    /// # #[cfg(feature = "sqlite")] {
    /// # use idem_runtime as idem;
    /// let options = idem::Store::<sqlx::Sqlite>::pool_options(16);
    /// assert_eq!(options.get_max_connections(), 17);
    /// assert!(!options.get_test_before_acquire());
    /// # }
    /// ```
    pub fn pool_options(in_flight: u32) -> PoolOptions<DB> {
        worker_pool(spared(in_flight))
    }

    /// A store keeping its markers in [`DEFAULT_TABLE`] (`idem_processed`).
    pub fn new(pool: Pool<DB>) -> Self {
        let table = Table::new(DEFAULT_TABLE).expect("the default table is a plain identifier");
        Store::of(pool, &table)
    }

    /// A store of `table`, whose commits of outbox messages are announced where the database
    /// can (`backend/wake.rs`).
    fn of(pool: Pool<DB>, table: &Table) -> Self {
        let sql = Sql::new(table);
        if let Some(announcer) = crate::backend::announcer(&pool, &sql) {
            table.wake().announce_with(announcer);
        }
        Store {
            pool,
            sql: Arc::new(sql),
        }
    }

    /// Keeps the markers in `table` instead.
    ///
    /// The name is written into SQL, so anything but a plain identifier (a letter or `_`, then
    /// letters, digits or `_`, at most [`MAX_TABLE_LEN`] characters) is refused with
    /// [`Refusal::Table`](crate::Refusal::Table).
    pub fn with_table(self, table: &str) -> Result<Self, Error> {
        let unnamed = self.sql.table.is_unnamed();
        let wal = self.sql.table.is_through_wal();
        let table = Table::new(table)?.unnamed(unnamed).through_wal(wal);
        Ok(Store::of(self.pool, &table))
    }

    /// The same store, its statements sent unnamed ([`Table::unnamed`]).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    fn unnamed(self) -> Self {
        let table = self.sql.table.clone().unnamed(true);
        Store::of(self.pool, &table)
    }

    /// Whether the store was told it runs behind a pooler in transaction mode
    /// ([`behind_transaction_pooler`](Store::behind_transaction_pooler)).
    pub fn is_behind_transaction_pooler(&self) -> bool {
        self.sql.table.is_unnamed()
    }

    /// The connection pool.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    pub(crate) fn sql(&self) -> &Sql<DB> {
        &self.sql
    }

    /// The statements shared by the store's clones, for a holder that outlives a borrow of
    /// the store.
    pub(crate) fn shared_sql(&self) -> &Arc<Sql<DB>> {
        &self.sql
    }

    /// The name of the marker table.
    pub fn table(&self) -> &str {
        self.sql.table.as_str()
    }

    /// The statements [`migrate`](Store::migrate) runs, for migration tools of your own.
    pub fn ddl(&self) -> Vec<String> {
        self.sql.ddl.iter().map(|s| s.as_str().to_owned()).collect()
    }

    /// Creates the marker table and its index if they are missing.
    ///
    /// Safe to call from every worker at start-up at the same time: the backends serialise it
    /// (an advisory lock on PostgreSQL, a named lock on MySQL, the write lock on SQLite).
    pub async fn migrate(&self) -> Result<(), Error> {
        DB::migrate(&self.pool, &self.sql).await?;
        Ok(())
    }

    /// Lets the next delivery of `(scope, key)` run the job again; returns whether a marker
    /// was there.
    ///
    /// For operators: a job whose effect was undone by hand can be let through once more. A
    /// completed marker is deleted. A marker in progress (a lease that ran out, or was let
    /// go) is not deleted but let go of: its fencing token goes up, so its old holder can
    /// neither complete, renew nor release it, and the next delivery takes it over with a
    /// larger token still (and as its next [`attempt`](crate::Lease::attempt)). A marker whose
    /// lease a delivery still holds is refused with [`LeaseError::Held`]: that delivery may still
    /// be calling the outside system, and a redelivery would call it again beside it. Wait for it
    /// to complete or run out, or use [`forget_forced`](Store::forget_forced).
    ///
    /// The steps a lease recorded ([`Lease::step`](crate::Lease::step)) are deleted with a
    /// deleted marker, in the same transaction; a marker in progress that is let go keeps
    /// them, so that its next delivery resumes after them.
    ///
    /// The job's outbox messages that were not sent yet (pending or parked) are deleted with
    /// it, in the same transaction: the re-run sends its own, under the same ids. Messages already sent stay until
    /// [`purge_outbox`](Store::purge_outbox): a re-run's message with the id of a sent one is
    /// not written, since the consumer that got the first one already holds that id as its
    /// key and would take the second for a duplicate.
    pub async fn forget<K: IntoKey + ?Sized>(&self, scope: &str, key: &K) -> Result<bool, Error> {
        self.forget_as(scope, key, false).await
    }

    /// [`forget`](Store::forget), even of a marker whose lease a delivery still holds.
    ///
    /// What that risks: the holder may still be calling the outside system; the next delivery
    /// takes the key over and calls it too (with the same idempotency key, which a provider
    /// that honours it deduplicates). The old holder is fenced out at once: it gets
    /// [`LeaseError::Lost`] and cannot complete, renew or release the lease. Use it when the holder
    /// is known to be gone (its worker was killed) and its lease is too long to wait out.
    pub async fn forget_forced<K: IntoKey + ?Sized>(
        &self,
        scope: &str,
        key: &K,
    ) -> Result<bool, Error> {
        self.forget_as(scope, key, true).await
    }

    async fn forget_as<K: IntoKey + ?Sized>(
        &self,
        scope: &str,
        key: &K,
        force: bool,
    ) -> Result<bool, Error> {
        check_scope(scope)?;
        let key = Key::new(key)?;
        let (pool, sql) = (&self.pool, &*self.sql);
        // A marker completed between the statements and the read is deleted on the second
        // round.
        for _ in 0..2 {
            // The job's unsent messages go with its marker, in one transaction: a re-run
            // claims only once the marker's delete committed, and then writes its own messages
            // under the same ids, which the old rows would have dropped (or a later delete of
            // them removed). Only a completed marker has messages: a lease writes them as it
            // completes.
            let mut tx = pool.begin().await?;
            if sql.forget(&mut tx, scope, key.as_str(), force).await? {
                sql.outbox_forget(&mut tx, scope, key.as_str()).await?;
                // A lease's recorded steps go with a deleted marker; a marker only let go
                // keeps them, and its next delivery resumes after them.
                sql.steps_forget(&mut tx, scope, key.as_str()).await?;
                tx.commit().await?;
                return Ok(true);
            }
            tx.rollback().await?;
            match sql.status(pool, scope, key.as_str()).await? {
                None => return Ok(false),
                Some(Status::Leased) => break,
                Some(_) => {}
            }
        }
        Err(Error::Lease(LeaseError::Held {
            scope: scope.to_owned(),
            key: key.as_str().to_owned(),
        }))
    }

    /// Deletes the markers of jobs completed more than `older_than` ago, in batches of at most
    /// [`PURGE_BATCH`] rows (each its own short transaction, so a purge never holds many
    /// locks), each with the steps its lease recorded; returns how many markers it deleted.
    ///
    /// A scope with a retention window of its own
    /// ([`set_retention`](Store::set_retention)) is purged by that window instead, longer or
    /// shorter than `older_than` ([`purge_by_retention`](Store::purge_by_retention) purges
    /// only those).
    ///
    /// Retention must outlast the longest time the broker may still redeliver a job (SQS
    /// visibility timeouts and retention, RabbitMQ requeues, JetStream `max_deliver` with
    /// back-off, a replay from a dead-letter queue): a redelivery that arrives after its marker
    /// was purged runs again.
    pub async fn purge(&self, older_than: Duration) -> Result<u64, Error> {
        let mut total = self.purge_by_retention().await?;
        // No marker is older than a century; a longer retention (up to `Duration::MAX`) would
        // overflow the databases' interval arithmetic, and purges nothing anyway.
        if older_than >= MAX_RETENTION {
            return Ok(total);
        }
        let age_ms = i64::try_from(older_than.as_millis()).expect("below MAX_RETENTION");
        loop {
            let n = self
                .sql
                .purge_batch(&self.pool, age_ms, PURGE_BATCH)
                .await?;
            total += n;
            if n < PURGE_BATCH as u64 {
                return Ok(total);
            }
        }
    }
}

#[cfg(feature = "postgres")]
impl Store<sqlx::Postgres> {
    /// Tells the store that its pool reaches PostgreSQL through a pooler in transaction mode
    /// (PgBouncer's `pool_mode = transaction`, and the poolers of managed PostgreSQL that work
    /// the same way), which gives each transaction whichever server connection is free, so
    /// that nothing of a session outlives its transaction. The store then keeps to what works
    /// there:
    ///
    /// - its statements are sent as unnamed prepared statements (sqlx's
    ///   [`persistent(false)`](sqlx::query::Query::persistent)): a statement sqlx prepared
    ///   under a name on one server connection is missing on the next ("prepared statement
    ///   \"sqlx_s_1\" does not exist"), and two clients' names collide on a server
    ///   connection they share ("already exists");
    /// - each statement it sends outside a transaction (a lease's claim, renewal, completion
    ///   and release, a step's record, the relay's takes and marks, the operators' reads)
    ///   runs in a transaction of its own: sqlx sends a statement with binds in two steps
    ///   (parse, then bind and execute), and outside a transaction the pooler may run the
    ///   second on another server connection, whose unnamed statement is someone else's;
    /// - the outbox relay polls instead of listening: a `LISTEN` keeps no server connection,
    ///   and its notifications reach another client or nobody.
    ///
    /// Every mode, `wait` (a `SET LOCAL`, which ends with its transaction) and the verified
    /// commit work unchanged; `docs/scaling.md` says what was tested (PgBouncer 1.18) and the
    /// pooler's settings. Without this call, idem's statements fail behind such a pooler with
    /// an [`Error::Database`] that names this method, or, where two clients' statements of
    /// one name take the same binds, one runs the other's: never run a store behind such a
    /// pooler without it.
    ///
    /// The handlers' own statements are theirs: send them with `.persistent(false)` as well,
    /// and those with binds inside a transaction (a lease body's, in one of their own), or
    /// go through a pooler that tracks prepared statements (PgBouncer 1.21 and later with
    /// `max_prepared_statements` above 0, untested here); and give the pool
    /// [`statement_cache_capacity(0)`](sqlx::postgres::PgConnectOptions::statement_cache_capacity)
    /// so that a query that still names its statement is not reused from the cache on another
    /// server connection. A pooler in session mode needs none of this.
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// # async fn f() -> Result<(), idem::Error> {
    /// use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
    ///
    /// let options: PgConnectOptions = "postgres://app@pgbouncer:6432/app".parse()?;
    /// let pool = PgPoolOptions::new()
    ///     .connect_with(options.statement_cache_capacity(0))
    ///     .await?;
    /// let store = idem::Store::new(pool).behind_transaction_pooler();
    /// store.migrate().await?;
    /// # Ok(()) }
    /// ```
    pub fn behind_transaction_pooler(self) -> Self {
        self.unnamed()
    }

    /// The shortest interval between two announcements of this store's commits of outbox
    /// messages (2 ms unless set; for this store and its clones).
    ///
    /// A transaction that writes messages sends no `NOTIFY` itself: PostgreSQL serialises
    /// the commits of the transactions that notify, on a lock of its own, and the jobs that
    /// send messages ran at 0.61 of those that send none (8 workers). Instead, once a commit
    /// of messages is confirmed, the store wakes its own relays in the process (no round
    /// trip), and announces the commit to the relays of other processes with one
    /// `pg_notify` on a connection of its pool, outside any job's transaction: the first
    /// commit after a quiet spell at once, the commits that follow it at most once per
    /// `interval`, each announcement for all the commits before it. A longer interval sends
    /// fewer notifications under load and delays other processes' relays by up to that much;
    /// `Duration::ZERO` announces whenever the last announcement has begun. A process that
    /// dies between a commit and its announcement leaves the messages to the relays' polls
    /// (their `poll`, [`Relay::run`](crate::outbox::Relay::run)). Behind a pooler in
    /// transaction mode ([`behind_transaction_pooler`](Store::behind_transaction_pooler))
    /// nothing is announced: the relays there poll.
    pub fn outbox_notify_interval(self, interval: Duration) -> Self {
        self.sql.table.wake().set_every(interval);
        self
    }

    /// Writes this store's outbox messages to PostgreSQL's write-ahead log, for the WAL relay
    /// ([`WalRelay`](crate::outbox::WalRelay), feature `wal-relay`), instead of the outbox
    /// table, which the polling [`Relay`](crate::outbox::Relay) reads.
    ///
    /// Each message is one transactional logical decoding message
    /// (`pg_logical_emit_message(true, 'idem:{table}', ..)`), all of a job's in one statement
    /// of the job's transaction, as its rows would be: decoded only if that transaction
    /// commits, in the order of the commits. It leaves no row to mark, delete or vacuum, and
    /// costs less than half the WAL of a row. Needs `wal_level = logical` on the server (the
    /// statement fails otherwise, and the job with it); any role may call it. Ids, headers and
    /// ordering keys are the same as through the table. Every store that writes messages for
    /// one relay must say the same: the polling relay never sees what went to the WAL, and
    /// the WAL relay sends the table's rows only as the ones it parked.
    ///
    /// WAL written before a slot exists is never decoded by it: set the relay up
    /// ([`WalRelay::setup`](crate::outbox::WalRelay::setup)) before the first job. Until a
    /// `pgoutput` slot exists in the database, a claim that sends messages fails with
    /// [`WalError::NoSlot`](crate::error::WalError::NoSlot) and keeps nothing. The check is for any
    /// such slot: two stores of one database that send through the WAL each need their
    /// relay's slot made before their first job.
    ///
    /// `idem outbox list` shows a message sent this way only once the relay wrote it to the
    /// table (a message the broker refused; the WAL holds the others until the relay's slot
    /// confirms them).
    pub fn outbox_through_wal(self) -> Self {
        let table = self.sql.table.clone().through_wal(true);
        Store::of(self.pool, &table)
    }
}

/// The connections `in_flight` jobs on transactions of their own want: one each and a spare
/// (at least one job: a pool of no connection never runs one).
pub(crate) fn spared(in_flight: u32) -> u32 {
    in_flight.max(1).saturating_add(1)
}

/// A worker's pool of at most `connections`, without sqlx's ping before each acquire.
pub(crate) fn worker_pool<DB: Backend>(connections: u32) -> PoolOptions<DB> {
    PoolOptions::new()
        .test_before_acquire(false)
        .max_connections(connections)
}

// On SQLite, whose in-memory database needs no server.
#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use std::error::Error as _;

    use super::Store;

    #[tokio::test]
    async fn a_schema_refusal_is_not_worth_a_redelivery() {
        let pool = sqlx::SqlitePool::connect("sqlite::memory:").await.unwrap();
        sqlx::query("CREATE TABLE idem_processed (scope TEXT, key TEXT)")
            .execute(&pool)
            .await
            .unwrap();
        let store = Store::new(pool);
        let key = crate::key::Key::new("job-1").unwrap();
        let err = store.claim("scope", &key).await.unwrap_err();
        assert!(!err.is_transient(), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("fails the same way") && msg.contains("idem doctor"),
            "{msg}"
        );
    }

    #[tokio::test]
    async fn a_missing_marker_table_points_at_migrate() {
        let pool = sqlx::SqlitePool::connect("sqlite::memory:").await.unwrap();
        let store = Store::new(pool);
        let key = crate::key::Key::new("job-1").unwrap();
        let err = store.claim("scope", &key).await.unwrap_err();
        let msg = err.to_string();
        assert_eq!(
            msg,
            "the database refused a statement: no such table: idem_processed: the marker \
             table does not exist: call `Store::migrate()` at start-up, or add the statements \
             of `Store::ddl()` to your migrations"
        );
        assert!(err.source().is_none());
    }
}
