use sqlx::{Postgres, Transaction};

struct Job {
    id: u64,
}

/// The user's own alias hides the database from the attribute.
type PgTx<'a> = Transaction<'a, Postgres>;

#[idem::idempotent(key = "job.id", scope = "jobs.handle")]
async fn handle(tx: &mut PgTx<'_>, job: &Job) -> Result<(), sqlx::Error> {
    let _ = (tx, job);
    Ok(())
}

fn main() {}
