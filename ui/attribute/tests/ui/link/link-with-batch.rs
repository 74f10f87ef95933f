// A batch's jobs come from messages of their own: one `link` for the batch is refused.
use sqlx::{Sqlite, Transaction};

#[derive(Clone)]
struct Message {
    id: u64,
    traceparent: String,
}

#[idem::idempotent(key = "job.id", scope = "ui.link", batch = "jobs", link = "job.traceparent")]
async fn handle(tx: &mut Transaction<'_, Sqlite>, jobs: &[Message]) -> Result<(), idem::Error> {
    let _ = (tx, jobs);
    Ok(())
}

fn main() {}
