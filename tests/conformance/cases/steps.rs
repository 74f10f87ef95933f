//! Steps inside a lease's body: recorded as they return, fenced by the lease's token, replayed
//! to the delivery that takes the key over, refused out of order, and gone with their marker.

use std::time::Duration;

use idem::{Claimed, Error, Key, Lease, LeaseError, LeaseOptions, Outcome, Refusal};
use sqlx::Transaction;

use super::lease::{CHARGES_COLUMNS, db_now_plus};
use crate::conformance::Support;
use crate::conformance::ctx::Ctx;
use crate::conformance::handlers::{TestError, insert_effect};
use crate::conformance::lease_handlers::Provider;
use crate::conformance::step_handlers::*;
use crate::conformance::util::within;

fn key(s: &str) -> Key {
    Key::new(s).expect("a valid key")
}

async fn lease_by_hand<S: Support>(ctx: &Ctx<S>, k: &str) -> Lease {
    let options = LeaseOptions::new(Duration::from_secs(30));
    match ctx.store.lease(CHECKOUT, &key(k), options).await {
        Ok(Claimed::Fresh(lease)) => lease,
        other => panic!("expected a fresh lease, got {other:?}"),
    }
}

pub(crate) async fn steps_of_a_failed_attempt_are_replayed_not_run_again<S: Support>() {
    let mut ctx = Ctx::<S>::new("steps_replay", 4).await;
    let charges = ctx.create_table("c", CHARGES_COLUMNS).await;
    let outside = S::connect(&ctx.url, 2).await;
    let provider = std::sync::Arc::new(Provider::table(outside.clone(), &charges));
    let job = ctx.job("order-s1", 31, 3100);
    // The first attempt runs under `tokio::spawn` (a step handler's future is `Send`), charges
    // and mails, then fails: the key is released with two steps recorded.
    let first = {
        let (store, job, provider) = (ctx.store.clone(), job.clone(), provider.clone());
        tokio::spawn(async move { checkout(&store, &job, &*provider, Stop::FailAfter(2)).await })
    };
    match within(60, "the first attempt", first).await.expect("task") {
        Err(TestError::Refused) => {}
        other => panic!("expected the body's own error, got {other:?}"),
    }
    assert_eq!(ctx.step_effects(&charges, &job).await, [1, 1, 0]);
    let recorded = ctx.recorded_steps(CHECKOUT, &job.key).await;
    let names: Vec<&str> = recorded.iter().map(|(n, _, _)| n.as_str()).collect();
    assert_eq!(names, ["charge", "mail"]);
    assert_eq!(
        recorded.iter().map(|(_, p, _)| *p).collect::<Vec<_>>(),
        [1, 2]
    );
    let first_token = recorded[0].2;
    // The redelivery takes the key over: the two recorded steps come back with the values the
    // first attempt made, and only the ledger runs.
    let done = applied_checkout(checkout(&ctx.store, &job, &*provider, Stop::Never).await);
    assert_eq!(
        done,
        Checkout {
            charge: "ch-31-attempt-1".into(),
            mail: "mail-31-attempt-1".into(),
            ledger: 2,
        }
    );
    assert_eq!(ctx.step_effects(&charges, &job).await, [1, 1, 1]);
    let recorded = ctx.recorded_steps(CHECKOUT, &job.key).await;
    assert_eq!(recorded.len(), 3, "{recorded:?}");
    assert_eq!((recorded[0].2, recorded[1].2), (first_token, first_token));
    assert!(recorded[2].2 > first_token, "{recorded:?}");
    // Each step's idempotency key is its own, and stable: the provider saw each once.
    let distinct = ctx
        .scalar(&format!(
            "SELECT COUNT(DISTINCT idempotency_key) FROM {charges}"
        ))
        .await;
    assert_eq!(distinct, 2);
    match checkout(&ctx.store, &job, &*provider, Stop::Never).await {
        Ok(Outcome::Replayed(again)) => assert_eq!(again, done),
        other => panic!("expected Replayed, got {other:?}"),
    }
    assert_eq!(ctx.step_effects(&charges, &job).await, [1, 1, 1]);
    outside.close().await;
    ctx.cleanup().await;
}

pub(crate) async fn stale_holder_cannot_record_a_step<S: Support>() {
    let ctx = Ctx::<S>::new("steps_stale", 4).await;
    let job = ctx.job("order-s2", 32, 3200);
    let stale = lease_by_hand(&ctx, &job.key).await;
    stale
        .step("charge", |_| async { Ok::<_, TestError>(1_u32) })
        .await
        .expect("the holder records its first step");
    // The lease runs out on the database's clock and another delivery takes the key over.
    ctx.set_locked_until(&job.key, &db_now_plus::<S>(-1000))
        .await;
    let taker = lease_by_hand(&ctx, &job.key).await;
    assert_eq!(taker.attempt(), 2);
    // The stale holder's steps run (it cannot know), but none is recorded: it is told.
    let mut ran = 0;
    let late = stale
        .step("mail", |_| {
            ran += 1;
            async { Ok::<_, TestError>(2_u32) }
        })
        .await;
    assert!(
        matches!(
            late,
            Err(TestError::Idem(Error::Lease(LeaseError::Lost { .. })))
        ),
        "{late:?}"
    );
    let late_ledger = stale
        .tx_step("ledger", async |tx: &mut Transaction<'_, S::Db>| {
            insert_effect(tx, &job, "ledger").await?;
            Ok::<_, TestError>(3_u32)
        })
        .await;
    assert!(
        matches!(
            late_ledger,
            Err(TestError::Idem(Error::Lease(LeaseError::Lost { .. })))
        ),
        "{late_ledger:?}"
    );
    assert_eq!(ran, 1);
    assert_eq!(
        ctx.effects_from(job.id, "ledger").await,
        0,
        "a database step refused its record keeps none of its writes"
    );
    // The new holder gets the first holder's recorded step back and runs the rest itself.
    let charge = taker
        .step("charge", |_| async { Ok::<_, TestError>(10_u32) })
        .await
        .expect("replayed");
    assert_eq!(charge, 1, "the value the first holder recorded");
    let mail = taker
        .step("mail", |_| async { Ok::<_, TestError>(20_u32) })
        .await
        .expect("recorded");
    assert_eq!(mail, 20);
    let recorded = ctx.recorded_steps(CHECKOUT, &job.key).await;
    assert_eq!(recorded.len(), 2, "{recorded:?}");
    assert_eq!(recorded[1].2, taker.token(), "{recorded:?}");
    match taker.finish(Ok::<_, TestError>(())).await {
        Ok(Outcome::Applied(())) => {}
        other => panic!("expected Applied, got {other:?}"),
    }
    match stale.finish(Ok::<_, TestError>(())).await {
        Err(TestError::Idem(Error::Lease(LeaseError::Lost { .. }))) => {}
        other => panic!("expected LeaseError::Lost, got {other:?}"),
    }
    ctx.cleanup().await;
}

pub(crate) async fn steps_out_of_order_or_repeated_are_refused_before_they_run<S: Support>() {
    let ctx = Ctx::<S>::new("steps_refused", 2).await;
    let lease = lease_by_hand(&ctx, "order-s3").await;
    let refused = |r: Result<u32, TestError>, why: &str| match r {
        Err(TestError::Idem(Error::Refused(Refusal::Step { step, reason, .. }))) => {
            assert!(reason.contains(why), "{step:?}: {reason}");
        }
        other => panic!("expected Refusal::Step ({why}), got {other:?}"),
    };
    let ran = std::sync::atomic::AtomicUsize::new(0);
    let step = |name: &'static str| {
        ran.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let _ = name;
        async { Ok::<_, TestError>(7_u32) }
    };
    assert_eq!(lease.step("charge", |_| step("charge")).await.unwrap(), 7);
    refused(
        lease.step("charge", |_| step("again")).await,
        "already ran a step of that name",
    );
    refused(lease.step("", |_| step("empty")).await, "cannot be empty");
    refused(lease.step("a\0b", |_| step("nul")).await, "NUL");
    let long = "x".repeat(idem::MAX_STEP_NAME + 1);
    refused(
        lease.step(&long, |_| step("long")).await,
        "at most 255 bytes",
    );
    // Two steps polled together: the second is refused while the first runs.
    let (gate_tx, gate_rx) = tokio::sync::oneshot::channel::<()>();
    let slow = lease.step("slow", |_| async move {
        gate_rx.await.expect("gate");
        Ok::<_, TestError>(1_u32)
    });
    let eager = async {
        let second = lease
            .step("eager", |_| async { Ok::<_, TestError>(2_u32) })
            .await;
        gate_tx.send(()).expect("gate");
        second
    };
    let (slow, eager) = tokio::join!(slow, eager);
    assert_eq!(slow.unwrap(), 1);
    refused(eager, "still running");
    // The refused names were not used up: "eager" runs now.
    assert_eq!(
        lease
            .step("eager", |_| async { Ok::<_, TestError>(3_u32) })
            .await
            .unwrap(),
        3
    );
    assert_eq!(
        ran.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "no refused step ran"
    );
    let names: Vec<String> = ctx
        .recorded_steps(CHECKOUT, "order-s3")
        .await
        .into_iter()
        .map(|(n, _, _)| n)
        .collect();
    assert_eq!(names, ["charge", "slow", "eager"]);
    lease.release().await;
    ctx.cleanup().await;
}

pub(crate) async fn steps_with_replay_and_fingerprint<S: Support>() {
    let mut ctx = Ctx::<S>::new("steps_print", 2).await;
    let charges = ctx.create_table("c", CHARGES_COLUMNS).await;
    let outside = S::connect(&ctx.url, 1).await;
    let provider = Provider::table(outside.clone(), &charges);
    let job = ctx.job("order-s4", 34, 3400);
    let other_payload = ctx.job("order-s4", 34, 9999);
    let reused = |r: Result<Outcome<Checkout>, TestError>| match r {
        Err(TestError::Idem(Error::KeyReused { scope, .. })) => assert_eq!(scope, CHECKOUT),
        other => panic!("expected KeyReused, got {other:?}"),
    };
    match checkout(&ctx.store, &job, &provider, Stop::FailAfter(1)).await {
        Err(TestError::Refused) => {}
        other => panic!("expected the body's own error, got {other:?}"),
    }
    // Another payload under the key is refused while the job is half done, and runs nothing.
    reused(checkout(&ctx.store, &other_payload, &provider, Stop::Never).await);
    assert_eq!(ctx.step_effects(&charges, &job).await, [1, 0, 0]);
    let done = applied_checkout(checkout(&ctx.store, &job, &provider, Stop::Never).await);
    assert_eq!(done.charge, "ch-34-attempt-1");
    assert_eq!((done.mail.as_str(), done.ledger), ("mail-34-attempt-2", 2));
    match checkout(&ctx.store, &job, &provider, Stop::Never).await {
        Ok(Outcome::Replayed(again)) => assert_eq!(again, done),
        other => panic!("expected Replayed, got {other:?}"),
    }
    reused(checkout(&ctx.store, &other_payload, &provider, Stop::Never).await);
    assert_eq!(ctx.step_effects(&charges, &job).await, [1, 1, 1]);
    outside.close().await;
    ctx.cleanup().await;
}

pub(crate) async fn database_step_keeps_its_writes_only_with_its_record<S: Support>() {
    let ctx = Ctx::<S>::new("steps_tx", 2).await;
    let job = ctx.job("order-s5", 35, 3500);
    let lease = lease_by_hand(&ctx, &job.key).await;
    // The step's own error rolls its writes back and records nothing.
    let failed = lease
        .tx_step("ledger", async |tx: &mut Transaction<'_, S::Db>| {
            insert_effect(tx, &job, "ledger").await?;
            Err::<u32, _>(TestError::Refused)
        })
        .await;
    assert!(matches!(failed, Err(TestError::Refused)), "{failed:?}");
    assert_eq!(ctx.effects_from(job.id, "ledger").await, 0);
    assert!(ctx.recorded_steps(CHECKOUT, &job.key).await.is_empty());
    lease.release().await;
    // The next holder runs it again: the row and the record are committed together.
    let lease = lease_by_hand_again(&ctx, &job.key).await;
    let rows = lease
        .tx_step("ledger", async |tx: &mut Transaction<'_, S::Db>| {
            insert_effect(tx, &job, "ledger").await?;
            Ok::<_, TestError>(1_u32)
        })
        .await
        .expect("the database step");
    assert_eq!(rows, 1);
    assert_eq!(ctx.effects_from(job.id, "ledger").await, 1);
    assert_eq!(ctx.recorded_steps(CHECKOUT, &job.key).await.len(), 1);
    lease.release().await;
    // A third holder reads it back and writes nothing.
    let lease = lease_by_hand_again(&ctx, &job.key).await;
    let again = lease
        .tx_step("ledger", async |tx: &mut Transaction<'_, S::Db>| {
            insert_effect(tx, &job, "ledger").await?;
            Ok::<_, TestError>(2_u32)
        })
        .await
        .expect("replayed");
    assert_eq!(again, 1);
    assert_eq!(ctx.effects_from(job.id, "ledger").await, 1);
    match lease.finish(Ok::<_, TestError>(())).await {
        Ok(Outcome::Applied(())) => {}
        other => panic!("expected Applied, got {other:?}"),
    }
    ctx.cleanup().await;
}

/// A lease of a key whose earlier lease was released.
async fn lease_by_hand_again<S: Support>(ctx: &Ctx<S>, k: &str) -> Lease {
    let lease = lease_by_hand(ctx, k).await;
    assert!(lease.attempt() > 1);
    lease
}

pub(crate) async fn forget_and_purge_remove_steps_with_their_marker<S: Support>() {
    let mut ctx = Ctx::<S>::new("steps_gone", 2).await;
    let charges = ctx.create_table("c", CHARGES_COLUMNS).await;
    let outside = S::connect(&ctx.url, 1).await;
    let provider = Provider::table(outside.clone(), &charges);
    let (done, half, old) = (
        ctx.job("order-s6", 36, 3600),
        ctx.job("order-s7", 37, 3700),
        ctx.job("order-s8", 38, 3800),
    );
    applied_checkout(checkout(&ctx.store, &done, &provider, Stop::Never).await);
    applied_checkout(checkout(&ctx.store, &old, &provider, Stop::Never).await);
    match checkout(&ctx.store, &half, &provider, Stop::FailAfter(2)).await {
        Err(TestError::Refused) => {}
        other => panic!("expected the body's own error, got {other:?}"),
    }
    assert_eq!(ctx.steps_total().await, 8);
    // A completed marker is deleted with its steps.
    assert!(ctx.store.forget(CHECKOUT, &done.key).await.unwrap());
    assert!(ctx.recorded_steps(CHECKOUT, &done.key).await.is_empty());
    // A marker in progress is let go and keeps its steps: the next delivery resumes.
    assert!(ctx.store.forget(CHECKOUT, &half.key).await.unwrap());
    assert_eq!(ctx.recorded_steps(CHECKOUT, &half.key).await.len(), 2);
    let resumed = applied_checkout(checkout(&ctx.store, &half, &provider, Stop::Never).await);
    assert_eq!(resumed.mail, "mail-37-attempt-1");
    assert_eq!(ctx.step_effects(&charges, &half).await, [1, 1, 1]);
    // Purge: only the old job's marker, and its steps with it.
    ctx.exec(&format!(
        "UPDATE {} SET completed_at = {} WHERE {} = '{}'",
        ctx.store.table(),
        S::TWO_HOURS_AGO,
        S::KEY_TEXT,
        old.key
    ))
    .await;
    assert_eq!(ctx.store.purge(Duration::from_secs(3600)).await.unwrap(), 1);
    assert!(ctx.recorded_steps(CHECKOUT, &old.key).await.is_empty());
    assert_eq!(ctx.recorded_steps(CHECKOUT, &half.key).await.len(), 3);
    assert_eq!(ctx.steps_total().await, 3);
    // The forgotten job runs again from its first step.
    let again = applied_checkout(checkout(&ctx.store, &done, &provider, Stop::Never).await);
    assert_eq!(again.charge, "ch-36-attempt-1");
    assert_eq!(ctx.step_effects(&charges, &done).await, [2, 2, 2]);
    outside.close().await;
    ctx.cleanup().await;
}
