//! A fresh claim's open transaction (or savepoint), and how it ends: with the value recorded
//! for `replay`, committed (verified) or released, or rolled back.

use std::sync::Arc;

use sqlx::Transaction;

use super::Request;
use crate::backend::{Backend, Check, Statements};
use crate::outgoing::Pending;
use crate::record::NotStorable;
use crate::{Error, Failed, Outbox, Outcome};

/// A fresh claim of either kind: a transaction of idem's own, or a savepoint of the caller's
/// (`joined`), which ends with a `RELEASE` and leaves the commit to the caller. Dropping it (a
/// panic, a cancelled future) rolls it back.
#[doc(hidden)]
#[derive(Debug)]
pub struct Held<'c, DB: Backend> {
    tx: Transaction<'c, DB>,
    st: Arc<Statements>,
    request: Request,
    joined: bool,
}

impl<'c, DB: Backend> Held<'c, DB> {
    pub(crate) fn new(
        tx: Transaction<'c, DB>,
        st: Arc<Statements>,
        request: Request,
        joined: bool,
    ) -> Self {
        Held {
            tx,
            st,
            request,
            joined,
        }
    }

    /// The transaction (or savepoint) the body runs on.
    pub fn tx(&mut self) -> &mut Transaction<'c, DB> {
        &mut self.tx
    }

    /// Rolls back the transaction, or to the savepoint. A failed rollback is not reported:
    /// the error that led here is what the caller needs, and the database drops the
    /// transaction with the connection anyway.
    async fn roll_back(self) {
        if self.joined {
            drop(self.tx.rollback().await);
        } else {
            drop(DB::rollback(self.tx, &self.request.options).await);
        }
    }

    /// The outbox of this claim's job: its messages get ids from this scope and key.
    pub fn outbox(&self) -> Outbox {
        Outbox::new(self.request.scope.clone(), self.request.key.clone())
    }

    /// [`finish_sending`](Held::finish_sending) without an outbox.
    pub(crate) async fn finish<T, E>(
        self,
        result: Result<T, E>,
        encode: impl FnOnce(&T) -> Result<Option<String>, NotStorable>,
    ) -> Result<Outcome<T>, Failed<E>> {
        self.finish_sending(result, encode, None).await
    }

    /// Ends the call: on `Ok`, stores what `encode` makes of the value (`replay`) and commits
    /// (verified: `Applied` only once the database confirmed it) or releases the savepoint;
    /// on `Err`, rolls back. A value that cannot be stored rolls everything back: in a
    /// transaction nothing happened outside it, so the redelivery may simply run again.
    ///
    /// The outbox's messages, if any, are written in the same transaction, after the value:
    /// they exist exactly when the marker and the effect do.
    pub(crate) async fn finish_sending<T, E>(
        mut self,
        result: Result<T, E>,
        encode: impl FnOnce(&T) -> Result<Option<String>, NotStorable>,
        outbox: Option<Pending>,
    ) -> Result<Outcome<T>, Failed<E>> {
        let value = match result {
            Ok(value) => value,
            Err(e) => {
                self.roll_back().await;
                return Err(Failed::Handler(e));
            }
        };
        let recorded = match encode(&value) {
            Ok(None) => Ok(()),
            Ok(Some(json)) => {
                let Request { scope, key, .. } = &self.request;
                DB::record(&mut self.tx, &self.st, scope, key.as_str(), &json)
                    .await
                    .map_err(Error::from)
            }
            Err(NotStorable(reason)) => Err(Error::Serialize(format!(
                "the value of {:?} / {:?} cannot be stored for `replay`: {reason}; the \
                 transaction was rolled back, nothing was kept (the redelivery runs again)",
                self.request.scope,
                self.request.key.as_str()
            ))),
        };
        let written = match (recorded, &outbox) {
            (Ok(()), Some(outbox)) if !outbox.is_empty() => {
                DB::outbox_write(&mut self.tx, &self.st, outbox)
                    .await
                    .map_err(Error::from)
            }
            (recorded, _) => recorded,
        };
        if let Err(e) = written {
            self.roll_back().await;
            return Err(Failed::Idem(e));
        }
        #[cfg(feature = "testing")]
        {
            let at = if self.joined {
                "savepoint release"
            } else {
                "commit"
            };
            let (scope, key) = (&self.request.scope, self.request.key.as_str());
            if let Some(e) = crate::testing::probe::before_commit(scope, key, at).await {
                self.roll_back().await;
                return Err(Failed::Idem(e));
            }
        }
        if self.joined {
            // `RELEASE SAVEPOINT`: applied in the caller's transaction, which is theirs to
            // commit. A failed release (the body swallowed an error that aborted the
            // transaction) drops the savepoint, whose drop rolls back to it.
            return match self.tx.commit().await {
                Ok(()) => Ok(Outcome::Applied(value)),
                Err(e) => Err(Failed::Idem(e.into())),
            };
        }
        let Held {
            tx, st, request, ..
        } = self;
        let check = Check::Marker(&st, request.claimant());
        match DB::commit(tx, check, &request.options).await {
            Ok(true) => Ok(Outcome::Applied(value)),
            Ok(false) => Err(Failed::Idem(Error::RolledBack {
                scope: request.scope.into_owned(),
                key: request.key.as_str().to_owned(),
            })),
            Err(e) => Err(Failed::Idem(e.into())),
        }
    }
}
