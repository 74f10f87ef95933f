use sqlx::{Sqlite, Transaction};

struct Job {
    id: u64,
}

// Neither `Serialize` nor `Deserialize`: the value cannot be stored for later deliveries.
struct Receipt {
    total: i64,
}

#[idem::idempotent(key = "job.id", scope = "billing.receipt", replay)]
async fn receipt(tx: &mut Transaction<'_, Sqlite>, job: &Job) -> Result<Receipt, sqlx::Error> {
    let _ = (tx, job);
    Ok(Receipt { total: 0 })
}

fn main() {}
