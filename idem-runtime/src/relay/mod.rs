//! The outbox relay: publishes the messages handlers committed, after their commit, and marks
//! each sent only once its broker confirmed it.

#[cfg(feature = "kafka")]
mod kafka;
#[cfg(feature = "outbox-nats")]
mod nats;
mod operators;
#[cfg(feature = "outbox-rabbitmq")]
mod rabbitmq;
mod run;
#[cfg(feature = "wal-relay")]
mod wal;
mod waves;

use std::future::Future;
use std::time::{Duration, Instant};

#[cfg(feature = "kafka")]
pub use kafka::{Kafka, MESSAGE_ID_HEADER};
#[cfg(feature = "outbox-nats")]
pub use nats::JetStream;
pub use operators::{OutboxEntry, OutboxState, ParkedFilter, REQUEUE_PARKED_PAGE};
#[cfg(feature = "outbox-rabbitmq")]
pub use rabbitmq::RabbitMq;
#[cfg(feature = "wal-relay")]
pub use wal::{SlotLag, WalRelay};

use crate::backend::{Backend, Taken};
use crate::error::Error;
use crate::outgoing::Message;
use crate::record::bounded;
use crate::store::{PURGE_BATCH, Store};

/// A broker the relay publishes to: RabbitMQ ([`RabbitMq`], feature `outbox-rabbitmq`), NATS
/// JetStream ([`JetStream`], feature `outbox-nats`), Kafka ([`Kafka`], feature `kafka`), or one
/// of your own.
///
/// `publish` returns `Ok` only once the broker confirmed the message (a publisher confirm, a
/// JetStream ack): the relay then marks it sent. Give the broker the message's id as its own
/// (AMQP `message_id`, `Nats-Msg-Id`): a message published twice (the relay died between the
/// confirm and its mark) then carries one id, which the broker (JetStream's duplicate window)
/// or the next consumer's claim (its key) recognises.
///
/// [`Relay::run`] may call it from several rounds at once
/// ([`Relay::rounds_in_flight`]); never with two messages of one ordering key at once.
pub trait Publisher: Send + Sync {
    /// Publishes `message` to its destination and waits for the broker's confirm.
    fn publish<'a>(
        &'a self,
        message: &'a Message,
    ) -> impl Future<Output = Result<(), PublishError>> + Send + 'a;

    /// Publishes a round's `messages` in their order and pushes each one's answer onto `done`,
    /// in the same order, as soon as it is known. The relay drops the future when the round's
    /// time is up: what `done` holds by then is marked, the rest is left for a later round.
    ///
    /// The default publishes one at a time. A broker that confirms asynchronously does better
    /// by sending every message first and then waiting for their confirms together (the
    /// RabbitMQ and JetStream publishers do): one round trip for the round, not one each.
    fn publish_all<'a>(
        &'a self,
        messages: &'a [Message],
        done: &'a mut Vec<Result<(), PublishError>>,
    ) -> impl Future<Output = ()> + Send + 'a {
        async move {
            for message in messages {
                done.push(self.publish(message).await);
            }
        }
    }
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
    /// Published and confirmed after the round's hold ran out, and taken since by another
    /// relay (so not marked here): that relay publishes them again, with the same ids.
    pub lost: usize,
    /// Not tried: the round's time was up (publishing a round must end well within its hold),
    /// or a publish did not answer in that time. Due again once the hold runs out.
    pub left: usize,
    /// Not tried: an earlier message of their ordering key failed in this round. They wait
    /// for it (its backoff, or its requeue once parked).
    pub waiting: usize,
}

/// Publishes the outbox's messages after their commit.
///
/// Each round takes due messages, holds them for [`lease`](Relay::lease), and publishes them:
/// a confirmed one is marked sent, a failed one is tried again after a backoff that doubles
/// with each attempt, and parked after [`max_attempts`](Relay::max_attempts). A relay that
/// dies with messages in hand lets another relay take them once their lease ran out: at least
/// once, each with its one id.
///
/// A round publishes for at most three quarters of its hold: a publish that has not answered by
/// then is abandoned with the rest of the round, which stays unmarked until the hold runs
/// out. Every mark (sent, failed) applies only to a message that is unsent and still under
/// this round's hold, so a relay that lost its hold (it stalled, another relay took the
/// messages) marks nothing of what the other relay now holds. The confirmed messages of a
/// round are marked sent in one statement: [`run`](Relay::run) makes it part of the next
/// take's transaction (one commit a round), [`relay_once`](Relay::relay_once) runs it before
/// it returns.
///
/// # Order
///
/// Every message has an ordering key: its job's key (the key alone, not its scope), or the
/// one it was sent with ([`Outbox::send_keyed`](crate::Outbox::send_keyed)).
///
/// - **One key's messages leave in the order they were written**, one at a time: a round
///   publishes in waves (every key's first message, pipelined; then, once confirmed, every
///   key's second...), and a key's message is published only after the one before it was
///   confirmed. A job's messages are in the order it sent them. Messages of different jobs
///   are in the order of their writes (the write's time on the database's clock, to the
///   microsecond, to the millisecond and then the insert's order on SQLite), which is their
///   commit order when the jobs' transactions take turns on something of their own (the
///   same row, the same key), as writers of one key usually do. Those of concurrent
///   transactions that do not take turns are in the order they become visible to the relay.
///   Messages one transaction writes for several jobs under one key of their own (a batch)
///   are in the order of their position in their job, then of their id.
/// - **A failing message holds back only its own key.** Its key is dropped from the round
///   (the key's later messages in the round are let go, [`Relayed::waiting`]) and is not
///   taken again until the message's backoff ran out; a parked message holds its key back
///   until an operator requeues it. Other keys go on.
/// - **Several relays never publish one key at once.** A take takes only the keys whose
///   earliest unsent message is due and no message of which is held, backing off or parked,
///   and takes such a key by locking that earliest message with `FOR UPDATE SKIP LOCKED`
///   (PostgreSQL, MariaDB 10.6+, MySQL 8): a key another take is taking is skipped, and one
///   taken is held until its round marks it. On SQLite writers take turns: one take runs at
///   a time.
/// - **Across keys** the order is the database's visibility order: a round takes the keys
///   whose messages are committed, oldest write first; a transaction that wrote first but
///   committed last is not visible to a round that runs between the two commits, so its
///   messages leave after the other's. Failures, backoffs and several relays reorder keys
///   freely.
///
/// A message written by an idem before ordering keys (no ordering key in its row: written
/// before `migrate`, or by an older worker since) is a key of its own.
pub struct Relay<DB: Backend, P: Publisher> {
    store: Store<DB>,
    publisher: P,
    batch: u32,
    lease: Duration,
    backoff: Duration,
    max_attempts: u32,
    listen: bool,
    rounds_in_flight: usize,
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
            listen: true,
            rounds_in_flight: 4,
        }
    }

    /// How many messages one round takes at most.
    pub fn batch(mut self, batch: u32) -> Self {
        self.batch = batch.max(1);
        self
    }

    /// How long a round holds the messages it took: longer than publishing a batch takes
    /// (a round publishes for three quarters of it at most). At least a millisecond.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease.max(Duration::from_millis(1));
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

    /// Whether [`run`](Relay::run) is woken by the commits of new messages (the default: its
    /// store's own, in the process, on every database; other stores' where the database
    /// announces them, PostgreSQL), or only polls. A store told it is behind a pooler in
    /// transaction mode ([`Store::behind_transaction_pooler`]) is woken by its own commits
    /// but does not listen for others' whatever this says: a `LISTEN` there does not keep its
    /// server connection, and its notifications never arrive.
    pub fn listen(mut self, listen: bool) -> Self {
        self.listen = listen;
        self
    }

    /// How many rounds [`run`](Relay::run) keeps in flight while there is a backlog (at least
    /// 1; 4 by default): while one round publishes, the next is taken and the one before is
    /// marked, so that the database's statements and commits overlap the broker's confirms
    /// instead of adding to them. The default is what ran fastest to RabbitMQ and JetStream
    /// in the project's benchmark (`docs/outbox.md`), and it is no slower with no broker. The rounds take in turn, each after the one before it took,
    /// and a round takes only keys no other round holds: one key is still published by one
    /// round at a time, in order. Each round in flight uses a connection of the store's pool
    /// for its statements, and calls the publisher while the others may be calling it too:
    /// 1 for a publisher that must publish one round at a time.
    pub fn rounds_in_flight(mut self, rounds: usize) -> Self {
        self.rounds_in_flight = rounds.max(1);
        self
    }

    /// One round: takes the due messages, publishes them within the round's time, marks them.
    pub async fn relay_once(&self) -> Result<Relayed, Error> {
        let round = self.take(None).await?;
        Ok(self.finish(round, false).await?.0)
    }

    /// A round's take: its messages, held for the lease, and the end of its time to publish;
    /// `confirmed`, the round before's, marked sent in the same transaction.
    async fn take(&self, confirmed: Option<Confirmed>) -> Result<TakenRound, Error> {
        // The hold runs from the take's statement, which runs after this instant: the round's
        // time, measured from here, ends before the hold does.
        let deadline = Instant::now() + self.lease.mul_f64(0.75);
        let (pool, st) = (self.store.pool(), self.store.sql());
        let (limit, lease_ms) = (i64::from(self.batch), millis(self.lease));
        let confirmed = confirmed.unwrap_or_default();
        let sent: Vec<&str> = confirmed.ids.iter().map(String::as_str).collect();
        let hold = confirmed.hold.as_str();
        let take = || DB::outbox_take(pool, st, limit, lease_ms, &sent, hold);
        let taken = again::<DB, _, _>(take).await?;
        Ok(TakenRound { taken, deadline })
    }

    /// Marks `ids` sent, if still unsent and under `hold`; how many were.
    async fn mark_sent(&self, ids: &[&str], hold: &str) -> Result<usize, Error> {
        let (pool, st) = (self.store.pool(), self.store.sql());
        let marked = again::<DB, _, _>(|| DB::outbox_sent(pool, st, ids, hold)).await?;
        Ok(usize::try_from(marked).unwrap_or(usize::MAX).min(ids.len()))
    }

    /// A taken round published within its time, then marked. With `defer`, a round that
    /// ended within its time hands its confirmed messages back instead of marking them, for
    /// its lane's next take to mark ([`Relayed::sent`] then counts them all and
    /// [`Relayed::lost`] none): the take runs at once, and a quarter of the hold is left
    /// for it.
    async fn finish(
        &self,
        round: TakenRound,
        defer: bool,
    ) -> Result<(Relayed, Option<Confirmed>), Error> {
        let st = self.store.sql();
        let pool = self.store.pool();
        let TakenRound {
            taken: Taken { messages, hold },
            deadline,
        } = round;
        let keys = waves::Keys::of(&messages);
        let taken: Vec<(String, u32)> = messages
            .iter()
            .map(|m| (m.id.clone(), m.attempts))
            .collect();
        let mut round = waves::Round::new(messages);
        let left = deadline.saturating_duration_since(Instant::now());
        if !taken.is_empty() && !left.is_zero() {
            let publishing = round.publish(&self.publisher, &keys);
            // Out of time: the answers so far are marked, the rest of the round is left.
            let _ = tokio::time::timeout(left, publishing).await;
        }
        let defer = defer && Instant::now() < deadline;
        let mut relayed = Relayed::default();
        let mut sent = Vec::with_capacity(taken.len());
        let mut waiting = Vec::new();
        for (at, answer) in round.answers(&keys) {
            let (id, attempts) = (taken[at].0.as_str(), taken[at].1);
            match answer {
                waves::Answer::Published => sent.push(id),
                waves::Answer::Waiting => waiting.push(id),
                waves::Answer::Left => relayed.left += 1,
                waves::Answer::Failed(e) => {
                    let attempts = attempts.saturating_add(1);
                    let park = attempts >= self.max_attempts;
                    let shift = attempts.saturating_sub(1).min(16);
                    let wait = self
                        .backoff
                        .saturating_mul(1 << shift)
                        .min(Duration::from_secs(300));
                    let error = e.to_string();
                    let error = bounded(&error, ERROR_TEXT);
                    // A parked message is due at once: its `next_attempt_at` is then when
                    // it was parked, which `requeue --all --parked-before` filters on (no
                    // relay takes a parked message, whenever it is due).
                    let retry = if park { 0 } else { millis(wait) };
                    let failed = || st.outbox_failed(pool, id, &error, retry, park, &hold);
                    again::<DB, _, _>(failed).await?;
                    if park {
                        relayed.parked += 1;
                    } else {
                        relayed.failed += 1;
                    }
                }
            }
        }
        if !waiting.is_empty() {
            again::<DB, _, _>(|| DB::outbox_release(pool, st, &waiting, &hold)).await?;
            relayed.waiting = waiting.len();
        }
        if sent.is_empty() {
            return Ok((relayed, None));
        }
        if defer {
            relayed.sent = sent.len();
            let ids = sent.into_iter().map(str::to_owned).collect();
            return Ok((relayed, Some(Confirmed { ids, hold })));
        }
        let marked = self.mark_sent(&sent, &hold).await?;
        relayed.sent = marked;
        relayed.lost = sent.len() - marked;
        Ok((relayed, None))
    }
}

/// Runs one of the relay's statements again while the database refuses it as a deadlock's
/// victim (`is_transient`: MySQL's 1213, PostgreSQL's serialization failures), at most
/// [`ATTEMPTS`] times in all. Relays, and the rounds of one relay, take and mark side by side,
/// and InnoDB may pick either as its victim. Each statement is a transaction of its own that
/// the database rolled back whole, and each is fenced by its round's hold, so running it again
/// changes nothing twice.
async fn again<DB: Backend, T, F>(mut statement: impl FnMut() -> F) -> Result<T, sqlx::Error>
where
    F: Future<Output = Result<T, sqlx::Error>>,
{
    for _ in 1..ATTEMPTS {
        match statement().await {
            Err(e) if DB::is_transient(&e) => continue,
            done => return done,
        }
    }
    statement().await
}

/// How many times [`again`] runs a statement.
const ATTEMPTS: usize = 5;

/// A round's confirmed messages and its hold, to be marked sent.
#[derive(Default)]
struct Confirmed {
    ids: Vec<String>,
    hold: String,
}

/// A round's take and the instant its publishing must end by.
struct TakenRound {
    taken: Taken,
    deadline: Instant,
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
            let n = self
                .sql()
                .outbox_purge(self.pool(), age_ms, PURGE_BATCH)
                .await?;
            total += n;
            if n < PURGE_BATCH as u64 {
                return Ok(total);
            }
        }
    }
}

/// The most of a publisher's error text kept in `last_error`, in bytes.
const ERROR_TEXT: usize = 2000;

/// Milliseconds for a statement, capped at a century (the databases' interval arithmetic).
fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis())
        .unwrap_or(i64::MAX)
        .min(100 * 366 * 24 * 3600 * 1000)
}
