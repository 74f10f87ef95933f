use sqlx::{Sqlite, Transaction};

#[derive(Clone)]
struct TopUp {
    id: u64,
}

#[idem::idempotent(key = "job.id", scope = "top_up", batch = "jobs", group)]
async fn top_up(tx: &mut Transaction<'_, Sqlite>, jobs: &[TopUp]) -> Result<(), sqlx::Error> {
    let _ = (tx, jobs);
    Ok(())
}

fn main() {}
