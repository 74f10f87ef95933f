//! The outbox on MySQL and MariaDB: one statement a message (MySQL has no array to bind),
//! written only while the claim's marker is there, and the relay's take with `SKIP LOCKED`.

use sqlx::{AssertSqlSafe, MySql, Pool, Row as _};

use super::MySqlSql;
use super::batch::hex_bytes;
use crate::backend::sealed::Outboxes;
use crate::backend::sql::statements;
use crate::backend::{Listen, OutboxRow, Taken, rows};
use crate::outgoing::Pending;

/// The columns of the operators' statements (see `OutboxRow`).
const OUTBOX_COLUMNS: &str = "CONVERT(id USING utf8mb4), CONVERT(destination USING utf8mb4), \
    CONVERT(scope USING utf8mb4), CONVERT(`key` USING utf8mb4), CAST(seq AS SIGNED), \
    CAST(attempts AS SIGNED), last_error, CAST(parked AS SIGNED), \
    CAST(sent_at IS NOT NULL AS SIGNED), DATE_FORMAT(created_at, '%Y-%m-%dT%H:%i:%s.%fZ'), \
    CAST(TIMESTAMPDIFF(MICROSECOND, created_at, UTC_TIMESTAMP(6)) DIV 1000 AS SIGNED), \
    CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), next_attempt_at) DIV 1000 AS SIGNED), \
    CONVERT(COALESCE(ordering_key, `key`) USING utf8mb4), CONVERT(headers USING utf8mb4)";

statements! {
    /// The outbox table's statements (`{t}_outbox`).
    pub(super) struct OutboxSql<MySql> {
        // A deadlock in the body rolls the transaction back and later statements run in
        // autocommit: a message is written only while the marker holding the claim's token
        // (its nonce, or a lease's token) is there, which it is only inside the claim's
        // transaction. Times are UTC, written by the statements (as the markers' are).
        write(id: &str, destination: &str, payload: &[u8], seq: i64, ordering_key: &str, headers: Option<&str>, scope: &str, key: &str, token: i64) =
            "INSERT INTO {t}_outbox (id, destination, payload, scope, `key`, seq, ordering_key, \
             headers, created_at, next_attempt_at) SELECT ?, ?, ?, m.scope, m.`key`, ?, ?, ?, \
             UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) FROM {t} AS m \
             WHERE m.scope = ? AND m.`key` = ? AND m.token = ? \
             ON DUPLICATE KEY UPDATE id = id";
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
             ORDER BY o.created_at, o.seq, o.id LIMIT ? FOR UPDATE SKIP LOCKED";
        // Only while the message is unsent and under the round's hold (a round's sent marks
        // are one statement, written per round: `outbox_sent`).
        failed(error: &str, retry_ms: i64, park: bool, id: &str, hold: &str) =
            "UPDATE {t}_outbox SET attempts = attempts + 1, last_error = ?, \
             next_attempt_at = UTC_TIMESTAMP(6) + INTERVAL (? * 1000) MICROSECOND, parked = ? \
             WHERE id = ? AND sent_at IS NULL AND CAST(next_attempt_at AS CHAR) = ?";
        forget(scope: &str, key: &str) =
            "DELETE FROM {t}_outbox WHERE scope = ? AND `key` = ? AND sent_at IS NULL";
        purge(age_ms: i64, limit: i64) =
            "DELETE FROM {t}_outbox WHERE sent_at < UTC_TIMESTAMP(6) - INTERVAL (? * 1000) \
             MICROSECOND ORDER BY sent_at LIMIT ?";
        list(parked: bool, pending: bool, limit: i64) = format!(
            "SELECT {OUTBOX_COLUMNS} FROM {{t}}_outbox WHERE sent_at IS NULL \
             AND ((parked AND ?) OR (NOT parked AND ?)) \
             ORDER BY parked DESC, created_at, seq LIMIT ?"
        );
        find(id: &str) = format!("SELECT {OUTBOX_COLUMNS} FROM {{t}}_outbox WHERE id = ?");
        requeue(id: &str) =
            "UPDATE {t}_outbox SET parked = FALSE, attempts = 0, \
             next_attempt_at = UTC_TIMESTAMP(6) WHERE id = ? AND parked AND sent_at IS NULL";
    }
}

impl Outboxes for MySql {
    async fn outbox_write<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t MySqlSql,
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
                &m.ordering_key,
                headers.as_deref(),
                outbox.scope(),
                key,
                token,
            );
            write.query().execute(&mut *conn).await?;
        }
        Ok(())
    }

    async fn outbox_take<'p>(
        pool: &'p Pool<Self>,
        sql: &'p MySqlSql,
        limit: i64,
        lease_ms: i64,
        sent: &'p [&'p str],
        sent_hold: &'p str,
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
            sql.outbox.heads(limit).rows().fetch_all(&mut *tx).await?;
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
        let mut hold = String::new();
        let mut messages = Vec::with_capacity(rows.len());
        for row in rows {
            hold = row.try_get(6)?;
            messages.push(rows::message(
                text(row.try_get(0)?)?,
                text(row.try_get(1)?)?,
                row.try_get(2)?,
                row.try_get::<i32, _>(3)?,
                row.try_get::<i32, _>(4)?,
                text(row.try_get(5)?)?,
                row.try_get::<Option<Vec<u8>>, _>(7)?
                    .map(text)
                    .transpose()?
                    .as_deref(),
            ));
        }
        Ok(Taken { messages, hold })
    }

    async fn outbox_sent<'p>(
        pool: &'p Pool<Self>,
        sql: &'p MySqlSql,
        ids: &'p [&'p str],
        hold: &'p str,
    ) -> Result<u64, sqlx::Error> {
        let sent = sent_marks(sql, ids, hold);
        let done = sqlx::raw_sql(AssertSqlSafe(sent)).execute(pool).await?;
        Ok(done.rows_affected())
    }

    async fn outbox_release<'p>(
        pool: &'p Pool<Self>,
        sql: &'p MySqlSql,
        ids: &'p [&'p str],
        hold: &'p str,
    ) -> Result<(), sqlx::Error> {
        let release = format!(
            "UPDATE {}_outbox SET next_attempt_at = UTC_TIMESTAMP(6) WHERE {}",
            sql.table.as_str(),
            still_held(ids, hold)
        );
        sqlx::raw_sql(AssertSqlSafe(release)).execute(pool).await?;
        Ok(())
    }

    async fn outbox_failed<'p>(
        pool: &'p Pool<Self>,
        sql: &'p MySqlSql,
        id: &'p str,
        error: &'p str,
        retry_ms: i64,
        park: bool,
        hold: &'p str,
    ) -> Result<(), sqlx::Error> {
        let failed = sql.outbox.failed(error, retry_ms, park, id, hold);
        failed.query().execute(pool).await?;
        Ok(())
    }

    async fn outbox_forget<'p>(
        conn: &'p mut Self::Connection,
        sql: &'p MySqlSql,
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
        sql: &'p MySqlSql,
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
        sql: &'p MySqlSql,
        parked: bool,
        pending: bool,
        limit: i64,
    ) -> Result<Vec<OutboxRow>, sqlx::Error> {
        let list = sql.outbox.list(parked, pending, limit);
        list.rows().fetch_all(pool).await
    }

    async fn outbox_find<'p>(
        pool: &'p Pool<Self>,
        sql: &'p MySqlSql,
        id: &'p str,
    ) -> Result<Option<OutboxRow>, sqlx::Error> {
        sql.outbox.find(id).rows().fetch_optional(pool).await
    }

    async fn outbox_requeue<'p>(
        pool: &'p Pool<Self>,
        sql: &'p MySqlSql,
        id: &'p str,
    ) -> Result<bool, sqlx::Error> {
        let done = sql.outbox.requeue(id).query().execute(pool).await?;
        Ok(done.rows_affected() == 1)
    }

    async fn outbox_listen<'p>(
        _: &'p Pool<Self>,
        _: &'p MySqlSql,
    ) -> Result<Option<Listen>, sqlx::Error> {
        // MySQL announces no commits: the relay polls.
        Ok(None)
    }
}

/// The sent marks of `ids` under `hold`.
fn sent_marks(sql: &MySqlSql, ids: &[&str], hold: &str) -> String {
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
