// sqlx's alias of the transaction names the database through `__private::db`; an alias of
// `Result` that does not name `T` is read through `__private::HandlerResult`.
#[idempotent(key = "(job.tenant, job.id)", scope = "billing.refund")]
pub async fn refund(tx: &mut sqlx::postgres::PgTransaction<'_>, job: &Refund) -> Fallible<u64> {
    sqlx::query("UPDATE accounts SET credits = credits - $1 WHERE id = $2")
        .bind(job.credits)
        .bind(job.account_id)
        .execute(&mut **tx)
        .await?;
    Ok(job.credits)
}
