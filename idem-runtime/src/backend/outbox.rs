//! The outbox's statements (`{t}_outbox`): the claim's writes, the relay's marks, what
//! operators read and change, and the announcement of commits where the database makes one.
//! The relay's take is each backend's own (`Backend::outbox_take`).

use std::sync::Arc;

use sqlx::Pool;

use super::bind::statements;
use super::bind::{Bound, Keys};
use super::wake::Announcer;
use super::{Backend, Fence, OutboxRow, Sql, sql_runs};
use crate::outgoing::Unsent;

/// The watermark row that holds an offset claim's nonce: a message of the claim is written
/// only while it is there (backends whose writes need a fence).
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(super) const WATERMARK_HELD: &str = "{t}_offsets AS w WHERE w.consumer_group = :group \
    AND w.topic = :topic AND w.partition_id = :partition AND w.token = :nonce";

/// `find`, as `columns` (the backend's `OutboxRow`).
pub(super) fn find(columns: &str) -> String {
    format!("SELECT {columns} FROM {{t}}_outbox WHERE id = :id")
}

/// `list`, as `columns`, where `parked` is a boolean: parked first, then in the order written.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(super) fn list(columns: &str) -> String {
    format!(
        "SELECT {columns} FROM {{t}}_outbox WHERE sent_at IS NULL \
         AND ((parked AND :parked) OR (NOT parked AND :pending)) \
         ORDER BY parked DESC, created_at, seq LIMIT :limit"
    )
}

/// The words in which the backends' statements over the parked messages differ.
pub(super) struct ParkedWords<'a> {
    /// The operators' columns (the backend's `OutboxRow`).
    pub(super) columns: &'a str,
    /// Whether the `:destination` bind is NULL (every destination).
    pub(super) null_destination: &'a str,
    /// Whether the `:error` bind is NULL (any error).
    pub(super) null_error: &'a str,
    /// Whether the `:age_ms` bind is NULL (whenever it was parked).
    pub(super) null_age: &'a str,
    /// Whether `last_error` holds the text `:error`, byte for byte.
    pub(super) contains: &'a str,
    /// The instant `:age_ms` milliseconds ago, as `next_attempt_at` compares with it.
    pub(super) ago: &'a str,
    /// `COUNT(*)` read as a 64-bit integer.
    pub(super) count: &'a str,
    /// A parked message, as a condition.
    pub(super) parked: &'a str,
    /// The order the relay publishes a key's messages in, after the key.
    pub(super) order: &'a str,
}

/// `parked_count` and `parked_matching`. A parked message's `next_attempt_at` is when it was
/// parked (the relay parks it due at once, and no relay takes a parked message).
pub(super) fn parked(words: &ParkedWords<'_>) -> (String, String) {
    let ParkedWords {
        columns,
        null_destination,
        null_error,
        null_age,
        contains,
        ago,
        count,
        parked,
        order,
    } = words;
    let matching = format!(
        "sent_at IS NULL AND {parked} AND ({null_destination} OR destination = :destination) \
         AND ({null_error} OR {contains}) AND ({null_age} OR next_attempt_at < {ago})"
    );
    (
        format!("SELECT {count} FROM {{t}}_outbox WHERE {matching}"),
        // Each key's messages together and in the relay's order: a bulk requeue makes them
        // pending in the order they are to be published (a message written before ordering
        // keys is a key of its own).
        format!(
            "SELECT {columns} FROM {{t}}_outbox WHERE {matching} \
             ORDER BY COALESCE(ordering_key, id), {order} LIMIT :limit"
        ),
    )
}

/// `forget`, `key` being the backend's `key` column.
pub(super) fn forget(key: &str) -> String {
    format!("DELETE FROM {{t}}_outbox WHERE scope = :scope AND {key} = :key AND sent_at IS NULL")
}

statements! {
    /// The outbox table's statements.
    pub(crate) struct OutboxSql, OutboxText {
        /// Publishing failed: try again in `retry_ms`, or never (`park`); only if the message
        /// is unsent and still under the round's `hold`.
        failed(id: &str, error: &str, retry_ms: i64, park: bool, hold: &str);
        /// Deletes the unsent messages (pending or parked) of one job.
        forget(scope: &str, key: &str);
        /// Deletes at most `limit` messages sent more than `age_ms` ago.
        purge(age_ms: i64, limit: i64);
        /// Unsent messages for operators (`OutboxRow`): parked ones if `parked`, pending ones
        /// if `pending`, parked first, then oldest first.
        list(parked: bool, pending: bool, limit: i64);
        /// One message by id, sent or not (`OutboxRow`).
        find(id: &str);
        /// Makes a parked message due again with no failed attempts.
        requeue(id: &str);
        /// How many parked messages the filter names (each bind NULL: any).
        parked_count(destination: Option<&str>, error: Option<&str>, age_ms: Option<i64>);
        /// At most `limit` of them (`OutboxRow`), each key's together, in its order.
        parked_matching(destination: Option<&str>, error: Option<&str>, age_ms: Option<i64>, limit: i64);
    } optional {
        /// One message, written only while the claim's marker holding `token` is there (a
        /// backend whose statements run in autocommit once the database rolled the transaction
        /// back: MySQL, SQLite).
        write(id: &str, destination: &str, payload: &[u8], seq: i64, ordering_key: &str, headers: Option<&str>, scope: &str, key: &str, token: i64);
        /// One message, written only while the watermark of the offset claim holds `nonce`.
        write_watermark(id: &str, destination: &str, payload: &[u8], seq: i64, ordering_key: &str, headers: Option<&str>, scope: &str, key: &str, group: &str, topic: &str, partition: i32, nonce: i64);
        /// Marks `ids` sent, if unsent and still under the round's `hold` (a backend that
        /// binds a list).
        sent(ids: Keys<'_>, hold: &str);
        /// Lets go of `ids` (due again at once), if unsent and still under `hold`.
        release(ids: Keys<'_>, hold: &str);
        /// Announces the commit of messages to the relays of other processes: the payload is
        /// the announcing store's token (PostgreSQL's `NOTIFY`).
        #[allow(dead_code, reason = "the announcer binds it itself: it outlives the statements")]
        notify(token: &str);
        /// Announces, in the transaction that wrote messages, that it did: for a claim joined
        /// to a caller's transaction, whose commit is the caller's.
        announce();
    }
}

impl<DB: Backend> OutboxSql<DB> {
    /// `Backend::outbox_write`: one statement a message, fenced by `fence`.
    pub(super) async fn write_each(
        &self,
        conn: &mut DB::Connection,
        outbox: &Unsent,
        fence: Fence<'_>,
    ) -> Result<(), sqlx::Error> {
        for (key, m) in outbox.rows() {
            let (seq, headers) = (i64::from(m.seq), m.headers.to_json());
            let (id, to, payload) = (m.id.as_str(), m.destination.as_str(), &m.payload[..]);
            let (ordering, headers, scope) = (&*m.ordering_key, headers.as_deref(), outbox.scope());
            let write = match fence {
                Fence::Marker(token) => {
                    self.write(id, to, payload, seq, ordering, headers, scope, key, token)
                }
                Fence::Watermark(at, nonce) => self.write_watermark(
                    id,
                    to,
                    payload,
                    seq,
                    ordering,
                    headers,
                    scope,
                    key,
                    at.group,
                    at.topic,
                    at.partition,
                    nonce,
                ),
            };
            let write = write.unwrap_or_else(|| {
                unreachable!("a backend without the outbox's `write` writes its own messages")
            });
            write.execute(&mut *conn).await?;
        }
        Ok(())
    }

    /// `Backend::outbox_sent`: one statement with the ids as a list.
    pub(super) async fn sent_listed(
        &self,
        pool: &Pool<DB>,
        ids: &[&str],
        hold: &str,
    ) -> Result<u64, sqlx::Error> {
        let sent = self.sent(Keys(ids), hold);
        let sent = sent.unwrap_or_else(|| unreachable!("a backend without `sent` marks its own"));
        sent.execute(pool).await
    }

    /// `Backend::outbox_release`: one statement with the ids as a list.
    pub(super) async fn release_listed(
        &self,
        pool: &Pool<DB>,
        ids: &[&str],
        hold: &str,
    ) -> Result<(), sqlx::Error> {
        let release = self.release(Keys(ids), hold);
        let release =
            release.unwrap_or_else(|| unreachable!("a backend without `release` writes its own"));
        release.execute(pool).await?;
        Ok(())
    }
}

sql_runs! {
    /// Publishing `id` failed: try again in `retry_ms`, or never (`park`).
    outbox_failed(pool: &Pool<DB>, id: &str, error: &str, retry_ms: i64, park: bool, hold: &str)
        -> () = outbox.failed(id, error, retry_ms, park, hold).execute => drop;
    /// Deletes the unsent messages of one job, in the transaction that forgets its marker, so
    /// that a re-run's messages, which get the same ids, are written.
    outbox_forget(conn: &mut DB::Connection, scope: &str, key: &str) -> u64 =
        outbox.forget(scope, key).execute;
    /// Deletes at most `limit` messages sent more than `age_ms` ago; returns how many.
    outbox_purge(pool: &Pool<DB>, age_ms: i64, limit: i64) -> u64 =
        outbox.purge(age_ms, limit).execute;
    /// Unsent messages for operators, parked first, then oldest first.
    outbox_list(pool: &Pool<DB>, parked: bool, pending: bool, limit: i64) -> Vec<OutboxRow> =
        outbox.list(parked, pending, limit).fetch_all;
    /// One message by id, sent or not.
    outbox_find(pool: &Pool<DB>, id: &str) -> Option<OutboxRow> = outbox.find(id).fetch_optional;
    /// Makes a parked message due again; `Ok(false)` if no unsent message of that id is
    /// parked.
    outbox_requeue(pool: &Pool<DB>, id: &str) -> bool = outbox.requeue(id).execute => |n| n == 1;
    /// How many parked messages the filter names.
    outbox_parked_count(
        pool: &Pool<DB>, destination: Option<&str>, error: Option<&str>, age_ms: Option<i64>
    ) -> Option<(i64,)> = outbox.parked_count(destination, error, age_ms).fetch_optional;
    /// At most `limit` parked messages the filter names, each key's in its order.
    outbox_parked_matching(
        pool: &Pool<DB>, destination: Option<&str>, error: Option<&str>, age_ms: Option<i64>,
        limit: i64
    ) -> Vec<OutboxRow> = outbox.parked_matching(destination, error, age_ms, limit).fetch_all;
}

impl<DB: Backend> Sql<DB> {
    /// Announces, in `conn`'s transaction, that it wrote messages, where the database
    /// announces commits (a joined claim's: the commit is the caller's).
    pub(crate) async fn outbox_announce(
        &self,
        conn: &mut DB::Connection,
    ) -> Result<(), sqlx::Error> {
        if let Some(announce) = self.outbox.announce() {
            announce.execute(conn).await?;
        }
        Ok(())
    }
}

/// How a store tells the relays of other processes that it committed messages: the outbox's
/// `notify`, on a connection of `pool` outside any job's transaction. Where the database has
/// no such statement, or where nobody could listen (behind a pooler in transaction mode), the
/// relays poll. It holds the statement, not the store's statements, which hold the announcer.
pub(crate) fn announcer<DB: Backend>(pool: &Pool<DB>, sql: &Sql<DB>) -> Option<Announcer> {
    let notify = sql
        .outbox
        .notify
        .clone()
        .filter(|_| !sql.table.is_unnamed())?;
    let pool = pool.clone();
    Some(Arc::new(move |token: String| {
        let (pool, notify) = (pool.clone(), notify.clone());
        Box::pin(async move {
            let notify = Bound::<DB>::new(&notify, &[&token.as_str()]);
            // A lost announcement costs latency only: the relays' polls find the messages.
            if let Err(e) = notify.execute(&pool).await {
                tracing::debug!(error = %e, "idem: the outbox's notification failed");
            }
        })
    }))
}
