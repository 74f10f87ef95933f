// `wait` and `isolation` become calls on the claim's options.
#[idempotent(key = "job.id", scope = "settle_invoice", wait = "2m", isolation = "repeatable read")]
async fn settle_invoice(
    tx: &mut sqlx::Transaction<'_, Postgres>,
    job: &Invoice,
) -> Result<(), sqlx::Error> {
    Ok(())
}
