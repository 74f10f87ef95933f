//! What operators read of the markers: one marker by key, and the jobs still in progress.

use crate::backend::{Backend, MarkerRow, StepRow};
use crate::error::Error;
use crate::key::{IntoKey, Key};
use crate::scope::check_scope;
use crate::store::Store;

/// Whether a marker's job is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MarkerState {
    /// A lease-mode delivery holds the key (or held it: see [`Marker::lease_ms_left`]).
    InProgress,
    /// The job's effect was committed (transaction mode) or its call completed (lease mode).
    Completed,
    /// The job failed for good (a lease-mode body's permanent error): completed, with its
    /// error ([`Marker::error`]); every delivery gets
    /// [`Outcome::Failed`](crate::Outcome::Failed) until an operator requeues it
    /// ([`Store::requeue`]).
    Failed,
}

/// One marker as [`Store::inspect`] reads it. Times are ISO-8601 UTC text as the database
/// formats them (`2026-11-30T17:30:00.123456Z`; SQLite keeps milliseconds).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Marker {
    /// The handler's scope.
    pub scope: String,
    /// The encoded key.
    pub key: String,
    /// Done, or still held.
    pub state: MarkerState,
    /// Deliveries that took the key: 1, plus lease takeovers.
    pub attempts: i64,
    /// The lease holder's fencing token (lease mode only).
    pub token: Option<i64>,
    /// When the key was first claimed.
    pub created_at: String,
    /// When the job completed.
    pub completed_at: Option<String>,
    /// When the current lease runs out (lease mode, while in progress; none once released).
    pub locked_until: Option<String>,
    /// Milliseconds from the database's now to `locked_until`: negative once the lease has
    /// run out (the next delivery takes it over), none when there is no lease.
    pub lease_ms_left: Option<i64>,
    /// The value stored with the marker, as the JSON text it was stored as: a `replay`
    /// handler's `Ok` value, or the response the HTTP layer replays (its status, chosen
    /// headers and base64 body). `None` when nothing was stored.
    pub value: Option<String>,
    /// The error a failed job recorded ([`MarkerState::Failed`]).
    pub error: Option<String>,
}

impl Marker {
    pub(crate) fn from_row(row: MarkerRow) -> Marker {
        let (
            scope,
            key,
            state,
            attempts,
            token,
            created_at,
            completed_at,
            locked_until,
            left,
            error,
        ) = row;
        Marker {
            scope,
            key,
            state: match (state.as_str(), &error) {
                ("completed", Some(_)) => MarkerState::Failed,
                ("completed", None) => MarkerState::Completed,
                _ => MarkerState::InProgress,
            },
            attempts,
            // A negative token is a transaction claim's nonce, not a lease's.
            token: token.filter(|t| *t > 0),
            created_at,
            completed_at,
            locked_until,
            lease_ms_left: left,
            value: None,
            error,
        }
    }
}

/// A step a lease-mode body recorded ([`Lease::step`](crate::Lease::step)), as
/// [`Store::steps`] reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordedStep {
    /// The step's name.
    pub name: String,
    /// Where the step was in its body: 1 for the first.
    pub position: u32,
    /// The fencing token of the holder that recorded it.
    pub token: i64,
    /// Its value, as JSON.
    pub value: String,
    /// When it was recorded (ISO-8601 UTC).
    pub recorded_at: String,
}

impl RecordedStep {
    fn from_row(row: StepRow) -> RecordedStep {
        let (name, position, token, value, recorded_at) = row;
        RecordedStep {
            name,
            position: u32::try_from(position).unwrap_or(u32::MAX),
            token,
            value,
            recorded_at,
        }
    }
}

impl<DB: Backend> Store<DB> {
    /// The steps the lease-mode deliveries of `(scope, key)` recorded, in their body's order:
    /// what a delivery that takes the key over gets back instead of running them. Empty for a
    /// job without steps, and once its marker was forgotten or purged.
    pub async fn steps<K: IntoKey + ?Sized>(
        &self,
        scope: &str,
        key: &K,
    ) -> Result<Vec<RecordedStep>, Error> {
        check_scope(scope)?;
        let key = Key::new(key)?;
        let rows = self
            .sql()
            .steps_read(self.pool(), scope, key.as_str())
            .await?;
        Ok(rows.into_iter().map(RecordedStep::from_row).collect())
    }

    /// The marker of `(scope, key)`, or `None` if no delivery claimed it (or it was forgotten
    /// or purged). For operators: what did idem do with this job?
    pub async fn inspect<K: IntoKey + ?Sized>(
        &self,
        scope: &str,
        key: &K,
    ) -> Result<Option<Marker>, Error> {
        check_scope(scope)?;
        let key = Key::new(key)?;
        let row = self.sql().inspect(self.pool(), scope, key.as_str()).await?;
        let Some(mut marker) = row.map(Marker::from_row) else {
            return Ok(None);
        };
        // The stored value on its own read: the claims' statement that reads it, where a
        // stored response of up to a megabyte stays out of the listings that share the row.
        let mut conn = self.pool().acquire().await?;
        if let Some(found) = self.sql().marker(&mut conn, scope, key.as_str()).await? {
            marker.value = found.recorded.result;
        }
        Ok(Some(marker))
    }

    /// At most `limit` markers of `scope` still in progress (lease mode), those whose lease ran
    /// out or was released first: the jobs to look at when a queue seems stuck.
    pub async fn list_in_progress(&self, scope: &str, limit: u32) -> Result<Vec<Marker>, Error> {
        check_scope(scope)?;
        let limit = i64::from(limit);
        let rows = self
            .sql()
            .in_progress(self.pool(), Some(scope), limit)
            .await?;
        Ok(rows.into_iter().map(Marker::from_row).collect())
    }

    /// At most `limit` markers of jobs that failed for good ([`MarkerState::Failed`]: a
    /// lease-mode body's permanent error), of `scope` or of every scope (`None`), newest
    /// first, each with its [`error`](Marker::error). A scan of the completed markers: an
    /// operator's query, not a worker's.
    pub async fn list_failed(&self, scope: Option<&str>, limit: u32) -> Result<Vec<Marker>, Error> {
        if let Some(scope) = scope {
            check_scope(scope)?;
        }
        let rows = self
            .sql()
            .failed(self.pool(), scope, i64::from(limit))
            .await?;
        Ok(rows.into_iter().map(Marker::from_row).collect())
    }

    /// Lets the next delivery of a job that failed for good run it again: its marker becomes
    /// a released lease (its fencing token up, its attempts, fingerprint and recorded steps
    /// kept), which the next delivery takes over, resuming after the recorded steps. Returns
    /// whether the marker was a failed one (`false`: no marker, or one that did not fail, and
    /// nothing was changed). For operators, once what made the job fail was fixed (a card
    /// updated, a bug deployed away).
    pub async fn requeue<K: IntoKey + ?Sized>(&self, scope: &str, key: &K) -> Result<bool, Error> {
        check_scope(scope)?;
        let key = Key::new(key)?;
        Ok(self.sql().requeue(self.pool(), scope, key.as_str()).await?)
    }

    /// [`list_in_progress`](Store::list_in_progress) across every scope: at most `limit`
    /// markers still in progress, those whose lease ran out or was released first.
    pub async fn list_all_in_progress(&self, limit: u32) -> Result<Vec<Marker>, Error> {
        let rows = self
            .sql()
            .in_progress(self.pool(), None, i64::from(limit))
            .await?;
        Ok(rows.into_iter().map(Marker::from_row).collect())
    }
}
