/// The work of a call was not kept: its transaction (or savepoint) was rolled back, by the
/// database or on purpose, or its job never finished; for a group whose commit lost its answer, it
/// may have been kept ([`Group`](NotKept::Group)'s `may_be_kept`). Either way the redelivery
/// settles it by its marker: nack the job. It reaches callers as
/// [`Error::NotKept`](crate::Error::NotKept); the variant says how, and its message what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NotKept {
    /// The body returned `Ok`, but the database did not commit: a statement in the body failed
    /// and the body carried on (PostgreSQL then aborts the transaction and answers `COMMIT`
    /// with a rollback; MySQL rolls the whole transaction back on a deadlock; SQLite on
    /// `INSERT OR ROLLBACK` and disk errors). Neither the marker nor the effect was kept.
    #[error(
        "the transaction of {scope:?} / {key:?} was rolled back by the database although the \
         body returned Ok: a statement in the body failed and its error was ignored. Nothing \
         was kept; let the job be redelivered, and return database errors from the body with \
         `?` instead of ignoring or retrying them"
    )]
    RolledBack {
        /// The scope of the call.
        scope: String,
        /// The encoded key of the call.
        key: String,
    },

    /// [`commit`](crate::commit) of a transaction the database had already rolled back (a
    /// statement in it failed and its error was ignored): nothing of it was kept.
    #[error(
        "the transaction was rolled back by the database instead of committed: a statement in \
         it failed and its error was ignored. Nothing of it was kept (the idempotent calls it \
         joined included): let the job be redelivered, and return database errors with `?`"
    )]
    NotCommitted,

    /// A job of a batch run job by job ([`EachGuard`](crate::EachGuard)) did not finish: its
    /// [`JobGuard`](crate::JobGuard) was dropped before `finish` (a panic that was caught, a
    /// future cancelled), or the batch finished without running it. Its savepoint was rolled
    /// back and its marker given back: nothing of it was kept, and the rest of the batch was
    /// not touched.
    #[error(
        "the job {key:?} of {scope:?} did not finish in its batch (its guard was dropped, or \
         the batch finished without running it): nothing of it was kept; nack it so that it \
         is redelivered"
    )]
    JobNotFinished {
        /// The scope of the batch.
        scope: String,
        /// The encoded key of the job.
        key: String,
    },

    /// Group commit: this call's work was done in a group's shared transaction, and the group
    /// failed as a whole (its connection was lost, the database rolled it back, its commit
    /// failed or lost its answer). `may_be_kept` says whether the commit may have landed
    /// (only when its answer was lost); otherwise nothing of the group was kept. Either way,
    /// nack the job: the redelivery settles it by its marker (it runs once, or is a
    /// duplicate).
    #[error(
        "the group transaction holding {scope:?} / {key:?} failed ({reason}): {}; nack the \
         job, the redelivery settles it by its marker (it runs once or is a duplicate)",
        if *may_be_kept {
            "its commit may have landed"
        } else {
            "nothing of it was kept"
        }
    )]
    Group {
        /// The scope of the call.
        scope: String,
        /// The encoded key of the call.
        key: String,
        /// Whether the group's commit may have landed (its answer was lost).
        may_be_kept: bool,
        /// What failed, for the log.
        reason: String,
    },

    /// Group commit: this call's body ran longer than its group's
    /// [`max_body`](crate::GroupOptions::max_body), and was stopped so that the calls kept
    /// before it could commit: its savepoint was rolled back, nothing of it was kept.
    #[error(
        "the body of {scope:?} / {key:?} ran longer than its group's bound ({after:?}, \
         GroupOptions::max_body) and was stopped so that the calls kept before it could commit: \
         nothing of it was kept; nack the job so that it runs again, and give the body's own \
         waits a timeout (or raise max_body, or run such a handler outside a group)"
    )]
    TimedOut {
        /// The scope of the call.
        scope: String,
        /// The encoded key of the call.
        key: String,
        /// The bound it ran past.
        after: std::time::Duration,
    },

    /// A failure that `idem::testing` injected on purpose, right before the
    /// commit (transaction mode) or the completing statement (lease mode) of a delivery under
    /// test: the transaction was rolled back, or the lease released, instead. Only tests that
    /// use the kit ever see it; the variant is there in every build so that the enum's shape
    /// does not depend on a feature another crate of the build may turn on.
    #[error(
        "idem::testing injected a failure into {scope:?} / {key:?} right before its {at}, as \
         the test asked: nothing was committed by idem (a redelivery must now apply the job \
         once); this error only comes from tests that use idem::testing"
    )]
    Injected {
        /// The scope of the call.
        scope: String,
        /// The encoded key of the call.
        key: String,
        /// Where: `"commit"`, `"savepoint release"` (a joined call) or `"completing
        /// statement"` (lease mode).
        at: &'static str,
    },
}
