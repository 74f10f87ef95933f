struct Charge {
    id: u64,
}

#[idem::idempotent(key = "job.id", scope = "billing.charge", lease = "30s", timeout = "30s")]
async fn charge(lease: &idem::Lease, job: &Charge) -> Result<(), sqlx::Error> {
    let _ = (lease, job);
    Ok(())
}

fn main() {}
