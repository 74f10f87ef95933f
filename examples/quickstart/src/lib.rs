//! The quickstart's job and handler (`cargo run --example quickstart` tells its story, in
//! `quickstart.rs` next to this folder).

use idem::JobError;
use sqlx::{Sqlite, Transaction};

/// A job as a broker would hand it over: its id is stable across redeliveries.
pub struct TopUp {
    pub id: &'static str,
    pub account: &'static str,
    pub credits: i64,
}

/// Adds credits. The marker and the `UPDATE` commit in one transaction.
///
/// `crash_after_effect` stands in for a worker that dies between the work and the commit.
/// `JobError`, idem's ready error type, takes the body's `sqlx::Error` and idem's own.
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
        return Err(JobError::new("the worker died before committing"));
    }
    Ok(())
}
