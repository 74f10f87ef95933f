use sqlx::{Sqlite, Transaction};

struct TopUp {
    id: u64,
    account: i64,
}

#[idem::idempotent(key = "job.id", scope = "top_up", lane = "job.account")]
async fn top_up(tx: &mut Transaction<'_, Sqlite>, job: &TopUp) -> Result<(), sqlx::Error> {
    let _ = (tx, job);
    Ok(())
}

fn main() {}
