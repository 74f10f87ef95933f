//! The mode a handler runs in: what every phase after the arguments follows.

/// How the handler runs its body. Decided once, by `validate::mode`: the signature analysis and the
/// expansion follow it rather than guessing again.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Claim, body and commit in one database transaction.
    Transaction,
    /// Claim a lease, run the body outside any transaction, complete the marker after it.
    Lease,
    /// Claim every job of a batch with one statement, run the body once for the fresh ones,
    /// and commit their markers and effects together.
    Batch,
}
