use sqlx::{Sqlite, Transaction};

#[derive(Clone)]
struct Job {
    id: u64,
}

#[idem::idempotent(key = "job.id", scope = "jobs.handle", batch = "jobs")]
async fn handle(
    tx: &mut Transaction<'_, Sqlite>,
    jobs: &[Job],
    outbox: &mut idem::Outbox,
) -> Result<(), sqlx::Error> {
    let _ = (tx, jobs, outbox);
    Ok(())
}

fn main() {}
