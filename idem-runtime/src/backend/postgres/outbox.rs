//! The outbox on PostgreSQL: all of a claim's messages in one statement, the relay's take
//! with `FOR UPDATE SKIP LOCKED`, and the notification the relay listens for, sent after the
//! commits of messages and for several of them at once (`backend/wake.rs`).

use std::sync::Arc;

use sqlx::{Pool, Postgres};

use super::PgSql;
use super::pinned::on_pool;
use crate::backend::sealed::Outboxes;
use crate::backend::sql::statements;
use crate::backend::wake::Announcer;
use crate::backend::{Listen, OutboxRow, Taken, rows};
use crate::outgoing::Pending;

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

statements! {
    /// The outbox table's statements (`{t}_outbox`).
    pub(super) struct OutboxSql<Postgres> {
        // No `NOTIFY` here: its lock at commit would serialise every committing job that
        // sends messages. Whoever commits the transaction knows it wrote messages and wakes
        // the relays after the commit (`backend/wake.rs`). No statement runs after a failed
        // one in a PostgreSQL transaction, so the write needs no check that the claim's marker
        // is still there.
        write(ids: Vec<&str>, destinations: Vec<&str>, payloads: Vec<&[u8]>, scope: &str, keys: Vec<&str>, seqs: Vec<i64>, ordering_keys: Vec<&str>, headers: Vec<Option<String>>) =
            "WITH written AS (INSERT INTO {t}_outbox (id, destination, payload, scope, key, seq, \
             ordering_key, headers, created_at) \
             SELECT m.id, m.destination, m.payload, $4, m.key, m.seq, m.ordering_key, m.headers, \
             statement_timestamp() \
             FROM unnest($1::text[], $2::text[], $3::bytea[], $5::text[], $6::int8[], $7::text[], \
             $8::text[]) AS m (id, destination, payload, key, seq, ordering_key, headers) \
             ON CONFLICT DO NOTHING RETURNING 1) \
             SELECT 1 FROM written LIMIT 1";
        // A joined claim's announcement, which goes out with the caller's commit.
        announce() = "SELECT pg_notify('{t}_outbox', '')";
        // Takes the keys whose earliest unsent message is due and that no other message of
        // theirs holds back (held by a round, backing off, parked), locking those earliest
        // messages with `SKIP LOCKED`: two takes never get one key. Then holds each taken
        // key's unsent messages, a wave at a time (every key's first, then every key's
        // second...) up to the limit, so that the ones left out are a key's last. A message
        // written before ordering keys (NULL) is a key of its own. Each taken key's messages
        // are read from its index (`{t}_outbox_key`), at most the limit of them, and the
        // taken messages updated by their ids: neither reads the whole backlog, as a
        // window over the keys `IN` the heads and an `UPDATE ... WHERE id IN` did (a hash
        // join over every unsent message: 14 to 20 ms a take of 100 at 20,000 unsent
        // messages, 5 ms now). The taken ids are joined as an `unnest`ed array (estimated at
        // a few rows, so looked up by the primary key): `id = ANY (ARRAY(...))` let the
        // planner scan a small outbox and compare every row with every id (100,000
        // comparisons at 1,000 unsent messages, 3 to 3.5 ms a take against 1.5 to 1.7 now),
        // and a join on the CTE, estimated at a tenth of the table, hashed all of a large one.
        // The round before's sent marks (`$3`, under its hold `$4`) come first, in the same
        // statement and commit. The take's snapshot does not see them: it leaves their
        // messages out (updating a row twice in one statement is undefined), and their keys'
        // next messages for the next take.
        take(limit: i64, lease_ms: i64, sent: &[&str], sent_hold: &str) = format!(
            "WITH marked AS (UPDATE {{t}}_outbox SET sent_at = now() \
             WHERE id = ANY($3::text[]) AND sent_at IS NULL AND {HOLD} = $4), \
             heads AS (SELECT o.id, o.ordering_key FROM {{t}}_outbox o \
             WHERE o.sent_at IS NULL AND NOT o.parked AND o.next_attempt_at <= now() \
             AND o.id <> ALL($3::text[]) \
             AND NOT EXISTS (SELECT 1 FROM {{t}}_outbox e WHERE e.ordering_key = o.ordering_key \
             AND e.sent_at IS NULL AND e.id <> o.id AND (e.parked OR e.next_attempt_at > now() \
             OR (e.created_at, e.seq, e.id) < (o.created_at, o.seq, o.id))) \
             ORDER BY o.created_at, o.seq, o.id LIMIT $1 FOR UPDATE OF o SKIP LOCKED), \
             picked AS (SELECT c.id FROM (\
             SELECT f.id, f.created_at, f.seq, f.wave FROM heads h CROSS JOIN LATERAL (\
             SELECT f.id, f.created_at, f.seq, row_number() OVER (ORDER BY f.created_at, f.seq, \
             f.id) AS wave FROM {{t}}_outbox f \
             WHERE f.ordering_key = h.ordering_key AND f.sent_at IS NULL \
             AND f.id <> ALL($3::text[]) \
             ORDER BY f.created_at, f.seq, f.id LIMIT $1) f \
             UNION ALL SELECT f.id, f.created_at, f.seq, 1 FROM {{t}}_outbox f \
             JOIN heads h ON h.id = f.id WHERE h.ordering_key IS NULL) c \
             ORDER BY c.wave, c.created_at, c.seq, c.id LIMIT $1) \
             UPDATE {{t}}_outbox u SET next_attempt_at = now() + $2 * interval '1 millisecond' \
             FROM unnest(ARRAY(SELECT id FROM picked)) AS p (id) WHERE u.id = p.id \
             RETURNING u.id, u.destination, u.payload, u.seq, u.attempts, \
             COALESCE(u.ordering_key, u.key), (EXTRACT(EPOCH FROM u.created_at) * 1000000)::int8, \
             {HOLD_U}, u.headers"
        );
        // Marks apply only to messages still unsent and under the round's hold: a relay whose
        // hold ran out and whose messages another relay took marks none of them. Their
        // commits do not wait for the WAL's flush ([`RELAXED`]).
        sent(ids: &[&str], hold: &str) = format!(
            "UPDATE {{t}}_outbox SET sent_at = now() FROM {RELAXED} \
             WHERE id = ANY($1::text[]) AND sent_at IS NULL AND {HOLD} = $2"
        );
        // Lets go of messages of the round that it did not try, since an earlier message of
        // their key failed: they wait for it, not for the round's hold.
        release(ids: &[&str], hold: &str) = format!(
            "UPDATE {{t}}_outbox SET next_attempt_at = now() FROM {RELAXED} \
             WHERE id = ANY($1::text[]) AND sent_at IS NULL AND {HOLD} = $2"
        );
        failed(id: &str, error: &str, retry_ms: i64, park: bool, hold: &str) = format!(
            "UPDATE {{t}}_outbox SET attempts = attempts + 1, last_error = $2, \
             next_attempt_at = now() + $3 * interval '1 millisecond', parked = $4 \
             FROM {RELAXED} WHERE id = $1 AND sent_at IS NULL AND {HOLD} = $5"
        );
        forget(scope: &str, key: &str) =
            "DELETE FROM {t}_outbox WHERE scope = $1 AND key = $2 AND sent_at IS NULL";
        purge(age_ms: i64, limit: i64) =
            "DELETE FROM {t}_outbox WHERE ctid = ANY (ARRAY(SELECT ctid FROM {t}_outbox \
             WHERE sent_at < now() - $1 * interval '1 millisecond' LIMIT $2))";
        list(parked: bool, pending: bool, limit: i64) = format!(
            "SELECT {OUTBOX_COLUMNS} FROM {{t}}_outbox WHERE sent_at IS NULL \
             AND ((parked AND $1) OR (NOT parked AND $2)) \
             ORDER BY parked DESC, created_at, seq LIMIT $3"
        );
        find(id: &str) = format!("SELECT {OUTBOX_COLUMNS} FROM {{t}}_outbox WHERE id = $1");
        requeue(id: &str) =
            "UPDATE {t}_outbox SET parked = false, attempts = 0, next_attempt_at = now() \
             WHERE id = $1 AND parked AND sent_at IS NULL";
    }
}

impl Outboxes for Postgres {
    async fn outbox_write<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t PgSql,
        outbox: &'t Pending,
        _token: i64,
    ) -> Result<(), sqlx::Error> {
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
        sql.outbox
            .write(
                ids,
                destinations,
                payloads,
                outbox.scope(),
                keys,
                seqs,
                ordering,
                headers,
            )
            .query()
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    async fn outbox_take<'p>(
        pool: &'p Pool<Self>,
        sql: &'p PgSql,
        limit: i64,
        lease_ms: i64,
        sent: &'p [&'p str],
        sent_hold: &'p str,
    ) -> Result<Taken, sqlx::Error> {
        type Row = (
            String,
            String,
            Vec<u8>,
            i32,
            i32,
            String,
            i64,
            String,
            Option<String>,
        );
        let mut taken: Vec<Row> = on_pool(pool, sql, async |conn| {
            sql.outbox
                .take(limit, lease_ms, sent, sent_hold)
                .rows()
                .fetch_all(conn)
                .await
        })
        .await?;
        // `RETURNING` keeps no order: the order they were written in, as the take's.
        taken.sort_by(|a, b| (a.6, a.3, &a.0).cmp(&(b.6, b.3, &b.0)));
        let hold = taken.first().map(|r| r.7.clone()).unwrap_or_default();
        let messages = taken
            .into_iter()
            .map(
                |(id, destination, payload, seq, attempts, key, _, _, headers)| {
                    rows::message(
                        id,
                        destination,
                        payload,
                        seq,
                        attempts,
                        key,
                        headers.as_deref(),
                    )
                },
            )
            .collect();
        Ok(Taken { messages, hold })
    }

    async fn outbox_sent<'p>(
        pool: &'p Pool<Self>,
        sql: &'p PgSql,
        ids: &'p [&'p str],
        hold: &'p str,
    ) -> Result<u64, sqlx::Error> {
        let done = on_pool(pool, sql, async |conn| {
            sql.outbox.sent(ids, hold).query().execute(conn).await
        })
        .await?;
        Ok(done.rows_affected())
    }

    async fn outbox_release<'p>(
        pool: &'p Pool<Self>,
        sql: &'p PgSql,
        ids: &'p [&'p str],
        hold: &'p str,
    ) -> Result<(), sqlx::Error> {
        on_pool(pool, sql, async |conn| {
            sql.outbox.release(ids, hold).query().execute(conn).await
        })
        .await?;
        Ok(())
    }

    async fn outbox_failed<'p>(
        pool: &'p Pool<Self>,
        sql: &'p PgSql,
        id: &'p str,
        error: &'p str,
        retry_ms: i64,
        park: bool,
        hold: &'p str,
    ) -> Result<(), sqlx::Error> {
        let failed = sql.outbox.failed(id, error, retry_ms, park, hold);
        on_pool(pool, sql, async |conn| failed.query().execute(conn).await).await?;
        Ok(())
    }

    async fn outbox_forget<'p>(
        conn: &'p mut Self::Connection,
        sql: &'p PgSql,
        scope: &'p str,
        key: &'p str,
    ) -> Result<u64, sqlx::Error> {
        let done = sql
            .outbox
            .forget(scope, key)
            .query()
            .execute(&mut *conn)
            .await?;
        Ok(done.rows_affected())
    }

    async fn outbox_purge<'p>(
        pool: &'p Pool<Self>,
        sql: &'p PgSql,
        age_ms: i64,
        limit: i64,
    ) -> Result<u64, sqlx::Error> {
        let done = on_pool(pool, sql, async |conn| {
            sql.outbox.purge(age_ms, limit).query().execute(conn).await
        })
        .await?;
        Ok(done.rows_affected())
    }

    async fn outbox_list<'p>(
        pool: &'p Pool<Self>,
        sql: &'p PgSql,
        parked: bool,
        pending: bool,
        limit: i64,
    ) -> Result<Vec<OutboxRow>, sqlx::Error> {
        let list = sql.outbox.list(parked, pending, limit);
        on_pool(pool, sql, async |conn| list.rows().fetch_all(conn).await).await
    }

    async fn outbox_find<'p>(
        pool: &'p Pool<Self>,
        sql: &'p PgSql,
        id: &'p str,
    ) -> Result<Option<OutboxRow>, sqlx::Error> {
        on_pool(pool, sql, async |conn| {
            sql.outbox.find(id).rows().fetch_optional(conn).await
        })
        .await
    }

    async fn outbox_requeue<'p>(
        pool: &'p Pool<Self>,
        sql: &'p PgSql,
        id: &'p str,
    ) -> Result<bool, sqlx::Error> {
        let done = on_pool(pool, sql, async |conn| {
            sql.outbox.requeue(id).query().execute(conn).await
        })
        .await?;
        Ok(done.rows_affected() == 1)
    }

    fn outbox_announcer(pool: &Pool<Self>, sql: &PgSql) -> Option<Announcer> {
        // Behind a pooler in transaction mode nobody listens: the relays poll.
        if sql.table.is_unnamed() {
            return None;
        }
        let pool = pool.clone();
        let channel = format!("{}_outbox", sql.table.as_str());
        Some(Arc::new(move |token: String| {
            let (pool, channel) = (pool.clone(), channel.clone());
            Box::pin(async move {
                // A lost announcement costs latency only: the relays' polls find the messages.
                let sent = sqlx::query("SELECT pg_notify($1, $2)")
                    .bind(channel)
                    .bind(token)
                    .execute(&pool)
                    .await;
                if let Err(e) = sent {
                    tracing::debug!(error = %e, "idem: the outbox's notification failed");
                }
            })
        }))
    }

    async fn outbox_announce<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t PgSql,
    ) -> Result<(), sqlx::Error> {
        sql.outbox.announce().query().execute(&mut *conn).await?;
        Ok(())
    }

    async fn outbox_listen<'p>(
        pool: &'p Pool<Self>,
        sql: &'p PgSql,
    ) -> Result<Option<Listen>, sqlx::Error> {
        // Behind a pooler in transaction mode, `LISTEN` lands on a server connection that goes
        // back to the pool at once: its notifications reach another client or nobody. The
        // relay polls instead.
        if sql.table.is_unnamed() {
            return Ok(None);
        }
        // A connection of its own, outside the application's pool: a listener holds its
        // connection for as long as it lives, and a pool of one would have none left.
        let own = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect_with((*pool.connect_options()).clone())
            .await?;
        let mut listener = sqlx::postgres::PgListener::connect_with(&own).await?;
        listener
            .listen(&format!("{}_outbox", sql.table.as_str()))
            .await?;
        Ok(Some(Listen::Postgres(listener)))
    }
}
