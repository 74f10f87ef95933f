use sqlx::{Sqlite, Transaction};

struct Job {
    id: u64,
}

struct Mailer;

impl Mailer {
    #[idem::idempotent(key = "job.id")]
    async fn handle(&self, tx: &mut Transaction<'_, Sqlite>, job: &Job) -> Result<(), sqlx::Error> {
        let _ = (tx, job);
        Ok(())
    }
}

fn main() {}
