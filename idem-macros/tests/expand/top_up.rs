// The seed's handler: a free function on Postgres, whose scope keeps the name it had by default.
#[idempotent(key = "job.id", scope = "apply_top_up")]
pub async fn apply_top_up(
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
