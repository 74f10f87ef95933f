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
        } = words;
        let marker = format!("scope = :scope AND {key} = :key");
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
            requeue: format!(
                "UPDATE {{t}} SET state = 'in_progress', completed_at = NULL, \
                 locked_until = NULL, error = NULL, token = COALESCE(token, 0) + 1 \
                 WHERE {marker} AND state = 'completed' AND error IS NOT NULL"
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
