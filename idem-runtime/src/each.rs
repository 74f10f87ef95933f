//! A batch run job by job: one claim and one commit for the whole batch, as in `batch`, but
//! each fresh job's body behind a savepoint of its own, so that a job whose body fails is
//! rolled back alone (its marker given back) and reported with its own error, while the
//! others commit. A failure that takes the transaction with it (a lost connection, MySQL's
//! rollback of a deadlock victim) fails the batch as a whole.
//!
//! One round trip per job for the savepoints: a job that ended `Ok` keeps its savepoint open
//! until the next job's is opened, in the same message (`RELEASE SAVEPOINT ..; SAVEPOINT ..`),
//! and the last one is released before the commit. A job whose statements failed under a
//! body that returned `Ok` anyway (PostgreSQL aborts its savepoint) is found there, rolled back
//! alone, and reported [`NotKept::RolledBack`].

use std::borrow::Cow;
use std::collections::HashSet;
use std::fmt;

use sqlx::Transaction;

use crate::backend::{Backend, Savepoint};
use crate::batch::BatchGuard;
use crate::claim::nested::Body;
use crate::claim::{Hold as _, TxHeld, end};
use crate::error::{Error, NotKept};
use crate::key::Key;
use crate::outcome::{Each, Failed, Failure, Outcome};
use crate::outgoing::{Outbox, Unsent};

/// One position of the batch.
enum Slot<T, E> {
    /// An earlier delivery committed it, or failed it for good (its failure).
    Done(Option<Failure>),
    /// Fresh and not run yet: its index among the fresh jobs.
    Fresh(usize),
    /// Ran and ended `Ok`: kept if the batch commits.
    Kept(usize, T),
    /// Rolled back alone, with its error.
    Failed(usize, E),
}

/// A job's savepoint still open after its guard ended.
#[derive(Clone, Copy)]
enum Open {
    /// Its body ended `Ok`: released with the next message.
    Kept(usize),
    /// Its guard was dropped before it finished: rolled back before anything else runs.
    Dropped(usize),
}

impl<DB: Backend> BatchGuard<DB> {
    /// Runs the batch job by job: each fresh job's body behind a savepoint of its own, so that
    /// a job that fails is rolled back alone and the others still commit.
    ///
    /// Take each fresh job with [`EachGuard::job`], run its effect on [`JobGuard::tx`] and end
    /// it with [`JobGuard::finish`]; then [`EachGuard::finish`] commits the jobs that ended
    /// `Ok` (one commit for all of them) and answers with one result per job
    /// ([`Each`]): `Ok` for each job to ack, that job's own error for each job to nack. A job
    /// that failed leaves nothing: its statements are rolled back to its savepoint, its
    /// messages dropped and its marker given back (deleted, or a lease it took over made free
    /// again), so that its redelivery runs it.
    ///
    /// What fails the whole batch instead (the call's `Err`, every job redelivered): an
    /// error that takes the transaction with it, which a savepoint cannot undo, namely a lost
    /// connection, and on MySQL and MariaDB a deadlock (1213) or a lock wait timeout under
    /// `innodb_rollback_on_timeout`, which roll the whole transaction back; and a failed
    /// commit. On PostgreSQL every statement error stays in its job's savepoint (a deadlock
    /// victim's too), and on SQLite every one but those that roll the whole transaction back
    /// (a full disk, an I/O error, `INSERT OR ROLLBACK`).
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// # #[cfg(feature = "sqlite")]
    /// # async fn f(store: &idem::Store<sqlx::Sqlite>, jobs: &[(String, i64)]) -> Result<(), idem::Error> {
    /// let keys = idem::Key::batch(jobs.iter().map(|(id, _)| id))?;
    /// let mut batch = store.claim_batch("top_up", &keys).await?.each::<(), idem::Error>();
    /// for (position, (id, cents)) in jobs.iter().enumerate() {
    ///     let Some(mut job) = batch.job(position).await? else {
    ///         continue; // a duplicate
    ///     };
    ///     let done = sqlx::query("INSERT INTO credits (id, cents) VALUES (?, ?)")
    ///         .bind(id).bind(cents).execute(&mut **job.tx()).await;
    ///     job.finish(done.map(drop).map_err(idem::Error::from)).await?;
    /// }
    /// let each = batch.finish().await?;
    /// for position in each.acks() {
    ///     // ack the message at `position`
    /// #   let _ = position;
    /// }
    /// for (position, error) in each.failures() {
    ///     // nack the message at `position`, logging `error`
    /// #   let _ = (position, error);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn each<T, E: From<Error>>(self) -> EachGuard<DB, T, E> {
        let (fresh, failed, held, keys, taken, outbox) = self.into_each_parts();
        let scope = held
            .as_ref()
            .map_or(Cow::Borrowed(""), |held| held.request().scope.clone());
        let unsent = match outbox {
            Some(outbox) => outbox.into_unsent(),
            None => Unsent::new(scope, keys),
        };
        let mut next = 0;
        let slots = fresh
            .iter()
            .enumerate()
            .map(|(position, &fresh)| match fresh {
                true => {
                    next += 1;
                    Slot::Fresh(next - 1)
                }
                false => Slot::Done(
                    failed
                        .iter()
                        .find(|(at, _)| *at == position)
                        .map(|(_, failure)| failure.clone()),
                ),
            })
            .collect();
        EachGuard {
            held,
            slots,
            taken: taken.into_iter().collect(),
            unsent,
            open: None,
            lost: false,
        }
    }
}

/// A batch run job by job, made by [`BatchGuard::each`]: the open transaction holding its
/// fresh jobs, each run behind a savepoint of its own.
///
/// Dropping it (a panic, a cancelled future) rolls everything back, as dropping a
/// [`BatchGuard`] does.
#[must_use = "a batch run job by job holds an open transaction: run its fresh jobs and call `finish`"]
pub struct EachGuard<DB: Backend, T, E> {
    held: Option<TxHeld<'static, DB>>,
    slots: Vec<Slot<T, E>>,
    taken: HashSet<String>,
    /// The messages of the jobs that ended `Ok`, by their index among the fresh jobs.
    unsent: Unsent,
    open: Option<Open>,
    /// A failure took the transaction with it: nothing can be kept.
    lost: bool,
}

impl<DB: Backend, T, E> fmt::Debug for EachGuard<DB, T, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EachGuard")
            .field("jobs", &self.slots.len())
            .field("lost", &self.lost)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend, T, E: From<Error>> EachGuard<DB, T, E> {
    /// How many jobs the batch holds (fresh and duplicate).
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// `true` for an empty batch.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// `true` if the job at `position` is this delivery's and has not run yet.
    ///
    /// # Panics
    ///
    /// If `position` is not below [`len`](EachGuard::len).
    pub fn is_fresh(&self, position: usize) -> bool {
        matches!(self.slots[position], Slot::Fresh(_))
    }

    /// `true` if at least one job is this delivery's (so there is a transaction).
    pub fn any_fresh(&self) -> bool {
        self.held.is_some()
    }

    /// The call's `idem.claim` span; `None` when every job was a duplicate.
    pub fn span(&self) -> Option<&tracing::Span> {
        self.held.as_ref().map(TxHeld::span)
    }

    /// The batch's body, to run each job in its span and marked as inside its open
    /// transaction (see [`Guard::body`](crate::Guard::body)); `None` when every job was a
    /// duplicate.
    pub fn body(&self) -> Option<Body> {
        self.held.as_ref().map(TxHeld::body)
    }

    /// Takes the job at `position` to run it, behind a savepoint of its own; `None` if it is
    /// not this delivery's (a duplicate) or ran already.
    ///
    /// An `Err` is the whole batch's: a failure took its transaction with it (the savepoint
    /// could not be opened, or a job before it could not be rolled back alone). Return it:
    /// every job is redelivered.
    ///
    /// # Panics
    ///
    /// If `position` is not below [`len`](EachGuard::len).
    pub async fn job(&mut self, position: usize) -> Result<Option<JobGuard<'_, DB, T, E>>, E> {
        let Slot::Fresh(index) = self.slots[position] else {
            return Ok(None);
        };
        if matches!(self.open, Some(Open::Dropped(p)) if p == position) {
            // Its guard was dropped: it ran, and is given back as failed.
            self.settle(false).await.map_err(E::from)?;
            return Ok(None);
        }
        if self.lost {
            return Err(E::from(self.rolled_back(index)));
        }
        self.settle(true).await.map_err(E::from)?;
        Ok(Some(JobGuard {
            each: self,
            position,
            index,
            outbox: None,
            done: false,
        }))
    }

    /// Ends the call: commits the jobs that ended `Ok` (their markers, effects and messages
    /// together), and answers with one result per job.
    ///
    /// A job is [`Outcome::Applied`] only once the database confirmed the commit (the check
    /// of [`Guard::finish`](crate::Guard::finish)). A fresh job that was never taken with
    /// [`job`](EachGuard::job) is given back, as failed, with [`NotKept::JobNotFinished`]. With no
    /// job to keep, nothing is committed. An `Err` is the whole batch's (the commit failed, or a
    /// job's failure took the transaction with it): nothing was kept.
    pub async fn finish(self) -> Result<Each<T, E>, E> {
        self.finish_failed()
            .await
            .map_err(Failed::into_handler_error)
    }

    /// Gives up: rolls everything back, every fresh job's marker and effect with it.
    pub async fn release(mut self) {
        if let Some(held) = self.held.take() {
            let (hold, ticket) = held.into_parts();
            hold.release(&ticket.request).await;
            ticket.observed.ended_each(Err(&Failed::<()>::Handler(())));
        }
    }

    pub(crate) async fn finish_failed(mut self) -> Result<Each<T, E>, Failed<E>> {
        if self.held.is_none() {
            let results = self.slots.drain(..).map(|slot| match slot {
                Slot::Done(Some(failure)) => Ok(Outcome::Failed(failure)),
                _ => Ok(Outcome::Duplicate),
            });
            return Ok(Each::new(results.collect()));
        }
        let settled = match self.lost {
            true => Err(self.rolled_back(0)),
            false => self.settle(false).await,
        };
        for slot in &mut self.slots {
            if let Slot::Fresh(index) = *slot {
                let key = self.unsent.key(index).as_str().to_owned();
                let scope = self.unsent.scope().to_owned();
                self.unsent.drop_job(index);
                *slot = Slot::Failed(
                    index,
                    E::from(Error::NotKept(NotKept::JobNotFinished { scope, key })),
                );
            }
        }
        let kept = match settled {
            Ok(()) => self.keep().await,
            Err(e) => Err(e),
        };
        let held = self.held.take().expect("checked above");
        let (hold, ticket) = held.into_parts();
        let ended = match kept {
            Ok(false) => {
                hold.release(&ticket.request).await;
                Ok(())
            }
            Ok(true) => {
                let committed = end(hold, &ticket, Some(&self.unsent), Ok(()), |_| Ok(None));
                committed.await.map(drop)
            }
            Err(e) => {
                hold.release(&ticket.request).await;
                Err(Failed::<E>::Idem(e))
            }
        };
        let counts = match &ended {
            Ok(()) => Ok(self.counts()),
            Err(failed) => Err(failed),
        };
        ticket.observed.ended_each(counts);
        ended?;
        let results = self.slots.into_iter().map(|slot| match slot {
            Slot::Done(None) => Ok(Outcome::Duplicate),
            Slot::Done(Some(failure)) => Ok(Outcome::Failed(failure)),
            Slot::Kept(_, value) => Ok(Outcome::Applied(value)),
            Slot::Failed(_, e) => Err(e),
            Slot::Fresh(_) => unreachable!("given back above"),
        });
        Ok(Each::new(results.collect()))
    }

    /// Gives back the markers of the jobs that failed, and readies the commit: `Ok(true)` if
    /// a job is to be kept (the commit's errors then name one of them).
    async fn keep(&mut self) -> Result<bool, Error> {
        let mut inserted = Vec::new();
        let mut taken = Vec::new();
        let mut kept = None;
        for slot in &self.slots {
            match slot {
                Slot::Failed(index, _) => {
                    let key = self.unsent.key(*index).as_str();
                    match self.taken.contains(key) {
                        true => taken.push(key),
                        false => inserted.push(key),
                    }
                }
                Slot::Kept(index, _) if kept.is_none() => kept = Some(*index),
                _ => {}
            }
        }
        let held = self.held.as_mut().expect("a batch with a fresh job");
        if kept.is_none() {
            return Ok(false);
        }
        if !inserted.is_empty() || !taken.is_empty() {
            let request = held.request().clone();
            let (tx, sql) = held.tx_sql();
            let unclaimed = DB::unclaim(tx, sql, request.claimant(), &inserted, &taken).await;
            unclaimed.map_err(Error::from)?;
        }
        let key = self.unsent.key(kept.expect("checked")).clone();
        held.rekey(key);
        Ok(true)
    }

    fn counts(&self) -> (u64, u64) {
        let (mut applied, mut failed) = (0, 0);
        for slot in &self.slots {
            match slot {
                Slot::Kept(..) => applied += 1,
                Slot::Failed(..) => failed += 1,
                _ => {}
            }
        }
        (applied, failed)
    }

    /// Ends the savepoint the last job left open, and with `next` opens the next job's.
    async fn settle(&mut self, next: bool) -> Result<(), Error> {
        let open = self.open.take();
        let step = match (open, next) {
            (Some(Open::Kept(_)), true) => Savepoint::Next(None),
            (Some(Open::Kept(_)), false) => Savepoint::Release,
            (Some(Open::Dropped(_)), _) => Savepoint::RollBack,
            (None, true) => Savepoint::Open(None),
            (None, false) => return Ok(()),
        };
        let done = DB::savepoint(self.tx(), step).await;
        let failed = match (open, done) {
            (_, Ok(())) if !matches!(open, Some(Open::Dropped(_))) => return Ok(()),
            (Some(Open::Dropped(position)), Ok(())) => {
                let error = |scope, key| Error::NotKept(NotKept::JobNotFinished { scope, key });
                self.fail(position, error);
                position
            }
            (Some(Open::Kept(position)), Err(_)) => {
                // The kept job's statements failed under it although its body returned `Ok`
                // (PostgreSQL aborted its savepoint): back to that savepoint, the job alone.
                if let Err(e) = DB::savepoint(self.tx(), Savepoint::RollBack).await {
                    return Err(self.lose(e, position));
                }
                let error = |scope, key| Error::NotKept(NotKept::RolledBack { scope, key });
                self.fail(position, error);
                position
            }
            (_, Err(e)) => {
                let position = match open {
                    Some(Open::Kept(p) | Open::Dropped(p)) => p,
                    None => self.first_fresh(),
                };
                return Err(self.lose(e, position));
            }
            (_, Ok(())) => unreachable!("matched above"),
        };
        if next && let Err(e) = DB::savepoint(self.tx(), Savepoint::Open(None)).await {
            return Err(self.lose(e, failed));
        }
        Ok(())
    }

    /// The job at `position` failed alone with the error `make(scope, key)` gives.
    fn fail(&mut self, position: usize, make: impl FnOnce(String, String) -> Error) {
        let index = match self.slots[position] {
            Slot::Kept(index, _) | Slot::Fresh(index) | Slot::Failed(index, _) => index,
            Slot::Done(_) => unreachable!("a job done earlier holds no savepoint"),
        };
        let scope = self.unsent.scope().to_owned();
        let key = self.unsent.key(index).as_str().to_owned();
        self.unsent.drop_job(index);
        self.slots[position] = Slot::Failed(index, E::from(make(scope, key)));
    }

    /// The transaction is gone with `e` (while settling the job at `position`).
    fn lose(&mut self, e: sqlx::Error, position: usize) -> Error {
        self.lost = true;
        match e.as_database_error() {
            // The server answered, but the savepoint was gone: it had rolled the transaction
            // back (MySQL after a deadlock).
            Some(_) => {
                let index = match self.slots[position] {
                    Slot::Kept(i, _) | Slot::Fresh(i) | Slot::Failed(i, _) => i,
                    Slot::Done(_) => 0,
                };
                self.rolled_back(index)
            }
            None => Error::from(e),
        }
    }

    fn rolled_back(&self, index: usize) -> Error {
        Error::NotKept(NotKept::RolledBack {
            scope: self.unsent.scope().to_owned(),
            key: self.unsent.key(index).as_str().to_owned(),
        })
    }

    fn first_fresh(&self) -> usize {
        let fresh = |s: &Slot<T, E>| !matches!(s, Slot::Done(_));
        self.slots.iter().position(fresh).unwrap_or(0)
    }

    fn tx(&mut self) -> &mut Transaction<'static, DB> {
        self.held.as_mut().expect("a batch with a fresh job").tx()
    }
}

/// One job of a batch run job by job ([`EachGuard::job`]), behind its own savepoint.
///
/// [`finish`](JobGuard::finish) ends it: `Ok` keeps its work in the batch's transaction (it
/// commits with the batch), `Err` rolls it back to its savepoint alone. Dropping it before
/// `finish` rolls it back too (before the batch's next statement), and the job is reported with
/// [`NotKept::JobNotFinished`].
pub struct JobGuard<'g, DB: Backend, T, E: From<Error>> {
    each: &'g mut EachGuard<DB, T, E>,
    position: usize,
    index: usize,
    outbox: Option<Outbox>,
    done: bool,
}

impl<DB: Backend, T, E: From<Error>> fmt::Debug for JobGuard<'_, DB, T, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobGuard")
            .field("position", &self.position)
            .field("key", self.key())
            .finish_non_exhaustive()
    }
}

impl<DB: Backend, T, E: From<Error>> JobGuard<'_, DB, T, E> {
    /// The transaction the job's effect must run on (inside the job's savepoint).
    pub fn tx(&mut self) -> &mut Transaction<'static, DB> {
        self.each.tx()
    }

    /// The outbox of this job: its messages are written with the batch's commit if the job
    /// ends `Ok`, and dropped if it fails.
    pub fn outbox(&mut self) -> &mut Outbox {
        let (unsent, index) = (&self.each.unsent, self.index);
        self.outbox.get_or_insert_with(|| unsent.job_outbox(index))
    }

    /// The transaction and the outbox at once, for a body that takes both.
    pub fn parts(&mut self) -> (&mut Transaction<'static, DB>, &mut Outbox) {
        let (unsent, index) = (&self.each.unsent, self.index);
        let outbox = self.outbox.get_or_insert_with(|| unsent.job_outbox(index));
        (self.each.tx(), outbox)
    }

    /// The job's key.
    pub fn key(&self) -> &Key {
        self.each.unsent.key(self.index)
    }

    /// The job's position in the batch.
    pub fn position(&self) -> usize {
        self.position
    }

    /// Ends the job: `Ok` keeps its work (and its messages) for the batch's commit, `Err`
    /// rolls it back to its savepoint and records the error as this job's.
    ///
    /// An `Err` returned here is the whole batch's: rolling the job back failed (its error
    /// took the transaction with it, as a lost connection or MySQL's deadlock rollback do),
    /// and the job's own error is returned as the batch's. Return it: every job is
    /// redelivered.
    pub async fn finish(mut self, result: Result<T, E>) -> Result<(), E> {
        self.done = true;
        let (position, index) = (self.position, self.index);
        match result {
            Ok(value) => {
                if let Some(outbox) = self.outbox.take() {
                    self.each.unsent.absorb(index, outbox);
                }
                self.each.slots[position] = Slot::Kept(index, value);
                self.each.open = Some(Open::Kept(position));
                Ok(())
            }
            Err(e) => match DB::savepoint(self.each.tx(), Savepoint::RollBack).await {
                Ok(()) => {
                    self.each.unsent.drop_job(index);
                    self.each.slots[position] = Slot::Failed(index, e);
                    Ok(())
                }
                Err(_) => {
                    self.each.lost = true;
                    Err(e)
                }
            },
        }
    }
}

impl<DB: Backend, T, E: From<Error>> Drop for JobGuard<'_, DB, T, E> {
    fn drop(&mut self) {
        if !self.done {
            self.each.open = Some(Open::Dropped(self.position));
        }
    }
}
