use sqlx::{Sqlite, Transaction};

struct Job {
    id: u64,
}

#[idem::idempotent(key = "tx.len()", scope = "jobs.handle")]
async fn handle(tx: &mut Transaction<'_, Sqlite>, job: &Job) -> Result<(), sqlx::Error> {
    let _ = (tx, job);
    Ok(())
}

fn main() {}
