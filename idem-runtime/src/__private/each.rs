//! What a batch handler run job by job (`each = "job"`) expands to calls.

use std::borrow::Cow;

use crate::backend::Backend;
use crate::batch::{BatchGuard, claim_batch as claim_keys};
use crate::each::EachGuard;
use crate::error::Error;
use crate::key::Key;
use crate::observe::Observed;
use crate::outcome::{Each, Failed};
use crate::store::Store;

use super::Spec;

/// The claim of a batch run job by job, passing a key error through (observed) without
/// touching the database.
pub async fn claim_each<DB: Backend, T, E: From<Error>>(
    store: &Store<DB>,
    spec: &'static Spec,
    keys: Result<Vec<Key>, Error>,
    jobs: usize,
) -> Result<EachGuard<DB, T, E>, Error> {
    let keys = match keys {
        Ok(keys) => keys,
        Err(e) => {
            Observed::batch(&spec.site, spec.scope, jobs, None).refused(&e);
            return Err(e);
        }
    };
    let scope = Cow::Borrowed(spec.scope);
    let handler = Some((&spec.site, spec.handler));
    let claim = claim_keys(store, scope, &keys, spec.options, handler).await?;
    Ok(BatchGuard::each(claim))
}

/// [`EachGuard::finish`] without converting idem's errors yet.
#[inline]
pub async fn finish_each<DB: Backend, T, E: From<Error>>(
    claim: EachGuard<DB, T, E>,
) -> Result<Each<T, E>, Failed<E>> {
    claim.finish_failed().await
}
