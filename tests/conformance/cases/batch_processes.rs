//! Batches across processes: a worker killed while its batch is in the body, and 10,000 jobs
//! delivered in overlapping batches of 100 by four processes.

use std::sync::Arc;

use idem::Outcome;

use crate::conformance::Support;
use crate::conformance::batch_handlers::*;
use crate::conformance::ctx::Ctx;
use crate::conformance::handlers::many_jobs;
use crate::conformance::util::{SplitMix, within};
use crate::conformance::worker::{self, Worker, child_env};

/// Jobs of the batch the killed worker hangs in (`job-0` to `job-9`).
const KILLED_BATCH: i64 = 10;
/// Jobs in batches of [`BATCH`], each process delivering every job once.
const MANY: i64 = 10_000;
const BATCH: usize = 100;
const PROCESSES: u64 = 4;

pub(crate) async fn worker_killed_inside_a_batch_keeps_nothing<S: Support>() {
    let ctx = Ctx::<S>::new("bkill", 2).await;
    let mut w = Worker::spawn(
        "batch_hang",
        &[
            (worker::CHILD_MODE, "batch_hang".to_owned()),
            (worker::CHILD_URL, ctx.url.clone()),
            (worker::CHILD_MARKERS, ctx.store.table().to_owned()),
            (worker::CHILD_EFFECTS, ctx.effects.clone()),
        ],
    );
    w.expect_line("IN_BODY").await;
    assert_eq!(
        w.kill().await.code(),
        None,
        "killed by the signal, not exited"
    );
    assert_eq!(ctx.markers().await, 0, "a killed batch's markers survived");
    assert_eq!(
        ctx.effects_total().await,
        0,
        "a killed batch's effects survived"
    );
    let jobs = many_jobs(KILLED_BATCH, &ctx.effects);
    let next = apply_batch(&ctx.store, &jobs, BatchThen::Commit, None);
    let next = within(120, "the batch after a killed worker", next)
        .await
        .expect("the redelivery commits");
    assert_eq!(
        next.outcomes(),
        vec![Outcome::Applied(()); KILLED_BATCH as usize]
    );
    let again = apply_batch(&ctx.store, &jobs, BatchThen::Commit, None)
        .await
        .expect("all duplicates");
    assert_eq!(
        again.outcomes(),
        vec![Outcome::Duplicate; KILLED_BATCH as usize]
    );
    for id in 0..KILLED_BATCH {
        assert_eq!(ctx.effects(id).await, 1, "job {id}");
    }
    ctx.cleanup().await;
}

pub(crate) async fn four_processes_in_overlapping_batches_apply_every_job_once<S: Support>() {
    let ctx = Ctx::<S>::new("bprocs", 2).await;
    let seed = crate::conformance::util::seed();
    println!("seed {seed} (IDEM_CONFORMANCE_SEED={seed} repeats this order)");
    let mut workers: Vec<Worker> = (0..PROCESSES)
        .map(|p| {
            Worker::spawn(
                &format!("batch{p}"),
                &[
                    (worker::CHILD_MODE, "batch_work".to_owned()),
                    (worker::CHILD_URL, ctx.url.clone()),
                    (worker::CHILD_MARKERS, ctx.store.table().to_owned()),
                    (worker::CHILD_EFFECTS, ctx.effects.clone()),
                    (worker::CHILD_SEED, seed.wrapping_add(p).to_string()),
                ],
            )
        })
        .collect();
    worker::start_together(&mut workers).await;
    let (applied_n, duplicate_n) = worker::applied_and_duplicates(workers).await;
    assert_eq!(
        applied_n, MANY,
        "seed {seed}: Applied outcomes over all workers"
    );
    assert_eq!(
        duplicate_n,
        MANY * (PROCESSES as i64 - 1),
        "seed {seed}: Duplicates"
    );
    assert_eq!(ctx.effects_total().await, MANY, "seed {seed}: effect rows");
    let once = ctx
        .scalar(&format!(
            "SELECT COUNT(*) FROM (SELECT id FROM {} GROUP BY id HAVING COUNT(*) = 1) o",
            ctx.effects
        ))
        .await;
    assert_eq!(once, MANY, "seed {seed}: jobs with exactly one effect row");
    assert_eq!(ctx.markers().await, MANY, "seed {seed}: markers");
    ctx.cleanup().await;
}

/// The worker process's side of the batch cases (`IDEM_CONFORMANCE_CHILD` = `batch_hang` or
/// `batch_work`).
pub(crate) async fn batch_child<S: Support>(mode: &str, url: &str, markers: &str, effects: &str) {
    let tasks = 2;
    let pool = S::connect(url, tasks).await;
    let store = idem::Store::new(pool)
        .with_table(markers)
        .expect("table name");
    match mode {
        "batch_hang" => {
            let jobs = many_jobs(KILLED_BATCH, effects);
            let r = apply_batch(&store, &jobs, BatchThen::Hang, None).await;
            panic!("the handler returned {r:?}; it should have hung in its body");
        }
        "batch_work" => {
            let seed: u64 = child_env(worker::CHILD_SEED).parse().expect("seed");
            // Every process delivers every job once, in its own order, cut into batches of
            // 100: batches of different processes overlap on many keys, in any order.
            let mut jobs = many_jobs(MANY, effects);
            SplitMix::new(seed).shuffle(&mut jobs);
            let mut batches: Vec<Vec<_>> = jobs.chunks(BATCH).map(<[_]>::to_vec).collect();
            batches.reverse(); // popped from the end
            let queue = Arc::new(std::sync::Mutex::new(batches));
            worker::ready_then_go().await;
            let runners: Vec<_> = (0..tasks)
                .map(|_| {
                    let (store, queue) = (store.clone(), queue.clone());
                    tokio::spawn(async move {
                        let (mut a, mut d) = (0_i64, 0_i64);
                        loop {
                            let next = queue.lock().expect("queue").pop();
                            let Some(batch) = next else { break (a, d) };
                            let done = apply_batch(&store, &batch, BatchThen::Commit, None)
                                .await
                                .unwrap_or_else(|e| panic!("a batch failed: {e:?}"));
                            let applied = done.applied() as i64;
                            assert_eq!(done.value().copied().unwrap_or(0) as i64, applied);
                            a += applied;
                            d += done.outcomes().len() as i64 - applied;
                        }
                    })
                })
                .collect();
            let (mut a, mut d) = (0, 0);
            for r in runners {
                let (ra, rd) = r.await.expect("worker task");
                a += ra;
                d += rd;
            }
            println!("DONE applied={a} duplicate={d}");
        }
        other => panic!("unknown batch mode {other:?}"),
    }
}
