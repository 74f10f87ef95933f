// `String` as the error type: it has no `From<idem::Error>`, said at the return type.
use sqlx::{Sqlite, Transaction};

struct Job {
    id: u64,
}

#[idem::idempotent(key = "job.id", scope = "ui.string")]
async fn handle(tx: &mut Transaction<'_, Sqlite>, job: &Job) -> Result<(), String> {
    let _ = (tx, job);
    Ok(())
}

fn main() {}
