//! The traits that say what a backend does, split by concern; sealed: no other crate can name
//! them (see the parent module).

use super::wake::Announcer;
use super::*;

// Schema version 3: per-scope retention; and what `Store::doctor` reads.
pub(crate) use super::health::Health;
pub(crate) use super::retention::Retentions;

/// What every backend is: its name, its statements for one table, how its errors read.
pub trait Dialect: sqlx::Database {
    /// The backend's name in `Debug` output and the CLI.
    const BACKEND: &'static str;

    /// The statements of this backend for one table: only those it runs.
    type Sql: Send + Sync + std::fmt::Debug + 'static;

    /// The statements of this backend for `table`.
    fn statements(table: &Table) -> Self::Sql;

    /// The table the statements were filled with.
    fn table(sql: &Self::Sql) -> &Table;

    /// The claim waited longer than the `wait` it was given.
    fn is_lock_timeout(err: &sqlx::Error) -> bool;

    /// A race lost to another claimer (serialization failure, deadlock victim): worth
    /// retrying the claim.
    fn is_transient(err: &sqlx::Error) -> bool;

    /// The statement failed only because the transaction was aborted by an earlier one
    /// (PostgreSQL's `25P02`): the body swallowed a failed statement.
    fn is_aborted(err: &sqlx::Error) -> bool;
}

/// Claims in a transaction: transaction mode, joined calls and batches.
pub trait Claims: Dialect {
    /// Begins a claim's transaction with the options' isolation level and lock wait, in
    /// as few round trips as the backend allows.
    fn begin<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
        options: &'p ClaimOptions,
    ) -> impl Future<Output = Result<Transaction<'static, Self>, sqlx::Error>> + Send + 'p;

    /// Begins a group's transaction. `true`: an empty savepoint for its first call is open
    /// already, sent with the `BEGIN` in one message (the servers); SQLite, whose statements
    /// cost no round trip, opens none (`false`).
    fn begin_primed<'p>(
        pool: &'p Pool<Self>,
        _: &'p Self::Sql,
    ) -> impl Future<Output = Result<(Transaction<'static, Self>, bool), sqlx::Error>> + Send + 'p
    {
        async move {
            let tx = pool.begin_with(sqlx::AssertSqlSafe(BEGIN_PRIMED)).await?;
            Ok((tx, true))
        }
    }

    /// Commits `tx`, in one round trip; `Ok(false)` means the database rolled the
    /// transaction back instead (a failed statement aborted it, or a deadlock undid it),
    /// so nothing of it was kept.
    fn commit<'a>(
        tx: Transaction<'a, Self>,
        check: Check<'a>,
        options: &'a ClaimOptions,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// Rolls `tx` back, and undoes what [`begin`](Claims::begin) set on the session.
    fn rollback<'a>(
        tx: Transaction<'a, Self>,
        options: &'a ClaimOptions,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Ends a transaction that wrote nothing (the claim found an earlier delivery's
    /// marker), without waiting for the database's answer where the backend allows it:
    /// sqlx queues the `ROLLBACK` when the transaction is dropped and sends it as the
    /// connection goes back to the pool. A connection whose rollback fails is closed by
    /// the pool, not reused.
    fn discard<'a>(
        tx: Transaction<'a, Self>,
        options: &'a ClaimOptions,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Inserts the marker (`completed`, holding the claim's nonce and fingerprint) and,
    /// when a marker is there already, reads it: `(inserted, the marker found)`. The
    /// marker can be missing from the answer although the insert found one (a delivery
    /// that committed it while this claim waited): the caller reads it again. The stored
    /// value is read only with `replay`. With a `wait`, the statement that makes the
    /// claim fresh puts the session's lock wait back. `own`: the transaction is the claim's
    /// own, ended right after a duplicate's answer, so the marker met may be locked for
    /// writing (MySQL answers a duplicate in its claim statement so); in a transaction that
    /// goes on (a caller's, a group's) it is locked no more than a read of it would.
    fn claim_or_read<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Self::Sql,
        claimant: Claimant<'t>,
        replay: bool,
        own: bool,
    ) -> impl Future<Output = Result<(bool, Option<Found>), sqlx::Error>> + Send + 't;

    /// Reads a marker: its state on the database's clock, fingerprint and stored value;
    /// `None` if it is gone.
    fn marker<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Self::Sql,
        scope: &'t str,
        key: &'t str,
    ) -> impl Future<Output = Result<Option<Found>, sqlx::Error>> + Send + 't;

    /// Takes a released or expired lease over in the transaction, as a completed marker
    /// holding the claim's nonce (fencing out its holder); `Ok(false)` if it is no longer
    /// free.
    fn take_over<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Self::Sql,
        claimant: Claimant<'t>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 't;

    /// Stores the handler's value (JSON) with the marker, in the claim's transaction.
    fn record<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Self::Sql,
        scope: &'t str,
        key: &'t str,
        json: &'t str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 't;

    /// Batch claim: inserts the markers of `keys` (distinct, sorted, so that overlapping
    /// batches lock rows in one order) with one statement; returns the keys this
    /// transaction inserted.
    fn claim_batch<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Self::Sql,
        claimant: Claimant<'t>,
        keys: &'t [&'t str],
    ) -> impl Future<Output = Result<Vec<String>, sqlx::Error>> + Send + 't;

    /// The status of each marker of `keys` that exists (batch claims).
    fn batch_markers<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Self::Sql,
        scope: &'t str,
        keys: &'t [&'t str],
    ) -> impl Future<Output = Result<Vec<(String, Found)>, sqlx::Error>> + Send + 't;

    /// [`take_over`](Claims::take_over) for the free markers among `keys`; returns the
    /// keys taken.
    fn take_over_batch<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Self::Sql,
        claimant: Claimant<'t>,
        keys: &'t [&'t str],
    ) -> impl Future<Output = Result<Vec<String>, sqlx::Error>> + Send + 't;

    /// Runs `step` on the savepoint of one job of a batch or one member of a group.
    fn savepoint<'t>(
        conn: &'t mut Self::Connection,
        step: Savepoint,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 't;

    /// Gives back the markers of batch jobs that failed alone: the ones this claim
    /// inserted (`inserted`) are deleted, the free leases it took over (`taken`) are free
    /// leases again (`in_progress`, no holder), their attempt counted. Only the rows
    /// holding the claim's nonce are touched.
    fn unclaim<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Self::Sql,
        claimant: Claimant<'t>,
        inserted: &'t [&'t str],
        taken: &'t [&'t str],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 't;

    /// After a batch claimed with a `wait`: the session's lock wait back where the batch's
    /// statements left it bounded (PostgreSQL), so that the body's statements are not.
    fn batch_claimed<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Self::Sql,
        options: &'t ClaimOptions,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 't;
}

/// Lease mode: claims outside any transaction, on the database's clock, fenced by a token
/// that never repeats for a key (the database clock's microseconds at the claim, or one
/// more than the last holder's, `forget` included).
pub trait Leases: Dialect {
    /// Claims `(scope, key)` for `lease_ms` of the database's clock, taking a free lease
    /// over (token up, attempts + 1), in as few statements as the backend allows; waits
    /// for another holder of the key at most `claimant.wait` (the backend's shortest
    /// wait without one).
    fn lease_claim<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
        claimant: Claimant<'p>,
        lease_ms: i64,
    ) -> impl Future<Output = Result<LeaseState, sqlx::Error>> + Send + 'p;

    /// Completes the lease of `holder`, storing `result` (if any), on `conn` (a
    /// transaction when messages are written with it); `Ok(false)` if that holder no
    /// longer had the key.
    fn lease_complete<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Self::Sql,
        holder: Holder<'t>,
        result: Option<&'t str>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 't;

    /// Completes the lease of `holder` as failed for good, with `error` and no value;
    /// `Ok(false)` if that holder no longer had the key.
    fn lease_fail<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
        holder: Holder<'p>,
        error: &'p str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'p;

    /// Releases the lease of `holder` now (the marker stays, free for the next delivery);
    /// `Ok(false)` if that holder no longer had the key.
    fn lease_release<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
        holder: Holder<'p>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'p;

    /// Extends the lease of `holder` by `lease_ms` from the database's now; `Ok(false)`
    /// if that holder no longer had the key.
    fn lease_renew<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
        holder: Holder<'p>,
        lease_ms: i64,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'p;
}

/// A lease's steps (`Lease::step`): each step's value, recorded only while its holder's
/// token is the marker's, and read back by a later holder of the key.
pub trait Steps: Dialect {
    /// The recorded steps of `(scope, key)`, in the order they were recorded.
    fn steps_read<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
        scope: &'p str,
        key: &'p str,
    ) -> impl Future<Output = Result<Vec<StepRow>, sqlx::Error>> + Send + 'p;

    /// Records the step `name` (the `seq`-th of its body) with its value `json`, on `conn`
    /// (a transaction for a database step), if `holder` still holds the key; `Ok(false)`
    /// if not, and nothing was written.
    fn step_record<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Self::Sql,
        holder: Holder<'t>,
        name: &'t str,
        seq: i64,
        json: &'t str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 't;

    /// Deletes the steps of `(scope, key)` if its marker is gone: what `forget` does in
    /// the transaction that deleted the marker.
    fn steps_forget<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Self::Sql,
        scope: &'t str,
        key: &'t str,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 't;
}

/// Jobs that failed for good (a lease's permanent error), for operators.
pub trait Failures: Dialect {
    /// At most `limit` failed markers of `scope` (every scope: `None`), newest first.
    fn failed<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
        scope: Option<&'p str>,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<MarkerRow>, sqlx::Error>> + Send + 'p;

    /// Makes the failed marker of `(scope, key)` a released lease (its token up, its
    /// steps kept), so that the next delivery runs the job again; `Ok(false)` if it is not
    /// a failed marker.
    fn requeue<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
        scope: &'p str,
        key: &'p str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'p;
}

/// The outbox: the claim's writes, the relay's rounds, what operators read and change.
pub trait Outboxes: Dialect {
    /// Writes the outbox's messages in the claim's transaction; where a statement could
    /// run in autocommit after the database rolled the transaction back (MySQL, SQLite),
    /// only while the marker holding `token` is there.
    fn outbox_write<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Self::Sql,
        outbox: &'t Pending,
        token: i64,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 't;

    /// The relay's take: at most `limit` messages, in the order they were written, of
    /// the ordering keys whose earliest unsent message is due and no message of which is
    /// held, backing off or parked; a key whose earliest message another take is taking
    /// is skipped (never taken by two at once). A key's messages are taken from its
    /// earliest on, every key's first before any key's second, so the limit leaves out a
    /// key's last ones. Held for `lease_ms`, after which a relay that died with them lets
    /// another take them again. Every message of one take is held until the same instant,
    /// which the [`Taken`] names: its hold, which a later take of the same message (once
    /// the hold ran out) changes.
    ///
    /// First, in the same transaction, marks `sent` as [`outbox_sent`](Outboxes::outbox_sent)
    /// would under `sent_hold` (the round before's confirmed messages: one commit for its
    /// marks and this take); the take takes none of them.
    fn outbox_take<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
        limit: i64,
        lease_ms: i64,
        sent: &'p [&'p str],
        sent_hold: &'p str,
    ) -> impl Future<Output = Result<Taken, sqlx::Error>> + Send + 'p;

    /// The broker confirmed these messages: each is marked sent if it is unsent and still
    /// under `hold`; returns how many were.
    fn outbox_sent<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
        ids: &'p [&'p str],
        hold: &'p str,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'p;

    /// Lets go of these messages of a round, which it did not try because an earlier
    /// message of their key failed: due again at once (their key waits for that one);
    /// only those unsent and still under `hold`.
    fn outbox_release<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
        ids: &'p [&'p str],
        hold: &'p str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'p;

    /// Publishing failed: try again in `retry_ms`, or never (`park`); only if the message
    /// is unsent and still under `hold`.
    fn outbox_failed<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
        id: &'p str,
        error: &'p str,
        retry_ms: i64,
        park: bool,
        hold: &'p str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'p;

    /// Deletes the unsent messages (pending or parked) of one job: what `forget` does to
    /// its outbox, in the transaction that forgets its marker, so that a re-run's messages,
    /// which get the same ids, are written.
    fn outbox_forget<'p>(
        conn: &'p mut Self::Connection,
        sql: &'p Self::Sql,
        scope: &'p str,
        key: &'p str,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'p;

    /// Deletes at most `limit` messages sent more than `age_ms` ago; returns how many.
    fn outbox_purge<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
        age_ms: i64,
        limit: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'p;

    /// Unsent messages for operators: parked ones if `parked`, pending ones if `pending`,
    /// parked first, then oldest first.
    fn outbox_list<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
        parked: bool,
        pending: bool,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<OutboxRow>, sqlx::Error>> + Send + 'p;

    /// One message by id, sent or not.
    fn outbox_find<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
        id: &'p str,
    ) -> impl Future<Output = Result<Option<OutboxRow>, sqlx::Error>> + Send + 'p;

    /// Makes a parked message due again with no failed attempts; `Ok(false)` if no
    /// unsent message of that id is parked.
    fn outbox_requeue<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
        id: &'p str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'p;

    /// What a relay waits on when a round found nothing to send: the commits of new
    /// messages, where the database announces them (PostgreSQL); `None` where it does
    /// not, and the relay polls.
    fn outbox_listen<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
    ) -> impl Future<Output = Result<Option<Listen>, sqlx::Error>> + Send + 'p;

    /// How a store tells the relays of other processes that messages were committed (a
    /// store's own relays are woken in the process): PostgreSQL's `NOTIFY`, on a connection
    /// of `pool`, outside any job's transaction; `None` where the database has no such thing,
    /// or where nobody could listen (behind a pooler in transaction mode).
    fn outbox_announcer(_pool: &Pool<Self>, _sql: &Self::Sql) -> Option<Announcer> {
        None
    }

    /// Announces, in `conn`'s transaction, that it wrote messages: for a claim joined to a
    /// caller's transaction, whose commit is the caller's and so signals nothing. Nothing
    /// where the database cannot announce a commit (the relays poll).
    fn outbox_announce<'t>(
        _conn: &'t mut Self::Connection,
        _sql: &'t Self::Sql,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 't {
        std::future::ready(Ok(()))
    }
}

/// The offset-watermark mode: per (consumer group, topic, partition), the next offset to
/// process, moved in the claim's transaction (`{t}_offsets`).
pub trait Watermarks: Dialect {
    /// Moves the watermark of `at` to `next` if it is at most `first` (every offset from
    /// `first` on is unprocessed), holding `nonce`; `Ok(false)` if it is above `first` or
    /// missing.
    fn offsets_advance<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Self::Sql,
        at: Partition<'t>,
        first: i64,
        next: i64,
        nonce: i64,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 't;

    /// The watermark of `at`, locked until the transaction ends (`FOR UPDATE`; SQLite's
    /// writer holds the database's write lock already); `None` if there is none.
    fn offsets_lock<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Self::Sql,
        at: Partition<'t>,
    ) -> impl Future<Output = Result<Option<i64>, sqlx::Error>> + Send + 't;

    /// Writes the first watermark of `at`, holding `nonce`; `Ok(false)` if another
    /// transaction wrote one first.
    fn offsets_insert<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Self::Sql,
        at: Partition<'t>,
        next: i64,
        nonce: i64,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 't;

    /// The watermarks of every partition of `topic` that `group` has one for.
    fn offsets_read<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
        group: &'p str,
        topic: &'p str,
    ) -> impl Future<Output = Result<Vec<(i32, i64)>, sqlx::Error>> + Send + 'p;

    /// Sets the watermark of `at` to `next`, whatever it was (operators: moving it back
    /// replays, moving it on skips).
    fn offsets_set<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
        at: Partition<'p>,
        next: i64,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'p;

    /// Deletes the watermarks of `group` for `topic` (every topic: `None`); returns how
    /// many.
    fn offsets_forget<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
        group: &'p str,
        topic: Option<&'p str>,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'p;

    /// Writes the outbox's messages in an offset claim's transaction; where a statement
    /// could run in autocommit after the database rolled the transaction back (MySQL,
    /// SQLite), only while the watermark of `at` holds `nonce`.
    fn offsets_outbox_write<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t Self::Sql,
        outbox: &'t Pending,
        at: Partition<'t>,
        nonce: i64,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 't;
}

/// What operators do with the marker table.
pub trait Operators: Dialect {
    /// The statements that create the tables, in order.
    fn ddl(sql: &Self::Sql) -> &[sqlx::SqlStr];

    /// Creates the marker and outbox tables if they are missing, the workers taking
    /// turns.
    fn migrate<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'p;

    /// Lets the next delivery of `(scope, key)` run: deletes a completed marker, or lets
    /// go of one in progress (its token goes up, fencing its holder out) unless a
    /// delivery holds a live lease on it and `force` is not set. `Ok(true)` if it did
    /// either. Runs in the caller's transaction, beside [`outbox_forget`](Outboxes::outbox_forget).
    fn forget<'p>(
        conn: &'p mut Self::Connection,
        sql: &'p Self::Sql,
        scope: &'p str,
        key: &'p str,
        force: bool,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'p;

    /// Who holds the marker of `(scope, key)`, if there is one.
    fn status<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
        scope: &'p str,
        key: &'p str,
    ) -> impl Future<Output = Result<Option<Status>, sqlx::Error>> + Send + 'p;

    /// One marker, for operators.
    fn inspect<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
        scope: &'p str,
        key: &'p str,
    ) -> impl Future<Output = Result<Option<MarkerRow>, sqlx::Error>> + Send + 'p;

    /// At most `limit` in-progress markers of `scope` (every scope: `None`), expired or
    /// released leases first.
    fn in_progress<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
        scope: Option<&'p str>,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<MarkerRow>, sqlx::Error>> + Send + 'p;

    /// Deletes at most `limit` completed markers older than `age_ms`, and their steps with
    /// them (one transaction); returns how many markers.
    fn purge_batch<'p>(
        pool: &'p Pool<Self>,
        sql: &'p Self::Sql,
        age_ms: i64,
        limit: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'p;
}
