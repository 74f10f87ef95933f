/// What an idempotent call did.
///
/// Every variant means the job is handled: ack it. Only [`Applied`](Outcome::Applied) means this
/// delivery ran the body.
#[must_use = "an `Outcome` says whether this delivery ran the handler; ack the job in every case"]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome<T> {
    /// This delivery claimed the key, ran the body and committed its effect.
    Applied(T),
    /// An earlier delivery of the same key already committed; the body did not run.
    Duplicate,
    /// An earlier delivery of the same key already committed, and stored its value (`replay`):
    /// here it is again, and the body did not run.
    Replayed(T),
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
        !self.is_applied()
    }

    /// The value: this delivery's ([`Applied`](Outcome::Applied)) or the first delivery's
    /// ([`Replayed`](Outcome::Replayed)).
    pub fn value(&self) -> Option<&T> {
        match self {
            Outcome::Applied(v) | Outcome::Replayed(v) => Some(v),
            Outcome::Duplicate => None,
        }
    }

    /// The value: this delivery's ([`Applied`](Outcome::Applied)) or the first delivery's
    /// ([`Replayed`](Outcome::Replayed)).
    pub fn into_value(self) -> Option<T> {
        match self {
            Outcome::Applied(v) | Outcome::Replayed(v) => Some(v),
            Outcome::Duplicate => None,
        }
    }

    /// Maps the value of an [`Applied`](Outcome::Applied) or
    /// [`Replayed`](Outcome::Replayed) outcome.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Outcome<U> {
        match self {
            Outcome::Applied(v) => Outcome::Applied(f(v)),
            Outcome::Replayed(v) => Outcome::Replayed(f(v)),
            Outcome::Duplicate => Outcome::Duplicate,
        }
    }
}
