use sqlx::{Sqlite, Transaction};

struct Job {
    id: u64,
}

#[idem::idempotent(scope = "jobs")]
async fn handle(tx: &mut Transaction<'_, Sqlite>, job: &Job) -> Result<(), sqlx::Error> {
    let _ = (tx, job.id);
    Ok(())
}

fn main() {}
