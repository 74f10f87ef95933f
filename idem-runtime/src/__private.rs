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

use crate::batch::claim_batch as claim_keys;
use crate::claim::Request;
use crate::key::collect_keys;
use crate::lease::claim_lease;
use crate::observe::Observed;
use crate::record::{self, NotStorable};

pub use crate::backend::Backend;
pub use crate::batch::BatchGuard;
pub use crate::claim::nested::Body;
pub use crate::claim::{Claimed, TxHeld};
pub use crate::error::Error;
pub use crate::join::{Joined, Target, Via};
pub use crate::key::{IntoKey, Key, KeyError};
pub use crate::lease::Lease;
pub use crate::observe::Site;
pub use crate::options::{ClaimOptions, Isolation, LeaseOptions, Mode};
pub use crate::outcome::{Batch, Failed, HandlerError, Outcome};
pub use crate::outgoing::{BatchOutbox, Outbox};
pub use crate::record::{Fingerprint, Recorded};
pub use crate::store::Store;
pub use crate::traceparent::{Link, TraceParent};
pub use core::time::Duration;

mod claim;
mod group;
pub use crate::each::{EachGuard, JobGuard};
pub use crate::group::{Group, GroupHeld, GroupTarget};
pub use crate::outcome::Each;
pub use claim::claim;
pub use group::{LaneOf, claim_group, finish_group, lane};

pub mod db;

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

/// What a handler's expansion claims with, built at compile time into a `static`: its scope
/// and its metric labels, its name (for a refused nested call) and its options.
pub struct Spec {
    scope: &'static str,
    handler: &'static str,
    site: Site,
    options: ClaimOptions,
}

impl Spec {
    pub const fn new(scope: &'static str, handler: &'static str, options: ClaimOptions) -> Spec {
        Spec {
            scope,
            handler,
            site: Site::new(scope),
            options,
        }
    }

    fn request(&'static self, key: Key, options: ClaimOptions) -> Request {
        Request::of(
            Cow::Borrowed(self.scope),
            key,
            options,
            &self.site,
            Cow::Borrowed(self.handler),
        )
    }

    /// The options, with the payload's fingerprint if the handler has one.
    fn options(&self, print: Option<Fingerprint>) -> ClaimOptions {
        match print {
            Some(print) => self.options.fingerprint(print),
            None => self.options,
        }
    }

    /// A call refused before its claim (a bad key, a payload that cannot be fingerprinted):
    /// observed as any other call.
    fn refused(&'static self, mode: Mode, error: Error) -> Error {
        Observed::start(&self.site, self.scope, mode, None, None).refused(&error);
        error
    }
}

/// [`Spec`] of a lease-mode handler.
pub struct LeaseSpec {
    spec: Spec,
    lease: LeaseOptions,
}

impl LeaseSpec {
    pub const fn new(scope: &'static str, handler: &'static str, lease: LeaseOptions) -> Self {
        let options = ClaimOptions::new();
        let options = match lease.replay {
            true => options.replay(),
            false => options,
        };
        LeaseSpec {
            spec: Spec::new(scope, handler, options),
            lease,
        }
    }
}

/// Encodes the key. Called with the `key` expression before any I/O, so that a type without
/// [`IntoKey`] is reported on the expression itself.
#[inline]
pub fn key<K: IntoKey + ?Sized>(value: &K) -> Result<Key, Error> {
    Ok(Key::new(value)?)
}

/// The key and the fingerprint, checked before any I/O; a refusal is observed.
fn checked(
    spec: &'static Spec,
    mode: Mode,
    key: Result<Key, Error>,
    print: Option<Result<Fingerprint, Error>>,
) -> Result<(Key, Option<Fingerprint>), Error> {
    match (key, print.transpose()) {
        (Ok(key), Ok(print)) => Ok((key, print)),
        (Err(e), _) | (_, Err(e)) => Err(spec.refused(mode, e)),
    }
}

/// The traceparent of the `link` expression; a value that is none links nothing (said at
/// `debug`, never an error: the header is the producer's).
#[inline]
pub fn link<L: Link + ?Sized>(value: &L) -> Option<TraceParent> {
    value.link()
}

/// A lease-mode handler's claim; its span links to the producer's when the handler was given
/// `link = ".."`.
pub async fn lease<DB: Backend>(
    store: &Store<DB>,
    spec: &'static LeaseSpec,
    key: Result<Key, Error>,
    print: Option<Result<Fingerprint, Error>>,
    link: Option<TraceParent>,
) -> Result<Claimed<Lease>, Error> {
    let (key, print) = checked(&spec.spec, Mode::Lease, key, print)?;
    let request = spec.spec.request(key, spec.spec.options(print).link(link));
    let lease = match print {
        Some(print) => spec.lease.fingerprint(print),
        None => spec.lease,
    };
    claim_lease(store, request, lease.link(link)).await
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
            encode: |value| record::encode(value),
            decode: |json| record::decode(json),
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

/// Ends a transaction-mode call with the body's `result` (its value stored for later
/// deliveries with `replay`'s codec), without converting idem's errors yet (that is
/// [`settle`]'s, once). The finish's own future, as `claim` returns the claim's.
#[inline]
pub fn finish<DB: Backend, T, E>(
    codec: Option<Codec<T>>,
    held: TxHeld<'_, DB>,
    result: Result<T, E>,
) -> impl Future<Output = Result<Outcome<T>, Failed<E>>> {
    held.finish(result, encoder(codec))
}

/// What a finish stores of the value: its JSON with `replay`'s codec, nothing without one.
fn encoder<T>(codec: Option<Codec<T>>) -> impl FnOnce(&T) -> Result<Option<String>, NotStorable> {
    move |value| match codec {
        Some(codec) => (codec.encode)(value).map(Some),
        None => Ok(None),
    }
}

/// The outbox a lease handler's body sends on (the body borrows the lease meanwhile).
#[inline]
pub fn lease_outbox(lease: &Lease) -> Outbox {
    Outbox::new(Cow::Owned(lease.scope().to_owned()), key_of(lease))
}

fn key_of(lease: &Lease) -> Key {
    Key::new(lease.key()).expect("a lease's key was checked at its claim")
}

/// Lease mode's end: `result` is the body's result, or the timeout that cut it short (its
/// value stored for later deliveries with `replay`'s codec); the body's messages, if it took
/// an outbox.
#[inline]
pub async fn lease_finish<T, E>(
    codec: Option<Codec<T>>,
    lease: Lease,
    result: Result<Result<T, E>, Error>,
    outbox: Option<Outbox>,
) -> Result<Outcome<T>, Failed<E>> {
    let unsent = outbox.map(Outbox::into_unsent);
    lease
        .finish_with(result, encoder(codec), unsent.as_ref())
        .await
}

/// The one place where an [`Error`] becomes the handler's error type, whatever the mode
/// answered (an [`Outcome`], a [`Batch`], an [`Each`]).
#[inline]
pub fn settle<R, E: HandlerError>(result: Result<R, Failed<E>>) -> Result<R, E> {
    result.map_err(Failed::into_handler_error)
}

/// Claims retried after a lost race (serialization failure, deadlock victim) in this process
/// so far; the race tests print it.
pub fn claim_retries() -> u64 {
    crate::observe::claim_retries()
}

// Batch handlers.

/// Every key of a batch (each from `Key::new`), checked before any I/O; a refused key is
/// named by its position.
pub fn batch_keys(keys: impl Iterator<Item = Result<Key, KeyError>>) -> Result<Vec<Key>, Error> {
    Ok(collect_keys(keys)?)
}

/// A batch handler's claim of its `jobs` jobs, passing a key error through (observed) without
/// touching the database.
pub async fn claim_batch<DB: Backend>(
    store: &Store<DB>,
    spec: &'static Spec,
    keys: Result<Vec<Key>, Error>,
    jobs: usize,
) -> Result<BatchGuard<DB>, Error> {
    let keys = match keys {
        Ok(keys) => keys,
        Err(e) => {
            Observed::batch(&spec.site, spec.scope, jobs, None).refused(&e);
            return Err(e);
        }
    };
    let scope = Cow::Borrowed(spec.scope);
    let handler = Some((&spec.site, spec.handler));
    claim_keys(store, scope, &keys, spec.options, handler).await
}

/// The jobs of a batch handler: the body gets clones of the fresh ones.
#[diagnostic::on_unimplemented(
    message = "the jobs of a batch handler must be `Clone`: `{Self}` is not",
    label = "the body gets clones of the fresh jobs of this batch, in this type",
    note = "derive `Clone` for `{Self}`, or claim by hand with `Store::claim_batch`"
)]
pub trait BatchJob: Clone {}

impl<T: Clone> BatchJob for T {}

/// The fresh jobs, as the body's batch parameter sees them (a slice).
pub enum FreshJobs<'a, T> {
    /// Every job of the batch was fresh.
    All(&'a [T]),
    /// Clones of the fresh ones, in the batch's order.
    Some(Vec<T>),
}

impl<T> std::ops::Deref for FreshJobs<'_, T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match self {
            FreshJobs::All(jobs) => jobs,
            FreshJobs::Some(jobs) => jobs,
        }
    }
}

/// The jobs the body gets: the batch itself when every job is fresh, else clones of the
/// fresh ones, in the batch's order (the body's parameter keeps its declared type).
pub fn fresh_jobs<'a, T: BatchJob, DB: Backend>(
    jobs: &'a [T],
    claim: &BatchGuard<DB>,
) -> FreshJobs<'a, T> {
    if claim.fresh().iter().all(|f| *f) {
        return FreshJobs::All(jobs);
    }
    FreshJobs::Some(
        jobs.iter()
            .zip(claim.fresh())
            .filter(|(_, fresh)| **fresh)
            .map(|(job, _)| job.clone())
            .collect(),
    )
}

/// The body, the transaction and the outbox of a claim with a fresh job.
pub fn batch_open<DB: Backend>(
    claim: &mut BatchGuard<DB>,
) -> (Body, &mut sqlx::Transaction<'static, DB>, &mut BatchOutbox) {
    const FRESH: &str = "the expansion runs the body only with a fresh job";
    let body = claim.body().expect(FRESH);
    let (tx, outbox) = claim.parts().expect(FRESH);
    (body, tx, outbox)
}

/// The answer of a batch whose every job is a duplicate; the body did not run.
pub fn all_duplicates<T, DB: Backend>(claim: &BatchGuard<DB>) -> Batch<T> {
    claim.settled()
}

/// [`BatchGuard::finish`] without converting idem's errors yet.
pub async fn finish_batch<DB: Backend, T, E>(
    claim: BatchGuard<DB>,
    result: Result<T, E>,
) -> Result<Batch<T>, Failed<E>> {
    claim.finish_failed(result.map_err(Failed::Handler)).await
}

/// [`EachGuard::finish`] without converting idem's errors yet.
#[inline]
pub async fn finish_each<DB: Backend, T, E: From<Error>>(
    claim: EachGuard<DB, T, E>,
) -> Result<Each<T, E>, Failed<E>> {
    claim.finish_failed().await
}
