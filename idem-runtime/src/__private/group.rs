//! What a group-commit handler (`group`) expands to calls.

use std::hash::Hash;

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

/// A group-commit handler's claim: in a savepoint of the open group of its key's lane, or of
/// the lane of the rows it named (`lane = ".."`, hashed by [`lane`]).
pub async fn claim_group<DB: Backend>(
    group: &Group<DB>,
    spec: &'static Spec,
    key: Result<Key, Error>,
    lane: Option<u64>,
    print: Option<Result<Fingerprint, Error>>,
    link: Option<TraceParent>,
) -> Result<Claimed<GroupHeld<DB>>, Error> {
    let (key, print) = checked(spec, Mode::Group, key, print)?;
    let request = spec.request(key, spec.options(print).link(link));
    group.claim_request(request, lane).await
}

/// The `lane` expression, hashed as [`Group::claim_in_lane`] hashes its `rows`, so that a
/// handler and a hand-written call naming the same rows meet in the same lane.
#[inline]
pub fn lane<L: LaneOf + ?Sized>(rows: &L) -> u64 {
    crate::group::rows_hash(rows)
}

/// What `lane` needs of its expression, named so that a missing impl reads as advice.
#[diagnostic::on_unimplemented(
    message = "`lane` hashes what the body's rows are chosen by: `{Self}` must implement `Hash`",
    label = "the `lane` expression has type `{Self}`",
    note = "point `lane` at the value that names the rows (an account's id), or derive `Hash` \
            for its type"
)]
pub trait LaneOf: Hash {}
impl<T: Hash + ?Sized> LaneOf for T {}

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
