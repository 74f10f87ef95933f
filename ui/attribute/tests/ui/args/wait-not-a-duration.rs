use sqlx::{Sqlite, Transaction};

struct Job {
    id: u64,
}

#[idem::idempotent(key = "job.id", scope = "jobs.handle", wait = "30 seconds")]
async fn handle(tx: &mut Transaction<'_, Sqlite>, job: &Job) -> Result<(), sqlx::Error> {
    let _ = (tx, job);
    Ok(())
}

fn main() {}
