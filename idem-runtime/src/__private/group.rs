//! What a group-commit handler (`group`) expands to calls.

use crate::backend::Backend;
use crate::claim::Claimed;
use crate::error::Error;
use crate::group::{Group, GroupHeld};
use crate::key::Key;
use crate::options::Mode;
use crate::outcome::{Failed, Outcome};
use crate::record::Fingerprint;
use crate::traceparent::TraceParent;

use super::{Codec, Spec, checked};

/// A group-commit handler's claim: in a savepoint of the open group of its key's lane.
#[inline]
pub async fn claim_group<DB: Backend>(
    group: &Group<DB>,
    spec: &'static Spec,
    key: Result<Key, Error>,
    print: Option<Result<Fingerprint, Error>>,
) -> Result<Claimed<GroupHeld<DB>>, Error> {
    let (key, print) = checked(spec, Mode::Group, key, print)?;
    let request = spec.request(key, spec.options(print));
    group.claim_request(request).await
}

/// [`claim_group`] of a handler given `link = ".."`.
pub async fn claim_group_linked<DB: Backend>(
    group: &Group<DB>,
    spec: &'static Spec,
    key: Result<Key, Error>,
    print: Option<Result<Fingerprint, Error>>,
    link: Option<TraceParent>,
) -> Result<Claimed<GroupHeld<DB>>, Error> {
    let (key, print) = checked(spec, Mode::Group, key, print)?;
    let request = spec.request(key, spec.options(print).link(link));
    group.claim_request(request).await
}

/// Ends a group-commit call with the body's `result`: answers once the group committed.
#[inline]
pub async fn finish_group<DB: Backend, T, E>(
    held: GroupHeld<DB>,
    result: Result<T, E>,
) -> Result<Outcome<T>, Failed<E>> {
    held.finish(result, |_| Ok(None)).await
}

/// [`finish_group`] storing the value for later deliveries (`replay`).
#[inline]
pub async fn finish_group_replay<DB: Backend, T, E>(
    codec: Codec<T>,
    held: GroupHeld<DB>,
    result: Result<T, E>,
) -> Result<Outcome<T>, Failed<E>> {
    held.finish(result, |value| (codec.encode)(value).map(Some))
        .await
}
