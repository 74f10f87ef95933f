//! The handler rows' jobs: a top-up of one of [`ACCOUNTS`] accounts, with or without messages,
//! run by [`WORKERS`] workers, and the check that every job's messages were written.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem::{Outbox, Store};
use sqlx::{AssertSqlSafe, Postgres, Transaction};

use super::{ACCOUNTS, Names, WORKERS};
use crate::Res;

/// The job as the handlers take it.
pub(super) struct Job {
    pub(super) id: u64,
    pub(super) account: i64,
}

pub(super) async fn effect(
    tx: &mut Transaction<'_, Postgres>,
    accounts: &str,
    job: &Job,
) -> Result<(), sqlx::Error> {
    let sql = format!("UPDATE {accounts} SET credits = credits + 1 WHERE id = $1");
    sqlx::query(AssertSqlSafe(sql))
        .bind(job.account)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// The baseline: the same handler without an outbox.
#[idem::idempotent(key = "job.id", scope = "bench.outbox")]
pub(super) async fn top_up(
    tx: &mut Transaction<'_, Postgres>,
    job: &Job,
    accounts: &str,
) -> Result<(), idem::Error> {
    effect(tx, accounts, job).await?;
    Ok(())
}

/// The handler sending `messages` messages with its effect.
#[idem::idempotent(key = "job.id", scope = "bench.outbox")]
pub(super) async fn top_up_sending(
    tx: &mut Transaction<'_, Postgres>,
    job: &Job,
    accounts: &str,
    messages: usize,
    outbox: &mut Outbox,
) -> Result<(), idem::Error> {
    effect(tx, accounts, job).await?;
    for n in 0..messages {
        outbox.send("bench.receipts", &(job.account, n))?;
    }
    Ok(())
}

/// Jobs/s of one variant (`None`: no outbox; `Some(n)`: `n` messages a job) over `run`.
pub(super) async fn handler_run(
    store: &Store<Postgres>,
    names: &Names,
    next: &Arc<AtomicU64>,
    messages: Option<usize>,
    run: Duration,
) -> Res<f64> {
    let started = Instant::now();
    let tasks = workers(store, &names.accounts, next, messages, started, run);
    finish_run(store, names, started, tasks, messages.unwrap_or(0) as u64).await
}

/// `WORKERS` workers running jobs until `run` has passed since `started`, each job sending
/// `messages` (none: the handler without an outbox); each answers how many it ran.
pub(super) fn workers(
    store: &Store<Postgres>,
    accounts: &str,
    next: &Arc<AtomicU64>,
    messages: Option<usize>,
    started: Instant,
    run: Duration,
) -> Vec<tokio::task::JoinHandle<Result<u64, idem::Error>>> {
    let mut tasks = Vec::new();
    for _ in 0..WORKERS {
        let (store, next, accounts) = (store.clone(), next.clone(), accounts.to_owned());
        tasks.push(tokio::spawn(async move {
            let mut done = 0_u64;
            while started.elapsed() < run {
                let id = next.fetch_add(1, Ordering::Relaxed);
                let job = Job {
                    id,
                    account: (id as i64) % ACCOUNTS + 1,
                };
                let outcome = match messages {
                    None => top_up(&store, &job, &accounts).await,
                    Some(n) => top_up_sending(&store, &job, &accounts, n).await,
                }?;
                assert!(outcome.is_applied(), "job {id} was fresh");
                done += 1;
            }
            Ok::<u64, idem::Error>(done)
        }));
    }
    tasks
}

pub(super) async fn finish_run(
    store: &Store<Postgres>,
    names: &Names,
    started: Instant,
    tasks: Vec<tokio::task::JoinHandle<Result<u64, idem::Error>>>,
    per_job: u64,
) -> Res<f64> {
    let mut jobs = 0;
    for task in tasks {
        jobs += task.await??;
    }
    let rate = jobs as f64 / started.elapsed().as_secs_f64();
    let outbox = format!("{}_outbox", names.markers);
    let rows: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT COUNT(*) FROM {outbox}")))
        .fetch_one(store.pool())
        .await?;
    if rows as u64 != jobs * per_job {
        return Err(format!("{rows} outbox rows after {jobs} jobs of {per_job} messages").into());
    }
    sqlx::query(AssertSqlSafe(format!("TRUNCATE {outbox}")))
        .execute(store.pool())
        .await?;
    Ok(rate)
}
