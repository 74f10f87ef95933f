use sqlx::{Sqlite, Transaction};

struct Job {
    id: u64,
}

#[idem::idempotent(key = "jobs.id", scope = "jobs.handle", retries = 3)]
async fn handle(tx: &mut Transaction<'_, Sqlite>, job: &Job) -> Option<()> {
    let _ = (tx, job);
    None
}

fn main() {}
