//! The outbox relay: publishes the messages handlers committed, after their commit, and marks
//! each sent only once its broker confirmed it.

#[cfg(feature = "outbox-nats")]
mod nats;
mod operators;
#[cfg(feature = "outbox-rabbitmq")]
mod rabbitmq;

use std::future::Future;
use std::time::Duration;

#[cfg(feature = "outbox-nats")]
pub use nats::JetStream;
pub use operators::{OutboxEntry, OutboxState};
#[cfg(feature = "outbox-rabbitmq")]
pub use rabbitmq::RabbitMq;

use crate::backend::Backend;
use crate::error::Error;
use crate::outgoing::Message;
use crate::store::{PURGE_BATCH, Store};

/// A broker the relay publishes to: RabbitMQ ([`RabbitMq`], feature `outbox-rabbitmq`), NATS
/// JetStream ([`JetStream`], feature `outbox-nats`), or one of your own.
///
/// `publish` returns `Ok` only once the broker confirmed the message (a publisher confirm, a
/// JetStream ack): the relay then marks it sent. Give the broker the message's id as its own
/// (AMQP `message_id`, `Nats-Msg-Id`): a message published twice (the relay died between the
/// confirm and its mark) then carries one id, which the broker (JetStream's duplicate window)
/// or the next consumer's claim (its key) recognises.
pub trait Publisher: Send + Sync {
    /// Publishes `message` to its destination and waits for the broker's confirm.
    fn publish<'a>(
        &'a self,
        message: &'a Message,
    ) -> impl Future<Output = Result<(), PublishError>> + Send + 'a;
}

/// Why a publisher could not publish a message: it is tried again later, and parked after
/// [`Relay::max_attempts`].
pub type PublishError = Box<dyn std::error::Error + Send + Sync>;

/// What one [`Relay::relay_once`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Relayed {
    /// Published and confirmed.
    pub sent: usize,
    /// Not published; to be tried again.
    pub failed: usize,
    /// Not published, for the last time: parked until an operator requeues them.
    pub parked: usize,
}

/// Publishes the outbox's messages after their commit.
///
/// Each round takes the due messages (oldest first, a job's in the order it sent them),
/// skipping those another relay holds (`FOR UPDATE SKIP LOCKED` on PostgreSQL, MariaDB 10.6+
/// and MySQL 8; SQLite's writers take turns), holds them for [`lease`](Relay::lease), and
/// publishes each: a confirmed one is marked sent, a failed one is tried again after a
/// backoff that doubles with each attempt, and parked after
/// [`max_attempts`](Relay::max_attempts). A relay that dies with messages in hand lets another
/// relay take them once their lease ran out: at least once, each with its one id.
///
/// Order: with one relay and no failed publish, the messages of one job leave in the order it
/// sent them, and jobs in the order their transactions began. A failed message is retried
/// later, so messages sent after it may leave first; several relays publish side by side.
pub struct Relay<DB: Backend, P: Publisher> {
    store: Store<DB>,
    publisher: P,
    batch: u32,
    lease: Duration,
    backoff: Duration,
    max_attempts: u32,
}

impl<DB: Backend, P: Publisher> Relay<DB, P> {
    /// A relay of `store`'s outbox to `publisher`: batches of 100, a lease of 30 s, a backoff
    /// of 1 s doubling up to 5 min, 10 attempts.
    pub fn new(store: Store<DB>, publisher: P) -> Self {
        Relay {
            store,
            publisher,
            batch: 100,
            lease: Duration::from_secs(30),
            backoff: Duration::from_secs(1),
            max_attempts: 10,
        }
    }

    /// How many messages one round takes at most.
    pub fn batch(mut self, batch: u32) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// How long a round holds the messages it took: longer than publishing a batch takes.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// The wait before the first retry of a failed message (doubling with each attempt, at
    /// most 5 min).
    pub fn backoff(mut self, backoff: Duration) -> Self {
        self.backoff = backoff;
        self
    }

    /// After how many failed attempts a message is parked.
    pub fn max_attempts(mut self, max_attempts: u32) -> Self {
        self.max_attempts = max_attempts.max(1);
        self
    }

    /// One round: takes the due messages, publishes them, marks each.
    pub async fn relay_once(&self) -> Result<Relayed, Error> {
        let st = self.store.sql();
        let pool = self.store.pool();
        let lease_ms = millis(self.lease);
        let taken = DB::outbox_take(pool, st, i64::from(self.batch), lease_ms).await?;
        let mut relayed = Relayed::default();
        for message in &taken {
            match self.publisher.publish(message).await {
                Ok(()) => {
                    DB::outbox_sent(pool, st, &message.id).await?;
                    relayed.sent += 1;
                }
                Err(e) => {
                    let attempts = message.attempts.saturating_add(1);
                    let park = attempts >= self.max_attempts;
                    let shift = attempts.saturating_sub(1).min(16);
                    let wait = self
                        .backoff
                        .saturating_mul(1 << shift)
                        .min(Duration::from_secs(300));
                    let error = e.to_string();
                    DB::outbox_failed(pool, st, &message.id, &error, millis(wait), park).await?;
                    if park {
                        relayed.parked += 1;
                    } else {
                        relayed.failed += 1;
                    }
                }
            }
        }
        Ok(relayed)
    }

    /// Relays until `stop` resolves: a round, then, when it found nothing to send, a wait of
    /// `poll` before the next one. A database error ends it (restart it from your supervisor).
    ///
    /// On PostgreSQL the wait ends early at the commit of a new message: each commit with
    /// messages sends `NOTIFY` on the channel `{table}_outbox`, on which the relay listens
    /// from a connection of its own (not one of the store's pool). Elsewhere it lasts `poll`.
    pub async fn run(&self, poll: Duration, stop: impl Future<Output = ()>) -> Result<(), Error> {
        let mut stop = std::pin::pin!(stop);
        // Listening before the first round: a commit from then on is announced, even one
        // that lands while a round runs (the notification waits in the listener).
        let listen = DB::outbox_listen(self.store.pool(), self.store.sql());
        let Some(listen) = unless(stop.as_mut(), listen).await else {
            return Ok(());
        };
        let mut listen = listen?;
        loop {
            let Some(relayed) = unless(stop.as_mut(), self.relay_once()).await else {
                return Ok(());
            };
            if relayed?.sent > 0 {
                continue;
            }
            let waited = match &mut listen {
                Some(listen) => unless(stop.as_mut(), listen.wait(poll)).await,
                None => unless(stop.as_mut(), tokio::time::sleep(poll)).await,
            };
            if waited.is_none() {
                return Ok(());
            }
        }
    }
}

impl<DB: Backend> Store<DB> {
    /// Deletes the outbox's messages sent more than `older_than` ago, in batches of at most
    /// [`PURGE_BATCH`](crate::PURGE_BATCH) rows; returns how many. Keep them as long as a
    /// consumer may still see a message again (its broker's redelivery horizon): the id is
    /// what it claims, not the row.
    pub async fn purge_outbox(&self, older_than: Duration) -> Result<u64, Error> {
        let age_ms = millis(older_than);
        let mut total = 0;
        loop {
            let n = DB::outbox_purge(self.pool(), self.sql(), age_ms, PURGE_BATCH).await?;
            total += n;
            if n < PURGE_BATCH as u64 {
                return Ok(total);
            }
        }
    }
}

/// `work`'s output, or `None` if `stop` resolved first.
async fn unless<T>(
    mut stop: std::pin::Pin<&mut impl Future<Output = ()>>,
    work: impl Future<Output = T>,
) -> Option<T> {
    use std::task::Poll;
    let mut work = std::pin::pin!(work);
    std::future::poll_fn(|cx| {
        if stop.as_mut().poll(cx).is_ready() {
            return Poll::Ready(None);
        }
        work.as_mut().poll(cx).map(Some)
    })
    .await
}

/// Milliseconds for a statement, capped at a century (the databases' interval arithmetic).
fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis())
        .unwrap_or(i64::MAX)
        .min(100 * 366 * 24 * 3600 * 1000)
}
