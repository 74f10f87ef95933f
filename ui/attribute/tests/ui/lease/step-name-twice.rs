struct Checkout {
    id: u64,
}

#[idem::idempotent(key = "job.id", scope = "shop.checkout", lease = "30s")]
async fn checkout(lease: &idem::Lease, job: &Checkout) -> Result<(), idem::Error> {
    let _ = job;
    lease.step("charge", |_| async { Ok::<_, idem::Error>(1) }).await?;
    lease.step("mail", |_| async { Ok::<_, idem::Error>(2) }).await?;
    lease.step("charge", |_| async { Ok::<_, idem::Error>(3) }).await?;
    Ok(())
}

fn main() {}
