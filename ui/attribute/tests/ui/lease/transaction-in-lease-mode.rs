use sqlx::{Sqlite, Transaction};

struct Charge {
    id: u64,
}

#[idem::idempotent(key = "job.id", scope = "billing.charge", lease = "30s")]
async fn charge(lease: &idem::Lease, tx: &mut Transaction<'_, Sqlite>, job: &Charge) -> Result<(), sqlx::Error> {
    let _ = (lease, tx, job);
    Ok(())
}

fn main() {}
