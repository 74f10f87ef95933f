// Group commit: the handler takes the group instead of a store, and claims and ends through
// the group's entries.
#[idempotent(key = "job.id", scope = "billing.top_up", group)]
pub async fn top_up_grouped(
    tx: &mut sqlx::Transaction<'_, Postgres>,
    job: &TopUp,
) -> Result<(), AppError> {
    sqlx::query("UPDATE accounts SET credits = credits + $1 WHERE id = $2")
        .bind(job.credits)
        .bind(job.account_id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}
