//! The extractors that hand a handler what the layer claimed its key with: the transaction
//! (transaction mode) or the lease (lease mode).

use std::ops::Deref;

use std::sync::Arc;

use ::http::StatusCode;
use ::http::request::Parts;
use axum_core::extract::FromRequestParts;
use axum_core::response::Response;
use sqlx::Transaction;
use tokio::sync::{Mutex, OwnedMutexGuard};

use super::problem::problem;
use crate::backend::Backend;
use crate::{Error, Guard, Lease, Outcome};

/// What holds a fresh claim while the handler runs.
pub(crate) enum Hold<DB: Backend> {
    /// Transaction mode: the open transaction, committed with the response.
    Tx(Guard<DB>),
    /// Lease mode: the lease, completed with the response.
    Lease(Lease),
}

impl<DB: Backend> Hold<DB> {
    /// Keeps the handler's work with `json`, the stored response: commits the transaction,
    /// or completes the lease.
    pub(crate) async fn complete(self, json: String) -> Result<(), Error> {
        match self {
            Hold::Tx(guard) => guard.finish_json(json).await.map(drop),
            Hold::Lease(lease) => {
                let value: serde_json::Value =
                    serde_json::from_str(&json).expect("the layer's own JSON");
                match lease.finish_replay(Ok::<_, Error>(value)).await? {
                    Outcome::Applied(_) => Ok(()),
                    _ => unreachable!("a fresh lease completes as Applied or fails"),
                }
            }
        }
    }

    /// Keeps nothing: rolls the transaction back, or releases the lease for the retry.
    pub(crate) async fn abandon(self) {
        match self {
            Hold::Tx(guard) => guard.roll_back().await,
            Hold::Lease(lease) => drop(lease.finish(Err::<(), Error>(Error::NotCommitted)).await),
        }
    }
}

/// Where the layer puts the claim for the handler, and takes it back from once the handler
/// returned.
pub(crate) struct Slot<DB: Backend>(Arc<Mutex<Option<Hold<DB>>>>);

impl<DB: Backend> Clone for Slot<DB> {
    fn clone(&self) -> Self {
        Slot(self.0.clone())
    }
}

impl<DB: Backend> Slot<DB> {
    pub(crate) fn new(hold: Hold<DB>) -> Self {
        Slot(Arc::new(Mutex::new(Some(hold))))
    }

    /// The claim back from the handler; `None` if the handler still holds its extractor.
    pub(crate) fn take(&self) -> Option<Hold<DB>> {
        self.0.try_lock().ok()?.take()
    }

    /// The claim for an extractor, if it holds what `is` wants.
    fn lend(
        parts: &Parts,
        is: fn(&Hold<DB>) -> bool,
        wanted: &'static str,
    ) -> Result<OwnedMutexGuard<Option<Hold<DB>>>, &'static str> {
        let Some(slot) = parts.extensions.get::<Slot<DB>>() else {
            return Err(
                "no key was claimed for this request: the route is not behind an \
                 `IdempotencyLayer` of this database, or its method is not one of the layer's",
            );
        };
        let guard = slot
            .0
            .clone()
            .try_lock_owned()
            .map_err(|_| "the claim is already extracted by this handler")?;
        match guard.as_ref() {
            Some(hold) if is(hold) => Ok(guard),
            _ => Err(wanted),
        }
    }
}

/// The transaction in which [`IdempotencyLayer`](super::IdempotencyLayer) claimed this
/// request's key: run the handler's writes on it (`.execute(tx.conn())`). Do not commit it:
/// when the handler returns, the layer stores its response with the marker and commits both
/// with these writes (or rolls all back on a 5xx).
///
/// Extracting it from a request the layer did not claim (a route without the layer, a method
/// the layer passes through) is a 500 that says so.
pub struct ClaimedTx<DB: Backend> {
    guard: OwnedMutexGuard<Option<Hold<DB>>>,
}

impl<DB: Backend> std::fmt::Debug for ClaimedTx<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimedTx").finish_non_exhaustive()
    }
}

impl<DB: Backend> ClaimedTx<DB> {
    /// The claimed transaction itself.
    pub fn tx(&mut self) -> &mut Transaction<'static, DB> {
        match self.guard.as_mut() {
            Some(Hold::Tx(guard)) => guard.tx(),
            _ => unreachable!("checked when extracted"),
        }
    }

    /// The transaction's connection, to run statements on: `.execute(tx.conn())`.
    pub fn conn(&mut self) -> &mut DB::Connection {
        self.tx()
    }
}

impl<S: Send + Sync, DB: Backend> FromRequestParts<S> for ClaimedTx<DB> {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Response> {
        let wanted = "this layer is in lease mode: extract `ClaimedLease`, not `ClaimedTx`";
        let guard = Slot::lend(parts, |h| matches!(h, Hold::Tx(_)), wanted)
            .map_err(|why| problem(StatusCode::INTERNAL_SERVER_ERROR, why))?;
        Ok(ClaimedTx { guard })
    }
}

/// The lease with which a lease-mode [`IdempotencyLayer`](super::IdempotencyLayer) claimed
/// this request's key, for a handler whose effect lives in another system: pass
/// [`Lease::idempotency_key`] on to it, and finish within [`Lease::remaining`]. When the
/// handler returns, the layer completes the lease with its response (or releases it on a 5xx,
/// for the retry to run again).
pub struct ClaimedLease<DB: Backend> {
    guard: OwnedMutexGuard<Option<Hold<DB>>>,
}

impl<DB: Backend> std::fmt::Debug for ClaimedLease<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("ClaimedLease").field(&**self).finish()
    }
}

impl<DB: Backend> Deref for ClaimedLease<DB> {
    type Target = Lease;

    fn deref(&self) -> &Lease {
        match self.guard.as_ref() {
            Some(Hold::Lease(lease)) => lease,
            _ => unreachable!("checked when extracted"),
        }
    }
}

impl<S: Send + Sync, DB: Backend> FromRequestParts<S> for ClaimedLease<DB> {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Response> {
        let wanted = "this layer is in transaction mode: extract `ClaimedTx`, or give the \
                      layer a lease (`.lease(..)`) to extract `ClaimedLease`";
        let guard = Slot::lend(parts, |h| matches!(h, Hold::Lease(_)), wanted)
            .map_err(|why| problem(StatusCode::INTERNAL_SERVER_ERROR, why))?;
        Ok(ClaimedLease { guard })
    }
}
