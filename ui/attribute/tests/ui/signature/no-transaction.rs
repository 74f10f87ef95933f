use sqlx::{Sqlite, Transaction};

struct Job {
    id: u64,
}

#[idem::idempotent(key = "job.id", scope = "jobs.handle")]
async fn handle(job: &Job) -> Result<(), sqlx::Error> {
    let _ = job;
    Ok(())
}

fn main() {}
