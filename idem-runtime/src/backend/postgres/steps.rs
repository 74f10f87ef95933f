//! Lease steps on PostgreSQL: a step's value recorded by one statement that reads its holder's
//! marker under a share lock, so that a takeover of the key and the record never interleave.

use sqlx::{Pool, Postgres};

use super::PgSql;
use super::pinned::{on_conn, on_pool};
use crate::backend::sealed::Steps;
use crate::backend::sql::statements;
use crate::backend::{Holder, StepRow};

statements! {
    /// The statements of the steps table (`{t}_steps`).
    pub(super) struct StepSql<Postgres> {
        read(scope: &str, key: &str) =
            "SELECT name, seq::int8, token, result::text, \
             to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') \
             FROM {t}_steps WHERE scope = $1 AND key = $2 ORDER BY seq, name";
        // Only while the holder's token is the marker's: `FOR SHARE` makes a concurrent
        // takeover wait for this statement (and this statement, if the takeover came first,
        // re-read the marker and find another token), so that no step of an old holder is
        // written after a new one took the key. A row left by an earlier life of the key (its
        // marker deleted without its steps) holds a smaller token and is replaced.
        record(scope: &str, key: &str, token: i64, name: &str, seq: i64, result: &str) =
            "INSERT INTO {t}_steps AS s (scope, key, name, seq, token, result) \
             SELECT m.scope, m.key, $4, $5, m.token, $6::json FROM {t} AS m \
             WHERE m.scope = $1 AND m.key = $2 AND m.token = $3 AND m.state = 'in_progress' \
             FOR SHARE \
             ON CONFLICT (scope, key, name) DO UPDATE SET seq = EXCLUDED.seq, \
             token = EXCLUDED.token, result = EXCLUDED.result, created_at = now() \
             WHERE s.token < EXCLUDED.token";
        // With `forget`, once its marker is deleted (not when a marker in progress is only let
        // go: the next delivery resumes after its recorded steps).
        forget(scope: &str, key: &str) =
            "DELETE FROM {t}_steps WHERE scope = $1 AND key = $2 \
             AND NOT EXISTS (SELECT 1 FROM {t} WHERE scope = $1 AND key = $2)";
    }
}

impl Steps for Postgres {
    async fn steps_read<'p>(
        pool: &'p Pool<Self>,
        sql: &'p PgSql,
        scope: &'p str,
        key: &'p str,
    ) -> Result<Vec<StepRow>, sqlx::Error> {
        on_pool(pool, sql, async |conn| {
            sql.steps.read(scope, key).rows().fetch_all(conn).await
        })
        .await
    }

    async fn step_record<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t PgSql,
        h: Holder<'t>,
        name: &'t str,
        seq: i64,
        json: &'t str,
    ) -> Result<bool, sqlx::Error> {
        // Also run outside a transaction (a step of a lease's body).
        let record = sql.steps.record(h.scope, h.key, h.token, name, seq, json);
        let done = on_conn(conn, sql, async |conn| record.query().execute(conn).await).await?;
        Ok(done.rows_affected() == 1)
    }

    async fn steps_forget<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t PgSql,
        scope: &'t str,
        key: &'t str,
    ) -> Result<u64, sqlx::Error> {
        let forget = sql.steps.forget(scope, key);
        Ok(forget.query().execute(conn).await?.rows_affected())
    }
}
