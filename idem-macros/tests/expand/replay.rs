// `replay` and `fingerprint` in transaction mode: the payload's digest is taken before any
// I/O, a duplicate returns the stored value, and the commit stores this one.
#[idempotent(key = "event.id", scope = "webhooks.payment", replay, fingerprint = "event")]
async fn record_payment(
    tx: &mut Transaction<'_, Sqlite>,
    event: &PaymentEvent,
) -> Result<Receipt, AppError> {
    sqlx::query("INSERT INTO payments (id, amount) VALUES (?1, ?2)")
        .bind(&event.id)
        .bind(event.amount)
        .execute(&mut **tx)
        .await?;
    Ok(Receipt::for_event(event))
}
