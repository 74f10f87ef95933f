//! Batch handlers run job by job: each job behind a savepoint of its own, written by hand on
//! `BatchGuard::each` and with the attribute's `each`. Both run the same body: the job's
//! effect row, then, for a poisoned job, a statement that fails (a duplicate primary key in
//! `poison`), whose error the body returns, or swallows.

use idem::{Each, Key, Store};
use sqlx::{Pool, Transaction};

use super::Support;
use super::db::{Bind, TestDb};
use super::handlers::{Job, TestError, insert_effect};

/// Which jobs (by id) fail, and how.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Poison<'a> {
    /// The table `(id BIGINT PRIMARY KEY)` holding id 0, which a poisoned job inserts again.
    pub(crate) table: &'a str,
    /// The ids of the jobs that fail.
    pub(crate) ids: &'a [i64],
    /// The failing statement's error is swallowed and the body returns `Ok`.
    pub(crate) swallow: bool,
}

impl Poison<'_> {
    pub(crate) fn none() -> Poison<'static> {
        Poison {
            table: "",
            ids: &[],
            swallow: false,
        }
    }
}

async fn body<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
    poison: Poison<'_>,
) -> Result<i64, TestError> {
    insert_effect(tx, job, "each").await?;
    if poison.ids.contains(&job.id) {
        let sql = format!("INSERT INTO {} (id) VALUES ($1)", poison.table);
        let failed = DB::execute(&mut **tx, &sql, &[Bind::I64(0)]).await;
        let err = failed.expect_err("id 0 is there already");
        if !poison.swallow {
            return Err(TestError::Db(err));
        }
    }
    Ok(job.amount)
}

/// The attribute's handler: the caller passes the batch, the body gets one job.
#[idem::idempotent(key = "job.key", scope = "apply", each = "job")]
pub(crate) async fn apply_each<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
    poison: Poison<'_>,
) -> Result<i64, TestError> {
    body(tx, job, poison).await
}

/// The same handler written by hand on `claim_batch(..).each()`.
pub(crate) async fn apply_each_by_hand<DB: TestDb>(
    store: &Store<DB>,
    jobs: &[Job],
    poison: Poison<'_>,
) -> Result<Each<i64, TestError>, TestError> {
    let keys = Key::batch(jobs.iter().map(|j| j.key.as_str())).map_err(idem::Error::from)?;
    let mut batch = store.claim_batch("apply", &keys).await?.each();
    for (position, job) in jobs.iter().enumerate() {
        let Some(mut step) = batch.job(position).await? else {
            continue;
        };
        let result = body(step.tx(), job, poison).await;
        step.finish(result).await?;
    }
    batch.finish().await
}

/// By hand, every job sending one message to `shipping` before its body; the jobs of
/// `poison` then fail.
pub(crate) async fn apply_each_sending<DB: TestDb>(
    store: &Store<DB>,
    jobs: &[Job],
    poison: Poison<'_>,
) -> Result<Each<i64, TestError>, TestError> {
    let keys = Key::batch(jobs.iter().map(|j| j.key.as_str())).map_err(idem::Error::from)?;
    let mut batch = store.claim_batch("apply", &keys).await?.each();
    for (position, job) in jobs.iter().enumerate() {
        let Some(mut step) = batch.job(position).await? else {
            continue;
        };
        step.outbox().send("shipping", &job.id)?;
        let result = body(step.tx(), job, poison).await;
        step.finish(result).await?;
    }
    batch.finish().await
}

/// By hand: the job at `drop_at` is taken and its guard dropped after its effect, as a body
/// that panicked (and was caught) or was cancelled leaves it.
pub(crate) async fn apply_each_dropping<DB: TestDb>(
    store: &Store<DB>,
    jobs: &[Job],
    drop_at: usize,
) -> Result<Each<i64, TestError>, TestError> {
    let keys = Key::batch(jobs.iter().map(|j| j.key.as_str())).map_err(idem::Error::from)?;
    let mut batch = store.claim_batch("apply", &keys).await?.each();
    for (position, job) in jobs.iter().enumerate() {
        let Some(mut step) = batch.job(position).await? else {
            continue;
        };
        let result = body(step.tx(), job, Poison::none()).await;
        if position == drop_at {
            drop(step);
            continue;
        }
        step.finish(result).await?;
    }
    batch.finish().await
}

/// By hand: the job of id `swallower` makes the database roll back (as `Support` says how)
/// and swallows the error.
pub(crate) async fn apply_each_swallowing<S: Support>(
    store: &Store<S::Db>,
    jobs: &[Job],
    swallower: i64,
    other: &Pool<S::Db>,
    rows: &str,
) -> Result<Each<i64, TestError>, TestError> {
    let keys = Key::batch(jobs.iter().map(|j| j.key.as_str())).map_err(idem::Error::from)?;
    let mut batch = store.claim_batch("apply", &keys).await?.each();
    for (position, job) in jobs.iter().enumerate() {
        let Some(mut step) = batch.job(position).await? else {
            continue;
        };
        insert_effect(step.tx(), job, "each").await?;
        if job.id == swallower {
            S::swallow_a_rollback(&mut **step.tx(), other, rows).await;
        }
        step.finish(Ok(job.amount)).await?;
    }
    batch.finish().await
}
