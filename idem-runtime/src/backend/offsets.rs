//! The offset-watermark mode's statements (`{t}_offsets`): per consumer group, topic and
//! partition, the next offset to process, moved in the claim's transaction.

use sqlx::Pool;

use super::bind::statements;
use super::{Backend, Partition, Sql, sql_runs};
use crate::options::ClaimOptions;

/// The partition a watermark statement names.
pub(super) const PARTITION: &str =
    "consumer_group = :group AND topic = :topic AND partition_id = :partition";

/// `read`, alike on every backend.
pub(super) const READ: &str = "SELECT partition_id, next_offset FROM {t}_offsets \
    WHERE consumer_group = :group AND topic = :topic ORDER BY partition_id";
/// `forget`, where a NULL bind needs no type (PostgreSQL's does).
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(super) const FORGET: &str = "DELETE FROM {t}_offsets WHERE consumer_group = :group \
    AND (:topic IS NULL OR topic = :topic)";

/// A first watermark where the backend can skip one another claim wrote first.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(super) const INSERT_OR_SKIP: &str = "INSERT INTO {t}_offsets (consumer_group, topic, \
    partition_id, next_offset, token) VALUES (:group, :topic, :partition, :next, :nonce) \
    ON CONFLICT DO NOTHING";

statements! {
    /// The watermark table's statements.
    pub(crate) struct OffsetSql, OffsetText {
        /// Moves the watermark to `next` if it is at most `first`, holding `nonce`.
        advance(group: &str, topic: &str, partition: i32, first: i64, next: i64, nonce: i64);
        /// The watermark, locked until the transaction ends (`FOR UPDATE`; SQLite's writer
        /// holds the database's write lock already).
        lock(group: &str, topic: &str, partition: i32);
        /// The first watermark of a partition, holding `nonce`: no row, or a duplicate-key
        /// error, where another transaction wrote one first.
        insert(group: &str, topic: &str, partition: i32, next: i64, nonce: i64);
        /// `(partition, next offset)` of every partition of the topic the group has one for.
        read(group: &str, topic: &str);
        /// Sets the watermark whatever it was.
        set(group: &str, topic: &str, partition: i32, next: i64);
        /// Deletes the group's watermarks of the topic (every topic: NULL).
        forget(group: &str, topic: Option<&str>);
    }
}

sql_runs! {
    /// Moves the watermark of `at` to `next` if it is at most `first` (every offset from
    /// `first` on is unprocessed), holding `nonce`; `Ok(false)` if it is above `first` or
    /// missing. MySQL counts the rows matched, changed or not (sqlx asks for found rows).
    offsets_advance(conn: &mut DB::Connection, at: Partition<'_>, first: i64, next: i64, nonce: i64)
        -> bool = offsets.advance(at.group, at.topic, at.partition, first, next, nonce).execute
        => |n| n == 1;
    /// The watermark of `at`, locked until the transaction ends; `None` if there is none.
    offsets_lock(conn: &mut DB::Connection, at: Partition<'_>) -> Option<i64> =
        offsets.lock(at.group, at.topic, at.partition).fetch_optional
        => |row: Option<(i64,)>| row.map(|(next,)| next);
    /// The watermarks of every partition of `topic` that `group` has one for.
    offsets_read(pool: &Pool<DB>, group: &str, topic: &str) -> Vec<(i32, i64)> =
        offsets.read(group, topic).fetch_all;
}

impl<DB: Backend> Sql<DB> {
    /// Writes the first watermark of `at`, holding `nonce`; `Ok(false)` if another
    /// transaction wrote one first.
    pub(crate) async fn offsets_insert(
        &self,
        conn: &mut DB::Connection,
        at: Partition<'_>,
        next: i64,
        nonce: i64,
    ) -> Result<bool, sqlx::Error> {
        let insert = self
            .offsets
            .insert(at.group, at.topic, at.partition, next, nonce);
        match insert.execute(conn).await {
            Ok(n) => Ok(n == 1),
            // MySQL's plain `INSERT` (its `IGNORE` would turn every error into a warning).
            Err(e)
                if e.as_database_error()
                    .is_some_and(|e| e.is_unique_violation()) =>
            {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Sets the watermark of `at` to `next`, whatever it was (operators: moving it back
    /// replays, moving it on skips). In a writer's transaction, as SQLite's writers take the
    /// write lock up front.
    pub(crate) async fn offsets_set(
        &self,
        pool: &Pool<DB>,
        at: Partition<'_>,
        next: i64,
    ) -> Result<(), sqlx::Error> {
        let mut tx = DB::begin(pool, self, &ClaimOptions::default()).await?;
        let set = self.offsets.set(at.group, at.topic, at.partition, next);
        set.execute(&mut *tx).await?;
        tx.commit().await
    }

    /// Deletes the watermarks of `group` for `topic` (every topic: `None`); returns how many.
    pub(crate) async fn offsets_forget(
        &self,
        pool: &Pool<DB>,
        group: &str,
        topic: Option<&str>,
    ) -> Result<u64, sqlx::Error> {
        let mut tx = DB::begin(pool, self, &ClaimOptions::default()).await?;
        let gone = self.offsets.forget(group, topic).execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(gone)
    }
}
