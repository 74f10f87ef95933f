// sqlx's alias names the database too: one error, at the alias.
#[idem::idempotent(key = "id", scope = "ui.feature.alias")]
async fn handler(tx: &mut sqlx::PgTransaction<'_>, id: u64) -> Result<(), sqlx::Error> {
    let _ = tx;
    Ok(())
}

fn main() {}
