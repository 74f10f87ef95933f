//! An apalis worker (apalis-postgres) applying top-up jobs exactly once, on PostgreSQL.
//!
//! apalis keeps its jobs in PostgreSQL (`apalis.jobs`) and runs each one at least once: a
//! worker that dies after the job's effect committed but before apalis marked the job `Done`
//! stops heartbeating, and another worker's heartbeat puts the job back to `Pending` once the
//! dead one missed `missed_heartbeats` beats (`Config::orphaned_duration`). The job function
//! here calls an `#[idempotent]` handler whose marker commits with the effect, in the same
//! database, and maps its answer onto apalis's:
//!
//! - `Applied`, `Duplicate`, `Replayed`: `Ok` — apalis records the job `Done`;
//! - `KeyReused`: `AbortError` — apalis records it `Killed` and never retries it;
//! - any other error (`InProgress`, a database error, a rollback): a plain error — apalis
//!   records it `Failed` and fetches it again while `attempts < max_attempts`.
//!
//! The producer sets apalis's `idempotency_key` to the job's id: a retried push of the same
//! job is refused by the database at insert time. That is producer-side only; a job re-run by
//! apalis is the same row run again, which only the handler's claim recognises.
//!
//! ```text
//! cargo run -p idem-example-jobs --example apalis_worker
//! ```
//! The database is `IDEM_POSTGRES_URL` (the variable the tests read), else the local server
//! `postgres://postgres@127.0.0.1:5432/test`.
//! Not `DATABASE_URL`: set while building, it makes apalis-postgres's compile-time query
//! macros check against that database instead of their bundled data, and fail unless
//! apalis's schema is already there (build with `SQLX_OFFLINE=true` then).
//!
//! The parts both job-framework examples share (the database URL and pool, the `TopUp` job,
//! `JobError`, the `PAUSE_AFTER_COMMIT` hook) are in this package's library,
//! `examples/jobs/src/lib.rs`.

use std::future::Future;
use std::io::Write;
use std::time::Duration;

use apalis::prelude::{
    AbortError, Attempt, BoxDynError, Data, TaskBuilder, TaskSink, WorkerBuilder, WorkerError,
};
use apalis_postgres::{Config, PostgresStorage};
use idem::Store;
use idem_example_jobs::{
    JobError, TopUp, connect, database_url, effects, insert_top_up, outcome_word,
    pause_after_commit, top_ups,
};
use sqlx::{PgPool, Postgres, Transaction};

/// The table of the effect: one row per application, committed with the marker.
pub const TOP_UPS: &str = "apalis_top_ups";

/// The handler: `apalis.top_up` is its scope in idem's marker table.
#[idem::idempotent(key = "job.id", scope = "apalis.top_up", wait = "5s")]
pub async fn apply_top_up(tx: &mut Transaction<'_, Postgres>, job: &TopUp) -> Result<(), JobError> {
    insert_top_up(tx, TOP_UPS, job).await?;
    Ok(())
}

/// Creates the effect table and idem's marker table (apalis's own tables: [`setup`]).
pub async fn create_tables(pool: &PgPool) -> Result<(), idem::Error> {
    idem_example_jobs::create_tables(pool, TOP_UPS).await
}

/// apalis's migrations: the `apalis` schema (`jobs`, `workers`, its functions).
pub async fn setup(pool: &PgPool) -> Result<(), apalis_postgres::Error> {
    PostgresStorage::setup(pool).await
}

/// The apalis job function. Its `Ok` value is what apalis stores in `last_result`.
pub async fn top_up(
    job: TopUp,
    store: Data<Store<Postgres>>,
    attempt: Attempt,
) -> Result<String, BoxDynError> {
    let attempt = attempt.current();
    match apply_top_up(&*store, &job).await {
        Ok(outcome) => {
            let outcome = outcome_word(&outcome);
            println!("{outcome} {} attempt={attempt}", job.id);
            pause_after_commit(outcome, &job.id).await;
            Ok(outcome.to_owned())
        }
        // The same key with another payload: no re-run can fix it.
        Err(e @ JobError::Idem(idem::Error::KeyReused { .. })) => {
            println!("killed {} attempt={attempt}: {e}", job.id);
            Err(AbortError::new(e).into())
        }
        // Nothing was kept; apalis fetches the job again (`Failed`, `attempts < max_attempts`).
        Err(e) => {
            println!("failed {} attempt={attempt}: {e}", job.id);
            Err(e.into())
        }
    }
}

/// The storage of `queue` (apalis's `job_type`), with its liveness settings: a worker that
/// misses `missed` heartbeats of `heartbeat` has its jobs put back to `Pending` by any other
/// worker of the queue.
pub fn storage(
    pool: &PgPool,
    queue: &str,
    heartbeat: Duration,
    missed: usize,
) -> PostgresStorage<TopUp> {
    let config = Config::default()
        .queue(queue)
        .heartbeat_interval(heartbeat)
        .missed_heartbeats(missed);
    PostgresStorage::new(pool).with_config(config)
}

/// Runs one apalis worker named `name` (unique among the queue's live workers) until `stop`
/// resolves.
pub async fn work(
    storage: PostgresStorage<TopUp>,
    store: Store<Postgres>,
    name: String,
    stop: impl Future<Output = ()> + Send + 'static,
) -> Result<(), WorkerError> {
    WorkerBuilder::new(name.as_str())
        .backend(storage)
        .data(store)
        .build(top_up)
        .run_until(async move {
            stop.await;
            Ok::<(), std::io::Error>(())
        })
        .await
}

/// Pushes `job` with apalis's `idempotency_key` set to its id. `Ok(false)`: a job with that
/// key is already in the queue (the unique index on `(job_type, idempotency_key)` refused the
/// insert), so this push was a retry.
pub async fn push(storage: &mut PostgresStorage<TopUp>, job: &TopUp) -> Result<bool, BoxDynError> {
    let task = TaskBuilder::new(job.clone())
        .idempotency_key(&job.id)
        .build();
    match storage.push_task(task).await {
        Ok(()) => Ok(true),
        Err(apalis::prelude::TaskSinkError::PushError(apalis_postgres::Error::Database(
            sqlx::Error::Database(e),
        ))) if e.constraint() == Some("idx_jobs_idempotency_key") => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// What [`run`] found at the end.
#[derive(Debug, PartialEq, Eq)]
pub struct Report {
    /// Pushes the database refused as repeats of a queued job's `idempotency_key`.
    pub refused: usize,
    /// `(status, last_result)` of each of the run's apalis jobs, by job id.
    pub jobs: Vec<(String, String, String)>,
    /// Rows in `apalis_top_ups` per job id of the run.
    pub effects: Vec<(String, i64)>,
}

/// Pushes five jobs twice (the second push is a producer's retry, refused at insert), then
/// job 3 once more without a key (a producer that does not set it: a second apalis job with
/// the same id), and runs one worker until apalis has recorded all six jobs `Done`.
pub async fn run(url: &str, out: &mut impl Write) -> Result<Report, BoxDynError> {
    let pool = connect(url, 4).await?;
    setup(&pool).await?;
    create_tables(&pool).await?;
    let run = format!(
        "{}-{}",
        std::process::id(),
        std::time::UNIX_EPOCH.elapsed()?.as_millis()
    );
    let queue = format!("idem-example-top-ups-{run}");
    let mut storage = storage(&pool, &queue, Duration::from_secs(1), 3);
    let jobs = top_ups(&run);
    let mut refused = 0;
    for job in jobs.iter().chain(&jobs) {
        if !push(&mut storage, job).await? {
            refused += 1;
            writeln!(out, "push of {} refused: already queued", job.id)?;
        }
    }
    storage.push(jobs[2].clone()).await?;
    writeln!(out, "pushed {} jobs to {queue}", jobs.len() + 1)?;

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let worker = tokio::spawn(work(
        storage,
        Store::new(pool.clone()),
        format!("example-worker-{run}"),
        async move {
            drop(stop_rx.await);
        },
    ));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut ticks = tokio::time::interval(Duration::from_millis(100));
    loop {
        ticks.tick().await;
        let done: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM apalis.jobs WHERE job_type = $1 AND status = 'Done'",
        )
        .bind(&queue)
        .fetch_one(&pool)
        .await?;
        if done == 6 {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!("only {done} of 6 jobs done after 60 s").into());
        }
    }
    // Err only if the worker already ended; its result says why.
    let _ = stop_tx.send(());
    worker.await??;

    let jobs: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT convert_from(job, 'UTF8')::json->>'id', status, last_result::text \
         FROM apalis.jobs WHERE job_type = $1 ORDER BY 1, 3",
    )
    .bind(&queue)
    .fetch_all(&pool)
    .await?;
    let effects = effects(&pool, TOP_UPS, &run).await?;
    for (id, status, result) in &jobs {
        writeln!(out, "apalis job {id}: {status}, {result}")?;
    }
    for (id, rows) in &effects {
        writeln!(out, "{id}: applied {rows} time(s)")?;
    }
    pool.close().await;
    Ok(Report {
        refused,
        jobs,
        effects,
    })
}

#[allow(dead_code)]
#[tokio::main]
async fn main() -> Result<(), BoxDynError> {
    run(&database_url(), &mut std::io::stdout())
        .await
        .map(|_| ())
}
