// A method with an explicit scope, a composite key and a documented signature.
/// Sends the receipt of one order.
#[idempotent(key = "(self.tenant, order.id)", scope = "billing.receipt")]
async fn send_receipt(
    &self,
    order: Order,
    tx: &mut idem::Tx<'_, Sqlite>,
) -> anyhow::Result<u64> {
    if order.total == 0 {
        return Ok(0);
    }
    Ok(order.total)
}
