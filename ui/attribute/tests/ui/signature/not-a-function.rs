use sqlx::{Sqlite, Transaction};

struct Job {
    id: u64,
}

#[idem::idempotent(key = "job.id", scope = "jobs.handle")]
struct Handler;

fn main() {}
