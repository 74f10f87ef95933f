use std::fmt;
use std::sync::Arc;

use sqlx::{Pool, Transaction};

use crate::backend::{Backend, Sql};
use crate::{Error, Key, Outcome};

/// The table of markers that [`Store::new`] uses.
pub const DEFAULT_TABLE: &str = "idem_processed";

/// The longest table name [`Store::with_table`] accepts: the names derived from it (the
/// index `{table}_completed_at`) must fit PostgreSQL's 63-byte identifiers, which it would
/// otherwise cut silently, merging the index names of tables with a long common prefix.
pub const MAX_TABLE_LEN: usize = 47;

/// The most rows one statement of [`Store::purge`] deletes.
pub const PURGE_BATCH: i64 = 5_000;

/// How often a claim that lost a race to a transient error (a serialization failure or a
/// deadlock between waiters) is tried again before the error is returned.
const CLAIM_ATTEMPTS: u32 = 5;

/// Where the markers live: a connection pool plus the name of the marker table.
///
/// Cheap to clone (the pool and the prepared SQL are shared). Create one per process, call
/// [`migrate`](Store::migrate) once at start-up, and pass `&store` to every idempotent handler.
///
/// ```no_run
/// # async fn f() -> Result<(), idem_runtime::Error> {
/// # #[cfg(feature = "sqlite")] {
/// let pool = sqlx::SqlitePool::connect("sqlite://jobs.db?mode=rwc").await?;
/// let store = idem_runtime::Store::new(pool);
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
///   lost race (`40001`, `40P01`) is retried, a few times at most.
/// - **MySQL / MariaDB**: the claim is a plain `INSERT`; duplicate-key error 1062 is the
///   duplicate signal, and a deadlock victim (1213) among waiters retries its claim. Keys are
///   stored with a binary collation, so `"Job-A"`, `"job-a"` and `"job-a "` are three keys.
/// - **SQLite**: every call begins with `BEGIN IMMEDIATE`, taking the write lock up front (a
///   deferred transaction could deadlock on the lock upgrade). Another writer waits for it up to
///   the connection's busy timeout (sqlx's default is 5 s; set it with
///   `SqliteConnectOptions::busy_timeout`) and then fails with `SQLITE_BUSY`, returned as
///   [`Error::Database`]: nothing was written, the job can be redelivered. Use WAL
///   (`journal_mode(Wal)`) so readers do not wait on writers.
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
    pub async fn purge(&self, older_than: std::time::Duration) -> Result<u64, Error> {
        let age_ms = i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
        let mut total = 0;
        loop {
            let n = DB::purge_batch(&self.pool, &self.sql, age_ms, PURGE_BATCH).await?;
            total += n;
            if n < PURGE_BATCH as u64 {
                return Ok(total);
            }
        }
    }

    /// Begins a transaction and claims `(scope, key)` in it.
    ///
    /// This is what `#[idempotent]` expands to; call it by hand only where the attribute does
    /// not fit. On [`Claim::Fresh`] run the effect on [`Guard::tx`] and end with
    /// [`Guard::finish`]; dropping the guard rolls everything back.
    pub async fn claim(&self, scope: &str, key: &Key) -> Result<Claim<DB>, Error> {
        let mut attempt = 1;
        loop {
            let mut tx = self.pool.begin_with(self.sql.begin.clone()).await?;
            match DB::try_claim(&mut tx, &self.sql, scope, key.as_str()).await {
                Ok(true) => return Ok(Claim::Fresh(Guard { tx })),
                Ok(false) => {
                    tx.rollback().await?;
                    return Ok(Claim::Duplicate);
                }
                // Another claimer's rollback or commit let us go with a transient error: the
                // race is decided, so asking again gives the real answer.
                Err(e) if attempt < CLAIM_ATTEMPTS && DB::is_transient(&e) => {
                    drop(tx.rollback().await);
                    attempt += 1;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
}

/// The answer to [`Store::claim`].
#[derive(Debug)]
#[must_use = "a fresh claim holds an open transaction: run the body and call `Guard::finish`"]
pub enum Claim<DB: Backend> {
    /// This delivery holds the key: run the body in [`Guard::tx`].
    Fresh(Guard<DB>),
    /// An earlier delivery committed this key; its transaction has been rolled back.
    Duplicate,
}

/// An open transaction holding a fresh claim.
///
/// [`finish`](Guard::finish) commits it (marker and effect together) or rolls it back; dropping
/// it, by a panic or a cancelled future, rolls it back as well.
#[derive(Debug)]
pub struct Guard<DB: Backend> {
    tx: Transaction<'static, DB>,
}

impl<DB: Backend> Guard<DB> {
    /// The transaction the body must run its effect on.
    pub fn tx(&mut self) -> &mut Transaction<'static, DB> {
        &mut self.tx
    }

    /// Ends the call: commits on `Ok`, rolls back on `Err`.
    ///
    /// A failed rollback is not reported: the body's error is what the caller needs, and the
    /// database drops the transaction with the connection anyway.
    pub async fn finish<T, E: From<Error>>(self, result: Result<T, E>) -> Result<Outcome<T>, E> {
        crate::__private::settle(self.end(result).await)
    }

    pub(crate) async fn end<T, E>(
        self,
        result: Result<T, E>,
    ) -> Result<Outcome<T>, crate::__private::Failed<E>> {
        use crate::__private::Failed;
        match result {
            Ok(value) => match self.tx.commit().await {
                Ok(()) => Ok(Outcome::Applied(value)),
                Err(e) => Err(Failed::Idem(Error::Database(e))),
            },
            Err(e) => {
                drop(self.tx.rollback().await);
                Err(Failed::Handler(e))
            }
        }
    }
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
