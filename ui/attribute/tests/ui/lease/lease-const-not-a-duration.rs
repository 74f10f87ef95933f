// A lease const must be a `Duration`, not a number of seconds.
const LEASE: u64 = 30;

struct Charge {
    id: u64,
}

#[idem::idempotent(key = "job.id", scope = "billing.charge", lease = LEASE)]
async fn charge(lease: &idem::Lease, job: &Charge) -> Result<(), sqlx::Error> {
    let _ = (lease, job);
    Ok(())
}

fn main() {}
