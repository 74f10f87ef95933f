// The traceparent is read before the claim, from the handler's parameters: not from the
// transaction, which exists only once the key is claimed.
use sqlx::{Sqlite, Transaction};

struct Message {
    id: u64,
}

#[idem::idempotent(key = "msg.id", scope = "ui.link", link = "tx.traceparent")]
async fn handle(tx: &mut Transaction<'_, Sqlite>, msg: &Message) -> Result<(), idem::Error> {
    let _ = (tx, msg);
    Ok(())
}

fn main() {}
