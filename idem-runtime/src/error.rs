use std::fmt;

use crate::key::KeyError;

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

    /// The key was refused before any I/O: nothing was written.
    #[error("invalid idempotency key: {0}")]
    InvalidKey(KeyError),

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

    /// [`Outbox::send`](crate::Outbox::send) refused a message it can know the broker would
    /// refuse (an empty destination, a payload over
    /// [`MAX_PAYLOAD`](crate::outbox::MAX_PAYLOAD)), before anything was written. The body
    /// decides: return it (the job fails and nothing is kept) or send something else.
    #[error("the outbox refused a message: {reason}; nothing was written")]
    InvalidMessage {
        /// What is wrong with it.
        reason: String,
    },

    /// A lease length outside [`MIN_LEASE`](crate::MIN_LEASE) and
    /// [`MAX_LEASE`](crate::MAX_LEASE), refused before any I/O: nothing was written.
    #[error(
        "a lease of {lease:?} is out of bounds: a lease must be at least 1s and at most 24h \
         (a job that runs longer renews its lease with `Lease::renew`); nothing was written"
    )]
    InvalidLease {
        /// The lease that was refused.
        lease: std::time::Duration,
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

    /// A failure that [`idem::testing`](crate::testing) injected on purpose, right before the
    /// commit (transaction mode) or the completing statement (lease mode) of a delivery under
    /// test: the transaction was rolled back, or the lease released, instead. Only tests that
    /// use the kit ever see it.
    #[cfg(feature = "testing")]
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

    /// An offset claim or a watermark call was refused before any I/O (an empty or over-long
    /// consumer group or topic, a negative partition or offset, a partition's offsets out of
    /// order): nothing was written.
    #[error("idem refused the offsets: {reason}; nothing was written")]
    InvalidOffsets {
        /// What is wrong with them.
        reason: String,
    },

    /// A Kafka record the per-message marker mode cannot key (feature `kafka`): it lacks the
    /// id header the consumer was told to key by, or its value is no key. Refused before any
    /// I/O: nothing was written.
    #[error("idem refused a record: {reason}")]
    InvalidRecord {
        /// Which record, and what is wrong with it.
        reason: String,
    },

    /// The database's watermark of a partition is past the end of the partition's log: the
    /// topic was deleted and made again, or its log was truncated (a broker that lost its
    /// data). Records now in the log below the watermark would be taken for duplicates, so the
    /// Kafka consumer does not consume the partition; nothing was written.
    #[error(
        "the watermark of {group:?} on {topic:?} partition {partition} is {watermark}, past          the end of the partition's log ({log_end}): the topic was made again or its log lost          records, and its new records would be taken for duplicates; the partition is not          consumed. If the log was made anew, set the watermark to where its records start          (`Store::set_watermark`); nothing was written"
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
    fn from(err: KeyError) -> Self {
        Error::InvalidKey(err)
    }
}

impl From<sqlx::Error> for Error {
    /// An idem error that travelled inside a `sqlx::Error` (see `From<Error> for sqlx::Error`)
    /// comes back as itself.
    fn from(err: sqlx::Error) -> Self {
        match err {
            sqlx::Error::Database(db) => match db.try_downcast::<Error>() {
                Ok(idem) => *idem,
                Err(db) => Error::Database(sqlx::Error::Database(db)),
            },
            other => Error::Database(other),
        }
    }
}

impl Error {
    /// The driver's error, for an [`Error::Database`] the database returned.
    fn driver_error(&self) -> Option<&dyn sqlx::error::DatabaseError> {
        match self {
            Error::Database(e) => e.as_database_error(),
            _ => None,
        }
    }
}

/// The text of [`Error::Database`]: the cause, once, then what to do about it.
struct DatabaseMessage<'a>(&'a sqlx::Error);

impl fmt::Display for DatabaseMessage<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let err = self.0;
        // sqlx prefixes database errors with "error returned from database:" and the code;
        // the server's own message is what says what happened.
        match err.as_database_error() {
            Some(db) => write!(f, "the database refused a statement: {}", db.message())?,
            None => write!(f, "{err}")?,
        }
        f.write_str(": ")?;
        f.write_str(advice(err))
    }
}

fn advice(err: &sqlx::Error) -> &'static str {
    if is_missing_table(err) {
        return "the marker table does not exist: call `Store::migrate()` at start-up, or add \
                the statements of `Store::ddl()` to your migrations";
    }
    match err {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Configuration(_) => {
            "the database could not be reached: check its URL and that it is running. Let \
             the job be redelivered: if the connection was lost during the commit, the commit \
             may have landed, and the redelivery settles it (it runs once or is a duplicate)"
        }
        _ => {
            "the job's marker and its effect were kept or lost together, so let the broker \
             redeliver the job: it will run once or be reported as a duplicate"
        }
    }
}

/// PostgreSQL `42P01`, MySQL 1146, SQLite "no such table".
fn is_missing_table(err: &sqlx::Error) -> bool {
    let Some(db) = err.as_database_error() else {
        return false;
    };
    matches!(db.code().as_deref(), Some("42P01" | "42S02"))
        || db.message().contains("no such table")
}

/// What lets an [`Error`] ride inside [`sqlx::Error::Database`], so that handlers returning
/// `sqlx::Error` keep its kind (sqlx's blanket `From<E: DatabaseError>` makes the conversion):
/// sqlx's own pattern for driver errors gets it back.
///
/// ```
/// # use idem_runtime as idem;
/// let err = sqlx::Error::from(idem::Error::KeyReused { scope: "s".into(), key: "k".into() });
/// let idem_err = err
///     .as_database_error()
///     .and_then(|e| e.try_downcast_ref::<idem::Error>());
/// assert!(matches!(idem_err, Some(idem::Error::KeyReused { .. })));
/// ```
///
/// A database error keeps its message, code and kind; idem's own have no SQLSTATE, and a key
/// reused for another payload reads like a violated unique key.
impl sqlx::error::DatabaseError for Error {
    fn message(&self) -> &str {
        if let Some(db) = self.driver_error() {
            return db.message();
        }
        match self {
            Error::InProgress { .. } => "another delivery of the key is still in progress",
            Error::KeyReused { .. } => "the idempotency key was used for another payload",
            Error::RolledBack { .. } | Error::NotCommitted => {
                "the database rolled the transaction back instead of committing it"
            }
            Error::LeaseLost { .. } => "the lease was lost to another delivery",
            Error::Timeout { .. } => "the body ran out of time",
            _ => "idem refused or could not complete the call",
        }
    }

    fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
        self
    }

    fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
        self.driver_error().and_then(|db| db.code())
    }

    fn constraint(&self) -> Option<&str> {
        self.driver_error().and_then(|db| db.constraint())
    }

    fn kind(&self) -> sqlx::error::ErrorKind {
        if let Some(db) = self.driver_error() {
            return db.kind();
        }
        match self {
            Error::KeyReused { .. } => sqlx::error::ErrorKind::UniqueViolation,
            _ => sqlx::error::ErrorKind::Other,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    #[test]
    fn an_unreachable_database_is_said_once_with_what_to_do() {
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let err = Error::from(sqlx::Error::Io(refused));
        let msg = err.to_string();
        assert!(msg.contains("check its URL"), "{msg}");
        assert_eq!(msg.matches("refused").count(), 1, "{msg}");
        assert!(err.source().is_none());
    }

    #[test]
    fn every_variant_says_what_to_do() {
        let cases = [
            (Error::from(KeyError::Empty), "non-empty id"),
            (
                Error::InvalidTable { name: "a b".into() },
                "plain SQL identifier",
            ),
            (
                Error::InvalidScope {
                    scope: String::new(),
                },
                "1 to 255 bytes",
            ),
            (
                Error::RolledBack {
                    scope: "s".into(),
                    key: "k".into(),
                },
                "return database errors from the body with `?`",
            ),
            (
                Error::InProgress {
                    scope: "s".into(),
                    key: "k".into(),
                },
                "nack the job",
            ),
            (
                Error::from(sqlx::Error::PoolTimedOut),
                "could not be reached",
            ),
            (
                Error::from(sqlx::Error::RowNotFound),
                "kept or lost together",
            ),
        ];
        for (err, advice) in cases {
            let msg = err.to_string();
            assert!(msg.contains(advice), "{msg:?} lacks {advice:?}");
            // Each message is whole: nothing to print again from a source.
            assert!(err.source().is_none(), "{msg}");
        }
    }

    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn a_missing_marker_table_points_at_migrate() {
        let pool = sqlx::SqlitePool::connect("sqlite::memory:").await.unwrap();
        let store = crate::Store::new(pool);
        let key = crate::Key::new("job-1").unwrap();
        let err = store.claim("scope", &key).await.unwrap_err();
        let msg = err.to_string();
        assert_eq!(
            msg,
            "the database refused a statement: no such table: idem_processed: the marker \
             table does not exist: call `Store::migrate()` at start-up, or add the statements \
             of `Store::ddl()` to your migrations"
        );
        assert!(err.source().is_none());
    }
}
