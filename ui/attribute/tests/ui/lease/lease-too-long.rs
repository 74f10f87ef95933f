struct Charge {
    id: u64,
}

// Over 24h: a lease of 11,000 years, whose end SQLite cannot even compute.
#[idem::idempotent(key = "job.id", scope = "billing.charge", lease = "100000000h")]
async fn charge(lease: &idem::Lease, job: &Charge) -> Result<(), sqlx::Error> {
    let _ = (lease, job);
    Ok(())
}

fn main() {}
