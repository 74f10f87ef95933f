// A handler takes `&store` or `store.join(tx)`: a pool in their place is refused with advice.
use sqlx::{Sqlite, SqlitePool, Transaction};

#[idem::idempotent(key = "id", scope = "ui.join")]
async fn handler(tx: &mut Transaction<'_, Sqlite>, id: u64) -> Result<(), sqlx::Error> {
    let _ = tx;
    Ok(())
}

async fn call(pool: &SqlitePool) {
    let _ = handler(pool, 1).await;
}

fn main() {
    drop(call);
}
