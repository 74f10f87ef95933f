//! What a claim of records by their offsets gives back: the records it holds, and the open
//! transaction (or a group's savepoint) holding them until `finish`.

use std::borrow::Cow;

use sqlx::Transaction;

use super::RecordOffset;
use super::claim::{self, Span};

use crate::backend::Backend;
use crate::claim::nested::Body;
use crate::claim::{Request, TxHeld, end};
use crate::error::Error;
use crate::group::GroupHeld;
use crate::key::Key;
use crate::outcome::{Batch, Failed};
use crate::outgoing::{BatchOutbox, Unsent};

/// The answer to [`Store::claim_offsets`](crate::Store::claim_offsets) and [`Group::claim_offsets`](crate::Group::claim_offsets):
/// which records this delivery holds, and the open transaction holding them (in a group, its
/// transaction inside this claim's savepoint).
///
/// [`finish`](OffsetGuard::finish) commits (the watermarks, the effects and the
/// [`outbox`](OffsetGuard::outbox) together) or rolls back; [`release`](OffsetGuard::release),
/// or dropping it (a panic, a cancelled future), rolls back as well, and the records are
/// fresh again for the next delivery. In a group, the commit is the group's (`finish` answers once
/// it is confirmed, or with [`NotKept::Group`](crate::NotKept::Group)) and a rollback is to the
/// claim's savepoint.
#[derive(Debug)]
#[must_use = "an offset claim may hold an open transaction: run the fresh records and call `finish`"]
pub struct OffsetGuard<DB: Backend> {
    fresh: Vec<bool>,
    held: Option<Held<DB>>,
    /// The fresh records' keys, in the batch's order, until the outbox takes them.
    fresh_keys: Vec<Key>,
    outbox: Option<BatchOutbox>,
}

/// What holds a fresh offset claim: a transaction of its own, or a savepoint of a group's.
#[derive(Debug)]
pub(crate) enum Held<DB: Backend> {
    Own(TxHeld<'static, DB>),
    Group(GroupHeld<DB>),
}

impl<DB: Backend> Held<DB> {
    fn tx(&mut self) -> &mut Transaction<'static, DB> {
        match self {
            Held::Own(held) => held.tx(),
            Held::Group(held) => held.tx(),
        }
    }

    fn span(&self) -> &tracing::Span {
        match self {
            Held::Own(held) => held.span(),
            Held::Group(held) => held.span(),
        }
    }

    fn body(&self) -> Body {
        match self {
            Held::Own(held) => held.body(),
            Held::Group(held) => held.body(),
        }
    }

    fn request_mut(&mut self) -> &mut Request {
        match self {
            Held::Own(held) => held.request_mut(),
            Held::Group(held) => held.request_mut(),
        }
    }

    /// Ends the claim (see [`end`]) and records each record's outcome.
    async fn end<T, E>(
        self,
        fresh: &[bool],
        outbox: Option<&Unsent>,
        result: Result<T, Failed<E>>,
    ) -> Result<Batch<T>, Failed<E>> {
        let (ended, ticket) = match self {
            Held::Own(held) => {
                let (hold, ticket) = held.into_parts();
                (
                    end(hold, &ticket, outbox, result, |_| Ok(None)).await,
                    ticket,
                )
            }
            Held::Group(held) => {
                let (hold, ticket) = held.into_parts();
                (
                    end(hold, &ticket, outbox, result, |_| Ok(None)).await,
                    ticket,
                )
            }
        };
        let batch = ended.map(|outcome| Batch::new(fresh, outcome.into_value()));
        ticket.observed.ended_batch(&batch);
        batch
    }
}

impl<DB: Backend> OffsetGuard<DB> {
    /// The guard of a claim whose statements answered (in a group: see
    /// [`Group::claim_offsets`](crate::Group::claim_offsets)): `from` says, for each span,
    /// where its fresh records begin.
    pub(crate) fn claimed(
        records: &[RecordOffset<'_>],
        spans: &[Span],
        from: &claim::From,
        held: Option<Held<DB>>,
    ) -> Self {
        let fresh: Vec<bool> = records
            .iter()
            .map(|r| {
                let at = spans
                    .iter()
                    .position(|s| s.topic == r.topic && s.partition == r.partition)
                    .expect("every record has its span");
                from.get(at)
                    .copied()
                    .flatten()
                    .is_some_and(|from| r.offset >= from)
            })
            .collect();
        let fresh_keys: Vec<Key> = records
            .iter()
            .zip(&fresh)
            .filter(|&(_, fresh)| *fresh)
            .map(|(r, _)| r.key())
            .collect();
        let mut held = held;
        if let (Some(held), Some(first)) = (&mut held, fresh_keys.first()) {
            held.request_mut().key = first.clone();
        }
        OffsetGuard {
            fresh,
            held,
            fresh_keys,
            outbox: None,
        }
    }

    pub(crate) fn done(records: usize) -> Self {
        OffsetGuard {
            fresh: vec![false; records],
            held: None,
            fresh_keys: Vec::new(),
            outbox: None,
        }
    }

    /// How many records the claim names (fresh and duplicate).
    pub fn len(&self) -> usize {
        self.fresh.len()
    }

    /// `true` for an empty claim.
    pub fn is_empty(&self) -> bool {
        self.fresh.is_empty()
    }

    /// `true` if this delivery holds the record at `position`: run its effect.
    ///
    /// # Panics
    ///
    /// If `position` is not below [`len`](OffsetGuard::len).
    pub fn is_fresh(&self, position: usize) -> bool {
        self.fresh[position]
    }

    /// For each record, whether this delivery holds it.
    pub fn fresh(&self) -> &[bool] {
        &self.fresh
    }

    /// `true` if at least one record is fresh (so the body must run).
    pub fn any_fresh(&self) -> bool {
        self.held.is_some()
    }

    /// The transaction the fresh records' effects must run on; `None` when every record was
    /// a duplicate (the transaction has ended already).
    pub fn tx(&mut self) -> Option<&mut Transaction<'static, DB>> {
        self.held.as_mut().map(Held::tx)
    }

    /// The outbox of the fresh records: each message names its record by its key
    /// ([`RecordOffset::key`]), and all are written with the watermarks when the claim
    /// finishes with `Ok`.
    pub fn outbox(&mut self) -> &mut BatchOutbox {
        let scope = match &mut self.held {
            Some(held) => held.request_mut().scope.clone(),
            None => Cow::Borrowed(""),
        };
        let keys = &mut self.fresh_keys;
        self.outbox
            .get_or_insert_with(|| BatchOutbox::new(scope, std::mem::take(keys)))
    }

    /// The transaction and the outbox at once; `None` as for [`tx`](OffsetGuard::tx).
    pub fn parts(&mut self) -> Option<(&mut Transaction<'static, DB>, &mut BatchOutbox)> {
        self.outbox();
        let outbox = self.outbox.as_mut().expect("made above");
        let tx = self.held.as_mut().map(Held::tx)?;
        Some((tx, outbox))
    }

    /// The call's `idem.claim` span; `None` when every record was a duplicate.
    pub fn span(&self) -> Option<&tracing::Span> {
        self.held.as_ref().map(Held::span)
    }

    /// The claim's body, to run in its span and marked as inside its open transaction (see
    /// [`Guard::body`](crate::Guard::body)); `None` when every record was a duplicate.
    pub fn body(&self) -> Option<Body> {
        self.held.as_ref().map(Held::body)
    }

    /// Ends the call: commits on `Ok`, rolls back on `Err`.
    ///
    /// On `Ok`, each fresh record is [`Outcome::Applied`](crate::Outcome::Applied) only once
    /// the database confirmed the commit of the watermarks with the effects (a transaction it threw
    /// away is [`NotKept::RolledBack`](crate::NotKept::RolledBack), and nothing of it was kept);
    /// the others are duplicates. With no fresh record there is nothing to commit, and the value is
    /// dropped.
    pub async fn finish<T, E: From<Error>>(self, result: Result<T, E>) -> Result<Batch<T>, E> {
        let end = self.finish_failed(result.map_err(Failed::Handler)).await;
        end.map_err(Failed::into_handler_error)
    }

    /// Gives up: rolls the transaction back, the watermarks and the effects with it.
    pub async fn release(self) {
        let result: Result<(), Failed<()>> = Err(Failed::Handler(()));
        drop(self.finish_failed(result).await);
    }

    async fn finish_failed<T, E>(
        self,
        result: Result<T, Failed<E>>,
    ) -> Result<Batch<T>, Failed<E>> {
        let OffsetGuard {
            fresh,
            held,
            outbox,
            ..
        } = self;
        let Some(held) = held else {
            result?;
            return Ok(Batch::new(&vec![false; fresh.len()], None));
        };
        let unsent = outbox.map(BatchOutbox::into_unsent);
        held.end(&fresh, unsent.as_ref(), result).await
    }
}
