//! What each database does differently: its SQL and the rows it returns. Nothing here knows a
//! mode; the claim core (`claim`) decides what the rows mean.
//!
//! [`Backend`] is the public, sealed name of a database idem supports. What a backend does is
//! split by concern into traits that no other crate can name: [`Claims`](sealed::Claims)
//! (a claim in a transaction, its verified commit), [`Leases`](sealed::Leases) (lease mode's
//! statements), [`Steps`](sealed::Steps) (a lease's recorded steps),
//! [`Failures`](sealed::Failures) (jobs that failed for good, for operators),
//! [`Outboxes`](sealed::Outboxes) (the outbox's writes and the relay's),
//! [`Operators`](sealed::Operators) (migrate, forget, inspect, purge) and
//! [`Watermarks`](sealed::Watermarks) (the offset-watermark mode's statements). Every statement takes
//! the backend's own [`Dialect::Sql`](sealed::Dialect::Sql), which only a
//! [`Store`](crate::store::Store) builds from a validated [`Table`]: no caller outside idem
//! can get a statement run, let alone one on a table name of its own. Each backend writes each
//! of its statements once, with its binds in the order of their placeholders (`sql.rs`).

use std::future::Future;
use std::time::Duration;

use sqlx::{Pool, Transaction};

use crate::options::ClaimOptions;
use crate::outgoing::Pending;

pub(crate) mod health;
mod listen;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
pub(crate) mod retention;
mod rows;
pub(crate) mod sealed;
mod sql;
#[cfg(feature = "sqlite")]
mod sqlite;
mod upgrade;
pub(crate) mod wake;

pub(crate) use listen::Listen;
pub(crate) use rows::{Found, LeaseState, MarkerRow, OutboxRow, Status, StepRow, Taken};
pub use sql::MAX_TABLE_LEN;
pub(crate) use sql::Table;

/// A database idem can keep markers in: `sqlx::Postgres`, `sqlx::Sqlite` or `sqlx::MySql`,
/// each behind the cargo feature of the same name.
///
/// The trait is sealed: the SQL each backend runs is not a public API.
#[diagnostic::on_unimplemented(
    message = "idem cannot keep markers in `{Self}`: this build of idem does not have that database",
    label = "a store or handler on `{Self}`",
    note = "enable idem's cargo feature for it: `postgres`, `mysql` or `sqlite` (the default), e.g. `idem = {{ version = \"..\", features = [\"postgres\"] }}`"
)]
pub trait Backend:
    sealed::Claims
    + sealed::Leases
    + sealed::Steps
    + sealed::Failures
    + sealed::Outboxes
    + sealed::Operators
    + sealed::Retentions
    + sealed::Health
    + sealed::Watermarks
{
}

/// One claim's identity in the statements that write its marker.
#[derive(Debug, Clone, Copy)]
pub struct Claimant<'a> {
    pub(crate) scope: &'a str,
    pub(crate) key: &'a str,
    pub(crate) fingerprint: Option<&'a [u8]>,
    /// This claim's own id (negative): a transaction-mode marker holds it as its `token`, so
    /// that the commit (MySQL) and the outbox's write (MySQL, SQLite) can tell whether the
    /// transaction holding it is still the one that claimed.
    pub(crate) nonce: i64,
    /// How long the claim may wait for another holder of the key.
    pub(crate) wait: Option<Duration>,
}

/// What a commit checks to tell a commit from a transaction the database threw away.
#[derive(Debug, Clone, Copy)]
pub enum Check<'a> {
    /// The marker a claim of this transaction wrote in `table` (MySQL finds it by its
    /// nonce).
    Marker(&'a Table, Claimant<'a>),
    /// No marker of ours: a caller's transaction (`idem::commit`).
    Session,
    /// The offset watermark of `partition` that a claim of this transaction moved, holding its
    /// nonce (MySQL finds it by that).
    Offsets(&'a Table, Partition<'a>, i64),
}

/// A consumer group's partition of a topic: the row of its offset watermark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Partition<'a> {
    pub(crate) group: &'a str,
    pub(crate) topic: &'a str,
    pub(crate) partition: i32,
}

/// What happens to the savepoint that holds one job of a batch run job by job, or one member
/// of a group (`idem_job`, named apart from sqlx's own `_sqlx_savepoint_N`, which a body may
/// open inside it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Savepoint {
    /// Opened for the next job; with `wait`, the claim that follows it waits at most that long
    /// where the backend bounds claims per transaction (PostgreSQL's `SET LOCAL`, undone by a
    /// rollback to the savepoint).
    Open(Option<Duration>),
    /// The last job's savepoint released (its work kept in the transaction), then the next
    /// one's opened: one message.
    Next(Option<Duration>),
    /// Released: the job's work stays in the transaction.
    Release,
    /// Rolled back to and released: nothing of the job stays.
    RollBack,
}

/// A group's `BEGIN` with the savepoint of its first call (see `Claims::begin_primed`).
const BEGIN_PRIMED: &str = "BEGIN; SAVEPOINT idem_job";

impl Savepoint {
    /// The statements, as every backend spells them (SQL's own savepoint statements).
    fn ansi(self) -> &'static str {
        match self {
            Savepoint::Open(_) => "SAVEPOINT idem_job",
            Savepoint::Next(_) => "RELEASE SAVEPOINT idem_job; SAVEPOINT idem_job",
            Savepoint::Release => "RELEASE SAVEPOINT idem_job",
            Savepoint::RollBack => "ROLLBACK TO SAVEPOINT idem_job; RELEASE SAVEPOINT idem_job",
        }
    }
}

/// A lease holder's identity in the statements that end or extend its lease.
#[derive(Debug, Clone, Copy)]
pub struct Holder<'a> {
    pub(crate) scope: &'a str,
    pub(crate) key: &'a str,
    pub(crate) token: i64,
}

/// `wait` rounded up to whole seconds (at least one), for databases that count lock waits in
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
