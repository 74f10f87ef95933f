use std::fmt;

use crate::key::KeyError;

mod database;
mod refusal;
#[cfg(test)]
mod tests;

use database::{DatabaseMessage, is_read_only, transient};
pub use refusal::Refusal;

/// Everything that can go wrong around an idempotent call.
///
/// Each message says what happened and what to do about it. Handlers return their own error
/// type `E`; the generated code converts an `Error` into it with `E: From<idem::Error>`
/// (`sqlx::Error` and `anyhow::Error` already qualify).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The database failed while claiming, committing or rolling back.
    ///
    /// The marker and the effect live in one transaction, so they were either both kept or both
    /// lost: letting the broker redeliver the job is safe, it will run once or report a duplicate.
    /// The message says the cause once, with advice that fits it (a missing marker table, a
    /// database that cannot be reached); the sqlx error is the variant's field, not a
    /// `source()`, so that error reporters do not print it twice.
    #[error("{}", DatabaseMessage(.0))]
    Database(sqlx::Error),

    /// The database refused to write: it is read-only. PostgreSQL answers so (SQLSTATE
    /// `25006`) on a hot standby and in a session with `default_transaction_read_only` on;
    /// MySQL and MariaDB on a replica or server with `read_only` (and in a read-only
    /// transaction). The claim wrote nothing, so no job is reported `Applied` there and
    /// nothing was kept: nack the job, and point the pool at the primary (after a failover,
    /// at the promoted server); it runs once writes are accepted again. The sqlx error is the
    /// variant's field, as in [`Error::Database`].
    #[error("{}", DatabaseMessage(.0))]
    ReadOnly(sqlx::Error),

    /// Bad input, refused before anything was written. The [`Refusal`] says which
    /// input (a key, a batch's size, a scope, a table name, an outbox message, a lease, ...),
    /// and its message why and what to do. Never transient: the same input is refused again.
    #[error("{0}")]
    Refused(Refusal),

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

    /// Another delivery of the same key still holds it (its transaction or its lease), and
    /// this one stopped waiting (`wait`). Nothing ran; nack the job so that the broker
    /// redelivers it later: never ack it, the first delivery may still fail.
    #[error(
        "another delivery of {scope:?} / {key:?} is still in progress: nothing ran; nack the \
         job so that it is redelivered later (do not ack it: the other delivery may still fail)"
    )]
    InProgress {
        /// The scope of the call.
        scope: String,
        /// The encoded key of the call.
        key: String,
    },

    /// The key was used before for another payload (`fingerprint`): the job was refused
    /// without running. A client that reuses an idempotency key for a different request must
    /// be told, not silently skipped (HTTP APIs answer 422).
    #[error(
        "the key {key:?} of {scope:?} was already used for another payload: nothing ran; \
         this is a different job under a reused id, so give it its own key (do not retry it)"
    )]
    KeyReused {
        /// The scope of the call.
        scope: String,
        /// The encoded key of the call.
        key: String,
    },

    /// A value could not be turned into JSON or back: the `fingerprint` expression (refused
    /// before any I/O), the handler's `Ok` value with `replay` in transaction mode (the
    /// transaction was rolled back), or a stored value read back by hand with
    /// [`Recorded::decode`](crate::Recorded::decode). The message says which, and what was
    /// kept.
    #[error("{0}")]
    Serialize(String),

    /// Lease mode with `replay`: the body's outside call happened and the marker is completed
    /// (later deliveries are [`Outcome::Duplicate`](crate::Outcome::Duplicate), the call is
    /// never repeated), but its value could not be stored to replay: it cannot be serialised,
    /// or its JSON is over [`MAX_REPLAY_LEN`](crate::MAX_REPLAY_LEN). Ack the job.
    #[error(
        "the work of {scope:?} / {key:?} was done and its marker completed (later deliveries \
         are duplicates and will not call the outside system again), but its value was not \
         stored for `replay`: {reason}. Ack the job; make the value storable to replay it"
    )]
    ValueNotStored {
        /// The scope of the call.
        scope: String,
        /// The encoded key of the call.
        key: String,
        /// Why the value could not be stored.
        reason: String,
    },

    /// [`commit`](crate::commit) of a transaction the database had already rolled back (a
    /// statement in it failed and its error was ignored): nothing of it was kept.
    #[error(
        "the transaction was rolled back by the database instead of committed: a statement in \
         it failed and its error was ignored. Nothing of it was kept (the idempotent calls it \
         joined included): let the job be redelivered, and return database errors with `?`"
    )]
    NotCommitted,

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
    LeaseHeld {
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
    LeaseLost {
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
    GroupFailed {
        /// The scope of the call.
        scope: String,
        /// The encoded key of the call.
        key: String,
        /// Whether the group's commit may have landed (its answer was lost).
        may_be_kept: bool,
        /// What failed, for the log.
        reason: String,
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

    /// The database's watermark of a partition is past the end of the partition's log: the
    /// topic was deleted and made again, or its log was truncated (a broker that lost its
    /// data). Records now in the log below the watermark would be taken for duplicates, so the
    /// Kafka consumer does not consume the partition; nothing was written.
    #[error(
        "the watermark of {group:?} on {topic:?} partition {partition} is {watermark}, past \
         the end of the partition's log ({log_end}): the topic was made again or its log lost \
         records, and its new records would be taken for duplicates; the partition is not \
         consumed. If the log was made anew, set the watermark to where its records start \
         (`Store::set_watermark`); nothing was written"
    )]
    WatermarkAhead {
        /// The consumer group.
        group: String,
        /// The topic.
        topic: String,
        /// The partition.
        partition: i32,
        /// The next offset the database holds for it.
        watermark: i64,
        /// The partition's end (its high watermark): the offset of the next record it takes.
        log_end: i64,
    },

    /// The Kafka client failed (feature `kafka`): a broker that cannot be reached, a
    /// subscription or commit refused. What it says comes from librdkafka.
    #[error("kafka: {reason}")]
    Kafka {
        /// librdkafka's description, with what idem was doing.
        reason: String,
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

impl From<KeyError> for Error {
    /// A refused key is [`Refusal::Key`]; a batch over [`MAX_BATCH`](crate::MAX_BATCH)
    /// is [`Refusal::Batch`], the refusal it names.
    fn from(err: KeyError) -> Self {
        Error::Refused(match err {
            KeyError::BatchTooLarge { len } => Refusal::Batch { len },
            other => Refusal::Key(other),
        })
    }
}

impl From<Refusal> for Error {
    fn from(refusal: Refusal) -> Self {
        Error::Refused(refusal)
    }
}

/// A refused key in a handler that returns `sqlx::Error`: it travels as the [`Error`] it
/// converts into, as every idem error does (see `From<Error> for sqlx::Error`).
impl From<KeyError> for sqlx::Error {
    fn from(err: KeyError) -> Self {
        sqlx::Error::from(Error::from(err))
    }
}

impl From<sqlx::Error> for Error {
    /// An idem error that travelled inside a `sqlx::Error` (see `From<Error> for sqlx::Error`)
    /// comes back as itself.
    fn from(err: sqlx::Error) -> Self {
        match err {
            sqlx::Error::Database(db) => match db.try_downcast::<Error>() {
                Ok(idem) => *idem,
                Err(db) => {
                    let err = sqlx::Error::Database(db);
                    if is_read_only(&err) {
                        Error::ReadOnly(err)
                    } else {
                        Error::Database(err)
                    }
                }
            },
            other => Error::Database(other),
        }
    }
}

impl Error {
    /// What a delivery the test kit crashed after a step ends with (`Class::Crashed`, which
    /// only the kit sets).
    pub(crate) fn crashed(scope: &str, key: &str) -> Self {
        Error::Injected {
            scope: scope.to_owned(),
            key: key.to_owned(),
            at: "end of a step",
        }
    }

    /// Whether a redelivery of the same job may succeed where this call failed: nack it (or
    /// retry the request with the same key). `false` means it fails the same way until the
    /// job, the code or the database changes (a refused key or scope, a reused key, a value
    /// that cannot be stored, a missing table or column, a privilege the database refused):
    /// dead-letter or park it, and fix what the message names. Messages give "retry" advice
    /// only for the transient ones.
    ///
    /// ```
    /// # use idem_runtime as idem;
    /// let busy = idem::Error::InProgress { scope: "s".into(), key: "k".into() };
    /// assert!(busy.is_transient());
    /// assert!(!idem::Error::Refused(idem::Refusal::Batch { len: 1001 }).is_transient());
    /// ```
    pub fn is_transient(&self) -> bool {
        match self {
            Error::InProgress { .. }
            | Error::RolledBack { .. }
            | Error::NotCommitted
            | Error::LeaseLost { .. }
            | Error::Timeout { .. }
            | Error::Unverified { .. }
            | Error::JobNotFinished { .. }
            | Error::GroupFailed { .. }
            | Error::Kafka { .. } => true,
            Error::Database(e) => transient(e),
            // A standby is promoted, a pool reconnects to the primary: a redelivery may land.
            Error::ReadOnly(_) => true,
            Error::Injected { .. } => true,
            Error::Refused(_)
            | Error::KeyReused { .. }
            | Error::Serialize(_)
            | Error::ValueNotStored { .. }
            | Error::WatermarkAhead { .. }
            | Error::Nested { .. }
            | Error::LeaseHeld { .. } => false,
        }
    }

    /// The driver's error, for an [`Error::Database`] the database returned.
    pub(super) fn driver_error(&self) -> Option<&dyn sqlx::error::DatabaseError> {
        match self {
            Error::Database(e) | Error::ReadOnly(e) => e.as_database_error(),
            _ => None,
        }
    }
}
