//! Lease steps on SQLite: a step's value recorded by one statement that writes only while its
//! holder's token is the marker's (writers take turns, so nothing interleaves with it).

use sqlx::{Pool, Sqlite};

use super::SqliteSql;
use crate::backend::sealed::Steps;
use crate::backend::sql::statements;
use crate::backend::{Holder, StepRow};

statements! {
    /// The statements of the steps table (`{t}_steps`).
    pub(super) struct StepSql<Sqlite> {
        read(scope: &str, key: &str) =
            "SELECT name, seq, token, result, created_at FROM {t}_steps \
             WHERE scope = ?1 AND key = ?2 ORDER BY seq, name";
        // A row left by an earlier life of the key (its marker deleted without its steps)
        // holds a smaller token and is replaced.
        record(scope: &str, key: &str, token: i64, name: &str, seq: i64, result: &str) =
            "INSERT INTO {t}_steps AS s (scope, key, name, seq, token, result) \
             SELECT m.scope, m.key, ?4, ?5, m.token, ?6 FROM {t} AS m \
             WHERE m.scope = ?1 AND m.key = ?2 AND m.token = ?3 AND m.state = 'in_progress' \
             ON CONFLICT (scope, key, name) DO UPDATE SET seq = excluded.seq, \
             token = excluded.token, result = excluded.result, \
             created_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') \
             WHERE s.token < excluded.token";
        // With `forget`, once its marker is deleted (not when a marker in progress is only let
        // go: the next delivery resumes after its recorded steps).
        forget(scope: &str, key: &str) =
            "DELETE FROM {t}_steps WHERE scope = ?1 AND key = ?2 \
             AND NOT EXISTS (SELECT 1 FROM {t} WHERE scope = ?1 AND key = ?2)";
    }
}

impl Steps for Sqlite {
    async fn steps_read<'p>(
        pool: &'p Pool<Self>,
        sql: &'p SqliteSql,
        scope: &'p str,
        key: &'p str,
    ) -> Result<Vec<StepRow>, sqlx::Error> {
        sql.steps.read(scope, key).rows().fetch_all(pool).await
    }

    async fn step_record<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t SqliteSql,
        h: Holder<'t>,
        name: &'t str,
        seq: i64,
        json: &'t str,
    ) -> Result<bool, sqlx::Error> {
        let record = sql.steps.record(h.scope, h.key, h.token, name, seq, json);
        Ok(record.query().execute(conn).await?.rows_affected() == 1)
    }

    async fn steps_forget<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t SqliteSql,
        scope: &'t str,
        key: &'t str,
    ) -> Result<u64, sqlx::Error> {
        let forget = sql.steps.forget(scope, key);
        Ok(forget.query().execute(conn).await?.rows_affected())
    }
}
