//! The `graphile_worker` example on the real PostgreSQL, with worker processes SIGKILLed at a
//! chosen point. Each test has a database of its own, with graphile_worker's migrations,
//! idem's markers and the effect table `graphile_top_ups` (no unique index, so an effect
//! applied twice shows as two rows).

#[allow(dead_code)]
#[path = "../graphile_worker.rs"]
mod graphile_worker;

#[path = "../../tests/support/mod.rs"]
mod support;

mod common;
mod db;

use std::time::{Duration, Instant};

use ::graphile_worker::WorkerUtils;
use common::{
    assert_child_process, assert_each_applied_once, child_vars, example_report, job, poll_until,
    rerun_outcome, stop_cleanly,
};
use db::{CHILD_DB, TestDb};
use graphile_worker::Recovery;
use sqlx::PgPool;
use support::{Lines, Worker, child_env, stop_signal, within};

const SCHEMA: &str = "graphile_worker";

/// Short, so that a killed worker's job is unlocked within seconds.
const RECOVERY: Recovery = Recovery {
    heartbeat: Duration::from_millis(500),
    sweep: Duration::from_millis(500),
    threshold: Duration::from_secs(2),
};

/// (attempts, locked_by, last_error) of every job in graphile_worker's table.
async fn graphile_jobs(pool: &PgPool) -> Vec<(i16, Option<String>, Option<String>)> {
    sqlx::query_as(
        "SELECT attempts, locked_by, last_error FROM graphile_worker._private_jobs ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// (rows in `graphile_top_ups`, idem markers of the handler's scope).
async fn counts(pool: &PgPool) -> (i64, i64) {
    db::counts(pool, graphile_worker::TOP_UPS, "graphile.top_up").await
}

/// The worker process: one graphile_worker worker of the example on the test's database,
/// until the parent writes `STOP`. With `IDEM_EXAMPLE_PAUSE_AFTER_COMMIT` set its task prints
/// `COMMITTED id` after the commit and waits to be killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a worker process that the tests start themselves"]
async fn child_process() {
    assert_child_process();
    let pool = db::pool(&child_env(CHILD_DB), 6).await;
    let worker = graphile_worker::worker(&pool, SCHEMA, 2, RECOVERY, stop_signal())
        .await
        .unwrap();
    println!("READY {}", worker.worker_id());
    worker.run().await.unwrap();
    pool.close().await;
    println!("STOPPED");
}

#[tokio::test(flavor = "multi_thread")]
async fn example_applies_each_job_once() {
    let db = TestDb::create("graphile_example").await;
    let mut out = Vec::new();
    let report = within(
        90,
        "the graphile_worker example",
        graphile_worker::run(&db.url(), &mut out),
    )
    .await;
    let (report, text) = example_report(report, out);
    // The five keyed re-adds replaced the waiting jobs; the unkeyed add of job 3 is a sixth
    // job, whose run was a duplicate.
    assert_eq!(report.queued, 6, "{text}");
    assert_each_applied_once(&report.effects, &text);
}

/// A worker SIGKILLed after idem's commit and before graphile_worker completed the job: its
/// heartbeat stops, a second worker process's sweep unlocks the job, and the re-run is a
/// `Duplicate` that graphile_worker completes (deletes). One row in `graphile_top_ups`.
#[tokio::test(flavor = "multi_thread")]
async fn killed_between_commit_and_completion_the_rerun_is_a_duplicate() {
    let db = TestDb::create("graphile_commit_done").await;
    let pool = db.pool(2).await;
    graphile_worker::setup(&pool, SCHEMA).await.unwrap();
    graphile_worker::create_tables(&pool).await.unwrap();
    let utils = WorkerUtils::new(pool.clone(), SCHEMA);
    graphile_worker::add(&utils, &job(1)).await.unwrap();

    let mut lines = Lines::new();
    let first = Worker::spawn(0, "work", &child_vars(&db, true), lines.tx.clone());
    let (_, ready) = lines.expect("READY", 60).await;
    let first_id = ready.trim_start_matches("READY ").to_owned();
    lines.expect("COMMITTED top-up-1", 60).await;
    // Committed, and the job is still locked by the first worker.
    assert_eq!(counts(&pool).await, (1, 1));
    assert_eq!(
        graphile_jobs(&pool).await,
        [(1, Some(first_id.clone()), None)],
        "{}",
        lines.dump()
    );
    assert!(!first.kill().await.success());
    let killed = Instant::now();

    let second = Worker::spawn(1, "work", &child_vars(&db, false), lines.tx.clone());
    // The first outcome the second worker reports. Nothing holds the key any more (the first
    // transaction committed), so it cannot be `InProgress`.
    let outcome = rerun_outcome(&mut lines, " top-up-1 attempts=").await;
    let rerun = killed.elapsed();
    assert_eq!(
        outcome,
        "duplicate top-up-1 attempts=1 last_error=Job recovered after worker interruption",
        "{}",
        lines.dump()
    );

    // graphile_worker deletes a completed job after the task returned: poll for it, bounded.
    let left = poll_until(|| graphile_jobs(&pool), Vec::is_empty).await;
    assert_eq!(left, [], "{}", lines.dump());
    assert_eq!(counts(&pool).await, (1, 1), "{}", lines.dump());
    println!(
        "graphile_worker: re-run {:.1} s after the SIGKILL (sweep threshold {:?})",
        rerun.as_secs_f64(),
        RECOVERY.threshold
    );

    stop_cleanly(second, &mut lines).await;
    pool.close().await;
}
