/// What an idempotent call did.
///
/// Every variant means the job is handled: ack it. Only [`Applied`](Outcome::Applied) means this
/// delivery ran the body.
#[must_use = "an `Outcome` says whether this delivery ran the handler; ack the job in every case"]
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Outcome<T> {
    /// This delivery claimed the key, ran the body and committed its effect.
    Applied(T),
    /// An earlier delivery of the same key already committed; the body did not run.
    Duplicate,
    /// An earlier delivery of the same key already committed, and stored its value (`replay`):
    /// here it is again, and the body did not run.
    Replayed(T),
    /// The job failed for good: a lease-mode body said its error was permanent
    /// ([`Lease::permanent`](crate::Lease::permanent)), and the marker completed as failed
    /// with the error's text. This delivery's body did that, or an earlier one did and this
    /// one did not run. Ack the job: it is never retried (an operator can requeue it, see
    /// [`Store::requeue`](crate::Store::requeue)).
    Failed(Failure),
}

/// A job that failed for good, as its marker recorded it ([`Outcome::Failed`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Failure {
    error: String,
}

impl Failure {
    pub(crate) fn new(error: String) -> Failure {
        Failure { error }
    }

    /// The error's text, as the body's error displayed it (at most
    /// [`MAX_ERROR_LEN`](crate::MAX_ERROR_LEN) bytes).
    pub fn error(&self) -> &str {
        &self.error
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the job failed for good: {}", self.error)
    }
}

impl<T> Outcome<T> {
    /// `true` if this delivery ran the body.
    pub fn is_applied(&self) -> bool {
        matches!(self, Outcome::Applied(_))
    }

    /// `true` if an earlier delivery had already handled the key ([`Duplicate`] or
    /// [`Replayed`]).
    ///
    /// [`Duplicate`]: Outcome::Duplicate
    /// [`Replayed`]: Outcome::Replayed
    pub fn is_duplicate(&self) -> bool {
        matches!(self, Outcome::Duplicate | Outcome::Replayed(_))
    }

    /// The failure, if the job failed for good ([`Outcome::Failed`]).
    pub fn failure(&self) -> Option<&Failure> {
        match self {
            Outcome::Failed(failure) => Some(failure),
            _ => None,
        }
    }

    /// The value: this delivery's ([`Applied`](Outcome::Applied)) or the first delivery's
    /// ([`Replayed`](Outcome::Replayed)).
    pub fn value(&self) -> Option<&T> {
        match self {
            Outcome::Applied(v) | Outcome::Replayed(v) => Some(v),
            Outcome::Duplicate | Outcome::Failed(_) => None,
        }
    }

    /// The value: this delivery's ([`Applied`](Outcome::Applied)) or the first delivery's
    /// ([`Replayed`](Outcome::Replayed)).
    pub fn into_value(self) -> Option<T> {
        match self {
            Outcome::Applied(v) | Outcome::Replayed(v) => Some(v),
            Outcome::Duplicate | Outcome::Failed(_) => None,
        }
    }

    /// Maps the value of an [`Applied`](Outcome::Applied) or
    /// [`Replayed`](Outcome::Replayed) outcome.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Outcome<U> {
        match self {
            Outcome::Applied(v) => Outcome::Applied(f(v)),
            Outcome::Replayed(v) => Outcome::Replayed(f(v)),
            Outcome::Duplicate => Outcome::Duplicate,
            Outcome::Failed(failure) => Outcome::Failed(failure),
        }
    }
}

/// What a batch call did: one [`Outcome`] per job, in the batch's order, and the body's value.
///
/// Every job is handled, whatever its outcome: ack them all.
#[must_use = "a `Batch` says which jobs this delivery ran; ack every job of it"]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch<T> {
    outcomes: Vec<Outcome<()>>,
    value: Option<T>,
}

impl<T> Batch<T> {
    /// The jobs of `fresh` this delivery ran and committed are applied, the others were
    /// handled by earlier deliveries; `value` is the body's, if it ran.
    pub(crate) fn new(fresh: &[bool], value: Option<T>) -> Self {
        let outcomes = fresh
            .iter()
            .map(|&fresh| {
                if fresh {
                    Outcome::Applied(())
                } else {
                    Outcome::Duplicate
                }
            })
            .collect();
        Batch { outcomes, value }
    }

    /// The jobs at these positions had failed for good in an earlier delivery: they are
    /// [`Outcome::Failed`].
    pub(crate) fn failed_at(mut self, failed: &[(usize, Failure)]) -> Self {
        for (position, failure) in failed {
            self.outcomes[*position] = Outcome::Failed(failure.clone());
        }
        self
    }

    /// One outcome per job, in the order of the batch: [`Outcome::Applied`] for the jobs this
    /// delivery ran and committed, [`Outcome::Duplicate`] for the others.
    pub fn outcomes(&self) -> &[Outcome<()>] {
        &self.outcomes
    }

    /// How many jobs this delivery ran and committed.
    pub fn applied(&self) -> usize {
        self.outcomes.iter().filter(|o| o.is_applied()).count()
    }

    /// The body's value, if it ran (at least one job was fresh) and committed.
    pub fn value(&self) -> Option<&T> {
        self.value.as_ref()
    }

    /// The body's value, if it ran and committed.
    pub fn into_value(self) -> Option<T> {
        self.value
    }

    /// The outcomes and the value.
    pub fn into_parts(self) -> (Vec<Outcome<()>>, Option<T>) {
        (self.outcomes, self.value)
    }
}

/// What a batch run job by job did: one result per job, in the batch's order.
///
/// A job's result reads as a single job's call does: `Ok` (any [`Outcome`]) means the job is
/// handled, **ack it**; `Err` is that job's own error (its body failed, or it was rolled back
/// alone), and nothing of it was kept, **nack it** (or dead-letter it) and only it. The jobs
/// that are `Ok` were committed together before this was returned. An error of the whole
/// batch (its claim, its commit, a failure that took its transaction with it) is not here:
/// the call returned it instead, and every job is to be redelivered.
///
/// ```
/// # use idem_runtime as idem;
/// fn settle(done: idem::Each<(), String>) {
///     for position in done.acks() {
///         // ack the message at `position`
/// #       let _ = position;
///     }
///     for (position, error) in done.failures() {
///         // nack (or dead-letter) the message at `position`, logging `error`
/// #       let _ = (position, error);
///     }
/// }
/// ```
#[must_use = "an `Each` says which jobs to ack and which to nack"]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Each<T, E> {
    results: Vec<Result<Outcome<T>, E>>,
}

impl<T, E> Each<T, E> {
    pub(crate) fn new(results: Vec<Result<Outcome<T>, E>>) -> Self {
        Each { results }
    }

    /// One result per job, in the order of the batch.
    pub fn results(&self) -> &[Result<Outcome<T>, E>] {
        &self.results
    }

    /// The results, in the order of the batch.
    pub fn into_results(self) -> Vec<Result<Outcome<T>, E>> {
        self.results
    }

    /// How many jobs the batch had.
    pub fn len(&self) -> usize {
        self.results.len()
    }

    /// `true` for an empty batch.
    pub fn is_empty(&self) -> bool {
        self.results.is_empty()
    }

    /// `true` if the job at `position` is handled (applied now, or by an earlier delivery):
    /// ack it.
    ///
    /// # Panics
    ///
    /// If `position` is not below [`len`](Each::len).
    pub fn is_ackable(&self, position: usize) -> bool {
        self.results[position].is_ok()
    }

    /// The positions of the jobs to ack (every job whose result is `Ok`), in order.
    pub fn acks(&self) -> impl Iterator<Item = usize> + '_ {
        self.results
            .iter()
            .enumerate()
            .filter(|(_, r)| r.is_ok())
            .map(|(i, _)| i)
    }

    /// The positions of the jobs that failed alone, with their errors: nack (or dead-letter)
    /// these, and only these.
    pub fn failures(&self) -> impl Iterator<Item = (usize, &E)> + '_ {
        self.results
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.as_ref().err().map(|e| (i, e)))
    }

    /// How many jobs this delivery ran and committed.
    pub fn applied(&self) -> usize {
        self.results
            .iter()
            .filter(|r| matches!(r, Ok(Outcome::Applied(_))))
            .count()
    }
}

impl<T, E> IntoIterator for Each<T, E> {
    type Item = Result<Outcome<T>, E>;
    type IntoIter = std::vec::IntoIter<Result<Outcome<T>, E>>;

    fn into_iter(self) -> Self::IntoIter {
        self.results.into_iter()
    }
}

/// What a handler's error type `E` needs: `From<idem::Error>`, named so that a missing impl
/// reads as advice at the handler's return type.
#[doc(hidden)]
#[diagnostic::on_unimplemented(
    message = "the error type of an idempotent handler must implement `From<idem::Error>`: `{Self}` does not",
    label = "idem returns its own errors (in progress, rolled back, lease lost) through this `Result`'s `E`",
    note = "use `idem::JobError` (it takes idem's errors and the body's own through `?`), `sqlx::Error`, `anyhow::Error` or `Box<dyn std::error::Error + Send + Sync>`, or an error enum of your own with a variant for idem's errors: `#[error(transparent)] Idem(#[from] idem::Error)` (thiserror)"
)]
pub trait HandlerError: From<crate::error::Error> {}

impl<E: From<crate::error::Error>> HandlerError for E {}

/// An error of a call, before it becomes the handler's `E`: idem's own (claim, commit) or the
/// body's.
#[doc(hidden)]
pub enum Failed<E> {
    Idem(crate::error::Error),
    Handler(E),
}

impl<E: From<crate::error::Error>> Failed<E> {
    /// The handler's error: the body's as it was, or idem's converted by `E: From<Error>`.
    pub(crate) fn into_handler_error(self) -> E {
        match self {
            Failed::Idem(e) => E::from(e),
            Failed::Handler(e) => e,
        }
    }
}
