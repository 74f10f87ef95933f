// `replay` and `fingerprint` in lease mode: the value is stored by the completing statement.
#[idempotent(key = "job.id", scope = "mail.send", lease = "1m", replay, fingerprint = "job.body")]
async fn send_mail(lease: &idem::Lease, job: &Mail, api: &MailApi) -> Result<MessageId, AppError> {
    api.send(lease.idempotency_key(), &job.body).await
}
