//! The consumer loop: what a consumer does with a delivery once its handler returned (ack,
//! retry after a delay, dead-letter), written once as code ([`Settle::decide`]), and the loop
//! itself ([`Runner`]) on a broker's [`Source`]: RabbitMQ (the `rabbitmq` module, feature
//! `rabbitmq`), NATS JetStream (`nats`, feature `nats`), Amazon SQS (`sqs`, feature `sqs`);
//! and a Lambda function's SQS event answered with a partial batch response (`lambda`,
//! feature `lambda`).
//!
//! ```
//! # use idem_runtime as idem;
//! use std::time::Duration;
//! use idem::{Disposition, Error, Outcome, Settle};
//!
//! let settle = Settle::new().max_deliveries(5);
//! let applied: Result<Outcome<()>, Error> = Ok(Outcome::Applied(()));
//! assert_eq!(settle.decide(&applied, 1), Disposition::Ack);
//! let busy: Result<Outcome<()>, Error> =
//!     Err(Error::InProgress { scope: "billing".into(), key: "job-7".into() });
//! // Never an immediate requeue, and never dead-lettered by the cap: the other delivery may
//! // still fail, and this one must then do the job.
//! assert_eq!(settle.decide(&busy, 9), Disposition::Retry { after: Duration::from_secs(1) });
//! ```

use std::fmt::Display;
use std::time::Duration;

use crate::error::{Error, JobError};
use crate::outcome::Outcome;

#[cfg(feature = "lambda")]
pub mod lambda;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
mod runner;
#[cfg(feature = "sqs")]
pub mod sqs;

pub use runner::{DELIVERY_SPAN, Delivery, Runner, SETTLED_TOTAL, Settled, Source, Tally};

/// What to do with a delivery: the broker's settlement of it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Disposition {
    /// Acknowledge it: its effect was kept (by this delivery or an earlier one), or the job
    /// failed for good and its marker says so ([`Outcome::Failed`]).
    Ack,
    /// Give it back, to be delivered again once `after` has passed (the broker's delayed
    /// redelivery: a nack with a delay, a visibility change, a retry queue). Nothing of it was
    /// kept, or another delivery holds it and may still fail.
    Retry {
        /// How long to wait before the next delivery.
        after: Duration,
    },
    /// Dead-letter it: no delivery of it can succeed (a permanent error, a reused key, a
    /// payload that is not a job), or it came as often as [`Settle::max_deliveries`] allows.
    /// Nothing of it was kept.
    DeadLetter {
        /// Why, for the dead letter's headers and the log: the error, and the delivery count
        /// when the cap decided.
        reason: String,
    },
}

impl Disposition {
    /// `ack`, `retry` or `dead_letter`: the label of [`SETTLED_TOTAL`] and of the delivery's
    /// span.
    pub fn name(&self) -> &'static str {
        match self {
            Disposition::Ack => "ack",
            Disposition::Retry { .. } => "retry",
            Disposition::DeadLetter { .. } => "dead_letter",
        }
    }

    /// A payload that does not parse: it is not a job, and no delivery of it can succeed.
    pub fn unparsable(error: impl Display) -> Disposition {
        Disposition::DeadLetter {
            reason: format!("the payload is not a job: {error}"),
        }
    }
}

/// What the decision needs to know of a handler's error type: the idem error it is or carries,
/// and whether it is permanent.
///
/// Implemented for [`Error`], for `sqlx::Error` (which carries an idem error converted into
/// it), for boxed errors and for [`JobError`], the ready handler error type (which needs no
/// impl of yours: mark an error permanent with [`JobError::permanent`]). For your own error
/// type, return the idem error it wraps (if it has one), and say which of your errors fail the
/// same way on every delivery:
///
/// ```
/// # use idem_runtime as idem;
/// use idem::{Classify, Error};
///
/// #[derive(Debug, thiserror::Error)]
/// enum ChargeError {
///     #[error(transparent)]
///     Idem(#[from] Error),
///     #[error("card declined")]
///     Declined,
///     #[error("the payment service is down")]
///     Unavailable,
/// }
///
/// impl Classify for ChargeError {
///     fn idem_error(&self) -> Option<&Error> {
///         match self {
///             ChargeError::Idem(e) => Some(e),
///             _ => None,
///         }
///     }
///
///     fn is_permanent(&self) -> bool {
///         match self {
///             ChargeError::Idem(e) => e.is_permanent(),
///             ChargeError::Declined => true,
///             ChargeError::Unavailable => false,
///         }
///     }
/// }
/// ```
pub trait Classify {
    /// The idem error this error is or carries, if any: it decides what [`Settle::decide`]
    /// does (see there).
    fn idem_error(&self) -> Option<&Error>;

    /// Whether a delivery that failed with this error fails the same way however often it
    /// comes, until the job, the code or the database changes: it is dead-lettered at once
    /// instead of retried. By default: what the carried idem error says
    /// ([`Error::is_permanent`]), else not permanent (retried, up to the cap).
    fn is_permanent(&self) -> bool {
        self.idem_error().is_some_and(Error::is_permanent)
    }
}

impl Classify for Error {
    fn idem_error(&self) -> Option<&Error> {
        Some(self)
    }
}

impl Classify for sqlx::Error {
    fn idem_error(&self) -> Option<&Error> {
        self.as_database_error()?.try_downcast_ref::<Error>()
    }

    /// The carried idem error's answer; a database error of the body's own is permanent when
    /// idem would call it so ([`Error::is_permanent`] of `Error::Database`).
    fn is_permanent(&self) -> bool {
        match self.idem_error() {
            Some(idem) => idem.is_permanent(),
            None => !crate::error::is_transient_database(self),
        }
    }
}

/// As the error it holds (see [`JobError`]), or permanent where
/// [`JobError::permanent`] marked it.
impl Classify for JobError {
    fn idem_error(&self) -> Option<&Error> {
        self.as_idem()
    }

    fn is_permanent(&self) -> bool {
        if self.is_marked_permanent() {
            return true;
        }
        match self.downcast_ref::<sqlx::Error>() {
            Some(body) => body.is_permanent(),
            None => self.idem_error().is_some_and(Error::is_permanent),
        }
    }
}

impl Classify for Box<dyn std::error::Error + Send + Sync + 'static> {
    fn idem_error(&self) -> Option<&Error> {
        match self.downcast_ref::<Error>() {
            Some(idem) => Some(idem),
            None => self.downcast_ref::<sqlx::Error>()?.idem_error(),
        }
    }
}

impl Error {
    /// Whether a delivery that failed with this error fails the same way however often it
    /// comes: a refused input, a reused key, a value that cannot be serialised, a database
    /// error that is not transient (a missing table or column, a privilege refused). The
    /// opposite of [`is_transient`](Error::is_transient), except for
    /// [`Error::ValueNotStored`], whose work was done: it is acked, neither retried nor
    /// dead-lettered.
    pub fn is_permanent(&self) -> bool {
        !self.is_transient() && !matches!(self, Error::ValueNotStored { .. })
    }
}

/// The consumer loop's policy: how long a retried delivery waits, and how many deliveries a
/// message gets before it is dead-lettered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settle {
    max_deliveries: u32,
    in_progress: Duration,
    backoff: Duration,
    max_backoff: Duration,
}

impl Default for Settle {
    fn default() -> Self {
        Settle::new()
    }
}

impl Settle {
    /// The defaults: 10 deliveries, a retry 100 ms after the first failure and twice as long
    /// after each next one up to 30 s, and 1 s before another look at a key another delivery
    /// holds.
    pub fn new() -> Settle {
        Settle {
            max_deliveries: 10,
            in_progress: Duration::from_secs(1),
            backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(30),
        }
    }

    /// The redelivery cap: the delivery numbered `n` (from 1) that fails in a way that would
    /// be retried is dead-lettered instead, with its error. At least 1 (every failure
    /// dead-letters). [`Error::InProgress`] is never capped: the delivery holding the key may
    /// still fail, and then a later one must do the job.
    pub fn max_deliveries(mut self, n: u32) -> Settle {
        self.max_deliveries = n.max(1);
        self
    }

    /// How long a delivery that met [`Error::InProgress`] waits before it comes again: about
    /// the time the holder needs (its lease, or the handler's `wait`). Never zero: an
    /// immediate requeue would spin while the other delivery runs.
    pub fn in_progress_after(mut self, after: Duration) -> Settle {
        self.in_progress = after.max(Duration::from_millis(1));
        self
    }

    /// The first retry's delay, doubled for each next delivery up to `max`.
    pub fn backoff(mut self, first: Duration, max: Duration) -> Settle {
        self.backoff = first;
        self.max_backoff = max.max(first);
        self
    }

    /// The cap of [`max_deliveries`](Settle::max_deliveries).
    pub fn get_max_deliveries(&self) -> u32 {
        self.max_deliveries
    }

    /// What to do with the delivery numbered `delivery` (from 1: the broker's count where it
    /// keeps one, RabbitMQ's `x-delivery-count`, JetStream's `delivered`, SQS's
    /// `ApproximateReceiveCount`) once its handler returned `result`:
    ///
    /// | the handler returned | disposition |
    /// |---|---|
    /// | `Ok(Applied)`, `Ok(Duplicate)`, `Ok(Replayed)` | ack: the effect is kept |
    /// | `Ok(Failed)` (a lease's permanent error, recorded) | ack: it is never retried |
    /// | [`Error::InProgress`] | retry after [`in_progress_after`](Settle::in_progress_after), never capped |
    /// | [`Error::ValueNotStored`] | ack: the work was done, only its value was not stored |
    /// | a permanent error ([`Classify::is_permanent`]: a reused key, a refused input, ...) | dead-letter at once |
    /// | any other error (nothing was kept: a rollback, a lost lease, a database that failed, the body's own error) | retry after the backoff of its delivery number; dead-letter from [`max_deliveries`](Settle::max_deliveries) on |
    pub fn decide<T, E: Classify + Display>(
        &self,
        result: &Result<Outcome<T>, E>,
        delivery: u32,
    ) -> Disposition {
        let error = match result {
            Ok(_) => return Disposition::Ack,
            Err(error) => error,
        };
        match error.idem_error() {
            Some(Error::InProgress { .. }) => {
                return Disposition::Retry {
                    after: self.in_progress,
                };
            }
            Some(Error::ValueNotStored { .. }) => return Disposition::Ack,
            _ => {}
        }
        if error.is_permanent() {
            return Disposition::DeadLetter {
                reason: error.to_string(),
            };
        }
        self.failed(error, delivery)
    }

    /// A delivery that failed in a way a later one may get past: retried after the backoff of
    /// its number, or dead-lettered from the cap on.
    pub(crate) fn failed(&self, error: &dyn Display, delivery: u32) -> Disposition {
        if delivery >= self.max_deliveries {
            return Disposition::DeadLetter {
                reason: format!(
                    "delivered {delivery} times, the cap of `Settle::max_deliveries`; the last \
                     delivery failed: {error}"
                ),
            };
        }
        // 2^(n-1) times the first delay, without overflow: past 2^31 it is the cap anyway.
        let doubled = self
            .backoff
            .saturating_mul(1_u32 << delivery.saturating_sub(1).min(31));
        Disposition::Retry {
            after: doubled.min(self.max_backoff),
        }
    }
}

impl Disposition {
    /// [`Settle::decide`] with the default policy ([`Settle::new`]).
    pub fn of<T, E: Classify + Display>(result: &Result<Outcome<T>, E>, delivery: u32) -> Self {
        Settle::new().decide(result, delivery)
    }
}

#[cfg(test)]
mod tests;
