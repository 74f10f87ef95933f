//! What operators do with many failed jobs at once: the failures grouped by their error, a
//! filter over them, requeued in bounded pages, and the audit log of the operators' actions.

use std::time::Duration;

use sha2::{Digest as _, Sha256};

use crate::backend::Backend;
use crate::error::Error;
use crate::inspect::Marker;
use crate::scope::check_scope;
use crate::store::Store;

/// How many hex digits of SHA-256 make a [`FailureGroup::id`]: 48 bits, short enough to type,
/// wide enough that two groups of one table do not share one.
pub const GROUP_ID_LEN: usize = 12;

/// How many failed markers one statement of [`Store::requeue_failed`] requeues: each page's
/// row locks are held only for its own statement.
pub const REQUEUE_PAGE: u64 = 500;

/// How many groups [`Store::failure_group`] looks through for an id.
pub const MAX_GROUPS: u32 = 10_000;

/// The jobs of one scope that failed for good with one error text, as
/// [`Store::failure_groups`] reads them.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct FailureGroup {
    /// A short, stable id of `(scope, error)` ([`FailureGroup::id_of`]): what an operator
    /// types to act on the group.
    pub id: String,
    /// The handler's scope.
    pub scope: String,
    /// The error text the jobs failed with (MySQL and MariaDB group by the column's
    /// collation: texts it holds equal are one group, shown by one of them).
    pub error: String,
    /// How many jobs.
    pub count: u64,
    /// When the first of them failed (ISO-8601 UTC, as [`Marker::completed_at`]).
    pub first_failed_at: String,
    /// When the last of them failed.
    pub last_failed_at: String,
}

impl FailureGroup {
    /// The id of the group of `(scope, error)`: the first [`GROUP_ID_LEN`] hex digits of
    /// SHA-256 over the scope, a NUL and the error text. The same in every process and on
    /// every database, so an id printed by one run names the group in the next.
    pub fn id_of(scope: &str, error: &str) -> String {
        let mut hash = Sha256::new();
        hash.update(scope.as_bytes());
        hash.update([0]);
        hash.update(error.as_bytes());
        let digest = hash.finalize();
        let mut id: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        id.truncate(GROUP_ID_LEN);
        id
    }

    /// Whether `id` is written as a group id is: [`GROUP_ID_LEN`] lower-case hex digits.
    pub fn is_id(id: &str) -> bool {
        id.len() == GROUP_ID_LEN && id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    }
}

/// A filter's binds: `(scope, error, age_ms)`, each `None` for any.
type FilterBinds<'a> = (Option<&'a str>, Option<&'a str>, Option<i64>);

/// Which failed jobs a bulk action takes: every one, or those of a scope, with an error text,
/// failed more than some time ago (each condition optional, all of them together).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct FailedFilter {
    /// Only this scope's.
    pub scope: Option<String>,
    /// Only those that failed with exactly this error text (a [`FailureGroup::error`]).
    pub error: Option<String>,
    /// Only those that failed longer ago than this.
    pub failed_before: Option<Duration>,
}

impl FailedFilter {
    /// Every failed job.
    pub fn new() -> FailedFilter {
        FailedFilter::default()
    }

    /// Only those of `scope`.
    pub fn scope(mut self, scope: impl Into<String>) -> FailedFilter {
        self.scope = Some(scope.into());
        self
    }

    /// Only those that failed with `error`.
    pub fn error(mut self, error: impl Into<String>) -> FailedFilter {
        self.error = Some(error.into());
        self
    }

    /// Only those of a group: its scope and its error.
    pub fn group(self, group: &FailureGroup) -> FailedFilter {
        self.scope(group.scope.clone()).error(group.error.clone())
    }

    /// Only those that failed longer ago than `age`.
    pub fn failed_before(mut self, age: Duration) -> FailedFilter {
        self.failed_before = Some(age);
        self
    }

    /// The binds of the filter's statements, the scope checked.
    fn binds(&self) -> Result<FilterBinds<'_>, Error> {
        if let Some(scope) = &self.scope {
            check_scope(scope)?;
        }
        let age_ms = self
            .failed_before
            .map(|age| i64::try_from(age.as_millis()).unwrap_or(i64::MAX));
        Ok((self.scope.as_deref(), self.error.as_deref(), age_ms))
    }
}

/// One row of the operators' audit log ([`Store::audit_log`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AuditEntry {
    /// The row's number: later actions have larger ones.
    pub id: i64,
    /// When (ISO-8601 UTC, on the database's clock).
    pub at: String,
    /// Who: the name the tool was given, or the operating system's user.
    pub actor: String,
    /// What: the command (`requeue`, `forget`, `outbox requeue`...).
    pub action: String,
    /// On what: the key, message id or filter, as the tool wrote it (JSON for a filter).
    pub target: String,
    /// How many rows it changed.
    pub changed: u64,
}

/// How many jobs of one scope completed in one stretch of time, as [`Store::outcomes`]
/// counts them.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutcomeCount {
    /// The handler's scope.
    pub scope: String,
    /// The stretch's start, in seconds since 1970 (UTC): a multiple of the bucket's length.
    pub from: i64,
    /// Jobs whose effect was committed (or whose lease-mode call completed) in it.
    pub applied: u64,
    /// Jobs that failed for good in it.
    pub failed: u64,
}

impl<DB: Backend> Store<DB> {
    /// The newest `at_most` jobs completed in the last `window`, of `scope` or of every scope
    /// (`None`), counted per scope and stretch of `bucket` (at least a second; whole seconds),
    /// by scope then time: applied and failed over time. Stretches without a job are left
    /// out. When the counts add up to `at_most`, older jobs of the window were not read: the
    /// earliest stretch is then partly counted, and the ones before it not at all. A duplicate
    /// writes nothing to the marker table, so it is not counted here (the metric
    /// `idem_outcomes_total` counts it), nor is a job still in progress.
    ///
    /// One statement, which reads at most `at_most` markers backwards along the index on
    /// `completed_at`: its cost does not grow with the table.
    pub async fn outcomes(
        &self,
        scope: Option<&str>,
        window: Duration,
        bucket: Duration,
        at_most: u32,
    ) -> Result<Vec<OutcomeCount>, Error> {
        if let Some(scope) = scope {
            check_scope(scope)?;
        }
        let bucket_s = i64::try_from(bucket.as_secs().max(1)).unwrap_or(i64::MAX);
        let age_ms = i64::try_from(window.as_millis()).unwrap_or(i64::MAX);
        let rows = self
            .sql()
            .outcomes(self.pool(), bucket_s, age_ms, scope, i64::from(at_most))
            .await?;
        let count = |n: i64| u64::try_from(n).unwrap_or(0);
        Ok(rows
            .into_iter()
            .map(|(scope, n, completed, failed)| OutcomeCount {
                scope,
                from: n.saturating_mul(bucket_s),
                applied: count(completed - failed),
                failed: count(failed),
            })
            .collect())
    }

    /// The jobs that failed for good ([`Store::list_failed`]), of `scope` or of every scope
    /// (`None`), grouped by scope and error text, at most `limit` groups, the largest first:
    /// what failed, how often, since when. The database groups them, in one statement (a scan
    /// of the completed markers: an operator's query, not a worker's).
    pub async fn failure_groups(
        &self,
        scope: Option<&str>,
        limit: u32,
    ) -> Result<Vec<FailureGroup>, Error> {
        if let Some(scope) = scope {
            check_scope(scope)?;
        }
        let rows = self
            .sql()
            .failure_groups(self.pool(), scope, i64::from(limit))
            .await?;
        Ok(rows
            .into_iter()
            .map(|(scope, error, count, first, last)| FailureGroup {
                id: FailureGroup::id_of(&scope, &error),
                scope,
                error,
                count: u64::try_from(count).unwrap_or(0),
                first_failed_at: first,
                last_failed_at: last,
            })
            .collect())
    }

    /// The group of failed jobs whose [`id`](FailureGroup::id) is `id`, among the
    /// [`MAX_GROUPS`] largest; `None` if there is none (its jobs were requeued, or the id was
    /// mistyped).
    pub async fn failure_group(&self, id: &str) -> Result<Option<FailureGroup>, Error> {
        let groups = self.failure_groups(None, MAX_GROUPS).await?;
        Ok(groups.into_iter().find(|g| g.id == id))
    }

    /// How many jobs that failed for good `filter` takes.
    pub async fn count_failed(&self, filter: &FailedFilter) -> Result<u64, Error> {
        let (scope, error, age_ms) = filter.binds()?;
        let row = self
            .sql()
            .failed_count(self.pool(), scope, error, age_ms)
            .await?;
        Ok(row.map_or(0, |(n,)| u64::try_from(n).unwrap_or(0)))
    }

    /// At most `limit` of the jobs `filter` takes, newest first ([`Store::list_failed`] with
    /// a filter).
    pub async fn list_failed_matching(
        &self,
        filter: &FailedFilter,
        limit: u32,
    ) -> Result<Vec<Marker>, Error> {
        let (scope, error, age_ms) = filter.binds()?;
        let rows = self
            .sql()
            .failed_matching(self.pool(), scope, error, age_ms, i64::from(limit))
            .await?;
        Ok(rows.into_iter().map(Marker::from_row).collect())
    }

    /// Requeues at most `at_most` of the jobs `filter` takes, each as [`Store::requeue`]
    /// does one (its marker a released lease, its token up, its steps kept); returns how
    /// many. In pages of [`REQUEUE_PAGE`], one statement each, in the primary key's order:
    /// never one statement holding the locks of every row. `at_most` bounds a run whose filter
    /// new failures keep matching: pass what [`Store::count_failed`] counted.
    pub async fn requeue_failed(&self, filter: &FailedFilter, at_most: u64) -> Result<u64, Error> {
        let (scope, error, age_ms) = filter.binds()?;
        let mut done = 0;
        while done < at_most {
            let page = REQUEUE_PAGE.min(at_most - done);
            let n = self
                .sql()
                .requeue_page(self.pool(), scope, error, age_ms, page as i64)
                .await?;
            done += n;
            // A short page: nothing more matches (or another operator took the rest).
            if n < page {
                break;
            }
        }
        Ok(done)
    }

    /// How many markers are stuck longer than `older_than`: in progress (lease mode) since
    /// they were created longer ago than that, and not let go; of `scope` or of every scope.
    /// Returns `(how many, how many of them a delivery still holds)`.
    pub async fn count_stuck(
        &self,
        scope: Option<&str>,
        older_than: Duration,
    ) -> Result<(u64, u64), Error> {
        if let Some(scope) = scope {
            check_scope(scope)?;
        }
        let age_ms = i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
        let count = |row: Option<(i64,)>| row.map_or(0, |(n,)| u64::try_from(n).unwrap_or(0));
        let all = self.sql().stuck_count(self.pool(), scope, age_ms).await?;
        let held = self.sql().stuck_held(self.pool(), scope, age_ms).await?;
        Ok((count(all), count(held)))
    }

    /// At most `limit` of the markers [`Store::count_stuck`] counts, by scope and key.
    pub async fn list_stuck(
        &self,
        scope: Option<&str>,
        older_than: Duration,
        limit: u32,
    ) -> Result<Vec<Marker>, Error> {
        if let Some(scope) = scope {
            check_scope(scope)?;
        }
        let age_ms = i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
        let rows = self
            .sql()
            .stuck_matching(self.pool(), scope, age_ms, i64::from(limit))
            .await?;
        Ok(rows.into_iter().map(Marker::from_row).collect())
    }

    /// Forgets at most `at_most` of the markers [`Store::count_stuck`] counts, each as
    /// [`Store::forget`] does one ([`Store::forget_forced`] if `force`: see what that risks);
    /// returns how many. In pages of [`REQUEUE_PAGE`]; a marker still held is skipped unless
    /// `force`. `at_most` bounds a run that new stuck markers keep feeding: pass what
    /// [`Store::count_stuck`] counted.
    pub async fn forget_stuck(
        &self,
        scope: Option<&str>,
        older_than: Duration,
        force: bool,
        at_most: u64,
    ) -> Result<u64, Error> {
        let mut done = 0;
        while done < at_most {
            let page = REQUEUE_PAGE.min(at_most - done);
            let markers = self.list_stuck(scope, older_than, page as u32).await?;
            let mut changed = 0;
            for m in &markers {
                // The key as stored is the key: `forget` stores nothing new from it.
                let key = m.key.as_str();
                let forgot = match force {
                    true => self.forget_forced(&m.scope, key).await,
                    false => self.forget(&m.scope, key).await,
                };
                match forgot {
                    Ok(true) => changed += 1,
                    Ok(false) | Err(Error::Lease(crate::LeaseError::Held { .. })) => {}
                    Err(e) => return Err(e),
                }
            }
            done += changed;
            // A forgotten marker is let go and not read again: a page that changed nothing
            // holds only markers taken meanwhile, which the next page would read again.
            if (markers.len() as u64) < page || changed == 0 {
                break;
            }
        }
        Ok(done)
    }

    /// Writes one row of the operators' audit log (`{table}_audit`, schema version 5): who
    /// (`actor`) did what (`action`) to what (`target`: a key, an id, a filter) and how many
    /// rows it changed. The tool writes one per action that changes state.
    pub async fn record_action(
        &self,
        actor: &str,
        action: &str,
        target: &str,
        changed: u64,
    ) -> Result<(), Error> {
        let changed = i64::try_from(changed).unwrap_or(i64::MAX);
        self.sql()
            .audit_write(self.pool(), actor, action, target, changed)
            .await?;
        Ok(())
    }

    /// The newest `limit` rows of the operators' audit log, newest first.
    pub async fn audit_log(&self, limit: u32) -> Result<Vec<AuditEntry>, Error> {
        let rows = self.sql().audit_list(self.pool(), i64::from(limit)).await?;
        Ok(rows
            .into_iter()
            .map(|(id, at, actor, action, target, changed)| AuditEntry {
                id,
                at,
                actor,
                action,
                target,
                changed: u64::try_from(changed).unwrap_or(0),
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_id_is_12_hex_digits_of_scope_and_error() {
        let id = FailureGroup::id_of("billing.charge", "card declined");
        assert!(FailureGroup::is_id(&id), "{id}");
        assert_eq!(id, FailureGroup::id_of("billing.charge", "card declined"));
        // The NUL keeps the scope's end from sliding into the error.
        assert_ne!(
            FailureGroup::id_of("a", "bc"),
            FailureGroup::id_of("ab", "c")
        );
        for bad in ["", "abc", "ABCDEF012345", "0123456789abc", "0123456789ag"] {
            assert!(!FailureGroup::is_id(bad), "{bad}");
        }
    }
}
