//! Batch handlers: the same effect as `handlers::apply`, for a whole batch of jobs in one
//! transaction, written by hand on the runtime's API and with the attribute.

use idem::{Batch, Key, Store};
use sqlx::{Pool, Transaction};

use super::Support;
use super::db::TestDb;
use super::handlers::{Hold, Job, TestError, Then, hang_in_body, insert_effect};

/// What a batch body does after its effects.
#[derive(Clone, Copy, Debug)]
pub(crate) enum BatchThen {
    Commit,
    Fail,
    /// Parks the first body that enters on the hold, then commits.
    Park,
    /// Parks the first body that enters on the hold, then fails.
    ParkThenFail,
    /// Prints `IN_BODY` and waits forever (until the process is killed).
    Hang,
}

/// The body both handlers run: one effect row per fresh job, then `then`. Its value is the
/// number of jobs it was given.
async fn body<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    jobs: &[&Job],
    then: BatchThen,
    hold: Option<&Hold>,
) -> Result<usize, TestError> {
    for job in jobs {
        insert_effect(tx, job, "batch").await?;
    }
    match then {
        BatchThen::Commit => {}
        BatchThen::Fail => return Err(TestError::Refused),
        BatchThen::Park => hold.expect("a hold to park on").park_first().await,
        BatchThen::ParkThenFail => {
            hold.expect("a hold to park on").park_first().await;
            return Err(TestError::Refused);
        }
        BatchThen::Hang => match hang_in_body().await {},
    }
    Ok(jobs.len())
}

/// A batch handler written by hand on `Store::claim_batch`, in scope `apply` (the scope of
/// `handlers::apply`, so that single deliveries and batches see each other's markers).
pub(crate) async fn apply_batch_by_hand<DB: TestDb>(
    store: &Store<DB>,
    jobs: &[Job],
    then: BatchThen,
    hold: Option<&Hold>,
) -> Result<Batch<usize>, TestError> {
    let keys = Key::batch(jobs.iter().map(|j| j.key.as_str())).map_err(idem::Error::from)?;
    let mut claim = store.claim_batch("apply", &keys).await?;
    let fresh: Vec<&Job> = jobs
        .iter()
        .zip(claim.fresh())
        .filter_map(|(job, &fresh)| fresh.then_some(job))
        .collect();
    let result = match claim.tx() {
        Some(tx) => body(tx, &fresh, then, hold).await,
        None => Ok(0),
    };
    claim.finish(result).await
}

/// The effects, then a statement on which the database rolls the whole transaction back,
/// with its error swallowed, and `Ok`: what a careless batch body does.
pub(crate) async fn apply_batch_swallowing<S: Support>(
    store: &Store<S::Db>,
    jobs: &[Job],
    other: &Pool<S::Db>,
    rows: &str,
) -> Result<Batch<usize>, TestError> {
    let keys = Key::batch(jobs.iter().map(|j| j.key.as_str())).map_err(idem::Error::from)?;
    let mut claim = store.claim_batch("apply", &keys).await?;
    let result = match claim.tx() {
        Some(tx) => {
            let r: Result<usize, TestError> = async {
                for job in jobs {
                    insert_effect(tx, job, "batch").await?;
                }
                S::swallow_a_rollback(&mut **tx, other, rows).await;
                Ok(jobs.len())
            }
            .await;
            r
        }
        None => Ok(0),
    };
    claim.finish(result).await
}

/// The same handler with the attribute: `jobs` in the body holds the fresh jobs only.
#[idem::idempotent(key = "job.key", scope = "apply", batch = "jobs")]
pub(crate) async fn apply_batch<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    jobs: &[Job],
    then: BatchThen,
    hold: Option<&Hold>,
) -> Result<usize, TestError> {
    let fresh: Vec<&Job> = jobs.iter().collect();
    body(tx, &fresh, then, hold).await
}

/// [`apply_batch`] that waits at most 500 ms for the keys another delivery holds.
#[idem::idempotent(key = "job.key", scope = "apply", batch = "jobs", wait = "500ms")]
pub(crate) async fn apply_batch_waiting<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    jobs: &[Job],
) -> Result<usize, TestError> {
    let fresh: Vec<&Job> = jobs.iter().collect();
    body(tx, &fresh, BatchThen::Commit, None).await
}
