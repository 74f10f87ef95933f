//! A ready error type for handlers: idem's errors kept as themselves, the body's boxed.

use std::error::Error as StdError;
use std::fmt;

use super::{Error, KafkaError, LeaseError, NotKept, Refusal};
use crate::key::KeyError;

/// The body's own error, boxed as `?` takes it.
type Boxed = Box<dyn StdError + Send + Sync + 'static>;

/// An error type for handlers, ready to use: `?` takes idem's errors and the body's own
/// (`sqlx::Error`, `serde_json::Error`, any `std::error::Error + Send + Sync + 'static`), so a
/// handler needs no error enum of its own. It is the `E` of `#[idempotent]` handlers in every
/// mode (`Result<Outcome<T>, JobError>`, `Result<Each<T, JobError>, JobError>`, ...) and of
/// hand-written calls (`finish(result)` takes it as any `E: From<idem::Error>`).
///
/// ```
/// # use idem_runtime as idem;
/// use idem::JobError;
///
/// fn parse(payload: &str) -> Result<i64, JobError> {
///     let credits: i64 = serde_json::from_str(payload)?;
///     Ok(credits)
/// }
///
/// let idem: JobError = idem::Error::InProgress { scope: "billing".into(), key: "7".into() }.into();
/// assert!(matches!(idem.as_idem(), Some(idem::Error::InProgress { .. })));
/// assert!(parse("nope").unwrap_err().as_idem().is_none());
/// ```
///
/// An idem error stays itself, whichever way it came (directly, inside a `sqlx::Error` that
/// carries it, or as one of its families: a [`KeyError`], a [`LeaseError`], ...):
/// [`as_idem`](JobError::as_idem) gives it back, and [`Classify`](crate::Classify) (so
/// [`Settle::decide`](crate::Settle::decide) and the [`Runner`](crate::settle::Runner))
/// classifies a `JobError` exactly as the error it holds: an idem error as [`Error`], a
/// `sqlx::Error` as `sqlx::Error` (permanent when idem would call it so), any other error
/// retried up to the cap, unless marked [`permanent`](JobError::permanent).
///
/// # Why it does not implement `std::error::Error`
///
/// `?` converts through `From`, and a `From` for every `std::error::Error` would, were
/// `JobError` one itself, overlap with the standard `From<T> for T`: the trade-off
/// `anyhow::Error` makes too. `JobError` takes every error through `?` and is not one:
/// [`as_error`](JobError::as_error) lends the error it holds as `&dyn std::error::Error`
/// (its `source()` chain included), and `?` turns a `JobError` into a
/// `Box<dyn std::error::Error + Send + Sync>` (or `Box<dyn std::error::Error>`), so a worker's
/// `main` can propagate it. A `Box<dyn Error + Send + Sync>` is not an `Error` either, so it
/// comes in through [`JobError::new`] instead of `?`.
pub struct JobError {
    held: Held,
    permanent: bool,
}

#[derive(Debug)]
enum Held {
    Idem(Error),
    Body(Boxed),
}

impl JobError {
    /// The error in `error`, boxed: an idem error in the box comes out as itself, as through
    /// `?`. Takes a `Box<dyn Error + Send + Sync>` (which `?` cannot), and a message:
    /// `JobError::new("no such account")`.
    pub fn new(error: impl Into<Boxed>) -> JobError {
        JobError::unboxed(error.into())
    }

    /// Marks `error` permanent: the job fails the same way on every delivery (a payload the
    /// body refuses, a row that can never exist), so [`Settle`](crate::Settle) dead-letters it
    /// at once instead of retrying it up to the cap. Takes what [`JobError::new`] does, so
    /// that `.map_err(JobError::permanent)?` marks a body's error and
    /// `JobError::permanent("3 credits is below the minimum")` says one;
    /// [`into_permanent`](JobError::into_permanent) marks a `JobError`.
    ///
    /// An idem error keeps its own disposition where [`Settle::decide`](crate::Settle::decide)
    /// decides it before permanence ([`Error::InProgress`] is retried, [`Error::ValueNotStored`]
    /// acked). In a lease-mode body, say it to the lease too,
    /// [`lease.permanent(..)`](crate::Lease::permanent), for the marker to record the failure.
    ///
    /// ```
    /// # use idem_runtime as idem;
    /// use idem::{Classify, JobError};
    ///
    /// fn credits(payload: &str) -> Result<i64, JobError> {
    ///     // The same payload never parses: retrying it would only delay the dead letter.
    ///     let credits: i64 = serde_json::from_str(payload).map_err(JobError::permanent)?;
    ///     Ok(credits)
    /// }
    ///
    /// assert!(credits("nope").unwrap_err().is_permanent());
    /// ```
    pub fn permanent(error: impl Into<Boxed>) -> JobError {
        JobError::new(error).into_permanent()
    }

    /// This error, marked [`permanent`](JobError::permanent).
    pub fn into_permanent(self) -> JobError {
        JobError {
            permanent: true,
            ..self
        }
    }

    /// The idem error this is, if it is one (however it came: directly, inside a
    /// `sqlx::Error`, as a [`KeyError`], ...): its kind (`InProgress`, `KeyReused`, ...) and
    /// [`is_transient`](Error::is_transient) are there.
    pub fn as_idem(&self) -> Option<&Error> {
        match &self.held {
            Held::Idem(e) => Some(e),
            Held::Body(_) => None,
        }
    }

    /// The idem error this is, or this error back if it is the body's.
    pub fn into_idem(self) -> Result<Error, JobError> {
        match self.held {
            Held::Idem(e) => Ok(e),
            held @ Held::Body(_) => Err(JobError { held, ..self }),
        }
    }

    /// The error held, idem's or the body's, as a standard error (for its `source()` chain,
    /// or a reporter).
    pub fn as_error(&self) -> &(dyn StdError + Send + Sync + 'static) {
        match &self.held {
            Held::Idem(e) => e,
            Held::Body(e) => e.as_ref(),
        }
    }

    /// The error held, if it is a `T`: the body's own error as it returned it
    /// (`downcast_ref::<sqlx::Error>()`), or idem's (`downcast_ref::<idem::Error>()`, as
    /// [`as_idem`](JobError::as_idem)).
    pub fn downcast_ref<T: StdError + 'static>(&self) -> Option<&T> {
        self.as_error().downcast_ref()
    }

    /// The error held, boxed (idem's too).
    pub fn into_inner(self) -> Boxed {
        match self.held {
            Held::Idem(e) => Box::new(e),
            Held::Body(e) => e,
        }
    }

    /// Whether [`permanent`](JobError::permanent) marked this error.
    pub(crate) fn is_marked_permanent(&self) -> bool {
        self.permanent
    }

    fn unboxed(boxed: Boxed) -> JobError {
        let families: [fn(Boxed) -> Result<Error, Boxed>; 6] = [
            family::<Error>,
            family::<KeyError>,
            family::<Refusal>,
            family::<LeaseError>,
            family::<NotKept>,
            family::<KafkaError>,
        ];
        let mut boxed = boxed;
        for family in families {
            match family(boxed) {
                Ok(idem) => return JobError::idem(idem),
                Err(other) => boxed = other,
            }
        }
        match boxed.downcast::<sqlx::Error>() {
            Ok(sqlx) => JobError::from_sqlx(*sqlx),
            Err(boxed) => JobError::body(boxed),
        }
    }

    fn idem(error: Error) -> JobError {
        JobError {
            held: Held::Idem(error),
            permanent: false,
        }
    }

    fn body(error: Boxed) -> JobError {
        JobError {
            held: Held::Body(error),
            permanent: false,
        }
    }

    /// A `sqlx::Error` carries an idem error when a call that returns `sqlx::Error` met one
    /// (`From<idem::Error> for sqlx::Error`): it comes out as itself. The body's own database
    /// errors stay `sqlx::Error`, so that they are classified as the body's.
    fn from_sqlx(error: sqlx::Error) -> JobError {
        let carries = error
            .as_database_error()
            .is_some_and(|db| db.try_downcast_ref::<Error>().is_some());
        if carries {
            JobError::idem(Error::from(error))
        } else {
            JobError::body(Box::new(error))
        }
    }
}

/// The idem error `boxed` is, if it is an `F` (an idem error, or one of its families).
fn family<F: StdError + Send + Sync + 'static>(boxed: Boxed) -> Result<Error, Boxed>
where
    Error: From<F>,
{
    boxed.downcast::<F>().map(|family| Error::from(*family))
}

impl<E: StdError + Send + Sync + 'static> From<E> for JobError {
    /// idem's errors (and its families, and a `sqlx::Error` that carries one) are kept as idem
    /// errors; any other error is the body's.
    fn from(error: E) -> JobError {
        // Boxed first even when it turns out to be idem's: one allocation on a failure's path
        // buys a single classification for `?`, `new` and `permanent`.
        JobError::unboxed(Box::new(error))
    }
}

impl fmt::Display for JobError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self.as_error(), f)
    }
}

impl fmt::Debug for JobError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobError")
            .field("error", &self.held)
            .field("permanent", &self.permanent)
            .finish()
    }
}

impl AsRef<dyn StdError + Send + Sync + 'static> for JobError {
    fn as_ref(&self) -> &(dyn StdError + Send + Sync + 'static) {
        self.as_error()
    }
}

impl From<JobError> for Box<dyn StdError + Send + Sync + 'static> {
    fn from(error: JobError) -> Self {
        error.into_inner()
    }
}

impl From<JobError> for Box<dyn StdError + 'static> {
    fn from(error: JobError) -> Self {
        error.into_inner()
    }
}

#[cfg(test)]
mod tests;
