// A short wait in milliseconds and the strictest isolation.
#[idempotent(key = "job.id", scope = "ledger.post", wait = "500ms", isolation = "serializable")]
async fn post(tx: &mut sqlx::Transaction<'_, MySql>, job: &Entry) -> Result<(), sqlx::Error> {
    Ok(())
}
