// A batch run job by job: the caller passes the batch, the body gets one job and runs in
// that job's savepoint; the call answers one result per job.
#[idempotent(key = "job.id", scope = "billing.top_up", each = "job")]
pub async fn top_up_each(
    tx: &mut sqlx::Transaction<'_, Postgres>,
    job: &TopUp,
    outbox: &mut idem::Outbox,
) -> Result<i64, AppError> {
    sqlx::query("UPDATE accounts SET credits = credits + $1 WHERE id = $2")
        .bind(job.credits)
        .bind(job.account_id)
        .execute(&mut **tx)
        .await?;
    outbox.send("credits", &job.credits)?;
    Ok(job.credits)
}
