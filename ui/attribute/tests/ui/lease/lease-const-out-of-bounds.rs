// A `Duration` const as the lease: its bounds are checked at compile time, at the path.
use std::time::Duration;

const LEASE: Duration = Duration::from_secs(2 * 24 * 3600);

struct Charge {
    id: u64,
}

#[idem::idempotent(key = "job.id", scope = "billing.charge", lease = LEASE)]
async fn charge(lease: &idem::Lease, job: &Charge) -> Result<(), sqlx::Error> {
    let _ = (lease, job);
    Ok(())
}

fn main() {}
