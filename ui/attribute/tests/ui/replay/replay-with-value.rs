use sqlx::{Sqlite, Transaction};

struct Job {
    id: u64,
}

#[idem::idempotent(key = "job.id", scope = "billing.total", replay = "true")]
async fn total(tx: &mut Transaction<'_, Sqlite>, job: &Job) -> Result<i64, sqlx::Error> {
    let _ = (tx, job);
    Ok(0)
}

fn main() {}
