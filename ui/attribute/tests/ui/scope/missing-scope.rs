use sqlx::{Sqlite, Transaction};

struct Order {
    id: u64,
}

mod invoices {
    use super::*;

    #[idem::idempotent(key = "order.id", scope = "billing.send_invoice")]
    pub(crate) async fn send(tx: &mut Transaction<'_, Sqlite>, order: &Order) -> Result<(), sqlx::Error> {
        let _ = (tx, order.id);
        Ok(())
    }
}

mod receipts {
    use super::*;

    // Without `scope`, it would share the markers of `invoices::send`: the receipt for an
    // order whose invoice went out would come back `Duplicate` and never be sent.
    #[idem::idempotent(key = "order.id")]
    pub(crate) async fn send(tx: &mut Transaction<'_, Sqlite>, order: &Order) -> Result<(), sqlx::Error> {
        let _ = (tx, order.id);
        Ok(())
    }
}

fn main() {}
