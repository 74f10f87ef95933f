// A handler on PostgreSQL with idem's default features (SQLite only): one error, at the
// database's name, naming the feature to enable. The caller's own mention of a PostgreSQL
// store is one more, and its call one more: both name the feature too.
use sqlx::{Postgres, Transaction};

#[idem::idempotent(key = "id", scope = "ui.feature")]
async fn handler(tx: &mut Transaction<'_, Postgres>, id: u64) -> Result<(), sqlx::Error> {
    let _ = tx;
    Ok(())
}

async fn call(store: &idem::Store<Postgres>) {
    let _ = handler(store, 1).await;
}

fn main() {
    drop(call);
}
