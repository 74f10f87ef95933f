//! Jobs that failed for good, for operators: the list of them, and the requeue that lets the
//! next delivery run a failed job again.

use sqlx::{Pool, Postgres};

use super::PgSql;
use super::operators::MARKER_COLUMNS;
use super::pinned::on_pool;
use crate::backend::MarkerRow;
use crate::backend::sealed::Failures;
use crate::backend::sql::statements;

statements! {
    /// The statements of failed markers.
    pub(super) struct FailedSql<Postgres> {
        // The newest failures first; a scan of the completed markers (failures are few).
        list(scope: Option<&str>, limit: i64) = format!(
            "SELECT {MARKER_COLUMNS} FROM {{t}} WHERE ($1::text IS NULL OR scope = $1) \
             AND state = 'completed' AND error IS NOT NULL \
             ORDER BY completed_at DESC, scope LIMIT $2"
        );
        // Back to a released lease, its steps and fingerprint kept: the next delivery takes it
        // over (one more attempt) and resumes after its recorded steps. The token goes up, as
        // `forget`'s does.
        requeue(scope: &str, key: &str) =
            "UPDATE {t} SET state = 'in_progress', completed_at = NULL, locked_until = NULL, \
             error = NULL, token = COALESCE(token, 0) + 1 \
             WHERE scope = $1 AND key = $2 AND state = 'completed' AND error IS NOT NULL";
    }
}

impl Failures for Postgres {
    async fn failed<'p>(
        pool: &'p Pool<Self>,
        sql: &'p PgSql,
        scope: Option<&'p str>,
        limit: i64,
    ) -> Result<Vec<MarkerRow>, sqlx::Error> {
        on_pool(pool, sql, async |conn| {
            sql.failed.list(scope, limit).rows().fetch_all(conn).await
        })
        .await
    }

    async fn requeue<'p>(
        pool: &'p Pool<Self>,
        sql: &'p PgSql,
        scope: &'p str,
        key: &'p str,
    ) -> Result<bool, sqlx::Error> {
        let requeue = sql.failed.requeue(scope, key);
        let done = on_pool(pool, sql, async |conn| requeue.query().execute(conn).await).await?;
        Ok(done.rows_affected() == 1)
    }
}
