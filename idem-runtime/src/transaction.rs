//! Transaction mode by hand: a claim in a transaction of its own, in which the body runs, and
//! which commits marker and effect together.

use std::borrow::Cow;

use crate::backend::Backend;
use crate::claim::{Claimed, Request, TxHeld, held_calls, run};
use crate::error::Error;
use crate::key::Key;
use crate::options::ClaimOptions;
use crate::scope::check_scope;
use crate::store::Store;

impl<DB: Backend> Store<DB> {
    /// Begins a transaction and claims `(scope, key)` in it, with the database's defaults.
    ///
    /// This is what `#[idempotent]` expands to; call it by hand only where the attribute does
    /// not fit. On [`Claimed::Fresh`] run the effect on [`Guard::tx`] and end with
    /// [`Guard::finish`]; dropping the guard rolls everything back. The scope is checked like
    /// the attribute's (1 to 255 bytes, no NUL: else
    /// [`Refusal::Scope`](crate::Refusal::Scope), before any I/O).
    /// A duplicate's transaction, which wrote nothing, is over: its `ROLLBACK` goes out with
    /// the connection's return to the pool (a connection whose rollback fails is closed, not
    /// reused), so a duplicate does not wait for it.
    ///
    /// A completed marker is [`Claimed::Duplicate`]; a lease-mode delivery still holding the
    /// key is [`Error::InProgress`] (never a duplicate: its job may still fail); a lease that
    /// was released or ran out is taken over, and this transaction's commit completes it.
    /// Inside the open transaction of another claim of this task (a handler's body, another guard)
    /// the claim is refused with [`Refusal::Nested`](crate::Refusal::Nested), before any I/O: claim
    /// on [`Store::join`] there.
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// # #[cfg(feature = "sqlite")]
    /// # async fn f(store: &idem::Store<sqlx::Sqlite>) -> Result<(), idem::Error> {
    /// use idem::{Claimed, Key, Outcome};
    ///
    /// let key = Key::new("order-7")?;
    /// let outcome = match store.claim("billing.top_up", &key).await? {
    ///     Claimed::Fresh(mut guard) => {
    ///         let done = sqlx::query("UPDATE accounts SET credits = credits + 50 WHERE id = 7")
    ///             .execute(&mut **guard.tx())
    ///             .await;
    ///         // A message that commits with the effect, published by the relay.
    ///         guard.outbox().send("receipts", &"order-7")?;
    ///         guard.finish(done.map(drop).map_err(idem::Error::from)).await?
    ///     }
    ///     Claimed::Duplicate | Claimed::Replayed(_) => Outcome::Duplicate,
    ///     // A lease-mode handler of the scope failed the job for good: ack it too.
    ///     Claimed::Failed(failure) => Outcome::Failed(failure),
    /// };
    /// # let _ = outcome;
    /// # Ok(()) }
    /// ```
    pub async fn claim(&self, scope: &str, key: &Key) -> Result<Claimed<Guard<DB>>, Error> {
        self.claim_with(scope, key, ClaimOptions::new()).await
    }

    /// [`claim`](Store::claim) with the options' `wait`, isolation level, `replay` (a
    /// duplicate with a stored value is [`Claimed::Replayed`]) and fingerprint (a delivery of
    /// the key with another payload is [`Error::KeyReused`]).
    pub async fn claim_with(
        &self,
        scope: &str,
        key: &Key,
        options: ClaimOptions,
    ) -> Result<Claimed<Guard<DB>>, Error> {
        check_scope(scope)?;
        let scope = Cow::Owned(scope.to_owned());
        let request = Request::new(scope, key.clone(), options, "Store::claim");
        Ok(run::own(self, request).await?.map(|held| Guard { held }))
    }
}

/// An open transaction holding a fresh claim.
///
/// [`finish`](Guard::finish) commits it (marker, effect and [`outbox`](Guard::outbox)
/// together) or rolls it back; [`release`](Guard::release), or dropping it (a panic, a
/// cancelled future), rolls it back as well. Its call has the `idem.claim` span and the
/// `idem_outcomes_total` count of an `#[idempotent]` handler's, and a body run with
/// [`body`](Guard::body) is marked as inside it, as a handler's is.
#[derive(Debug)]
pub struct Guard<DB: Backend> {
    held: TxHeld<'static, DB>,
}

held_calls! {
    Guard<DB>, 'static;
    /// The transaction the body must run its effect on.
    tx;
    /// The outbox of this claim's job: the messages sent on it are written with the marker
    /// when the guard finishes with `Ok`, and not at all otherwise.
    outbox;
    /// The call's `idem.claim` span.
    span;
    /// The claim's body: [`Body::run`](crate::Body::run) runs a future in the call's span,
    /// marked as inside this claim's open transaction, so that a claim with a store in it is
    /// refused ([`Refusal::Nested`](crate::Refusal::Nested)) rather than left to wait for this
    /// transaction's lock or commit apart from it.
    body;
    /// Ends the call: commits on `Ok`, rolls back on `Err`.
    ///
    /// `Ok(Outcome::Applied)` only once the database confirmed the commit: a transaction it
    /// threw away is [`NotKept::RolledBack`](crate::NotKept::RolledBack). A failed rollback
    /// is not reported: the body's error is what the caller needs, and the database drops the
    /// transaction with the connection anyway.
    finish;
    /// [`finish`](Guard::finish) that also stores the `Ok` value with the marker, in the same
    /// transaction, so that later deliveries get it back (`replay`). A value that cannot be
    /// stored is [`Error::Serialize`], and nothing is committed.
    finish_replay;
    /// Gives up: rolls the transaction back, the marker and the body's statements with it.
    release;
}
