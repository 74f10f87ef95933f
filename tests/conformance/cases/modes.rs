//! Modes meet on one scope: every ordered pair of transaction, joined, batch and lease
//! deliveries of one job. The second never reports `Duplicate` (so never acks) a job the first
//! has not completed: it is `InProgress` while a lease holds it, waits while a transaction
//! holds it, and applies once the first let it go; a completed marker is a duplicate to every
//! mode.

use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use idem::{Disposition, LeaseOptions, Outcome, Settle};
use sqlx::Pool;

use super::lease::db_now_plus;
use crate::conformance::batch_handlers::{BatchThen, apply_batch};
use crate::conformance::ctx::Ctx;
use crate::conformance::db::Bind;
use crate::conformance::handlers::*;
use crate::conformance::util::within;
use crate::conformance::{Support, TestDb};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Transaction,
    Joined,
    Batch,
    Lease,
}

const MODES: [Mode; 4] = [Mode::Transaction, Mode::Joined, Mode::Batch, Mode::Lease];

/// What a delivery got, compared exactly.
#[derive(Debug, PartialEq, Eq)]
enum Got {
    Applied,
    Duplicate,
    InProgress,
    LeaseLost,
    Refused,
    Other(String),
}

/// What `result` is, once the consumer loop's decision on it was checked: an ack for work that
/// was kept, a delayed retry for a key another delivery holds, a backoff for what was not kept.
fn got<T: std::fmt::Debug>(result: Result<Outcome<T>, TestError>) -> Got {
    let settled = Settle::new().decide(&result, 1);
    let got = match result {
        Ok(Outcome::Applied(_)) => Got::Applied,
        Ok(Outcome::Duplicate) => Got::Duplicate,
        Err(TestError::Idem(idem::Error::InProgress { .. })) => Got::InProgress,
        Err(TestError::Idem(idem::Error::Lease(idem::LeaseError::Lost { .. }))) => Got::LeaseLost,
        Err(TestError::Refused) => Got::Refused,
        other => return Got::Other(format!("{other:?}")),
    };
    let expected = match got {
        Got::Applied | Got::Duplicate => Disposition::Ack,
        Got::InProgress => Disposition::Retry {
            after: Duration::from_secs(1),
        },
        _ => Disposition::Retry {
            after: Duration::from_millis(100),
        },
    };
    assert_eq!(settled, expected, "the consumer loop's decision on {got:?}");
    got
}

/// The lease-mode `apply`, in the same scope: the effect is an autocommit statement of its
/// own (the outside system's). `fail` fails the body before the effect; `hold` parks the first
/// body before anything.
#[idem::idempotent(key = "job.key", scope = "apply", lease = "30s")]
async fn apply_leased<DB: TestDb>(
    lease: &idem::Lease,
    job: &Job,
    pool: &Pool<DB>,
    hold: Option<&Hold>,
    fail: bool,
) -> Result<i64, TestError> {
    assert_eq!(lease.key(), job.key);
    if let Some(hold) = hold {
        hold.park_first().await;
    }
    if fail {
        return Err(TestError::Refused);
    }
    let sql = format!(
        "INSERT INTO {} (id, amount, origin) VALUES ($1, $2, 'lease')",
        job.effects
    );
    let mut conn = pool.acquire().await?;
    DB::execute(&mut conn, &sql, &[Bind::I64(job.id), Bind::I64(job.amount)]).await?;
    Ok(job.amount)
}

/// One delivery of `job` in `mode`. With `hold`, the first body parks on it, then fails (so
/// the key is let go); without, it commits.
async fn deliver<S: Support>(ctx: &Ctx<S>, mode: Mode, job: &Job, hold: Option<&Hold>) -> Got {
    let fails = AtomicUsize::new(usize::from(hold.is_some()));
    match mode {
        Mode::Transaction => match hold {
            Some(hold) => got(apply_unless_told_to_fail(&ctx.store, job, &fails, hold).await),
            None => got(apply(&ctx.store, job, Then::Commit).await),
        },
        Mode::Joined => {
            let mut tx = ctx.pool.begin().await.expect("begin");
            let answer = match hold {
                Some(hold) => {
                    apply_unless_told_to_fail(ctx.store.join(&mut tx), job, &fails, hold).await
                }
                None => apply(ctx.store.join(&mut tx), job, Then::Commit).await,
            };
            if answer.is_ok() {
                idem::commit(tx).await.expect("the caller's commit");
            }
            got(answer)
        }
        Mode::Batch => {
            let then = match hold {
                Some(_) => BatchThen::ParkThenFail,
                None => BatchThen::Commit,
            };
            match apply_batch(&ctx.store, std::slice::from_ref(job), then, hold).await {
                Ok(batch) => match batch.outcomes() {
                    [Outcome::Applied(())] => Got::Applied,
                    [Outcome::Duplicate] => Got::Duplicate,
                    other => Got::Other(format!("{other:?}")),
                },
                Err(e) => got::<()>(Err(e)),
            }
        }
        Mode::Lease => got(apply_leased(&ctx.store, job, &ctx.pool, hold, hold.is_some()).await),
    }
}

/// Until a claim is seen waiting on the marker table's row locks (servers); SQLite's waiters
/// wait in the busy handler, where no query sees them, so there the overlap is not shown.
async fn until_a_claim_waits<S: Support>(ctx: &Ctx<S>) {
    if ctx.claims_waiting().await.is_none() {
        return;
    }
    within(30, "a claim waiting on the key", async {
        while ctx.claims_waiting().await.unwrap_or(0) < 1 {
            tokio::task::yield_now().await;
        }
    })
    .await;
}

/// A completed marker of any mode is a duplicate to every mode: 16 ordered pairs.
pub(crate) async fn every_mode_reads_a_completed_marker_of_every_mode_as_a_duplicate<S: Support>() {
    let ctx = Ctx::<S>::new("modes_done", 3).await;
    let mut id = 0;
    for first in MODES {
        for second in MODES {
            id += 1;
            let job = ctx.job(&format!("done-{id}"), id, 1);
            assert_eq!(
                deliver(&ctx, first, &job, None).await,
                Got::Applied,
                "{first:?}"
            );
            let again = deliver(&ctx, second, &job, None).await;
            assert_eq!(again, Got::Duplicate, "{first:?} then {second:?}");
            assert_eq!(ctx.effects(id).await, 1, "{first:?} then {second:?}");
        }
    }
    ctx.cleanup().await;
}

/// A live lease is `InProgress` to every mode (never a duplicate: its job may still fail);
/// once its holder fails and releases the key, the same mode's next delivery applies.
pub(crate) async fn a_live_lease_is_in_progress_to_every_mode_then_released<S: Support>() {
    let ctx = Ctx::<S>::new("modes_live", 4).await;
    for (n, second) in MODES.into_iter().enumerate() {
        let id = n as i64 + 1;
        let job = ctx.job(&format!("live-{id}"), id, 1);
        let hold = Hold::default();
        let holder = deliver(&ctx, Mode::Lease, &job, Some(&hold));
        let meanwhile = async {
            hold.entered().await;
            let during = deliver(&ctx, second, &job, None).await;
            hold.release();
            during
        };
        let (held, during) = tokio::join!(holder, meanwhile);
        assert_eq!(
            during,
            Got::InProgress,
            "{second:?} while a lease holds the key"
        );
        assert_eq!(held, Got::Refused);
        assert_eq!(ctx.effects(id).await, 0, "{second:?}");
        let after = deliver(&ctx, second, &job, None).await;
        assert_eq!(
            after,
            Got::Applied,
            "{second:?} after the lease was released"
        );
        assert_eq!(ctx.effects(id).await, 1, "{second:?}");
    }
    ctx.cleanup().await;
}

/// A lease that ran out is taken over by every mode, and its old holder can no longer complete it
/// (`LeaseError::Lost`): the job applies once.
pub(crate) async fn an_expired_lease_is_taken_over_by_every_mode<S: Support>() {
    let ctx = Ctx::<S>::new("modes_expired", 3).await;
    for (n, second) in MODES.into_iter().enumerate() {
        let id = n as i64 + 1;
        let job = ctx.job(&format!("expired-{id}"), id, 1);
        let key = idem::Key::new(&job.key).expect("a valid key");
        let options = LeaseOptions::new(Duration::from_secs(30));
        let stale = match ctx.store.lease("apply", &key, options).await {
            Ok(idem::Claimed::Fresh(lease)) => lease,
            other => panic!("expected a fresh lease, got {other:?}"),
        };
        ctx.set_locked_until(&job.key, &db_now_plus::<S>(-1000))
            .await;
        assert_eq!(
            deliver(&ctx, second, &job, None).await,
            Got::Applied,
            "{second:?}"
        );
        assert_eq!(
            got(stale.finish::<(), TestError>(Ok(())).await),
            Got::LeaseLost
        );
        assert_eq!(
            deliver(&ctx, second, &job, None).await,
            Got::Duplicate,
            "{second:?}"
        );
        assert_eq!(ctx.effects(id).await, 1, "{second:?}");
    }
    ctx.cleanup().await;
}

/// A transaction, joined or batch delivery holding the key (its marker not yet committed)
/// keeps every other claim in a transaction waiting, never answering `Duplicate`; when it
/// fails, the waiter applies. On the servers the waiter is seen waiting on the key before the
/// holder fails. A lease claim does not wait behind it on the servers (lease mode answers at
/// once, or within its `wait`): it is `InProgress` while the transaction holds the key, and
/// applies after. On SQLite every writer, a lease claim included, waits for the one write lock.
pub(crate) async fn a_transaction_holding_the_key_keeps_every_mode_waiting<S: Support>() {
    let ctx = Ctx::<S>::new("modes_held", 4).await;
    let lease_waits = crate::conformance::util::backend::<S::Db>() == "sqlite";
    let mut id = 0;
    for first in [Mode::Transaction, Mode::Joined, Mode::Batch] {
        for second in MODES {
            id += 1;
            let job = ctx.job(&format!("held-{id}"), id, 1);
            let hold = Hold::default();
            let holder = deliver(&ctx, first, &job, Some(&hold));
            let refused = second == Mode::Lease && !lease_waits;
            let meanwhile = async {
                hold.entered().await;
                if refused {
                    let during = deliver(&ctx, second, &job, None).await;
                    hold.release();
                    return during;
                }
                let waiter = deliver(&ctx, second, &job, None);
                let release = async {
                    until_a_claim_waits(&ctx).await;
                    hold.release();
                };
                tokio::join!(waiter, release).0
            };
            let (held, during) =
                within(60, "the pair", async { tokio::join!(holder, meanwhile) }).await;
            assert_eq!(held, Got::Refused, "{first:?} then {second:?}");
            if refused {
                assert_eq!(during, Got::InProgress, "{first:?} then a lease");
                assert_eq!(ctx.effects(id).await, 0, "{first:?} then a lease");
                let after = deliver(&ctx, second, &job, None).await;
                assert_eq!(after, Got::Applied, "{first:?} then a lease, after");
            } else {
                assert_eq!(during, Got::Applied, "{first:?} then {second:?}");
            }
            assert_eq!(ctx.effects(id).await, 1, "{first:?} then {second:?}");
        }
    }
    ctx.cleanup().await;
}
