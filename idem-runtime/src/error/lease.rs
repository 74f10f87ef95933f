/// A lease that could not be kept, taken or verified: the lease mode's own failures, and an
/// operator's [`Store::forget`](crate::Store::forget) of a marker whose lease is live. It
/// reaches callers as [`Error::Lease`](crate::Error::Lease); the variant says which, and its
/// message what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LeaseError {
    /// [`Store::forget`](crate::Store::forget) of a marker whose lease a delivery still holds:
    /// nothing was changed. That delivery may still be calling the outside system, and a
    /// redelivery let through now would call it again beside it.
    #[error(
        "the marker of {scope:?} / {key:?} was not forgotten: a delivery still holds its lease \
         and may still be calling the outside system. Wait until it completes or its lease runs \
         out (`idem stuck` shows when), or force it (`Store::forget_forced`, `idem forget \
         --force`) if that delivery is known to be gone: the next delivery then runs the job \
         again, with the same idempotency key"
    )]
    Held {
        /// The scope of the marker.
        scope: String,
        /// The encoded key of the marker.
        key: String,
    },

    /// Lease mode: the body finished, but its lease had run out and another delivery took the
    /// key over (or an operator forgot it), so this result was not recorded. The other
    /// delivery, which holds the same idempotency key, decides the outcome.
    #[error(
        "the lease on {scope:?} / {key:?} was lost: it ran out and another delivery took the \
         key over, so this delivery's result was not recorded; nack or drop the job, the \
         holder of the lease completes it (a longer lease, or `Lease::renew` during long \
         calls, avoids this)"
    )]
    Lost {
        /// The scope of the call.
        scope: String,
        /// The encoded key of the call.
        key: String,
    },

    /// A step's verify ([`Lease::step_verified`](crate::Lease::step_verified)) could not tell
    /// whether an earlier delivery's run of the step had its effect. Nothing ran; the lease is
    /// kept until it runs out, and the next delivery asks again: nack the job.
    #[error(
        "the outside system could not tell whether the step {step:?} of {scope:?} / {key:?} \
         had its effect in an earlier delivery: nothing ran, and the lease is kept until it \
         runs out; nack the job so that a later delivery asks again"
    )]
    Unverified {
        /// The scope of the call.
        scope: String,
        /// The encoded key of the call.
        key: String,
        /// The step's name.
        step: String,
    },

    /// Lease mode: the body ran longer than its timeout and was cancelled; the key was released
    /// at once, so a redelivery retries (with the same idempotency key).
    #[error(
        "the body of {scope:?} / {key:?} did not finish within {after:?} (of its claim or of \
         its last `Lease::renew`) and was cancelled; \
         the key was released: nack the job so that it is retried (the outside call may have \
         happened: the retry sends the same idempotency key)"
    )]
    Timeout {
        /// The scope of the call.
        scope: String,
        /// The encoded key of the call.
        key: String,
        /// The timeout that ran out.
        after: std::time::Duration,
    },
}
