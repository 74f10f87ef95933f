//! The extractor that hands a handler the transaction in which the layer claimed its key.

use std::sync::Arc;

use ::http::StatusCode;
use ::http::request::Parts;
use axum_core::extract::FromRequestParts;
use axum_core::response::Response;
use sqlx::Transaction;
use tokio::sync::{Mutex, OwnedMutexGuard};

use super::problem::problem;
use crate::Guard;
use crate::backend::Backend;

/// Where the layer puts the claimed transaction for the handler, and takes it back from once
/// the handler returned.
pub(crate) struct Slot<DB: Backend>(Arc<Mutex<Option<Guard<DB>>>>);

impl<DB: Backend> Clone for Slot<DB> {
    fn clone(&self) -> Self {
        Slot(self.0.clone())
    }
}

impl<DB: Backend> Slot<DB> {
    pub(crate) fn new(guard: Guard<DB>) -> Self {
        Slot(Arc::new(Mutex::new(Some(guard))))
    }

    /// The claim back from the handler; `None` if the handler still holds its extractor.
    pub(crate) fn take(&self) -> Option<Guard<DB>> {
        self.0.try_lock().ok()?.take()
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
    guard: OwnedMutexGuard<Option<Guard<DB>>>,
}

impl<DB: Backend> std::fmt::Debug for ClaimedTx<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimedTx").finish_non_exhaustive()
    }
}

impl<DB: Backend> ClaimedTx<DB> {
    /// The claimed transaction itself.
    pub fn tx(&mut self) -> &mut Transaction<'static, DB> {
        self.guard
            .as_mut()
            .expect("the slot holds the claim while the handler runs")
            .tx()
    }

    /// The transaction's connection, to run statements on: `.execute(tx.conn())`.
    pub fn conn(&mut self) -> &mut DB::Connection {
        self.tx()
    }
}

impl<S: Send + Sync, DB: Backend> FromRequestParts<S> for ClaimedTx<DB> {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Response> {
        let refuse = |why: &str| problem(StatusCode::INTERNAL_SERVER_ERROR, why);
        let Some(slot) = parts.extensions.get::<Slot<DB>>() else {
            return Err(refuse(
                "no key was claimed for this request: the route is not behind an \
                 `IdempotencyLayer` of this database, or its method is not one of the layer's",
            ));
        };
        let guard =
            slot.0.clone().try_lock_owned().map_err(|_| {
                refuse("the claimed transaction is already extracted by this handler")
            })?;
        Ok(ClaimedTx { guard })
    }
}
