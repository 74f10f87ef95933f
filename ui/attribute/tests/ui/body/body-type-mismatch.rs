use sqlx::{Sqlite, Transaction};

struct Job {
    id: u64,
}

#[idem::idempotent(key = "job.id", scope = "jobs.handle")]
async fn handle(tx: &mut Transaction<'_, Sqlite>, job: &Job) -> Result<String, sqlx::Error> {
    let _ = (tx, job);
    Ok(5)
}

fn main() {}
