// Lease mode: the `&Lease` parameter becomes the store, over a database type parameter added
// after the user's own; the body runs outside any transaction under the timeout.
#[idempotent(key = "job.id", scope = "billing.charge", lease = "30s", timeout = "10s")]
async fn charge_once<'a>(
    lease: &idem::Lease,
    job: &'a Charge,
    http: &reqwest::Client,
) -> Result<Receipt, AppError> {
    let receipt = http
        .post("https://pay.example/charges")
        .header("Idempotency-Key", lease.idempotency_key())
        .timeout(lease.remaining())
        .send()
        .await?;
    Ok(receipt.json().await?)
}
