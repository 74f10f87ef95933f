//! The `apalis_worker` example against apalis-postgres on the real PostgreSQL, with worker
//! processes SIGKILLed at a chosen point. Each test has a database of its own, with apalis's
//! migrations, idem's markers and the effect table `apalis_top_ups` (no unique index, so an effect
//! applied twice shows as two rows).

#[allow(dead_code)]
#[path = "../apalis_worker.rs"]
mod apalis_worker;

#[path = "../../tests/support/mod.rs"]
mod support;

mod common;
mod db;

use std::time::{Duration, Instant};

use common::{
    assert_child_process, assert_each_applied_once, child_vars, example_report, job, poll_until,
    rerun_outcome, stop_cleanly,
};
use db::{CHILD_DB, TestDb};
use idem::Store;
use sqlx::PgPool;
use support::{Lines, Worker, child_env, stop_signal, within};

const CHILD_QUEUE: &str = "IDEM_APALIS_QUEUE";
const CHILD_NAME: &str = "IDEM_APALIS_WORKER";

/// Short, so that a killed worker's job is re-enqueued within seconds: a worker whose last
/// heartbeat is `HEARTBEAT × MISSED` old is dead to the others (apalis compares whole seconds).
const HEARTBEAT: Duration = Duration::from_secs(1);
const MISSED: usize = 2;

const QUEUE: &str = "top-ups";

/// (status, attempts, last_result, lock_by) of the apalis job whose payload has `id`.
async fn apalis_job(pool: &PgPool, id: &str) -> (String, i32, Option<String>, Option<String>) {
    sqlx::query_as(
        "SELECT status, attempts, last_result::text, lock_by FROM apalis.jobs \
         WHERE convert_from(job, 'UTF8')::json->>'id' = $1",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// (rows in `apalis_top_ups`, idem markers of the handler's scope).
async fn counts(pool: &PgPool) -> (i64, i64) {
    db::counts(pool, apalis_worker::TOP_UPS, "apalis.top_up").await
}

fn env(db: &TestDb, name: &str, pause: bool) -> Vec<(&'static str, String)> {
    let mut env = child_vars(db, pause);
    env.push((CHILD_QUEUE, QUEUE.to_owned()));
    env.push((CHILD_NAME, name.to_owned()));
    env
}

/// The worker process: one apalis worker of the example on the test's database and queue,
/// until the parent writes `STOP`. With `IDEM_EXAMPLE_PAUSE_AFTER_COMMIT` set its job prints
/// `COMMITTED id` after the commit and waits to be killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a worker process that the tests start themselves"]
async fn child_process() {
    assert_child_process();
    let pool = db::pool(&child_env(CHILD_DB), 4).await;
    let storage = apalis_worker::storage(&pool, &child_env(CHILD_QUEUE), HEARTBEAT, MISSED);
    println!("READY");
    apalis_worker::work(
        storage,
        Store::new(pool.clone()),
        child_env(CHILD_NAME),
        stop_signal(),
    )
    .await
    .unwrap();
    pool.close().await;
    println!("STOPPED");
}

#[tokio::test(flavor = "multi_thread")]
async fn example_applies_each_job_once() {
    let db = TestDb::create("apalis_example").await;
    let mut out = Vec::new();
    let report = within(
        90,
        "the apalis_worker example",
        apalis_worker::run(&db.url(), &mut out),
    )
    .await;
    let (report, text) = example_report(report, out);
    // Five retried pushes refused at insert; job 3 pushed a third time without a key ran
    // twice, the second time as a duplicate.
    assert_eq!(report.refused, 5, "{text}");
    let mut results: Vec<(&str, &str)> = report
        .jobs
        .iter()
        .map(|(_, status, result)| (status.as_str(), result.as_str()))
        .collect();
    results.sort();
    assert_eq!(
        results,
        [
            ("Done", r#"{"Ok": "applied"}"#),
            ("Done", r#"{"Ok": "applied"}"#),
            ("Done", r#"{"Ok": "applied"}"#),
            ("Done", r#"{"Ok": "applied"}"#),
            ("Done", r#"{"Ok": "applied"}"#),
            ("Done", r#"{"Ok": "duplicate"}"#),
        ],
        "{text}"
    );
    assert_each_applied_once(&report.effects, &text);
}

/// A worker SIGKILLed after idem's commit and before apalis recorded the job `Done`: its
/// heartbeat stops, a second worker process's heartbeat re-enqueues the job, and the re-run
/// is a `Duplicate` that apalis records `Done`. One row in `apalis_top_ups`.
#[tokio::test(flavor = "multi_thread")]
async fn killed_between_commit_and_done_the_rerun_is_a_duplicate() {
    let db = TestDb::create("apalis_commit_done").await;
    let pool = db.pool(2).await;
    apalis_worker::setup(&pool).await.unwrap();
    apalis_worker::create_tables(&pool).await.unwrap();
    let mut storage = apalis_worker::storage(&pool, QUEUE, HEARTBEAT, MISSED);
    assert!(apalis_worker::push(&mut storage, &job(1)).await.unwrap());

    let mut lines = Lines::new();
    let first = Worker::spawn(0, "work", &env(&db, "worker-0", true), lines.tx.clone());
    lines.expect("COMMITTED top-up-1", 60).await;
    // Committed, and the job is still worker-0's in apalis: `Queued` (fetched) or `Running`
    // (once the worker's lock event reached the database; it is written asynchronously).
    assert_eq!(counts(&pool).await, (1, 1));
    let (status, attempts, _, lock_by) = apalis_job(&pool, "top-up-1").await;
    assert!(
        matches!(status.as_str(), "Queued" | "Running")
            && attempts == 0
            && lock_by.as_deref() == Some("worker-0"),
        "{status} {attempts} {lock_by:?}\n{}",
        lines.dump()
    );
    assert!(!first.kill().await.success());
    let killed = Instant::now();

    let second = Worker::spawn(1, "work", &env(&db, "worker-1", false), lines.tx.clone());
    // The first outcome the second worker reports. Nothing holds the key any more (the first
    // transaction committed), so it cannot be `InProgress`.
    let outcome = rerun_outcome(&mut lines, " top-up-1 attempt=").await;
    let rerun = killed.elapsed();
    assert_eq!(outcome, "duplicate top-up-1 attempt=2", "{}", lines.dump());

    // apalis writes the result after the job function returned: poll for it, bounded.
    let row = poll_until(
        || apalis_job(&pool, "top-up-1"),
        |row| !matches!(row.0.as_str(), "Queued" | "Running"),
    )
    .await;
    assert_eq!(
        (row.0.as_str(), row.1, row.2.as_deref(), row.3.as_deref()),
        ("Done", 2, Some(r#"{"Ok": "duplicate"}"#), Some("worker-1")),
        "{}",
        lines.dump()
    );
    assert_eq!(counts(&pool).await, (1, 1), "{}", lines.dump());
    println!(
        "apalis: re-run {:.1} s after the SIGKILL (heartbeat {HEARTBEAT:?} × {MISSED})",
        rerun.as_secs_f64()
    );

    stop_cleanly(second, &mut lines).await;
    pool.close().await;
}
