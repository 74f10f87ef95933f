//! The offset watermarks on SQLite (`{t}_offsets`): writers take turns on the database's
//! write lock, which a claim holds from its `BEGIN IMMEDIATE`, so a read needs no row lock.

use sqlx::{Pool, Sqlite};

use super::{SqliteSql, begin};
use crate::backend::Partition;
use crate::backend::sealed::Watermarks;
use crate::backend::sql::statements;
use crate::outgoing::Pending;

/// The time a statement writes, as ISO-8601 UTC text (the markers' format).
macro_rules! now {
    () => {
        "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')"
    };
}

statements! {
    /// The watermark table's statements.
    pub(super) struct OffsetSql<Sqlite> {
        advance(group: &str, topic: &str, partition: i32, first: i64, next: i64, nonce: i64) =
            concat!(
                "UPDATE {t}_offsets SET next_offset = ?5, token = ?6, updated_at = ", now!(),
                " WHERE consumer_group = ?1 AND topic = ?2 AND partition_id = ?3 \
                 AND next_offset <= ?4"
            );
        lock(group: &str, topic: &str, partition: i32) =
            "SELECT next_offset FROM {t}_offsets \
             WHERE consumer_group = ?1 AND topic = ?2 AND partition_id = ?3";
        insert(group: &str, topic: &str, partition: i32, next: i64, nonce: i64) =
            "INSERT INTO {t}_offsets (consumer_group, topic, partition_id, next_offset, token) \
             VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT DO NOTHING";
        read(group: &str, topic: &str) =
            "SELECT partition_id, next_offset FROM {t}_offsets \
             WHERE consumer_group = ?1 AND topic = ?2 ORDER BY partition_id";
        set(group: &str, topic: &str, partition: i32, next: i64) = concat!(
            "INSERT INTO {t}_offsets (consumer_group, topic, partition_id, next_offset) \
             VALUES (?1, ?2, ?3, ?4) ON CONFLICT (consumer_group, topic, partition_id) \
             DO UPDATE SET next_offset = excluded.next_offset, token = NULL, updated_at = ",
            now!()
        );
        // Every topic when `?2` is NULL.
        forget(group: &str, topic: Option<&str>) =
            "DELETE FROM {t}_offsets WHERE consumer_group = ?1 AND (?2 IS NULL OR topic = ?2)";
        // A statement that rolled the transaction back ends it, and later ones run in
        // autocommit: a message is written only while the watermark holds the claim's nonce,
        // which it does only inside the claim's transaction (or once it committed).
        outbox_write(id: &str, destination: &str, payload: &[u8], seq: i64, scope: &str, key: &str, group: &str, topic: &str, partition: i32, nonce: i64) =
            "INSERT INTO {t}_outbox (id, destination, payload, scope, key, seq) \
             SELECT ?1, ?2, ?3, ?5, ?6, ?4 FROM {t}_offsets AS w \
             WHERE w.consumer_group = ?7 AND w.topic = ?8 AND w.partition_id = ?9 \
             AND w.token = ?10 ON CONFLICT DO NOTHING";
    }
}

impl Watermarks for Sqlite {
    async fn offsets_advance<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t SqliteSql,
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
        sql: &'t SqliteSql,
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
        sql: &'t SqliteSql,
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
        sql: &'p SqliteSql,
        group: &'p str,
        topic: &'p str,
    ) -> Result<Vec<(i32, i64)>, sqlx::Error> {
        sql.offsets.read(group, topic).rows().fetch_all(pool).await
    }

    async fn offsets_set<'p>(
        pool: &'p Pool<Self>,
        sql: &'p SqliteSql,
        at: Partition<'p>,
        next: i64,
    ) -> Result<(), sqlx::Error> {
        // `BEGIN IMMEDIATE`, as every writer here.
        let mut tx = begin(pool).await?;
        let Partition {
            group,
            topic,
            partition,
        } = at;
        let statement = sql.offsets.set(group, topic, partition, next);
        statement.query().execute(&mut *tx).await?;
        tx.commit().await
    }

    async fn offsets_forget<'p>(
        pool: &'p Pool<Self>,
        sql: &'p SqliteSql,
        group: &'p str,
        topic: Option<&'p str>,
    ) -> Result<u64, sqlx::Error> {
        let mut tx = begin(pool).await?;
        let done = sql
            .offsets
            .forget(group, topic)
            .query()
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(done.rows_affected())
    }

    async fn offsets_outbox_write<'t>(
        conn: &'t mut Self::Connection,
        sql: &'t SqliteSql,
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
                i64::from(m.seq),
                outbox.scope(),
                key,
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
