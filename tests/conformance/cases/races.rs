//! Concurrent deliveries of one key: shown to overlap, at the default isolation and at the
//! stricter ones, and with a `wait` that runs out.

use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use idem::{ClaimOptions, Claimed, Isolation, Outcome, Store};

use crate::conformance::ctx::Ctx;
use crate::conformance::handlers::*;
use crate::conformance::util::{until, within};
use crate::conformance::{Support, TestDb};

/// Deliveries of one key in a race. Not the 64 of earlier versions: each waiter holds a
/// connection while it waits on the key, and the PostgreSQL server here (`max_connections`
/// 100) is shared with other suites running at the same time.
const DELIVERIES: usize = 32;

/// Blocks until the `deliveries - 1` deliveries that are not parked in the body are visibly
/// queued behind the key, so that the race is shown to overlap instead of assumed to.
///
/// PostgreSQL and MariaDB: the database lists them as lock waiters on a statement against
/// this test's marker table. SQLite: waiters sit in the busy handler of `BEGIN IMMEDIATE`,
/// which SQL cannot see; instead, every delivery has checked a connection out of the pool
/// (a claim holds one from `BEGIN IMMEDIATE` on) while a probe without a busy handler finds
/// the write lock taken, so all but the parked one are inside `BEGIN IMMEDIATE`.
pub(crate) async fn until_all_queued<S: Support>(ctx: &Ctx<S>, deliveries: usize) {
    let waiters = (deliveries - 1) as i64;
    if S::LOCK_WAITERS.is_some() {
        until(
            120,
            "the other deliveries queuing behind the key",
            || async { ctx.claims_waiting().await == Some(waiters) },
        )
        .await;
        return;
    }
    until(120, "every delivery holding a connection", || async {
        let pool = &ctx.pool;
        (pool.size() as usize).saturating_sub(pool.num_idle()) == deliveries
    })
    .await;
    let mut probe = ctx.pool.acquire().await.expect("an observer connection");
    S::Db::execute(&mut probe, "PRAGMA busy_timeout = 0", &[])
        .await
        .expect("busy_timeout");
    let taken = S::Db::execute(&mut probe, "BEGIN IMMEDIATE", &[]).await;
    S::Db::execute(&mut probe, "PRAGMA busy_timeout = 60000", &[])
        .await
        .expect("busy_timeout");
    match taken {
        Err(e) => assert_eq!(
            crate::conformance::util::db_code(&e).as_deref(),
            Some("5"),
            "{e}"
        ),
        Ok(_) => panic!("the write lock was free while a body was parked"),
    }
}

/// The claim retries since `before`, printed (process-wide: tests running in parallel add
/// theirs).
fn print_retries(test: &str, before: u64) {
    let n = idem::__private::claim_retries() - before;
    println!("{test}: claim retries {n}");
}

pub(crate) async fn concurrent_deliveries_of_one_key_apply_once<S: Support>() {
    let before = idem::__private::claim_retries();
    // Every delivery and the observer have a connection.
    let ctx = Ctx::<S>::new("race", DELIVERIES as u32 + 2).await;
    let job = ctx.job("job-race", 4, 40);
    let hold = Arc::new(Hold::default());
    let barrier = Arc::new(tokio::sync::Barrier::new(DELIVERIES));
    let tasks: Vec<_> = (0..DELIVERIES)
        .map(|_| {
            let (store, job, barrier, hold) = (
                ctx.store.clone(),
                job.clone(),
                barrier.clone(),
                hold.clone(),
            );
            tokio::spawn(async move {
                barrier.wait().await;
                apply_holding(&store, &job, &hold).await
            })
        })
        .collect();
    within(120, "a first delivery parking in its body", hold.entered()).await;
    until_all_queued(&ctx, DELIVERIES).await;
    hold.release();
    let (mut applied_n, mut duplicate_n) = (0, 0);
    for t in tasks {
        match within(120, "a concurrent delivery", t)
            .await
            .expect("no panic")
        {
            Ok(Outcome::Applied(v)) => {
                assert_eq!(v, 40);
                applied_n += 1;
            }
            Ok(Outcome::Duplicate | Outcome::Replayed(_)) => duplicate_n += 1,
            Ok(Outcome::Failed(f)) => panic!("no delivery fails for good here: {f:?}"),
            Err(e) => panic!("a concurrent delivery failed: {e:?}"),
        }
    }
    print_retries("concurrent_deliveries_of_one_key_apply_once", before);
    assert_eq!((applied_n, duplicate_n), (1, DELIVERIES - 1));
    assert_eq!(ctx.effects(4).await, 1);
    assert_eq!(ctx.effects_total().await, 1);
    assert_eq!(ctx.markers().await, 1);
    ctx.cleanup().await;
}

/// With holders that roll back while the others wait on the key (on InnoDB the waiters can
/// then deadlock with each other: a race to retry, never a failure).
pub(crate) async fn concurrent_deliveries_after_failed_holders_apply_once<S: Support>() {
    const FAILURES: usize = 8;
    let before = idem::__private::claim_retries();
    let ctx = Ctx::<S>::new("rollbackrace", DELIVERIES as u32 + 2).await;
    let job = ctx.job("job-rollback-race", 41, 410);
    let failures = Arc::new(AtomicUsize::new(FAILURES));
    let hold = Arc::new(Hold::default());
    let barrier = Arc::new(tokio::sync::Barrier::new(DELIVERIES));
    let tasks: Vec<_> = (0..DELIVERIES)
        .map(|_| {
            let (store, job, barrier, failures, hold) = (
                ctx.store.clone(),
                job.clone(),
                barrier.clone(),
                failures.clone(),
                hold.clone(),
            );
            tokio::spawn(async move {
                barrier.wait().await;
                apply_unless_told_to_fail(&store, &job, &failures, &hold).await
            })
        })
        .collect();
    within(120, "a first delivery parking in its body", hold.entered()).await;
    until_all_queued(&ctx, DELIVERIES).await;
    hold.release();
    let (mut applied_n, mut duplicate_n, mut refused_n) = (0, 0, 0);
    for t in tasks {
        match within(120, "a concurrent delivery", t)
            .await
            .expect("no panic")
        {
            Ok(Outcome::Applied(v)) => {
                assert_eq!(v, 410);
                applied_n += 1;
            }
            Ok(Outcome::Duplicate | Outcome::Replayed(_)) => duplicate_n += 1,
            Ok(Outcome::Failed(f)) => panic!("no delivery fails for good here: {f:?}"),
            Err(TestError::Refused) => refused_n += 1,
            Err(e) => panic!("a concurrent delivery failed: {e:?}"),
        }
    }
    print_retries(
        "concurrent_deliveries_after_failed_holders_apply_once",
        before,
    );
    assert_eq!(
        (applied_n, refused_n, duplicate_n),
        (1, FAILURES, DELIVERIES - FAILURES - 1),
        "(applied, failed bodies, duplicates)"
    );
    assert_eq!(ctx.effects(41).await, 1);
    assert_eq!(ctx.effects_total().await, 1);
    assert_eq!(ctx.markers().await, 1);
    ctx.cleanup().await;
}

/// `apply` written by hand with [`Store::claim_with`], for the options the attribute of this
/// branch cannot set yet; the first body parks on `hold`.
async fn apply_with<DB: TestDb>(
    store: &Store<DB>,
    job: &Job,
    options: ClaimOptions,
    hold: &Hold,
) -> Result<Outcome<i64>, TestError> {
    let key = idem::Key::new(job.key.as_str()).map_err(idem::Error::from)?;
    match store.claim_with("apply", &key, options).await? {
        Claimed::Duplicate | Claimed::Replayed(_) => Ok(Outcome::Duplicate),
        Claimed::Failed(f) => Ok(Outcome::Failed(f)),
        Claimed::Fresh(mut guard) => {
            let result = insert_effect(guard.tx(), job, "apply").await;
            hold.park_first().await;
            guard
                .finish(result.map(|()| job.amount).map_err(TestError::from))
                .await
        }
    }
}

/// Deliveries at `level`, shown to overlap like the ones above (SQLite ignores the level: its
/// writers are serialised). A waiter that wakes to a committed marker outside its snapshot
/// fails with a serialization failure (PostgreSQL) or deadlocks (InnoDB), and is retried.
async fn race_at<S: Support>(level: Isolation, tag: &str, id: i64) {
    const RACERS: usize = 16;
    let before = idem::__private::claim_retries();
    let ctx = Ctx::<S>::new(tag, RACERS as u32 + 2).await;
    let job = ctx.job(&format!("job-{tag}"), id, id * 10);
    let options = ClaimOptions::new().isolation(level);
    let hold = Arc::new(Hold::default());
    let tasks: Vec<_> = (0..RACERS)
        .map(|_| {
            let (store, job, hold) = (ctx.store.clone(), job.clone(), hold.clone());
            tokio::spawn(async move { apply_with(&store, &job, options, &hold).await })
        })
        .collect();
    within(120, "a first delivery parking in its body", hold.entered()).await;
    until_all_queued(&ctx, RACERS).await;
    hold.release();
    let (mut applied_n, mut duplicate_n) = (0, 0);
    for t in tasks {
        match within(120, "a concurrent delivery", t)
            .await
            .expect("no panic")
        {
            Ok(Outcome::Applied(v)) => {
                assert_eq!(v, id * 10);
                applied_n += 1;
            }
            Ok(Outcome::Duplicate | Outcome::Replayed(_)) => duplicate_n += 1,
            Ok(Outcome::Failed(f)) => panic!("no delivery fails for good here: {f:?}"),
            Err(e) => panic!("a delivery at {level:?} failed: {e:?}"),
        }
    }
    print_retries(&format!("concurrent deliveries at {level:?}"), before);
    assert_eq!((applied_n, duplicate_n), (1, RACERS - 1), "{level:?}");
    assert_eq!(ctx.effects(id).await, 1);
    assert_eq!(ctx.effects_total().await, 1);
    assert_eq!(ctx.markers().await, 1);
    ctx.cleanup().await;
}

pub(crate) async fn concurrent_serializable_deliveries_apply_once<S: Support>() {
    race_at::<S>(Isolation::Serializable, "serializable", 21).await;
}

pub(crate) async fn concurrent_repeatable_read_deliveries_apply_once<S: Support>() {
    race_at::<S>(Isolation::RepeatableRead, "repeatable", 22).await;
}

pub(crate) async fn delivery_that_stops_waiting_is_in_progress_and_runs_nothing<S: Support>() {
    let ctx = Ctx::<S>::new("wait", 4).await;
    let job = ctx.job("job-wait", 18, 180);
    let hold = Arc::new(Hold::default());
    let first = tokio::spawn({
        let (store, job, hold) = (ctx.store.clone(), job.clone(), hold.clone());
        async move { apply_holding(&store, &job, &hold).await }
    });
    within(60, "the first delivery parking in its body", hold.entered()).await;
    let key = idem::Key::new(job.key.as_str()).expect("a valid key");
    let options = ClaimOptions::new().wait(Duration::from_millis(500));
    let second = ctx.store.claim_with("apply", &key, options);
    match within(60, "the second delivery", second).await {
        Err(idem::Error::InProgress { scope, key: k }) => {
            assert_eq!((scope.as_str(), k.as_str()), ("apply", key.as_str()));
        }
        Err(e) => panic!("expected InProgress, got {e:?}"),
        Ok(Claimed::Fresh(_)) => panic!("the second delivery claimed a key that is held"),
        Ok(Claimed::Duplicate | Claimed::Replayed(_) | Claimed::Failed(_)) => {
            panic!("the second delivery saw a marker not yet committed")
        }
    }
    // Nothing is committed while the first delivery holds the key.
    assert_eq!(ctx.markers().await, 0);
    assert_eq!(ctx.effects_total().await, 0);
    hold.release();
    let first = within(60, "the first delivery", first)
        .await
        .expect("no panic");
    assert_eq!(applied(first), 180);
    duplicate(apply_with(&ctx.store, &job, options, &Hold::default()).await);
    assert_eq!(ctx.effects(18).await, 1);
    assert_eq!(ctx.effects_total().await, 1);
    assert_eq!(ctx.markers().await, 1);
    ctx.cleanup().await;
}
