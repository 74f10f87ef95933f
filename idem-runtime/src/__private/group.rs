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

use super::{Codec, Spec, checked, encoder};

/// A group-commit handler's claim: in a savepoint of the open group of its key's lane.
pub async fn claim_group<DB: Backend>(
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

/// Ends a group-commit call with the body's `result` (its value stored for later deliveries
/// with `replay`'s codec): answers once the group committed.
#[inline]
pub async fn finish_group<DB: Backend, T, E>(
    codec: Option<Codec<T>>,
    held: GroupHeld<DB>,
    result: Result<T, E>,
) -> Result<Outcome<T>, Failed<E>> {
    held.finish(result, encoder(codec)).await
}
