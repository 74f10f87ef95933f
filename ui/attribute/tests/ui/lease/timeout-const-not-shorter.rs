// A const timeout not shorter than the lease: refused at compile time, at the path.
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(30);

struct Charge {
    id: u64,
}

#[idem::idempotent(key = "job.id", scope = "billing.charge", lease = "30s", timeout = TIMEOUT)]
async fn charge(lease: &idem::Lease, job: &Charge) -> Result<(), sqlx::Error> {
    let _ = (lease, job);
    Ok(())
}

fn main() {}
