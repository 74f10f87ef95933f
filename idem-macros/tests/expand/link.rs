// `link` reads the message's traceparent before any I/O, beside the key, and the claim goes
// through the linked entry; a handler without `link` calls `claim` as before.
#[idempotent(key = "msg.id", scope = "orders.ship", link = "msg.traceparent")]
async fn ship(tx: &mut Transaction<'_, Sqlite>, msg: &Message) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO shipments (id) VALUES (?)")
        .bind(&msg.id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}
