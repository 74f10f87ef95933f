use crate::key::KeyError;

mod database;
mod job;
mod kafka;
mod lease;
mod not_kept;
mod refusal;
#[cfg(test)]
mod tests;
mod wal;

use database::{DatabaseMessage, is_read_only, transient};
pub use job::JobError;
pub use kafka::KafkaError;
pub use lease::LeaseError;
pub use not_kept::NotKept;
pub use refusal::Refusal;
pub use wal::WalError;

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
    /// input (a key, a batch's size, a scope, a table name, an outbox message, a lease, a
    /// claim made inside another claim's body, ...), and its message why and what to do. Never transient: the same input is refused again.
    #[error("{0}")]
    Refused(Refusal),

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

    /// A lease that could not be kept, taken or verified: lost to another delivery, out of
    /// time, a step that could not be verified, or a marker whose live lease kept
    /// [`Store::forget`](crate::Store::forget) from forgetting it. The [`LeaseError`] says
    /// which, and its message what to do.
    #[error("{0}")]
    Lease(LeaseError),

    /// The work was not kept (or, for a group whose commit's answer was lost, may have been):
    /// rolled back by the database, by a failed group, on purpose by the test kit, or a job of
    /// a batch that did not finish. The [`NotKept`] says how, and its message what to do;
    /// nack the job, the redelivery settles it by its marker.
    #[error("{0}")]
    NotKept(NotKept),

    /// The Kafka consumer or producer could not go on (feature `kafka`): the client failed,
    /// or a partition's watermark is past the end of its log. The [`KafkaError`] says which,
    /// and its message what to do.
    #[error("{0}")]
    Kafka(KafkaError),

    /// The WAL relay could not go on, or was not set up to (feature `wal-relay`). The
    /// [`WalError`] says which, and its message what to do.
    #[error("{0}")]
    Wal(WalError),
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

/// Each family's error is the `Error` variant that carries it (not its `source()`: the
/// variant displays it already, and reporters would print it twice).
macro_rules! families {
    ($($variant:ident($family:ty),)*) => {$(
        impl From<$family> for Error {
            fn from(err: $family) -> Self {
                Error::$variant(err)
            }
        }
    )*};
}

families! {
    Refused(Refusal),
    Lease(LeaseError),
    NotKept(NotKept),
    Kafka(KafkaError),
    Wal(WalError),
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

/// Whether a redelivery may succeed where a database error of a body's own failed: what
/// [`Error::is_transient`] says of the `Error` it converts into.
pub(crate) fn is_transient_database(err: &sqlx::Error) -> bool {
    is_read_only(err) || transient(err)
}

impl Error {
    /// What a delivery the test kit crashed after a step ends with (`Class::Crashed`, which
    /// only the kit sets).
    pub(crate) fn crashed(scope: &str, key: &str) -> Self {
        Error::NotKept(NotKept::Injected {
            scope: scope.to_owned(),
            key: key.to_owned(),
            at: "end of a step",
        })
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
            Error::InProgress { .. } => true,
            // Nothing was kept (or a group's commit may have landed): the redelivery settles
            // it by its marker.
            Error::NotKept(_) => true,
            Error::Lease(lease) => match lease {
                LeaseError::Lost { .. }
                | LeaseError::Timeout { .. }
                | LeaseError::Unverified { .. } => true,
                LeaseError::Held { .. } => false,
            },
            Error::Kafka(kafka) => match kafka {
                KafkaError::Client { .. } => true,
                KafkaError::WatermarkAhead { .. } => false,
            },
            Error::Wal(wal) => matches!(wal, WalError::Stream { .. } | WalError::NoSlot),
            Error::Database(e) => transient(e),
            // A standby is promoted, a pool reconnects to the primary: a redelivery may land.
            Error::ReadOnly(_) => true,
            Error::Refused(_)
            | Error::KeyReused { .. }
            | Error::Serialize(_)
            | Error::ValueNotStored { .. } => false,
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
