struct Charge {
    id: u64,
}

#[idem::idempotent(key = "job.id", scope = "billing.charge", lease = "30s")]
async fn charge(
    lease: &idem::Lease,
    job: &Charge,
    outbox: &mut idem::Outbox,
) -> Result<(), sqlx::Error> {
    let _ = (lease, job, outbox);
    Ok(())
}

fn main() {}
