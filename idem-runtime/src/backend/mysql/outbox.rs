//! The outbox on MySQL and MariaDB: one statement a message (MySQL has no array to bind),
//! written only while the claim's marker (or watermark) is there, and the relay's take with
//! `SKIP LOCKED`; a round's ids travel as hex literals in statements written per round.

use sqlx::{AssertSqlSafe, MySql, Pool, Row as _};

use super::batch::hex_bytes;
use crate::backend::bind::statements;
use crate::backend::outbox::{self, OutboxText};
use crate::backend::{Sql, Taken};

/// The columns of the operators' statements (see `OutboxRow`).
const OUTBOX_COLUMNS: &str = "CONVERT(id USING utf8mb4), CONVERT(destination USING utf8mb4), \
    CONVERT(scope USING utf8mb4), CONVERT(`key` USING utf8mb4), CAST(seq AS SIGNED), \
    CAST(attempts AS SIGNED), last_error, CAST(parked AS SIGNED), \
    CAST(sent_at IS NOT NULL AS SIGNED), DATE_FORMAT(created_at, '%Y-%m-%dT%H:%i:%s.%fZ'), \
    CAST(TIMESTAMPDIFF(MICROSECOND, created_at, UTC_TIMESTAMP(6)) DIV 1000 AS SIGNED), \
    CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), next_attempt_at) DIV 1000 AS SIGNED), \
    CONVERT(COALESCE(ordering_key, `key`) USING utf8mb4), CONVERT(headers USING utf8mb4)";

/// The statements every backend runs on its outbox.
pub(super) fn text() -> OutboxText {
    // A deadlock in the body rolls the transaction back and later statements run in
    // autocommit: a message is written only while the row holding the claim's token is there
    // (its marker; an offset claim's watermark), which it is only inside the claim's
    // transaction. Times are UTC, written by the statements (as the markers' are).
    let write = |from: &str| {
        format!(
            "INSERT INTO {{t}}_outbox (id, destination, payload, scope, `key`, seq, \
             ordering_key, headers, created_at, next_attempt_at) SELECT :id, :destination, \
             :payload, :scope, :key, :seq, :ordering_key, :headers, UTC_TIMESTAMP(6), \
             UTC_TIMESTAMP(6) FROM {from} ON DUPLICATE KEY UPDATE id = id"
        )
    };
    // The error's text is matched byte for byte, as on the other backends (not as the
    // column's collation compares).
    let (parked_count, parked_matching) = outbox::parked(&outbox::ParkedWords {
        columns: OUTBOX_COLUMNS,
        null_destination: ":destination IS NULL",
        null_error: ":error IS NULL",
        null_age: ":age_ms IS NULL",
        contains: "LOCATE(CAST(:error AS BINARY), CAST(last_error AS BINARY)) > 0",
        ago: "UTC_TIMESTAMP(6) - INTERVAL (:age_ms * 1000) MICROSECOND",
        count: "CAST(COUNT(*) AS SIGNED)",
        parked: "parked",
        order: "created_at, seq, id",
    });
    OutboxText {
        parked_count: parked_count.into(),
        parked_matching: parked_matching.into(),
        // Only while the message is unsent and under the round's hold (a round's sent marks
        // are one statement, written per round: `sent`).
        failed: "UPDATE {t}_outbox SET attempts = attempts + 1, last_error = :error, \
                 next_attempt_at = UTC_TIMESTAMP(6) + INTERVAL (:retry_ms * 1000) MICROSECOND, \
                 parked = :park WHERE id = :id AND sent_at IS NULL \
                 AND CAST(next_attempt_at AS CHAR) = :hold"
            .into(),
        forget: outbox::forget("`key`").into(),
        purge: "DELETE FROM {t}_outbox WHERE sent_at < UTC_TIMESTAMP(6) \
                - INTERVAL (:age_ms * 1000) MICROSECOND ORDER BY sent_at LIMIT :limit"
            .into(),
        list: outbox::list(OUTBOX_COLUMNS).into(),
        find: outbox::find(OUTBOX_COLUMNS).into(),
        requeue: "UPDATE {t}_outbox SET parked = FALSE, attempts = 0, \
                  next_attempt_at = UTC_TIMESTAMP(6) WHERE id = :id AND parked \
                  AND sent_at IS NULL"
            .into(),
        write: Some(
            write("{t} AS m WHERE m.scope = :scope AND m.`key` = :key AND m.token = :token").into(),
        ),
        write_watermark: Some(write(outbox::WATERMARK_HELD).into()),
        sent: None,
        release: None,
        // MySQL announces no commits: the relays poll.
        notify: None,
        announce: None,
    }
}

statements! {
    /// The relay's take.
    pub(super) struct Statements {
        // The keys whose earliest unsent message is due and that no other message of theirs
        // holds back (held by a round, backing off, parked): those earliest messages, locked
        // with `SKIP LOCKED` (MariaDB 10.6, MySQL 8), so that two takes never get one key.
        // The subquery reads without locks. A message written before ordering keys (NULL) is
        // a key of its own.
        heads(limit: i64) =
            "SELECT o.id, o.ordering_key FROM {t}_outbox o WHERE o.sent_at IS NULL \
             AND o.parked = FALSE AND o.next_attempt_at <= UTC_TIMESTAMP(6) \
             AND NOT EXISTS (SELECT 1 FROM {t}_outbox e WHERE e.ordering_key = o.ordering_key \
             AND e.sent_at IS NULL AND e.id <> o.id AND (e.parked \
             OR e.next_attempt_at > UTC_TIMESTAMP(6) \
             OR (e.created_at, e.seq, e.id) < (o.created_at, o.seq, o.id))) \
             ORDER BY o.created_at, o.seq, o.id LIMIT :limit FOR UPDATE SKIP LOCKED";
    }
}

/// `Backend::outbox_take`: the round before's marks, the heads of the keys to take (locked
/// with `SKIP LOCKED`), their messages, and the hold, in one transaction.
pub(super) async fn take(
    pool: &Pool<MySql>,
    sql: &Sql<MySql>,
    limit: i64,
    lease_ms: i64,
    sent: &[&str],
    sent_hold: &str,
) -> Result<Taken, sqlx::Error> {
    // READ COMMITTED: the take's locking read keeps no lock on the rows it read and did
    // not take (REPEATABLE READ would keep them, and two takes' holds could then wait on
    // each other). It applies to this transaction only.
    let mut conn = pool.acquire().await?;
    sqlx::raw_sql("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
        .execute(&mut *conn)
        .await?;
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    // The round before's marks, in this transaction (one commit for both): the take's
    // reads see them sent.
    if !sent.is_empty() {
        sqlx::raw_sql(AssertSqlSafe(sent_marks(sql, sent, sent_hold)))
            .execute(&mut *tx)
            .await?;
    }
    let heads: Vec<(Vec<u8>, Option<Vec<u8>>)> =
        sql.own.outbox.heads(limit).fetch_all(&mut *tx).await?;
    if heads.is_empty() {
        tx.commit().await?;
        return Ok(Taken::default());
    }
    let table = sql.table.as_str();
    // Each taken key's unsent messages, a wave at a time (every key's first, then every
    // key's second...) up to the limit, so that the ones left out are a key's last.
    // MySQL binds no array: keys and ids travel as hex literals.
    let mut of = Vec::new();
    let keys: Vec<String> = heads
        .iter()
        .filter_map(|h| h.1.as_deref())
        .map(hex_bytes)
        .collect();
    if !keys.is_empty() {
        of.push(format!("f.ordering_key IN ({})", keys.join(",")));
    }
    let lone: Vec<String> = heads
        .iter()
        .filter(|h| h.1.is_none())
        .map(|h| hex_bytes(&h.0))
        .collect();
    if !lone.is_empty() {
        of.push(format!("f.id IN ({})", lone.join(",")));
    }
    let picked = format!(
        "SELECT c.id FROM (SELECT f.id, f.created_at, f.seq, ROW_NUMBER() OVER \
         (PARTITION BY COALESCE(f.ordering_key, f.id) ORDER BY f.created_at, f.seq, f.id) \
         AS wave FROM {table}_outbox f WHERE f.sent_at IS NULL AND ({})) c \
         ORDER BY c.wave, c.created_at, c.seq, c.id LIMIT {limit}",
        of.join(" OR ")
    );
    let picked = sqlx::raw_sql(AssertSqlSafe(picked))
        .fetch_all(&mut *tx)
        .await?;
    let ids = picked
        .iter()
        .map(|r| r.try_get::<Vec<u8>, _>(0).map(|id| hex_bytes(&id)))
        .collect::<Result<Vec<_>, _>>()?
        .join(",");
    // `UTC_TIMESTAMP` is the statement's: one instant for every message it holds, read
    // back as the round's hold.
    let held = format!(
        "UPDATE {table}_outbox SET next_attempt_at = UTC_TIMESTAMP(6) + INTERVAL {} \
         MICROSECOND WHERE id IN ({ids}); \
         SELECT id, destination, payload, seq, attempts, COALESCE(ordering_key, `key`), \
         CAST(next_attempt_at AS CHAR), headers FROM {table}_outbox WHERE id IN ({ids}) \
         ORDER BY created_at, seq, id",
        lease_ms.saturating_mul(1000),
    );
    let rows = sqlx::raw_sql(AssertSqlSafe(held))
        .fetch_all(&mut *tx)
        .await?;
    tx.commit().await?;
    let text = |b: Vec<u8>| String::from_utf8(b).map_err(|e| sqlx::Error::Decode(Box::new(e)));
    let hold = match rows.first() {
        Some(row) => row.try_get(6)?,
        None => String::new(),
    };
    let rows = rows
        .iter()
        .map(|row| {
            Ok((
                text(row.try_get(0)?)?,
                text(row.try_get(1)?)?,
                row.try_get(2)?,
                row.try_get::<i32, _>(3)?.into(),
                row.try_get::<i32, _>(4)?.into(),
                text(row.try_get(5)?)?,
                row.try_get::<Option<Vec<u8>>, _>(7)?
                    .map(text)
                    .transpose()?,
            ))
        })
        .collect::<Result<Vec<_>, sqlx::Error>>()?;
    Ok(Taken::new(hold, rows))
}

/// `Backend::outbox_sent`: one statement written for the round.
pub(super) async fn sent(
    pool: &Pool<MySql>,
    sql: &Sql<MySql>,
    ids: &[&str],
    hold: &str,
) -> Result<u64, sqlx::Error> {
    let sent = sent_marks(sql, ids, hold);
    let done = sqlx::raw_sql(AssertSqlSafe(sent)).execute(pool).await?;
    Ok(done.rows_affected())
}

/// `Backend::outbox_release`: one statement written for the round.
pub(super) async fn release(
    pool: &Pool<MySql>,
    sql: &Sql<MySql>,
    ids: &[&str],
    hold: &str,
) -> Result<(), sqlx::Error> {
    let release = format!(
        "UPDATE {}_outbox SET next_attempt_at = UTC_TIMESTAMP(6) WHERE {}",
        sql.table.as_str(),
        still_held(ids, hold)
    );
    sqlx::raw_sql(AssertSqlSafe(release)).execute(pool).await?;
    Ok(())
}

/// The sent marks of `ids` under `hold`.
fn sent_marks(sql: &Sql<MySql>, ids: &[&str], hold: &str) -> String {
    format!(
        "UPDATE {}_outbox SET sent_at = UTC_TIMESTAMP(6) WHERE {}",
        sql.table.as_str(),
        still_held(ids, hold)
    )
}

/// The rows of `ids` that are unsent and still under the round's `hold`: what a round's mark
/// or release may touch. MySQL binds no array, so the ids travel as hex literals in one
/// statement.
fn still_held(ids: &[&str], hold: &str) -> String {
    let ids: Vec<String> = ids.iter().map(|id| hex_bytes(id.as_bytes())).collect();
    format!(
        "id IN ({}) AND sent_at IS NULL \
         AND CAST(next_attempt_at AS CHAR) = CONVERT({} USING utf8mb4)",
        ids.join(","),
        hex_bytes(hold.as_bytes())
    )
}
