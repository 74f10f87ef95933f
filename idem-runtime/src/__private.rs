//! What `#[idempotent]` expands to calls. Not a public API: names and signatures here change
//! with the macro, which is why the facade pins both crates to one exact version.

//!
//! A leaf: nothing in the runtime imports it; it re-exports what the expansion names and adds
//! the small adapters between the expansion and the modes.

use std::borrow::Cow;
use std::future::Future;
use std::marker::PhantomData;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::Key;
pub use crate::batch::expansion::*;
pub use crate::claim::{Claimed, Held};
use crate::claim::{Request, nested, run};
pub use crate::join::Via;
pub use crate::observe::{Call, Site};
pub use crate::options::Mode;
pub use crate::outcome::{Failed, HandlerError};
use crate::record::NotStorable;
pub use crate::{
    Backend, Batch, Claim, ClaimOptions, Error, Fingerprint, Guard, IntoKey, Isolation, Joined,
    Lease, LeaseOptions, Leased, Outbox, Outcome, Recorded, Store, Target,
};
pub use core::time::Duration;

/// The databases that sqlx's transaction aliases name (`PgTransaction<'_>` is
/// `Transaction<'_, Postgres>`), for the store parameter that replaces them.
pub mod db {
    #[cfg(feature = "mysql")]
    pub use sqlx::MySql;
    #[cfg(feature = "postgres")]
    pub use sqlx::Postgres;
    #[cfg(feature = "sqlite")]
    pub use sqlx::Sqlite;

    /// Stands in for the database of a transaction parameter that named none
    /// (`&mut Transaction`), so that the handler given back to rustc compiles around the one
    /// error reported on that type.
    #[cfg(feature = "sqlite")]
    pub type Placeholder = Sqlite;
    #[cfg(all(feature = "postgres", not(feature = "sqlite")))]
    pub type Placeholder = Postgres;
    #[cfg(all(feature = "mysql", not(any(feature = "sqlite", feature = "postgres"))))]
    pub type Placeholder = MySql;
}

/// `if_postgres! { { handler } { stand-in } }` gives the handler when this build has the
/// database, else the stand-in: a handler on a database whose feature is off is one error
/// naming the feature, and its callers compile around it. The feature is the runtime's, so
/// the choice is made here rather than in the macro crate.
#[cfg(feature = "postgres")]
#[doc(hidden)]
#[macro_export]
macro_rules! __idem_if_postgres {
    ({ $($handler:tt)* } { $($stand_in:tt)* }) => { $($handler)* };
}
#[cfg(not(feature = "postgres"))]
#[doc(hidden)]
#[macro_export]
macro_rules! __idem_if_postgres {
    ({ $($handler:tt)* } { $($stand_in:tt)* }) => { $($stand_in)* };
}
pub use __idem_if_postgres as if_postgres;

#[cfg(feature = "sqlite")]
#[doc(hidden)]
#[macro_export]
macro_rules! __idem_if_sqlite {
    ({ $($handler:tt)* } { $($stand_in:tt)* }) => { $($handler)* };
}
#[cfg(not(feature = "sqlite"))]
#[doc(hidden)]
#[macro_export]
macro_rules! __idem_if_sqlite {
    ({ $($handler:tt)* } { $($stand_in:tt)* }) => { $($stand_in)* };
}
pub use __idem_if_sqlite as if_sqlite;

#[cfg(feature = "mysql")]
#[doc(hidden)]
#[macro_export]
macro_rules! __idem_if_mysql {
    ({ $($handler:tt)* } { $($stand_in:tt)* }) => { $($handler)* };
}
#[cfg(not(feature = "mysql"))]
#[doc(hidden)]
#[macro_export]
macro_rules! __idem_if_mysql {
    ({ $($handler:tt)* } { $($stand_in:tt)* }) => { $($stand_in)* };
}
pub use __idem_if_mysql as if_mysql;

/// `T` and `E` of a handler's return type, read through the type rather than its name, so
/// that any alias of `Result` works (`type Fallible<T> = Result<T, MyError>`).
#[diagnostic::on_unimplemented(
    message = "`#[idempotent]` handlers return `Result<T, E>`: `{Self}` is not a `Result`",
    label = "an `Err` is how a handler fails a delivery so that the job is redelivered; `{Self}` has none",
    note = "return `Result<T, E>`, or an alias of it like `type Fallible<T> = Result<T, MyError>`"
)]
pub trait HandlerResult {
    type Ok;
    type Err;
    fn into_result(self) -> Result<Self::Ok, Self::Err>;
}

impl<T, E> HandlerResult for Result<T, E> {
    type Ok = T;
    type Err = E;
    #[inline]
    fn into_result(self) -> Self {
        self
    }
}

/// The body's value on its way to the runtime, for a return type that is an alias not naming
/// `T`: `Returned(value).into_result()` finds [`IntoResult`] for a `Result`, else (by autoref)
/// [`NotAResult`], whose unconstrained `Result` adds no error to the signature's one.
pub struct Returned<R>(pub R);

pub trait IntoResult {
    type Ok;
    type Err;
    fn into_result(self) -> Result<Self::Ok, Self::Err>;
}

impl<R: HandlerResult> IntoResult for Returned<R> {
    type Ok = R::Ok;
    type Err = R::Err;
    fn into_result(self) -> Result<R::Ok, R::Err> {
        self.0.into_result()
    }
}

pub trait NotAResult {
    fn into_result<T, E>(self) -> Result<T, E>;
}

impl<R> NotAResult for &Returned<R> {
    fn into_result<T, E>(self) -> Result<T, E> {
        unreachable!("a handler whose return type is not a `Result` does not compile")
    }
}

/// Encodes the key. Called with the `key` expression before any I/O, so that a type without
/// [`IntoKey`] is reported on the expression itself.
#[inline]
pub fn key<K: IntoKey + ?Sized>(value: &K) -> Result<Key, Error> {
    Ok(Key::new(value)?)
}

/// Where the call of `handler` claims. A store inside the body of another handler (in this
/// task) is refused here, before any I/O: its transaction would not be the open one.
#[inline]
pub fn via<'a, DB: Backend, S: Target<DB> + 'a>(
    store: S,
    handler: &'static str,
) -> Result<Via<'a, DB>, Error> {
    let via = store.via();
    if let Via::Store(_) = via {
        nested::refuse_nested(handler)?;
    }
    Ok(via)
}

/// Runs a handler's claim, body and end with `handler` marked as the one whose transaction is
/// open in this task (a task-local, set and reset around each poll).
#[inline]
pub fn in_body<F: Future>(handler: &'static str, future: F) -> impl Future<Output = F::Output> {
    nested::in_body(handler, future)
}

/// Opens the call's `idem.claim` span; [`Call::run`] then runs claim, body and end in it and
/// records the outcome (span fields and metrics).
#[inline]
pub fn observe(site: &'static Site, mode: Mode, key: &Result<Key, Error>) -> Call {
    Call::start(site, mode, key.as_ref().ok().map(Key::as_str))
}

/// A batch call's span and metrics. The span names no `key`: the batch has many.
#[inline]
pub fn observe_batch(site: &'static Site) -> Call {
    Call::start(site, Mode::Batch, None)
}

/// The span's `mode` of a transaction-mode call: its own transaction, or the caller's.
#[inline]
pub fn mode<DB: Backend>(via: &Result<Via<'_, DB>, Error>) -> Mode {
    match via {
        Ok(Via::Joined(_)) => Mode::Joined,
        _ => Mode::Transaction,
    }
}

/// Claims an already-encoded key, passing a key error through without touching the database.
#[inline]
pub async fn claim<'a, DB: Backend>(
    via: Result<Via<'a, DB>, Error>,
    scope: &'static str,
    options: ClaimOptions,
    key: Result<Key, Error>,
) -> Result<Claimed<Held<'a, DB>>, Error> {
    claim_checked(via, scope, options, key, None).await
}

/// [`claim`] with the payload's fingerprint, computed before any I/O.
#[inline]
pub async fn claim_checked<'a, DB: Backend>(
    via: Result<Via<'a, DB>, Error>,
    scope: &'static str,
    options: ClaimOptions,
    key: Result<Key, Error>,
    fingerprint: Option<Result<Fingerprint, Error>>,
) -> Result<Claimed<Held<'a, DB>>, Error> {
    let via = via?;
    let request = Request::new(
        Cow::Borrowed(scope),
        key?,
        options,
        fingerprint.transpose()?,
    );
    match via {
        Via::Store(store) => run::own(store, request).await,
        Via::Joined(joined) => joined.claim_request(request).await,
    }
}

/// The fingerprint of the `fingerprint` expression.
#[inline]
pub fn fingerprint<T: Fingerprintable + ?Sized>(value: &T) -> Result<Fingerprint, Error> {
    Fingerprint::of(value)
}

/// What `fingerprint` needs of its expression, named so that a missing impl reads as advice.
#[diagnostic::on_unimplemented(
    message = "`fingerprint` digests the payload's JSON: `{Self}` must implement `serde::Serialize`",
    label = "the `fingerprint` expression has type `{Self}`",
    note = "derive it: `#[derive(serde::Serialize)]`, or point `fingerprint` at a field that is"
)]
pub trait Fingerprintable: Serialize {}
impl<T: Serialize + ?Sized> Fingerprintable for T {}

/// How a handler's `T` goes to JSON and back, for `replay`; obtained from [`Replay`].
pub struct Codec<T> {
    encode: fn(&T) -> Result<String, NotStorable>,
    decode: fn(&str) -> Result<T, serde_json::Error>,
}

impl<T> Clone for Codec<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Codec<T> {}

/// Picks the [`Codec`] of `T` by autoref: `(&Replay::<T>::new()).codec()` finds
/// [`ReplayCodec`] when `T` can be replayed, else [`ReplayFallback`], whose one unmet bound
/// is the single compile error the handler gets (on its return type), instead of one error
/// per serde bound per call.
pub struct Replay<T>(PhantomData<fn() -> T>);

impl<T> Replay<T> {
    #[allow(clippy::new_without_default, reason = "only the expansion makes one")]
    pub const fn new() -> Self {
        Replay(PhantomData)
    }
}

pub trait ReplayCodec<T> {
    fn codec(&self) -> Codec<T>;
}

impl<T: Serialize + DeserializeOwned> ReplayCodec<T> for Replay<T> {
    fn codec(&self) -> Codec<T> {
        Codec {
            encode: |value| crate::record::encode(value),
            decode: |json| crate::record::decode(json),
        }
    }
}

pub trait ReplayFallback<T> {
    fn codec(&self) -> Codec<T>
    where
        T: Replayable;
}

impl<T> ReplayFallback<T> for &Replay<T> {
    fn codec(&self) -> Codec<T>
    where
        T: Replayable,
    {
        unreachable!("`Replayable` has no implementations")
    }
}

/// The bound a handler's `T` fails when it cannot be replayed. Nothing implements it: it only
/// carries the message.
#[diagnostic::on_unimplemented(
    message = "`replay` stores the handler's value as JSON and reads it back: `{Self}` must implement `serde::Serialize` and `serde::Deserialize`",
    label = "`{Self}` cannot be stored and replayed",
    note = "derive them: `#[derive(serde::Serialize, serde::Deserialize)]`, or drop `replay`"
)]
pub trait Replayable {}

/// The first delivery's value, read back for [`Outcome::Replayed`]. A stored value that no
/// longer reads as `T` (the type changed since) is a plain duplicate, with a warning: the job
/// was applied, and an error would have it redelivered forever.
#[inline]
pub fn replayed<T, E>(codec: Codec<T>, recorded: &Recorded) -> Result<Outcome<T>, Failed<E>> {
    match recorded.result_json().map(codec.decode).transpose() {
        Ok(Some(value)) => Ok(Outcome::Replayed(value)),
        Ok(None) => Ok(Outcome::Duplicate),
        Err(e) => {
            crate::observe::undecodable(&e);
            Ok(Outcome::Duplicate)
        }
    }
}

/// [`finish`] storing the value for later deliveries (`replay`).
#[inline]
pub async fn finish_replay<DB: Backend, T, E>(
    codec: Codec<T>,
    guard: Held<'_, DB>,
    result: Result<T, E>,
) -> Result<Outcome<T>, Failed<E>> {
    guard
        .finish(result, |value| (codec.encode)(value).map(Some))
        .await
}

/// [`finish`] that also writes the outbox's messages in the claim's transaction.
#[inline]
pub async fn finish_sending<DB: Backend, T, E>(
    guard: Held<'_, DB>,
    result: Result<T, E>,
    outbox: Outbox,
) -> Result<Outcome<T>, Failed<E>> {
    guard
        .finish_sending(result, |_| Ok(None), Some(outbox.into_pending()))
        .await
}

/// [`finish_replay`] that also writes the outbox's messages in the claim's transaction.
#[inline]
pub async fn finish_replay_sending<DB: Backend, T, E>(
    codec: Codec<T>,
    guard: Held<'_, DB>,
    result: Result<T, E>,
    outbox: Outbox,
) -> Result<Outcome<T>, Failed<E>> {
    guard
        .finish_sending(
            result,
            |value| (codec.encode)(value).map(Some),
            Some(outbox.into_pending()),
        )
        .await
}

/// Lease mode's claim of an already-encoded key.
#[inline]
pub async fn lease<DB: Backend>(
    store: &Store<DB>,
    scope: &'static str,
    options: LeaseOptions,
    key: Result<Key, Error>,
) -> Result<Leased, Error> {
    store
        .lease_owned(Cow::Borrowed(scope), key?, options, None)
        .await
}

/// [`lease`] with the payload's fingerprint, computed before any I/O.
#[inline]
pub async fn lease_checked<DB: Backend>(
    store: &Store<DB>,
    scope: &'static str,
    options: LeaseOptions,
    key: Result<Key, Error>,
    fingerprint: Option<Result<Fingerprint, Error>>,
) -> Result<Leased, Error> {
    let fingerprint = fingerprint.transpose()?;
    store
        .lease_owned(Cow::Borrowed(scope), key?, options, fingerprint)
        .await
}

/// [`lease_finish`] storing the value for later deliveries (`replay`).
#[inline]
pub async fn lease_finish_replay<T, E>(
    codec: Codec<T>,
    lease: Lease,
    result: Result<Result<T, E>, Error>,
) -> Result<Outcome<T>, Failed<E>> {
    lease
        .finish_with(result, |value| (codec.encode)(value).map(Some))
        .await
}

/// Runs a lease handler's body under the lease's timeout.
#[inline]
pub async fn lease_run<F: Future>(lease: &Lease, body: F) -> Result<F::Output, Error> {
    lease.run(body).await
}

/// Lease mode's end: `result` is the body's result, or the timeout that cut it short.
#[inline]
pub async fn lease_finish<T, E>(
    lease: Lease,
    result: Result<Result<T, E>, Error>,
) -> Result<Outcome<T>, Failed<E>> {
    lease.finish_with(result, |_| Ok(None)).await
}

/// [`Guard::finish`] without converting idem's errors yet.
#[inline]
pub async fn finish<DB: Backend, T, E>(
    guard: Held<'_, DB>,
    result: Result<T, E>,
) -> Result<Outcome<T>, Failed<E>> {
    guard.finish(result, |_| Ok(None)).await
}

/// The one place where an [`Error`] becomes the handler's error type.
#[inline]
pub fn settle<T, E: HandlerError>(result: Result<Outcome<T>, Failed<E>>) -> Result<Outcome<T>, E> {
    crate::claim::settle(result)
}

/// Claims retried after a lost race (serialization failure, deadlock victim) in this process
/// so far; the race tests print it.
pub fn claim_retries() -> u64 {
    crate::observe::claim_retries()
}
