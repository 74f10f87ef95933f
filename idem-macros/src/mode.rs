//! The mode a handler runs in: what every phase after the arguments follows.

/// How the handler runs its body. Decided once, by `validate::mode`: the signature analysis and the
/// expansion follow it rather than guessing again.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Claim, body and commit in one database transaction (or in a savepoint of the caller's,
    /// given `store.join(tx)`: the store argument decides that at run time).
    Transaction,
    /// Transaction mode in a group commit (`group`): concurrent calls share one transaction
    /// and one commit, each call in a savepoint of its own.
    Group,
    /// Claim a lease, run the body outside any transaction, complete the marker after it.
    Lease,
    /// Claim every job of a batch with one statement, run the body once for the fresh ones,
    /// and commit their markers and effects together.
    Batch,
    /// A batch run job by job (`each = "job"`): one transaction for the batch, the body once
    /// per fresh job in a savepoint of its own, one result per job.
    Each,
}
