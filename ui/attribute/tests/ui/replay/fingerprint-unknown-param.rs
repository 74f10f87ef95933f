use sqlx::{Sqlite, Transaction};

struct Job {
    id: u64,
    body: String,
}

#[idem::idempotent(key = "job.id", scope = "billing.pay", fingerprint = "event.body")]
async fn pay(tx: &mut Transaction<'_, Sqlite>, job: &Job) -> Result<(), sqlx::Error> {
    let _ = (tx, job);
    Ok(())
}

fn main() {}
