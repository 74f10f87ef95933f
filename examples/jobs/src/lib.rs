//! What the job-framework examples (`apalis_worker`, `graphile_worker`) share: the database
//! they connect to, the job they run, the handler's error, and the hook that lets a crash test
//! kill a worker between idem's commit and the framework's own bookkeeping. Each example keeps
//! its framework's part: the idempotent handler (its scope, and the name of its effect table),
//! the worker, the producer.

use idem::{Outcome, Store};
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, PgConnection, PgPool};

/// The variable that makes the job print `COMMITTED <id>` once its effect committed and then
/// never return, so that a crash test can kill the worker between idem's commit and the
/// framework's completion of the job. Unset in production.
pub const PAUSE_AFTER_COMMIT: &str = "IDEM_EXAMPLE_PAUSE_AFTER_COMMIT";

/// `IDEM_POSTGRES_URL`, else the local server.
pub fn database_url() -> String {
    std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// Connects to PostgreSQL; the error names the URL and the variable that overrides it.
pub async fn connect(url: &str, max: u32) -> Result<PgPool, String> {
    PgPoolOptions::new()
        // A dead connection fails the claim (the job is retried) rather than being replaced
        // before it; see `Store`'s docs.
        .test_before_acquire(false)
        .max_connections(max)
        .connect(url)
        .await
        .map_err(|e| format!("cannot reach PostgreSQL at {url} (set IDEM_POSTGRES_URL): {e}"))
}

/// A top-up job as the producer pushes it (JSON in the framework's job row). `id` is the
/// producer's, stable across the framework's re-runs of the job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopUp {
    pub id: String,
    pub account: i64,
    pub credits: i64,
}

/// The five jobs an example's run pushes, their ids unique to `run`.
pub fn top_ups(run: &str) -> Vec<TopUp> {
    (1..=5)
        .map(|n| TopUp {
            id: format!("top-up-{run}-{n}"),
            account: 1 + n % 2,
            credits: 10 * n,
        })
        .collect()
}

/// The handler's error: idem's own, or the database's.
#[derive(Debug)]
pub enum JobError {
    Database(sqlx::Error),
    Idem(idem::Error),
}

impl From<sqlx::Error> for JobError {
    fn from(e: sqlx::Error) -> Self {
        JobError::Database(e)
    }
}

impl From<idem::Error> for JobError {
    fn from(e: idem::Error) -> Self {
        JobError::Idem(e)
    }
}

impl std::fmt::Display for JobError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JobError::Database(e) => write!(f, "{e}"),
            JobError::Idem(e) => write!(f, "{e}"),
        }
    }
}

// apalis boxes the job function's error (`BoxDynError`) and downcasts it for `AbortError`.
impl std::error::Error for JobError {}

/// The word a worker prints for the handler's outcome: `applied`, or `duplicate` for a job
/// whose effect an earlier run already committed.
pub fn outcome_word(outcome: &Outcome<()>) -> &'static str {
    match outcome {
        Outcome::Applied(()) => "applied",
        Outcome::Duplicate | Outcome::Replayed(()) => "duplicate",
        Outcome::Failed(_) => "failed",
    }
}

/// With [`PAUSE_AFTER_COMMIT`] set and job `id` just `applied`: prints `COMMITTED <id>` and
/// never returns, holding the job as the framework sees it until the worker is killed.
pub async fn pause_after_commit(outcome: &str, id: &str) {
    if outcome == "applied" && std::env::var_os(PAUSE_AFTER_COMMIT).is_some() {
        println!("COMMITTED {id}");
        std::future::pending::<()>().await;
    }
}

/// Creates the effect table `table` (no unique index, so that a job applied twice shows as two
/// rows) and idem's marker table.
pub async fn create_tables(pool: &PgPool, table: &str) -> Result<(), idem::Error> {
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS {table} \
         (job text NOT NULL, account bigint NOT NULL, credits bigint NOT NULL)"
    )))
    .execute(pool)
    .await
    .map_err(idem::Error::from)?;
    Store::new(pool.clone()).migrate().await
}

/// The effect of `job`: one row in `table`, in the handler's transaction `tx`.
pub async fn insert_top_up(
    tx: &mut PgConnection,
    table: &str,
    job: &TopUp,
) -> Result<(), sqlx::Error> {
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {table} (job, account, credits) VALUES ($1, $2, $3)"
    )))
    .bind(&job.id)
    .bind(job.account)
    .bind(job.credits)
    .execute(tx)
    .await?;
    Ok(())
}

/// Rows of `table` per job id of `run`, by job id.
pub async fn effects(
    pool: &PgPool,
    table: &str,
    run: &str,
) -> Result<Vec<(String, i64)>, sqlx::Error> {
    sqlx::query_as(AssertSqlSafe(format!(
        "SELECT job, count(*) FROM {table} WHERE job LIKE $1 GROUP BY job ORDER BY job"
    )))
    .bind(format!("top-up-{run}-%"))
    .fetch_all(pool)
    .await
}

/// `docs/job-frameworks.md`'s code blocks, compiled as doctests with this package's frameworks
/// (apalis, graphile_worker), which the facade's doctests do not build. Compiled, not run
/// (`no_run`): they need PostgreSQL.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/job-frameworks.md")]
pub struct JobFrameworksDoctests;
