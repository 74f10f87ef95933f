//! `Lease::keep_alive`: a slow call outlives its lease (and the body's time limit) while the lease
//! renews itself, and is stopped with `LeaseError::Lost` once a renewal finds the key taken.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idem::{Claimed, Error, Key, Lease, LeaseError, LeaseOptions, Outcome};

use super::lease::{db_now, poll_db};
use crate::conformance::Support;
use crate::conformance::ctx::Ctx;
use crate::conformance::handlers::{Job, TestError};
use crate::conformance::util::{unique_name, within};

/// Waits (without renewing) until the database's clock is past `first`'s `t`: the lease's
/// `locked_until` when the body began (or after a first renewal), a second or more past the
/// body's 1 s timeout.
async fn past_first<S: Support>(ctx: &Ctx<S>, first: &str) -> u64 {
    let past = format!(
        "SELECT CAST(CASE WHEN (SELECT t FROM {first}) < {} THEN 1 ELSE 0 END AS {})",
        db_now::<S>(),
        S::BIGINT
    );
    poll_db(
        60,
        "the database's clock passing the first lease",
        || async { ctx.scalar(&past).await == 1 },
    )
    .await
}

/// Keeps its lease alive around a wait that outlasts both the lease and the timeout.
#[idem::idempotent(key = "job.key", scope = "billing.kept", lease = "2s", timeout = "1s")]
async fn kept_alive<S: Support>(
    lease: &Lease,
    job: &Job,
    ctx: &Ctx<S>,
    first: &str,
) -> Result<u64, TestError> {
    let _ = job;
    // The whole body is kept alive: on a loaded machine the DDL alone may take longer than
    // the 1 s timeout. If a renewal comes before it, `first` is a renewed lease, still a
    // second past the timeout, and outliving it takes renewals all the same.
    let body = async {
        ctx.exec(&format!(
            "CREATE TABLE {first} AS SELECT locked_until AS t FROM {} WHERE scope = 'billing.kept'",
            ctx.store.table()
        ))
        .await;
        past_first(ctx, first).await
    };
    Ok(lease.keep_alive(body).await?)
}

pub(crate) async fn keep_alive_outlives_the_lease_and_its_timeout<S: Support>() {
    let mut ctx = Ctx::<S>::new("keep_alive", 2).await;
    let first = unique_name("first", &ctx.tag);
    ctx.tables.push(first.clone());
    let job = ctx.job("order-ka1", 81, 8100);
    match within(
        60,
        "a kept-alive body",
        kept_alive(&ctx.store, &job, &ctx, &first),
    )
    .await
    {
        Ok(Outcome::Applied(polls)) => assert!(polls > 1, "{polls}"),
        other => panic!("a body kept alive must not be cut off: got {other:?}"),
    }
    let m = ctx.marker(&job.key).await;
    assert!(m.completed && m.attempts == 1, "{m:?}");
    ctx.cleanup().await;
}

/// Sets `flag` when dropped.
struct DropFlag<'a>(&'a AtomicBool);

impl Drop for DropFlag<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

pub(crate) async fn keep_alive_stops_the_call_once_the_lease_is_taken<S: Support>() {
    let ctx = Ctx::<S>::new("keep_lost", 2).await;
    let key = Key::new("order-ka2").unwrap();
    let options = LeaseOptions::new(Duration::from_secs(1));
    let Ok(Claimed::Fresh(lease)) = ctx.store.lease("billing.kept", &key, options).await else {
        panic!("a fresh lease")
    };
    let dropped = AtomicBool::new(false);
    let forgotten = AtomicBool::new(false);
    let call = async {
        let _flag = DropFlag(&dropped);
        std::future::pending::<()>().await
    };
    let fence = async {
        // An operator lets the key go while the call runs: the holder is fenced out.
        assert!(ctx.store.forget_forced("billing.kept", &key).await.unwrap());
        forgotten.store(true, Ordering::SeqCst);
    };
    let (kept, ()) = within(60, "a call whose lease is lost", async {
        tokio::join!(lease.keep_alive(call), fence)
    })
    .await;
    assert!(forgotten.load(Ordering::SeqCst));
    match kept {
        Err(Error::Lease(LeaseError::Lost { scope, .. })) => assert_eq!(scope, "billing.kept"),
        other => panic!("expected LeaseError::Lost, got {other:?}"),
    }
    assert!(dropped.load(Ordering::SeqCst), "the call was stopped");
    match lease.finish(Ok::<_, Error>(())).await {
        Err(Error::Lease(LeaseError::Lost { .. })) => {}
        other => panic!("expected LeaseError::Lost, got {other:?}"),
    }
    ctx.cleanup().await;
}
