// A batch handler with an outbox: the outbox leaves the signature, and is made of the fresh
// jobs' keys beside the claim; each `send` names its job.
#[idempotent(key = "order.id", scope = "orders.place", batch = "orders")]
pub async fn place_all(
    tx: &mut sqlx::Transaction<'_, Postgres>,
    orders: &[Order],
    outbox: &mut idem::BatchOutbox,
) -> Result<(), AppError> {
    for order in orders {
        sqlx::query("INSERT INTO orders (id) VALUES ($1)")
            .bind(order.id)
            .execute(&mut **tx)
            .await?;
        outbox.send(&order.id, "shipping", &order.id)?;
    }
    Ok(())
}
