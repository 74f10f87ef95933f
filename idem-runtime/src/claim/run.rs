//! Making a claim: what every entry shares (the observation, the nested-call check, the
//! bounded retry of a lost race, the decision's conclusion) and the claims in a transaction
//! (of the call's own, a savepoint of the caller's, a batch). Lease mode's claim is in
//! `lease`, on the same pieces.

use std::collections::HashSet;
use std::future::Future;

use sqlx::{Connection as _, Transaction};

use super::{CLAIM_ATTEMPTS, Claimed, Decision, RECHECKS, Request, Ticket, TxHeld, decide, nested};
use crate::backend::{Backend, Savepoint, Sql};
use crate::error::Error;
use crate::observe::trace_context;
use crate::observe::{self, Answer, Observed};
use crate::options::Mode;
use crate::outcome::{Batch, Failure, Outcome};
use crate::store::Store;

/// What one attempt of a claim came to, once its statements answered.
pub(crate) enum Attempt<H> {
    /// This delivery holds the key (`took_over`: a free lease it took over).
    Fresh(H, bool),
    /// An earlier delivery completed the key; nothing is held.
    Done(Claimed<()>),
    /// Decided without holding anything: in progress, a reused key.
    Refused(Error),
}

/// Opens the call's observation and refuses a nested claim (before any I/O): what every entry
/// with a store does first.
pub(crate) fn start(request: &Request, mode: Mode, nested_check: bool) -> Result<Observed, Error> {
    let observed = Observed::start(
        request.site,
        &request.scope,
        mode,
        Some(request.key.as_str()),
        request.about,
    );
    begun(observed, request, mode, nested_check)
}

/// A claim's observation, begun: linked to the job's producer, told to the test kit, and a
/// claim inside another claim's body refused (and observed so) when `nested_check`.
pub(crate) fn begun(
    observed: Observed,
    request: &Request,
    mode: Mode,
    nested_check: bool,
) -> Result<Observed, Error> {
    if let Some(producer) = &request.options.link {
        trace_context::link(observed.span(), std::slice::from_ref(producer));
    }
    crate::testing::probe::claiming(mode);
    if nested_check && let Err(e) = nested::refuse_nested(&request.caller) {
        observed.refused(&e);
        return Err(e);
    }
    Ok(observed)
}

/// A way of claiming: one attempt of its statements. Each attempt ends what it began on the
/// paths that do not hold the key.
pub(crate) trait Attempts {
    /// What holds a fresh claim.
    type Fresh: Send;

    fn attempt(&mut self)
    -> impl Future<Output = Result<Attempt<Self::Fresh>, sqlx::Error>> + Send;
}

/// [`retrying`] in the claim's span.
pub(crate) async fn retrying_in_span<DB: Backend, A: Attempts>(
    observed: &mut Observed,
    request: &Request,
    retries: bool,
    attempts: &mut A,
) -> Result<Attempt<A::Fresh>, Error> {
    let span = observed.span().clone();
    observe::in_span(
        span,
        retrying::<DB, A>(observed, request, retries, attempts),
    )
    .await
}

/// Runs `attempts` until one answers, again after a lost race (a serialization failure, a
/// deadlock between waiters) at most [`CLAIM_ATTEMPTS`] times when `retries`; a lock wait that
/// ran out (`wait`) is [`Error::InProgress`]: nothing was claimed.
pub(crate) async fn retrying<DB: Backend, A: Attempts>(
    observed: &mut Observed,
    request: &Request,
    retries: bool,
    attempts: &mut A,
) -> Result<Attempt<A::Fresh>, Error> {
    let mut tried = 1;
    loop {
        let sent = observed.sending();
        let answer = attempts.attempt().await;
        observed.attempted(sent);
        match answer {
            Ok(answer) => return Ok(answer),
            Err(e) if DB::is_lock_timeout(&e) => return Err(request.in_progress()),
            // Another claimer's rollback or commit let us go with a transient error: the race
            // is decided, so asking again gives the real answer.
            Err(e) if retries && tried < CLAIM_ATTEMPTS && DB::is_transient(&e) => {
                observe::retry(tried, &e);
                tried += 1;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// The end of a claim's making: a fresh one is handed to `hold` with its ticket; any other
/// answer ends the call here, observed.
pub(crate) fn conclude<H, F>(
    mut observed: Observed,
    request: Request,
    answer: Result<Attempt<H>, Error>,
    hold: impl FnOnce(H, Ticket) -> F,
) -> Result<Claimed<F>, Error> {
    match answer {
        Ok(Attempt::Fresh(held, took_over)) => {
            observed.decided(match took_over {
                true => Answer::Takeover,
                false => Answer::Fresh,
            });
            Ok(Claimed::Fresh(hold(held, Ticket::new(request, observed))))
        }
        Ok(Attempt::Done(claimed)) => {
            let outcome = match &claimed {
                Claimed::Replayed(_) => {
                    observed.decided(Answer::Replayed);
                    Outcome::Replayed(())
                }
                Claimed::Failed(failure) => {
                    observed.decided(Answer::Duplicate);
                    Outcome::Failed(failure.clone())
                }
                _ => {
                    observed.decided(Answer::Duplicate);
                    Outcome::Duplicate
                }
            };
            observed.ended::<(), ()>(&Ok(outcome));
            Ok(claimed.map(|()| unreachable!("not fresh")))
        }
        Ok(Attempt::Refused(e)) | Err(e) => {
            observed.decided(match e {
                Error::InProgress { .. } => Answer::InProgress,
                _ => Answer::Failed,
            });
            observed.refused(&e);
            Err(e)
        }
    }
}

/// The marker of one key, claimed in an open transaction: the insert, and only when it finds a
/// marker (the duplicate path, which alone pays for it) the read of that marker and the
/// decision; a free lease is taken over in the same transaction. `own`: the transaction is
/// the claim's own ([`Claims::claim_or_read`](crate::backend::sealed::Claims::claim_or_read)).
async fn claim_one<DB: Backend>(
    conn: &mut DB::Connection,
    sql: &Sql<DB>,
    request: &Request,
    own: bool,
) -> Result<Attempt<()>, sqlx::Error> {
    let c = request.claimant();
    let replay = request.options.replay;
    for _ in 0..RECHECKS {
        let found = match DB::claim_or_read(conn, sql, c, replay, own).await? {
            (true, _) => return Ok(Attempt::Fresh((), false)),
            (false, Some(found)) => Some(found),
            // Committed while the insert waited for it: read it now.
            (false, None) => sql.marker(conn, c.scope, c.key).await?,
        };
        // Gone again (an operator forgot it): insert once more.
        let Some(found) = found else {
            continue;
        };
        match decide(found, request) {
            Ok(Decision::Done(claimed)) => return Ok(Attempt::Done(claimed)),
            Ok(Decision::TakeOver) => {
                if DB::take_over(conn, sql, c).await? {
                    return Ok(Attempt::Fresh((), true));
                }
                // Another delivery took it first: see what it made of it.
            }
            Err(e) => return Ok(Attempt::Refused(e)),
        }
    }
    Ok(Attempt::Refused(request.in_progress()))
}

/// A claim in a transaction of its own.
struct Own<'a, DB: Backend> {
    store: &'a Store<DB>,
    request: &'a Request,
}

impl<DB: Backend> Attempts for Own<'_, DB> {
    type Fresh = Transaction<'static, DB>;

    fn attempt(
        &mut self,
    ) -> impl Future<Output = Result<Attempt<Self::Fresh>, sqlx::Error>> + Send {
        own_attempt(self.store, self.request)
    }
}

/// One attempt of a claim in a transaction of its own: the begin (SQLite waits for the write
/// lock there, the servers in the claim: both are the attempt's wait), then the claim; a
/// transaction that holds nothing is ended before the answer.
async fn own_attempt<DB: Backend>(
    store: &Store<DB>,
    request: &Request,
) -> Result<Attempt<Transaction<'static, DB>>, sqlx::Error> {
    let (sql, options) = (store.sql(), &request.options);
    let mut tx = DB::begin(store.pool(), sql, options).await?;
    let answer = match claim_one::<DB>(&mut tx, sql, request, true).await {
        Ok(answer) => answer,
        Err(e) => {
            drop(DB::rollback(tx, options).await);
            return Err(e);
        }
    };
    match answer {
        Attempt::Fresh((), took_over) => Ok(Attempt::Fresh(tx, took_over)),
        // Decided without writing anything.
        Attempt::Done(done) => {
            DB::discard(tx, options).await?;
            Ok(Attempt::Done(done))
        }
        Attempt::Refused(e) => {
            DB::discard(tx, options).await?;
            Ok(Attempt::Refused(e))
        }
    }
}

/// A claim in a transaction of its own: what `&store` handlers and
/// [`Store::claim`](crate::Store::claim) run.
pub(crate) async fn own<DB: Backend>(
    store: &Store<DB>,
    request: Request,
) -> Result<Claimed<TxHeld<'static, DB>>, Error> {
    let mut observed = start(&request, Mode::Transaction, true)?;
    let mut attempts = Own {
        store,
        request: &request,
    };
    let answer = retrying_in_span::<DB, _>(&mut observed, &request, true, &mut attempts).await;
    let sql = store.shared_sql().clone();
    conclude(observed, request, answer, |tx, ticket| {
        TxHeld::new(tx, sql, false, ticket)
    })
}

/// A claim in a savepoint of the caller's transaction: one attempt.
struct InSavepoint<'a, 'r, DB: Backend> {
    conn: Option<&'a mut DB::Connection>,
    sql: &'r Sql<DB>,
    request: &'r Request,
}

impl<'a, DB: Backend> Attempts for InSavepoint<'a, '_, DB> {
    type Fresh = Transaction<'a, DB>;

    fn attempt(
        &mut self,
    ) -> impl Future<Output = Result<Attempt<Self::Fresh>, sqlx::Error>> + Send {
        let conn = self.conn.take().expect("a joined claim makes one attempt");
        savepoint_attempt(conn, self.sql, self.request)
    }
}

/// The claim in a savepoint (in a transaction, sqlx's `begin` is a `SAVEPOINT`); a savepoint
/// that holds nothing is rolled back before the answer.
async fn savepoint_attempt<'a, DB: Backend>(
    conn: &'a mut DB::Connection,
    sql: &Sql<DB>,
    request: &Request,
) -> Result<Attempt<Transaction<'a, DB>>, sqlx::Error> {
    let mut savepoint = conn.begin().await?;
    match claim_one::<DB>(&mut savepoint, sql, request, false).await {
        Ok(Attempt::Fresh((), took_over)) => Ok(Attempt::Fresh(savepoint, took_over)),
        Ok(answer) => {
            savepoint.rollback().await?;
            Ok(match answer {
                Attempt::Done(done) => Attempt::Done(done),
                Attempt::Refused(e) => Attempt::Refused(e),
                Attempt::Fresh(..) => unreachable!("matched above"),
            })
        }
        Err(e) => {
            // Back to the savepoint, so that the caller's transaction stays usable where the
            // database allows it (PostgreSQL aborts it on any error otherwise).
            drop(savepoint.rollback().await);
            Err(e)
        }
    }
}

/// One attempt of a claim in a savepoint of a shared transaction (a group's): the savepoint
/// (bounding the claim by `wait` where the backend does so per transaction), the claim, and
/// for anything but a fresh claim the savepoint rolled back, so that the transaction is as it
/// was. The outer `Err` says the transaction itself is gone: rolling back to the savepoint
/// failed (a lost connection; on MySQL a deadlock or lock wait that rolled back the whole
/// transaction).
pub(crate) async fn shared_attempt<DB: Backend>(
    conn: &mut DB::Connection,
    sql: &Sql<DB>,
    request: &Request,
    opening: Option<Savepoint>,
) -> Result<Result<Attempt<()>, sqlx::Error>, sqlx::Error> {
    let opened = match opening {
        Some(step) => DB::savepoint(conn, step).await,
        None => Ok(()),
    };
    let answer = match opened {
        Ok(()) => claim_one::<DB>(conn, sql, request, false).await,
        Err(e) => Err(e),
    };
    match answer {
        Ok(Attempt::Fresh((), took_over)) => Ok(Ok(Attempt::Fresh((), took_over))),
        Ok(answer) => {
            DB::savepoint(conn, Savepoint::RollBack).await?;
            Ok(Ok(answer))
        }
        // An error that took the whole transaction with it (MySQL's deadlock victim, a
        // transaction Galera's certification aborted) makes the rollback fail as well, with
        // `SAVEPOINT .. does not exist`: the claim's own error is the one that says what
        // happened (a lost race, which is retried), as in `savepoint_attempt`.
        Err(e) => match DB::savepoint(conn, Savepoint::RollBack).await {
            Ok(()) => Ok(Err(e)),
            Err(_) => Err(e),
        },
    }
}

/// A claim in a savepoint of a transaction the caller holds. No retry on a transient error,
/// unlike a claim of our own: the race was lost by the caller's transaction (MySQL has rolled
/// it back whole), so only the caller can retry.
pub(crate) async fn joined<'a, DB: Backend>(
    store: &Store<DB>,
    conn: &'a mut DB::Connection,
    request: Request,
) -> Result<Claimed<TxHeld<'a, DB>>, Error> {
    let mut observed = start(&request, Mode::Joined, false)?;
    let mut attempts = InSavepoint {
        conn: Some(conn),
        sql: store.sql(),
        request: &request,
    };
    let answer = retrying_in_span::<DB, _>(&mut observed, &request, false, &mut attempts).await;
    let sql = store.shared_sql().clone();
    conclude(observed, request, answer, |tx, ticket| {
        TxHeld::new(tx, sql, true, ticket)
    })
}

/// The keys a batch claim holds: every one (`fresh`), and which of them were free leases it
/// took over (`taken`; the others it inserted).
#[derive(Debug, Default)]
pub(crate) struct Keys {
    pub(crate) fresh: Vec<String>,
    pub(crate) taken: Vec<String>,
}

/// The keys of a batch, claimed in an open transaction with one statement; the markers it
/// meets are read (one statement, only if there are any) and decided as for one key, except
/// that a live lease of any of them makes the whole batch `InProgress`: nothing is claimed,
/// and every job is redelivered.
async fn claim_keys<DB: Backend>(
    conn: &mut DB::Connection,
    sql: &Sql<DB>,
    request: &Request,
    keys: &[&str],
    failed: &mut Vec<(String, Failure)>,
) -> Result<Result<Keys, Error>, sqlx::Error> {
    let c = request.claimant();
    let mut fresh = DB::claim_batch(conn, sql, c, keys).await?;
    if fresh.len() == keys.len() {
        let taken = Vec::new();
        return Ok(Ok(Keys { fresh, taken }));
    }
    let taken: HashSet<&str> = fresh.iter().map(String::as_str).collect();
    let met: Vec<&str> = keys
        .iter()
        .copied()
        .filter(|k| !taken.contains(k))
        .collect();
    let found = DB::batch_markers(conn, sql, c.scope, &met).await?;
    // A marker that vanished since the insert was forgotten meanwhile: let the batch come
    // back rather than guess.
    if found.len() < met.len() {
        return Ok(Err(request.in_progress()));
    }
    let mut free = Vec::new();
    for (key, found) in found {
        match decide(found, request) {
            Ok(Decision::Done(Claimed::Failed(failure))) => failed.push((key, failure)),
            Ok(Decision::Done(_)) => {}
            Ok(Decision::TakeOver) => free.push(key),
            Err(e) => return Ok(Err(e)),
        }
    }
    if !free.is_empty() {
        let free: Vec<&str> = free.iter().map(String::as_str).collect();
        let took = DB::take_over_batch(conn, sql, c, &free).await?;
        if took.len() < free.len() {
            return Ok(Err(request.in_progress()));
        }
        fresh.extend(took.iter().cloned());
        return Ok(Ok(Keys { fresh, taken: took }));
    }
    let taken = Vec::new();
    Ok(Ok(Keys { fresh, taken }))
}

/// A batch claim in a transaction of its own.
struct Batched<'a, DB: Backend> {
    store: &'a Store<DB>,
    request: &'a Request,
    keys: &'a [&'a str],
    /// The keys the last attempt found failed for good, each with its failure.
    failed: Vec<(String, Failure)>,
}

impl<DB: Backend> Attempts for Batched<'_, DB> {
    type Fresh = (Transaction<'static, DB>, Keys);

    fn attempt(
        &mut self,
    ) -> impl Future<Output = Result<Attempt<Self::Fresh>, sqlx::Error>> + Send {
        self.failed.clear();
        batch_attempt(self.store, self.request, self.keys, &mut self.failed)
    }
}

/// One attempt of a batch claim: the begin, then its keys; a transaction that holds nothing is
/// ended before the answer.
async fn batch_attempt<DB: Backend>(
    store: &Store<DB>,
    request: &Request,
    keys: &[&str],
    failed: &mut Vec<(String, Failure)>,
) -> Result<Attempt<(Transaction<'static, DB>, Keys)>, sqlx::Error> {
    let (sql, options) = (store.sql(), &request.options);
    let mut tx = DB::begin(store.pool(), sql, options).await?;
    let claimed = async {
        let fresh = claim_keys::<DB>(&mut tx, sql, request, keys, failed).await?;
        if matches!(&fresh, Ok(keys) if !keys.fresh.is_empty()) {
            DB::batch_claimed(&mut tx, sql, options).await?;
        }
        Ok(fresh)
    };
    match claimed.await {
        Ok(Ok(keys)) if keys.fresh.is_empty() => {
            DB::discard(tx, options).await?;
            Ok(Attempt::Done(Claimed::Duplicate))
        }
        Ok(Ok(keys)) => Ok(Attempt::Fresh((tx, keys), false)),
        Ok(Err(e)) => {
            DB::discard(tx, options).await?;
            Ok(Attempt::Refused(e))
        }
        Err(e) => {
            drop(DB::rollback(tx, options).await);
            Err(e)
        }
    }
}

/// A batch claim in a transaction of its own: the keys this delivery holds, those that failed
/// for good in an earlier delivery, and the open transaction with its ticket, if it holds any
/// (else the call has ended: every job was a duplicate or a failure).
pub(crate) async fn batch<DB: Backend>(
    store: &Store<DB>,
    request: Request,
    keys: &[&str],
    jobs: usize,
) -> Result<(Keys, Vec<(String, Failure)>, Option<TxHeld<'static, DB>>), Error> {
    let observed = Observed::batch(request.site, &request.scope, jobs, request.about);
    let mut observed = begun(observed, &request, Mode::Batch, true)?;
    let mut attempts = Batched {
        store,
        request: &request,
        keys,
        failed: Vec::new(),
    };
    let answer = retrying_in_span::<DB, _>(&mut observed, &request, true, &mut attempts).await;
    let failed = attempts.failed;
    match answer {
        Ok(Attempt::Done(_)) => {
            observed.decided(Answer::Duplicate);
            observed.ended_batch::<(), ()>(&Ok(Batch::new(&vec![false; jobs], None)));
            Ok((Keys::default(), failed, None))
        }
        other => {
            let sql = store.shared_sql().clone();
            let held = conclude(observed, request, other, |(tx, fresh), ticket| {
                (fresh, TxHeld::new(tx, sql, false, ticket))
            })?;
            match held {
                Claimed::Fresh((fresh, held)) => Ok((fresh, failed, Some(held))),
                _ => unreachable!("a batch's duplicates end above"),
            }
        }
    }
}
