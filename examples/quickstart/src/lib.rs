//! The quickstart's job and handler (`cargo run --example quickstart` tells its story, in
//! `quickstart.rs` next to this folder).

use sqlx::{Sqlite, Transaction};

/// A job as a broker would hand it over: its id is stable across redeliveries.
pub struct TopUp {
    pub id: &'static str,
    pub account: &'static str,
    pub credits: i64,
}

/// The handler's own error type: idem only asks that it can hold an `idem::Error`.
#[derive(Debug)]
pub enum JobError {
    Database(sqlx::Error),
    Idem(idem::Error),
    WorkerDied,
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
            JobError::WorkerDied => f.write_str("the worker died before committing"),
        }
    }
}

/// Adds credits. The marker and the `UPDATE` commit in one transaction.
///
/// `crash_after_effect` stands in for a worker that dies between the work and the commit.
#[idem::idempotent(key = "job.id", scope = "billing.top_up")]
pub async fn apply_top_up(
    tx: &mut Transaction<'_, Sqlite>,
    job: &TopUp,
    crash_after_effect: bool,
) -> Result<(), JobError> {
    sqlx::query("UPDATE accounts SET credits = credits + ?1 WHERE name = ?2")
        .bind(job.credits)
        .bind(job.account)
        .execute(&mut **tx)
        .await?;
    if crash_after_effect {
        return Err(JobError::WorkerDied);
    }
    Ok(())
}
