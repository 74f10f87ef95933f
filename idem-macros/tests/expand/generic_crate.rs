// A generic handler (so it names its scope), re-rooted for a crate that re-exports idem.
#[idempotent(key = "job.key()", scope = "jobs.handle", crate = "::my_app::idem")]
pub(crate) async fn handle<J: Job + Sync>(
    job: &J,
    mut tx: &mut sqlx::Transaction<'_, MySql>,
) -> Result<J::Output, sqlx::Error>
where
    J::Output: Send,
{
    job.run(&mut tx).await
}
