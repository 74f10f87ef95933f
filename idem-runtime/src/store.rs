use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::{Pool, Transaction};

use crate::backend::{Backend, Sql};
use crate::observe;
use crate::{ClaimOptions, Error, Fingerprint, Key, Outcome, Recorded};

/// The table of markers that [`Store::new`] uses.
pub const DEFAULT_TABLE: &str = "idem_processed";

/// The longest table name [`Store::with_table`] accepts: the names derived from it (the
/// index `{table}_completed_at`) must fit PostgreSQL's 63-byte identifiers, which it would
/// otherwise cut silently, merging the index names of tables with a long common prefix.
pub const MAX_TABLE_LEN: usize = 47;

/// The most rows one statement of [`Store::purge`] deletes.
pub const PURGE_BATCH: i64 = 5_000;

/// How often a claim that lost a race to a transient error (a serialization failure or a
/// deadlock between waiters) is tried again before the error is returned. InnoDB can pick a
/// waiter as deadlock victim each time a holder of the key rolls back, so a waiter behind
/// several failing deliveries may lose a few rounds in a row: every round is decided, so the
/// bound only stops a livelock, and 16 covers the conformance suite's 8 failing holders
/// with 31 waiters.
pub(crate) const CLAIM_ATTEMPTS: u32 = 16;

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
///   stored as bytes, so `"Job-A"`, `"job-a"` and `"job-a "` are three keys. `wait` sets the
///   session's `innodb_lock_wait_timeout` (whole seconds) for the transaction and puts the
///   server's default back when it ends.
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
/// [`Outcome::Applied`] is returned only when the database confirmed the commit. A body that
/// ignores a failed statement and returns `Ok` gets [`Error::RolledBack`] where the database
/// threw the transaction away: PostgreSQL aborts the transaction at the first failed statement
/// (and answers `COMMIT` with a rollback), MySQL rolls the whole transaction back on a
/// deadlock (1213) and runs later statements in autocommit, SQLite on `INSERT OR ROLLBACK`
/// and I/O errors. The check rides in the commit's own message (PostgreSQL `SELECT 1;
/// COMMIT`, MySQL `SELECT @@in_transaction; COMMIT`), at no extra round trip. Statements a
/// MySQL or SQLite body ran in autocommit after such a rollback are kept, marker or not: a body
/// must return database errors (with `?`), never ignore or retry them. (On MySQL and SQLite
/// most failed statements, a constraint violation say, undo only themselves: a body that
/// ignores one and returns `Ok` commits the rest of its work with the marker, which is then
/// what it chose to keep.)
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
    sql: Arc<Sql>,
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
            .field("backend", &<DB as Backend>::BACKEND)
            .field("table", &self.sql.table)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> Store<DB> {
    /// A store keeping its markers in [`DEFAULT_TABLE`] (`idem_processed`).
    pub fn new(pool: Pool<DB>) -> Self {
        Store {
            pool,
            sql: Arc::new(DB::sql(DEFAULT_TABLE)),
        }
    }

    /// Keeps the markers in `table` instead.
    ///
    /// The name is written into SQL, so anything but a plain identifier (a letter or `_`, then
    /// letters, digits or `_`, at most [`MAX_TABLE_LEN`] characters) is refused with
    /// [`Error::InvalidTable`].
    pub fn with_table(self, table: &str) -> Result<Self, Error> {
        if !is_identifier(table) {
            return Err(Error::InvalidTable {
                name: table.to_owned(),
            });
        }
        Ok(Store {
            pool: self.pool,
            sql: Arc::new(DB::sql(table)),
        })
    }

    /// The connection pool.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    pub(crate) fn sql(&self) -> &Sql {
        &self.sql
    }

    pub(crate) fn sql_arc(&self) -> Arc<Sql> {
        self.sql.clone()
    }

    /// The name of the marker table.
    pub fn table(&self) -> &str {
        &self.sql.table
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
        let done = DB::forget(&self.pool, &self.sql, scope, key.as_str()).await?;
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
            let n = DB::purge_batch(&self.pool, &self.sql, age_ms, PURGE_BATCH).await?;
            total += n;
            if n < PURGE_BATCH as u64 {
                return Ok(total);
            }
        }
    }

    /// Begins a transaction and claims `(scope, key)` in it, with the database's defaults.
    ///
    /// This is what `#[idempotent]` expands to; call it by hand only where the attribute does
    /// not fit. On [`Claim::Fresh`] run the effect on [`Guard::tx`] and end with
    /// [`Guard::finish`]; dropping the guard rolls everything back. The scope is checked like
    /// the attribute's (1 to 255 bytes, no NUL: else [`Error::InvalidScope`], before any I/O).
    pub async fn claim(&self, scope: &str, key: &Key) -> Result<Claim<DB>, Error> {
        self.claim_with(scope, key, ClaimOptions::new()).await
    }

    /// [`claim`](Store::claim) with a `wait` and an isolation level.
    pub async fn claim_with(
        &self,
        scope: &str,
        key: &Key,
        options: ClaimOptions,
    ) -> Result<Claim<DB>, Error> {
        check_scope(scope)?;
        crate::join::refuse_nested("Store::claim")?;
        self.claim_owned(Cow::Owned(scope.to_owned()), key.clone(), options, None)
            .await
    }

    /// [`claim_with`](Store::claim_with) that stores the payload's fingerprint with the marker,
    /// and refuses a later delivery of the key with another one ([`Error::KeyReused`]).
    pub async fn claim_checked(
        &self,
        scope: &str,
        key: &Key,
        options: ClaimOptions,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Claim<DB>, Error> {
        check_scope(scope)?;
        crate::join::refuse_nested("Store::claim")?;
        self.claim_owned(
            Cow::Owned(scope.to_owned()),
            key.clone(),
            options,
            fingerprint.copied(),
        )
        .await
    }

    pub(crate) async fn claim_owned(
        &self,
        scope: Cow<'static, str>,
        key: Key,
        options: ClaimOptions,
        fingerprint: Option<Fingerprint>,
    ) -> Result<Claim<DB>, Error> {
        let started = Instant::now();
        let claim = self.claim_attempts(scope, key, options, fingerprint).await;
        observe::decided(started, observe::Decision::of_claim(&claim));
        claim
    }

    async fn claim_attempts(
        &self,
        scope: Cow<'static, str>,
        key: Key,
        options: ClaimOptions,
        fingerprint: Option<Fingerprint>,
    ) -> Result<Claim<DB>, Error> {
        let print = fingerprint.as_ref().map(|f| &f.as_bytes()[..]);
        #[cfg(feature = "testing")]
        crate::testing::probe::claiming(crate::testing::probe::Mode::Transaction);
        let mut attempt = 1;
        loop {
            let begin = DB::begin_sql(&self.sql, &options);
            // SQLite waits for the write lock in the begin, the servers in the claim: both
            // are the attempt's wait.
            let sent = Instant::now();
            let begun = self.pool.begin_with(begin).await;
            let mut tx = match begun {
                Ok(tx) => tx,
                Err(e) => {
                    observe::attempted(sent);
                    if DB::is_lock_timeout(&e) {
                        return Err(in_progress(scope, key));
                    }
                    return Err(e.into());
                }
            };
            let claimed = DB::try_claim(&mut tx, &self.sql, &scope, key.as_str(), print).await;
            observe::attempted(sent);
            match claimed {
                Ok(true) => {
                    let held = Held::new(tx, self.sql.clone(), options, scope, key, false);
                    return Ok(Claim::Fresh(Guard { held }));
                }
                Ok(false) if options.replay || fingerprint.is_some() => {
                    // Only handlers that asked for it pay for reading the marker back.
                    let recorded = DB::recorded(&mut tx, &self.sql, &scope, key.as_str()).await;
                    DB::rollback(tx, &options).await?;
                    let recorded = recorded?;
                    recorded.check(fingerprint.as_ref(), &scope, key.as_str())?;
                    return Ok(match recorded.result {
                        Some(_) if options.replay => Claim::Replayed(recorded),
                        _ => Claim::Duplicate,
                    });
                }
                Ok(false) => {
                    DB::abandon(tx, &options).await?;
                    return Ok(Claim::Duplicate);
                }
                Err(e) if DB::is_lock_timeout(&e) => {
                    drop(DB::rollback(tx, &options).await);
                    return Err(in_progress(scope, key));
                }
                // Another claimer's rollback or commit let us go with a transient error: the
                // race is decided, so asking again gives the real answer.
                Err(e) if attempt < CLAIM_ATTEMPTS && DB::is_transient(&e) => {
                    drop(DB::rollback(tx, &options).await);
                    crate::__private::count_retry();
                    observe::retry(attempt, &e);
                    attempt += 1;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
}

pub(crate) fn in_progress(scope: Cow<'static, str>, key: Key) -> Error {
    Error::InProgress {
        scope: scope.into_owned(),
        key: key.as_str().to_owned(),
    }
}

/// The answer to [`Store::claim`].
#[derive(Debug)]
#[must_use = "a fresh claim holds an open transaction: run the body and call `Guard::finish`"]
pub enum Claim<DB: Backend> {
    /// This delivery holds the key: run the body in [`Guard::tx`].
    Fresh(Guard<DB>),
    /// An earlier delivery committed this key. The claim's transaction, which wrote nothing,
    /// is over: its `ROLLBACK` goes out with the connection's return to the pool (and a
    /// connection whose rollback fails is closed, not reused), so a duplicate does not wait
    /// for it.
    Duplicate,
    /// An earlier delivery committed this key and stored its value (`replay`): read it with
    /// [`Recorded::decode`].
    Replayed(Recorded),
}

/// An open transaction holding a fresh claim.
///
/// [`finish`](Guard::finish) commits it (marker and effect together) or rolls it back; dropping
/// it, by a panic or a cancelled future, rolls it back as well.
#[derive(Debug)]
pub struct Guard<DB: Backend> {
    held: Held<'static, DB>,
}

impl<DB: Backend> Guard<DB> {
    /// The transaction the body must run its effect on.
    pub fn tx(&mut self) -> &mut Transaction<'static, DB> {
        self.held.tx()
    }

    /// Ends the call: commits on `Ok`, rolls back on `Err`.
    ///
    /// A failed rollback is not reported: the body's error is what the caller needs, and the
    /// database drops the transaction with the connection anyway.
    pub async fn finish<T, E: From<Error>>(self, result: Result<T, E>) -> Result<Outcome<T>, E> {
        crate::__private::settle(self.held.end_recording(result, |_| Ok(None)).await)
    }

    /// [`finish`](Guard::finish) that also stores the `Ok` value with the marker, in the same
    /// transaction, so that later deliveries get it back (`replay`). A value that cannot be
    /// serialised is [`Error::Serialize`], and nothing is committed.
    pub async fn finish_replay<T: serde::Serialize, E: From<Error>>(
        self,
        result: Result<T, E>,
    ) -> Result<Outcome<T>, E> {
        let end = self
            .held
            .end_recording(result, |v| crate::replay::encode(v).map(Some));
        crate::__private::settle(end.await)
    }

    pub(crate) fn into_held(self) -> Held<'static, DB> {
        self.held
    }
}

/// A fresh claim of either kind: a transaction of idem's own ([`Guard`]), or a savepoint of the
/// caller's (`joined`, [`JoinedGuard`](crate::JoinedGuard)), which ends with a `RELEASE` and
/// leaves the commit to the caller.
#[doc(hidden)]
#[derive(Debug)]
pub struct Held<'c, DB: Backend> {
    tx: Transaction<'c, DB>,
    sql: Arc<Sql>,
    options: ClaimOptions,
    scope: Cow<'static, str>,
    key: Key,
    joined: bool,
}

impl<'c, DB: Backend> Held<'c, DB> {
    pub(crate) fn new(
        tx: Transaction<'c, DB>,
        sql: Arc<Sql>,
        options: ClaimOptions,
        scope: Cow<'static, str>,
        key: Key,
        joined: bool,
    ) -> Self {
        Held {
            tx,
            sql,
            options,
            scope,
            key,
            joined,
        }
    }

    /// The transaction (or savepoint) the body runs on.
    pub fn tx(&mut self) -> &mut Transaction<'c, DB> {
        &mut self.tx
    }

    /// Rolls back the transaction, or to the savepoint. A failed rollback is not reported:
    /// the error that led here is what the caller needs, and the database drops the
    /// transaction with the connection anyway.
    async fn abandon(self) {
        if self.joined {
            drop(self.tx.rollback().await);
        } else {
            drop(DB::rollback(self.tx, &self.options).await);
        }
    }

    pub(crate) async fn end_recording<T, E>(
        mut self,
        result: Result<T, E>,
        encode: impl FnOnce(&T) -> Result<Option<String>, Error>,
    ) -> Result<Outcome<T>, crate::__private::Failed<E>> {
        use crate::__private::Failed;
        let recorded = match &result {
            Ok(value) => match encode(value) {
                Ok(None) => Ok(()),
                Ok(Some(json)) => DB::record(
                    &mut self.tx,
                    &self.sql,
                    &self.scope,
                    self.key.as_str(),
                    &json,
                )
                .await
                .map_err(Error::Database),
                Err(e) => Err(e),
            },
            Err(_) => Ok(()),
        };
        if let Err(e) = recorded {
            self.abandon().await;
            return Err(Failed::Idem(e));
        }
        #[cfg(feature = "testing")]
        if result.is_ok() {
            let at = if self.joined {
                "savepoint release"
            } else {
                "commit"
            };
            let injected = crate::testing::probe::before_commit(&self.scope, self.key.as_str(), at);
            if let Some(e) = injected.await {
                self.abandon().await;
                return Err(Failed::Idem(e));
            }
        }
        match result {
            // Joined: `RELEASE SAVEPOINT`. Applied in the caller's transaction, which is
            // theirs to commit. A failed release (the body swallowed an error that aborted the
            // transaction) drops the savepoint, whose drop rolls back to it.
            Ok(value) if self.joined => match self.tx.commit().await {
                Ok(()) => Ok(Outcome::Applied(value)),
                Err(e) => Err(Failed::Idem(Error::Database(e))),
            },
            Ok(value) => match DB::commit(self.tx, &self.sql, &self.options).await {
                Ok(true) => Ok(Outcome::Applied(value)),
                Ok(false) => Err(Failed::Idem(Error::RolledBack {
                    scope: self.scope.into_owned(),
                    key: self.key.as_str().to_owned(),
                })),
                Err(e) => Err(Failed::Idem(Error::Database(e))),
            },
            Err(e) => {
                self.abandon().await;
                Err(Failed::Handler(e))
            }
        }
    }
}

/// Scopes are checked like keys: the attribute checks its literal at compile time, the store
/// checks the scopes that hand-written code passes.
pub(crate) fn check_scope(scope: &str) -> Result<(), Error> {
    if scope.is_empty() || scope.len() > crate::MAX_KEY_LEN || scope.contains('\0') {
        return Err(Error::InvalidScope {
            scope: scope.to_owned(),
        });
    }
    Ok(())
}

fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && name.len() <= MAX_TABLE_LEN
}

#[cfg(test)]
mod tests {
    use super::{MAX_TABLE_LEN, is_identifier};

    #[test]
    fn only_plain_identifiers_are_table_names() {
        for ok in ["idem_processed", "_t", "Jobs2", &"a".repeat(MAX_TABLE_LEN)] {
            assert!(is_identifier(ok), "{ok}");
        }
        for bad in [
            "",
            "2jobs",
            "jobs; DROP TABLE users",
            "public.jobs",
            "\"jobs\"",
            "jobs-x",
            "jöbs",
            &"a".repeat(MAX_TABLE_LEN + 1),
        ] {
            assert!(!is_identifier(bad), "{bad}");
        }
    }
}
