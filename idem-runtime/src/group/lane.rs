//! One lane of a group: a transaction that stays open while calls take turns on it, one
//! generation (one group, one commit) after another.
//!
//! A turn is the lane's lock: the call holding it runs its claim and body on the lane's
//! transaction, each call behind a savepoint of its own. A call that keeps its work releases
//! its savepoint and the lock, then waits for its generation's end; the generation closes
//! when it is full, when its delay bound runs out, or when no other call is waiting for the
//! lane, and a task of its own commits it, so that no caller's cancellation can stop the
//! commit of the others. A call alone in its generation commits it itself: there are no
//! others to stop, and a lone call then costs no task and no timer more than the macro's.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use sqlx::Transaction;
use tokio::sync::{Mutex, OwnedMutexGuard, watch};
use tokio::time::Instant;

use super::GroupOptions;
use crate::backend::{Backend, Check, Claimant, Partition, Savepoint};
use crate::claim::run::Attempt;
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
    /// The database had rolled the transaction back (a failed statement aborted it), and its
    /// one kept call had left its savepoint for the commit to release: that call's rollback.
    RolledBack,
    /// Nothing of it was kept, or (`may_be_kept`) its commit's answer was lost.
    Failed {
        may_be_kept: bool,
        reason: Arc<str>,
    },
}

/// The end of a generation, awaited by its calls.
pub(crate) type Waiter = watch::Receiver<Option<Ended>>;

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
            queued,
            shared: shared.clone(),
            lane: self.open.clone(),
        };
        turn.ready().await?;
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
    /// When the open generation began: its delay bound runs from here.
    began: Instant,
    /// The open generation's delay bound is armed (see [`Turn`]'s `drop`).
    timed: bool,
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
    /// The one kept call left its savepoint open for the commit (see
    /// [`release_step`](Turn::release_step)).
    unreleased: bool,
    ended: Option<watch::Sender<Option<Ended>>>,
    /// A call's savepoint may be open with no call to end it (the call was dropped): it is
    /// rolled back before anything else runs.
    dirty: bool,
    /// An empty savepoint is open for the next turn, sent in a message that was going anyway:
    /// the generation's `BEGIN`, or the release of the last kept call's savepoint when it saw
    /// another call waiting. The next claim then opens none of its own (one round trip less).
    primed: bool,
}

impl<DB: Backend> Default for Open<DB> {
    fn default() -> Self {
        Open {
            tx: None,
            generation: 0,
            began: Instant::now(),
            timed: false,
            members: 0,
            fresh: HashSet::new(),
            moved: HashSet::new(),
            kept: None,
            wrote: false,
            unreleased: false,
            ended: None,
            dirty: false,
            primed: false,
        }
    }
}

impl<DB: Backend> Open<DB> {
    /// Rolls back the savepoint a dropped call left open; the generation fails if that fails.
    async fn clean(&mut self) {
        if !std::mem::take(&mut self.dirty) {
            return;
        }
        let Some(tx) = &mut self.tx else { return };
        if let Err(e) = DB::savepoint(tx, Savepoint::RollBack).await {
            let reason = format!("the savepoint of a cancelled call could not be rolled back: {e}");
            self.fail(false, &reason);
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
        self.members = 0;
        self.fresh.clear();
        self.moved.clear();
        self.kept = None;
        self.wrote = false;
        self.unreleased = false;
        self.primed = false;
    }

    /// Takes the generation out of the lane, to be committed.
    fn close(&mut self) -> Option<Closing<DB>> {
        let tx = self.tx.take()?;
        let ended = self
            .ended
            .take()
            .expect("an open generation has its sender");
        let (kept, wrote, unreleased) = (self.kept.take(), self.wrote, self.unreleased);
        self.reset();
        Some(Closing {
            tx,
            ended,
            kept,
            wrote,
            unreleased,
        })
    }
}

/// A call's turn on a lane: the lane's lock, and whether the call's savepoint may be open.
/// Dropped while armed (a cancelled call, a panic), it leaves the lane dirty, so that the
/// next turn rolls that savepoint back first: a call's claim or body is never kept without
/// the call.
///
/// A turn that ends with its generation still open arms the generation's delay bound, once:
/// a later turn may close it sooner, and if none comes (the calls waiting were cancelled) the
/// bound does. A generation that closes with its first turn, as a lone call's does, never
/// needs one.
#[derive(Debug)]
pub(crate) struct Turn<DB: Backend> {
    guard: OwnedMutexGuard<Open<DB>>,
    armed: bool,
    queued: Queued,
    shared: Arc<Shared<DB>>,
    lane: Arc<Mutex<Open<DB>>>,
}

impl<DB: Backend> Drop for Turn<DB> {
    fn drop(&mut self) {
        let open = &mut *self.guard;
        if self.armed {
            open.dirty = true;
        }
        if open.tx.is_none() || open.timed {
            return;
        }
        // Without a runtime nothing runs on the lane again either.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            open.timed = true;
            let (shared, lane) = (self.shared.clone(), self.lane.clone());
            let deadline = open.began + shared.options.max_delay;
            runtime.spawn(close_after_delay(shared, lane, open.generation, deadline));
        }
    }
}

/// How a kept call's turn ended: its generation stays open (or closed with others in it) and
/// the call waits for its end, or the call was alone in the generation it closed, and commits
/// it itself.
pub(crate) enum Left<DB: Backend> {
    Waiting(Waiter),
    Alone(Closing<DB>),
}

impl<DB: Backend> Turn<DB> {
    async fn ready(&mut self) -> Result<(), sqlx::Error> {
        self.guard.clean().await;
        if self.guard.tx.is_none() {
            let store = &self.shared.store;
            let (tx, primed) = DB::begin_primed(store.pool(), store.sql()).await?;
            let open = &mut *self.guard;
            open.generation += 1;
            open.tx = Some(tx);
            open.began = Instant::now();
            open.timed = false;
            open.primed = primed;
            open.ended = Some(watch::channel(None).0);
        }
        Ok(())
    }

    /// From here on the call's savepoint may be open. Returns the statement that opens it
    /// (with the claim's `wait`), or `None` when a message sent before opened it already
    /// (see [`primed`](Open::primed)).
    pub(crate) fn arm(&mut self, wait: Option<Duration>) -> Option<Savepoint> {
        self.armed = true;
        let primed = std::mem::take(&mut self.guard.primed);
        match (primed, wait) {
            (true, None) => None,
            // The open one cannot take a wait after the fact: a new one, in the same message.
            (true, Some(_)) => Some(Savepoint::Next(wait)),
            (false, _) => Some(Savepoint::Open(wait)),
        }
    }

    /// How a kept call's savepoint is released:
    ///
    /// - `None`, not at all, when the call is the generation's first kept one and no other
    ///   waits: the generation then closes with it alone ([`kept`](Turn::kept) is told so),
    ///   and its commit releases the savepoint, one round trip less. Nothing else can run in
    ///   the transaction before that commit, so a savepoint its body aborted (PostgreSQL)
    ///   rolls back only this call's work: the commit answers that, and the call is told
    ///   ([`Ended::RolledBack`]).
    /// - with the next call's opened in the same message ([`Savepoint::Next`]) when another
    ///   call waits for this generation and has room in it; then [`primed`](Turn::primed)
    ///   once that succeeded.
    /// - [`Savepoint::Release`] otherwise.
    pub(crate) fn release_step(&self, shared: &Shared<DB>) -> Option<Savepoint> {
        let waiting = self.queued.0.load(Ordering::SeqCst) > 1;
        let members = self.guard.members;
        if members == 0 && !waiting {
            return None;
        }
        match waiting && members + 1 < shared.options.max_size && !self.due() {
            true => Some(Savepoint::Next(None)),
            false => Some(Savepoint::Release),
        }
    }

    /// The next turn's savepoint is open (see [`release_step`](Turn::release_step)).
    pub(crate) fn primed(&mut self) {
        self.guard.primed = true;
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
    pub(crate) async fn again(&mut self) -> Result<(), sqlx::Error> {
        self.ready().await
    }

    pub(crate) fn fail(&mut self, may_be_kept: bool, reason: &str) {
        self.guard.fail(may_be_kept, reason);
    }

    /// Readies a claim's attempt in this turn (a new generation if the last one failed under
    /// it): the transaction, and the statement that opens the armed savepoint.
    pub(crate) async fn ready_attempt(
        &mut self,
        wait: Option<Duration>,
    ) -> Result<(&mut Transaction<'static, DB>, Option<Savepoint>), sqlx::Error> {
        if self.tx().is_none() {
            self.again().await?;
        }
        let opening = self.arm(wait);
        let tx = self.tx().expect("readied above");
        Ok((tx, opening))
    }

    /// An attempt's answer: a fresh claim's savepoint stays armed, any other answer settled
    /// it, and an attempt that lost the transaction (`during` says in what) fails the
    /// generation.
    pub(crate) fn attempted<F>(
        &mut self,
        answer: Result<Result<Attempt<F>, sqlx::Error>, sqlx::Error>,
        during: &str,
    ) -> Result<Attempt<F>, sqlx::Error> {
        match answer {
            Ok(Ok(Attempt::Fresh(fresh, took_over))) => Ok(Attempt::Fresh(fresh, took_over)),
            Ok(answer) => {
                self.disarm();
                answer
            }
            Err(e) => {
                self.disarm();
                let reason = format!("its transaction was lost during {during}: {e}");
                self.fail(false, &reason);
                Err(e)
            }
        }
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

    /// The call's work is in the generation (its savepoint released): counts it, and ends
    /// the turn (see [`leave`](Turn::leave)), closing the generation at once if it is full.
    /// `kept` is what its claim wrote (a marker, or watermarks: `moved`, as (topic,
    /// partition), all of the request's scope, its consumer group); `wrote`, whether it wrote
    /// outbox messages; `unreleased`, that its savepoint is still open, which closes the
    /// generation now, with this call alone in it. Returns the end to wait for, or the
    /// generation to commit when the call alone is in it.
    pub(crate) fn kept(
        mut self,
        request: &Request,
        shared: &Arc<Shared<DB>>,
        kept: &Kept,
        moved: &[(String, i32)],
        wrote: bool,
        unreleased: bool,
    ) -> Left<DB> {
        self.armed = false;
        let open = &mut *self.guard;
        open.wrote |= wrote;
        open.unreleased = unreleased;
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
        open.kept = Some(KeptBy {
            scope: scope.clone(),
            key: key.clone(),
            nonce: request.nonce,
            partition,
        });
        for (topic, partition) in moved {
            open.moved
                .insert((scope.clone(), topic.clone(), *partition));
        }
        if matches!(kept, Kept::Marker) {
            open.fresh.insert((scope, key));
        }
        let full = open.members >= shared.options.max_size;
        let only = open.members == 1;
        match self.close(full || unreleased) {
            Some(closing) if only => Left::Alone(closing),
            Some(closing) => {
                tokio::spawn(closing.commit(shared.clone()));
                Left::Waiting(waiter)
            }
            None => Left::Waiting(waiter),
        }
    }

    /// Ends the turn; the generation closes (commits what its calls kept, or ends a
    /// transaction that kept nothing) if `close`, or if no other call waits for the lane: a
    /// lone call is never held back, and an idle lane holds no transaction.
    pub(crate) fn leave(mut self, shared: &Arc<Shared<DB>>, close: bool) {
        if let Some(closing) = self.close(close) {
            tokio::spawn(closing.commit(shared.clone()));
        }
    }

    /// The generation's delay bound has passed: it takes no new call. Its timer cannot close
    /// it while a call holds the turn, so each turn's end looks.
    fn due(&self) -> bool {
        self.guard.began.elapsed() >= self.shared.options.max_delay
    }

    /// Ends the turn, and takes its generation out of the lane if `close`, if no other call
    /// waits for the lane, or if its delay bound has passed.
    fn close(&mut self, close: bool) -> Option<Closing<DB>> {
        self.armed = false;
        // This call still counts as queued until the turn is dropped.
        let alone = self.queued.0.load(Ordering::SeqCst) <= 1;
        match close || alone || self.due() {
            true => self.guard.close(),
            false => None,
        }
    }
}

/// Closes the generation `generation` of `lane` at `deadline` (its delay bound), if it is
/// still open then.
async fn close_after_delay<DB: Backend>(
    shared: Arc<Shared<DB>>,
    lane: Arc<Mutex<Open<DB>>>,
    generation: u64,
    deadline: Instant,
) {
    tokio::time::sleep_until(deadline).await;
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

/// A generation taken out of its lane, to be committed.
pub(crate) struct Closing<DB: Backend> {
    tx: Transaction<'static, DB>,
    ended: watch::Sender<Option<Ended>>,
    kept: Option<KeptBy>,
    wrote: bool,
    unreleased: bool,
}

/// A kept call's identity: its scope, key and nonce, and, for an offset claim, the partition
/// (topic, partition) whose watermark holds its nonce (the scope is its consumer group).
#[derive(Debug)]
struct KeptBy {
    scope: String,
    key: String,
    nonce: i64,
    partition: Option<(String, i32)>,
}

impl<DB: Backend> Closing<DB> {
    /// Commits the generation (verified, as every claim's commit is) and tells its calls; also
    /// returns the end, to a call that commits it itself.
    pub(crate) async fn commit(self, shared: Arc<Shared<DB>>) -> Ended {
        let Closing {
            tx,
            ended,
            kept,
            wrote,
            unreleased,
        } = self;
        let options = ClaimOptions::new();
        let end = match kept {
            // No call kept anything: the transaction only held claims that were given back.
            None => {
                drop(DB::rollback(tx, &options).await);
                Ended::Committed
            }
            Some(kept) => {
                let table = &shared.store.sql().table;
                let check = match &kept.partition {
                    None => Check::Marker(
                        table,
                        Claimant {
                            scope: &kept.scope,
                            key: &kept.key,
                            fingerprint: None,
                            nonce: kept.nonce,
                            wait: None,
                        },
                    ),
                    Some((topic, partition)) => {
                        let at = Partition {
                            group: &kept.scope,
                            topic,
                            partition: *partition,
                        };
                        Check::Watermark(table, at, kept.nonce)
                    }
                };
                match DB::commit(tx, check, &options).await {
                    Ok(true) => {
                        if wrote {
                            table.wake().committed();
                        }
                        Ended::Committed
                    }
                    Ok(false) if unreleased => Ended::RolledBack,
                    Ok(false) => Ended::Failed {
                        may_be_kept: false,
                        reason: "the database rolled the group's transaction back".into(),
                    },
                    // The server's own error: not committed. Anything else (a lost
                    // connection) may have come after the commit landed.
                    Err(e) => Ended::Failed {
                        may_be_kept: e.as_database_error().is_none(),
                        reason: format!("its commit failed: {e}").into(),
                    },
                }
            }
        };
        ended.send_replace(Some(end.clone()));
        end
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
