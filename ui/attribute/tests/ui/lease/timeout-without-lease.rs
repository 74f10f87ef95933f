use sqlx::{Sqlite, Transaction};

struct Charge {
    id: u64,
}

#[idem::idempotent(key = "job.id", scope = "billing.charge", timeout = "10s")]
async fn charge(tx: &mut Transaction<'_, Sqlite>, job: &Charge) -> Result<(), sqlx::Error> {
    let _ = (tx, job);
    Ok(())
}

fn main() {}
