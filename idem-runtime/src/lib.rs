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

mod backend;
mod batch;
mod error;
mod inspect;
mod job_id;
mod join;
mod key;
mod lease;
mod observe;
mod options;
mod outcome;
mod replay;
mod store;
#[cfg(feature = "testing")]
pub mod testing;

pub use backend::Backend;
pub use batch::{Batch, BatchClaim, MAX_BATCH};
pub use error::{Error, KeyError};
pub use inspect::{Marker, MarkerState};
pub use job_id::{JobId, job_id};
pub use join::{Joined, JoinedClaim, JoinedGuard, Target};
pub use key::{IntoKey, Key, KeyWriter, MAX_KEY_LEN};
pub use lease::{Lease, LeaseOptions, Leased};
pub use observe::{CLAIM_SECONDS, OUTCOMES_TOTAL, describe_metrics};
pub use options::{ClaimOptions, Isolation};
pub use outcome::Outcome;
pub use replay::{Fingerprint, MAX_REPLAY_LEN, Recorded};
pub use store::{Claim, DEFAULT_TABLE, Guard, MAX_TABLE_LEN, PURGE_BATCH, Store};

/// The transaction an `#[idempotent]` handler's body runs on (an alias of
/// `sqlx::Transaction`, so either spelling works in a handler's signature).
pub type Tx<'c, DB> = sqlx::Transaction<'c, DB>;

#[doc(hidden)]
pub mod __private;
