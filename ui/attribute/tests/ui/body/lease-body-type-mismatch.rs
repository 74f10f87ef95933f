struct Charge {
    id: u64,
}

#[idem::idempotent(key = "job.id", scope = "billing.charge", lease = "30s")]
async fn charge(lease: &idem::Lease, job: &Charge) -> Result<String, sqlx::Error> {
    let _ = (lease, job);
    Ok(5)
}

fn main() {}
