use sqlx::{Pool, Postgres, Transaction};

use super::{Backend, Sql, sealed};

impl sealed::Sealed for Postgres {}

// `key` and `scope` are not reserved words in PostgreSQL. The partial index serves purges of
// completed markers by age without touching in-flight ones.
const DDL: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS {t} (
        scope text NOT NULL,
        key text NOT NULL,
        state text NOT NULL DEFAULT 'completed' CHECK (state IN ('in_progress', 'completed')),
        fingerprint bytea,
        result jsonb,
        locked_until timestamptz,
        token bigint,
        attempts integer NOT NULL DEFAULT 1,
        created_at timestamptz NOT NULL DEFAULT now(),
        completed_at timestamptz,
        PRIMARY KEY (scope, key)
    )",
    "CREATE INDEX IF NOT EXISTS {t}_completed_at ON {t} (completed_at) WHERE state = 'completed'",
];

impl Backend for Postgres {
    const BACKEND: &'static str = "postgres";

    fn sql(table: &str) -> Sql {
        Sql::new(
            table,
            "BEGIN",
            [
                "INSERT INTO {t} (scope, key, completed_at) VALUES ($1, $2, now()) \
                 ON CONFLICT DO NOTHING",
                "DELETE FROM {t} WHERE scope = $1 AND key = $2",
                // Selecting the batch by ctid makes each batch a TID scan; an `IN (SELECT
                // scope, key ...)` ran as a hash join over the whole table, every batch.
                "DELETE FROM {t} WHERE ctid = ANY (ARRAY(SELECT ctid FROM {t} \
                 WHERE state = 'completed' AND completed_at < now() - $1 * interval '1 millisecond' \
                 LIMIT $2))",
            ],
            DDL,
        )
    }

    super::claim_on_conflict!();

    fn is_transient(err: &sqlx::Error) -> bool {
        // serialization_failure (REPEATABLE READ / SERIALIZABLE) and deadlock_detected.
        matches!(database_code(err).as_deref(), Some("40001" | "40P01"))
    }

    async fn migrate<'p>(pool: &'p Pool<Self>, sql: &'p Sql) -> Result<(), sqlx::Error> {
        // Concurrent `CREATE TABLE IF NOT EXISTS` can still fail on the catalog's unique
        // index; a transaction-scoped advisory lock makes the workers take turns.
        let mut tx = pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('idem.migrate.' || $1))")
            .bind(&sql.table)
            .execute(&mut *tx)
            .await?;
        for stmt in &sql.ddl {
            sqlx::query(stmt.clone()).execute(&mut *tx).await?;
        }
        tx.commit().await
    }

    super::pool_statements!();
}

fn database_code(err: &sqlx::Error) -> Option<String> {
    err.as_database_error()
        .and_then(|e| e.code())
        .map(|c| c.into_owned())
}
