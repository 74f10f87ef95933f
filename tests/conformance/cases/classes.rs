//! Error classes of a lease's body: a permanent error completes the marker as failed (every
//! mode then answers `Failed` and acks; an operator can requeue it), an unknown one keeps the
//! lease until it runs out or is settled by a verify, a transient one releases at once.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem::{Claimed, Error, Key, LeaseError, LeaseOptions, MarkerState, Outcome};

use super::lease::db_now_plus;
use crate::conformance::Support;
use crate::conformance::ctx::Ctx;
use crate::conformance::db::Bind;
use crate::conformance::handlers::TestError;
use crate::conformance::lease_handlers::Provider;
use crate::conformance::step_handlers::*;

fn failed_with<T: std::fmt::Debug>(result: Result<Outcome<T>, TestError>, text: &str) {
    match result {
        Ok(Outcome::Failed(failure)) => assert_eq!(failure.error(), text),
        other => panic!("expected Failed({text:?}), got {other:?}"),
    }
}

pub(crate) async fn permanent_error_completes_the_marker_as_failed_for_every_mode<S: Support>() {
    let ctx = Ctx::<S>::new("classes_failed", 4).await;
    let provider = Provider::<S::Db>::in_memory();
    let job = ctx.job("order-p1", 51, 5100);
    failed_with(
        pay_or_decline(&ctx.store, &job, &provider, true).await,
        DECLINED,
    );
    assert_eq!(provider.requests(), 1);
    // What every reader finds: a completed marker (an older idem's claim reads it as a
    // duplicate, and acks), with no value to replay and the error recorded.
    let sql = format!(
        "SELECT CAST(CASE WHEN state = 'completed' AND result IS NULL AND error = $1 \
         AND locked_until IS NULL THEN 1 ELSE 0 END AS {}) FROM {} WHERE {} = $2",
        S::BIGINT,
        ctx.store.table(),
        S::KEY_TEXT
    );
    let binds = [Bind::Str(DECLINED.to_owned()), Bind::Str(job.key.clone())];
    assert_eq!(ctx.scalar_with(&sql, &binds).await, 1);
    let marker = ctx
        .store
        .inspect(CHECKOUT, &job.key)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(marker.state, MarkerState::Failed);
    assert_eq!(marker.error.as_deref(), Some(DECLINED));
    // Later lease deliveries are failed too, without running.
    failed_with(
        pay_or_decline(&ctx.store, &job, &provider, false).await,
        DECLINED,
    );
    assert_eq!(provider.requests(), 1);
    // A transaction-mode delivery of the same scope meets it: failed, nothing written.
    failed_with(checkout_in_tx(&ctx.store, &job).await, DECLINED);
    assert_eq!(ctx.effects_from(job.id, "tx").await, 0);
    // A batch with it and a fresh job: the failed one is failed, the fresh one applies.
    let fresh = ctx.job("order-p2", 52, 5200);
    let batch = checkout_batch(&ctx.store, &[job.clone(), fresh.clone()])
        .await
        .expect("the batch");
    match batch.outcomes() {
        [Outcome::Failed(f), Outcome::Applied(())] => assert_eq!(f.error(), DECLINED),
        other => panic!("expected [Failed, Applied], got {other:?}"),
    }
    assert_eq!(batch.value(), Some(&1));
    assert_eq!(ctx.effects_from(job.id, "batch").await, 0);
    assert_eq!(ctx.effects_from(fresh.id, "batch").await, 1);
    let alone = checkout_batch(&ctx.store, std::slice::from_ref(&job))
        .await
        .expect("the batch");
    assert!(
        matches!(alone.outcomes(), [Outcome::Failed(_)]),
        "{alone:?}"
    );
    // A claim by hand is told too.
    match ctx
        .store
        .claim(CHECKOUT, &Key::new(&job.key).unwrap())
        .await
    {
        Ok(Claimed::Failed(f)) => assert_eq!(f.error(), DECLINED),
        other => panic!("expected Claimed::Failed, got {other:?}"),
    }
    // Operators find it.
    let listed = ctx.store.list_failed(Some(CHECKOUT), 10).await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(
        (listed[0].key.as_str(), listed[0].error.as_deref()),
        (job.key.as_str(), Some(DECLINED))
    );
    assert!(
        ctx.store
            .list_failed(Some("other"), 10)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(ctx.store.list_failed(None, 10).await.unwrap().len(), 1);
    ctx.cleanup().await;
}

pub(crate) async fn requeued_failed_job_runs_again_after_its_recorded_steps<S: Support>() {
    let ctx = Ctx::<S>::new("classes_requeue", 2).await;
    let provider = Provider::<S::Db>::in_memory();
    let job = ctx.job("order-p3", 53, 5300);
    failed_with(
        pay_or_decline(&ctx.store, &job, &provider, true).await,
        DECLINED,
    );
    let token = ctx.marker(&job.key).await.token;
    assert!(!ctx.store.requeue(CHECKOUT, "order-none").await.unwrap());
    assert!(ctx.store.requeue(CHECKOUT, &job.key).await.unwrap());
    assert!(
        !ctx.store.requeue(CHECKOUT, &job.key).await.unwrap(),
        "only a failed marker is requeued"
    );
    let marker = ctx
        .store
        .inspect(CHECKOUT, &job.key)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(marker.state, MarkerState::InProgress);
    assert_eq!((marker.error, marker.locked_until), (None, None));
    assert!(ctx.marker(&job.key).await.token > token, "fenced");
    // The next delivery takes it over and resumes after its recorded charge.
    match pay_or_decline(&ctx.store, &job, &provider, false).await {
        Ok(Outcome::Applied(charged)) => assert_eq!(charged, 1, "the charge of attempt 1"),
        other => panic!("expected Applied, got {other:?}"),
    }
    assert_eq!(provider.requests(), 1);
    assert_eq!(ctx.marker(&job.key).await.attempts, 2);
    assert!(ctx.store.list_failed(None, 10).await.unwrap().is_empty());
    assert!(!ctx.store.requeue(CHECKOUT, &job.key).await.unwrap());
    ctx.cleanup().await;
}

pub(crate) async fn unknown_error_keeps_the_lease_until_it_runs_out<S: Support>() {
    let ctx = Ctx::<S>::new("classes_unknown", 2).await;
    let provider = &Provider::<S::Db>::in_memory();
    let key = Key::new("order-u1").unwrap();
    let options = || LeaseOptions::new(Duration::from_secs(30));
    let Ok(Claimed::Fresh(lease)) = ctx.store.lease(CHECKOUT, &key, options()).await else {
        panic!("a fresh lease")
    };
    // The call went out and its answer was lost: the effect may have happened.
    let held = &lease;
    let step = lease
        .step("charge", |step| async move {
            provider.charge(step.idempotency_key(), 0).await?;
            Err::<u32, _>(held.unknown(TestError::Refused))
        })
        .await;
    match lease.finish(step).await {
        Err(TestError::Refused) => {}
        other => panic!("expected the body's error, got {other:?}"),
    }
    let m = ctx.marker("order-u1").await;
    assert!(!m.completed && !m.unlocked && m.live, "kept: {m:?}");
    match ctx.store.lease(CHECKOUT, &key, options()).await {
        Err(Error::InProgress { .. }) => {}
        other => panic!("expected InProgress while the lease runs, got {other:?}"),
    }
    // Once it ran out the next delivery takes over and asks again with the same key.
    ctx.set_locked_until("order-u1", &db_now_plus::<S>(-1000))
        .await;
    let Ok(Claimed::Fresh(lease)) = ctx.store.lease(CHECKOUT, &key, options()).await else {
        panic!("a takeover")
    };
    assert_eq!(lease.attempt(), 2);
    let charged = lease
        .step("charge", |step| async move {
            provider.charge(step.idempotency_key(), 0).await?;
            Ok::<_, TestError>(2_u32)
        })
        .await;
    assert!(matches!(
        lease.finish(charged).await,
        Ok(Outcome::Applied(2))
    ));
    assert_eq!((provider.requests(), provider.charges()), (2, 1));
    ctx.cleanup().await;
}

pub(crate) async fn unknown_error_with_a_verify_step_is_decided_at_once<S: Support>() {
    let ctx = Ctx::<S>::new("classes_verify", 2).await;
    let provider = Provider::<S::Db>::in_memory();
    let verified = AtomicUsize::new(0);
    let act = |send, end, verify_unknown| Act {
        send,
        end,
        verify_unknown,
    };
    // The call happened: the verify finds it, and the step is recorded with its answer.
    let happened = ctx.job("order-v1", 61, 6100);
    match pay_verified(
        &ctx.store,
        &happened,
        &provider,
        act(true, StepEnd::Unknown, false),
        &verified,
    )
    .await
    {
        Ok(Outcome::Applied(v)) => assert_eq!(v, "found-by-attempt-1"),
        other => panic!("expected Applied, got {other:?}"),
    }
    assert_eq!(
        (verified.load(Ordering::SeqCst), provider.requests()),
        (1, 1)
    );
    assert_eq!(ctx.recorded_steps(CHECKOUT, &happened.key).await.len(), 1);
    // It did not: the error is transient, and the key released at once.
    let lost = ctx.job("order-v2", 62, 6200);
    match pay_verified(
        &ctx.store,
        &lost,
        &provider,
        act(false, StepEnd::Unknown, false),
        &verified,
    )
    .await
    {
        Err(TestError::Refused) => {}
        other => panic!("expected the step's error, got {other:?}"),
    }
    let m = ctx.marker(&lost.key).await;
    assert!(!m.completed && m.unlocked, "released at once: {m:?}");
    assert_eq!(verified.load(Ordering::SeqCst), 2);
    // Its redelivery asks first (the step may have run), is told no, and runs it.
    match pay_verified(
        &ctx.store,
        &lost,
        &provider,
        act(true, StepEnd::Ok, false),
        &verified,
    )
    .await
    {
        Ok(Outcome::Applied(v)) => assert_eq!(v, "ch-attempt-2"),
        other => panic!("expected Applied, got {other:?}"),
    }
    assert_eq!(
        (verified.load(Ordering::SeqCst), provider.requests()),
        (3, 2)
    );
    // The outside system cannot tell: the lease is kept until it runs out.
    let unsure = ctx.job("order-v3", 63, 6300);
    match pay_verified(
        &ctx.store,
        &unsure,
        &provider,
        act(true, StepEnd::Unknown, true),
        &verified,
    )
    .await
    {
        Err(TestError::Refused) => {}
        other => panic!("expected the step's error, got {other:?}"),
    }
    let m = ctx.marker(&unsure.key).await;
    assert!(!m.completed && m.live, "kept: {m:?}");
    ctx.cleanup().await;
}

pub(crate) async fn takeover_verifies_a_step_its_predecessor_may_have_run<S: Support>() {
    let ctx = Ctx::<S>::new("classes_takeover", 2).await;
    let provider = Provider::<S::Db>::in_memory();
    let verified = AtomicUsize::new(0);
    let act = |send, end, verify_unknown| Act {
        send,
        end,
        verify_unknown,
    };
    // The call happened, then the holder failed before its record (a plain error: released).
    let job = ctx.job("order-t1", 71, 7100);
    match pay_verified(
        &ctx.store,
        &job,
        &provider,
        act(true, StepEnd::Fails, false),
        &verified,
    )
    .await
    {
        Err(TestError::Refused) => {}
        other => panic!("expected the step's error, got {other:?}"),
    }
    assert_eq!(
        verified.load(Ordering::SeqCst),
        0,
        "a first run asks nothing"
    );
    // The takeover asks before running: it happened, so it is recorded, not run again.
    match pay_verified(
        &ctx.store,
        &job,
        &provider,
        act(true, StepEnd::Ok, false),
        &verified,
    )
    .await
    {
        Ok(Outcome::Applied(v)) => assert_eq!(v, "found-by-attempt-2"),
        other => panic!("expected Applied, got {other:?}"),
    }
    assert_eq!(
        (verified.load(Ordering::SeqCst), provider.requests()),
        (1, 1)
    );
    match pay_verified(
        &ctx.store,
        &job,
        &provider,
        act(true, StepEnd::Ok, false),
        &verified,
    )
    .await
    {
        Ok(Outcome::Duplicate) => {}
        other => panic!("expected Duplicate, got {other:?}"),
    }
    // A verify that cannot tell on a takeover: nothing runs, and the lease is kept.
    let unsure = ctx.job("order-t2", 72, 7200);
    match pay_verified(
        &ctx.store,
        &unsure,
        &provider,
        act(true, StepEnd::Fails, false),
        &verified,
    )
    .await
    {
        Err(TestError::Refused) => {}
        other => panic!("expected the step's error, got {other:?}"),
    }
    match pay_verified(
        &ctx.store,
        &unsure,
        &provider,
        act(true, StepEnd::Ok, true),
        &verified,
    )
    .await
    {
        Err(TestError::Idem(Error::Lease(LeaseError::Unverified { step, .. }))) => {
            assert_eq!(step, "charge")
        }
        other => panic!("expected LeaseError::Unverified, got {other:?}"),
    }
    let m = ctx.marker(&unsure.key).await;
    assert!(!m.completed && m.live, "kept: {m:?}");
    assert_eq!(provider.requests(), 2, "the unsure step ran once");
    ctx.cleanup().await;
}
