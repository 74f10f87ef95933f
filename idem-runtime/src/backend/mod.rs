//! What each database does differently, and the one layer that runs every database's
//! statements. Nothing here knows a mode; the claim core (`claim`) decides what the rows mean.
//!
//! A backend supplies text, not glue: the statements of each concern as one struct of texts
//! (`{t}` for the table, `:name` for a bind; [`statements!`](bind::statements) declares each
//! set once, with its binds), its DDL, and the few places where its protocol really differs
//! (a transaction's begin and verified commit, the claim statement, a lease's claim, the
//! relay's take, migrations). [`Sql`] holds the statements filled for one table and runs
//! them for every database ([`bind`]: binds added in the order each text names them, rows
//! read as plain values); the concern modules (`claim`, `lease`, `outbox`, `offsets`,
//! `operators`, `health`) hold the sets and the code that runs them.
//!
//! # What a fourth database implements
//!
//! 1. [`Driver`](bind::Driver), with the `driver!` macro: its placeholders, and how it binds a
//!    list of keys and reads text.
//! 2. [`Backend`]'s required items (the list below). Its folder's modules (`claim`, `lease`,
//!    `outbox`, `operators`) and constants (`DDL`, `ADDED`) give its name, the texts of every
//!    set ([`Texts`]), the statements of its own protocol ([`Backend::Own`]) and its schema
//!    ([`Schema`]) through `own!` and `wiring!`; by hand it writes how its errors read, its
//!    transaction's begin and verified commit, the claim in a transaction, the lease claim,
//!    the relay's take and `migrate` (`backend_fns!` writes their signatures).
//! 3. Where its protocol differs from the defaults, the provided hooks: the savepoint
//!    statements, batches of keys (a database that binds no list writes them as one message),
//!    the outbox's write and the round's marks, and [`Backend::listen`] where it announces
//!    commits (the optional `notify` and `announce` statements).
//! 4. A unit test that checks and fills every text (`sql::check_backend`) and the
//!    conformance suite (`tests/conformance`) instantiated for it.

use std::fmt::Debug;
use std::future::Future;
use std::time::Duration;

use sqlx::{Pool, SqlStr, Transaction};

use crate::options::ClaimOptions;

pub(crate) mod bind;
mod claim;
mod glue;
mod health;
mod lease;
mod listen;
#[cfg(feature = "mysql")]
mod mysql;
mod offsets;
mod operators;
mod outbox;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
mod rows;
pub(crate) mod sql;
#[cfg(feature = "sqlite")]
mod sqlite;
mod upgrade;
pub(crate) mod wake;

pub(crate) use glue::{backend_fns, own, sql_runs, wiring};
pub(crate) use health::{Bloat, COUNT_CAP, Slot};
pub(crate) use listen::Listen;
pub(crate) use outbox::announcer;
pub(crate) use rows::{Found, LeaseState, MarkerRow, OutboxRow, Status, StepRow, Taken};
pub use sql::MAX_TABLE_LEN;
pub(crate) use sql::Table;

use bind::Driver;
use upgrade::{Added, Addition};

/// A database idem can keep markers in: `sqlx::Postgres`, `sqlx::Sqlite` or `sqlx::MySql`,
/// each behind the cargo feature of the same name.
///
/// The trait is sealed: the SQL each backend runs is not a public API.
#[diagnostic::on_unimplemented(
    message = "idem cannot keep markers in `{Self}`: this build of idem does not have that database",
    label = "a store or handler on `{Self}`",
    note = "enable idem's cargo feature for it: `postgres`, `mysql` or `sqlite` (the default), e.g. `idem = {{ version = \"..\", features = [\"postgres\"] }}`"
)]
pub trait Backend: Driver + Sized {
    /// The backend's name in `Debug` output and the CLI.
    const BACKEND: &'static str;

    /// The statements only this backend's protocol runs, filled for one table.
    type Own: Send + Sync + Debug + 'static;

    /// The texts of every shared statement set.
    fn texts() -> Texts;

    /// [`Backend::Own`] for `table`.
    fn own(table: &Table) -> Self::Own;

    /// The tables, indexes and later additions, for `Store::ddl` and `migrate`.
    fn schema() -> Schema;

    /// The claim waited longer than the `wait` it was given.
    fn is_lock_timeout(err: &sqlx::Error) -> bool;

    /// A race lost to another claimer (serialization failure, deadlock victim): worth
    /// retrying the claim.
    fn is_transient(err: &sqlx::Error) -> bool;

    /// The statement failed only because the transaction was aborted by an earlier one
    /// (PostgreSQL's `25P02`): the body swallowed a failed statement.
    fn is_aborted(err: &sqlx::Error) -> bool;

    /// Begins a claim's transaction with the options' isolation level and lock wait, in as
    /// few round trips as the backend allows; with the default options, any writer's.
    fn begin<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Sql<Self>,
        options: &'p ClaimOptions,
    ) -> impl Future<Output = Result<Transaction<'static, Self>, sqlx::Error>> + Send + 'p;

    /// Commits `tx`, in one round trip; `Ok(false)` means the database rolled the
    /// transaction back instead (a failed statement aborted it, or a deadlock undid it), so
    /// nothing of it was kept.
    fn commit<'a>(
        tx: Transaction<'a, Self>,
        check: Check<'a>,
        options: &'a ClaimOptions,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// Inserts the marker (`completed`, holding the claim's nonce and fingerprint) and, when a
    /// marker is there already, reads it: `(inserted, the marker found)`. The marker can be
    /// missing from the answer although the insert found one (a delivery that committed it
    /// while this claim waited): the caller reads it again. The stored value is read only with
    /// `replay`. With a `wait`, the statement that makes the claim fresh puts the session's
    /// lock wait back. `own`: the transaction is the claim's own, ended right after a
    /// duplicate's answer, so the marker met may be locked for writing; in a transaction that
    /// goes on (a caller's, a group's) it is locked no more than a read of it would.
    fn claim_or_read<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Sql<Self>,
        claimant: Claimant<'t>,
        replay: bool,
        own: bool,
    ) -> impl Future<Output = Result<(bool, Option<Found>), sqlx::Error>> + Send + 't;

    /// Lease mode: claims `(scope, key)` for `lease_ms` of the database's clock, taking a free
    /// lease over (token up, attempts + 1), in as few statements as the backend allows; waits
    /// for another holder of the key at most `claimant.wait` (the backend's shortest wait
    /// without one).
    fn lease_claim<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Sql<Self>,
        claimant: Claimant<'p>,
        lease_ms: i64,
    ) -> impl Future<Output = Result<LeaseState, sqlx::Error>> + Send + 'p;

    /// The relay's take: at most `limit` messages, in the order they were written, of the
    /// ordering keys whose earliest unsent message is due and no message of which is held,
    /// backing off or parked; a key whose earliest message another take is taking is skipped
    /// (never taken by two at once). A key's messages are taken from its earliest on, every
    /// key's first before any key's second. Held for `lease_ms`, until the one instant the
    /// `Taken` names. First, in the same transaction, marks `sent` as
    /// [`Backend::outbox_sent`] would under `sent_hold` (the round before's confirmed messages);
    /// the take takes none of them.
    fn outbox_take<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Sql<Self>,
        limit: i64,
        lease_ms: i64,
        sent: &'p [&'p str],
        sent_hold: &'p str,
    ) -> impl Future<Output = Result<Taken, sqlx::Error>> + Send + 'p;

    /// Creates the tables if they are missing and adds what later versions added, the workers
    /// taking turns (`upgrade::run` does the statements; the backend, the turns).
    fn migrate<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Sql<Self>,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'p;

    // Provided: the shared protocol, which a backend replaces where its own differs.

    /// Begins a group's transaction. `true`: an empty savepoint for its first call is open
    /// already, sent with the `BEGIN` in one message (the servers); SQLite, whose statements
    /// cost no round trip, opens none (`false`).
    fn begin_primed<'p>(
        pool: &'p Pool<Self>,
        _: &'p Sql<Self>,
    ) -> impl Future<Output = Result<(Transaction<'static, Self>, bool), sqlx::Error>> + Send + 'p
    {
        async move {
            let tx = pool.begin_with(sqlx::AssertSqlSafe(BEGIN_PRIMED)).await?;
            Ok((tx, true))
        }
    }

    /// Rolls `tx` back, and undoes what [`begin`](Backend::begin) set on the session.
    fn rollback<'a>(
        tx: Transaction<'a, Self>,
        _: &'a ClaimOptions,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a {
        tx.rollback()
    }

    /// Ends a transaction that wrote nothing (the claim found an earlier delivery's marker),
    /// without waiting for the database's answer where the backend allows it: sqlx queues the
    /// `ROLLBACK` when the transaction is dropped and sends it as the connection goes back to
    /// the pool. A connection whose rollback fails is closed by the pool, not reused.
    fn discard<'a>(
        tx: Transaction<'a, Self>,
        _: &'a ClaimOptions,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a {
        drop(tx);
        std::future::ready(Ok(()))
    }

    /// Runs `step` on the savepoint of one job of a batch or one member of a group.
    fn savepoint<'t>(
        conn: &'t mut Self::Connection,
        step: Savepoint,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 't {
        async move {
            sqlx::raw_sql(step.ansi()).execute(Self::exec(conn)).await?;
            Ok(())
        }
    }

    /// Takes a released or expired lease over in the transaction, as a completed marker
    /// holding the claim's nonce (fencing out its holder); `Ok(false)` if it is no longer
    /// free.
    fn take_over<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Sql<Self>,
        c: Claimant<'t>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 't {
        sql.claim.take_over_plain(conn, c)
    }

    /// Batch claim: inserts the markers of `keys` (distinct, sorted, so that overlapping
    /// batches lock rows in one order); returns the keys this transaction inserted.
    fn claim_batch<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Sql<Self>,
        c: Claimant<'t>,
        keys: &'t [&'t str],
    ) -> impl Future<Output = Result<Vec<String>, sqlx::Error>> + Send + 't {
        sql.claim.batch_claim(conn, c, keys)
    }

    /// [`take_over`](Backend::take_over) for the free markers among `keys`; returns the keys
    /// taken.
    fn take_over_batch<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Sql<Self>,
        c: Claimant<'t>,
        keys: &'t [&'t str],
    ) -> impl Future<Output = Result<Vec<String>, sqlx::Error>> + Send + 't {
        sql.claim.batch_take_over(conn, c, keys)
    }

    /// The status of each marker of `keys` that exists (batch claims).
    fn batch_markers<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Sql<Self>,
        scope: &'t str,
        keys: &'t [&'t str],
    ) -> impl Future<Output = Result<Vec<(String, Found)>, sqlx::Error>> + Send + 't {
        sql.claim.read_batch(conn, scope, keys)
    }

    /// Gives back the markers of batch jobs that failed alone: the ones this claim inserted
    /// (`inserted`) are deleted, the free leases it took over (`taken`) are free leases again
    /// (`in_progress`, no holder), their attempt counted. Only the rows holding the claim's
    /// nonce are touched.
    fn unclaim<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Sql<Self>,
        c: Claimant<'t>,
        inserted: &'t [&'t str],
        taken: &'t [&'t str],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 't {
        sql.claim.batch_unclaim(conn, c, inserted, taken)
    }

    /// After a batch claimed with a `wait`: the session's lock wait back where the batch's
    /// statements left it bounded (PostgreSQL), so that the body's statements are not.
    fn batch_claimed<'t>(
        _: &'t mut Self::Connection,
        _: &'t Sql<Self>,
        _: &'t ClaimOptions,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 't {
        std::future::ready(Ok(()))
    }

    /// Writes a claim's outbox messages in its transaction, fenced by `fence` where a
    /// statement could run in autocommit after the database rolled the transaction back
    /// (MySQL, SQLite): only while the marker (or watermark) holding its token is there.
    fn outbox_write<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Sql<Self>,
        outbox: &'t crate::outgoing::Unsent,
        fence: Fence<'t>,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 't {
        sql.outbox.write_each(conn, outbox, fence)
    }

    /// The broker confirmed these messages: each is marked sent if it is unsent and still
    /// under `hold`; returns how many were.
    fn outbox_sent<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Sql<Self>,
        ids: &'p [&'p str],
        hold: &'p str,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'p {
        sql.outbox.sent_listed(pool, ids, hold)
    }

    /// Lets go of messages of a round that it did not try because an earlier message of their
    /// key failed: due again at once; only those unsent and still under `hold`.
    fn outbox_release<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Sql<Self>,
        ids: &'p [&'p str],
        hold: &'p str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'p {
        sql.outbox.release_listed(pool, ids, hold)
    }

    /// The port the pool connects to, where its options name one (the doctor compares it
    /// with the server's own, `HealthSql::server_port`).
    fn port(_: &Pool<Self>) -> Option<u16> {
        None
    }

    /// What a relay waits on when a round found nothing to send: the announced commits of
    /// other processes, where the database announces them (the outbox's `notify`).
    fn listen<'p>(
        _: &'p Pool<Self>,
        _: &'p Sql<Self>,
    ) -> impl Future<Output = Result<Listen, sqlx::Error>> + Send + 'p {
        std::future::ready(Ok(Listen::Polled))
    }
}

/// The texts of every shared statement set, as one backend writes them.
pub struct Texts {
    pub(crate) claim: claim::ClaimText,
    pub(crate) lease: lease::LeaseText,
    pub(crate) steps: lease::StepText,
    pub(crate) outbox: outbox::OutboxText,
    pub(crate) offsets: offsets::OffsetText,
    pub(crate) ops: operators::OperatorText,
    pub(crate) health: health::HealthText,
}

/// A backend's tables: `CREATE` statements in order (`{t}` for the marker table), what later
/// schema versions added to tables earlier ones made, and whether its `ADD COLUMN` can say
/// `IF NOT EXISTS`.
pub struct Schema {
    pub(crate) ddl: &'static [&'static str],
    pub(crate) added: &'static [Added],
    pub(crate) if_not_exists: bool,
}

/// The statements of one marker table, for every concern, and the code that runs them.
#[derive(Debug)]
pub struct Sql<DB: Backend> {
    pub(crate) table: Table,
    pub(crate) claim: claim::ClaimSql<DB>,
    pub(crate) lease: lease::LeaseSql<DB>,
    pub(crate) steps: lease::StepSql<DB>,
    pub(crate) outbox: outbox::OutboxSql<DB>,
    pub(crate) offsets: offsets::OffsetSql<DB>,
    pub(crate) ops: operators::OperatorSql<DB>,
    pub(crate) health: health::HealthSql<DB>,
    pub(crate) ddl: Vec<SqlStr>,
    pub(crate) added: Vec<Addition>,
    pub(crate) own: DB::Own,
}

impl<DB: Backend> Sql<DB> {
    /// Every statement of `DB` filled for `table`.
    pub(crate) fn new(table: &Table) -> Self {
        let texts = DB::texts();
        let schema = DB::schema();
        Sql {
            table: table.clone(),
            claim: claim::ClaimSql::new(table, &texts.claim),
            lease: lease::LeaseSql::new(table, &texts.lease),
            steps: lease::StepSql::new(table, &texts.steps),
            outbox: outbox::OutboxSql::new(table, &texts.outbox),
            offsets: offsets::OffsetSql::new(table, &texts.offsets),
            ops: operators::OperatorSql::new(table, &texts.ops),
            health: health::HealthSql::new(table, &texts.health),
            ddl: schema.ddl.iter().map(|s| table.fill(s)).collect(),
            added: schema
                .added
                .iter()
                .map(|a| a.fill(table, schema.if_not_exists))
                .collect(),
            own: DB::own(table),
        }
    }
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
    Watermark(&'a Table, Partition<'a>, i64),
}

/// What a claim's outbox write is fenced by: the row of the claim's own that exists only while
/// its transaction does.
#[derive(Debug, Clone, Copy)]
pub enum Fence<'a> {
    /// The marker holding this token (a claim's nonce, or a lease's token).
    Marker(i64),
    /// The watermark of this partition holding this nonce (an offset claim).
    Watermark(Partition<'a>, i64),
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

/// A group's `BEGIN` with the savepoint of its first call (see `Backend::begin_primed`).
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
pub(crate) struct Holder<'a> {
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
