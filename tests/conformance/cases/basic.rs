//! One delivery at a time: outcomes, errors, panics, scopes, keys, forget and purge.

use std::sync::Arc;
use std::time::Duration;

use idem::{Outcome, Store};

use crate::conformance::Support;
use crate::conformance::ctx::Ctx;
use crate::conformance::handlers::*;
use crate::conformance::util::within;

pub(crate) async fn first_delivery_applies_second_is_duplicate<S: Support>() {
    let ctx = Ctx::<S>::new("dup", 2).await;
    let job = ctx.job("job-1", 1, 10);
    assert_eq!(applied(apply(&ctx.store, &job, Then::Commit).await), 10);
    duplicate(apply(&ctx.store, &job, Then::Commit).await);
    duplicate(apply(&ctx.store, &job, Then::Commit).await);
    assert_eq!(ctx.effects(1).await, 1);
    assert_eq!(ctx.effects_total().await, 1);
    assert_eq!(ctx.markers().await, 1);
    ctx.cleanup().await;
}

pub(crate) async fn handler_error_keeps_nothing_and_next_delivery_applies<S: Support>() {
    let ctx = Ctx::<S>::new("err", 2).await;
    let job = ctx.job("job-err", 2, 20);
    match apply(&ctx.store, &job, Then::Fail).await {
        Err(TestError::Refused) => {}
        other => panic!("expected the handler's own error, got {other:?}"),
    }
    assert_eq!(ctx.markers().await, 0, "a failed handler left a marker");
    assert_eq!(
        ctx.effects_total().await,
        0,
        "a failed handler left its effect"
    );
    assert_eq!(applied(apply(&ctx.store, &job, Then::Commit).await), 20);
    duplicate(apply(&ctx.store, &job, Then::Commit).await);
    assert_eq!(ctx.effects(2).await, 1);
    assert_eq!(ctx.markers().await, 1);
    ctx.cleanup().await;
}

pub(crate) async fn handler_panic_rolls_back_and_next_delivery_applies<S: Support>() {
    let ctx = Ctx::<S>::new("panic", 2).await;
    let job = ctx.job("job-panic", 3, 30);
    let (store, j) = (ctx.store.clone(), job.clone());
    let joined = tokio::spawn(async move { apply(&store, &j, Then::Panic).await }).await;
    match joined {
        Err(e) if e.is_panic() => {}
        other => panic!("expected the task to panic, got {other:?}"),
    }
    assert_eq!(ctx.markers().await, 0, "a panicking handler left a marker");
    assert_eq!(
        ctx.effects_total().await,
        0,
        "a panicking handler left its effect"
    );
    let next = apply(&ctx.store, &job, Then::Commit);
    let next = within(60, "delivery after a panic", next).await;
    assert_eq!(applied(next), 30);
    duplicate(apply(&ctx.store, &job, Then::Commit).await);
    assert_eq!(ctx.effects(3).await, 1);
    assert_eq!(ctx.markers().await, 1);
    ctx.cleanup().await;
}

pub(crate) async fn same_key_in_two_scopes_runs_once_in_each<S: Support>() {
    let ctx = Ctx::<S>::new("scopes", 2).await;
    let job = ctx.job("job-42", 42, 5);
    assert_eq!(applied(apply(&ctx.store, &job, Then::Commit).await), 5);
    assert_eq!(applied(apply_elsewhere(&ctx.store, &job).await), 5);
    duplicate(apply(&ctx.store, &job, Then::Commit).await);
    duplicate(apply_elsewhere(&ctx.store, &job).await);
    assert_eq!(ctx.effects_from(42, "apply").await, 1);
    assert_eq!(ctx.effects_from(42, "elsewhere").await, 1);
    assert_eq!(ctx.effects_total().await, 2);
    assert_eq!(ctx.markers().await, 2);
    ctx.cleanup().await;
}

pub(crate) async fn invalid_keys_are_refused_and_write_nothing<S: Support>() {
    let ctx = Ctx::<S>::new("badkey", 2).await;
    let cases = [
        (String::new(), ::idem::KeyError::Empty),
        ("k".repeat(256), ::idem::KeyError::TooLong { len: 256 }),
        ("a\0b".to_owned(), ::idem::KeyError::Nul),
    ];
    for (key, want) in cases {
        let job = ctx.job(&key, 6, 60);
        match apply(&ctx.store, &job, Then::Commit).await {
            Err(TestError::Idem(::idem::Error::Refused(::idem::Refusal::Key(got)))) => {
                assert_eq!(got, want, "key {key:?}")
            }
            other => panic!("key {key:?}: expected Refusal::Key, got {other:?}"),
        }
    }
    assert_eq!(ctx.markers().await, 0);
    assert_eq!(ctx.effects_total().await, 0);
    ctx.cleanup().await;
}

pub(crate) async fn longest_multibyte_key_round_trips<S: Support>() {
    let ctx = Ctx::<S>::new("euro", 2).await;
    let key = "€".repeat(85);
    assert_eq!(key.len(), ::idem::MAX_KEY_LEN);
    let job = ctx.job(&key, 12, 120);
    assert_eq!(applied(apply(&ctx.store, &job, Then::Commit).await), 120);
    duplicate(apply(&ctx.store, &job, Then::Commit).await);
    assert_eq!(ctx.stored_keys().await, vec![key.clone()]);
    assert_eq!(ctx.effects(12).await, 1);
    let longer = ctx.job(&format!("{key}x"), 13, 130);
    match apply(&ctx.store, &longer, Then::Commit).await {
        Err(TestError::Idem(::idem::Error::Refused(::idem::Refusal::Key(
            ::idem::KeyError::TooLong { len: 256 },
        )))) => {}
        other => panic!("expected a 256-byte key to be refused, got {other:?}"),
    }
    assert_eq!(ctx.markers().await, 1);
    assert_eq!(ctx.effects_total().await, 1);
    ctx.cleanup().await;
}

pub(crate) async fn keys_differing_in_case_or_trailing_space_are_distinct<S: Support>() {
    let ctx = Ctx::<S>::new("case", 2).await;
    let keys = ["Job-A", "job-a", "x", "x "];
    for (id, key) in (1..).zip(keys) {
        match apply(&ctx.store, &ctx.job(key, id, id * 10), Then::Commit).await {
            Ok(Outcome::Applied(v)) => assert_eq!(v, id * 10),
            other => panic!(
                "key {key:?} (after {:?}): expected Applied, got {other:?}",
                &keys[..id as usize - 1]
            ),
        }
    }
    for (id, key) in (1..).zip(keys) {
        duplicate(apply(&ctx.store, &ctx.job(key, id, id * 10), Then::Commit).await);
    }
    let mut want: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
    want.sort();
    assert_eq!(ctx.stored_keys().await, want);
    for id in 1..=4 {
        assert_eq!(ctx.effects(id).await, 1, "job {id}");
    }
    ctx.cleanup().await;
}

pub(crate) async fn forget_lets_a_job_run_again<S: Support>() {
    let ctx = Ctx::<S>::new("forget", 2).await;
    let job = ctx.job("job-forget", 15, 150);
    assert_eq!(applied(apply(&ctx.store, &job, Then::Commit).await), 150);
    duplicate(apply(&ctx.store, &job, Then::Commit).await);
    assert!(
        !ctx.store
            .forget("conformance.elsewhere", &job.key)
            .await
            .expect("forget")
    );
    assert!(ctx.store.forget("apply", &job.key).await.expect("forget"));
    assert_eq!(ctx.markers().await, 0);
    assert_eq!(applied(apply(&ctx.store, &job, Then::Commit).await), 150);
    duplicate(apply(&ctx.store, &job, Then::Commit).await);
    assert_eq!(ctx.effects(15).await, 2);
    assert_eq!(ctx.markers().await, 1);
    assert!(
        !ctx.store
            .forget("apply", "job-unknown")
            .await
            .expect("forget")
    );
    assert_eq!(ctx.markers().await, 1);
    ctx.cleanup().await;
}

/// Retention: purge deletes old completed markers, in batches, and nothing younger.
pub(crate) async fn purge_deletes_only_markers_older_than_the_retention<S: Support>() {
    let ctx = Ctx::<S>::new("purge", 2).await;
    let old = ::idem::PURGE_BATCH + 7;
    for n in 0..old + 3 {
        let key = ::idem::Key::new(&n).expect("integer keys are valid");
        match ctx.store.claim("aged", &key).await.expect("claim") {
            ::idem::Claimed::Fresh(guard) => {
                let done = guard.finish(Ok::<(), ::idem::Error>(())).await;
                assert_eq!(done.expect("commit"), Outcome::Applied(()));
            }
            ::idem::Claimed::Duplicate
            | ::idem::Claimed::Replayed(_)
            | ::idem::Claimed::Failed(_) => {
                panic!("key {n} was claimed twice")
            }
        }
    }
    let table = ctx.store.table().to_owned();
    ctx.exec(&format!(
        "UPDATE {table} SET completed_at = {} WHERE scope = 'aged' AND {} NOT IN ('{}', '{}', '{}')",
        S::TWO_HOURS_AGO,
        S::KEY_TEXT,
        old,
        old + 1,
        old + 2,
    ))
    .await;
    let purged = ctx
        .store
        .purge(Duration::from_secs(3600))
        .await
        .expect("purge");
    assert_eq!(purged, u64::try_from(old).unwrap());
    assert_eq!(ctx.markers().await, 3);
    // The young markers still stop their jobs.
    let young = ::idem::Key::new(&old).unwrap();
    assert!(matches!(
        ctx.store.claim("aged", &young).await.expect("claim"),
        ::idem::Claimed::Duplicate
    ));
    assert_eq!(
        ctx.store
            .purge(Duration::from_secs(3600))
            .await
            .expect("purge"),
        0
    );
    ctx.cleanup().await;
}
