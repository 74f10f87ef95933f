//! Offset claims in a group: the watermarks of a batch of records moved in a savepoint of a
//! lane's transaction, so that concurrent consumers (one per partition, typically) share one
//! commit. The statements are the offset mode's own; the hold, its end and the generation's
//! commit are a group member's.

use std::borrow::Cow;
use std::sync::Arc;

use super::claim::{From, Span, move_one};
use super::{Held, OffsetGuard, RecordOffset, check_name, kept, spans};
use crate::backend::{Backend, Savepoint, Sql};
use crate::claim::run::{Attempt, begun, conclude};
use crate::claim::{Claimed, Request};
use crate::error::Error;
use crate::group::Group;
use crate::group::lane::{Lane, Shared, Turn};
use crate::group::member::{GroupHeld, InTurn, in_turn, not_fresh};
use crate::observe::{Answer, Observed};
use crate::options::{ClaimOptions, Mode};
use crate::outcome::Batch;

/// Who claims, as spans and a refused nested call name it.
const CALLER: &str = "Group::claim_offsets";

impl<DB: Backend> Group<DB> {
    /// Claims the records of the consumer group `consumer_group` at `records` by their
    /// offsets, as [`Store::claim_offsets`](crate::Store::claim_offsets) does, in a savepoint
    /// of the open group of the first partition's lane: concurrent claims (a consumer per
    /// partition) share the group's transaction and its one commit.
    ///
    /// The watermarks move in the claim's savepoint, with the fresh records' effects (run
    /// them on [`OffsetGuard::tx`]); [`OffsetGuard::finish`] with `Ok` releases the
    /// savepoint and answers once the group committed: each fresh record
    /// [`Applied`](crate::Outcome::Applied) only then, or every record
    /// [`NotKept::Group`](crate::NotKept::Group) when the group failed as a whole (`may_be_kept` as
    /// for any member). With `Err`, or [`release`](OffsetGuard::release), or a dropped guard, the
    /// savepoint is rolled back, its watermark moves with it, and the records come again; the group
    /// goes on.
    ///
    /// A claim whose records are all below the watermark is answered with duplicates at once,
    /// unless an earlier claim of the same group moved one of its partitions' watermarks (not
    /// committed yet): then once the group committed, and with `NotKept::Group` if it failed.
    ///
    /// A claim's lane is chosen by its first partition (consumer group, topic, partition), so
    /// that the claims of a partition meet in one lane and one transaction: claim one
    /// partition per call where partitions may be spread over calls. Within a group, as
    /// between transactions, the watermark only moves forward: a claim of a partition's later
    /// records makes its earlier ones duplicates once it commits. Claim a partition's batches
    /// in the order of their offsets, one at a time, as the broker delivers them.
    ///
    /// Refused before any I/O as [`Store::claim_offsets`](crate::Store::claim_offsets) is.
    /// The call has the `idem.claim` span of an offset claim (mode `offsets`).
    pub async fn claim_offsets(
        &self,
        consumer_group: &str,
        records: &[RecordOffset<'_>],
    ) -> Result<OffsetGuard<DB>, Error> {
        check_name("consumer group", consumer_group)?;
        let spans = spans(records)?;
        let (Some(first), Some(span)) = (records.first(), spans.first()) else {
            return Ok(OffsetGuard::done(0));
        };
        let scope = Cow::Owned(consumer_group.to_owned());
        let request = Request::new(scope, first.key(), ClaimOptions::new(), CALLER);
        let lane = self.lane((consumer_group, span.topic.as_str(), span.partition));
        let claim = claim(&self.shared, lane, request, &spans, records.len());
        let (from, held) = claim.await?;
        Ok(OffsetGuard::claimed(
            records,
            &spans,
            &from,
            held.map(Held::Group),
        ))
    }
}

/// The claim in its lane: a turn, a savepoint, the watermarks. A fresh claim keeps the turn
/// (its body runs on the lane's transaction); any other answer gives it back at once, and
/// waits for the generation's end when an earlier claim of it moved one of the partitions.
async fn claim<DB: Backend>(
    shared: &Arc<Shared<DB>>,
    lane: &Lane<DB>,
    request: Request,
    spans: &[Span],
    records: usize,
) -> Result<(From, Option<GroupHeld<DB>>), Error> {
    let group = request.scope.to_string();
    let observed = Observed::counted(request.site, &group, Mode::Offsets, records, request.about);
    // Offset claims link no producer: their options are the defaults.
    let mut observed = begun(observed, &request, Mode::Offsets, true)?;
    let attempts = InGroup {
        shared,
        request: &request,
        group: &group,
        spans,
    };
    let answer = match in_turn(shared, lane, &mut observed, &request, attempts).await {
        Ok((Attempt::Fresh(from, took_over), turn)) => Ok(Attempt::Fresh((turn, from), took_over)),
        Ok((other, turn)) => {
            let partitions = spans.iter().map(|s| (s.topic.as_str(), s.partition));
            let waiter = turn.holder_of_partitions(&group, partitions);
            turn.leave(shared, false);
            // The watermark that made these records duplicates may not be committed yet.
            not_fresh(other, waiter, &request).await
        }
        Err(e) => Err(e),
    };
    if let Ok(Attempt::Done(_)) = answer {
        observed.decided(Answer::Duplicate);
        observed.ended_batch::<(), ()>(&Ok(Batch::new(&vec![false; records], None)));
        return Ok((vec![None; spans.len()], None));
    }
    let shared = shared.clone();
    let held = conclude(observed, request, answer, |(turn, from), ticket| {
        let kept = kept(&group, spans, &from);
        let moved = spans
            .iter()
            .zip(&from)
            .filter(|(_, from)| from.is_some())
            .map(|(s, _)| (s.topic.clone(), s.partition))
            .collect();
        (from, GroupHeld::new(turn, shared, kept, moved, ticket))
    })?;
    match held {
        Claimed::Fresh((from, held)) => Ok((from, Some(held))),
        _ => unreachable!("duplicates end above"),
    }
}

/// An offset claim's attempts in a savepoint of the lane's transaction. An attempt that loses
/// the transaction (rolling back to its savepoint failed) fails the generation, and the next
/// attempt begins a new one.
struct InGroup<'a, DB: Backend> {
    shared: &'a Arc<Shared<DB>>,
    request: &'a Request,
    group: &'a str,
    spans: &'a [Span],
}

impl<DB: Backend> InTurn<DB> for InGroup<'_, DB> {
    type Fresh = From;

    async fn attempt(&mut self, turn: &mut Turn<DB>) -> Result<Attempt<From>, sqlx::Error> {
        let sql = self.shared.store.sql();
        let (tx, opening) = turn.ready_attempt(self.request.options.wait).await?;
        let attempt = in_savepoint::<DB>(tx, sql, self.request, opening, self.group, self.spans);
        let answer = attempt.await;
        turn.attempted(answer, "an offset claim")
    }
}

/// One attempt: the savepoint, then each span's watermark in the order of the partitions;
/// anything but a fresh claim rolls the savepoint back, so that the transaction is as it was.
/// The outer `Err` says the transaction itself is gone.
async fn in_savepoint<DB: Backend>(
    conn: &mut DB::Connection,
    sql: &Sql<DB>,
    request: &Request,
    opening: Option<Savepoint>,
    group: &str,
    spans: &[Span],
) -> Result<Result<Attempt<From>, sqlx::Error>, sqlx::Error> {
    let opened = match opening {
        Some(step) => DB::savepoint(conn, step).await,
        None => Ok(()),
    };
    let answer = match opened {
        Ok(()) => moves::<DB>(conn, sql, request, group, spans).await,
        Err(e) => Err(e),
    };
    match answer {
        Ok(Attempt::Fresh(from, took_over)) => Ok(Ok(Attempt::Fresh(from, took_over))),
        other => {
            DB::savepoint(conn, Savepoint::RollBack).await?;
            Ok(other)
        }
    }
}

async fn moves<DB: Backend>(
    conn: &mut DB::Connection,
    sql: &Sql<DB>,
    request: &Request,
    group: &str,
    spans: &[Span],
) -> Result<Attempt<From>, sqlx::Error> {
    let mut from = Vec::with_capacity(spans.len());
    for span in spans {
        match move_one::<DB>(conn, sql, span.at(group), span, request.nonce).await? {
            Ok(fresh) => from.push(fresh),
            Err(()) => return Ok(Attempt::Refused(request.in_progress())),
        }
    }
    if from.iter().all(Option::is_none) {
        return Ok(Attempt::Done(Claimed::Duplicate));
    }
    Ok(Attempt::Fresh(from, false))
}
