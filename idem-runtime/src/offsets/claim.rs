//! An offset claim's statements, in a transaction of its own: each partition's watermark moved
//! past the claim's records in the order of their partitions (so that two claims of the same
//! partitions lock their rows in one order), read `FOR UPDATE` only when a record below it is
//! met.

use std::future::Future;

use sqlx::Transaction;

use crate::backend::{Backend, Partition, Sql};
use crate::claim::RECHECKS;
use crate::claim::run::{Attempt, Attempts};
use crate::claim::{Claimed, Request};
use crate::store::Store;

/// The records of one partition in a claim: its offsets from `first` to `last`.
#[derive(Debug, Clone)]
pub(crate) struct Span {
    pub(crate) topic: String,
    pub(crate) partition: i32,
    pub(crate) first: i64,
    pub(crate) last: i64,
}

impl Span {
    pub(crate) fn at<'a>(&'a self, group: &'a str) -> Partition<'a> {
        Partition {
            group,
            topic: &self.topic,
            partition: self.partition,
        }
    }
}

/// For each span, the first offset this claim holds (records from it on are fresh), or `None`
/// when every record of the span was processed already.
pub(crate) type From = Vec<Option<i64>>;

/// Moves the watermark of one span past its last record: `Some(first fresh offset)`, or `None`
/// if the watermark is past it already.
pub(crate) async fn move_one<DB: Backend>(
    conn: &mut DB::Connection,
    sql: &Sql<DB>,
    at: Partition<'_>,
    span: &Span,
    nonce: i64,
) -> Result<Result<Option<i64>, ()>, sqlx::Error> {
    let next = span.last + 1;
    // The fresh path: every record of the span is at or above the watermark.
    if sql
        .offsets_advance(conn, at, span.first, next, nonce)
        .await?
    {
        return Ok(Ok(Some(span.first)));
    }
    for _ in 0..RECHECKS {
        match sql.offsets_lock(conn, at).await? {
            Some(watermark) if watermark > span.last => return Ok(Ok(None)),
            Some(watermark) => {
                // Locked: the watermark cannot move under this claim now.
                let moved = sql
                    .offsets_advance(conn, at, watermark, next, nonce)
                    .await?;
                debug_assert!(moved, "a locked watermark at or below the span moves");
                return Ok(Ok(Some(watermark.max(span.first))));
            }
            // A partition never seen: its first watermark, unless another claim wrote one
            // meanwhile (read it then, locked).
            None => {
                if sql.offsets_insert(conn, at, next, nonce).await? {
                    return Ok(Ok(Some(span.first)));
                }
            }
        }
    }
    // Written and deleted over and over (an operator forgetting the group): let it settle.
    Ok(Err(()))
}

/// One attempt of an offset claim.
pub(super) struct Offsets<'a, DB: Backend> {
    pub(super) store: &'a Store<DB>,
    pub(super) request: &'a Request,
    pub(super) group: &'a str,
    pub(super) spans: &'a [Span],
}

impl<DB: Backend> Attempts for Offsets<'_, DB> {
    type Fresh = (Transaction<'static, DB>, From);

    fn attempt(
        &mut self,
    ) -> impl Future<Output = Result<Attempt<Self::Fresh>, sqlx::Error>> + Send {
        attempt(self.store, self.request, self.group, self.spans)
    }
}

/// The begin, then each span's watermark; a transaction that holds nothing is ended before the
/// answer.
async fn attempt<DB: Backend>(
    store: &Store<DB>,
    request: &Request,
    group: &str,
    spans: &[Span],
) -> Result<Attempt<(Transaction<'static, DB>, From)>, sqlx::Error> {
    let (sql, options) = (store.sql(), &request.options);
    let mut tx = DB::begin(store.pool(), sql, options).await?;
    let mut from = Vec::with_capacity(spans.len());
    for span in spans {
        match move_one::<DB>(&mut tx, sql, span.at(group), span, request.nonce).await {
            Ok(Ok(fresh)) => from.push(fresh),
            Ok(Err(())) => {
                DB::discard(tx, options).await?;
                return Ok(Attempt::Refused(request.in_progress()));
            }
            Err(e) => {
                drop(DB::rollback(tx, options).await);
                return Err(e);
            }
        }
    }
    if from.iter().all(Option::is_none) {
        DB::discard(tx, options).await?;
        return Ok(Attempt::Done(Claimed::Duplicate));
    }
    Ok(Attempt::Fresh((tx, from), false))
}
