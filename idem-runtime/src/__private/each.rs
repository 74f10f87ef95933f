//! What a batch handler run job by job (`each = "job"`) expands to calls.

use std::borrow::Cow;

use crate::backend::Backend;
use crate::batch::{BatchGuard, claim_batch as claim_keys};
use crate::claim::nested::Body;
use crate::each::{EachGuard, JobGuard};
use crate::error::Error;
use crate::key::Key;
use crate::observe::Observed;
use crate::outcome::{Each, Failed, HandlerError};
use crate::outgoing::Outbox;
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

/// The body of a batch with a fresh job; `None` when every job is a duplicate.
#[inline]
pub fn each_body<DB: Backend, T, E: From<Error>>(claim: &EachGuard<DB, T, E>) -> Option<Body> {
    claim.body()
}

/// The job at `at`, if it is this delivery's.
#[inline]
pub async fn each_job<DB: Backend, T, E: From<Error>>(
    claim: &mut EachGuard<DB, T, E>,
    at: usize,
) -> Result<Option<JobGuard<'_, DB, T, E>>, E> {
    claim.job(at).await
}

/// The transaction of a job.
#[inline]
pub fn job_tx<'j, DB: Backend, T, E: From<Error>>(
    job: &'j mut JobGuard<'_, DB, T, E>,
) -> &'j mut sqlx::Transaction<'static, DB> {
    job.tx()
}

/// The transaction and the outbox of a job.
#[inline]
pub fn job_parts<'j, DB: Backend, T, E: From<Error>>(
    job: &'j mut JobGuard<'_, DB, T, E>,
) -> (&'j mut sqlx::Transaction<'static, DB>, &'j mut Outbox) {
    job.parts()
}

/// Ends one job with its body's result; an `Err` is the whole batch's.
#[inline]
pub async fn finish_job<DB: Backend, T, E: From<Error>>(
    job: JobGuard<'_, DB, T, E>,
    result: Result<T, E>,
) -> Result<(), E> {
    job.finish(result).await
}

/// [`EachGuard::finish`] without converting idem's errors yet.
#[inline]
pub async fn finish_each<DB: Backend, T, E: From<Error>>(
    claim: EachGuard<DB, T, E>,
) -> Result<Each<T, E>, Failed<E>> {
    claim.finish_failed().await
}

/// The one place where an [`Error`] of a batch run job by job becomes the handler's error
/// type.
#[inline]
pub fn settle_each<T, E: HandlerError>(
    result: Result<Each<T, E>, Failed<E>>,
) -> Result<Each<T, E>, E> {
    result.map_err(Failed::into_handler_error)
}
