// Types of the user's own named like the transaction but not shaped like it
// (`Transaction<'_, DB>`) are ordinary parameters: the transaction is still missing.

struct Tx {
    id: u64,
}

struct Transaction<T> {
    payload: T,
}

#[idem::idempotent(key = "job.id", scope = "jobs.handle")]
async fn handle(job: &Tx, payment: &mut Transaction<u64>) -> Result<(), sqlx::Error> {
    payment.payload += job.id;
    Ok(())
}

fn main() {}
