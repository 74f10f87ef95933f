//! The consumer loop itself: deliveries from a broker, each run through a handler and settled
//! as [`Settle::decide`] says, a bound on how many run at once, and a shutdown that never acks
//! what was not kept.

use std::fmt::{self, Debug, Display};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt as _;
use futures_util::StreamExt as _;
use futures_util::future::{Fuse, FusedFuture as _};
use futures_util::stream::FuturesUnordered;
use serde::de::DeserializeOwned;
use tokio::time::MissedTickBehavior;
use tracing::Instrument as _;

use super::{Classify, Disposition, Settle};
use crate::outcome::Outcome;

/// The span of each delivery, from its parsing to its settlement, with OpenTelemetry's
/// messaging attributes (a `process` span: `messaging.system`, `messaging.operation.type`,
/// `messaging.destination.name`, `messaging.message.id`) and idem's: `idem.delivery_count`
/// (which delivery of the message it is), `idem.outcome` and `idem.disposition` (as
/// [`SETTLED_TOTAL`]'s labels). The handler's `idem.claim` span is its child.
pub const DELIVERY_SPAN: &str = "idem.delivery";

/// The counter of settled deliveries, labelled `disposition` (`ack`, `retry`, `dead_letter`)
/// and `outcome` (what the handler answered: `applied`, `duplicate`, `replayed`, `failed`,
/// `error`, `unparsable`, `panicked`).
pub const SETTLED_TOTAL: &str = "idem_settled_total";

/// Where deliveries come from: a broker's consumer, as one of idem's adapters wraps it.
pub trait Source {
    /// One delivery of a message.
    type Delivery: Delivery<Error = Self::Error>;
    /// What fails when the broker cannot be reached.
    type Error: std::error::Error + Send + Sync + 'static;

    /// The next delivery, or `None` once the broker ended the consumer. Cancel-safe: the
    /// runner drops this future when another event comes first, and no delivery may be lost
    /// then (a stream's `next` is).
    fn next(&mut self) -> impl Future<Output = Option<Result<Self::Delivery, Self::Error>>> + Send;

    /// Asks the broker to send no more deliveries (a consumer's cancel), at shutdown, before
    /// the deliveries in flight end.
    fn stop(&mut self) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Once the deliveries in flight ended or were dropped: hands every delivery nobody
    /// settled back to the broker, so that it is delivered again (RabbitMQ's channel close).
    fn close(self) -> impl Future<Output = Result<(), Self::Error>> + Send;
}

/// One delivery of a message, and how its broker settles it.
pub trait Delivery: Send {
    /// What fails when the settlement does not reach the broker.
    type Error: std::error::Error + Send + Sync + 'static;

    /// The message's body, as its producer wrote it.
    fn payload(&self) -> &[u8];

    /// Which delivery of the message this is, from 1: the broker's own count where it keeps
    /// one, else the adapter's.
    fn count(&self) -> u32;

    /// The message's id, for logs, where it has one.
    fn id(&self) -> Option<&str> {
        None
    }

    /// The broker, as OpenTelemetry's `messaging.system` names it (`rabbitmq`, `aws_sqs`,
    /// `nats`), for the delivery's span.
    fn system(&self) -> &'static str {
        "unknown"
    }

    /// Where the message was consumed from (the queue, the subject), for the delivery's span.
    fn destination(&self) -> Option<&str> {
        None
    }

    /// Keeps the delivery from being handed out again while its handler runs: resets the
    /// broker's timer of an unsettled delivery (JetStream's `ack_wait`, SQS's visibility
    /// timeout) to its whole length from now. The runner calls it every
    /// [`Runner::heartbeat`] period while the handler runs, one call at a time, never once the
    /// delivery is settled. An error is logged and the handler goes on (the delivery may come
    /// again; its handler's claim answers that delivery `InProgress` or `Duplicate`).
    ///
    /// By default it does nothing: a broker that waits for the consumer as long as it is
    /// connected (RabbitMQ, up to its `consumer_timeout`) needs nothing.
    fn extend(&self) -> impl Future<Output = Result<(), Self::Error>> + Send {
        async { Ok(()) }
    }

    /// Settles the delivery on its broker as `disposition` says. `Ok` once the broker took
    /// the settlement (a retry or a dead letter that is a copy of the message is confirmed
    /// before the delivery is acked).
    fn settle(
        self,
        disposition: &Disposition,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;
}

/// What [`Runner::on_settled`] sees of each delivery once its broker took the settlement.
#[derive(Debug)]
#[non_exhaustive]
pub struct Settled<'a> {
    /// The message's id, where it has one.
    pub id: Option<&'a str>,
    /// Which delivery of it this was, from 1.
    pub delivery: u32,
    /// What the handler answered: `applied`, `duplicate`, `replayed`, `failed` (an
    /// [`Outcome`]), `error` (an error; see `error`), `unparsable` (the payload is not a job)
    /// or `panicked`.
    pub outcome: &'static str,
    /// The error's text, when the handler failed.
    pub error: Option<&'a str>,
    /// How the delivery was settled.
    pub disposition: &'a Disposition,
}

/// What a [`Runner::run`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Tally {
    /// Deliveries acked after their handler answered `Applied`.
    pub applied: u64,
    /// Deliveries acked for another reason: a duplicate, a replay, a job that failed for good
    /// earlier.
    pub acked_otherwise: u64,
    /// Deliveries given back to be delivered again later.
    pub retried: u64,
    /// Deliveries dead-lettered.
    pub dead_lettered: u64,
    /// Deliveries whose handler had not answered when the shutdown's bound ran out: left
    /// unsettled (their transaction rolled back when dropped), so that the broker delivers them
    /// again.
    pub abandoned: u64,
}

impl Tally {
    /// Every delivery acked.
    pub fn acked(&self) -> u64 {
        self.applied + self.acked_otherwise
    }
}

/// The default period of [`Runner::heartbeat`]: a third of the 30 s that JetStream's
/// `ack_wait` and SQS's visibility timeout default to.
const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(10);

type Observer = Arc<dyn Fn(&Settled<'_>) + Send + Sync>;

/// The consumer loop: takes deliveries from a [`Source`], at most
/// [`in_flight`](Runner::in_flight) at once, parses each payload (JSON) into the handler's job,
/// runs the handler and settles the delivery as [`Settle::decide`] says; a payload that does
/// not parse is dead-lettered, a handler that panics is retried like one that failed.
///
/// On shutdown it stops taking deliveries, gives the handlers running the
/// [`drain`](Runner::drain) bound to end and settles those that did. A handler that did not
/// end is dropped unsettled: its transaction rolls back, nothing of it is kept, and the broker
/// delivers it again. Nothing is ever acked before its handler answered.
///
/// While a handler runs, its delivery's [`Delivery::extend`] is called every
/// [`heartbeat`](Runner::heartbeat) period, so that a handler that runs longer than the
/// broker's ack wait or visibility timeout is not delivered again meanwhile.
#[derive(Clone)]
pub struct Runner {
    settle: Settle,
    in_flight: usize,
    drain: Duration,
    heartbeat: Option<Duration>,
    observer: Option<Observer>,
}

impl Debug for Runner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Runner")
            .field("settle", &self.settle)
            .field("in_flight", &self.in_flight)
            .field("drain", &self.drain)
            .field("heartbeat", &self.heartbeat)
            .field("on_settled", &self.observer.is_some())
            .finish()
    }
}

impl Default for Runner {
    fn default() -> Self {
        Runner::new()
    }
}

impl Runner {
    /// The defaults: [`Settle::new`]'s policy, 16 deliveries in flight, 30 s for the handlers
    /// running at shutdown, a [`heartbeat`](Runner::heartbeat) every 10 s.
    pub fn new() -> Runner {
        Runner {
            settle: Settle::new(),
            in_flight: 16,
            drain: Duration::from_secs(30),
            heartbeat: Some(DEFAULT_HEARTBEAT),
            observer: None,
        }
    }

    /// How deliveries are settled (the redelivery cap, the backoff).
    pub fn settle(mut self, settle: Settle) -> Runner {
        self.settle = settle;
        self
    }

    /// How many deliveries are handled at once (at least 1). Give the broker the same
    /// prefetch, and the pool a connection more than this.
    pub fn in_flight(mut self, n: usize) -> Runner {
        self.in_flight = n.max(1);
        self
    }

    /// How long the handlers running at shutdown get to end before they are dropped
    /// unsettled. Keep it under the time your platform gives a stopping process.
    pub fn drain(mut self, bound: Duration) -> Runner {
        self.drain = bound;
        self
    }

    /// How often a running handler's delivery is kept from being delivered again
    /// ([`Delivery::extend`]: on JetStream an "in progress" ack, on SQS a visibility change,
    /// on RabbitMQ nothing), from `every` after the handler began until it ends;
    /// `Duration::ZERO` turns it off.
    ///
    /// Keep it well under the broker's timer (JetStream's `ack_wait`, SQS's visibility
    /// timeout): a beat that is late or lost must not let the timer run out. The default,
    /// 10 s, is a third of both brokers' defaults (30 s each), so two beats in a row may fail
    /// before the delivery is handed out again; a handler that ends within 10 s, as most do,
    /// costs no call at all. With shorter timers, give it a shorter period.
    pub fn heartbeat(mut self, every: Duration) -> Runner {
        self.heartbeat = (!every.is_zero()).then_some(every);
        self
    }

    /// Calls `f` for each delivery once its broker took the settlement (for logs and tests;
    /// the runner also counts [`SETTLED_TOTAL`] and logs each dead letter).
    pub fn on_settled(mut self, f: impl Fn(&Settled<'_>) + Send + Sync + 'static) -> Runner {
        self.observer = Some(Arc::new(f));
        self
    }

    /// Runs until `shutdown` resolves or the source ends, then drains (see [`Runner`]).
    /// `Err` when the source or a settlement failed (the broker's connection is lost): the
    /// runner stops taking deliveries at once and drains the rest, whose settlements are
    /// tried too; whatever was not settled is delivered again.
    pub async fn run<S, J, F, Fut, T, E>(
        &self,
        mut source: S,
        handler: F,
        shutdown: impl Future<Output = ()>,
    ) -> Result<Tally, S::Error>
    where
        S: Source,
        J: DeserializeOwned,
        F: Fn(J) -> Fut,
        Fut: Future<Output = Result<Outcome<T>, E>>,
        E: Classify + Display,
    {
        let mut tally = Tally::default();
        let mut failed: Option<S::Error> = None;
        let mut running = FuturesUnordered::new();
        let mut shutdown = pin!(shutdown);
        loop {
            tokio::select! {
                // Shutdown first, then settlements, then new deliveries: a stopping runner
                // takes nothing more, and a full one frees a place before it takes another.
                biased;
                () = &mut shutdown => break,
                Some(done) = running.next(), if !running.is_empty() => {
                    if let Err(e) = self.count(done, &mut tally) {
                        failed = Some(e);
                        break;
                    }
                }
                next = source.next(), if running.len() < self.in_flight => match next {
                    Some(Ok(delivery)) => running.push(self.handle(delivery, &handler)),
                    Some(Err(e)) => {
                        failed = Some(e);
                        break;
                    }
                    None => break,
                },
            }
        }
        let stopped = source.stop().await;
        let drained = tokio::time::timeout(self.drain, async {
            while let Some(done) = running.next().await {
                if let Err(e) = self.count(done, &mut tally) {
                    failed.get_or_insert(e);
                }
            }
        })
        .await;
        if drained.is_err() {
            tally.abandoned = running.len() as u64;
            tracing::warn!(
                abandoned = tally.abandoned,
                "idem: handlers still running at the end of the shutdown's bound were dropped \
                 unsettled; their broker delivers them again"
            );
        }
        // Dropped before the source closes, so that their transactions' rollbacks are on their
        // way (the pool runs them) before the broker hands the deliveries out again; a
        // redelivery that still meets one gets `InProgress` and waits its turn.
        drop(running);
        let closed = source.close().await;
        match (failed, stopped.and(closed)) {
            (Some(e), _) | (None, Err(e)) => Err(e),
            (None, Ok(())) => Ok(tally),
        }
    }

    /// Parses, handles and settles one delivery.
    async fn handle<D, J, F, Fut, T, E>(&self, delivery: D, handler: &F) -> Done<D::Error>
    where
        D: Delivery,
        J: DeserializeOwned,
        F: Fn(J) -> Fut,
        Fut: Future<Output = Result<Outcome<T>, E>>,
        E: Classify + Display,
    {
        let name = match delivery.destination() {
            Some(destination) => format!("process {destination}"),
            None => "process".to_owned(),
        };
        let span = tracing::info_span!(
            "idem.delivery",
            otel.name = name,
            otel.kind = "consumer",
            messaging.system = delivery.system(),
            messaging.operation.type = "process",
            messaging.operation.name = "process",
            messaging.destination.name = delivery.destination(),
            messaging.message.id = delivery.id(),
            idem.delivery_count = delivery.count(),
            idem.outcome = tracing::field::Empty,
            idem.disposition = tracing::field::Empty,
        );
        let done = self
            .handled(delivery, handler)
            .instrument(span.clone())
            .await;
        span.record("idem.outcome", done.outcome);
        span.record("idem.disposition", done.disposition.name());
        done
    }

    async fn handled<D, J, F, Fut, T, E>(&self, delivery: D, handler: &F) -> Done<D::Error>
    where
        D: Delivery,
        J: DeserializeOwned,
        F: Fn(J) -> Fut,
        Fut: Future<Output = Result<Outcome<T>, E>>,
        E: Classify + Display,
    {
        let count = delivery.count();
        let (outcome, error, disposition) = match serde_json::from_slice::<J>(delivery.payload()) {
            Err(e) => (
                "unparsable",
                Some(e.to_string()),
                Disposition::unparsable(e),
            ),
            Ok(job) => {
                // A panicking handler dropped its transaction: nothing of it was kept, and the
                // loop goes on without it.
                let run = AssertUnwindSafe(async { handler(job).await }).catch_unwind();
                let answer = self.beating(&delivery, run).await;
                match answer {
                    Ok(result) => (
                        label(&result),
                        result.as_ref().err().map(|e| e.to_string()),
                        self.settle.decide(&result, count),
                    ),
                    Err(panic) => {
                        let text = format!("the handler panicked: {}", panic_text(&*panic));
                        let disposition = self.settle.failed(&text, count);
                        ("panicked", Some(text), disposition)
                    }
                }
            }
        };
        let id = delivery.id().map(str::to_owned);
        let settled = delivery.settle(&disposition).await;
        if settled.is_ok() {
            self.observe(&Settled {
                id: id.as_deref(),
                delivery: count,
                outcome,
                error: error.as_deref(),
                disposition: &disposition,
            });
        }
        Done {
            outcome,
            disposition,
            settled,
        }
    }

    /// Runs `work` (the handler) to its end, never cancelling it, and meanwhile calls
    /// `delivery`'s [`Delivery::extend`] every heartbeat period, one call at a time.
    async fn beating<D: Delivery, O>(&self, delivery: &D, work: impl Future<Output = O>) -> O {
        // A period too long to be reached is no heartbeat either.
        let first = self
            .heartbeat
            .and_then(|every| Some((tokio::time::Instant::now().checked_add(every)?, every)));
        let Some((first, every)) = first else {
            return work.await;
        };
        let mut work = pin!(work);
        let mut ticks = tokio::time::interval_at(first, every);
        // A beat that took longer than the period is followed by the next at once, then
        // every period again: no burst of the beats it held up.
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut extending = pin!(Fuse::terminated());
        loop {
            tokio::select! {
                // The handler's end first: no beat begins once it answered.
                biased;
                answer = &mut work => {
                    // A beat under way ends before the delivery is settled rather than being
                    // dropped: its request may already be on the wire, and on a broker whose
                    // calls can pass each other (SQS's visibility change, over another
                    // connection) it could land after the settlement and undo a retry's delay.
                    if !extending.is_terminated() {
                        beaten(delivery, extending.as_mut().await);
                    }
                    return answer;
                }
                beat = &mut extending, if !extending.is_terminated() => {
                    beaten(delivery, beat);
                }
                _ = ticks.tick(), if extending.is_terminated() => {
                    extending.set(delivery.extend().fuse());
                }
            }
        }
    }

    fn observe(&self, settled: &Settled<'_>) {
        let disposition = settled.disposition.name();
        if let Disposition::DeadLetter { reason } = settled.disposition {
            tracing::warn!(
                message.id = settled.id,
                delivery = settled.delivery,
                reason,
                "idem: dead-lettered"
            );
        }
        metrics::counter!(SETTLED_TOTAL, "disposition" => disposition, "outcome" => settled.outcome)
            .increment(1);
        if let Some(f) = &self.observer {
            f(settled);
        }
    }

    fn count<X>(&self, done: Done<X>, tally: &mut Tally) -> Result<(), X> {
        done.settled?;
        let n = match (done.disposition, done.outcome) {
            (Disposition::Ack, "applied") => &mut tally.applied,
            (Disposition::Ack, _) => &mut tally.acked_otherwise,
            (Disposition::Retry { .. }, _) => &mut tally.retried,
            (Disposition::DeadLetter { .. }, _) => &mut tally.dead_lettered,
        };
        *n += 1;
        Ok(())
    }
}

/// One delivery's end.
struct Done<X> {
    outcome: &'static str,
    disposition: Disposition,
    settled: Result<(), X>,
}

/// Logs a heartbeat that did not reach the broker; the handler goes on regardless.
fn beaten<D: Delivery>(delivery: &D, beat: Result<(), D::Error>) {
    if let Err(e) = beat {
        tracing::warn!(
            message.id = delivery.id(),
            delivery = delivery.count(),
            error = %e,
            "idem: the heartbeat did not reach the broker; the handler goes on, and the \
             delivery may come again meanwhile"
        );
    }
}

fn label<T, E>(result: &Result<Outcome<T>, E>) -> &'static str {
    match result {
        Ok(Outcome::Applied(_)) => "applied",
        Ok(Outcome::Duplicate) => "duplicate",
        Ok(Outcome::Replayed(_)) => "replayed",
        Ok(Outcome::Failed(_)) => "failed",
        Err(_) => "error",
    }
}

fn panic_text(panic: &(dyn std::any::Any + Send)) -> &str {
    match panic.downcast_ref::<&str>() {
        Some(text) => text,
        None => panic
            .downcast_ref::<String>()
            .map_or("(no text)", String::as_str),
    }
}
