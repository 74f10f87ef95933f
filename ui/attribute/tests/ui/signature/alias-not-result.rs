use sqlx::{Sqlite, Transaction};

struct Job {
    id: u64,
}

/// An alias whose name says nothing: rustc reads it, and it is not a `Result`.
type Maybe<T> = Option<T>;

#[idem::idempotent(key = "job.id", scope = "jobs.handle")]
async fn handle(tx: &mut Transaction<'_, Sqlite>, job: &Job) -> Maybe<()> {
    let _ = (tx, job);
    Some(())
}

fn main() {}
