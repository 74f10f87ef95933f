// A string as the error type: it has no `From<idem::Error>`, said at the return type. (A
// `String` says the same; its list of `From` impls differs with the crate's features.)
use sqlx::{Sqlite, Transaction};

struct Job {
    id: u64,
}

#[idem::idempotent(key = "job.id", scope = "ui.string")]
async fn handle(tx: &mut Transaction<'_, Sqlite>, job: &Job) -> Result<(), &'static str> {
    let _ = (tx, job);
    Ok(())
}

fn main() {}
