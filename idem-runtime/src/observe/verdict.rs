//! How a call ended, as one bounded label, and the one event that says so.

use tracing::Span;

use super::keys;
use crate::error::{Error, KafkaError, LeaseError, NotKept};
use crate::outcome::{Failed, Outcome};

/// How a call ended: the span's `outcome` field and the counter's `outcome` label.
///
/// One value per kind of [`Error`] an operator acts on differently; the rest (the body's own
/// errors, database failures) are `error`. The set is fixed, so the label stays bounded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    Applied,
    Duplicate,
    Replayed,
    Failed,
    InProgress,
    RolledBack,
    Timeout,
    KeyReused,
    LeaseLost,
    ValueNotStored,
    Invalid,
    Error,
}

/// How many [`Verdict`]s there are.
pub(super) const COUNT: usize = 12;

impl Verdict {
    /// The label values, in the order of the variants.
    pub(super) const ALL: [&'static str; COUNT] = [
        "applied",
        "duplicate",
        "replayed",
        "failed",
        "in_progress",
        "rolled_back",
        "timeout",
        "key_reused",
        "lease_lost",
        "value_not_stored",
        "invalid",
        "error",
    ];

    pub(super) fn of<T, E>(result: &Result<Outcome<T>, Failed<E>>) -> Self {
        match result {
            Ok(Outcome::Applied(_)) => Verdict::Applied,
            Ok(Outcome::Duplicate) => Verdict::Duplicate,
            Ok(Outcome::Replayed(_)) => Verdict::Replayed,
            Ok(Outcome::Failed(_)) => Verdict::Failed,
            Err(failed) => Verdict::of_failed(failed),
        }
    }

    pub(super) fn of_failed<E>(failed: &Failed<E>) -> Self {
        match failed {
            Failed::Idem(error) => Verdict::of_error(error),
            Failed::Handler(_) => Verdict::Error,
        }
    }

    pub(super) fn of_error(error: &Error) -> Self {
        match error {
            Error::InProgress { .. } => Verdict::InProgress,
            Error::NotKept(NotKept::RolledBack { .. }) | Error::NotKept(NotKept::NotCommitted) => {
                Verdict::RolledBack
            }
            Error::Lease(LeaseError::Timeout { .. }) | Error::NotKept(NotKept::TimedOut { .. }) => {
                Verdict::Timeout
            }
            Error::KeyReused { .. } => Verdict::KeyReused,
            Error::Lease(LeaseError::Lost { .. }) => Verdict::LeaseLost,
            Error::ValueNotStored { .. } => Verdict::ValueNotStored,
            // Refused as given (a nested claim included): a redelivery fails the same way until
            // the job or the code changes.
            Error::Refused(_)
            | Error::Kafka(KafkaError::WatermarkAhead { .. })
            | Error::Serialize(_) => Verdict::Invalid,
            // An operator's refusal: it ends no call.
            Error::Lease(LeaseError::Held { .. }) => Verdict::Invalid,
            Error::Database(_)
            | Error::ReadOnly(_)
            | Error::Kafka(KafkaError::Client { .. })
            | Error::Wal(_)
            | Error::NotKept(NotKept::JobNotFinished { .. })
            | Error::NotKept(NotKept::Group { .. })
            | Error::Lease(LeaseError::Unverified { .. })
            | Error::NotKept(NotKept::Injected { .. }) => Verdict::Error,
        }
    }

    pub(super) fn as_str(self) -> &'static str {
        Self::ALL[self as usize]
    }
}

/// The `error` of a call whose holder was dropped before it finished.
pub(super) const DROPPED: &str = "the call was dropped before it finished (a panic or a \
    cancelled future): its transaction was rolled back, or its lease released";

/// How a call ended, for its event.
pub(super) enum Ended<'a> {
    /// With an outcome.
    Ok,
    /// With an error of idem's own.
    Idem(&'a Error),
    /// With the body's own error, which the caller gets back.
    Handler,
    /// Its holder was dropped before it finished: a panic, a cancelled future.
    Dropped,
}

/// The one event of a call, in its span, once its fields are recorded: `idem call finished`
/// with `outcome`, and `error` (the text of idem's error, keys shown as
/// [`observe_keys`](super::observe_keys) says) when idem's own error ended the call.
///
/// Levels: the outcomes a healthy worker has all day (applied, duplicate, replayed) and a
/// body's own error (which the caller gets back and logs itself; idem cannot print a type it
/// knows nothing of) at DEBUG; another delivery holding the key at INFO (a nack, normal under
/// at-least-once delivery); every error of idem's own at WARN (each needs a look: a timeout, a
/// lost lease, a reused key, a swallowed statement error, a value not stored, a refused key,
/// a database failure), and a holder dropped before it finished.
pub(super) fn finished(span: &Span, verdict: Verdict, ended: Ended<'_>) {
    // The span as the explicit parent, rather than entered: no enter and exit per call.
    let outcome = verdict.as_str();
    match ended {
        Ended::Idem(error) if verdict == Verdict::InProgress => tracing::info!(
            target: "idem",
            parent: span,
            outcome,
            error = %keys::error_text(error),
            "idem call finished"
        ),
        Ended::Idem(error) => tracing::warn!(
            target: "idem",
            parent: span,
            outcome,
            error = %keys::error_text(error),
            "idem call finished"
        ),
        Ended::Dropped => tracing::warn!(
            target: "idem",
            parent: span,
            outcome,
            error = DROPPED,
            "idem call finished"
        ),
        Ended::Ok | Ended::Handler => {
            tracing::debug!(target: "idem", parent: span, outcome, "idem call finished");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Refusal;

    fn idem(error: Error) -> Verdict {
        Verdict::of_failed::<()>(&Failed::Idem(error))
    }

    fn sk() -> (String, String) {
        ("s".to_owned(), "k".to_owned())
    }

    #[test]
    fn every_error_kind_has_its_label() {
        let (scope, key) = sk();
        let cases = [
            (
                Error::InProgress {
                    scope: scope.clone(),
                    key: key.clone(),
                },
                "in_progress",
            ),
            (
                Error::NotKept(NotKept::RolledBack {
                    scope: scope.clone(),
                    key: key.clone(),
                }),
                "rolled_back",
            ),
            (Error::NotKept(NotKept::NotCommitted), "rolled_back"),
            (
                Error::Lease(LeaseError::Timeout {
                    scope: scope.clone(),
                    key: key.clone(),
                    after: std::time::Duration::from_secs(1),
                }),
                "timeout",
            ),
            (
                Error::NotKept(NotKept::TimedOut {
                    scope: scope.clone(),
                    key: key.clone(),
                    after: std::time::Duration::from_secs(1),
                }),
                "timeout",
            ),
            (
                Error::KeyReused {
                    scope: scope.clone(),
                    key: key.clone(),
                },
                "key_reused",
            ),
            (
                Error::Lease(LeaseError::Lost {
                    scope: scope.clone(),
                    key: key.clone(),
                }),
                "lease_lost",
            ),
            (
                Error::ValueNotStored {
                    scope: scope.clone(),
                    key: key.clone(),
                    reason: "r".into(),
                },
                "value_not_stored",
            ),
            (Error::from(crate::key::KeyError::Empty), "invalid"),
            (Error::Refused(Refusal::Scope { scope }), "invalid"),
            (Error::Serialize("s".into()), "invalid"),
            (Error::from(sqlx::Error::PoolTimedOut), "error"),
        ];
        for (error, label) in cases {
            let text = error.to_string();
            assert_eq!(idem(error).as_str(), label, "{text}");
        }
        assert_eq!(Verdict::of_failed(&Failed::Handler(())).as_str(), "error");
        assert_eq!(Verdict::Error as usize, COUNT - 1);
    }
}
