//! The offset watermarks on PostgreSQL (`{t}_offsets`): moved by one `UPDATE` on the fresh
//! path, read `FOR UPDATE` only when a claim meets offsets processed already.

use sqlx::{Pool, Postgres};

use super::PgSql;
use super::pinned::on_pool;
use crate::backend::Partition;
use crate::backend::sealed::{Outboxes as _, Watermarks};
use crate::backend::sql::statements;
use crate::outgoing::Pending;

statements! {
    /// The watermark table's statements.
    pub(super) struct OffsetSql<Postgres> {
        advance(group: &str, topic: &str, partition: i32, first: i64, next: i64, nonce: i64) =
            "UPDATE {t}_offsets SET next_offset = $5, token = $6, updated_at = now() \
             WHERE consumer_group = $1 AND topic = $2 AND partition_id = $3 \
             AND next_offset <= $4";
        lock(group: &str, topic: &str, partition: i32) =
            "SELECT next_offset FROM {t}_offsets \
             WHERE consumer_group = $1 AND topic = $2 AND partition_id = $3 FOR UPDATE";
        insert(group: &str, topic: &str, partition: i32, next: i64, nonce: i64) =
            "INSERT INTO {t}_offsets (consumer_group, topic, partition_id, next_offset, token) \
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING";
        read(group: &str, topic: &str) =
            "SELECT partition_id, next_offset FROM {t}_offsets \
             WHERE consumer_group = $1 AND topic = $2 ORDER BY partition_id";
        set(group: &str, topic: &str, partition: i32, next: i64) =
            "INSERT INTO {t}_offsets (consumer_group, topic, partition_id, next_offset) \
             VALUES ($1, $2, $3, $4) ON CONFLICT (consumer_group, topic, partition_id) \
             DO UPDATE SET next_offset = EXCLUDED.next_offset, token = NULL, updated_at = now()";
        // Every topic when `$2` is NULL.
        forget(group: &str, topic: Option<&str>) =
            "DELETE FROM {t}_offsets WHERE consumer_group = $1 \
             AND ($2::text IS NULL OR topic = $2)";
    }
}

impl Watermarks for Postgres {
    async fn offsets_advance<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t PgSql,
        at: Partition<'t>,
        first: i64,
        next: i64,
        nonce: i64,
    ) -> Result<bool, sqlx::Error> {
        let Partition {
            group,
            topic,
            partition,
        } = at;
        let statement = sql
            .offsets
            .advance(group, topic, partition, first, next, nonce);
        Ok(statement.query().execute(&mut *conn).await?.rows_affected() == 1)
    }

    async fn offsets_lock<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t PgSql,
        at: Partition<'t>,
    ) -> Result<Option<i64>, sqlx::Error> {
        let Partition {
            group,
            topic,
            partition,
        } = at;
        let statement = sql.offsets.lock(group, topic, partition);
        statement.scalar().fetch_optional(&mut *conn).await
    }

    async fn offsets_insert<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t PgSql,
        at: Partition<'t>,
        next: i64,
        nonce: i64,
    ) -> Result<bool, sqlx::Error> {
        let Partition {
            group,
            topic,
            partition,
        } = at;
        let statement = sql.offsets.insert(group, topic, partition, next, nonce);
        Ok(statement.query().execute(&mut *conn).await?.rows_affected() == 1)
    }

    async fn offsets_read<'p>(
        pool: &'p Pool<Self>,
        sql: &'p PgSql,
        group: &'p str,
        topic: &'p str,
    ) -> Result<Vec<(i32, i64)>, sqlx::Error> {
        on_pool(pool, sql, async |conn| {
            sql.offsets.read(group, topic).rows().fetch_all(conn).await
        })
        .await
    }

    async fn offsets_set<'p>(
        pool: &'p Pool<Self>,
        sql: &'p PgSql,
        at: Partition<'p>,
        next: i64,
    ) -> Result<(), sqlx::Error> {
        let Partition {
            group,
            topic,
            partition,
        } = at;
        let statement = sql.offsets.set(group, topic, partition, next);
        on_pool(pool, sql, async |conn| {
            statement.query().execute(conn).await
        })
        .await?;
        Ok(())
    }

    async fn offsets_forget<'p>(
        pool: &'p Pool<Self>,
        sql: &'p PgSql,
        group: &'p str,
        topic: Option<&'p str>,
    ) -> Result<u64, sqlx::Error> {
        let done = on_pool(pool, sql, async |conn| {
            sql.offsets.forget(group, topic).query().execute(conn).await
        })
        .await?;
        Ok(done.rows_affected())
    }

    async fn offsets_outbox_write<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t PgSql,
        outbox: &'t Pending,
        _: Partition<'t>,
        nonce: i64,
    ) -> Result<(), sqlx::Error> {
        // An aborted transaction refuses every later statement: the outbox's own write needs
        // no fence here.
        Self::outbox_write(conn, sql, outbox, nonce).await
    }
}
