//! Transaction mode by hand: a claim in a transaction of its own, in which the body runs, and
//! which commits marker and effect together.

use std::borrow::Cow;

use sqlx::Transaction;

use crate::backend::Backend;
use crate::claim::{self, Claimed, Held, Request, nested, run};
use crate::key::check_scope;
use crate::{ClaimOptions, Error, Fingerprint, Key, Outcome, Store};

/// The answer to [`Store::claim`]: on [`Claimed::Fresh`] the [`Guard`] holding the open
/// transaction. A duplicate's transaction, which wrote nothing, is over: its `ROLLBACK` goes
/// out with the connection's return to the pool (a connection whose rollback fails is closed,
/// not reused), so a duplicate does not wait for it.
pub type Claim<DB> = Claimed<Guard<DB>>;

impl<DB: Backend> Store<DB> {
    /// Begins a transaction and claims `(scope, key)` in it, with the database's defaults.
    ///
    /// This is what `#[idempotent]` expands to; call it by hand only where the attribute does
    /// not fit. On [`Claimed::Fresh`] run the effect on [`Guard::tx`] and end with
    /// [`Guard::finish`]; dropping the guard rolls everything back. The scope is checked like
    /// the attribute's (1 to 255 bytes, no NUL: else [`Error::InvalidScope`], before any I/O).
    ///
    /// A completed marker is [`Claimed::Duplicate`]; a lease-mode delivery still holding the
    /// key is [`Error::InProgress`] (never a duplicate: its job may still fail); a lease that
    /// was released or ran out is taken over, and this transaction's commit completes it.
    pub async fn claim(&self, scope: &str, key: &Key) -> Result<Claim<DB>, Error> {
        self.claim_with(scope, key, ClaimOptions::new()).await
    }

    /// [`claim`](Store::claim) with a `wait` and an isolation level.
    pub async fn claim_with(
        &self,
        scope: &str,
        key: &Key,
        options: ClaimOptions,
    ) -> Result<Claim<DB>, Error> {
        self.claim_checked(scope, key, options, None).await
    }

    /// [`claim_with`](Store::claim_with) that stores the payload's fingerprint with the marker,
    /// and refuses a later delivery of the key with another one ([`Error::KeyReused`]).
    pub async fn claim_checked(
        &self,
        scope: &str,
        key: &Key,
        options: ClaimOptions,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Claim<DB>, Error> {
        check_scope(scope)?;
        nested::refuse_nested("Store::claim")?;
        let scope = Cow::Owned(scope.to_owned());
        let request = Request::new(scope, key.clone(), options, fingerprint.copied());
        Ok(run::own(self, request).await?.map(|held| Guard { held }))
    }
}

/// An open transaction holding a fresh claim.
///
/// [`finish`](Guard::finish) commits it (marker and effect together) or rolls it back; dropping
/// it, by a panic or a cancelled future, rolls it back as well.
#[derive(Debug)]
pub struct Guard<DB: Backend> {
    held: Held<'static, DB>,
}

impl<DB: Backend> Guard<DB> {
    /// The transaction the body must run its effect on.
    pub fn tx(&mut self) -> &mut Transaction<'static, DB> {
        self.held.tx()
    }

    /// Ends the call: commits on `Ok`, rolls back on `Err`.
    ///
    /// `Ok(Outcome::Applied)` only once the database confirmed the commit: a transaction it
    /// threw away is [`Error::RolledBack`]. A failed rollback is not reported: the body's
    /// error is what the caller needs, and the database drops the transaction with the
    /// connection anyway.
    pub async fn finish<T, E: From<Error>>(self, result: Result<T, E>) -> Result<Outcome<T>, E> {
        claim::settle(self.held.finish(result, |_| Ok(None)).await)
    }

    /// [`finish`](Guard::finish) that also stores the `Ok` value with the marker, in the same
    /// transaction, so that later deliveries get it back (`replay`). A value that cannot be
    /// stored is [`Error::Serialize`], and nothing is committed.
    pub async fn finish_replay<T: serde::Serialize, E: From<Error>>(
        self,
        result: Result<T, E>,
    ) -> Result<Outcome<T>, E> {
        let end = self
            .held
            .finish(result, |v| crate::record::encode(v).map(Some));
        claim::settle(end.await)
    }
}

#[cfg(feature = "axum")]
impl<DB: Backend> Guard<DB> {
    /// Commits with `json`, already encoded and within [`MAX_REPLAY_LEN`](crate::MAX_REPLAY_LEN),
    /// as the marker's stored value (the HTTP layer's recorded response).
    pub(crate) async fn finish_json(self, json: String) -> Result<Outcome<()>, Error> {
        claim::settle(
            self.held
                .finish(Ok::<(), Error>(()), |()| Ok(Some(json)))
                .await,
        )
    }

    /// Rolls the transaction back: the marker and the body's statements are gone.
    pub(crate) async fn roll_back(self) {
        let end = self
            .held
            .finish(Err::<(), Error>(Error::NotCommitted), |()| Ok(None));
        drop(end.await);
    }
}
