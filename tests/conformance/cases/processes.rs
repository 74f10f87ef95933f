//! Worker processes: several of them sharing the jobs, and one killed in a body.

use std::sync::Arc;
use std::time::Duration;

use idem::{Outcome, Store};

use crate::conformance::Support;
use crate::conformance::ctx::Ctx;
use crate::conformance::handlers::*;
use crate::conformance::util::within;

use crate::conformance::worker::{self, KILLED_JOB, Worker};

pub(crate) async fn four_processes_apply_every_job_exactly_once<S: Support>() {
    const PROCESSES: u64 = 4;
    const JOBS: i64 = 2000;
    let ctx = Ctx::<S>::new("procs", 2).await;
    let seed = crate::conformance::util::seed();
    println!("seed {seed} (IDEM_CONFORMANCE_SEED={seed} repeats this order)");
    let mut workers: Vec<Worker> = (0..PROCESSES)
        .map(|p| {
            Worker::spawn(
                &format!("{p}"),
                &[
                    (worker::CHILD_MODE, "work".to_owned()),
                    (worker::CHILD_URL, ctx.url.clone()),
                    (worker::CHILD_MARKERS, ctx.store.table().to_owned()),
                    (worker::CHILD_EFFECTS, ctx.effects.clone()),
                    (worker::CHILD_SEED, seed.wrapping_add(p).to_string()),
                    (worker::CHILD_JOBS, JOBS.to_string()),
                    (worker::CHILD_TASKS, "2".to_owned()),
                ],
            )
        })
        .collect();
    worker::start_together(&mut workers).await;
    let (applied_n, duplicate_n) = worker::applied_and_duplicates(workers).await;
    let jobs = many_jobs(JOBS, &ctx.effects);
    let want_sum: i64 = jobs.iter().map(|j| j.amount).sum();
    assert_eq!(
        applied_n, JOBS,
        "seed {seed}: Applied outcomes over all workers"
    );
    assert_eq!(
        duplicate_n,
        JOBS * (PROCESSES as i64 - 1),
        "seed {seed}: Duplicates"
    );
    assert_eq!(ctx.effects_total().await, JOBS, "seed {seed}: effect rows");
    let big = S::BIGINT;
    let sum = ctx
        .scalar(&format!(
            "SELECT CAST(SUM(amount) AS {big}) FROM {}",
            ctx.effects
        ))
        .await;
    assert_eq!(sum, want_sum, "seed {seed}: SUM(amount)");
    let off = ctx
        .scalar(&format!(
            "SELECT COUNT(*) FROM (SELECT id FROM {} GROUP BY id HAVING COUNT(*) <> 1) x",
            ctx.effects
        ))
        .await;
    assert_eq!(
        off, 0,
        "seed {seed}: jobs whose effect did not happen exactly once"
    );
    let distinct = ctx
        .scalar(&format!("SELECT COUNT(DISTINCT id) FROM {}", ctx.effects))
        .await;
    assert_eq!(distinct, JOBS, "seed {seed}: jobs with an effect");
    assert_eq!(ctx.markers().await, JOBS, "seed {seed}: markers");
    ctx.cleanup().await;
}

pub(crate) async fn worker_killed_inside_the_body_keeps_nothing<S: Support>() {
    let ctx = Ctx::<S>::new("sigkill", 2).await;
    let (id, amount) = KILLED_JOB;
    let job = ctx.job("job-killed", id, amount);
    let mut w = Worker::spawn(
        "hang",
        &[
            (worker::CHILD_MODE, "hang".to_owned()),
            (worker::CHILD_URL, ctx.url.clone()),
            (worker::CHILD_MARKERS, ctx.store.table().to_owned()),
            (worker::CHILD_EFFECTS, ctx.effects.clone()),
            (worker::CHILD_KEY, job.key.clone()),
        ],
    );
    w.expect_line("IN_BODY").await;
    let status = w.kill().await;
    {
        use ::std::os::unix::process::ExitStatusExt as _;
        assert_eq!(status.signal(), Some(9), "worker status {status:?}");
    }
    assert_eq!(ctx.markers().await, 0, "a killed worker's marker survived");
    assert_eq!(
        ctx.effects_total().await,
        0,
        "a killed worker's effect survived"
    );
    let next = apply(&ctx.store, &job, Then::Commit);
    let next = within(120, "delivery after a killed worker", next).await;
    assert_eq!(applied(next), amount);
    duplicate(apply(&ctx.store, &job, Then::Commit).await);
    assert_eq!(ctx.effects(id).await, 1);
    assert_eq!(ctx.markers().await, 1);
    ctx.cleanup().await;
}
