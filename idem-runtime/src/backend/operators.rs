//! What operators do with the markers: forget, inspect, list, requeue, purge (by the default
//! window or each scope's own), and each scope's retention window (`{t}_retention`).

use sqlx::Pool;

use super::bind::statements;
use super::sql::Text;
use super::{Backend, MarkerRow, Sql, Status, sql_runs};
use crate::options::ClaimOptions;

/// The words in which the backends' operator statements differ.
pub(super) struct Words<'a> {
    /// The `key` column (MySQL quotes the word).
    pub(super) key: &'a str,
    /// The columns of `inspect` and the listings (`MarkerRow`).
    pub(super) columns: &'a str,
    /// Whether a marker's lease is over (released or run out), as a condition.
    pub(super) lease_over: &'a str,
    /// The same as an integer, 0 or 1 (`status`).
    pub(super) lease_over_int: &'a str,
    /// Whether the `:scope` bind is NULL (every scope).
    pub(super) null: &'a str,
    /// Whether the `:error` bind is NULL (every error).
    pub(super) null_error: &'a str,
    /// Whether the `:age_ms` bind is NULL (whenever it failed).
    pub(super) null_age: &'a str,
    /// The instant `:age_ms` milliseconds ago, as `completed_at` compares with it.
    pub(super) ago: &'a str,
    /// The database's now, as the tables' times are written (UTC).
    pub(super) now: &'a str,
    /// `COUNT(*)` read as a 64-bit integer.
    pub(super) count: &'a str,
    /// A time column or aggregate as ISO-8601 UTC text, as `columns` writes them.
    pub(super) time: fn(&str) -> String,
    /// A time column as a whole number of `:bucket_s` seconds since 1970 (UTC), rounded down.
    pub(super) bucket: fn(&str) -> String,
    /// Whether an `UPDATE` takes its own `ORDER BY ... LIMIT` (MySQL and MariaDB, which refuse
    /// a `LIMIT` in an `IN` subquery and a subquery of the table being updated), rather than a
    /// page of keys chosen by a subquery (PostgreSQL and SQLite, which have no `UPDATE ...
    /// LIMIT` in their default builds).
    pub(super) update_limit: bool,
}

impl OperatorText {
    /// The statements alike on every backend but for `words`; a backend adds its
    /// `retention_set` and its way to purge.
    pub(super) fn of(words: Words<'_>, retention_set: Text) -> OperatorText {
        let Words {
            key,
            columns,
            lease_over,
            lease_over_int,
            null,
            null_error,
            null_age,
            ago,
            now,
            count,
            time,
            bucket,
            update_limit,
        } = words;
        let marker = format!("scope = :scope AND {key} = :key");
        let failed = "state = 'completed' AND error IS NOT NULL";
        // The failed markers an operator's filter names: of a scope (or every one), with one
        // error text (or any), failed more than `:age_ms` ago (or whenever).
        let matching = format!(
            "({null} OR scope = :scope) AND {failed} AND ({null_error} OR error = :error) \
             AND ({null_age} OR completed_at < {ago})"
        );
        // What `requeue` does to one failed marker.
        let requeued = "SET state = 'in_progress', completed_at = NULL, locked_until = NULL, \
                        error = NULL, token = COALESCE(token, 0) + 1";
        // A page of them, in the primary key's order, so that each page's row locks are taken
        // in one order and a bulk requeue never holds more than a page's.
        let requeue_page = match update_limit {
            true => format!(
                "UPDATE {{t}} {requeued} WHERE {matching} ORDER BY scope, {key} LIMIT :limit"
            ),
            false => format!(
                "UPDATE {{t}} {requeued} WHERE (scope, {key}) IN (SELECT scope, {key} FROM {{t}} \
                 WHERE {matching} ORDER BY scope, {key} LIMIT :limit) AND {matching}"
            ),
        };
        // The stuck leases an operator forgets at once: in progress since longer ago than
        // `:age_ms`, and not let go yet (a released marker has nothing left to forget, and a
        // page that forgot its markers must not find them again).
        let stuck = format!(
            "({null} OR scope = :scope) AND state = 'in_progress' \
             AND locked_until IS NOT NULL AND created_at < {ago}"
        );
        let release = format!(
            "UPDATE {{t}} SET locked_until = NULL, fingerprint = NULL, \
             token = COALESCE(token, 0) + 1 WHERE {marker} AND state = 'in_progress'"
        );
        let listing = |state: &str, order: &str| -> Text {
            format!(
                "SELECT {columns} FROM {{t}} WHERE ({null} OR scope = :scope) \
                 AND state = {state} ORDER BY {order}, scope LIMIT :limit"
            )
            .into()
        };
        OperatorText {
            forget: format!("DELETE FROM {{t}} WHERE {marker} AND state = 'completed'").into(),
            release: format!("{release} AND {lease_over}").into(),
            release_forced: release.into(),
            status: format!("SELECT state, {lease_over_int} FROM {{t}} WHERE {marker}").into(),
            inspect: format!("SELECT {columns} FROM {{t}} WHERE {marker}").into(),
            // Released or expired leases first.
            in_progress: listing("'in_progress'", "locked_until IS NOT NULL, locked_until"),
            // The newest failures first; a scan of the completed markers (failures are few).
            failed: listing("'completed' AND error IS NOT NULL", "completed_at DESC"),
            requeue: format!("UPDATE {{t}} {requeued} WHERE {marker} AND {failed}").into(),
            // The grouping is the database's (its collation decides which errors are one);
            // bounded by the number of groups, the largest first.
            failure_groups: format!(
                "SELECT scope, error, {count}, {}, {} FROM {{t}} \
                 WHERE ({null} OR scope = :scope) AND {failed} GROUP BY scope, error \
                 ORDER BY {count} DESC, scope, error LIMIT :limit",
                time("MIN(completed_at)"),
                time("MAX(completed_at)"),
            )
            .into(),
            // The newest `:limit` completed markers of a window, read backwards along the index
            // on `completed_at` (a bounded read whatever the table's size), counted per scope
            // and bucket; `COUNT(error)` counts the failed among them.
            outcomes: format!(
                "SELECT scope, {}, {count}, {} FROM (SELECT scope, completed_at, error \
                 FROM {{t}} WHERE state = 'completed' AND completed_at >= {ago} \
                 AND ({null} OR scope = :scope) ORDER BY completed_at DESC LIMIT :limit) AS s \
                 GROUP BY scope, 2 ORDER BY scope, 2",
                bucket("completed_at"),
                count.replace("COUNT(*)", "COUNT(error)"),
            )
            .into(),
            failed_count: format!("SELECT {count} FROM {{t}} WHERE {matching}").into(),
            failed_matching: format!(
                "SELECT {columns} FROM {{t}} WHERE {matching} \
                 ORDER BY completed_at DESC, scope LIMIT :limit"
            )
            .into(),
            requeue_page: requeue_page.into(),
            stuck_count: format!("SELECT {count} FROM {{t}} WHERE {stuck}").into(),
            stuck_held: format!("SELECT {count} FROM {{t}} WHERE {stuck} AND NOT {lease_over}")
                .into(),
            stuck_matching: format!(
                "SELECT {columns} FROM {{t}} WHERE {stuck} ORDER BY scope, {key} LIMIT :limit"
            )
            .into(),
            audit_write: format!(
                "INSERT INTO {{t}}_audit (acted_at, actor, action, target, changed) \
                 VALUES ({now}, :actor, :action, :target, :changed)"
            )
            .into(),
            audit_list: format!(
                "SELECT id, {}, actor, action, target, changed FROM {{t}}_audit \
                 ORDER BY id DESC LIMIT :limit",
                time("acted_at")
            )
            .into(),
            retention_set,
            retention_clear: "DELETE FROM {t}_retention WHERE scope = :scope".into(),
            retention_list: "SELECT scope, keep_ms FROM {t}_retention ORDER BY scope".into(),
            has_column: None,
            has_index: None,
            purge: None,
            purge_scope: None,
            cutoff: None,
            purge_steps: None,
            purge_cut: None,
            purge_scope_steps: None,
            purge_scope_cut: None,
        }
    }
}

statements! {
    /// The operators' statements.
    pub(crate) struct OperatorSql, OperatorText {
        /// A completed marker is deleted: the next delivery runs the job again.
        forget(scope: &str, key: &str);
        /// A marker in progress whose lease is over is let go, not deleted: its token goes up,
        /// so that its holder is fenced out and the next holder's token is larger still.
        release(scope: &str, key: &str);
        /// The same, whatever its lease.
        release_forced(scope: &str, key: &str);
        /// Whether the marker is there, and held: `(state, lease over)`.
        status(scope: &str, key: &str);
        /// One marker (`MarkerRow`).
        inspect(scope: &str, key: &str);
        /// Markers in progress of a scope (every scope: NULL), released or expired first.
        in_progress(scope: Option<&str>, limit: i64);
        /// Markers that failed for good of a scope (every scope: NULL), newest first.
        failed(scope: Option<&str>, limit: i64);
        /// A failed marker back to a released lease, its steps and fingerprint kept, its token
        /// up: the next delivery takes it over and resumes after its recorded steps.
        requeue(scope: &str, key: &str);
        /// The failed markers of a scope (every scope: NULL) grouped by their error:
        /// `(scope, error, count, first failed at, last failed at)`, the largest groups first.
        failure_groups(scope: Option<&str>, limit: i64);
        /// The newest `limit` markers completed in the last `age_ms` of a scope (every scope:
        /// NULL), counted per scope and bucket of `bucket_s` seconds: `(scope, bucket,
        /// completed, failed)`.
        outcomes(bucket_s: i64, age_ms: i64, scope: Option<&str>, limit: i64);
        /// How many failed markers the filter names (each bind NULL: any).
        failed_count(scope: Option<&str>, error: Option<&str>, age_ms: Option<i64>);
        /// At most `limit` of them (`MarkerRow`), newest first.
        failed_matching(scope: Option<&str>, error: Option<&str>, age_ms: Option<i64>, limit: i64);
        /// Requeues at most `limit` of them, as `requeue` does one.
        requeue_page(scope: Option<&str>, error: Option<&str>, age_ms: Option<i64>, limit: i64);
        /// How many markers in progress since longer ago than `age_ms` and not let go, of a
        /// scope (every scope: NULL).
        stuck_count(scope: Option<&str>, age_ms: i64);
        /// How many of them a delivery still holds (their lease not run out).
        stuck_held(scope: Option<&str>, age_ms: i64);
        /// At most `limit` of them (`MarkerRow`), in the primary key's order.
        stuck_matching(scope: Option<&str>, age_ms: i64, limit: i64);
        /// Records one operator action in the audit log (`{t}_audit`).
        audit_write(actor: &str, action: &str, target: &str, changed: i64);
        /// The newest `limit` actions of the audit log: `(id, at, actor, action, target,
        /// changed)`.
        audit_list(limit: i64);
        /// Sets a scope's retention window (a new one, or a change).
        retention_set(scope: &str, keep_ms: i64);
        /// Removes a scope's window.
        retention_clear(scope: &str);
        /// `(scope, keep_ms)` of every window, by scope.
        retention_list();
    } optional {
        // Whether a table has the column or index a later version added, where the statement
        // that adds it cannot skip it (SQLite, MySQL 8): how many there are.
        /// Counts the columns of `table` named `name`.
        has_column(table: &str, name: &str);
        /// Counts the indexes of `table` named `name`.
        has_index(table: &str, name: &str);
        // A purge batch is one statement that deletes completed markers and their steps
        // (PostgreSQL), or a cutoff read first, then the batch's steps and its markers
        // chosen again from that cutoff in one order, in one transaction.
        /// Deletes at most `limit` completed markers older than `age_ms` of the scopes without
        /// a window of their own, and their steps.
        purge(age_ms: i64, limit: i64);
        /// The same for one scope, by its window.
        purge_scope(scope: &str, age_ms: i64, limit: i64);
        /// The instant `age_ms` ago, as the purge's statements compare it.
        cutoff(age_ms: i64);
        /// The steps of the batch [`purge_cut`](Self::purge_cut) deletes.
        purge_steps(cutoff: &str, limit: i64);
        /// At most `limit` completed markers before `cutoff`, of the scopes without a window.
        purge_cut(cutoff: &str, limit: i64);
        /// The steps of the batch [`purge_scope_cut`](Self::purge_scope_cut) deletes.
        purge_scope_steps(scope: &str, cutoff: &str, limit: i64);
        /// At most `limit` completed markers of `scope` before `cutoff`.
        purge_scope_cut(scope: &str, cutoff: &str, limit: i64);
    }
}

sql_runs! {
    /// Who holds the marker of `(scope, key)`, if there is one.
    status(pool: &Pool<DB>, scope: &str, key: &str) -> Option<Status> =
        ops.status(scope, key).fetch_optional
        => |row: Option<(String, i64)>| row.map(|(state, over)| Status::of(&state, over != 0));
    /// One marker, for operators.
    inspect(pool: &Pool<DB>, scope: &str, key: &str) -> Option<MarkerRow> =
        ops.inspect(scope, key).fetch_optional;
    /// At most `limit` in-progress markers of `scope` (every scope: `None`).
    in_progress(pool: &Pool<DB>, scope: Option<&str>, limit: i64) -> Vec<MarkerRow> =
        ops.in_progress(scope, limit).fetch_all;
    /// At most `limit` failed markers of `scope` (every scope: `None`), newest first.
    failed(pool: &Pool<DB>, scope: Option<&str>, limit: i64) -> Vec<MarkerRow> =
        ops.failed(scope, limit).fetch_all;
    /// Makes the failed marker of `(scope, key)` a released lease; `Ok(false)` if it is not a
    /// failed marker.
    requeue(pool: &Pool<DB>, scope: &str, key: &str) -> bool =
        ops.requeue(scope, key).execute => |n| n == 1;
    /// `(scope, error, count, first, last)` of at most `limit` groups of failed markers.
    failure_groups(pool: &Pool<DB>, scope: Option<&str>, limit: i64)
        -> Vec<(String, String, i64, String, String)> =
        ops.failure_groups(scope, limit).fetch_all;
    /// `(scope, bucket, completed, failed)` of the markers completed in the last `age_ms`.
    outcomes(pool: &Pool<DB>, bucket_s: i64, age_ms: i64, scope: Option<&str>, limit: i64)
        -> Vec<(String, i64, i64, i64)> =
        ops.outcomes(bucket_s, age_ms, scope, limit).fetch_all;
    /// How many failed markers the filter names.
    failed_count(pool: &Pool<DB>, scope: Option<&str>, error: Option<&str>, age_ms: Option<i64>)
        -> Option<(i64,)> = ops.failed_count(scope, error, age_ms).fetch_optional;
    /// At most `limit` failed markers the filter names, newest first.
    failed_matching(
        pool: &Pool<DB>, scope: Option<&str>, error: Option<&str>, age_ms: Option<i64>, limit: i64
    ) -> Vec<MarkerRow> = ops.failed_matching(scope, error, age_ms, limit).fetch_all;
    /// Requeues at most `limit` failed markers the filter names; returns how many.
    requeue_page(
        pool: &Pool<DB>, scope: Option<&str>, error: Option<&str>, age_ms: Option<i64>, limit: i64
    ) -> u64 = ops.requeue_page(scope, error, age_ms, limit).execute => |n| n;
    /// How many stuck markers the bound names.
    stuck_count(pool: &Pool<DB>, scope: Option<&str>, age_ms: i64) -> Option<(i64,)> =
        ops.stuck_count(scope, age_ms).fetch_optional;
    /// How many of them a delivery still holds.
    stuck_held(pool: &Pool<DB>, scope: Option<&str>, age_ms: i64) -> Option<(i64,)> =
        ops.stuck_held(scope, age_ms).fetch_optional;
    /// At most `limit` of them, in the primary key's order.
    stuck_matching(pool: &Pool<DB>, scope: Option<&str>, age_ms: i64, limit: i64)
        -> Vec<MarkerRow> = ops.stuck_matching(scope, age_ms, limit).fetch_all;
    /// Writes one row of the audit log.
    audit_write(pool: &Pool<DB>, actor: &str, action: &str, target: &str, changed: i64) -> () =
        ops.audit_write(actor, action, target, changed).execute => drop;
    /// The newest `limit` rows of the audit log.
    audit_list(pool: &Pool<DB>, limit: i64) -> Vec<(i64, String, String, String, String, i64)> =
        ops.audit_list(limit).fetch_all;
    /// Sets the window of `scope` to `keep_ms`.
    retention_set(pool: &Pool<DB>, scope: &str, keep_ms: i64) -> () =
        ops.retention_set(scope, keep_ms).execute => drop;
    /// Removes the window of `scope`; `Ok(true)` if it had one.
    retention_clear(pool: &Pool<DB>, scope: &str) -> bool =
        ops.retention_clear(scope).execute => |n| n > 0;
    /// Every scope's window, `(scope, keep_ms)`, by scope.
    retention_list(pool: &Pool<DB>) -> Vec<(String, i64)> = ops.retention_list().fetch_all;
}

impl<DB: Backend> Sql<DB> {
    /// Lets the next delivery of `(scope, key)` run: deletes a completed marker, or lets go
    /// of one in progress unless a delivery holds a live lease on it and `force` is not set.
    /// `Ok(true)` if it did either. Runs in the caller's transaction, beside
    /// [`outbox_forget`](Sql::outbox_forget).
    pub(crate) async fn forget(
        &self,
        conn: &mut DB::Connection,
        scope: &str,
        key: &str,
        force: bool,
    ) -> Result<bool, sqlx::Error> {
        if self.ops.forget(scope, key).execute(&mut *conn).await? > 0 {
            return Ok(true);
        }
        let release = match force {
            true => self.ops.release_forced(scope, key),
            false => self.ops.release(scope, key),
        };
        Ok(release.execute(conn).await? > 0)
    }

    /// Deletes at most `limit` completed markers older than `age_ms` of the scopes without a
    /// window of their own, and their steps with them; returns how many markers.
    pub(crate) async fn purge_batch(
        &self,
        pool: &Pool<DB>,
        age_ms: i64,
        limit: i64,
    ) -> Result<u64, sqlx::Error> {
        if let Some(purge) = self.ops.purge(age_ms, limit) {
            return purge.execute(pool).await;
        }
        self.purge_from_cutoff(pool, age_ms, |ops, cutoff| {
            (ops.purge_steps(cutoff, limit), ops.purge_cut(cutoff, limit))
        })
        .await
    }

    /// Deletes at most `limit` completed markers of `scope` older than `age_ms`, and their
    /// steps; returns how many markers.
    pub(crate) async fn purge_scope_batch(
        &self,
        pool: &Pool<DB>,
        scope: &str,
        age_ms: i64,
        limit: i64,
    ) -> Result<u64, sqlx::Error> {
        if let Some(purge) = self.ops.purge_scope(scope, age_ms, limit) {
            return purge.execute(pool).await;
        }
        self.purge_from_cutoff(pool, age_ms, |ops, cutoff| {
            let steps = ops.purge_scope_steps(scope, cutoff, limit);
            (steps, ops.purge_scope_cut(scope, cutoff, limit))
        })
        .await
    }

    /// A purge batch where one statement cannot delete markers and steps together: the
    /// cutoff read once, then the batch's steps and its markers, chosen again from it in one
    /// order, in one writer's transaction: a purge never leaves the steps of a deleted marker.
    async fn purge_from_cutoff(
        &self,
        pool: &Pool<DB>,
        age_ms: i64,
        batch: impl FnOnce(
            &OperatorSql<DB>,
            &str,
        ) -> (
            Option<super::bind::Bound<DB>>,
            Option<super::bind::Bound<DB>>,
        ),
    ) -> Result<u64, sqlx::Error> {
        let cutoff = self.ops.cutoff(age_ms);
        let cutoff = cutoff.expect("a backend purges with one statement or from a cutoff");
        let mut tx = DB::begin(pool, self, &ClaimOptions::default()).await?;
        let (cutoff,): (String,) = cutoff
            .fetch_optional(&mut *tx)
            .await?
            .ok_or(sqlx::Error::RowNotFound)?;
        let (steps, markers) = batch(&self.ops, &cutoff);
        let (Some(steps), Some(markers)) = (steps, markers) else {
            unreachable!("a backend that purges from a cutoff writes both of its statements");
        };
        steps.execute(&mut *tx).await?;
        let gone = markers.execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(gone)
    }
}
