//! What the body says of its error (permanent, transient, unknown), and what the lease's end
//! does with each: complete the marker as failed, release the key now, or keep the lease
//! until it runs out.

use std::fmt;

use super::Lease;
use crate::record::bounded;

/// The most bytes of a permanent error's text a marker keeps; a longer text is cut at a
/// character boundary and ends with `…`.
pub const MAX_ERROR_LEN: usize = 2048;

/// How the body's error was classed, last class first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) enum Class {
    /// Not classed: a plain `Err` releases the key at once (as [`Class::Transient`]).
    #[default]
    Plain,
    /// The job can never succeed: the marker completes as failed, with this text.
    Permanent(String),
    /// Worth a retry: the key is released at once.
    Transient,
    /// The outside effect may have happened: the lease is kept until it runs out.
    Unknown,
    /// The test kit crashed the delivery after a step: nothing after it is kept.
    Crashed,
}

impl Lease {
    /// Marks `error`, which the body is about to return, as permanent: the job can never
    /// succeed (a card declined, a request the outside system refuses as invalid). When the
    /// body returns `Err`, the marker completes as failed with `error`'s text (at most
    /// [`MAX_ERROR_LEN`] bytes) instead of being released: the call returns
    /// [`Outcome::Failed`](crate::Outcome::Failed) (ack the job), and so does every later
    /// delivery, without running.
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// # async fn f(lease: &idem::Lease, declined: bool) -> Result<(), idem::Error> {
    /// if declined {
    ///     return Err(lease.permanent(idem::Error::Serialize("card declined".into())));
    /// }
    /// # Ok(()) }
    /// ```
    pub fn permanent<E: fmt::Display>(&self, error: E) -> E {
        let text = bounded(&error.to_string(), MAX_ERROR_LEN).into_owned();
        self.classify(Class::Permanent(text));
        error
    }

    /// Marks `error` as transient (a 503, a refused connection): the key is released at once
    /// and a redelivery retries. What a plain `Err` does; say it where it is meant.
    pub fn transient<E>(&self, error: E) -> E {
        self.classify(Class::Transient);
        error
    }

    /// Marks `error` as unknown: the outside effect may have happened (a timeout, a
    /// connection lost after the request was sent). The lease is not released: it is kept
    /// until it runs out, so that the next delivery comes only once the outside system had
    /// the lease's length to settle, and a delivery before that gets
    /// [`Error::InProgress`](crate::Error::InProgress). A step with a verify
    /// ([`step_verified`](Lease::step_verified)) asks the outside system at once instead.
    pub fn unknown<E>(&self, error: E) -> E {
        self.classify(Class::Unknown);
        error
    }

    pub(crate) fn classify(&self, class: Class) {
        *self.class.lock().unwrap_or_else(|e| e.into_inner()) = class;
    }

    pub(crate) fn class(&self) -> Class {
        self.class.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub(super) fn is_unknown(&self) -> bool {
        self.class() == Class::Unknown
    }
}
