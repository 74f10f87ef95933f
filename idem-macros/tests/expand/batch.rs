// A batch handler: the jobs' keys claimed with one statement, the body run once on the
// fresh jobs, one commit for the batch.
#[idempotent(key = "job.id", scope = "billing.top_up", batch = "jobs")]
pub async fn apply_top_ups(
    tx: &mut sqlx::Transaction<'_, Postgres>,
    jobs: &[TopUp],
) -> Result<usize, AppError> {
    for job in jobs {
        sqlx::query("UPDATE accounts SET credits = credits + $1 WHERE id = $2")
            .bind(job.credits)
            .bind(job.account_id)
            .execute(&mut **tx)
            .await?;
    }
    Ok(jobs.len())
}
