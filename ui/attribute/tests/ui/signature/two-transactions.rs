use sqlx::{Sqlite, Transaction};

struct Job {
    id: u64,
}

#[idem::idempotent(key = "job.id", scope = "jobs.handle")]
async fn handle(
    tx: &mut Transaction<'_, Sqlite>,
    other: &mut Transaction<'_, Sqlite>,
    job: &Job,
) -> Result<(), sqlx::Error> {
    let _ = (tx, other, job);
    Ok(())
}

fn main() {}
