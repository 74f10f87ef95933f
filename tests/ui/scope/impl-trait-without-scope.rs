use sqlx::{Sqlite, Transaction};

trait Job {
    fn id(&self) -> u64;
}

#[idem::idempotent(key = "job.id()")]
async fn handle(tx: &mut Transaction<'_, Sqlite>, job: &impl Job) -> Result<(), sqlx::Error> {
    let _ = (tx, job);
    Ok(())
}

fn main() {}
