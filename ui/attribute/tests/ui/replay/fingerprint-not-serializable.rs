use sqlx::{Sqlite, Transaction};

// The payload has no `Serialize`: there is nothing to digest.
struct Body {
    amount: i64,
}

struct Job {
    id: u64,
    body: Body,
}

#[idem::idempotent(key = "job.id", scope = "billing.pay", fingerprint = "job.body")]
async fn pay(tx: &mut Transaction<'_, Sqlite>, job: &Job) -> Result<(), sqlx::Error> {
    let _ = (tx, job.body.amount);
    Ok(())
}

fn main() {}
