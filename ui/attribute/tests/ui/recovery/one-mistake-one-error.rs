use sqlx::{Sqlite, Transaction};

struct Job {
    id: u64,
}

// One mistake in the attribute. The function is given back to rustc as written, so its body,
// which uses `tx`, `job`, `?` and a typed return value, adds no second error or warning.
#[idem::idempotent(key = "job.id", scope = "jobs.handle", retries = 3)]
async fn handle(tx: &mut Transaction<'_, Sqlite>, job: &Job) -> Result<u64, sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut **tx).await?;
    Ok(job.id)
}

fn main() {}
