//! Lease steps on MySQL and MariaDB: a step's value recorded by one statement that reads its
//! holder's marker under a share lock, so that a takeover of the key and the record never
//! interleave.

use sqlx::{MySql, Pool};

use super::MySqlSql;
use crate::backend::sealed::Steps;
use crate::backend::sql::statements;
use crate::backend::{Holder, StepRow};

statements! {
    /// The statements of the steps table (`{t}_steps`).
    pub(super) struct StepSql<MySql> {
        read(scope: &str, key: &str) =
            "SELECT CONVERT(name USING utf8mb4), CAST(seq AS SIGNED), token, CAST(result AS CHAR), \
             DATE_FORMAT(created_at, '%Y-%m-%dT%H:%i:%s.%fZ') FROM {t}_steps \
             WHERE scope = ? AND `key` = ? ORDER BY seq, name";
        // Only while the holder's token is the marker's: the locking read makes a concurrent
        // takeover wait for this statement (and reads the latest marker if the takeover came
        // first). sqlx asks for found rows: a new row counts 1, a replaced one 2, and a row
        // with a token as large as this holder's (which no holder of the key writes twice)
        // would count 1 unchanged. A row left by an earlier life of the key (its marker deleted
        // without its steps) holds a smaller token and is replaced; the token is set last, as
        // the assignments read the row as the earlier ones left it.
        record(name: &str, seq: i64, result: &str, scope: &str, key: &str, token: i64) =
            "INSERT INTO {t}_steps (scope, `key`, name, seq, token, result, created_at) \
             SELECT m.scope, m.`key`, ?, ?, m.token, ?, UTC_TIMESTAMP(6) FROM {t} AS m \
             WHERE m.scope = ? AND m.`key` = ? AND m.token = ? AND m.state = 'in_progress' \
             LOCK IN SHARE MODE \
             ON DUPLICATE KEY UPDATE \
             seq = IF({t}_steps.token < VALUES(token), VALUES(seq), {t}_steps.seq), \
             result = IF({t}_steps.token < VALUES(token), VALUES(result), {t}_steps.result), \
             created_at = IF({t}_steps.token < VALUES(token), VALUES(created_at), \
             {t}_steps.created_at), \
             token = GREATEST({t}_steps.token, VALUES(token))";
        // With `forget`, once its marker is deleted (not when a marker in progress is only let
        // go: the next delivery resumes after its recorded steps).
        forget(scope: &str, key: &str, same_scope: &str, same_key: &str) =
            "DELETE FROM {t}_steps WHERE scope = ? AND `key` = ? \
             AND NOT EXISTS (SELECT 1 FROM {t} WHERE scope = ? AND `key` = ?)";
    }
}

impl Steps for MySql {
    async fn steps_read<'p>(
        pool: &'p Pool<Self>,
        sql: &'p MySqlSql,
        scope: &'p str,
        key: &'p str,
    ) -> Result<Vec<StepRow>, sqlx::Error> {
        sql.steps.read(scope, key).rows().fetch_all(pool).await
    }

    async fn step_record<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t MySqlSql,
        h: Holder<'t>,
        name: &'t str,
        seq: i64,
        json: &'t str,
    ) -> Result<bool, sqlx::Error> {
        let record = sql.steps.record(name, seq, json, h.scope, h.key, h.token);
        Ok(record.query().execute(conn).await?.rows_affected() > 0)
    }

    async fn steps_forget<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t MySqlSql,
        scope: &'t str,
        key: &'t str,
    ) -> Result<u64, sqlx::Error> {
        let forget = sql.steps.forget(scope, key, scope, key);
        Ok(forget.query().execute(conn).await?.rows_affected())
    }
}
