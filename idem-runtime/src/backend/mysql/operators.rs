//! What operators do with the markers on MySQL and MariaDB (migrate, forget, inspect, purge,
//! each scope's retention), the offset watermarks' statements, and what the doctor reads.

use sqlx::{MySql, Pool};

use super::LEASE_OVER;
use crate::backend::Sql;
use crate::backend::health::{HealthText, counts};
use crate::backend::offsets::{FORGET, OffsetText, PARTITION, READ};
use crate::backend::operators::{OperatorText, Words};

/// The columns of `Store::inspect`: times as ISO-8601 UTC text (idem writes them in UTC), and
/// the lease's time left on the database's clock.
const MARKER_COLUMNS: &str = "CONVERT(scope USING utf8mb4), CONVERT(`key` USING utf8mb4), state, \
    CAST(attempts AS SIGNED), token, \
    DATE_FORMAT(created_at, '%Y-%m-%dT%H:%i:%s.%fZ'), \
    DATE_FORMAT(completed_at, '%Y-%m-%dT%H:%i:%s.%fZ'), \
    DATE_FORMAT(locked_until, '%Y-%m-%dT%H:%i:%s.%fZ'), \
    CAST(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), locked_until) DIV 1000 AS SIGNED), error";

/// `:age_ms` milliseconds ago, on the server's clock.
const AGO: &str = "UTC_TIMESTAMP(6) - INTERVAL (:age_ms * 1000) MICROSECOND";

/// The operators' statements. A purge reads its cutoff once, then deletes a batch's steps and
/// its markers, oldest first through the index on (state, completed_at), chosen again from
/// that cutoff in one order.
pub(super) fn text() -> OperatorText {
    let words = Words {
        key: "`key`",
        columns: MARKER_COLUMNS,
        lease_over: LEASE_OVER,
        lease_over_int: LEASE_OVER,
        null: ":scope IS NULL",
        null_error: ":error IS NULL",
        null_age: ":age_ms IS NULL",
        ago: AGO,
        now: "UTC_TIMESTAMP(6)",
        count: "CAST(COUNT(*) AS SIGNED)",
        time: |c| format!("DATE_FORMAT({c}, '%Y-%m-%dT%H:%i:%s.%fZ')"),
        bucket: |c| {
            format!(
                "CAST(FLOOR(TIMESTAMPDIFF(SECOND, '1970-01-01 00:00:00', {c}) / :bucket_s) AS SIGNED)"
            )
        },
        update_limit: true,
    };
    let retention_set = "INSERT INTO {t}_retention (scope, keep_ms, updated_at) \
                         VALUES (:scope, :keep_ms, UTC_TIMESTAMP(6)) \
                         ON DUPLICATE KEY UPDATE keep_ms = VALUES(keep_ms), \
                         updated_at = VALUES(updated_at)";
    let steps_of = |batch: &str| {
        format!(
            "DELETE s FROM {{t}}_steps AS s JOIN (SELECT scope, `key` FROM {{t}} \
             WHERE {batch}) AS b ON s.scope = b.scope AND s.`key` = b.`key`"
        )
    };
    // Scopes with a retention window of their own are purged by it.
    let unwindowed = "state = 'completed' AND completed_at < :cutoff \
                      AND scope NOT IN (SELECT scope FROM {t}_retention) \
                      ORDER BY completed_at, scope, `key` LIMIT :limit";
    let scoped = "scope = :scope AND state = 'completed' AND completed_at < :cutoff \
                  ORDER BY completed_at, `key` LIMIT :limit";
    OperatorText {
        // MySQL 8 has no `ADD COLUMN IF NOT EXISTS` (MariaDB has), nor `CREATE INDEX IF NOT
        // EXISTS`: the catalog is asked first.
        has_column: Some(
            "SELECT COUNT(*) FROM information_schema.columns WHERE table_schema = DATABASE() \
             AND table_name = :table AND column_name = :name"
                .into(),
        ),
        has_index: Some(
            "SELECT COUNT(*) FROM information_schema.statistics \
             WHERE table_schema = DATABASE() AND table_name = :table AND index_name = :name"
                .into(),
        ),
        cutoff: Some(format!("SELECT DATE_FORMAT({AGO}, '%Y-%m-%d %H:%i:%s.%f')").into()),
        purge_steps: Some(steps_of(unwindowed).into()),
        purge_cut: Some(format!("DELETE FROM {{t}} WHERE {unwindowed}").into()),
        purge_scope_steps: Some(steps_of(scoped).into()),
        purge_scope_cut: Some(format!("DELETE FROM {{t}} WHERE {scoped}").into()),
        ..OperatorText::of(words, retention_set.into())
    }
}

/// The watermarks' statements: moved by one `UPDATE` on the fresh path, read `FOR UPDATE` only
/// when a claim meets offsets processed already; a first watermark is a plain `INSERT`, whose
/// duplicate-key error says another claim wrote it first. Times are UTC, as the markers'.
pub(super) fn offsets() -> OffsetText {
    OffsetText {
        advance: format!(
            "UPDATE {{t}}_offsets SET next_offset = :next, token = :nonce, \
             updated_at = UTC_TIMESTAMP(6) WHERE {PARTITION} AND next_offset <= :first"
        )
        .into(),
        lock: format!("SELECT next_offset FROM {{t}}_offsets WHERE {PARTITION} FOR UPDATE").into(),
        insert: "INSERT INTO {t}_offsets (consumer_group, topic, partition_id, next_offset, \
                 token, updated_at) VALUES (:group, :topic, :partition, :next, :nonce, \
                 UTC_TIMESTAMP(6))"
            .into(),
        read: READ.into(),
        set: "INSERT INTO {t}_offsets (consumer_group, topic, partition_id, next_offset, \
              updated_at) VALUES (:group, :topic, :partition, :next, UTC_TIMESTAMP(6)) \
              ON DUPLICATE KEY UPDATE next_offset = VALUES(next_offset), token = NULL, \
              updated_at = UTC_TIMESTAMP(6)"
            .into(),
        forget: FORGET.into(),
    }
}

/// The doctor's reads.
pub(super) fn health() -> HealthText {
    // Named like the marker table, or with its name and `_` as prefix.
    let ours = "(TABLE_NAME = :name OR LEFT(TABLE_NAME, CHAR_LENGTH(:name) + 1) = \
                CONCAT(:name, '_'))";
    let [old_in_scope, old, stuck] = counts("CAST(COUNT(*) AS SIGNED)", AGO);
    HealthText {
        tables: format!(
            "SELECT CAST(TABLE_NAME AS CHAR) FROM information_schema.TABLES \
             WHERE TABLE_SCHEMA = DATABASE() AND {ours}"
        )
        .into(),
        indexes: format!(
            "SELECT DISTINCT CAST(TABLE_NAME AS CHAR), CAST(INDEX_NAME AS CHAR) \
             FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = DATABASE() AND {ours}"
        )
        .into(),
        columns: format!(
            "SELECT CAST(TABLE_NAME AS CHAR), CAST(COLUMN_NAME AS CHAR) \
             FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() AND {ours}"
        )
        .into(),
        marker_tables: "SELECT CAST(TABLE_NAME AS CHAR) FROM information_schema.COLUMNS \
                        WHERE TABLE_SCHEMA = DATABASE() AND COLUMN_NAME IN ('scope', 'key', \
                        'state', 'token', 'locked_until', 'attempts', 'completed_at') \
                        GROUP BY TABLE_NAME HAVING COUNT(*) = 7 ORDER BY TABLE_NAME"
            .into(),
        old_in_scope,
        old,
        stuck,
        outbox: format!(
            "SELECT CAST(COALESCE(SUM(parked), 0) AS SIGNED), \
             CAST(COALESCE(SUM(NOT parked AND next_attempt_at < {AGO}), 0) AS SIGNED) \
             FROM {{t}}_outbox WHERE sent_at IS NULL"
        )
        .into(),
        bloat: "SELECT CAST(DATA_FREE AS SIGNED), CAST(DATA_LENGTH + INDEX_LENGTH AS SIGNED), \
                'bytes' FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() \
                AND TABLE_NAME = :name"
            .into(),
        clock: Some(
            "SELECT CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) \
             DIV 1000 AS SIGNED)"
                .into(),
        ),
        max_connections: Some("SELECT CAST(@@max_connections AS SIGNED)".into()),
        server_port: None,
        slots: None,
    }
}

/// `Backend::migrate`.
pub(super) async fn migrate(pool: &Pool<MySql>, sql: &Sql<MySql>) -> Result<(), sqlx::Error> {
    // DDL commits implicitly in MySQL, so a named lock is what makes concurrent workers
    // take turns. The lock belongs to the session: the connection is detached from the
    // pool, so that a cancelled migration closes it (and the server frees the lock)
    // instead of returning it to the pool still holding the lock.
    let mut conn = pool.acquire().await?.detach();
    // MySQL 5.7+ refuses lock names over 64 characters; two long names that share a
    // prefix then share a lock, which only makes them take turns.
    let mut lock = format!("idem.migrate.{}", sql.table.as_str());
    lock.truncate(64);
    let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 60)")
        .bind(&lock)
        .fetch_one(&mut conn)
        .await?;
    if got != Some(1) {
        return Err(sqlx::Error::Protocol(format!(
            "GET_LOCK({lock:?}, 60) answered {got:?}: another migration of the table held \
             the lock for 60 s; try again"
        )));
    }
    let result = crate::backend::upgrade::run(&mut conn, sql).await;
    // The DDL's own error, if any, is the one worth reporting.
    let released = sqlx::query("SELECT RELEASE_LOCK(?)")
        .bind(&lock)
        .execute(&mut conn)
        .await;
    result?;
    released?;
    sqlx::Connection::close(conn).await
}
