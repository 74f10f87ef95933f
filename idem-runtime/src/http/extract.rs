//! The extractors that hand a handler what the layer claimed its key with: the transaction
//! (transaction mode) or the lease (lease mode). What holds the claim is the claim core's
//! holder; the layer only keeps it where the handler can borrow it.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use ::http::StatusCode;
use ::http::request::Parts;
use axum_core::extract::FromRequestParts;
use axum_core::response::Response;
use sqlx::Transaction;
use tokio::sync::{Mutex, OwnedMutexGuard};

use super::problem::problem;
use crate::backend::Backend;
use crate::claim::TxHeld;
use crate::error::Error;
use crate::lease::Lease;
use crate::outcome::Failed;
use crate::outgoing::Outbox;

/// The claim core's holder of a request's key, in the layer's mode.
pub(crate) enum Holding<DB: Backend> {
    /// Transaction mode: the open transaction, committed with the response.
    Tx(TxHeld<'static, DB>),
    /// Lease mode: the lease, completed with the response.
    Lease(Lease),
}

impl<DB: Backend> Holding<DB> {
    /// Keeps the handler's work with `json`, the stored response: the claim core's finish,
    /// with the response as the value stored for replay.
    pub(crate) async fn keep(self, json: String) -> Result<(), Error> {
        let stored = |_: &()| Ok(Some(json));
        let ended = match self {
            Holding::Tx(held) => held.finish(Ok::<(), ()>(()), stored).await,
            Holding::Lease(lease) => lease.finish_with(Ok(Ok(())), stored, None).await,
        };
        match ended {
            Ok(_) => Ok(()),
            Err(Failed::Idem(e)) => Err(e),
            Err(Failed::Handler(())) => unreachable!("the result was Ok"),
        }
    }

    /// Keeps nothing: rolls the transaction back, or releases the lease for the retry.
    pub(crate) async fn release(self) {
        match self {
            Holding::Tx(held) => held.release().await,
            Holding::Lease(lease) => lease.release().await,
        }
    }
}

/// Where the layer puts the claim for the handler, and takes it back from once the handler
/// returned.
pub(crate) struct Slot<DB: Backend>(Arc<Mutex<Option<Holding<DB>>>>);

impl<DB: Backend> Clone for Slot<DB> {
    fn clone(&self) -> Self {
        Slot(self.0.clone())
    }
}

impl<DB: Backend> Slot<DB> {
    pub(crate) fn new(holding: Holding<DB>) -> Self {
        Slot(Arc::new(Mutex::new(Some(holding))))
    }

    /// The claim back from the handler; `None` if the handler still holds its extractor.
    pub(crate) fn take(&self) -> Option<Holding<DB>> {
        self.0.try_lock().ok()?.take()
    }

    /// The claim for an extractor, if it holds what `is` wants.
    fn lend(
        parts: &Parts,
        is: fn(&Holding<DB>) -> bool,
        wanted: &'static str,
    ) -> Result<OwnedMutexGuard<Option<Holding<DB>>>, &'static str> {
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
            Some(holding) if is(holding) => Ok(guard),
            _ => Err(wanted),
        }
    }
}

/// The transaction in which [`IdempotencyLayer`](super::IdempotencyLayer) claimed this
/// request's key: run the handler's writes on it (`.execute(tx.conn())`), and send its
/// messages on [`outbox`](ClaimedTx::outbox). Do not commit it: when the handler returns, the
/// layer stores its response with the marker and commits both with these writes and messages
/// (or rolls all back on a 5xx).
///
/// Extracting it from a request the layer did not claim (a route without the layer, a method
/// the layer passes through) is a 500 that says so. While the handler runs, a claim with a store in
/// it is refused ([`Refusal::Nested`](crate::Refusal::Nested)): call handlers with
/// `store.join(tx.tx())`.
pub struct ClaimedTx<DB: Backend> {
    guard: OwnedMutexGuard<Option<Holding<DB>>>,
}

impl<DB: Backend> std::fmt::Debug for ClaimedTx<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimedTx").finish_non_exhaustive()
    }
}

impl<DB: Backend> ClaimedTx<DB> {
    fn held(&mut self) -> &mut TxHeld<'static, DB> {
        match self.guard.as_mut() {
            Some(Holding::Tx(held)) => held,
            _ => unreachable!("checked when extracted"),
        }
    }

    /// The claimed transaction itself.
    pub fn tx(&mut self) -> &mut Transaction<'static, DB> {
        self.held().tx()
    }

    /// The transaction's connection, to run statements on: `.execute(tx.conn())`.
    pub fn conn(&mut self) -> &mut DB::Connection {
        self.tx()
    }

    /// The outbox of this request's key: its messages commit with the handler's writes and
    /// the stored response, and go nowhere if the layer rolls back.
    pub fn outbox(&mut self) -> &mut Outbox {
        self.held().outbox()
    }

    /// The request's `idem.claim` span.
    pub fn span(&mut self) -> &tracing::Span {
        self.held().span()
    }
}

impl<S: Send + Sync, DB: Backend> FromRequestParts<S> for ClaimedTx<DB> {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Response> {
        let wanted = "this layer is in lease mode: extract `ClaimedLease`, not `ClaimedTx`";
        let guard = Slot::lend(parts, |h| matches!(h, Holding::Tx(_)), wanted)
            .map_err(|why| problem(StatusCode::INTERNAL_SERVER_ERROR, why))?;
        Ok(ClaimedTx { guard })
    }
}

/// The lease with which a lease-mode [`IdempotencyLayer`](super::IdempotencyLayer) claimed
/// this request's key, for a handler whose effect lives in another system: pass
/// [`Lease::idempotency_key`] on to it, finish within [`Lease::remaining`], and
/// [`Lease::renew`] during a long call (the handler's time limit moves with it). When the
/// handler returns, the layer completes the lease with its response (and the messages sent on
/// [`Lease::outbox`]), or releases it on a 5xx, for the retry to run again.
pub struct ClaimedLease<DB: Backend> {
    guard: OwnedMutexGuard<Option<Holding<DB>>>,
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
            Some(Holding::Lease(lease)) => lease,
            _ => unreachable!("checked when extracted"),
        }
    }
}

impl<DB: Backend> DerefMut for ClaimedLease<DB> {
    fn deref_mut(&mut self) -> &mut Lease {
        match self.guard.as_mut() {
            Some(Holding::Lease(lease)) => lease,
            _ => unreachable!("checked when extracted"),
        }
    }
}

impl<S: Send + Sync, DB: Backend> FromRequestParts<S> for ClaimedLease<DB> {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Response> {
        let wanted = "this layer is in transaction mode: extract `ClaimedTx`, or give the \
                      layer a lease (`.lease(..)`) to extract `ClaimedLease`";
        let guard = Slot::lend(parts, |h| matches!(h, Holding::Lease(_)), wanted)
            .map_err(|why| problem(StatusCode::INTERNAL_SERVER_ERROR, why))?;
        Ok(ClaimedLease { guard })
    }
}
