// A misspelt field in the key: rustc names the field it does not find, at the field in the
// literal, and suggests the field that exists (not a rewrite of the attribute).
use sqlx::{Sqlite, Transaction};

struct Job {
    id: u64,
}

#[idem::idempotent(key = "job.idd", scope = "ui.key")]
async fn handle(tx: &mut Transaction<'_, Sqlite>, job: &Job) -> Result<(), sqlx::Error> {
    let _ = (tx, job);
    Ok(())
}

fn main() {}
