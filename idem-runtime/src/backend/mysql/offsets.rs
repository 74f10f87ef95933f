//! The offset watermarks on MySQL and MariaDB (`{t}_offsets`): moved by one `UPDATE` on the
//! fresh path, read `FOR UPDATE` only when a claim meets offsets processed already; a first
//! watermark is a plain `INSERT`, whose duplicate-key error says another claim wrote it first.

use sqlx::{MySql, Pool};

use super::{ER_DUP_ENTRY, MySqlSql, number};
use crate::backend::Partition;
use crate::backend::sealed::Watermarks;
use crate::backend::sql::statements;
use crate::outgoing::Pending;

statements! {
    /// The watermark table's statements. Times are UTC, as the markers'.
    pub(super) struct OffsetSql<MySql> {
        advance(next: i64, nonce: i64, group: &str, topic: &str, partition: i32, first: i64) =
            "UPDATE {t}_offsets SET next_offset = ?, token = ?, updated_at = UTC_TIMESTAMP(6) \
             WHERE consumer_group = ? AND topic = ? AND partition_id = ? AND next_offset <= ?";
        lock(group: &str, topic: &str, partition: i32) =
            "SELECT next_offset FROM {t}_offsets \
             WHERE consumer_group = ? AND topic = ? AND partition_id = ? FOR UPDATE";
        insert(group: &str, topic: &str, partition: i32, next: i64, nonce: i64) =
            "INSERT INTO {t}_offsets (consumer_group, topic, partition_id, next_offset, token, \
             updated_at) VALUES (?, ?, ?, ?, ?, UTC_TIMESTAMP(6))";
        read(group: &str, topic: &str) =
            "SELECT partition_id, next_offset FROM {t}_offsets \
             WHERE consumer_group = ? AND topic = ? ORDER BY partition_id";
        set(group: &str, topic: &str, partition: i32, next: i64) =
            "INSERT INTO {t}_offsets (consumer_group, topic, partition_id, next_offset, \
             updated_at) VALUES (?, ?, ?, ?, UTC_TIMESTAMP(6)) ON DUPLICATE KEY UPDATE \
             next_offset = VALUES(next_offset), token = NULL, updated_at = UTC_TIMESTAMP(6)";
        // Every topic when the topic is NULL.
        forget(group: &str, topic: Option<&str>, same_topic: Option<&str>) =
            "DELETE FROM {t}_offsets WHERE consumer_group = ? AND (? IS NULL OR topic = ?)";
        // A deadlock in the body rolls the transaction back and later statements run in
        // autocommit: a message is written only while the watermark holds the claim's nonce,
        // which it does only inside the claim's transaction (or once it committed).
        outbox_write(id: &str, destination: &str, payload: &[u8], scope: &str, key: &str, seq: i64, group: &str, topic: &str, partition: i32, nonce: i64) =
            "INSERT INTO {t}_outbox (id, destination, payload, scope, `key`, seq, created_at, \
             next_attempt_at) SELECT ?, ?, ?, ?, ?, ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) \
             FROM {t}_offsets AS w WHERE w.consumer_group = ? AND w.topic = ? \
             AND w.partition_id = ? AND w.token = ? ON DUPLICATE KEY UPDATE id = id";
    }
}

impl Watermarks for MySql {
    async fn offsets_advance<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t MySqlSql,
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
            .advance(next, nonce, group, topic, partition, first);
        // sqlx asks for found rows: the count is of rows matched, changed or not.
        Ok(statement.query().execute(&mut *conn).await?.rows_affected() == 1)
    }

    async fn offsets_lock<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t MySqlSql,
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
        sql: &'t MySqlSql,
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
        match statement.query().execute(&mut *conn).await {
            Ok(_) => Ok(true),
            Err(e) if number(&e) == Some(ER_DUP_ENTRY) => Ok(false),
            Err(e) => Err(e),
        }
    }

    async fn offsets_read<'p>(
        pool: &'p Pool<Self>,
        sql: &'p MySqlSql,
        group: &'p str,
        topic: &'p str,
    ) -> Result<Vec<(i32, i64)>, sqlx::Error> {
        sql.offsets.read(group, topic).rows().fetch_all(pool).await
    }

    async fn offsets_set<'p>(
        pool: &'p Pool<Self>,
        sql: &'p MySqlSql,
        at: Partition<'p>,
        next: i64,
    ) -> Result<(), sqlx::Error> {
        let Partition {
            group,
            topic,
            partition,
        } = at;
        let statement = sql.offsets.set(group, topic, partition, next);
        statement.query().execute(pool).await?;
        Ok(())
    }

    async fn offsets_forget<'p>(
        pool: &'p Pool<Self>,
        sql: &'p MySqlSql,
        group: &'p str,
        topic: Option<&'p str>,
    ) -> Result<u64, sqlx::Error> {
        let statement = sql.offsets.forget(group, topic, topic);
        Ok(statement.query().execute(pool).await?.rows_affected())
    }

    async fn offsets_outbox_write<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t MySqlSql,
        outbox: &'t Pending,
        at: Partition<'t>,
        nonce: i64,
    ) -> Result<(), sqlx::Error> {
        let Partition {
            group,
            topic,
            partition,
        } = at;
        for (key, m) in outbox.rows() {
            let write = sql.offsets.outbox_write(
                &m.id,
                &m.destination,
                &m.payload,
                outbox.scope(),
                key,
                i64::from(m.seq),
                group,
                topic,
                partition,
                nonce,
            );
            write.query().execute(&mut *conn).await?;
        }
        Ok(())
    }
}
