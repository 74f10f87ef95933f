//! The offset-watermark mode: records of a Kafka partition claimed by their offsets. For each
//! (consumer group, topic, partition) the database holds the next offset to process, moved in
//! the transaction of the records' effects; a record below it was processed (a duplicate),
//! with no marker per record. Kafka's own offsets are then advisory: a consumer starts each
//! partition it is given at the watermark.

pub(crate) mod claim;
mod group;
mod guard;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt::Write as _;

use sha2::{Digest as _, Sha256};

use self::claim::{Offsets, Span};
use crate::backend::{Backend, Partition};
use crate::claim::run::{Attempt, begun, conclude, retrying_in_span};
use crate::claim::{Claimed, Kept, Request, TxHeld};
use crate::error::{Error, Refusal};
use crate::key::{Key, MAX_BATCH, MAX_KEY_LEN};
use crate::observe::{Answer, Observed, Site};
use crate::options::{ClaimOptions, Mode};
use crate::outcome::Batch;
use crate::store::Store;

pub(crate) use guard::Held;
pub use guard::OffsetGuard;

/// The longest consumer group name and topic name accepted, in bytes (Kafka's own limit for
/// topics is 249).
pub const MAX_NAME_LEN: usize = 255;

/// Where a record is: its topic, its partition, its offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RecordOffset<'a> {
    /// The topic.
    pub topic: &'a str,
    /// The partition of the topic.
    pub partition: i32,
    /// The record's offset in the partition.
    pub offset: i64,
}

impl RecordOffset<'_> {
    /// The record's key for the per-message marker mode and for its outbox's message ids:
    /// see [`record_key`].
    pub fn key(&self) -> Key {
        record_key(self.topic, self.partition, self.offset)
    }
}

/// The key of the record at `offset` of `topic`'s `partition`: `topic/partition/offset`, or,
/// when that is longer than [`MAX_KEY_LEN`], `sha256:` and the hex digest of it.
///
/// Two records of a topic never share it. It names a record by its place in the log, so a
/// record that a producer sent twice (two places) gets two keys: for those topics, key the
/// per-message marker mode by an id the producer sets (a header) instead.
pub fn record_key(topic: &str, partition: i32, offset: i64) -> Key {
    let plain = format!("{topic}/{partition}/{offset}");
    let text = match plain.len() {
        0..=MAX_KEY_LEN if !plain.contains('\0') => plain,
        _ => {
            let mut hex = String::from("sha256:");
            for byte in Sha256::digest(plain.as_bytes()) {
                let _ = write!(hex, "{byte:02x}");
            }
            hex
        }
    };
    Key::new(text.as_str()).expect("at most 255 bytes, never empty, no NUL")
}

fn refused(reason: String) -> Error {
    Error::Refused(Refusal::Offsets { reason })
}

/// A consumer group or topic name: 1 to [`MAX_NAME_LEN`] bytes, no NUL.
pub(crate) fn check_name(what: &str, name: &str) -> Result<(), Error> {
    if name.is_empty() || name.len() > MAX_NAME_LEN || name.contains('\0') {
        return Err(refused(format!(
            "the {what} {name:?} is not 1 to {MAX_NAME_LEN} bytes without NUL: name the {what} \
             as the broker does"
        )));
    }
    Ok(())
}

fn check_partition(partition: i32) -> Result<(), Error> {
    if partition < 0 {
        return Err(refused(format!(
            "partition {partition} is negative: give the partition the broker delivered"
        )));
    }
    Ok(())
}

/// The spans of `records`, one per partition, in the order of (topic, partition); refused
/// before any I/O when a record is malformed or a partition's offsets do not rise.
pub(crate) fn spans(records: &[RecordOffset<'_>]) -> Result<Vec<Span>, Error> {
    if records.len() > MAX_BATCH {
        return Err(refused(format!(
            "{} records are more than the {MAX_BATCH} one claim takes: claim them in smaller \
             batches",
            records.len()
        )));
    }
    let mut spans: BTreeMap<(&str, i32), Span> = BTreeMap::new();
    for r in records {
        check_name("topic", r.topic)?;
        check_partition(r.partition)?;
        if !(0..i64::MAX).contains(&r.offset) {
            return Err(refused(format!(
                "offset {} of {:?} partition {} is out of range: give the offset the broker \
                 delivered",
                r.offset, r.topic, r.partition
            )));
        }
        match spans.get_mut(&(r.topic, r.partition)) {
            Some(span) if r.offset <= span.last => {
                return Err(refused(format!(
                    "offset {} of {:?} partition {} follows offset {} in the batch: a \
                     partition's records must come in the order of their offsets, as the \
                     broker delivers them",
                    r.offset, r.topic, r.partition, span.last
                )));
            }
            Some(span) => span.last = r.offset,
            None => {
                let span = Span {
                    topic: r.topic.to_owned(),
                    partition: r.partition,
                    first: r.offset,
                    last: r.offset,
                };
                spans.insert((r.topic, r.partition), span);
            }
        }
    }
    Ok(spans.into_values().collect())
}

impl<DB: Backend> Store<DB> {
    /// Claims the records of `group` at `records` by their offsets (the offset-watermark
    /// mode), in a transaction of its own, and says which ones this delivery holds.
    ///
    /// For each partition among the records the database holds a watermark, the next offset
    /// to process. A record at or above it is fresh; one below it was processed by an earlier
    /// delivery and is a duplicate, with no marker per record. The claim moves each
    /// partition's watermark past its last record in the claim's transaction, so that it
    /// commits with the fresh records' effects (run them on [`OffsetGuard::tx`], end with
    /// [`OffsetGuard::finish`]) or not at all. A partition the database has never seen has no
    /// watermark: all its records are fresh, and the claim writes its first.
    ///
    /// A claim of a partition whose records another delivery holds waits for that
    /// transaction, then decides on what it committed: the watermark only moves forward, and
    /// a delivery that lost the partition in a rebalance never moves it back, whatever its
    /// records (the check is the stored offset, in SQL, not the worker's memory). Records
    /// older than the watermark (a consumer group reset to an earlier offset, a replay) are
    /// duplicates: to process them again, move the watermark back with
    /// [`set_watermark`](Store::set_watermark).
    ///
    /// Records may come from several partitions (a poll's batch); a partition's records must
    /// come in the order of their offsets. Refused before any I/O
    /// ([`Refusal::Offsets`]): an empty or over-long group or topic
    /// ([`MAX_NAME_LEN`]), a negative partition or offset, a partition's offsets out of
    /// order, more than [`MAX_BATCH`] records; and a claim inside the open transaction of another
    /// claim of this task ([`Refusal::Nested`]). An empty batch does no I/O.
    ///
    /// The call has one `idem.claim` span (mode `offsets`, scope the group) and counts each
    /// record's outcome in `idem_outcomes_total`; the guard's outbox, body and verified
    /// commit are those of every mode.
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// # #[cfg(feature = "sqlite")]
    /// # async fn f(store: &idem::Store<sqlx::Sqlite>) -> Result<(), idem::Error> {
    /// use idem::offsets::RecordOffset;
    ///
    /// let records = [
    ///     RecordOffset { topic: "orders", partition: 0, offset: 41 },
    ///     RecordOffset { topic: "orders", partition: 0, offset: 42 },
    /// ];
    /// let mut claim = store.claim_offsets("billing", &records).await?;
    /// let fresh: Vec<usize> = (0..records.len()).filter(|i| claim.is_fresh(*i)).collect();
    /// let result: Result<(), idem::Error> = async {
    ///     if let Some(tx) = claim.tx() {
    ///         for i in &fresh {
    ///             sqlx::query("INSERT INTO credits (record) VALUES (?)")
    ///                 .bind(records[*i].offset).execute(&mut **tx).await?;
    ///         }
    ///     }
    ///     Ok(())
    /// }.await;
    /// let batch = claim.finish(result).await?;
    /// assert_eq!(batch.outcomes().len(), records.len());
    /// # Ok(()) }
    /// ```
    pub async fn claim_offsets(
        &self,
        group: &str,
        records: &[RecordOffset<'_>],
    ) -> Result<OffsetGuard<DB>, Error> {
        check_name("consumer group", group)?;
        let spans = spans(records)?;
        let Some(first) = records.first() else {
            return Ok(OffsetGuard::done(0));
        };
        let scope = Cow::Owned(group.to_owned());
        let request = Request::new(scope, first.key(), ClaimOptions::new(), CALLER);
        let (from, held) = claim(self, request, group, &spans, records.len()).await?;
        Ok(OffsetGuard::claimed(
            records,
            &spans,
            &from,
            held.map(Held::Own),
        ))
    }

    /// The watermarks of `group` on `topic`: `(partition, next offset)` for every partition
    /// that has one, by partition.
    pub async fn watermarks(&self, group: &str, topic: &str) -> Result<Vec<(i32, i64)>, Error> {
        check_name("consumer group", group)?;
        check_name("topic", topic)?;
        Ok(self.sql().offsets_read(self.pool(), group, topic).await?)
    }

    /// Sets the watermark of `group` on `topic`'s `partition` to `next`, whatever it was: for
    /// operators. Moving it back makes the records from `next` on fresh again (a replay that
    /// runs their effects again); moving it on skips records. A consumer that holds the
    /// partition keeps reading where it is: restart it (or let the group rebalance) to start
    /// at the new watermark.
    pub async fn set_watermark(
        &self,
        group: &str,
        topic: &str,
        partition: i32,
        next: i64,
    ) -> Result<(), Error> {
        check_name("consumer group", group)?;
        check_name("topic", topic)?;
        check_partition(partition)?;
        if next < 0 {
            return Err(refused(format!("the next offset {next} is negative")));
        }
        let at = Partition {
            group,
            topic,
            partition,
        };
        Ok(self.sql().offsets_set(self.pool(), at, next).await?)
    }

    /// Deletes the watermarks of `group` on `topic` (on every topic: `None`), for a consumer
    /// group that is retired; returns how many. A consumer of the group that is given one of
    /// those partitions later starts it as a partition never seen.
    pub async fn forget_watermarks(&self, group: &str, topic: Option<&str>) -> Result<u64, Error> {
        check_name("consumer group", group)?;
        if let Some(topic) = topic {
            check_name("topic", topic)?;
        }
        Ok(self.sql().offsets_forget(self.pool(), group, topic).await?)
    }
}

/// Who claims, as spans and a refused nested call name it.
const CALLER: &str = "Store::claim_offsets";

/// The claim: observed, refused inside another claim's body, retried after a lost race.
async fn claim<DB: Backend>(
    store: &Store<DB>,
    request: Request,
    group: &str,
    spans: &[Span],
    records: usize,
) -> Result<(claim::From, Option<TxHeld<'static, DB>>), Error> {
    let site = Site::of(group);
    let observed = Observed::counted(site, group, Mode::Offsets, records, request.about);
    // Offset claims link no producer: their options are the defaults.
    let mut observed = begun(observed, &request, Mode::Offsets, true)?;
    let mut attempts = Offsets {
        store,
        request: &request,
        group,
        spans,
    };
    let answer = retrying_in_span::<DB, _>(&mut observed, &request, true, &mut attempts).await;
    match answer {
        Ok(Attempt::Done(_)) => {
            observed.decided(Answer::Duplicate);
            observed.ended_batch::<(), ()>(&Ok(Batch::new(&vec![false; records], None)));
            Ok((vec![None; spans.len()], None))
        }
        other => {
            let sql = store.shared_sql().clone();
            let held = conclude(observed, request, other, |(tx, from), ticket| {
                let kept = kept(group, spans, &from);
                (from, TxHeld::new(tx, sql, false, ticket).keeping(kept))
            })?;
            match held {
                Claimed::Fresh((from, held)) => Ok((from, Some(held))),
                _ => unreachable!("duplicates end above"),
            }
        }
    }
}

/// The watermark a fresh claim's commit looks for: its first partition with a fresh record.
pub(crate) fn kept(group: &str, spans: &[Span], from: &claim::From) -> Kept {
    let span = spans
        .iter()
        .zip(from)
        .find_map(|(span, from)| from.map(|_| span))
        .expect("a fresh claim has a fresh partition");
    Kept::Watermark {
        group: group.to_owned(),
        topic: span.topic.clone(),
        partition: span.partition,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(topic: &str, partition: i32, offset: i64) -> RecordOffset<'_> {
        RecordOffset {
            topic,
            partition,
            offset,
        }
    }

    #[test]
    fn a_record_key_names_its_place_and_long_ones_are_digested() {
        assert_eq!(record_key("orders", 3, 42).as_str(), "orders/3/42");
        let long = "t".repeat(255);
        let key = record_key(&long, 0, 1);
        assert!(key.as_str().starts_with("sha256:") && key.as_str().len() == 71);
        assert_ne!(key, record_key(&long, 0, 2));
    }

    #[test]
    fn spans_group_records_by_partition_in_partition_order() {
        let got = spans(&[at("b", 1, 5), at("a", 0, 7), at("b", 1, 9), at("a", 2, 1)]).unwrap();
        let got: Vec<_> = got
            .iter()
            .map(|s| (s.topic.as_str(), s.partition, s.first, s.last))
            .collect();
        assert_eq!(got, [("a", 0, 7, 7), ("a", 2, 1, 1), ("b", 1, 5, 9)]);
    }

    #[test]
    fn malformed_offsets_are_refused() {
        for bad in [
            vec![at("", 0, 1)],
            vec![at("t", -1, 1)],
            vec![at("t", 0, -1)],
            vec![at("t", 0, i64::MAX)],
            vec![at("t", 0, 5), at("t", 0, 5)],
            vec![at("t", 0, 5), at("t", 0, 4)],
            vec![at("t\0", 0, 5)],
        ] {
            assert!(
                matches!(spans(&bad), Err(Error::Refused(Refusal::Offsets { .. }))),
                "{bad:?}"
            );
        }
        let many: Vec<_> = (0..=MAX_BATCH as i64).map(|o| at("t", 0, o)).collect();
        assert!(matches!(
            spans(&many),
            Err(Error::Refused(Refusal::Offsets { .. }))
        ));
    }
}
