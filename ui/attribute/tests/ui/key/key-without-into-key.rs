use sqlx::{Sqlite, Transaction};

struct Job {
    id: u64,
}

struct Payload {
    data: Vec<u8>,
}

#[idem::idempotent(key = "job.data", scope = "jobs.handle")]
async fn handle(tx: &mut Transaction<'_, Sqlite>, job: &Payload) -> Result<(), sqlx::Error> {
    let _ = (tx, job);
    Ok(())
}

fn main() {}
