//! Claiming inside a transaction the caller already holds (an HTTP handler's, a job
//! framework's, or the body of an outer idempotent handler).
//!
//! The claim and the body run in a savepoint of the caller's transaction: the commit stays the
//! caller's, a body error rolls back to the savepoint only, and a duplicate leaves nothing.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use sqlx::Transaction;
use sqlx_core::transaction::TransactionManager as _;

use crate::backend::{Backend, Check};
use crate::claim::{Claimed, Request, TxHeld, held_calls, run};
use crate::error::{Error, NotKept};
use crate::key::Key;
use crate::options::ClaimOptions;
use crate::scope::check_scope;
use crate::store::Store;

/// A [`Store`] joined to a transaction the caller holds: made by [`Store::join`], passed to a
/// handler in place of `&store`, or claimed on by hand with [`Joined::claim`].
///
/// The claim runs in a savepoint of that transaction, with the caller's settings (its
/// isolation level, lock timeouts and, on SQLite, its `BEGIN`: begin it with
/// `begin_with("BEGIN IMMEDIATE")`, a deferred one may fail to take the write lock). A handler's
/// `wait` and `isolation` do not apply: they belong to the begin statement, which is the
/// caller's here.
pub struct Joined<'a, DB: Backend> {
    store: &'a Store<DB>,
    conn: &'a mut DB::Connection,
}

impl<DB: Backend> fmt::Debug for Joined<'_, DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Joined")
            .field("store", self.store)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> Store<DB> {
    /// Joins `tx`, a transaction the caller holds, so that a handler (or a hand-written
    /// [`claim`](Joined::claim)) claims and runs inside it instead of beginning its own:
    /// `top_up(store.join(&mut tx), &job)`.
    ///
    /// `Outcome::Applied` then means *applied in your transaction*: it is kept only if you
    /// commit `tx`. A body error rolls back the claim and the body's statements only (a
    /// savepoint), and leaves `tx` usable. Inside the body of another handler, pass that
    /// body's `tx`: both then commit or roll back together.
    pub fn join<'a>(&'a self, tx: &'a mut Transaction<'_, DB>) -> Joined<'a, DB> {
        Joined {
            store: self,
            conn: &mut **tx,
        }
    }
}

impl<'a, DB: Backend> Joined<'a, DB> {
    /// Claims `(scope, key)` in a savepoint of the joined transaction.
    ///
    /// On [`Claimed::Fresh`] run the effect on [`JoinedGuard::tx`] and end with
    /// [`JoinedGuard::finish`]. The scope is checked as [`Store::claim`] checks it, and the
    /// marker it meets is decided as there. Claiming on a joined store is how a claim inside
    /// another claim's body is made: it is never refused as nested.
    pub async fn claim(
        self,
        scope: &str,
        key: &Key,
    ) -> Result<Claimed<JoinedGuard<'a, DB>>, Error> {
        self.claim_with(scope, key, ClaimOptions::new()).await
    }

    /// [`claim`](Joined::claim) with the options' `replay` (an earlier delivery's stored value
    /// read back) and fingerprint (see [`Store::claim_with`]). Their `wait` and isolation level
    /// do not apply: they belong to the begin statement, which is the caller's here.
    pub async fn claim_with(
        self,
        scope: &str,
        key: &Key,
        options: ClaimOptions,
    ) -> Result<Claimed<JoinedGuard<'a, DB>>, Error> {
        check_scope(scope)?;
        let options = ClaimOptions {
            wait: None,
            isolation: None,
            ..options
        };
        let scope = Cow::Owned(scope.to_owned());
        let request = Request::new(scope, key.clone(), options, "Joined::claim");
        let claimed = self.claim_request(request).await?;
        Ok(claimed.map(|held| JoinedGuard { held }))
    }

    pub(crate) async fn claim_request(
        self,
        request: Request,
    ) -> Result<Claimed<TxHeld<'a, DB>>, Error> {
        run::joined(self.store, self.conn, request).await
    }
}

/// A fresh claim in a savepoint of the caller's transaction.
///
/// [`finish`](JoinedGuard::finish) releases the savepoint on `Ok` (marker, effect and
/// [`outbox`](JoinedGuard::outbox) are then part of the caller's transaction, kept only if it
/// commits) or rolls back to it on `Err`; [`release`](JoinedGuard::release), or dropping the
/// guard, rolls back to it too. A duplicate's savepoint has been rolled back, and the caller's
/// transaction is as it was.
#[derive(Debug)]
pub struct JoinedGuard<'a, DB: Backend> {
    held: TxHeld<'a, DB>,
}

held_calls! {
    JoinedGuard<'a, DB>, 'a;
    /// The savepoint the body must run its effect on.
    tx;
    /// The outbox of this claim's job: its messages are written in the savepoint when the
    /// guard finishes with `Ok`, and kept if the caller's transaction commits.
    outbox;
    /// The call's `idem.claim` span.
    span;
    /// The claim's body, to run in its span and marked as inside the caller's transaction
    /// (see [`Guard::body`](crate::Guard::body)).
    body;
    /// Ends the call: releases the savepoint on `Ok`
    /// ([`Outcome::Applied`](crate::Outcome::Applied): applied in the caller's transaction, kept
    /// only if it commits), rolls back to it on `Err`.
    finish;
    /// [`finish`](JoinedGuard::finish) that also stores the `Ok` value with the marker
    /// (`replay`).
    finish_replay;
    /// Gives up: rolls back to the savepoint; the caller's transaction stays usable.
    release;
}

/// Commits a transaction you hold, checking that the database really committed it, as idem
/// checks its own: use it after joined calls (`store.join(&mut tx)`) instead of
/// `tx.commit()`.
///
/// PostgreSQL answers `COMMIT` of a transaction that a failed statement aborted with a silent
/// rollback, which sqlx's `commit()` reports as success: here that is [`NotKept::NotCommitted`],
/// and so is a MariaDB transaction a deadlock rolled back. Costs no extra round trip. A savepoint
/// (a transaction begun inside another) is released as sqlx releases it; on MySQL 8, which cannot
/// tell, the commit is not checked.
///
/// ```no_run
/// # use idem_runtime as idem;
/// # #[cfg(feature = "sqlite")]
/// # async fn f(store: &idem::Store<sqlx::Sqlite>) -> Result<(), idem::Error> {
/// let mut tx = store.pool().begin_with("BEGIN IMMEDIATE").await?;
/// // ... joined handlers: `top_up(store.join(&mut tx), &job).await?` ...
/// idem::commit(tx).await?;
/// # Ok(()) }
/// ```
pub async fn commit<DB: Backend>(tx: Transaction<'_, DB>) -> Result<(), Error> {
    if DB::TransactionManager::get_transaction_depth(&*tx) > 1 {
        return Ok(tx.commit().await?);
    }
    match DB::commit(tx, Check::Session, &ClaimOptions::new()).await {
        Ok(true) => Ok(()),
        Ok(false) => Err(Error::NotKept(NotKept::NotCommitted)),
        Err(e) => Err(e.into()),
    }
}

/// What an `#[idempotent]` handler in transaction mode takes in place of the transaction:
/// `&store` (the call begins and commits its own transaction; `store` a [`Store`], a `&Store`
/// or an `Arc<Store>`) or [`Joined`] (made by [`Store::join`]: the call claims and runs inside
/// the caller's transaction).
#[diagnostic::on_unimplemented(
    message = "an idempotent handler takes `&idem::Store<DB>` or `store.join(tx)`, not `{Self}`",
    label = "pass `&store`, or `store.join(tx)` to run inside a transaction you hold",
    note = "`DB` is the database named in the handler's transaction parameter"
)]
pub trait Target<DB: Backend>: sealed::Sealed {
    #[doc(hidden)]
    fn via<'a>(self) -> Via<'a, DB>
    where
        Self: 'a;
}

mod sealed {
    pub trait Sealed {}
}

impl<DB: Backend> sealed::Sealed for &Store<DB> {}
impl<DB: Backend> sealed::Sealed for &&Store<DB> {}
impl<DB: Backend> sealed::Sealed for &Arc<Store<DB>> {}
impl<DB: Backend> sealed::Sealed for Joined<'_, DB> {}

impl<DB: Backend> Target<DB> for &Store<DB> {
    fn via<'a>(self) -> Via<'a, DB>
    where
        Self: 'a,
    {
        Via::Store(self)
    }
}

// `&store` where `store` is already a `&Store`, or an `Arc<Store>` (axum state, a spawned
// worker's): a `&Store<DB>` parameter took them by deref coercion, which a generic parameter
// does not do.
impl<DB: Backend> Target<DB> for &&Store<DB> {
    fn via<'a>(self) -> Via<'a, DB>
    where
        Self: 'a,
    {
        Via::Store(*self)
    }
}

impl<DB: Backend> Target<DB> for &Arc<Store<DB>> {
    fn via<'a>(self) -> Via<'a, DB>
    where
        Self: 'a,
    {
        Via::Store(self)
    }
}

impl<DB: Backend> Target<DB> for Joined<'_, DB> {
    fn via<'a>(self) -> Via<'a, DB>
    where
        Self: 'a,
    {
        Via::Joined(self)
    }
}

/// Where a handler's call claims: in a transaction of its own, or in the caller's.
#[doc(hidden)]
pub enum Via<'a, DB: Backend> {
    Store(&'a Store<DB>),
    Joined(Joined<'a, DB>),
}
