use sqlx::{Sqlite, Transaction};

#[derive(Clone)]
struct TopUp {
    id: u64,
}

#[idem::idempotent(key = "job.id", scope = "top_up", batch = "jobs")]
async fn top_up(tx: &mut Transaction<'_, Sqlite>, batch: &[TopUp]) -> Result<(), sqlx::Error> {
    let _ = (tx, batch);
    Ok(())
}

fn main() {}
