//! Retention per scope: how long each scope keeps its completed markers, kept in the database
//! (`{t}_retention`, schema version 3) so that the code that sets a window and the `idem`
//! tool that purges by it agree.

use std::time::Duration;

use crate::backend::Backend;
use crate::error::{Error, Refusal};
use crate::scope::check_scope;
use crate::store::{MAX_RETENTION, PURGE_BATCH, Store};

/// The shortest window a scope may keep its markers for: a second. A shorter one would purge
/// markers while their jobs' redeliveries are still on their way.
pub const MIN_RETENTION: Duration = Duration::from_secs(1);

/// One scope's retention window, as [`Store::retentions`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Retention {
    /// The scope.
    pub scope: String,
    /// How long its completed markers are kept.
    pub keep: Duration,
}

impl<DB: Backend> Store<DB> {
    /// Keeps the completed markers of `scope` for `keep` (a payment's keys for 30 days, a
    /// webhook's for 72 hours), whatever age [`purge`](Store::purge) is given for the others.
    ///
    /// The window is stored in the database (`{table}_retention`), so the `idem` tool's
    /// `purge` honours it as the workers' own purges do; setting it again changes it. Choose
    /// it longer than the time the scope's broker may still redeliver a job
    /// (`docs/brokers.md` relates it to each broker). A window under [`MIN_RETENTION`], or of
    /// a century or more, is refused with [`Refusal::Retention`] before any I/O.
    pub async fn set_retention(&self, scope: &str, keep: Duration) -> Result<(), Error> {
        check_scope(scope)?;
        if keep < MIN_RETENTION || keep >= MAX_RETENTION {
            return Err(Error::Refused(Refusal::Retention { retention: keep }));
        }
        let keep_ms = i64::try_from(keep.as_millis()).expect("below MAX_RETENTION");
        self.sql()
            .retention_set(self.pool(), scope, keep_ms)
            .await?;
        Ok(())
    }

    /// Removes the window of `scope`: its markers are purged by the age
    /// [`purge`](Store::purge) is given again. Returns whether it had one.
    pub async fn clear_retention(&self, scope: &str) -> Result<bool, Error> {
        check_scope(scope)?;
        Ok(self.sql().retention_clear(self.pool(), scope).await?)
    }

    /// Every scope's window, by scope.
    pub async fn retentions(&self) -> Result<Vec<Retention>, Error> {
        let rows = self.sql().retention_list(self.pool()).await?;
        Ok(rows
            .into_iter()
            .map(|(scope, keep_ms)| Retention {
                scope,
                keep: Duration::from_millis(u64::try_from(keep_ms).unwrap_or(0)),
            })
            .collect())
    }

    /// Deletes the markers of the scopes that have a window of their own
    /// ([`set_retention`](Store::set_retention)) completed longer ago than their window, in
    /// batches of at most [`PURGE_BATCH`]; returns how many. [`purge`](Store::purge) does this
    /// too, and also purges the other scopes by its age.
    pub async fn purge_by_retention(&self) -> Result<u64, Error> {
        let mut total = 0;
        for window in self.retentions().await? {
            let age_ms = i64::try_from(window.keep.as_millis()).unwrap_or(i64::MAX);
            loop {
                let n = self
                    .sql()
                    .purge_scope_batch(self.pool(), &window.scope, age_ms, PURGE_BATCH)
                    .await?;
                total += n;
                if n < PURGE_BATCH as u64 {
                    break;
                }
            }
        }
        Ok(total)
    }
}
