use sqlx::{Sqlite, Transaction};

trait Job {
    fn id(&self) -> u64;
}

#[idem::idempotent(key = "job.id()")]
async fn handle<J: Job>(tx: &mut Transaction<'_, Sqlite>, job: &J) -> Result<(), sqlx::Error> {
    let _ = (tx, job);
    Ok(())
}

fn main() {}
