//! What operators do with the markers on SQLite (forget, inspect, purge, each scope's
//! retention), the offset watermarks' statements, and what the doctor reads.

use super::{LEASE_OVER, NOW};
use crate::backend::health::{HealthText, counts};
use crate::backend::offsets::{FORGET, INSERT_OR_SKIP, OffsetText, PARTITION, READ};
use crate::backend::operators::{OperatorText, Words};

/// The columns of `Store::inspect`: times are already ISO-8601 UTC text here; the lease's time
/// left on the database's clock.
const MARKER_COLUMNS: &str = "scope, key, state, attempts, token, created_at, completed_at, \
    locked_until, CAST((julianday(locked_until) - julianday('now')) * 86400000.0 AS INTEGER), \
    error";

/// `:age_ms` milliseconds ago, as the markers' times are written.
const AGO: &str = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-' || (:age_ms / 1000.0) || ' seconds')";

/// One purge batch: the oldest completed markers before `:cutoff` (`{which}`: of which
/// scopes), at most `:limit`, in one order.
fn batch(which: &str) -> String {
    format!(
        "SELECT scope, key FROM {{t}} WHERE {which} AND state = 'completed' \
         AND completed_at < :cutoff ORDER BY completed_at, scope, key LIMIT :limit"
    )
}

/// The operators' statements.
pub(super) fn text() -> OperatorText {
    let words = Words {
        key: "key",
        columns: MARKER_COLUMNS,
        lease_over: LEASE_OVER,
        lease_over_int: LEASE_OVER,
        null: ":scope IS NULL",
        null_error: ":error IS NULL",
        null_age: ":age_ms IS NULL",
        ago: AGO,
        now: NOW,
        count: "COUNT(*)",
        // The times are ISO-8601 UTC text already.
        time: str::to_owned,
        bucket: |c| format!("(CAST(strftime('%s', {c}) AS INTEGER) / :bucket_s)"),
        update_limit: false,
    };
    let retention_set = format!(
        "INSERT INTO {{t}}_retention (scope, keep_ms) VALUES (:scope, :keep_ms) \
         ON CONFLICT (scope) DO UPDATE SET keep_ms = excluded.keep_ms, updated_at = {NOW}"
    );
    let unwindowed = batch("scope NOT IN (SELECT scope FROM {t}_retention)");
    let scoped = batch("scope = :scope");
    let steps = |batch: &str| format!("DELETE FROM {{t}}_steps WHERE (scope, key) IN ({batch})");
    let cut = |batch: &str| format!("DELETE FROM {{t}} WHERE (scope, key) IN ({batch})");
    OperatorText {
        // SQLite's `ADD COLUMN` cannot skip a column that exists: the catalog is asked first.
        has_column: Some(
            "SELECT COUNT(*) FROM pragma_table_info(:table) WHERE name = :name".into(),
        ),
        has_index: Some("SELECT COUNT(*) FROM pragma_index_list(:table) WHERE name = :name".into()),
        cutoff: Some(format!("SELECT {}", AGO).into()),
        purge_steps: Some(steps(&unwindowed).into()),
        purge_cut: Some(cut(&unwindowed).into()),
        purge_scope_steps: Some(steps(&scoped).into()),
        purge_scope_cut: Some(cut(&scoped).into()),
        ..OperatorText::of(words, retention_set.into())
    }
}

/// The watermarks' statements: writers take turns on the database's write lock, which a claim
/// holds from its `BEGIN IMMEDIATE`, so a read needs no row lock.
pub(super) fn offsets() -> OffsetText {
    OffsetText {
        advance: format!(
            "UPDATE {{t}}_offsets SET next_offset = :next, token = :nonce, updated_at = {NOW} \
             WHERE {PARTITION} AND next_offset <= :first"
        )
        .into(),
        lock: format!("SELECT next_offset FROM {{t}}_offsets WHERE {PARTITION}").into(),
        insert: INSERT_OR_SKIP.into(),
        read: READ.into(),
        set: format!(
            "INSERT INTO {{t}}_offsets (consumer_group, topic, partition_id, next_offset) \
             VALUES (:group, :topic, :partition, :next) \
             ON CONFLICT (consumer_group, topic, partition_id) \
             DO UPDATE SET next_offset = excluded.next_offset, token = NULL, updated_at = {NOW}"
        )
        .into(),
        forget: FORGET.into(),
    }
}

/// The doctor's reads. SQLite runs in this process: it has no clock, connection limit or port
/// of a server's.
pub(super) fn health() -> HealthText {
    // Named like the marker table, or with its name and `_` as prefix.
    let ours = |column: &str| {
        format!("({column} = :name OR substr({column}, 1, length(:name) + 1) = :name || '_')")
    };
    let [old_in_scope, old, stuck] = counts("COUNT(*)", AGO);
    HealthText {
        tables: format!(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND {}",
            ours("name")
        )
        .into(),
        indexes: format!(
            "SELECT tbl_name, name FROM sqlite_master WHERE type = 'index' AND {}",
            ours("tbl_name")
        )
        .into(),
        columns: format!(
            "SELECT m.name, c.name FROM sqlite_master m, pragma_table_info(m.name) c \
             WHERE m.type = 'table' AND {}",
            ours("m.name")
        )
        .into(),
        marker_tables: "SELECT m.name FROM sqlite_master m, pragma_table_info(m.name) c \
                        WHERE m.type = 'table' AND c.name IN ('scope', 'key', 'state', 'token', \
                        'locked_until', 'attempts', 'completed_at') \
                        GROUP BY m.name HAVING COUNT(*) = 7 ORDER BY m.name"
            .into(),
        old_in_scope,
        old,
        stuck,
        outbox: format!(
            "SELECT COALESCE(SUM(parked <> 0), 0), \
             COALESCE(SUM(parked = 0 AND next_attempt_at < {AGO}), 0) \
             FROM {{t}}_outbox WHERE sent_at IS NULL"
        )
        .into(),
        bloat: "SELECT (SELECT freelist_count FROM pragma_freelist_count), \
                (SELECT page_count FROM pragma_page_count), 'pages'"
            .into(),
        clock: None,
        max_connections: None,
        server_port: None,
        slots: None,
    }
}
