//! A batch of records claimed by their offsets through the consumer: the offset claim, and
//! what the consumer does when it ends (Kafka's commit after the database's, or the batch's
//! partitions moved back to its first records when nothing was kept).

use sqlx::Transaction;

use super::Consumer;
use super::record::Record;
use crate::backend::Backend;
use crate::claim::nested::Body;
use crate::error::Error;
use crate::offsets::OffsetGuard;
use crate::outcome::Batch;
use crate::outgoing::BatchOutbox;

/// Each partition of a batch: its first and its last record's offset.
pub(super) type Spans = Vec<(String, i32, i64, i64)>;

/// The partitions of `records`, each with its first and last offset, in first-seen order.
pub(super) fn spans(records: &[Record]) -> Spans {
    let mut spans: Spans = Vec::new();
    for r in records {
        match spans
            .iter_mut()
            .find(|(t, p, ..)| t == r.topic() && *p == r.partition())
        {
            Some(span) => {
                span.2 = span.2.min(r.offset());
                span.3 = span.3.max(r.offset());
            }
            None => spans.push((r.topic().to_owned(), r.partition(), r.offset(), r.offset())),
        }
    }
    spans
}

/// A batch of records claimed through the [`Consumer`] (the offset-watermark mode): which
/// records this delivery holds, and the open transaction holding them.
///
/// What [`OffsetGuard`] is, plus the consumer's part of the end: once
/// [`finish`](Claim::finish) committed, each partition's next offset is committed to Kafka
/// with the consumer's next poll (advisory: for lag monitoring; the consumer never starts
/// from it); when nothing was
/// kept (`finish` with `Err`, a rolled-back commit, [`release`](Claim::release), or dropping
/// the claim), each partition of the batch is moved back to its first record, so that the
/// next batch brings the same records again rather than the ones after them.
#[derive(Debug)]
#[must_use = "a claim may hold an open transaction: run the fresh records and call `finish`"]
pub struct Claim<'c, DB: Backend> {
    guard: Option<OffsetGuard<DB>>,
    consumer: &'c Consumer<DB>,
    spans: Spans,
}

impl<'c, DB: Backend> Claim<'c, DB> {
    pub(super) fn new(guard: OffsetGuard<DB>, consumer: &'c Consumer<DB>, spans: Spans) -> Self {
        Claim {
            guard: Some(guard),
            consumer,
            spans,
        }
    }

    fn guard(&self) -> &OffsetGuard<DB> {
        self.guard.as_ref().expect("held until the claim ends")
    }

    fn guard_mut(&mut self) -> &mut OffsetGuard<DB> {
        self.guard.as_mut().expect("held until the claim ends")
    }

    /// `true` if this delivery holds the record at `position` of the batch: run its effect.
    ///
    /// # Panics
    ///
    /// If `position` is not below the batch's length.
    pub fn is_fresh(&self, position: usize) -> bool {
        self.guard().is_fresh(position)
    }

    /// For each record of the batch, whether this delivery holds it.
    pub fn fresh(&self) -> &[bool] {
        self.guard().fresh()
    }

    /// `true` if at least one record is fresh.
    pub fn any_fresh(&self) -> bool {
        self.guard().any_fresh()
    }

    /// The transaction the fresh records' effects run on; `None` when every record was a
    /// duplicate.
    pub fn tx(&mut self) -> Option<&mut Transaction<'static, DB>> {
        self.guard_mut().tx()
    }

    /// The outbox of the fresh records, each message naming its record by
    /// [`Record::offset_key`].
    pub fn outbox(&mut self) -> &mut BatchOutbox {
        self.guard_mut().outbox()
    }

    /// The transaction and the outbox at once; `None` as for [`tx`](Claim::tx).
    pub fn parts(&mut self) -> Option<(&mut Transaction<'static, DB>, &mut BatchOutbox)> {
        self.guard_mut().parts()
    }

    /// The call's `idem.claim` span; `None` when every record was a duplicate.
    pub fn span(&self) -> Option<&tracing::Span> {
        self.guard().span()
    }

    /// The body, to run in the call's span, marked as inside its open transaction; `None`
    /// when every record was a duplicate.
    pub fn body(&self) -> Option<Body> {
        self.guard().body()
    }

    /// Ends the claim: commits on `Ok` (the next offsets go to Kafka with the next poll),
    /// rolls back on `Err` (then moves the batch's partitions back to its first records).
    /// See [`OffsetGuard::finish`] for what the outcomes say.
    pub async fn finish<T, E: From<Error>>(mut self, result: Result<T, E>) -> Result<Batch<T>, E> {
        let guard = self.guard.take().expect("held until the claim ends");
        let done = guard.finish(result).await;
        match &done {
            Ok(_) => self.consumer.claimed(&self.spans),
            Err(_) => self.consumer.seek_back(&self.spans),
        }
        done
    }

    /// Gives up: rolls back, and moves the batch's partitions back to its first records.
    pub async fn release(mut self) {
        if let Some(guard) = self.guard.take() {
            guard.release().await;
        }
        self.consumer.seek_back(&self.spans);
    }
}

impl<DB: Backend> Drop for Claim<'_, DB> {
    fn drop(&mut self) {
        // Dropped unfinished (a panic, a cancelled future): the guard's transaction rolls back
        // as it drops, and the records must come again.
        if self.guard.is_some() {
            self.consumer.seek_back(&self.spans);
        }
    }
}
