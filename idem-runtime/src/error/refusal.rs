use std::fmt;

use crate::key::KeyError;

/// Bad input, refused before anything was written (before any I/O, but for
/// [`Partitions`](Refusal::Partitions), which reads the table first). The message names what
/// was refused, why, and what to do; the variant says which input.
///
/// A refusal is never transient: the same input is refused again, so a redelivery of the
/// same job fails the same way until the job or the code changes. It reaches callers as
/// [`Error::Refused`](crate::Error::Refused).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// The key was refused before any I/O: nothing was written.
    #[error("invalid idempotency key: {0}")]
    Key(KeyError),

    /// A batch of more jobs than one claim takes ([`MAX_BATCH`](crate::MAX_BATCH)), refused
    /// before any I/O: nothing was claimed. [`KeyError::BatchTooLarge`] (from
    /// [`Key::batch`](crate::Key::batch)) converts into this variant.
    #[error(
        "a batch of {len} jobs is more than the {max} one claim takes: nothing was claimed; \
         split it into batches of at most {max} (do not redeliver it unchanged: it would be \
         refused again)",
        max = crate::key::MAX_BATCH
    )]
    Batch {
        /// How many jobs the batch held.
        len: usize,
    },

    /// The table name given to [`Store::with_table`](crate::Store::with_table) is not a plain
    /// SQL identifier.
    #[error(
        "invalid table name {name:?}: use a plain SQL identifier of at most 47 characters \
         (a letter or `_`, then letters, digits or `_`)"
    )]
    Table {
        /// The name that was refused.
        name: String,
    },

    /// The scope given to [`Store::claim`](crate::Store::claim) or
    /// [`Store::forget`](crate::Store::forget) is empty, longer than 255 bytes or holds a NUL
    /// byte. Nothing was written.
    #[error(
        "invalid scope {scope:?}: a scope is 1 to 255 bytes with no NUL byte, \
         like \"billing.top_up\""
    )]
    Scope {
        /// The scope that was refused.
        scope: String,
    },

    /// [`Outbox::send`](crate::Outbox::send) refused a message it can know the broker would
    /// refuse (an empty destination, a payload over
    /// [`MAX_PAYLOAD`](crate::outbox::MAX_PAYLOAD)), before anything was written. The body
    /// decides: return it (the job fails and nothing is kept) or send something else.
    #[error("the outbox refused a message: {reason}; nothing was written")]
    Message {
        /// What is wrong with it.
        reason: String,
    },

    /// A lease length outside [`MIN_LEASE`](crate::MIN_LEASE) and
    /// [`MAX_LEASE`](crate::MAX_LEASE), refused before any I/O: nothing was written.
    #[error(
        "a lease of {lease:?} is out of bounds: a lease must be at least 1s and at most 24h \
         (a job that runs longer renews its lease with `Lease::renew`); nothing was written"
    )]
    Lease {
        /// The lease that was refused.
        lease: std::time::Duration,
    },

    /// A retention window outside [`MIN_RETENTION`](crate::MIN_RETENTION) and a century,
    /// given to [`Store::set_retention`](crate::Store::set_retention): refused before any
    /// I/O, nothing was written.
    #[error(
        "a retention of {retention:?} is out of bounds: a scope keeps its markers at least 1s \
         and less than a century (choose a window longer than the time its broker may still \
         redeliver a job); nothing was written"
    )]
    Retention {
        /// The window that was refused.
        retention: std::time::Duration,
    },

    /// A marker table cannot be partitioned as asked (`Store::partitions`, on PostgreSQL): it
    /// exists and is not partitioned, or the days asked for are out of range. Nothing was
    /// written.
    #[error(
        "the marker table {table:?} cannot be partitioned as asked: {problem}; nothing was written"
    )]
    Partitions {
        /// The table.
        table: String,
        /// What stands in the way, and what to do instead.
        problem: String,
    },

    /// A step of a lease's body ([`Lease::step`](crate::Lease::step)) was refused before it
    /// ran: its name is empty, too long or holds a NUL byte, the body already ran a step of
    /// that name, another step of the body was still running, or a database step named
    /// another database than the lease's. Nothing of the step ran or was recorded.
    #[error("the step {step:?} of {scope:?} / {key:?} was refused: {reason}; nothing of it ran")]
    Step {
        /// The scope of the call.
        scope: String,
        /// The encoded key of the call.
        key: String,
        /// The step's name.
        step: String,
        /// What is wrong, and what to do.
        reason: String,
    },

    /// [`GroupOptions`](crate::GroupOptions) out of their bounds, refused by
    /// [`Store::group`](crate::Store::group) before any I/O.
    #[error("invalid group options: {reason}")]
    Group {
        /// What is out of bounds, and the bounds.
        reason: String,
    },

    /// An offset claim or a watermark call was refused before any I/O (an empty or over-long
    /// consumer group or topic, a negative partition or offset, a partition's offsets out of
    /// order): nothing was written.
    #[error("idem refused the offsets: {reason}; nothing was written")]
    Offsets {
        /// What is wrong with them.
        reason: String,
    },

    /// A Kafka record the per-message marker mode cannot key (feature `kafka`): it lacks the
    /// id header the consumer was told to key by, or its value is no key. Refused before any
    /// I/O: nothing was written.
    #[error("idem refused a record: {reason}")]
    Record {
        /// Which record, and what is wrong with it.
        reason: String,
    },

    /// A claim with a store (a transaction-mode, lease-mode or batch handler, or
    /// [`Store::claim`](crate::Store::claim), [`Store::lease`](crate::Store::lease),
    /// [`Store::claim_batch`](crate::Store::claim_batch)) was made while this task held the
    /// open transaction of another claim (a handler's body, a hand-written guard, a request
    /// behind the HTTP layer). Its own transaction (or lease) would not be the open one: on
    /// SQLite it would wait for the open transaction's write lock (forever, on every
    /// redelivery), elsewhere it would commit on its own, whatever the open one does. Refused
    /// before any I/O: nothing was written by this call. Pass `store.join(tx)` (the open
    /// transaction) instead of the store, or make the call before or after the other claim's
    /// body.
    #[error("{}", NestedMessage { inner, outer })]
    Nested {
        /// The handler called with a store (`Store::claim` for a hand-written claim).
        inner: String,
        /// The handler whose body was running.
        outer: String,
    },
}

struct NestedMessage<'a> {
    inner: &'a str,
    outer: &'a str,
}

impl fmt::Display for NestedMessage<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let NestedMessage { inner, outer } = self;
        write!(
            f,
            "`{inner}` was called with a store inside the body of `{outer}`, whose transaction \
             is open, and would not run in that transaction (nothing was written): "
        )?;
        // The advice names the call to write: a handler takes the joined store in place of
        // the store, a hand-written claim is made on it; a lease has no transaction to join.
        match *inner {
            "Store::claim" | "Store::claim_batch" => {
                f.write_str("claim with `store.join(tx).claim(scope, &key)` to join it")
            }
            "Store::lease" => write!(
                f,
                "a lease has no transaction to join: take it before or after `{outer}`'s body"
            ),
            _ => write!(
                f,
                "call `{inner}(store.join(tx), ...)` to join it; a lease-mode handler has no \
                 transaction to join: call it before or after `{outer}`'s body"
            ),
        }
    }
}
