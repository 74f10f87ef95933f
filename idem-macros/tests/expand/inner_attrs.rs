// Inner attributes of the body stay inside the function; outer ones stay on it.
#[idempotent(key = "job.id", scope = "apply")]
#[allow(clippy::too_many_lines)]
async fn apply(tx: &mut sqlx::Transaction<'_, Sqlite>, job: &Job) -> Result<(), sqlx::Error> {
    #![allow(unused_variables)]
    let unused = job.id;
    Ok(())
}
