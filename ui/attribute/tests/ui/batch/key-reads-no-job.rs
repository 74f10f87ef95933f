use sqlx::{Sqlite, Transaction};

#[derive(Clone)]
struct TopUp {
    id: u64,
}

#[idem::idempotent(key = "tenant", scope = "top_up", batch = "jobs")]
async fn top_up(tx: &mut Transaction<'_, Sqlite>, jobs: &[TopUp], tenant: &str) -> Result<(), sqlx::Error> {
    let _ = (tx, jobs, tenant);
    Ok(())
}

fn main() {}
