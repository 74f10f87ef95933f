//! The outbox on PostgreSQL: all of a claim's messages in one statement, the relay's take
//! with `FOR UPDATE SKIP LOCKED` in one statement with the round before's marks, and the
//! notification the relay listens for, sent after the commits of messages and for several of
//! them at once (`backend/wake.rs`).

use sqlx::{PgConnection, Pool, Postgres};

use crate::backend::bind::Keys;
use crate::backend::bind::statements;
use crate::backend::outbox::{self, OutboxText};
use crate::backend::sql::{Placeholders, Template};
use crate::backend::{Listen, Sql, Table, Taken};
use crate::error::{Error, WalError};
use crate::outgoing::Unsent;

/// The columns of the operators' statements (see `OutboxRow`).
const OUTBOX_COLUMNS: &str = "id, destination, scope, key, seq::int8, attempts::int8, \
    last_error, (CASE WHEN parked THEN 1 ELSE 0 END)::int8, \
    (CASE WHEN sent_at IS NULL THEN 0 ELSE 1 END)::int8, \
    to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), \
    (EXTRACT(EPOCH FROM (now() - created_at)) * 1000)::int8, \
    (EXTRACT(EPOCH FROM (next_attempt_at - now())) * 1000)::int8, \
    COALESCE(ordering_key, key), headers";

/// A take's hold as text: the instant its messages are held until, in microseconds. One take
/// writes one `now()`, the transaction's, to every message it takes.
const HOLD: &str = "((EXTRACT(EPOCH FROM next_attempt_at) * 1000000)::int8)::text";

/// [`HOLD`] of the take's updated row (`u`).
const HOLD_U: &str = "((EXTRACT(EPOCH FROM u.next_attempt_at) * 1000000)::int8)::text";

/// Joined to a mark's `UPDATE`: its transaction (the statement's own) commits without waiting
/// for the WAL's flush, `SET LOCAL synchronous_commit = off` in the statement itself (one
/// round trip; the setting ends with the transaction, and the session's is untouched).
///
/// Sound because the WAL is one sequence: a crash loses at most the last commits, and never a
/// commit without those before it. A mark lost that way leaves its message unsent under its
/// round's hold, which its take committed synchronously and so outlives the crash: the
/// message is taken again once the hold ran out, after its round ended, and published again
/// with its id, as after a relay killed between the confirm and the mark. Nothing of its key
/// was published after it: a take of the key's next message needs the mark, commits after
/// it, and waits for the flush of both. Takes stay synchronous: a hold lost while its round
/// publishes would let another take publish the key beside it once the server is back.
const RELAXED: &str = "(SELECT set_config('synchronous_commit', 'off', true)) AS relaxed";

/// The statements every backend runs on its outbox.
pub(super) fn text() -> OutboxText {
    let (parked_count, parked_matching) = outbox::parked(&outbox::ParkedWords {
        columns: OUTBOX_COLUMNS,
        null_destination: ":destination::text IS NULL",
        null_error: ":error::text IS NULL",
        null_age: ":age_ms::int8 IS NULL",
        contains: "strpos(last_error, :error::text) > 0",
        ago: "now() - :age_ms * interval '1 millisecond'",
        count: "COUNT(*)",
        parked: "parked",
        order: "created_at, seq, id",
    });
    OutboxText {
        parked_count: parked_count.into(),
        parked_matching: parked_matching.into(),
        failed: format!(
            "UPDATE {{t}}_outbox SET attempts = attempts + 1, last_error = :error, \
             next_attempt_at = now() + :retry_ms * interval '1 millisecond', parked = :park \
             FROM {RELAXED} WHERE id = :id AND sent_at IS NULL AND {HOLD} = :hold"
        )
        .into(),
        forget: outbox::forget("key").into(),
        purge: "DELETE FROM {t}_outbox WHERE ctid = ANY (ARRAY(SELECT ctid FROM {t}_outbox \
                WHERE sent_at < now() - :age_ms * interval '1 millisecond' LIMIT :limit))"
            .into(),
        list: outbox::list(OUTBOX_COLUMNS).into(),
        find: outbox::find(OUTBOX_COLUMNS).into(),
        requeue: "UPDATE {t}_outbox SET parked = false, attempts = 0, next_attempt_at = now() \
                  WHERE id = :id AND parked AND sent_at IS NULL"
            .into(),
        // No statement runs after a failed one in a PostgreSQL transaction: the writes need no
        // fence (`write` below writes them all).
        write: None,
        write_watermark: None,
        // Marks apply only to messages still unsent and under the round's hold: a relay whose
        // hold ran out and whose messages another relay took marks none of them. Their
        // commits do not wait for the WAL's flush ([`RELAXED`]).
        sent: Some(
            format!(
                "UPDATE {{t}}_outbox SET sent_at = now() FROM {RELAXED} \
                 WHERE id = ANY(:ids::text[]) AND sent_at IS NULL AND {HOLD} = :hold"
            )
            .into(),
        ),
        // Lets go of messages of the round that it did not try, since an earlier message of
        // their key failed: they wait for it, not for the round's hold.
        release: Some(
            format!(
                "UPDATE {{t}}_outbox SET next_attempt_at = now() FROM {RELAXED} \
                 WHERE id = ANY(:ids::text[]) AND sent_at IS NULL AND {HOLD} = :hold"
            )
            .into(),
        ),
        // No `NOTIFY` in a job's transaction: its lock at commit would serialise every
        // committing job that sends messages. Whoever commits the transaction knows it wrote
        // messages and wakes the relays after the commit (`backend/wake.rs`); a joined
        // claim's announcement goes out with the caller's commit.
        notify: Some("SELECT pg_notify('{t}_outbox', :token)".into()),
        announce: Some("SELECT pg_notify('{t}_outbox', '')".into()),
    }
}

statements! {
    /// The relay's take.
    pub(super) struct Statements {
        // Takes the keys whose earliest unsent message is due and that no other message of
        // theirs holds back (held by a round, backing off, parked), locking those earliest
        // messages with `SKIP LOCKED`: two takes never get one key. Then holds each taken
        // key's unsent messages, a wave at a time (every key's first, then every key's
        // second...) up to the limit, so that the ones left out are a key's last. A message
        // written before ordering keys (NULL) is a key of its own. Each taken key's messages
        // are read from its index (`{t}_outbox_key`), at most the limit of them, and the
        // taken messages updated by their ids, so that no take reads the whole backlog (a
        // window over the keys `IN` the heads hashed every unsent message). The taken ids
        // are joined as an `unnest`ed array, estimated at a few rows and so looked up by the
        // primary key (`id = ANY (ARRAY(...))` let the planner compare every row of a small
        // outbox with every id, and a join on the CTE hashed all of a large one). The round
        // before's sent marks (`:sent`, under its hold `:sent_hold`) come first, in the same
        // statement and commit. The take's snapshot does not see them: it leaves their
        // messages out (updating a row twice in one statement is undefined), and their keys'
        // next messages for the next take.
        take(limit: i64, lease_ms: i64, sent: Keys<'_>, sent_hold: &str) = format!(
            "WITH marked AS (UPDATE {{t}}_outbox SET sent_at = now() \
             WHERE id = ANY(:sent::text[]) AND sent_at IS NULL AND {HOLD} = :sent_hold), \
             heads AS (SELECT o.id, o.ordering_key FROM {{t}}_outbox o \
             WHERE o.sent_at IS NULL AND NOT o.parked AND o.next_attempt_at <= now() \
             AND o.id <> ALL(:sent::text[]) \
             AND NOT EXISTS (SELECT 1 FROM {{t}}_outbox e WHERE e.ordering_key = o.ordering_key \
             AND e.sent_at IS NULL AND e.id <> o.id AND (e.parked OR e.next_attempt_at > now() \
             OR (e.created_at, e.seq, e.id) < (o.created_at, o.seq, o.id))) \
             ORDER BY o.created_at, o.seq, o.id LIMIT :limit FOR UPDATE OF o SKIP LOCKED), \
             picked AS (SELECT c.id FROM (\
             SELECT f.id, f.created_at, f.seq, f.wave FROM heads h CROSS JOIN LATERAL (\
             SELECT f.id, f.created_at, f.seq, row_number() OVER (ORDER BY f.created_at, f.seq, \
             f.id) AS wave FROM {{t}}_outbox f \
             WHERE f.ordering_key = h.ordering_key AND f.sent_at IS NULL \
             AND f.id <> ALL(:sent::text[]) \
             ORDER BY f.created_at, f.seq, f.id LIMIT :limit) f \
             UNION ALL SELECT f.id, f.created_at, f.seq, 1 FROM {{t}}_outbox f \
             JOIN heads h ON h.id = f.id WHERE h.ordering_key IS NULL) c \
             ORDER BY c.wave, c.created_at, c.seq, c.id LIMIT :limit) \
             UPDATE {{t}}_outbox u SET next_attempt_at = now() + :lease_ms * interval '1 millisecond' \
             FROM unnest(ARRAY(SELECT id FROM picked)) AS p (id) WHERE u.id = p.id \
             RETURNING u.id, u.destination, u.payload, u.seq::int8, u.attempts::int8, \
             COALESCE(u.ordering_key, u.key), (EXTRACT(EPOCH FROM u.created_at) * 1000000)::int8, \
             {HOLD_U}, u.headers"
        );
    }
}

/// All of a claim's messages in one statement, as arrays of their columns.
const WRITE: &str = "WITH written AS (INSERT INTO {t}_outbox (id, destination, payload, scope, \
    key, seq, ordering_key, headers, created_at) \
    SELECT m.id, m.destination, m.payload, :scope, m.key, m.seq, m.ordering_key, m.headers, \
    statement_timestamp() \
    FROM unnest(:ids::text[], :destinations::text[], :payloads::bytea[], :keys::text[], \
    :seqs::int8[], :ordering_keys::text[], :headers::text[]) \
    AS m (id, destination, payload, key, seq, ordering_key, headers) \
    ON CONFLICT DO NOTHING RETURNING 1) SELECT 1 FROM written LIMIT 1";

/// The binds of [`WRITE`], in the order its text names them first (the placeholders' numbers),
/// which is the order [`write`] adds them.
const WRITE_BINDS: [&str; 8] = [
    "scope",
    "ids",
    "destinations",
    "payloads",
    "keys",
    "seqs",
    "ordering_keys",
    "headers",
];

/// [`WRITE`] filled for `table`.
pub(super) fn write_template(table: &Table) -> Template {
    Template::new(table, WRITE, &WRITE_BINDS, Placeholders::Dollar)
}

/// `Backend::outbox_write`: the messages of `outbox` in one statement. Its binds are arrays,
/// which only PostgreSQL's driver binds, so they are added here rather than by a statement
/// set.
pub(super) async fn write(
    conn: &mut PgConnection,
    sql: &Sql<Postgres>,
    outbox: &Unsent,
) -> Result<(), sqlx::Error> {
    if sql.table.is_through_wal() {
        return emit(conn, sql, outbox).await;
    }
    let (mut ids, mut destinations, mut payloads, mut keys, mut seqs, mut ordering) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    let mut headers = Vec::new();
    for (key, m) in outbox.rows() {
        ids.push(m.id.as_str());
        destinations.push(m.destination.as_str());
        payloads.push(m.payload.as_slice());
        keys.push(key);
        seqs.push(i64::from(m.seq));
        ordering.push(m.ordering_key.as_str());
        headers.push(m.headers.to_json());
    }
    let template = &sql.own.write;
    debug_assert!(
        template.order.iter().copied().eq(0..8),
        "binds in their order"
    );
    sqlx::query(template.sql.clone())
        .bind(outbox.scope())
        .bind(ids)
        .bind(destinations)
        .bind(payloads)
        .bind(keys)
        .bind(seqs)
        .bind(ordering)
        .bind(headers)
        .persistent(template.persistent)
        .execute(conn)
        .await?;
    Ok(())
}

/// All of a claim's messages as transactional logical decoding messages, one statement
/// ([`Store::outbox_through_wal`](crate::Store::outbox_through_wal)): each message's frame
/// (`outgoing/frame.rs`) under the prefix [`wal_prefix`], in the order the claim sent them
/// (`unnest` yields an array's elements in their order, and each is emitted as it is read).
/// Only while a `pgoutput` slot of the database exists: WAL written before a slot was made is
/// never decoded by it, so a message emitted with no slot would be lost. With none, nothing
/// is emitted and the claim fails (`WalError::NoSlot`) instead.
const EMIT: &str = "SELECT count(pg_logical_emit_message(true, $1, f)) FROM unnest($2::bytea[]) \
    AS f WHERE EXISTS (SELECT 1 FROM pg_replication_slots WHERE plugin = 'pgoutput' \
    AND database = current_database())";

/// The prefix of the logical decoding messages of `table`'s outbox: the WAL relay of a store
/// reads its own table's messages and passes over others'.
pub(crate) fn wal_prefix(table: &str) -> String {
    format!("idem:{table}")
}

async fn emit(
    conn: &mut PgConnection,
    sql: &Sql<Postgres>,
    outbox: &Unsent,
) -> Result<(), sqlx::Error> {
    let frames: Vec<Vec<u8>> = outbox
        .rows()
        .map(|(key, m)| crate::outgoing::frame::encode(outbox.scope(), key, m))
        .collect();
    let emitted: i64 = sqlx::query_scalar(EMIT)
        .bind(wal_prefix(sql.table.as_str()))
        .bind(&frames)
        .persistent(!sql.table.is_unnamed())
        .fetch_one(conn)
        .await?;
    if emitted == 0 && !frames.is_empty() {
        return Err(Error::Wal(WalError::NoSlot).into());
    }
    Ok(())
}

/// `Backend::outbox_take`: the round before's marks and the take, in one statement.
pub(super) async fn take(
    pool: &Pool<Postgres>,
    sql: &Sql<Postgres>,
    limit: i64,
    lease_ms: i64,
    sent: &[&str],
    sent_hold: &str,
) -> Result<Taken, sqlx::Error> {
    type Row = (
        String,
        String,
        Vec<u8>,
        i64,
        i64,
        String,
        i64,
        String,
        Option<String>,
    );
    let take = sql.own.outbox.take(limit, lease_ms, Keys(sent), sent_hold);
    let mut taken: Vec<Row> = take.fetch_all(pool).await?;
    // `RETURNING` keeps no order: the order they were written in, as the take's.
    taken.sort_by(|a, b| (a.6, a.3, &a.0).cmp(&(b.6, b.3, &b.0)));
    let hold = taken.first().map(|r| r.7.clone()).unwrap_or_default();
    let rows = taken
        .into_iter()
        .map(|(id, to, payload, seq, attempts, key, _, _, headers)| {
            (id, to, payload, seq, attempts, key, headers)
        });
    Ok(Taken::new(hold, rows))
}

/// `Backend::listen`: `LISTEN` on the outbox's channel, on a connection of its own outside
/// the application's pool (a listener holds its connection for as long as it lives, and a
/// pool of one would have none left). Behind a pooler in transaction mode, `LISTEN` lands on
/// a server connection that goes back to the pool at once, whose notifications reach another
/// client or nobody: the relay polls instead.
pub(super) async fn listen(
    pool: &Pool<Postgres>,
    sql: &Sql<Postgres>,
) -> Result<Listen, sqlx::Error> {
    if sql.table.is_unnamed() {
        return Ok(Listen::Polled);
    }
    let own = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with((*pool.connect_options()).clone())
        .await?;
    let mut listener = sqlx::postgres::PgListener::connect_with(&own).await?;
    listener
        .listen(&format!("{}_outbox", sql.table.as_str()))
        .await?;
    Ok(Listen::Postgres(listener))
}
