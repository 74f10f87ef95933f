//! Lease mode's statements after the claim (which is each backend's own): the holder's, each
//! fenced by its token, and its recorded steps.

use sqlx::Pool;

use super::bind::statements;
use super::{Holder, StepRow, sql_runs};

/// The words in which the backends' holder statements differ.
pub(super) struct Words<'a> {
    /// The `key` column (MySQL quotes the word).
    pub(super) key: &'a str,
    /// The current instant, as the markers' times are written.
    pub(super) now: &'a str,
    /// `:lease_ms` milliseconds from now.
    pub(super) until: &'a str,
    /// The `:result` bind as its column stores it.
    pub(super) result: &'a str,
}

/// The steps' `forget`, `key` being the backend's `key` column: only once the marker is gone.
pub(super) fn forget_steps(key: &str) -> String {
    format!(
        "DELETE FROM {{t}}_steps WHERE scope = :scope AND {key} = :key \
         AND NOT EXISTS (SELECT 1 FROM {{t}} WHERE scope = :scope AND {key} = :key)"
    )
}

impl LeaseText {
    /// The holder's statements, each fenced by its token: alike on every backend but for
    /// `words`.
    pub(super) fn of(words: Words<'_>) -> LeaseText {
        let Words {
            key,
            now,
            until,
            result,
        } = words;
        let holder =
            format!("scope = :scope AND {key} = :key AND token = :token AND state = 'in_progress'");
        let complete = |set: &str| {
            format!(
                "UPDATE {{t}} SET state = 'completed', completed_at = {now}, \
                 locked_until = NULL, {set} WHERE {holder}"
            )
        };
        LeaseText {
            complete: complete(&format!("result = {result}")).into(),
            fail: complete("result = NULL, error = :error").into(),
            release: format!("UPDATE {{t}} SET locked_until = NULL WHERE {holder}").into(),
            renew: format!("UPDATE {{t}} SET locked_until = {until} WHERE {holder}").into(),
        }
    }
}

statements! {
    /// The statements of a lease's holder.
    pub(crate) struct LeaseSql, LeaseText {
        /// Completes the holder's lease, storing `result` (if any).
        complete(scope: &str, key: &str, token: i64, result: Option<&str>);
        /// A permanent failure: completed, with its error and no value.
        fail(scope: &str, key: &str, token: i64, error: &str);
        /// Lets the lease go now: the marker stays, free for the next delivery.
        release(scope: &str, key: &str, token: i64);
        /// Extends the lease by `lease_ms` from the database's now.
        renew(scope: &str, key: &str, token: i64, lease_ms: i64);
    }
}

statements! {
    /// The statements of the steps table (`{t}_steps`).
    pub(crate) struct StepSql, StepText {
        /// `(name, seq, token, value, recorded at)` of each recorded step, in order.
        read(scope: &str, key: &str);
        /// Records a step's value, only while the holder's token is the marker's; a row left
        /// by an earlier life of the key (its marker deleted without its steps) holds a
        /// smaller token and is replaced.
        record(scope: &str, key: &str, token: i64, name: &str, seq: i64, result: &str);
        /// With `forget`, once its marker is deleted (not when a marker in progress is only let
        /// go: the next delivery resumes after its recorded steps).
        forget(scope: &str, key: &str);
    }
}

sql_runs! {
    /// Completes the lease of `h`, storing `result` (if any), on `conn` (a transaction when
    /// messages are written with it); `Ok(false)` if that holder no longer had the key.
    lease_complete(conn: &mut DB::Connection, h: Holder<'_>, result: Option<&str>) -> bool =
        lease.complete(h.scope, h.key, h.token, result).execute => |n| n == 1;
    /// Completes the lease of `h` as failed for good, with `error` and no value; `Ok(false)`
    /// if that holder no longer had the key.
    lease_fail(pool: &Pool<DB>, h: Holder<'_>, error: &str) -> bool =
        lease.fail(h.scope, h.key, h.token, error).execute => |n| n == 1;
    /// Releases the lease of `h` now; `Ok(false)` if that holder no longer had the key.
    lease_release(pool: &Pool<DB>, h: Holder<'_>) -> bool =
        lease.release(h.scope, h.key, h.token).execute => |n| n == 1;
    /// Extends the lease of `h` by `lease_ms`; `Ok(false)` if that holder no longer had it.
    lease_renew(pool: &Pool<DB>, h: Holder<'_>, lease_ms: i64) -> bool =
        lease.renew(h.scope, h.key, h.token, lease_ms).execute => |n| n == 1;
    /// The recorded steps of `(scope, key)`, in the order they were recorded.
    steps_read(pool: &Pool<DB>, scope: &str, key: &str) -> Vec<StepRow> =
        steps.read(scope, key).fetch_all;
    /// Records the step `name` (the `seq`-th of its body) with its value `json`, on `conn`
    /// (a transaction for a database step), if `h` still holds the key; `Ok(false)` if not,
    /// and nothing was written. MySQL counts a replaced row twice (sqlx asks for found rows).
    step_record(conn: &mut DB::Connection, h: Holder<'_>, name: &str, seq: i64, json: &str)
        -> bool = steps.record(h.scope, h.key, h.token, name, seq, json).execute => |n| n > 0;
    /// Deletes the steps of `(scope, key)` if its marker is gone, in `forget`'s transaction.
    steps_forget(conn: &mut DB::Connection, scope: &str, key: &str) -> u64 =
        steps.forget(scope, key).execute;
}
