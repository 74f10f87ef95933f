//! The `top_up` example's job and handler, on PostgreSQL.

use sqlx::{Postgres, Transaction};

/// The default database of the examples and tests.
pub const DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// `DATABASE_URL`, else `IDEM_POSTGRES_URL`, else [`DEFAULT_URL`].
pub fn database_url() -> String {
    ["DATABASE_URL", "IDEM_POSTGRES_URL"]
        .iter()
        .find_map(|var| std::env::var(var).ok())
        .unwrap_or_else(|| DEFAULT_URL.to_owned())
}

pub struct TopUp {
    pub id: String,
    pub account_id: i64,
    pub credits: i64,
}

/// DESIGN §2's handler: the marker and the `UPDATE` commit in one transaction.
#[idem::idempotent(key = "job.id", scope = "billing.top_up")]
pub async fn apply_top_up(
    tx: &mut Transaction<'_, Postgres>,
    job: &TopUp,
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE accounts SET credits = credits + $1 WHERE id = $2")
        .bind(job.credits)
        .bind(job.account_id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}
