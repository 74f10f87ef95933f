//! Claiming inside a transaction the caller already holds (an HTTP handler's, a job
//! framework's, or the body of an outer idempotent handler).
//!
//! The claim and the body run in a savepoint of the caller's transaction: the commit stays the
//! caller's, a body error rolls back to the savepoint only, and a duplicate leaves nothing.

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use sqlx::{Connection as _, Transaction};

use crate::backend::{Backend, Sql};
use crate::observe;
use crate::store::{Held, check_scope, in_progress};
use crate::{ClaimOptions, Error, Fingerprint, Key, Outcome, Recorded, Store};

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
    /// On [`JoinedClaim::Fresh`] run the effect on [`JoinedGuard::tx`] and end with
    /// [`JoinedGuard::finish`]. The scope is checked as [`Store::claim`] checks it.
    pub async fn claim(self, scope: &str, key: &Key) -> Result<JoinedClaim<'a, DB>, Error> {
        self.claim_with(scope, key, None, false).await
    }

    /// [`claim`](Joined::claim) with the payload's fingerprint (see [`Store::claim_checked`])
    /// and, with `replay`, the stored value of an earlier delivery read back.
    pub async fn claim_with(
        self,
        scope: &str,
        key: &Key,
        fingerprint: Option<&Fingerprint>,
        replay: bool,
    ) -> Result<JoinedClaim<'a, DB>, Error> {
        check_scope(scope)?;
        let mut options = ClaimOptions::new();
        if replay {
            options = options.replay();
        }
        let claimed = self
            .claim_owned(
                Cow::Owned(scope.to_owned()),
                key.clone(),
                options,
                fingerprint.copied(),
            )
            .await?;
        Ok(match claimed {
            Claimed::Fresh(held) => JoinedClaim::Fresh(JoinedGuard { held }),
            Claimed::Duplicate => JoinedClaim::Duplicate,
            Claimed::Replayed(recorded) => JoinedClaim::Replayed(recorded),
        })
    }

    pub(crate) async fn claim_owned(
        self,
        scope: Cow<'static, str>,
        key: Key,
        options: ClaimOptions,
        fingerprint: Option<Fingerprint>,
    ) -> Result<Claimed<'a, DB>, Error> {
        let started = Instant::now();
        let claimed = self.claim_once(scope, key, options, fingerprint).await;
        observe::decided(started, observe::Decision::of_joined(&claimed));
        claimed
    }

    async fn claim_once(
        self,
        scope: Cow<'static, str>,
        key: Key,
        options: ClaimOptions,
        fingerprint: Option<Fingerprint>,
    ) -> Result<Claimed<'a, DB>, Error> {
        let sql: Arc<Sql> = self.store.sql_arc();
        #[cfg(feature = "testing")]
        crate::testing::probe::claiming(crate::testing::probe::Mode::Transaction);
        // In a transaction, sqlx's `begin` is a SAVEPOINT.
        let sent = Instant::now();
        let begun = self.conn.begin().await;
        let mut tx = match begun {
            Ok(tx) => tx,
            Err(e) => {
                observe::attempted(sent);
                if DB::is_lock_timeout(&e) {
                    return Err(in_progress(scope, key));
                }
                return Err(e.into());
            }
        };
        let print = fingerprint.as_ref().map(|f| &f.as_bytes()[..]);
        // No retry on a transient error, unlike a claim of our own: the race was lost by the
        // caller's transaction (MySQL has rolled it back whole), so only the caller can retry.
        let claimed = DB::try_claim(&mut tx, &sql, &scope, key.as_str(), print).await;
        observe::attempted(sent);
        match claimed {
            Ok(true) => Ok(Claimed::Fresh(Held::new(
                tx, sql, options, scope, key, true,
            ))),
            Ok(false) if options.replay || fingerprint.is_some() => {
                let recorded = DB::recorded(&mut tx, &sql, &scope, key.as_str()).await;
                tx.rollback().await?;
                let recorded = recorded?;
                recorded.check(fingerprint.as_ref(), &scope, key.as_str())?;
                Ok(match recorded.result {
                    Some(_) if options.replay => Claimed::Replayed(recorded),
                    _ => Claimed::Duplicate,
                })
            }
            Ok(false) => {
                tx.rollback().await?;
                Ok(Claimed::Duplicate)
            }
            Err(e) => {
                // Back to the savepoint, so that the caller's transaction stays usable where
                // the database allows it (PostgreSQL aborts it on any error otherwise).
                drop(tx.rollback().await);
                if DB::is_lock_timeout(&e) {
                    return Err(in_progress(scope, key));
                }
                Err(e.into())
            }
        }
    }
}

/// The answer to [`Joined::claim`].
#[derive(Debug)]
#[must_use = "a fresh claim holds a savepoint: run the body and call `JoinedGuard::finish`"]
pub enum JoinedClaim<'a, DB: Backend> {
    /// This delivery holds the key: run the body in [`JoinedGuard::tx`].
    Fresh(JoinedGuard<'a, DB>),
    /// An earlier delivery committed this key; the savepoint has been rolled back, and the
    /// caller's transaction is as it was.
    Duplicate,
    /// An earlier delivery committed this key and stored its value (`replay`).
    Replayed(Recorded),
}

/// A fresh claim in a savepoint of the caller's transaction.
///
/// [`finish`](JoinedGuard::finish) releases the savepoint on `Ok` (marker and effect are then
/// part of the caller's transaction, kept only if it commits) or rolls back to it on `Err`;
/// dropping the guard rolls back to it too.
#[derive(Debug)]
pub struct JoinedGuard<'a, DB: Backend> {
    held: Held<'a, DB>,
}

impl<'a, DB: Backend> JoinedGuard<'a, DB> {
    /// The savepoint the body must run its effect on.
    pub fn tx(&mut self) -> &mut Transaction<'a, DB> {
        self.held.tx()
    }

    /// Ends the call: releases the savepoint on `Ok` ([`Outcome::Applied`]: applied in the
    /// caller's transaction, kept only if it commits), rolls back to it on `Err`.
    pub async fn finish<T, E: From<Error>>(self, result: Result<T, E>) -> Result<Outcome<T>, E> {
        crate::__private::settle(self.held.end_recording(result, |_| Ok(None)).await)
    }

    /// [`finish`](JoinedGuard::finish) that also stores the `Ok` value with the marker
    /// (`replay`).
    pub async fn finish_replay<T: serde::Serialize, E: From<Error>>(
        self,
        result: Result<T, E>,
    ) -> Result<Outcome<T>, E> {
        let end = self
            .held
            .end_recording(result, |v| crate::replay::encode(v).map(Some));
        crate::__private::settle(end.await)
    }
}

/// What an `#[idempotent]` handler in transaction mode takes in place of the transaction:
/// `&Store<DB>` (the call begins and commits its own transaction) or [`Joined`] (made by
/// [`Store::join`]: the call claims and runs inside the caller's transaction).
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
impl<DB: Backend> sealed::Sealed for Joined<'_, DB> {}

impl<DB: Backend> Target<DB> for &Store<DB> {
    fn via<'a>(self) -> Via<'a, DB>
    where
        Self: 'a,
    {
        Via::Store(self)
    }
}

// `&store` where `store` is already a `&Store`: a `&Store<DB>` parameter took it by deref
// coercion, which a generic parameter does not do.
impl<DB: Backend> Target<DB> for &&Store<DB> {
    fn via<'a>(self) -> Via<'a, DB>
    where
        Self: 'a,
    {
        Via::Store(*self)
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

/// The answer to a claim of either kind, as the generated code sees it.
#[doc(hidden)]
pub enum Claimed<'a, DB: Backend> {
    Fresh(Held<'a, DB>),
    Duplicate,
    Replayed(Recorded),
}

tokio::task_local! {
    /// The name of the handler whose body is running in this task (its transaction is open).
    static BODY: &'static str;
}

/// Runs `future` (a handler's claim, body and end) with `handler` marked as the one whose
/// transaction is open, for [`refuse_nested`]. A task-local: set and reset around each poll.
pub(crate) fn in_body<F: Future>(
    handler: &'static str,
    future: F,
) -> impl Future<Output = F::Output> {
    BODY.scope(handler, future)
}

/// Refuses a claim with a store inside a handler's body (before any I/O): its transaction
/// would be another one than the open one, and wait for it (SQLite) or commit apart from it.
pub(crate) fn refuse_nested(inner: &str) -> Result<(), Error> {
    match BODY.try_with(|outer| *outer) {
        Ok(outer) => Err(Error::Nested {
            inner: inner.to_owned(),
            outer: outer.to_owned(),
        }),
        Err(_) => Ok(()),
    }
}
