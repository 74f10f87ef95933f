// `link` reads the message's W3C traceparent: a number is none, and the error says which types
// are, at the `link` literal.
use sqlx::{Sqlite, Transaction};

struct Message {
    id: u64,
    trace: u64,
}

#[idem::idempotent(key = "msg.id", scope = "ui.link", link = "msg.trace")]
async fn handle(tx: &mut Transaction<'_, Sqlite>, msg: &Message) -> Result<(), idem::Error> {
    let _ = (tx, msg);
    Ok(())
}

fn main() {}
