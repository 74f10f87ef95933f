//! `--outbox`'s batch rows: a batch handler of `BATCH` jobs without an outbox, and with one
//! message a job (`BatchOutbox`), at the same workers as the single-job rows.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem::{BatchOutbox, Store};
use sqlx::{AssertSqlSafe, Postgres, Transaction};

use super::{ACCOUNTS, Names, WORKERS};
use crate::Res;

/// Jobs a batch.
pub(super) const BATCH: u64 = 100;

#[derive(Clone)]
struct Job {
    id: u64,
    account: i64,
}

/// The batch's effects, in the order of their accounts: overlapping batches then lock their
/// rows in one order and never deadlock.
async fn effects(
    tx: &mut Transaction<'_, Postgres>,
    accounts: &str,
    jobs: &[Job],
) -> Result<(), sqlx::Error> {
    let mut ids: Vec<i64> = jobs.iter().map(|job| job.account).collect();
    ids.sort_unstable();
    let sql = format!("UPDATE {accounts} SET credits = credits + 1 WHERE id = $1");
    for id in ids {
        sqlx::query(AssertSqlSafe(sql.as_str()))
            .bind(id)
            .execute(&mut **tx)
            .await?;
    }
    Ok(())
}

#[idem::idempotent(key = "job.id", scope = "bench.outbox_batch", batch = "jobs")]
async fn top_up_all(
    tx: &mut Transaction<'_, Postgres>,
    jobs: &[Job],
    accounts: &str,
) -> Result<(), idem::Error> {
    effects(tx, accounts, jobs).await?;
    Ok(())
}

#[idem::idempotent(key = "job.id", scope = "bench.outbox_batch", batch = "jobs")]
async fn top_up_all_sending(
    tx: &mut Transaction<'_, Postgres>,
    jobs: &[Job],
    accounts: &str,
    outbox: &mut BatchOutbox,
) -> Result<(), idem::Error> {
    effects(tx, accounts, jobs).await?;
    for job in jobs {
        outbox.send(&job.id, "bench.receipts", &job.account)?;
    }
    Ok(())
}

/// Jobs/s (not batches/s) of batches of `BATCH`, sending one message a job or none; the
/// outbox is then checked (a message for every job, or none) and emptied.
pub(super) async fn run(
    store: &Store<Postgres>,
    names: &Names,
    next: &Arc<AtomicU64>,
    sending: bool,
    run: Duration,
) -> Res<f64> {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..WORKERS {
        let (store, next, accounts) = (store.clone(), next.clone(), names.accounts.clone());
        tasks.push(tokio::spawn(async move {
            let mut done = 0_u64;
            while started.elapsed() < run {
                let first = next.fetch_add(BATCH, Ordering::Relaxed);
                let jobs: Vec<Job> = (first..first + BATCH)
                    .map(|id| Job {
                        id,
                        account: (id as i64) % ACCOUNTS + 1,
                    })
                    .collect();
                let batch = if sending {
                    top_up_all_sending(&store, &jobs, &accounts).await?
                } else {
                    top_up_all(&store, &jobs, &accounts).await?
                };
                assert_eq!(batch.applied(), jobs.len(), "every job was fresh");
                done += BATCH;
            }
            Ok::<u64, idem::Error>(done)
        }));
    }
    super::finish_run(store, names, started, tasks, u64::from(sending)).await
}
