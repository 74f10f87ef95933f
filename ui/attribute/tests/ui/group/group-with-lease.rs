use idem::Lease;

struct Charge {
    id: u64,
}

#[idem::idempotent(key = "job.id", scope = "charge", lease = "30s", group)]
async fn charge(lease: &Lease, job: &Charge) -> Result<(), sqlx::Error> {
    let _ = (lease, job);
    Ok(())
}

fn main() {}
