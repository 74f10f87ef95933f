//! The outbox on SQLite: one statement a message (they cost no round trip here), written only
//! while the claim's marker (or watermark) is there; writers are serialised, so the relay's
//! take needs no row locks.

use sqlx::{Pool, Sqlite};

use super::{NOW, begin};
use crate::backend::bind::statements;
use crate::backend::outbox::{self, OutboxText};
use crate::backend::{Sql, Taken};

/// The columns of the operators' statements (see `OutboxRow`).
const OUTBOX_COLUMNS: &str = "id, destination, scope, key, seq, attempts, last_error, \
    parked <> 0, sent_at IS NOT NULL, created_at, \
    CAST((julianday('now') - julianday(created_at)) * 86400000.0 AS INTEGER), \
    CAST((julianday(next_attempt_at) - julianday('now')) * 86400000.0 AS INTEGER), \
    COALESCE(ordering_key, key), headers";

/// `ms` milliseconds from now (`+`) or ago (`-`), as the outbox's times are written.
fn shifted(sign: char, ms: &str) -> String {
    format!("strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '{sign}' || ({ms} / 1000.0) || ' seconds')")
}

/// The statements every backend runs on its outbox.
pub(super) fn text() -> OutboxText {
    // A statement that rolls the transaction back (`INSERT OR ROLLBACK`, a full disk) ends it,
    // and later statements run in autocommit: a message is written only while the row holding
    // the claim's token is there (its marker; an offset claim's watermark).
    let write = |from: &str| {
        format!(
            "INSERT INTO {{t}}_outbox (id, destination, payload, scope, key, seq, ordering_key, \
             headers) SELECT :id, :destination, :payload, :scope, :key, :seq, :ordering_key, \
             :headers FROM {from} ON CONFLICT DO NOTHING"
        )
    };
    // Marks apply only to messages still unsent and under the round's hold (the time the take
    // wrote, one for the whole statement: SQLite reads 'now' once per statement).
    let held = "id IN (SELECT value FROM json_each(:ids)) AND sent_at IS NULL \
                AND next_attempt_at = :hold";
    let (parked_count, parked_matching) = outbox::parked(&outbox::ParkedWords {
        columns: OUTBOX_COLUMNS,
        null_destination: ":destination IS NULL",
        null_error: ":error IS NULL",
        null_age: ":age_ms IS NULL",
        contains: "instr(last_error, :error) > 0",
        ago: &shifted('-', ":age_ms"),
        count: "COUNT(*)",
        parked: "parked <> 0",
        order: "created_at, rowid",
    });
    OutboxText {
        parked_count: parked_count.into(),
        parked_matching: parked_matching.into(),
        failed: format!(
            "UPDATE {{t}}_outbox SET attempts = attempts + 1, last_error = :error, \
             next_attempt_at = {}, parked = :park \
             WHERE id = :id AND sent_at IS NULL AND next_attempt_at = :hold",
            shifted('+', ":retry_ms")
        )
        .into(),
        forget: outbox::forget("key").into(),
        purge: format!(
            "DELETE FROM {{t}}_outbox WHERE id IN (SELECT id FROM {{t}}_outbox \
             WHERE sent_at < {} LIMIT :limit)",
            shifted('-', ":age_ms")
        )
        .into(),
        list: format!(
            "SELECT {OUTBOX_COLUMNS} FROM {{t}}_outbox WHERE sent_at IS NULL \
             AND ((parked <> 0 AND :parked) OR (parked = 0 AND :pending)) \
             ORDER BY parked DESC, created_at, rowid LIMIT :limit"
        )
        .into(),
        find: outbox::find(OUTBOX_COLUMNS).into(),
        requeue: format!(
            "UPDATE {{t}}_outbox SET parked = 0, attempts = 0, next_attempt_at = {NOW} \
             WHERE id = :id AND parked <> 0 AND sent_at IS NULL"
        )
        .into(),
        write: Some(
            write("{t} AS m WHERE m.scope = :scope AND m.key = :key AND m.token = :token").into(),
        ),
        write_watermark: Some(write(outbox::WATERMARK_HELD).into()),
        sent: Some(format!("UPDATE {{t}}_outbox SET sent_at = {NOW} WHERE {held}").into()),
        // Lets go of messages of the round that it did not try, since an earlier message of
        // their key failed: they wait for it, not for the round's hold.
        release: Some(
            format!("UPDATE {{t}}_outbox SET next_attempt_at = {NOW} WHERE {held}").into(),
        ),
        // SQLite announces no commits: the relays poll.
        notify: None,
        announce: None,
    }
}

statements! {
    /// The relay's take.
    pub(super) struct Statements {
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
             ORDER BY o.created_at, o.rowid LIMIT :limit), \
             picked AS (SELECT c.r FROM (\
             SELECT f.rowid AS r, f.created_at AS at, row_number() OVER (PARTITION BY \
             f.ordering_key ORDER BY f.created_at, f.rowid) AS wave FROM {t}_outbox f \
             WHERE f.sent_at IS NULL AND f.ordering_key IN (SELECT k FROM heads) \
             UNION ALL SELECT h.r, f.created_at, 1 FROM heads h JOIN {t}_outbox f \
             ON f.rowid = h.r WHERE h.k IS NULL) c ORDER BY c.wave, c.at, c.r LIMIT :limit) \
             UPDATE {t}_outbox SET next_attempt_at = \
             strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '+' || (:lease_ms / 1000.0) || ' seconds') \
             WHERE rowid IN (SELECT r FROM picked) \
             RETURNING id, destination, payload, seq, attempts, COALESCE(ordering_key, key), \
             created_at, rowid, next_attempt_at, headers";
    }
}

/// `Backend::outbox_take`: `BEGIN IMMEDIATE`, as every writer here (the take waits for the
/// write lock like a claim), the round before's marks, then the take: one commit for both.
pub(super) async fn take(
    pool: &Pool<Sqlite>,
    sql: &Sql<Sqlite>,
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
        String,
        i64,
        String,
        Option<String>,
    );
    let mut tx = begin(pool).await?;
    if !sent.is_empty() {
        let marks = sql.outbox.sent(crate::backend::bind::Keys(sent), sent_hold);
        marks
            .expect("SQLite marks a list")
            .execute(&mut *tx)
            .await?;
    }
    let take = sql.own.outbox.take(limit, lease_ms);
    let mut taken: Vec<Row> = take.fetch_all(&mut *tx).await?;
    tx.commit().await?;
    // `RETURNING` keeps no order: the order they were written in, as the take's.
    taken.sort_by(|a, b| (&a.6, a.7).cmp(&(&b.6, b.7)));
    let hold = taken.first().map(|r| r.8.clone()).unwrap_or_default();
    let rows = taken
        .into_iter()
        .map(|(id, to, payload, seq, attempts, key, _, _, _, headers)| {
            (id, to, payload, seq, attempts, key, headers)
        });
    Ok(Taken::new(hold, rows))
}
