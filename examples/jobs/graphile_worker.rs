//! A graphile_worker worker (the Rust port of Graphile Worker) applying top-up jobs exactly
//! once, on PostgreSQL.
//!
//! graphile_worker keeps its jobs in a schema of their own (`graphile_worker` unless told
//! otherwise), locks a job to one worker while it runs and deletes it when the task returned
//! `Ok`. A worker that dies in between leaves the job locked; with dead-worker recovery on, the
//! other workers heartbeat and sweep, and once the dead one's last heartbeat is older than
//! `sweep_threshold` one of them unlocks its jobs, which run again after `recovery_delay`
//! (without recovery the lock holds until an operator unlocks it). The task here calls an
//! `#[idempotent]` handler whose marker commits with the effect, in the same database:
//!
//! - `Applied`, `Duplicate`, `Replayed`: `Ok` — graphile_worker deletes the job;
//! - any error, `KeyReused` included: `Err` — graphile_worker retries the job with exponential
//!   back-off until `max_attempts` (25 by default); a task cannot fail a job for good.
//!
//! The producer sets graphile_worker's `job_key` to the job's id: adding a job whose key
//! names a job still waiting replaces that one instead of queueing a second. It is a
//! producer-side merge, not a guard against re-runs (see `docs/brokers.md`).
//!
//! ```text
//! cargo run -p idem-example-jobs --example graphile_worker
//! ```
//! The database is `IDEM_POSTGRES_URL` (the variable the tests read), else the local server
//! `postgres://postgres@127.0.0.1:5432/test`.
//!
//! The parts both job-framework examples share (the database URL and pool, the `TopUp` job,
//! `JobError`, the `PAUSE_AFTER_COMMIT` hook) are in this package's library,
//! `examples/jobs/src/lib.rs`.

use std::future::Future;
use std::io::Write;
use std::time::Duration;

use graphile_worker::errors::GraphileWorkerError;
use graphile_worker::{
    IntoTaskHandlerResult, JobSpec, TaskHandler, Worker, WorkerBuildError, WorkerContext,
    WorkerOptions, WorkerRecoveryConfig, WorkerUtils,
};
use idem::Store;
use idem_example_jobs::{
    JobError, TopUp, connect, database_url, effects, insert_top_up, outcome_word,
    pause_after_commit, top_ups,
};
use serde::{Deserialize, Serialize};
use sqlx::{PgPool, Postgres, Transaction};

/// The table of the effect: one row per application, committed with the marker.
pub const TOP_UPS: &str = "graphile_top_ups";

/// The handler: `graphile.top_up` is its scope in idem's marker table.
#[idem::idempotent(key = "job.id", scope = "graphile.top_up", wait = "5s")]
pub async fn apply_top_up(tx: &mut Transaction<'_, Postgres>, job: &TopUp) -> Result<(), JobError> {
    insert_top_up(tx, TOP_UPS, job).await?;
    Ok(())
}

/// Creates the effect table and idem's marker table (graphile_worker's: [`setup`]).
pub async fn create_tables(pool: &PgPool) -> Result<(), idem::Error> {
    idem_example_jobs::create_tables(pool, TOP_UPS).await
}

/// graphile_worker's migrations, into `schema`.
pub async fn setup(pool: &PgPool, schema: &str) -> Result<(), BoxError> {
    WorkerUtils::new(pool.clone(), schema).migrate().await?;
    Ok(())
}

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The graphile_worker task of a [`TopUp`] job: a type of this example's own, since the
/// orphan rule keeps graphile_worker's trait off the library's `TopUp`. Transparent, so the
/// job row's payload is the `TopUp`'s JSON.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TopUpTask(pub TopUp);

impl TaskHandler for TopUpTask {
    const IDENTIFIER: &'static str = "top_up";

    async fn run(self, ctx: WorkerContext) -> impl IntoTaskHandlerResult {
        let Some(store) = ctx.get_ext::<Store<Postgres>>() else {
            return Err("the worker has no idem Store: add_extension(store)".to_owned());
        };
        // 1 on the first run; a job recovered from a dead worker gets its attempt back.
        let attempts = *ctx.job().attempts();
        let recovered = ctx
            .job()
            .last_error()
            .as_deref()
            .unwrap_or("none")
            .to_owned();
        let job = self.0;
        match apply_top_up(store, &job).await {
            Ok(outcome) => {
                let outcome = outcome_word(&outcome);
                println!(
                    "{outcome} {} attempts={attempts} last_error={recovered}",
                    job.id
                );
                pause_after_commit(outcome, &job.id).await;
                Ok(())
            }
            // Nothing was kept; graphile_worker runs the job again after its back-off.
            Err(e) => {
                println!("failed {} attempts={attempts}: {e}", job.id);
                Err(e.to_string())
            }
        }
    }
}

/// How fast a dead worker's jobs come back: every worker heartbeats every `heartbeat`,
/// sweeps every `sweep`, and unlocks the jobs of workers silent for `threshold`.
#[derive(Debug, Clone, Copy)]
pub struct Recovery {
    pub heartbeat: Duration,
    pub sweep: Duration,
    pub threshold: Duration,
}

/// A worker on `schema` running [`TopUpTask`] jobs, `concurrency` at a time, until `stop`
/// resolves.
pub async fn worker(
    pool: &PgPool,
    schema: &str,
    concurrency: usize,
    recovery: Recovery,
    stop: impl Future<Output = ()> + Send + 'static,
) -> Result<Worker, WorkerBuildError> {
    WorkerOptions::default()
        .pg_pool(pool.clone())
        .schema(schema)
        .concurrency(concurrency)
        .define_job::<TopUpTask>()
        .add_extension(Store::new(pool.clone()))
        .worker_recovery(
            WorkerRecoveryConfig::default()
                .heartbeat_interval(recovery.heartbeat)
                .sweep_interval(recovery.sweep)
                .sweep_threshold(recovery.threshold)
                .recovery_delay(Duration::ZERO),
        )
        .listen_os_shutdown_signals(false)
        .shutdown_signal(stop)
        .init()
        .await
}

/// Adds `job` with graphile_worker's `job_key` set to its id: a job with that key still
/// waiting is replaced (`JobKeyMode::Replace`), not doubled.
pub async fn add(utils: &WorkerUtils, job: &TopUp) -> Result<(), GraphileWorkerError> {
    let spec = JobSpec::builder().job_key(job.id.as_str()).build();
    utils.add_job(TopUpTask(job.clone()), spec).await.map(drop)
}

/// What [`run`] found at the end.
#[derive(Debug, PartialEq, Eq)]
pub struct Report {
    /// Jobs in graphile_worker's table after the five keyed adds twice and the unkeyed one.
    pub queued: i64,
    /// Rows in `graphile_top_ups` per job id of the run.
    pub effects: Vec<(String, i64)>,
}

/// Adds five jobs twice with their `job_key` (the second add replaces the first), then job 3
/// once more without a key (a producer that does not set it: a second job with the same id),
/// and runs one worker until graphile_worker has completed (deleted) all six.
pub async fn run(url: &str, out: &mut impl Write) -> Result<Report, BoxError> {
    let pool = connect(url, 8).await?;
    let run = format!("{:x}", std::time::UNIX_EPOCH.elapsed()?.as_millis());
    let schema = format!("idem_example_graphile_{run}");
    setup(&pool, &schema).await?;
    create_tables(&pool).await?;
    let utils = WorkerUtils::new(pool.clone(), schema.as_str());
    let jobs = top_ups(&run);
    for job in jobs.iter().chain(&jobs) {
        add(&utils, job).await?;
    }
    utils
        .add_job(TopUpTask(jobs[2].clone()), JobSpec::default())
        .await?;
    let jobs_table = format!("{schema}._private_jobs");
    let queued: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {jobs_table}"
    )))
    .fetch_one(&pool)
    .await?;
    writeln!(out, "{queued} jobs queued in {schema} after 11 adds")?;

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let recovery = Recovery {
        heartbeat: Duration::from_secs(1),
        sweep: Duration::from_secs(1),
        threshold: Duration::from_secs(5),
    };
    let worker = worker(&pool, &schema, 4, recovery, async move {
        drop(stop_rx.await);
    })
    .await?;
    let running = tokio::spawn(async move { worker.run().await });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut ticks = tokio::time::interval(Duration::from_millis(100));
    loop {
        ticks.tick().await;
        let left: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM {jobs_table}"
        )))
        .fetch_one(&pool)
        .await?;
        if left == 0 {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!("{left} jobs still queued after 60 s").into());
        }
    }
    // Err only if the worker already ended; its result says why.
    let _ = stop_tx.send(());
    running.await??;

    let effects = effects(&pool, TOP_UPS, &run).await?;
    for (id, rows) in &effects {
        writeln!(out, "{id}: applied {rows} time(s)")?;
    }
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&pool)
        .await?;
    pool.close().await;
    Ok(Report { queued, effects })
}

#[allow(dead_code)]
#[tokio::main]
async fn main() -> Result<(), BoxError> {
    run(&database_url(), &mut std::io::stdout())
        .await
        .map(|_| ())
}
