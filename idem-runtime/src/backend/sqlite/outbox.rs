//! The outbox on SQLite: one statement a message (they cost no round trip here), written only
//! while the claim's marker is there; writers are serialised, so the relay's take needs no row
//! locks.

use sqlx::{Pool, Sqlite};

use super::{SqliteSql, begin};
use crate::backend::sealed::Outboxes;
use crate::backend::sql::statements;
use crate::backend::{Listen, OutboxRow, Taken, rows};
use crate::outgoing::Pending;

/// The columns of the operators' statements (see `OutboxRow`).
const OUTBOX_COLUMNS: &str = "id, destination, scope, key, seq, attempts, last_error, \
    parked <> 0, sent_at IS NOT NULL, created_at, \
    CAST((julianday('now') - julianday(created_at)) * 86400000.0 AS INTEGER), \
    CAST((julianday(next_attempt_at) - julianday('now')) * 86400000.0 AS INTEGER), \
    COALESCE(ordering_key, key), headers";

statements! {
    /// The outbox table's statements (`{t}_outbox`).
    pub(super) struct OutboxSql<Sqlite> {
        // A statement that rolls the transaction back (`INSERT OR ROLLBACK`, a full disk) ends
        // it, and later statements run in autocommit: a message is written only while the
        // marker holding the claim's token (its nonce, or a lease's token) is there.
        write(id: &str, destination: &str, payload: &[u8], seq: i64, scope: &str, key: &str, token: i64, ordering_key: &str, headers: Option<&str>) =
            "INSERT INTO {t}_outbox (id, destination, payload, scope, key, seq, ordering_key, \
             headers) SELECT ?1, ?2, ?3, m.scope, m.key, ?4, ?8, ?9 FROM {t} AS m \
             WHERE m.scope = ?5 AND m.key = ?6 AND m.token = ?7 ON CONFLICT DO NOTHING";
        // The keys whose earliest unsent message is due and that no other message of theirs
        // holds back (held by a round, backing off, parked); then each taken key's unsent
        // messages, a wave at a time (every key's first, then every key's second...) up to
        // the limit, so that the ones left out are a key's last. One writer at a time: no
        // other take runs meanwhile. The order they were written in is `created_at` (to the
        // millisecond) and then the `rowid` (one more than the largest, for each insert). A
        // message written before ordering keys (NULL) is a key of its own.
        take(limit: i64, lease_ms: i64) =
            "WITH heads AS (SELECT o.rowid AS r, o.ordering_key AS k FROM {t}_outbox o \
             WHERE o.sent_at IS NULL AND o.parked = 0 \
             AND o.next_attempt_at <= strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
             AND NOT EXISTS (SELECT 1 FROM {t}_outbox e WHERE e.ordering_key = o.ordering_key \
             AND e.sent_at IS NULL AND e.rowid <> o.rowid AND (e.parked <> 0 \
             OR e.next_attempt_at > strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
             OR (e.created_at, e.rowid) < (o.created_at, o.rowid))) \
             ORDER BY o.created_at, o.rowid LIMIT ?1), \
             picked AS (SELECT c.r FROM (\
             SELECT f.rowid AS r, f.created_at AS at, row_number() OVER (PARTITION BY \
             f.ordering_key ORDER BY f.created_at, f.rowid) AS wave FROM {t}_outbox f \
             WHERE f.sent_at IS NULL AND f.ordering_key IN (SELECT k FROM heads) \
             UNION ALL SELECT h.r, f.created_at, 1 FROM heads h JOIN {t}_outbox f \
             ON f.rowid = h.r WHERE h.k IS NULL) c ORDER BY c.wave, c.at, c.r LIMIT ?1) \
             UPDATE {t}_outbox SET next_attempt_at = \
             strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '+' || (?2 / 1000.0) || ' seconds') \
             WHERE rowid IN (SELECT r FROM picked) \
             RETURNING id, destination, payload, seq, attempts, COALESCE(ordering_key, key), \
             created_at, rowid, next_attempt_at, headers";
        // Marks apply only to messages still unsent and under the round's hold (the time the
        // take wrote, one for the whole statement: SQLite reads 'now' once per statement).
        sent(ids: &str, hold: &str) =
            "UPDATE {t}_outbox SET sent_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
             WHERE id IN (SELECT value FROM json_each(?1)) AND sent_at IS NULL \
             AND next_attempt_at = ?2";
        // Lets go of messages of the round that it did not try, since an earlier message of
        // their key failed: they wait for it, not for the round's hold.
        release(ids: &str, hold: &str) =
            "UPDATE {t}_outbox SET next_attempt_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
             WHERE id IN (SELECT value FROM json_each(?1)) AND sent_at IS NULL \
             AND next_attempt_at = ?2";
        failed(id: &str, error: &str, retry_ms: i64, park: bool, hold: &str) =
            "UPDATE {t}_outbox SET attempts = attempts + 1, last_error = ?2, next_attempt_at = \
             strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '+' || (?3 / 1000.0) || ' seconds'), \
             parked = ?4 WHERE id = ?1 AND sent_at IS NULL AND next_attempt_at = ?5";
        forget(scope: &str, key: &str) =
            "DELETE FROM {t}_outbox WHERE scope = ?1 AND key = ?2 AND sent_at IS NULL";
        purge(age_ms: i64, limit: i64) =
            "DELETE FROM {t}_outbox WHERE id IN (SELECT id FROM {t}_outbox WHERE sent_at < \
             strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-' || (?1 / 1000.0) || ' seconds') \
             LIMIT ?2)";
        list(parked: bool, pending: bool, limit: i64) = format!(
            "SELECT {OUTBOX_COLUMNS} FROM {{t}}_outbox WHERE sent_at IS NULL \
             AND ((parked <> 0 AND ?1) OR (parked = 0 AND ?2)) \
             ORDER BY parked DESC, created_at, rowid LIMIT ?3"
        );
        find(id: &str) = format!("SELECT {OUTBOX_COLUMNS} FROM {{t}}_outbox WHERE id = ?1");
        requeue(id: &str) =
            "UPDATE {t}_outbox SET parked = 0, attempts = 0, \
             next_attempt_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
             WHERE id = ?1 AND parked <> 0 AND sent_at IS NULL";
    }
}

impl Outboxes for Sqlite {
    async fn outbox_write<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t SqliteSql,
        outbox: &'t Pending,
        token: i64,
    ) -> Result<(), sqlx::Error> {
        for (key, m) in outbox.rows() {
            let seq = i64::from(m.seq);
            let headers = m.headers.to_json();
            let write = sql.outbox.write(
                &m.id,
                &m.destination,
                &m.payload,
                seq,
                outbox.scope(),
                key,
                token,
                &m.ordering_key,
                headers.as_deref(),
            );
            write.query().execute(&mut *conn).await?;
        }
        Ok(())
    }

    async fn outbox_take<'p>(
        pool: &'p Pool<Self>,
        sql: &'p SqliteSql,
        limit: i64,
        lease_ms: i64,
        sent: &'p [&'p str],
        sent_hold: &'p str,
    ) -> Result<Taken, sqlx::Error> {
        type Row = (
            String,
            String,
            Vec<u8>,
            i64,
            i64,
            String,
            String,
            i64,
            String,
            Option<String>,
        );
        // `BEGIN IMMEDIATE`, as every writer here: the statement runs in a transaction of
        // its own, waiting for the write lock like a claim.
        let mut tx = begin(pool).await?;
        // The round before's marks, in this transaction (one commit for both): the take sees
        // them sent.
        if !sent.is_empty() {
            let sent = super::claim::json(sent);
            sql.outbox
                .sent(&sent, sent_hold)
                .query()
                .execute(&mut *tx)
                .await?;
        }
        let mut taken: Vec<Row> = sql
            .outbox
            .take(limit, lease_ms)
            .rows()
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        // `RETURNING` keeps no order: the order they were written in, as the take's.
        taken.sort_by(|a, b| (&a.6, a.7).cmp(&(&b.6, b.7)));
        let hold = taken.first().map(|r| r.8.clone()).unwrap_or_default();
        let messages = taken
            .into_iter()
            .map(
                |(id, destination, payload, seq, attempts, key, _, _, _, headers)| {
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
        sql: &'p SqliteSql,
        ids: &'p [&'p str],
        hold: &'p str,
    ) -> Result<u64, sqlx::Error> {
        let ids = super::claim::json(ids);
        let done = sql.outbox.sent(&ids, hold).query().execute(pool).await?;
        Ok(done.rows_affected())
    }

    async fn outbox_release<'p>(
        pool: &'p Pool<Self>,
        sql: &'p SqliteSql,
        ids: &'p [&'p str],
        hold: &'p str,
    ) -> Result<(), sqlx::Error> {
        let ids = super::claim::json(ids);
        sql.outbox.release(&ids, hold).query().execute(pool).await?;
        Ok(())
    }

    async fn outbox_failed<'p>(
        pool: &'p Pool<Self>,
        sql: &'p SqliteSql,
        id: &'p str,
        error: &'p str,
        retry_ms: i64,
        park: bool,
        hold: &'p str,
    ) -> Result<(), sqlx::Error> {
        let failed = sql.outbox.failed(id, error, retry_ms, park, hold);
        failed.query().execute(pool).await?;
        Ok(())
    }

    async fn outbox_forget<'p>(
        conn: &'p mut Self::Connection,
        sql: &'p SqliteSql,
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
        sql: &'p SqliteSql,
        age_ms: i64,
        limit: i64,
    ) -> Result<u64, sqlx::Error> {
        let done = sql
            .outbox
            .purge(age_ms, limit)
            .query()
            .execute(pool)
            .await?;
        Ok(done.rows_affected())
    }

    async fn outbox_list<'p>(
        pool: &'p Pool<Self>,
        sql: &'p SqliteSql,
        parked: bool,
        pending: bool,
        limit: i64,
    ) -> Result<Vec<OutboxRow>, sqlx::Error> {
        let list = sql.outbox.list(parked, pending, limit);
        list.rows().fetch_all(pool).await
    }

    async fn outbox_find<'p>(
        pool: &'p Pool<Self>,
        sql: &'p SqliteSql,
        id: &'p str,
    ) -> Result<Option<OutboxRow>, sqlx::Error> {
        sql.outbox.find(id).rows().fetch_optional(pool).await
    }

    async fn outbox_requeue<'p>(
        pool: &'p Pool<Self>,
        sql: &'p SqliteSql,
        id: &'p str,
    ) -> Result<bool, sqlx::Error> {
        let done = sql.outbox.requeue(id).query().execute(pool).await?;
        Ok(done.rows_affected() == 1)
    }

    async fn outbox_listen<'p>(
        _: &'p Pool<Self>,
        _: &'p SqliteSql,
    ) -> Result<Option<Listen>, sqlx::Error> {
        // SQLite announces no commits: the relay polls.
        Ok(None)
    }
}
