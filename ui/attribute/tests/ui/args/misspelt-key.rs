use sqlx::{Sqlite, Transaction};

struct Job {
    id: u64,
}

// One typo, one error: no second one saying that `key` is missing.
#[idem::idempotent(kee = "job.id", scope = "jobs.handle")]
async fn handle(tx: &mut Transaction<'_, Sqlite>, job: &Job) -> Result<(), sqlx::Error> {
    let _ = (tx, job);
    Ok(())
}

fn main() {}
