//! The test kit (feature `testing`): helpers that prove a handler idempotent against a real
//! database, in a few lines per case. Use it as `idem::testing`, whose documentation shows
//! each case with an example.
//!
//! Each helper takes the handler's call as a closure (`|| top_up(&store, &job)`), a check
//! that reads the effect back (`|| balance(&pool)`) and the value that check reads once the
//! job applied exactly once. The helpers are assertions: a violation panics with a message
//! that says which delivery got what and what that means for the handler.

mod all;
mod call;
mod cases;
pub(crate) mod probe;
mod steps;

use std::fmt;

pub use all::{CONCURRENT_DELIVERIES, all_cases};
pub use call::{Check, Deliver};
pub use cases::{deliver_concurrently, deliver_twice, expire_lease, fail_before_commit};
pub use steps::{MAX_CRASHES, crash_after_each_step};

/// What one delivery of the job got, as the kit classifies it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Got {
    /// `Ok(Outcome::Applied(_))`: this delivery ran the body and its work was kept.
    Applied,
    /// `Ok(Outcome::Duplicate)`: an earlier delivery had handled the job.
    Duplicate,
    /// `Ok(Outcome::Replayed(_))`: the same, with the earlier delivery's value (`replay`).
    Replayed,
    /// `Ok(Outcome::Failed(_))`: the job failed for good (a permanent error, this delivery's
    /// or an earlier one's).
    FailedForGood,
    /// `Err` from [`Error::InProgress`](crate::Error::InProgress): another delivery held the
    /// key. The broker redelivers such a job later.
    InProgress,
    /// `Err` from [`LeaseError::Lost`](crate::LeaseError::Lost): the delivery's lease had been
    /// taken over, so its result was not recorded.
    LeaseLost,
    /// `Err` from [`NotKept::Injected`](crate::NotKept::Injected): the kit failed this delivery on
    /// purpose right before its commit.
    Injected,
    /// Any other `Err`: the body's own error, or another of idem's.
    Failed,
}

impl Got {
    fn is_duplicate(self) -> bool {
        matches!(self, Got::Duplicate | Got::Replayed)
    }

    fn meaning(self) -> &'static str {
        match self {
            Got::Applied => "ran the body and committed",
            Got::Duplicate => "an earlier delivery had handled the job",
            Got::Replayed => "an earlier delivery had handled the job; its value replayed",
            Got::FailedForGood => "the job failed for good (a permanent error); acked",
            Got::InProgress => "another delivery held the key (nack, redeliver later)",
            Got::LeaseLost => "its lease had been taken over; its result was not recorded",
            Got::Injected => "failed on purpose by the kit before its commit",
            Got::Failed => "an error",
        }
    }
}

/// One delivery the kit made, and what it got.
#[derive(Debug, Clone)]
pub struct Delivery {
    number: usize,
    got: Got,
    returned: String,
    value: Option<String>,
    attempt: Option<u32>,
    mode: Option<probe::Mode>,
    idem_error: Option<String>,
}

impl Delivery {
    /// Which delivery this was, counting from 1 in the order the kit started them.
    pub fn number(&self) -> usize {
        self.number
    }

    /// What it got.
    pub fn got(&self) -> Got {
        self.got
    }

    /// Lease mode: the attempt its claim took (1 for the first holder, one more for each
    /// takeover); `None` if it took no lease.
    pub fn attempt(&self) -> Option<u32> {
        self.attempt
    }

    /// What the call returned, as `Debug` prints it.
    pub fn returned(&self) -> &str {
        &self.returned
    }

    /// The message of idem's [`Error`](crate::Error), if the call failed with one (before it
    /// became the handler's error type).
    pub fn idem_error(&self) -> Option<&str> {
        self.idem_error.as_deref()
    }
}

impl fmt::Display for Delivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "delivery {}: {}", self.number, self.returned)?;
        if let Some(attempt) = self.attempt {
            write!(f, " (lease attempt {attempt})")?;
        }
        write!(f, ": {:?}, {}", self.got, self.got.meaning())?;
        // The kinds the kit names say it all; another error of idem's is worth its message.
        match &self.idem_error {
            Some(message) if self.got == Got::Failed => write!(f, " (idem: {message})"),
            _ => Ok(()),
        }
    }
}

/// What a case did: every delivery in the order they were started, and what the check read.
///
/// Returned when every assertion held, for tests that want to look closer (or print it); a
/// violation panics with the same text.
#[derive(Debug, Clone, Default)]
pub struct Report {
    deliveries: Vec<Delivery>,
    checks: Vec<(&'static str, String)>,
}

impl Report {
    /// Every delivery, in the order the kit started them.
    pub fn deliveries(&self) -> &[Delivery] {
        &self.deliveries
    }

    /// What each delivery got, in the same order.
    pub fn got(&self) -> Vec<Got> {
        self.deliveries.iter().map(|d| d.got).collect()
    }

    pub(crate) fn push(&mut self, delivery: Delivery) -> &Delivery {
        self.deliveries.push(delivery);
        self.deliveries.last().expect("just pushed")
    }

    fn checked(&mut self, when: &'static str, read: &impl fmt::Debug) {
        self.checks.push((when, format!("{read:?}")));
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for d in &self.deliveries {
            writeln!(f, "  {d}")?;
        }
        for (when, read) in &self.checks {
            writeln!(f, "  the check read {read} {when}")?;
        }
        Ok(())
    }
}
