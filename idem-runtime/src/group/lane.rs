//! One lane of a group: a transaction that stays open while calls take turns on it, one
//! generation (one group, one commit) after another.
//!
//! A turn is the lane's lock: the call holding it runs its claim and body on the lane's
//! transaction, each call behind a savepoint of its own. A call that keeps its work gives up
//! the lock and waits for its generation's end; the generation closes when it is full, when
//! its delay bound runs out, or when no other call is waiting for the lane, and a task of its
//! own commits it, so that no caller's cancellation can stop the commit of the others.
//!
//! A kept call whose generation stays open leaves its savepoint open (pending): the next
//! call's first message releases it, with that call's own savepoint and claim, so that
//! keeping costs no round trip of its own. Whoever finds it cannot be released (its savepoint
//! was aborted under a body that returned `Ok`) rolls it back and tells the call (`Undone`)
//! before the generation commits.

use std::collections::HashSet;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use std::sync::atomic::{AtomicUsize, Ordering};

use sqlx::Transaction;
use tokio::sync::{Mutex, OwnedMutexGuard, watch};

use super::GroupOptions;
use super::closing::{Closing, KeptBy};
use crate::backend::{Backend, Savepoint, Slot};
use crate::claim::{Kept, Request};
use crate::options::ClaimOptions;
use crate::store::Store;

/// What every lane of a group shares.
#[derive(Debug)]
pub(crate) struct Shared<DB: Backend> {
    pub(crate) store: Store<DB>,
    pub(crate) options: GroupOptions,
}

/// How a generation ended, as each of its calls reads it.
#[derive(Debug, Clone)]
pub(crate) enum Ended {
    Committed,
    /// Nothing of it was kept, or (`may_be_kept`) its commit's answer was lost.
    Failed {
        may_be_kept: bool,
        reason: Arc<str>,
    },
}

/// The end of a generation, awaited by its calls.
pub(crate) type Waiter = watch::Receiver<Option<Ended>>;

/// Why a kept call's work was undone before its generation's commit.
#[derive(Debug, Clone)]
pub(crate) enum Undone {
    /// Its savepoint was aborted: a statement of its body failed, and the body returned
    /// `Ok` all the same (PostgreSQL).
    Aborted,
    /// Its savepoint was rolled back with the generation going on: whether it could be
    /// released was not to be told (the call after it was dropped in its first message).
    Lost(Arc<str>),
}

/// Where a kept call reads whether its work was undone: set, if ever, before its
/// generation's end is sent.
pub(crate) type Undo = Arc<OnceLock<Undone>>;

/// A kept call whose savepoint is still open, for the next call's first message (or the
/// generation's close) to release.
#[derive(Debug)]
pub(super) struct Pending {
    pub(super) slot: Slot,
    pub(super) undo: Undo,
    /// The kept call before it, which the commit checks if this one is undone.
    pub(super) before: Option<KeptBy>,
}

/// One lane: its open generation behind the lock of its turns.
#[derive(Debug)]
pub(crate) struct Lane<DB: Backend> {
    open: Arc<Mutex<Open<DB>>>,
    /// Calls waiting for a turn (or holding one): a generation closes once none is left.
    pub(crate) queued: Arc<AtomicUsize>,
}

impl<DB: Backend> Lane<DB> {
    pub(crate) fn new() -> Self {
        Lane {
            open: Arc::new(Mutex::new(Open::default())),
            queued: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Waits for this lane's turn, and readies its transaction for the turn's savepoint (a
    /// new generation begun if none is open).
    pub(crate) async fn turn(&self, shared: &Arc<Shared<DB>>) -> Result<Turn<DB>, sqlx::Error> {
        let queued = Queued(self.queued.clone());
        queued.0.fetch_add(1, Ordering::SeqCst);
        let guard = self.open.clone().lock_owned().await;
        let mut turn = Turn {
            guard,
            armed: false,
            slot: Slot::A,
            queued,
        };
        turn.ready(shared, &self.open).await?;
        Ok(turn)
    }
}

/// Counts a call among the lane's queued ones until it is dropped.
#[derive(Debug)]
struct Queued(Arc<AtomicUsize>);

impl Drop for Queued {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The open generation of a lane.
#[derive(Debug)]
pub(crate) struct Open<DB: Backend> {
    tx: Option<Transaction<'static, DB>>,
    generation: u64,
    /// Calls whose work is in the transaction.
    members: usize,
    /// The keys claimed fresh in this generation: a later call of the same key reads their
    /// uncommitted markers, and its answer waits for the generation's end.
    fresh: HashSet<(String, String)>,
    /// The partitions (consumer group, topic, partition) whose watermarks offset claims kept
    /// in this generation moved: a later claim of one of them reads the uncommitted
    /// watermark, and its answer waits for the generation's end.
    moved: HashSet<(String, String, i32)>,
    /// The last kept call's identity, which the commit checks (MySQL finds its marker, or the
    /// watermark holding its nonce). The last, not the first: a later call of the generation
    /// may move a watermark an earlier one moved, and the row then holds the later nonce.
    kept: Option<KeptBy>,
    /// A kept call of this generation wrote outbox messages.
    wrote: bool,
    ended: Option<watch::Sender<Option<Ended>>>,
    /// The savepoint of a call that was dropped while it may have been open, in this slot:
    /// it is rolled back before anything else runs.
    dirty: Option<Slot>,
    /// The last kept call's savepoint, left open.
    pending: Option<Pending>,
}

impl<DB: Backend> Default for Open<DB> {
    fn default() -> Self {
        Open {
            tx: None,
            generation: 0,
            members: 0,
            fresh: HashSet::new(),
            moved: HashSet::new(),
            kept: None,
            wrote: false,
            ended: None,
            dirty: None,
            pending: None,
        }
    }
}

impl<DB: Backend> Open<DB> {
    /// Rolls back the savepoint a dropped call left open; the generation fails if that fails.
    /// The state is changed only once a statement answered: a clean cut short by a drop of
    /// its own is done again by the next turn.
    async fn clean(&mut self) {
        let (Some(slot), Some(tx)) = (self.dirty, &mut self.tx) else {
            self.dirty = None;
            return;
        };
        let back = DB::savepoint(tx, Savepoint::RollBackAt(slot)).await;
        let pending = self.pending.as_ref().map(|p| p.slot);
        match (back, pending) {
            // The dropped call's savepoint was there: its first message went through,
            // releasing the one it carried.
            (Ok(()), _) => self.pending = None,
            (Err(e), None) => {
                let reason =
                    format!("the savepoint of a cancelled call could not be rolled back: {e}");
                self.fail(false, &reason);
            }
            // It was not: its first message did not run, or its carried release failed.
            (Err(_), Some(kept)) => {
                if DB::savepoint(tx, Savepoint::ReleaseAt(kept)).await.is_ok() {
                    self.pending = None;
                } else {
                    let why = "the call after it was cancelled in its first statement, and \
                               the savepoint it left open could not be released";
                    self.undo_pending(Undone::Lost(why.into())).await;
                }
            }
        }
        self.dirty = None;
    }

    /// Rolls back the pending call's savepoint and tells it why; the generation fails if that
    /// fails (which tells the call too).
    async fn undo_pending(&mut self, why: Undone) {
        let (Some(slot), Some(tx)) = (self.pending.as_ref().map(|p| p.slot), &mut self.tx) else {
            return;
        };
        match DB::savepoint(tx, Savepoint::RollBackAt(slot)).await {
            Ok(()) => {
                let pending = self.pending.take().expect("looked at above");
                self.kept = pending.before;
                self.members -= 1;
                // Set before the generation's end is sent, which the call awaits first.
                let _ = pending.undo.set(why);
            }
            Err(e) => {
                let reason = format!("the savepoint of a kept call could not be rolled back: {e}");
                self.fail(false, &reason);
            }
        }
    }

    /// Fails the generation: its transaction rolled back (dropped), its calls told whether
    /// its work may have been kept.
    pub(crate) fn fail(&mut self, may_be_kept: bool, reason: &str) {
        drop(self.tx.take());
        self.reset();
        if let Some(sender) = self.ended.take() {
            let reason = reason.into();
            sender.send_replace(Some(Ended::Failed {
                may_be_kept,
                reason,
            }));
        }
    }

    fn reset(&mut self) {
        // A pending call learns the generation's end from its sender: nothing to undo.
        self.pending = None;
        self.members = 0;
        self.fresh.clear();
        self.moved.clear();
        self.kept = None;
        self.wrote = false;
    }

    /// Takes the generation out of the lane, to be committed.
    fn close(&mut self) -> Option<Closing<DB>> {
        let tx = self.tx.take()?;
        let ended = self
            .ended
            .take()
            .expect("an open generation has its sender");
        let (kept, wrote, pending) = (self.kept.take(), self.wrote, self.pending.take());
        self.reset();
        Some(Closing {
            tx,
            ended,
            kept,
            wrote,
            pending,
        })
    }
}

/// A call's turn on a lane: the lane's lock, and whether the call's savepoint may be open.
/// Dropped while armed (a cancelled call, a panic), it leaves the lane dirty, so that the
/// next turn rolls that savepoint back first: a call's claim or body is never kept without
/// the call.
#[derive(Debug)]
pub(crate) struct Turn<DB: Backend> {
    guard: OwnedMutexGuard<Open<DB>>,
    armed: bool,
    /// The name of the call's savepoint.
    slot: Slot,
    queued: Queued,
}

impl<DB: Backend> Drop for Turn<DB> {
    fn drop(&mut self) {
        if self.armed {
            self.guard.dirty = Some(self.slot);
        }
    }
}

impl<DB: Backend> Turn<DB> {
    async fn ready(
        &mut self,
        shared: &Arc<Shared<DB>>,
        lane: &Arc<Mutex<Open<DB>>>,
    ) -> Result<(), sqlx::Error> {
        self.guard.clean().await;
        if self.guard.tx.is_none() {
            let store = &shared.store;
            let tx = DB::begin(store.pool(), store.sql(), &ClaimOptions::new()).await?;
            let open = &mut *self.guard;
            open.generation += 1;
            open.tx = Some(tx);
            open.ended = Some(watch::channel(None).0);
            let (shared, lane, generation) = (shared.clone(), lane.clone(), open.generation);
            tokio::spawn(close_after_delay(shared, lane, generation));
        }
        Ok(())
    }

    /// The step that opens the call's savepoint (from here on it may be open): in the slot
    /// the pending call did not take, carrying the release of that call's savepoint if there
    /// is one.
    pub(crate) fn opening(&mut self, wait: Option<Duration>) -> Savepoint {
        let pending = self.guard.pending.as_ref().map(|p| p.slot);
        self.slot = pending.map_or(Slot::A, Slot::other);
        self.armed = true;
        let (slot, carry) = (self.slot, pending.is_some());
        Savepoint::Member { slot, carry, wait }
    }

    /// The opening step went through: the pending call's savepoint was released with it.
    pub(crate) fn opened(&mut self) {
        self.guard.pending = None;
    }

    /// The opening step failed (`e`) and the claim did not run. If it carried the pending
    /// call's release, that call's savepoint is rolled back (it was aborted under its body,
    /// or the transaction is gone, and then the generation fails) and `Ok`: open again.
    /// Otherwise the transaction is gone: the generation fails, and `e` is the call's.
    pub(crate) async fn open_failed(&mut self, e: sqlx::Error) -> Result<(), sqlx::Error> {
        self.armed = false;
        if self.guard.pending.is_none() {
            self.fail(false, &format!("its transaction was lost during a claim: {e}"));
            return Err(e);
        }
        let why = match DB::is_aborted(&e) {
            true => Undone::Aborted,
            false => Undone::Lost(format!("its savepoint could not be released: {e}").into()),
        };
        self.guard.undo_pending(why).await;
        Ok(())
    }

    /// The name of the call's savepoint.
    pub(crate) fn slot(&self) -> Slot {
        self.slot
    }

    /// Whether the call, once kept, may leave its savepoint open for the next call's first
    /// message to release: another call waits for the lane, and the generation will not be
    /// full with this one (a generation closing now releases it itself).
    pub(crate) fn may_stay_open(&self, shared: &Shared<DB>) -> bool {
        let waiting = self.queued.0.load(Ordering::SeqCst) > 1;
        waiting && self.guard.members + 1 < shared.options.max_size
    }

    /// The call's savepoint is settled (released or rolled back).
    pub(crate) fn disarm(&mut self) {
        self.armed = false;
    }

    /// The lane's transaction, if its generation is still open.
    pub(crate) fn tx(&mut self) -> Option<&mut Transaction<'static, DB>> {
        self.guard.tx.as_mut()
    }

    /// Readies a new generation after the last one failed under this turn.
    pub(crate) async fn again(
        &mut self,
        shared: &Arc<Shared<DB>>,
        lane: &Lane<DB>,
    ) -> Result<(), sqlx::Error> {
        self.ready(shared, &lane.open).await
    }

    pub(crate) fn fail(&mut self, may_be_kept: bool, reason: &str) {
        self.guard.fail(may_be_kept, reason);
    }

    /// The end of this generation, if `request`'s key was claimed fresh in it.
    pub(crate) fn holder_of(&self, request: &Request) -> Option<Waiter> {
        let key = (request.scope.to_string(), request.key.as_str().to_owned());
        let open = &*self.guard;
        match open.fresh.contains(&key) {
            true => open.ended.as_ref().map(watch::Sender::subscribe),
            false => None,
        }
    }

    /// The end of this generation, if an offset claim kept in it moved the watermark of one
    /// of `partitions` (topic, partition) of the consumer group `group`.
    pub(crate) fn holder_of_partitions<'a>(
        &self,
        group: &str,
        mut partitions: impl Iterator<Item = (&'a str, i32)>,
    ) -> Option<Waiter> {
        let open = &*self.guard;
        let met = partitions.any(|(topic, partition)| {
            let at = (group.to_owned(), topic.to_owned(), partition);
            open.moved.contains(&at)
        });
        match met {
            true => open.ended.as_ref().map(watch::Sender::subscribe),
            false => None,
        }
    }

    /// The call's work is in the generation (its savepoint released, or left open if
    /// `stays_open`: see [`may_stay_open`](Turn::may_stay_open)): counts it, and ends the
    /// turn (see [`leave`](Turn::leave)), closing the generation at once if it is full.
    /// `kept` is what its claim wrote (a marker, or watermarks: `moved`, as (topic,
    /// partition), all of the request's scope, its consumer group); `wrote`, whether it wrote
    /// outbox messages. Returns the end to wait for, and where to read, once it came, whether
    /// the call's work was undone after all (a savepoint left open).
    pub(crate) fn kept(
        mut self,
        request: &Request,
        shared: &Arc<Shared<DB>>,
        kept: &Kept,
        moved: &[(String, i32)],
        wrote: bool,
        stays_open: bool,
    ) -> (Waiter, Option<Undo>) {
        self.armed = false;
        let open = &mut *self.guard;
        open.wrote |= wrote;
        let waiter = open
            .ended
            .as_ref()
            .expect("a generation is open during a turn")
            .subscribe();
        open.members += 1;
        let (scope, key) = (request.scope.to_string(), request.key.as_str().to_owned());
        let partition = kept
            .partition()
            .map(|at| (at.topic.to_owned(), at.partition));
        let before = open.kept.replace(KeptBy {
            scope: scope.clone(),
            key: key.clone(),
            nonce: request.nonce,
            partition,
        });
        let undo = stays_open.then(|| {
            let undo = Undo::default();
            open.pending = Some(Pending {
                slot: self.slot,
                undo: undo.clone(),
                before,
            });
            undo
        });
        for (topic, partition) in moved {
            open.moved
                .insert((scope.clone(), topic.clone(), *partition));
        }
        if matches!(kept, Kept::Marker) {
            open.fresh.insert((scope, key));
        }
        let full = open.members >= shared.options.max_size;
        self.leave(shared, full);
        (waiter, undo)
    }

    /// Ends the turn; the generation closes (commits what its calls kept, or ends a
    /// transaction that kept nothing) if `close`, or if no other call waits for the lane: a
    /// lone call is never held back, and an idle lane holds no transaction.
    pub(crate) fn leave(mut self, shared: &Arc<Shared<DB>>, close: bool) {
        self.armed = false;
        // This call still counts as queued until the turn is dropped.
        let alone = self.queued.0.load(Ordering::SeqCst) <= 1;
        if (close || alone)
            && let Some(closing) = self.guard.close()
        {
            tokio::spawn(closing.commit(shared.clone()));
        }
    }
}

/// Closes the generation `generation` of `lane` once the group's delay bound ran out, if it is
/// still open then.
async fn close_after_delay<DB: Backend>(
    shared: Arc<Shared<DB>>,
    lane: Arc<Mutex<Open<DB>>>,
    generation: u64,
) {
    tokio::time::sleep(shared.options.max_delay).await;
    let mut open = lane.lock().await;
    if open.generation != generation {
        return;
    }
    open.clean().await;
    let closing = open.close();
    drop(open);
    if let Some(closing) = closing {
        closing.commit(shared).await;
    }
}

/// Waits for the end of a generation; a generation whose commit task ended without a word
/// (a runtime shutting down) may have committed.
pub(crate) async fn ended(mut waiter: Waiter) -> Ended {
    match waiter.wait_for(Option::is_some).await {
        Ok(end) => end.clone().expect("waited for it"),
        Err(_) => Ended::Failed {
            may_be_kept: true,
            reason: "its commit ended without an answer".into(),
        },
    }
}
