//! Make at-least-once job and message handlers exactly-once in effect.
//!
//! Brokers deliver every job at least once and sometimes twice. idem gives each job a stable
//! key, records a marker for it in the same database transaction as the job's effect, and
//! skips any later delivery whose marker is already committed. A crash loses both the marker
//! and the effect, or keeps both.
//!
//! ```no_run
//! use idem::{JobError, Outcome, Store};
//! use sqlx::{Sqlite, Transaction};
//!
//! struct TopUp { id: String, account: i64, credits: i64 }
//!
//! // `JobError` takes idem's errors and the body's own through `?`; any error type with
//! // `From<idem::Error>` would do (the attribute's docs, "Your error type").
//! #[idem::idempotent(key = "job.id", scope = "billing.top_up")]
//! async fn top_up(tx: &mut Transaction<'_, Sqlite>, job: &TopUp) -> Result<(), JobError> {
//!     sqlx::query("UPDATE accounts SET credits = credits + ?1 WHERE id = ?2")
//!         .bind(job.credits)
//!         .bind(job.account)
//!         .execute(&mut **tx)
//!         .await?;
//!     Ok(())
//! }
//!
//! # async fn run(store: Store<Sqlite>, job: TopUp) -> Result<(), JobError> {
//! // `top_up` now takes `&Store<Sqlite>` where it took the transaction.
//! match top_up(&store, &job).await? {
//!     Outcome::Applied(()) => { /* this delivery did the work: ack */ }
//!     Outcome::Duplicate => { /* an earlier delivery did: ack, nothing ran */ }
//!     Outcome::Replayed(()) => { /* the same, with its stored value (`replay` only) */ }
//!     Outcome::Failed(_) => { /* failed for good (a lease's permanent error): ack */ }
//! }
//! # Ok(()) }
//! ```
//!
//! Databases are chosen with the cargo features `sqlite` (on by default), `postgres` and
//! `mysql`. See [`idempotent`] for the attribute and [`Store`] for the table it keeps. The
//! feature `axum` adds `idem::http`, an `Idempotency-Key` layer for axum and tower whose
//! claim and stored response commit with the handler's own writes. The feature `reqwest` adds
//! `Lease::send`, a lease's outside HTTP call with its key and timeout set and its failure
//! classed (`docs/steps.md`).

#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]
// Doctests, this crate's and its guides' (`docs/*.md`), compile without warnings; only what a
// snippet's hidden set-up leaves unused (items, imports, variables) is allowed.
#![doc(test(attr(deny(warnings), allow(unused_variables, unused_imports, dead_code))))]

// Lets the examples and tests inside this crate spell `::idem::...` like users do.
extern crate self as idem;

#[doc = include_str!("../docs/idempotent.md")]
#[doc = include_str!("../docs/idempotent-arguments.md")]
#[doc = include_str!("../docs/idempotent-modes.md")]
#[doc = include_str!("../docs/idempotent-diagnostics.md")]
#[doc(inline)]
pub use idem_macros::idempotent;
pub use idem_runtime::*;

#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing {
    // An inner attribute, so that the page's links resolve inside the module.
    #![doc = include_str!("../docs/testing.md")]
    pub use idem_runtime::testing::*;
}

pub mod by_hand {
    // An inner attribute, so that the page's links resolve inside the module.
    #![doc = include_str!("../docs/by-hand.md")]
}

pub mod observability {
    // An inner attribute, so that the page's links resolve inside the module.
    #![doc = include_str!("../docs/observability.md")]
}

/// The guides of `docs/` that no page above includes, compiled as doctests so that each code
/// block stays complete and true to the API: a block that needs a database or a broker is
/// `no_run` (compiled, not run). A guide whose blocks use a feature's module is compiled with
/// that feature (PostgreSQL comes with the dev-dependencies); steps.md's HTTP call is gated
/// inside its block, on the feature `reqwest`, so that the rest of the page is compiled always;
/// `cargo test -p idem --doc --all-features` compiles them all. `docs/job-frameworks.md` is
/// compiled by the package that has its frameworks (`examples/jobs/`).
#[cfg(doctest)]
mod guides {
    #[doc = include_str!("../docs/BENCHMARKS.md")]
    mod benchmarks {}
    #[cfg(all(
        feature = "rabbitmq",
        feature = "nats",
        feature = "sqs",
        feature = "lambda",
        feature = "kafka"
    ))]
    #[doc = include_str!("../docs/brokers.md")]
    mod brokers {}
    #[doc = include_str!("../docs/cli.md")]
    mod cli {}
    #[cfg(feature = "console")]
    #[doc = include_str!("../docs/console.md")]
    mod console {}
    #[doc = include_str!("../docs/operators.md")]
    mod operators {}
    #[doc = include_str!("../docs/group-commit.md")]
    mod group_commit {}
    #[doc = include_str!("../docs/group-commit-measured.md")]
    mod group_commit_measured {}
    #[cfg(feature = "axum")]
    #[doc = include_str!("../docs/http.md")]
    mod http {}
    #[cfg(feature = "kafka")]
    #[doc = include_str!("../docs/kafka.md")]
    mod kafka {}
    #[cfg(all(feature = "outbox-rabbitmq", feature = "rabbitmq"))]
    #[doc = include_str!("../docs/outbox.md")]
    mod outbox {}
    #[doc = include_str!("../docs/reliability.md")]
    mod reliability {}
    #[doc = include_str!("../docs/scaling.md")]
    mod scaling {}
    #[doc = include_str!("../docs/schema.md")]
    mod schema {}
    #[doc = include_str!("../docs/sqlx-upstream.md")]
    mod sqlx_upstream {}
    #[doc = include_str!("../docs/steps.md")]
    mod steps {}
    #[cfg(all(
        feature = "wal-relay",
        feature = "outbox-rabbitmq",
        feature = "rabbitmq"
    ))]
    #[doc = include_str!("../docs/wal-relay.md")]
    mod wal_relay {}
}

#[doc(hidden)]
pub mod __private {
    pub use idem_runtime::__private::*;
}
