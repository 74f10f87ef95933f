//! What operators read and change of the outbox: its unsent messages, one message by id, and
//! a parked message made pending again.

use std::time::Duration;

use crate::backend::{Backend, OutboxRow};
use crate::error::Error;
use crate::outgoing::Headers;
use crate::store::Store;

/// Where an outbox message stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OutboxState {
    /// Not sent yet: the relay publishes it once it is due.
    Pending,
    /// It failed [`Relay::max_attempts`](crate::outbox::Relay::max_attempts) times: the relay
    /// leaves it until an operator requeues it ([`Store::requeue_outbox`]).
    Parked,
    /// The broker confirmed it.
    Sent,
}

/// One outbox message as operators see it (its payload left out). Times are ISO-8601 UTC text
/// as the database formats them; ages are on the database's clock.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxEntry {
    /// The message's id: the broker's message id, the next consumer's key.
    pub id: String,
    /// The queue, routing key or subject it goes to.
    pub destination: String,
    /// The scope of the handler whose job sent it.
    pub scope: String,
    /// That job's key, as stored.
    pub key: String,
    /// Its position among that job's messages, from 0.
    pub seq: i64,
    /// Failed attempts to publish it since it was written or last requeued.
    pub attempts: i64,
    /// The broker's or the network's error at the last failed attempt.
    pub last_error: Option<String>,
    /// Pending, parked or sent.
    pub state: OutboxState,
    /// When its job's transaction wrote it.
    pub created_at: String,
    /// Milliseconds since `created_at`.
    pub age_ms: i64,
    /// Milliseconds until the relay may take it (negative: it is due; for a parked message,
    /// minus the time since it was parked; for a sent one, the time of its last attempt's
    /// retry, which no relay uses).
    pub due_in_ms: i64,
    /// Its ordering key (its job's key when it was written before ordering keys).
    pub ordering_key: String,
    /// Its headers: content type, `traceparent`, yours (none when it was written before
    /// headers; none either when what is stored no longer reads, edited by hand).
    pub headers: Headers,
}

impl OutboxEntry {
    /// From a row of the operators' statements, in `OutboxRow`'s column order.
    fn from_row(row: OutboxRow) -> OutboxEntry {
        let state = match (row.8 != 0, row.7 != 0) {
            (true, _) => OutboxState::Sent,
            (false, true) => OutboxState::Parked,
            (false, false) => OutboxState::Pending,
        };
        OutboxEntry {
            id: row.0,
            destination: row.1,
            scope: row.2,
            key: row.3,
            seq: row.4,
            attempts: row.5,
            last_error: row.6,
            state,
            created_at: row.9,
            age_ms: row.10,
            due_in_ms: row.11,
            ordering_key: row.12,
            headers: Headers::from_json(row.13.as_deref()).unwrap_or_default(),
        }
    }
}

/// How many parked messages one page of [`Store::requeue_parked`] reads and requeues.
pub const REQUEUE_PARKED_PAGE: u32 = 500;

/// Which parked messages a bulk requeue takes: every one, or those to a destination, whose
/// last error holds a text, parked more than some time ago (all the conditions given).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ParkedFilter {
    /// Only those to this destination (exactly).
    pub destination: Option<String>,
    /// Only those whose last error contains this text (byte for byte).
    pub error: Option<String>,
    /// Only those parked longer ago than this.
    pub parked_before: Option<Duration>,
}

impl ParkedFilter {
    /// Every parked message.
    pub fn new() -> ParkedFilter {
        ParkedFilter::default()
    }

    /// Only those to `destination`.
    pub fn destination(mut self, destination: impl Into<String>) -> ParkedFilter {
        self.destination = Some(destination.into());
        self
    }

    /// Only those whose last error contains `text`.
    pub fn error(mut self, text: impl Into<String>) -> ParkedFilter {
        self.error = Some(text.into());
        self
    }

    /// Only those parked longer ago than `age`.
    pub fn parked_before(mut self, age: Duration) -> ParkedFilter {
        self.parked_before = Some(age);
        self
    }

    fn binds(&self) -> (Option<&str>, Option<&str>, Option<i64>) {
        let age_ms = self
            .parked_before
            .map(|age| i64::try_from(age.as_millis()).unwrap_or(i64::MAX));
        (self.destination.as_deref(), self.error.as_deref(), age_ms)
    }
}

impl<DB: Backend> Store<DB> {
    /// How many parked messages `filter` takes.
    pub async fn count_parked(&self, filter: &ParkedFilter) -> Result<u64, Error> {
        let (destination, error, age_ms) = filter.binds();
        let row = self
            .sql()
            .outbox_parked_count(self.pool(), destination, error, age_ms)
            .await?;
        Ok(row.map_or(0, |(n,)| u64::try_from(n).unwrap_or(0)))
    }

    /// At most `limit` of the parked messages `filter` takes, each key's together and in the
    /// order the relay publishes them.
    pub async fn list_parked_matching(
        &self,
        filter: &ParkedFilter,
        limit: u32,
    ) -> Result<Vec<OutboxEntry>, Error> {
        let (destination, error, age_ms) = filter.binds();
        let rows = self
            .sql()
            .outbox_parked_matching(self.pool(), destination, error, age_ms, limit.into())
            .await?;
        Ok(rows.into_iter().map(OutboxEntry::from_row).collect())
    }

    /// Requeues at most `at_most` of the parked messages `filter` takes, each as
    /// [`requeue_outbox`](Store::requeue_outbox) does one; returns how many. In pages of
    /// [`REQUEUE_PARKED_PAGE`], each key's messages in the order the relay publishes them.
    /// The relay's order holds whatever the order of the requeues (a parked message holds
    /// its whole key back); this order only keeps a key's earlier messages from waiting on a
    /// later page. `at_most` bounds a run whose filter new parked messages keep matching:
    /// pass what [`Store::count_parked`] counted.
    pub async fn requeue_parked(&self, filter: &ParkedFilter, at_most: u64) -> Result<u64, Error> {
        let (destination, error, age_ms) = filter.binds();
        let mut done = 0;
        while done < at_most {
            let page = u64::from(REQUEUE_PARKED_PAGE).min(at_most - done);
            let rows = self
                .sql()
                .outbox_parked_matching(self.pool(), destination, error, age_ms, page as i64)
                .await?;
            let mut changed = 0;
            for row in &rows {
                // A message requeued meanwhile by someone else is no longer parked: skipped
                // here, and not read again by the next page.
                if self.sql().outbox_requeue(self.pool(), &row.0).await? {
                    changed += 1;
                }
            }
            done += changed;
            if (rows.len() as u64) < page || changed == 0 {
                break;
            }
        }
        Ok(done)
    }

    /// At most `limit` unsent messages of the outbox: the parked ones if `parked`, the
    /// pending ones if `pending`; parked first, then oldest first (a job's in its order).
    pub async fn list_outbox(
        &self,
        parked: bool,
        pending: bool,
        limit: u32,
    ) -> Result<Vec<OutboxEntry>, Error> {
        let rows = self
            .sql()
            .outbox_list(self.pool(), parked, pending, limit.into())
            .await?;
        Ok(rows.into_iter().map(OutboxEntry::from_row).collect())
    }

    /// The outbox message `id`, sent or not; `None` if there is none (never written, or
    /// purged after it was sent).
    pub async fn outbox_message(&self, id: &str) -> Result<Option<OutboxEntry>, Error> {
        let row = self.sql().outbox_find(self.pool(), id).await?;
        Ok(row.map(OutboxEntry::from_row))
    }

    /// Makes the parked message `id` pending again, due at once, with no failed attempts (so
    /// that it gets every attempt again before it is parked anew; its last error stays until
    /// the next attempt). `Ok(false)` if no unsent message of that id is parked: see
    /// [`outbox_message`](Store::outbox_message) for where it stands.
    pub async fn requeue_outbox(&self, id: &str) -> Result<bool, Error> {
        Ok(self.sql().outbox_requeue(self.pool(), id).await?)
    }
}
