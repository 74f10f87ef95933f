//! Failover to a synchronous standby keeps every job reported `Applied`: a primary whose
//! `synchronous_standby_names` names its streaming standby is killed (SIGKILL) while workers
//! claim jobs on it; the standby is promoted, and every job a worker saw `Applied` has its
//! marker and its effect there, once. The jobs whose call failed when the primary died are
//! delivered again on the promoted server: each then runs once or is a duplicate.
//!
//! The same run with asynchronous replication measures what is lost (printed, not asserted:
//! it depends on the replication lag at the kill); what survives is still whole, each effect
//! with its marker.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem::{Outcome, Store};
use idem_scale::jobs::{self, Job};
use idem_scale::standby::Pair;
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, PgPool};
use tokio::sync::watch;

/// Workers claiming jobs at once, and how many `Applied` before the primary is killed.
const WORKERS: usize = 8;
const APPLIED_BEFORE_KILL: usize = 200;

async fn pool(url: &str, max: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(10))
        .connect(url)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_applied_job_survives_failover_to_a_synchronous_standby() {
    let lost = failover(true).await;
    assert_eq!(
        lost, 0,
        "Applied jobs missing on the promoted synchronous standby"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failover_to_an_asynchronous_standby_can_lose_applied_jobs() {
    // Measured, not asserted: 0 on a quiet loopback is as possible as a few.
    let lost = failover(false).await;
    eprintln!("asynchronous failover: {lost} Applied jobs lost");
}

/// Runs jobs on the primary, kills it after [`APPLIED_BEFORE_KILL`] of them were Applied,
/// promotes the standby and returns how many Applied jobs are missing there; panics if a job
/// is there by half (an effect without its marker or the reverse) or twice.
async fn failover(synchronous: bool) -> usize {
    let pair = Pair::start(synchronous).await;
    let primary = pool(&Pair::url(pair.primary_port), WORKERS as u32 + 1).await;
    pair.wait_for_standby(&primary, if synchronous { "sync" } else { "async" })
        .await;
    let markers = jobs::unique("scale_failover");
    let effects = jobs::unique("scale_failover_effects");
    let store = Store::new(primary.clone())
        .with_table(&markers)
        .expect("a name");
    store.migrate().await.expect("migrate");
    jobs::create_effects(&primary, &effects).await;

    // Each worker claims its own jobs one after the other until a call fails (the primary
    // died under it), noting every job it saw Applied.
    let applied = Arc::new(Mutex::new(Vec::<Job>::new()));
    let (count, mut counted) = watch::channel(0usize);
    let mut workers = Vec::new();
    for w in 0..WORKERS {
        let (store, applied, count, effects) = (
            store.clone(),
            applied.clone(),
            count.clone(),
            effects.clone(),
        );
        workers.push(tokio::spawn(async move {
            for i in 0.. {
                let job = Job {
                    key: format!("w{w}-job-{i}"),
                    amount: i,
                    effects: effects.clone(),
                };
                match jobs::in_transaction(&store, &job).await {
                    Ok(Outcome::Applied(_)) => {
                        let mut applied = applied.lock().expect("applied");
                        applied.push(job);
                        count.send_replace(applied.len());
                    }
                    Ok(other) => panic!("{}: a fresh key answered {other:?}", job.key),
                    // The primary is gone: this job's fate is unknown to the worker.
                    Err(_) => return job,
                }
            }
            unreachable!("a worker ends at its first failed call")
        }));
    }
    counted
        .wait_for(|n| *n >= APPLIED_BEFORE_KILL)
        .await
        .expect("the workers run");
    pair.kill_primary();
    let mut cut_off = Vec::new();
    for worker in workers {
        cut_off.push(worker.await.expect("a worker panicked"));
    }
    drop(primary);
    pair.promote();

    let promoted = pool(&Pair::url(pair.standby_port), WORKERS as u32).await;
    let applied = applied.lock().expect("applied").clone();
    let keys: Vec<&str> = applied.iter().map(|j| j.key.as_str()).collect();
    // Per Applied job: its effects and its markers on the promoted server.
    let found: Vec<(i64, i64)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT (SELECT COUNT(*) FROM {effects} e WHERE e.key = k), \
         (SELECT COUNT(*) FROM {markers} m WHERE m.key = k) FROM unnest($1::text[]) AS u(k)"
    )))
    .bind(&keys)
    .fetch_all(&promoted)
    .await
    .expect("count on the promoted server");
    for (job, &(effects_of, markers_of)) in applied.iter().zip(&found) {
        assert_eq!(
            effects_of, markers_of,
            "{}: its effect and its marker, together or neither",
            job.key
        );
        assert!(effects_of <= 1, "{}: {effects_of} effects", job.key);
    }
    let lost = found.iter().filter(|&&(e, _)| e == 0).count();
    eprintln!(
        "failover ({}): {} jobs Applied before the primary died, {} cut off; {lost} of the \
         Applied ones missing on the promoted standby",
        if synchronous {
            "synchronous"
        } else {
            "asynchronous"
        },
        applied.len(),
        cut_off.len()
    );

    // The cut-off jobs, delivered again on the promoted server: once each, whatever the
    // primary did with them.
    let store = Store::new(promoted.clone())
        .with_table(&markers)
        .expect("a name");
    for job in &cut_off {
        match jobs::in_transaction(&store, job).await {
            Ok(Outcome::Applied(_) | Outcome::Duplicate) => {}
            other => panic!("{} on the promoted server: {other:?}", job.key),
        }
    }
    let (keys, doubled) = jobs::counts(&promoted, &effects).await;
    assert_eq!(
        (keys, doubled),
        ((applied.len() - lost + cut_off.len()) as i64, 0),
        "(keys with an effect, keys with more than one) after the redelivery"
    );
    drop(promoted);
    drop(pair);
    lost
}
