use sqlx::Transaction;

struct Job {
    id: u64,
}

#[idem::idempotent(key = "job.id", scope = "jobs.handle")]
async fn handle(tx: &mut Transaction, job: &Job) -> Result<(), sqlx::Error> {
    let _ = (tx, job);
    Ok(())
}

fn main() {}
