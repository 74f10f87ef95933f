//! The conformance suite: every behaviour idem promises, written once as generic async
//! functions and run against every backend on a real database.
//!
//! A backend joins with one trait impl and a list of tests (see `tests/postgres.rs`):
//!
//! ```text
//! struct Pg;
//! impl conformance::Support for Pg { ... }        // connect, SQL dialect
//! impl conformance::Server for Pg { ... }         // only for servers: kill a connection
//! conformance::tests!(Pg; first_delivery_applies_second_is_duplicate, ...);
//! ```
//!
//! Every test makes its own tables (unique names), so tests run in parallel and reruns never
//! collide; a test that passes drops them again. A server that cannot be reached fails the test
//! with the URL and the environment variable that overrides it: the suite never skips.
//!
//! - `util`: names, the seeded shuffle, the hang guard `within`;
//! - `db`: the statements handlers run, generic over the database;
//! - `handlers`: the job, the error type, the handlers;
//! - `ctx`: one test's pool, store and tables, and counts read back from the database;
//! - `worker`: the worker processes of the multi-process cases;
//! - `cases/*`: the cases, grouped by concern.

// Each test binary includes this module and lists the cases its backend runs: SQLite skips the
// server-only ones, so some items are unused in some binaries.
#![allow(
    dead_code,
    unused_imports,
    reason = "each backend runs its own subset of the cases"
)]

pub(crate) mod cases;
pub(crate) mod ctx;
pub(crate) mod db;
pub(crate) mod handlers;
pub(crate) mod lease_handlers;
pub(crate) mod proxy;
pub(crate) mod replay_handlers;
pub(crate) mod util;
pub(crate) mod worker;

use std::future::Future;

use sqlx::{Database, Pool};

pub(crate) use db::TestDb;
pub(crate) use util::{question_marks, server_url, unique_name, unreachable};

/// What the suite needs to know about one database.
pub(crate) trait Support: Send + Sync + 'static {
    /// The sqlx database type handlers run on.
    type Db: TestDb;

    /// A database URL for one test: the server's (from the environment variable or the default)
    /// or, for an embedded database, a new file.
    fn url() -> String;

    /// A pool of at most `max` connections to `url`. Panics, naming the URL and the variable
    /// that overrides it, when the database cannot be reached.
    fn connect(url: &str, max: u32) -> impl Future<Output = Pool<Self::Db>> + Send;

    /// An SQL expression that reads the marker table's `key` column as text.
    const KEY_TEXT: &'static str;

    /// The type to `CAST` an aggregate to so that it decodes as `i64`.
    const BIGINT: &'static str;

    /// An SQL expression for the time two hours ago, in the marker table's time format.
    const TWO_HOURS_AGO: &'static str;

    /// A query counting the sessions blocked on a row lock of the marker table named `$1`
    /// (claims queued behind a key), or `None` where waiters cannot be seen from SQL (SQLite: they wait
    /// in the busy handler of `BEGIN IMMEDIATE`, invisible to other connections).
    const LOCK_WAITERS: Option<&'static str>;

    /// Whether a statement that runs after the database rolled the body's transaction back
    /// (in [`swallow_a_rollback`](Support::swallow_a_rollback)) is kept: MySQL and SQLite run
    /// it in autocommit, PostgreSQL refuses it in the aborted transaction.
    const STATEMENT_AFTER_ROLLBACK_KEPT: bool;

    /// Inside a body, on its transaction's connection: makes the database roll the whole
    /// transaction back by a failing statement, and swallows that statement's error (what a
    /// careless body does). `rows` is a table `(id BIGINT PRIMARY KEY, v BIGINT)` holding ids
    /// 1 to 100; `other` is a pool for a second session.
    fn swallow_a_rollback<'a>(
        conn: &'a mut <Self::Db as Database>::Connection,
        other: &'a Pool<Self::Db>,
        rows: &'a str,
    ) -> impl Future<Output = ()> + Send + 'a;

    /// Where a claim with `wait` changes a session setting that outlives the transaction
    /// unless put back (MySQL's `innodb_lock_wait_timeout`): a query for the session's id,
    /// and one answering 1 when the setting is back to the server's default. `None` where the
    /// wait ends with the transaction (PostgreSQL's `SET LOCAL`) or stays set by design
    /// (SQLite's busy timeout).
    const WAIT_RESTORED: Option<(&'static str, &'static str)> = None;

    /// Removes what [`url`](Support::url) created outside the database (files), if anything.
    fn remove(_url: &str) {}
}

/// What the suite needs from a database server (not from an embedded database).
pub(crate) trait Server: Support {
    /// The environment variable that overrides the server's URL.
    const URL_VAR: &'static str;

    /// A URL of this scheme on which no server listens.
    const UNREACHABLE_URL: &'static str;

    /// The id by which another session can kill this connection.
    fn connection_id(
        conn: &mut <Self::Db as Database>::Connection,
    ) -> impl Future<Output = i64> + Send + '_;

    /// Kills the connection `id` from another session of `pool`.
    fn kill(pool: &Pool<Self::Db>, id: i64) -> impl Future<Output = ()> + Send + '_;

    /// The wire protocol, which the proxy of the ambiguous-commit cases frames.
    const WIRE: proxy::Wire;

    /// `host:port` of the server `url` names.
    fn address(url: &str) -> String;

    /// `url` connecting to `addr` instead (the proxy), in plain text: the proxy reads the
    /// messages, so the client must not negotiate TLS.
    fn with_address(url: &str, addr: std::net::SocketAddr) -> String;

    /// A query counting the server's sessions whose client port is `$1` (an integer).
    const SESSIONS_FROM_PORT: &'static str;
}

/// One `#[tokio::test]` per listed case, each a call of the generic case on `$support`.
macro_rules! tests {
    ($support:ty; $($case:ident),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread")]
        async fn $case() {
            $crate::conformance::cases::$case::<$support>().await;
        }
    )*};
}

pub(crate) use tests;
