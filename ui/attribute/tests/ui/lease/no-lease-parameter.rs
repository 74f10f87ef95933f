struct Charge {
    id: u64,
}

#[idem::idempotent(key = "job.id", scope = "billing.charge", lease = "30s")]
async fn charge(job: &Charge) -> Result<(), sqlx::Error> {
    let _ = job;
    Ok(())
}

fn main() {}
