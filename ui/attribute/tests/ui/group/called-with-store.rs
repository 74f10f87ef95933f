// A `group` handler runs in a group's shared transactions: called with the store itself, it
// says to make the group once with `store.group(..)`.
use sqlx::{Sqlite, Transaction};

struct TopUp {
    id: u64,
}

#[idem::idempotent(key = "job.id", scope = "top_up", group)]
async fn top_up(tx: &mut Transaction<'_, Sqlite>, job: &TopUp) -> Result<(), sqlx::Error> {
    let _ = (tx, job);
    Ok(())
}

async fn call(store: &idem::Store<Sqlite>) {
    let _ = top_up(store, &TopUp { id: 1 }).await;
}

fn main() {
    drop(call);
}
