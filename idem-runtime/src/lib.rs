//! Runtime of [idem](https://docs.rs/idem): the claim store that `#[idempotent]` handlers call.
//!
//! Use it through the `idem` crate, which re-exports everything here together with the
//! attribute. A [`Store`] keeps one marker per handled job, keyed by `(scope, key)`, in the
//! same database (and the same transaction) as the job's effect.

#![warn(missing_docs, unreachable_pub)]

#[cfg(not(any(feature = "postgres", feature = "sqlite", feature = "mysql")))]
compile_error!(
    "idem needs a database: enable at least one of the cargo features `sqlite`, `postgres`, `mysql`"
);

// The layers, each using only those above it: the vocabulary; observation and the test hooks;
// the backends' SQL; the store; the claim core; the modes (and, beside them, the outbox's
// relay and the HTTP layer). Every module imports an item from the module that defines it;
// the re-exports below are for users. `__private`, for generated code, is a leaf that nothing
// here imports.
mod error;
mod future;
mod job_id;
mod key;
mod options;
mod outcome;
mod outgoing;
mod record;
mod scope;
pub mod settle;
mod traceparent;

mod observe;
#[cfg(feature = "testing")]
pub mod testing;
// Without the kit its hooks are empty functions, so that the runtime calls them everywhere
// without a `cfg` of its own.
#[cfg(not(feature = "testing"))]
mod testing {
    #[path = "off.rs"]
    pub(crate) mod probe;
}

mod backend;

mod bulk;
mod doctor;
mod inspect;
mod retention;
mod store;

mod claim;

mod batch;
mod each;
mod group;
mod join;
mod lease;
pub mod offsets;
#[cfg(feature = "postgres")]
pub mod partitions;
mod relay;
mod transaction;

// Above the modes: the HTTP layer claims through transaction and lease mode, the Kafka
// consumer through the offset-watermark mode; the web console reads the store and the outbox.
#[cfg(feature = "console")]
pub mod console;
#[cfg(feature = "axum")]
pub mod http;
#[cfg(feature = "kafka")]
pub mod kafka;

pub use backend::Backend;
pub use batch::BatchGuard;
pub use bulk::{
    AuditEntry, FailedFilter, FailureGroup, GROUP_ID_LEN, MAX_GROUPS, OutcomeCount, REQUEUE_PAGE,
};
pub use claim::Claimed;
pub use claim::nested::Body;
pub use doctor::{Checkup, Diagnosis, Finding, Severity};
pub use each::{EachGuard, JobGuard};
pub use error::{Error, JobError, KafkaError, LeaseError, NotKept, Refusal, WalError};
pub use group::{
    Group, GroupGuard, GroupOptions, GroupTarget, MAX_GROUP, MAX_GROUP_BODY, MAX_GROUP_DELAY,
    MAX_LANES,
};
pub use inspect::{Marker, MarkerState, RecordedStep};
pub use job_id::{JobId, job_id};
pub use join::{Joined, JoinedGuard, Target, commit};
pub use key::{IntoKey, Key, KeyError, KeyWriter, MAX_BATCH, MAX_KEY_LEN};
pub use lease::{Lease, MAX_ERROR_LEN, MAX_STEP_NAME, Step, Verified};
pub use observe::semconv::{MESSAGING_PROCESS_DURATION, observe_messaging};
pub use observe::{CLAIM_SECONDS, KeyInSpans, OUTCOMES_TOTAL, describe_metrics, observe_keys};
pub use options::{ClaimOptions, Isolation, LeaseOptions, MAX_LEASE, MIN_LEASE, Messaging};
pub use outcome::{Batch, Each, Failure, Outcome};
pub use outgoing::{BatchOutbox, Message, Outbox};
pub use record::{Fingerprint, MAX_REPLAY_LEN, Recorded};
pub use retention::{MIN_RETENTION, Retention};
pub use settle::{Classify, Disposition, Settle};
pub use store::{DEFAULT_TABLE, MAX_TABLE_LEN, PURGE_BATCH, Store};
pub use traceparent::{TRACEPARENT, TraceParent, TraceParentError};
pub use transaction::Guard;

/// The reqwest that `Lease::send` takes requests of (feature `reqwest`): build them with this
/// one, and no second version of reqwest has to match it.
#[cfg(feature = "reqwest")]
pub use reqwest;

/// The transactional outbox: the messages a handler sends with its effect
/// ([`Outbox`]), and the relay that publishes them after the commit.
pub mod outbox {
    pub use crate::outgoing::{
        BatchOutbox, Headers, MAX_DESTINATION_LEN, MAX_HEADERS_SIZE, MAX_PAYLOAD, Message,
        MessageBuilder, Outbox,
    };
    #[cfg(feature = "outbox-nats")]
    pub use crate::relay::JetStream;
    #[cfg(feature = "outbox-rabbitmq")]
    pub use crate::relay::RabbitMq;
    #[cfg(feature = "kafka")]
    pub use crate::relay::{Kafka, MESSAGE_ID_HEADER};
    pub use crate::relay::{
        OutboxEntry, OutboxState, ParkedFilter, PublishError, Publisher, REQUEUE_PARKED_PAGE,
        Relay, Relayed,
    };
    #[cfg(feature = "wal-relay")]
    pub use crate::relay::{SlotLag, WalRelay};
}

/// The transaction an `#[idempotent]` handler's body runs on (an alias of
/// `sqlx::Transaction`, so either spelling works in a handler's signature).
pub type Tx<'c, DB> = sqlx::Transaction<'c, DB>;

#[doc(hidden)]
pub mod __private;
