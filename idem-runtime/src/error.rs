use std::fmt;

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
    #[error(
        "database error: {0} (the job's marker and its effect were kept or lost together: \
         let the broker redeliver the job, idem will run it once or report a duplicate)"
    )]
    Database(#[from] sqlx::Error),

    /// The key was refused before any I/O: nothing was written.
    #[error("invalid idempotency key: {0}")]
    InvalidKey(#[from] KeyError),

    /// The table name given to [`Store::with_table`](crate::Store::with_table) is not a plain
    /// SQL identifier.
    #[error(
        "invalid table name {name:?}: use a plain SQL identifier of at most 47 characters \
         (a letter or `_`, then letters, digits or `_`)"
    )]
    InvalidTable {
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
    InvalidScope {
        /// The scope that was refused.
        scope: String,
    },

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
}

/// Why a key was refused. Keys are checked before any I/O, so a refused key writes nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyError {
    /// The key (or one part of a tuple key) is the empty string.
    Empty,
    /// The encoded key is longer than [`MAX_KEY_LEN`](crate::MAX_KEY_LEN) bytes.
    TooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// The key contains a NUL byte, which PostgreSQL cannot store in `text`.
    Nul,
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyError::Empty => f.write_str(
                "the key is empty: every job needs a stable, non-empty id \
                 (check that the key expression reads the job's id)",
            ),
            KeyError::TooLong { len } => write!(
                f,
                "the encoded key is {len} bytes, more than the {} allowed: use a shorter id, \
                 or a digest of a long one (for example the hex SHA-256 of it)",
                crate::MAX_KEY_LEN
            ),
            KeyError::Nul => f.write_str(
                "the key contains a NUL byte, which databases cannot store as text: \
                 strip it, or encode the id (for example as hex)",
            ),
        }
    }
}

impl std::error::Error for KeyError {}

impl From<Error> for sqlx::Error {
    /// Lets handlers that return `sqlx::Error` use `#[idempotent]` as they are.
    fn from(err: Error) -> Self {
        match err {
            Error::Database(e) => e,
            other => sqlx::Error::InvalidArgument(other.to_string()),
        }
    }
}
