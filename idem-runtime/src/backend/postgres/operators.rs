//! What operators do with the markers on PostgreSQL (migrate, forget, inspect, purge, each
//! scope's retention), the offset watermarks' statements, and what the doctor reads.

use sqlx::{Pool, Postgres};

use super::LEASE_OVER;
use crate::backend::Sql;
use crate::backend::health::{HealthText, counts};
use crate::backend::offsets::{INSERT_OR_SKIP, OffsetText, PARTITION, READ};
use crate::backend::operators::{OperatorText, Words};

/// The columns of `Store::inspect`: times as ISO-8601 UTC text, and the lease's time left on the
/// database's clock.
const MARKER_COLUMNS: &str = "scope, key, state, attempts::bigint, token, \
    to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), \
    to_char(completed_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), \
    to_char(locked_until AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), \
    (EXTRACT(EPOCH FROM (locked_until - now())) * 1000)::bigint, error";

/// A purge batch of completed markers (`{where}`: which), and their steps in the same
/// statement (a data-modifying `WITH` runs whatever reads it). Selecting the batch by ctid
/// makes each batch a TID scan; an `IN (SELECT scope, key ...)` ran as a hash join over the
/// whole table, every batch. A ctid names a row only within its partition (a partitioned
/// table, `Store::partitions`), so the batch's `tableoid` must match too.
fn purge(which: &str) -> String {
    format!(
        "WITH batch AS MATERIALIZED (SELECT tableoid, ctid, scope, key FROM {{t}} \
         WHERE {which} AND state = 'completed' \
         AND completed_at < now() - :age_ms * interval '1 millisecond' LIMIT :limit), \
         steps AS (DELETE FROM {{t}}_steps AS s USING batch AS b \
         WHERE s.scope = b.scope AND s.key = b.key) \
         DELETE FROM {{t}} WHERE ctid = ANY (ARRAY(SELECT ctid FROM batch)) \
         AND (tableoid, ctid) IN (SELECT tableoid, ctid FROM batch)"
    )
}

/// The operators' statements.
pub(super) fn text() -> OperatorText {
    let words = Words {
        key: "key",
        columns: MARKER_COLUMNS,
        lease_over: LEASE_OVER,
        lease_over_int: &format!("{LEASE_OVER}::int::int8"),
        null: ":scope::text IS NULL",
        null_error: ":error::text IS NULL",
        null_age: ":age_ms::int8 IS NULL",
        ago: "now() - :age_ms * interval '1 millisecond'",
        now: "now()",
        count: "COUNT(*)",
        time: |c| format!("to_char({c} AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')"),
        bucket: |c| format!("(floor(extract(epoch FROM {c}) / :bucket_s))::int8"),
        update_limit: false,
    };
    let retention_set = "INSERT INTO {t}_retention (scope, keep_ms) VALUES (:scope, :keep_ms) \
                         ON CONFLICT (scope) DO UPDATE SET keep_ms = EXCLUDED.keep_ms, \
                         updated_at = now()";
    OperatorText {
        // `ADD COLUMN IF NOT EXISTS` skips what exists: no catalog to ask (no `has_column`).
        // Scopes with a retention window of their own are purged by it.
        purge: Some(purge("scope NOT IN (SELECT scope FROM {t}_retention)").into()),
        purge_scope: Some(purge("scope = :scope").into()),
        ..OperatorText::of(words, retention_set.into())
    }
}

/// The watermarks' statements: moved by one `UPDATE` on the fresh path, read `FOR UPDATE` only
/// when a claim meets offsets processed already.
pub(super) fn offsets() -> OffsetText {
    OffsetText {
        advance: format!(
            "UPDATE {{t}}_offsets SET next_offset = :next, token = :nonce, updated_at = now() \
             WHERE {PARTITION} AND next_offset <= :first"
        )
        .into(),
        lock: format!("SELECT next_offset FROM {{t}}_offsets WHERE {PARTITION} FOR UPDATE").into(),
        insert: INSERT_OR_SKIP.into(),
        read: READ.into(),
        set: "INSERT INTO {t}_offsets (consumer_group, topic, partition_id, next_offset) \
              VALUES (:group, :topic, :partition, :next) \
              ON CONFLICT (consumer_group, topic, partition_id) \
              DO UPDATE SET next_offset = EXCLUDED.next_offset, token = NULL, updated_at = now()"
            .into(),
        forget: "DELETE FROM {t}_offsets WHERE consumer_group = :group \
                 AND (:topic::text IS NULL OR topic = :topic)"
            .into(),
    }
}

/// The doctor's reads.
pub(super) fn health() -> HealthText {
    // Named like the marker table, or with its name and `_` as prefix.
    let ours = |column: &str| {
        format!(
            "({column} = lower(:name) OR left({column}, length(:name) + 1) = lower(:name) || '_')"
        )
    };
    let ago = "now() - :age_ms * interval '1 millisecond'";
    let [old_in_scope, old, stuck] = counts("COUNT(*)", ago);
    HealthText {
        tables: format!(
            "SELECT tablename::text FROM pg_tables WHERE schemaname = current_schema() AND {}",
            ours("tablename")
        )
        .into(),
        indexes: format!(
            "SELECT tablename::text, indexname::text FROM pg_indexes \
             WHERE schemaname = current_schema() AND {}",
            ours("tablename")
        )
        .into(),
        columns: format!(
            "SELECT table_name::text, column_name::text FROM information_schema.columns \
             WHERE table_schema = current_schema() AND {}",
            ours("table_name")
        )
        .into(),
        marker_tables: "SELECT table_name::text FROM information_schema.columns \
                        WHERE table_schema = current_schema() AND column_name IN ('scope', \
                        'key', 'state', 'token', 'locked_until', 'attempts', 'completed_at') \
                        GROUP BY table_name HAVING COUNT(*) = 7 ORDER BY table_name"
            .into(),
        old_in_scope,
        old,
        stuck,
        outbox: format!(
            "SELECT COUNT(*) FILTER (WHERE parked), COUNT(*) FILTER (WHERE NOT parked \
             AND next_attempt_at < {ago}) FROM {{t}}_outbox WHERE sent_at IS NULL"
        )
        .into(),
        bloat: "SELECT n_dead_tup, n_live_tup, 'rows' FROM pg_stat_user_tables \
                WHERE schemaname = current_schema() AND relname = lower(:name)"
            .into(),
        clock: Some("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::int8".into()),
        max_connections: Some("SELECT current_setting('max_connections')::int8".into()),
        server_port: Some("SELECT inet_server_port()::int8".into()),
        slots: Some(
            "SELECT slot_name::text, \
             COALESCE(pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn), 0)::int8, \
             COALESCE(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn), 0)::int8, \
             (CASE WHEN active THEN 1 ELSE 0 END)::int8, \
             COALESCE(wal_status, '') FROM pg_replication_slots WHERE slot_type = 'logical' \
             AND plugin = 'pgoutput' AND database = current_database() ORDER BY slot_name"
                .into(),
        ),
    }
}

/// `Backend::migrate`: in one transaction, under a transaction-scoped advisory lock that makes
/// concurrent workers take turns (concurrent `CREATE TABLE IF NOT EXISTS` can still fail on
/// the catalog's unique index).
pub(super) async fn migrate(pool: &Pool<Postgres>, sql: &Sql<Postgres>) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    // `IF NOT EXISTS` answers an existing table with a NOTICE, which sqlx logs at INFO: every
    // worker's start-up would say "relation already exists, skipping".
    sqlx::raw_sql("SET LOCAL client_min_messages = warning")
        .execute(&mut *tx)
        .await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('idem.migrate.' || $1))")
        .bind(sql.table.as_str())
        .persistent(false)
        .execute(&mut *tx)
        .await?;
    crate::backend::upgrade::run(&mut *tx, sql).await?;
    tx.commit().await
}
