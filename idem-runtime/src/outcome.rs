/// What an idempotent call did.
///
/// Both variants mean the job is handled: ack it. Only [`Applied`](Outcome::Applied) means this
/// delivery ran the body.
#[must_use = "an `Outcome` says whether this delivery ran the handler; ack the job in both cases"]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome<T> {
    /// This delivery claimed the key, ran the body and committed its effect.
    Applied(T),
    /// An earlier delivery of the same key already committed; the body did not run.
    Duplicate,
}

impl<T> Outcome<T> {
    /// `true` if this delivery ran the body.
    pub fn is_applied(&self) -> bool {
        matches!(self, Outcome::Applied(_))
    }

    /// `true` if an earlier delivery had already handled the key.
    pub fn is_duplicate(&self) -> bool {
        matches!(self, Outcome::Duplicate)
    }

    /// The body's value, if this delivery ran it.
    pub fn value(&self) -> Option<&T> {
        match self {
            Outcome::Applied(v) => Some(v),
            Outcome::Duplicate => None,
        }
    }

    /// The body's value, if this delivery ran it.
    pub fn into_value(self) -> Option<T> {
        match self {
            Outcome::Applied(v) => Some(v),
            Outcome::Duplicate => None,
        }
    }

    /// Maps the value of an [`Applied`](Outcome::Applied) outcome.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Outcome<U> {
        match self {
            Outcome::Applied(v) => Outcome::Applied(f(v)),
            Outcome::Duplicate => Outcome::Duplicate,
        }
    }
}
