//! Running a claim: its statements in a transaction, the begin-and-retry loop of a claim in a
//! transaction of its own, and a claim in a savepoint of the caller's.

use std::collections::HashSet;
use std::time::Instant;

use sqlx::{Connection as _, Transaction};

use super::{CLAIM_ATTEMPTS, Claimed, Decided, Held, RECHECKS, Request, decide, decision};
use crate::backend::{Backend, Hold, Statements};
use crate::observe;
use crate::{Error, Store};

/// A statement failed (`Err`: the caller tells a lost race or a lock timeout from a failure),
/// or the claim was decided (`Ok`), possibly as an error of idem's (in progress, key reused).
type Step<T> = Result<Result<T, Error>, sqlx::Error>;

/// What an attempt claims: one key, or the sorted, distinct keys of a batch.
#[derive(Clone, Copy)]
enum Ask<'a> {
    One,
    Batch(&'a [&'a str]),
}

enum Got {
    One(Claimed<()>),
    /// The keys of a batch this transaction now holds.
    Batch(Vec<String>),
}

/// One key, claimed in an open transaction: the insert, and only when it finds a marker (the
/// duplicate path, which alone pays for it) the read of that marker and the decision; a free
/// lease is taken over in the same transaction.
async fn claim_one<DB: Backend>(
    conn: &mut DB::Connection,
    st: &Statements,
    request: &Request,
) -> Step<(Claimed<()>, bool)> {
    let c = request.claimant();
    let replay = request.options.replay;
    for _ in 0..RECHECKS {
        let found = match DB::claim_or_read(conn, st, c, replay).await? {
            (true, _) => return Ok(Ok((Claimed::Fresh(()), false))),
            (false, Some(found)) => Some(found),
            // Committed while the insert waited for it: read it now.
            (false, None) => DB::marker(conn, st, c.scope, c.key).await?,
        };
        // Gone again (an operator forgot it): insert once more.
        let Some(found) = found else {
            continue;
        };
        match decide(found, request) {
            Ok(Decided::Done(claimed)) => return Ok(Ok((claimed, false))),
            Ok(Decided::TakeOver) => {
                if DB::take_over(conn, st, c).await? {
                    return Ok(Ok((Claimed::Fresh(()), true)));
                }
                // Another delivery took it first: see what it made of it.
            }
            Err(e) => return Ok(Err(e)),
        }
    }
    Ok(Err(request.in_progress()))
}

/// The keys of a batch, claimed in an open transaction with one statement; the markers it
/// meets are read (one statement, only if there are any) and decided as for one key, except
/// that a live lease of any of them makes the whole batch `InProgress`: nothing is claimed,
/// and every job is redelivered.
async fn claim_batch<DB: Backend>(
    conn: &mut DB::Connection,
    st: &Statements,
    request: &Request,
    keys: &[&str],
) -> Step<Vec<String>> {
    let c = request.claimant();
    let mut fresh = DB::try_claim_batch(conn, st, c, keys).await?;
    if fresh.len() == keys.len() {
        return Ok(Ok(fresh));
    }
    let taken: HashSet<&str> = fresh.iter().map(String::as_str).collect();
    let met: Vec<&str> = keys
        .iter()
        .copied()
        .filter(|k| !taken.contains(k))
        .collect();
    let found = DB::batch_markers(conn, st, c.scope, &met).await?;
    // A marker that vanished since the insert was forgotten meanwhile: let the batch come
    // back rather than guess.
    if found.len() < met.len() || found.iter().any(|(_, hold)| *hold == Hold::Live) {
        return Ok(Err(request.in_progress()));
    }
    let free: Vec<&str> = found
        .iter()
        .filter(|(_, hold)| *hold == Hold::Free)
        .map(|(key, _)| key.as_str())
        .collect();
    if !free.is_empty() {
        let took = DB::take_over_batch(conn, st, c, &free).await?;
        if took.len() < free.len() {
            return Ok(Err(request.in_progress()));
        }
        fresh.extend(took);
    }
    Ok(Ok(fresh))
}

/// Begins a transaction of the call's own and claims in it, again after a lost race (a
/// serialization failure, a deadlock between waiters), at most [`CLAIM_ATTEMPTS`] times. A
/// lock wait that ran out (`wait`) is [`Error::InProgress`]: nothing was claimed.
async fn attempts<DB: Backend>(
    store: &Store<DB>,
    request: &Request,
    ask: Ask<'_>,
) -> Result<(Transaction<'static, DB>, Got, bool), Error> {
    let st = store.statements();
    let options = &request.options;
    let mut attempt = 1;
    loop {
        // SQLite waits for the write lock in the begin, the servers in the claim: both are
        // the attempt's wait.
        let sent = Instant::now();
        let begun = store.pool().begin_with(DB::begin_sql(st, options)).await;
        let mut tx = match begun {
            Ok(tx) => tx,
            Err(e) => {
                observe::attempted(sent);
                if DB::is_lock_timeout(&e) {
                    return Err(request.in_progress());
                }
                return Err(e.into());
            }
        };
        let step = match ask {
            Ask::One => claim_one::<DB>(&mut tx, st, request)
                .await
                .map(|r| r.map(|(claimed, took_over)| (Got::One(claimed), took_over))),
            Ask::Batch(keys) => claim_batch::<DB>(&mut tx, st, request, keys)
                .await
                .map(|r| r.map(|fresh| (Got::Batch(fresh), false))),
        };
        observe::attempted(sent);
        match step {
            Ok(Ok((got, took_over))) => return Ok((tx, got, took_over)),
            // Decided without writing anything.
            Ok(Err(e)) => {
                DB::abandon(tx, options).await?;
                return Err(e);
            }
            Err(e) if DB::is_lock_timeout(&e) => {
                drop(DB::rollback(tx, options).await);
                return Err(request.in_progress());
            }
            // Another claimer's rollback or commit let us go with a transient error: the race
            // is decided, so asking again gives the real answer.
            Err(e) if attempt < CLAIM_ATTEMPTS && DB::is_transient(&e) => {
                drop(DB::rollback(tx, options).await);
                observe::retry(attempt, &e);
                attempt += 1;
            }
            Err(e) => {
                drop(DB::rollback(tx, options).await);
                return Err(e.into());
            }
        }
    }
}

/// A claim in a transaction of its own: what `&store` handlers and [`Store::claim`] run.
pub(crate) async fn own<DB: Backend>(
    store: &Store<DB>,
    request: Request,
) -> Result<Claimed<Held<'static, DB>>, Error> {
    let started = Instant::now();
    #[cfg(feature = "testing")]
    crate::testing::probe::claiming(crate::options::Mode::Transaction);
    let claimed = match attempts(store, &request, Ask::One).await {
        Ok((tx, Got::One(Claimed::Fresh(())), took_over)) => {
            let held = Held::new(tx, store.statements().clone(), request, false);
            (Ok(Claimed::Fresh(held)), took_over)
        }
        Ok((tx, Got::One(answer), _)) => match DB::abandon(tx, &request.options).await {
            Ok(()) => (Ok(answer.map(|()| unreachable!("not fresh"))), false),
            Err(e) => (Err(e.into()), false),
        },
        Ok((_, Got::Batch(_), _)) => unreachable!("one key asked"),
        Err(e) => (Err(e), false),
    };
    let (claimed, took_over) = claimed;
    observe::decided(started, decision(&claimed, took_over));
    claimed
}

/// A batch claim in a transaction of its own: the keys this delivery holds, and the open
/// transaction if it holds any (else it has ended already).
pub(crate) async fn own_batch<DB: Backend>(
    store: &Store<DB>,
    request: Request,
    keys: &[&str],
) -> Result<(Vec<String>, Option<Transaction<'static, DB>>), Error> {
    let started = Instant::now();
    let claimed = attempts(store, &request, Ask::Batch(keys)).await;
    let claimed = match claimed {
        Ok((tx, Got::Batch(fresh), _)) if fresh.is_empty() => {
            match DB::abandon(tx, &request.options).await {
                Ok(()) => Ok((fresh, None)),
                Err(e) => Err(e.into()),
            }
        }
        Ok((tx, Got::Batch(fresh), _)) => Ok((fresh, Some(tx))),
        Ok((_, Got::One(_), _)) => unreachable!("a batch asked"),
        Err(e) => Err(e),
    };
    let decision = match &claimed {
        Ok((_, None)) => observe::Decision::Duplicate,
        Ok(_) => observe::Decision::Fresh,
        Err(Error::InProgress { .. }) => observe::Decision::InProgress,
        Err(_) => observe::Decision::Failed,
    };
    observe::decided(started, decision);
    claimed
}

/// A claim in a savepoint of a transaction the caller holds. No retry on a transient error,
/// unlike a claim of our own: the race was lost by the caller's transaction (MySQL has rolled
/// it back whole), so only the caller can retry.
pub(crate) async fn joined<'a, DB: Backend>(
    store: &Store<DB>,
    conn: &'a mut DB::Connection,
    request: Request,
) -> Result<Claimed<Held<'a, DB>>, Error> {
    let started = Instant::now();
    #[cfg(feature = "testing")]
    crate::testing::probe::claiming(crate::options::Mode::Transaction);
    let (claimed, took_over) = joined_attempt(store, conn, request).await;
    observe::decided(started, decision(&claimed, took_over));
    claimed
}

async fn joined_attempt<'a, DB: Backend>(
    store: &Store<DB>,
    conn: &'a mut DB::Connection,
    request: Request,
) -> (Result<Claimed<Held<'a, DB>>, Error>, bool) {
    let st = store.statements();
    // In a transaction, sqlx's `begin` is a SAVEPOINT.
    let sent = Instant::now();
    let mut savepoint = match conn.begin().await {
        Ok(tx) => tx,
        Err(e) => {
            observe::attempted(sent);
            if DB::is_lock_timeout(&e) {
                return (Err(request.in_progress()), false);
            }
            return (Err(e.into()), false);
        }
    };
    let step = claim_one::<DB>(&mut savepoint, st, &request).await;
    observe::attempted(sent);
    match step {
        Ok(Ok((Claimed::Fresh(()), took_over))) => {
            let held = Held::new(savepoint, st.clone(), request, true);
            (Ok(Claimed::Fresh(held)), took_over)
        }
        Ok(Ok((answer, _))) => match savepoint.rollback().await {
            Ok(()) => (Ok(answer.map(|()| unreachable!("not fresh"))), false),
            Err(e) => (Err(e.into()), false),
        },
        Ok(Err(e)) => {
            drop(savepoint.rollback().await);
            (Err(e), false)
        }
        Err(e) => {
            // Back to the savepoint, so that the caller's transaction stays usable where the
            // database allows it (PostgreSQL aborts it on any error otherwise).
            drop(savepoint.rollback().await);
            if DB::is_lock_timeout(&e) {
                return (Err(request.in_progress()), false);
            }
            (Err(e.into()), false)
        }
    }
}
