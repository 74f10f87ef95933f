//! Batch claims: a whole batch claimed with one statement and committed together, with
//! duplicates, repeated keys, failures, swallowed rollbacks and overlapping batches. The
//! attribute's handler (`apply_batch`) and the hand-written one (`apply_batch_by_hand`) run
//! the same body; each case names the one it drives.

use std::sync::Arc;

use idem::{Key, KeyError, MAX_BATCH, Outcome};

use crate::conformance::Support;
use crate::conformance::batch_handlers::*;
use crate::conformance::cases::races::until_all_queued;
use crate::conformance::ctx::Ctx;
use crate::conformance::handlers::*;
use crate::conformance::util::within;

const A: Outcome<()> = Outcome::Applied(());
const D: Outcome<()> = Outcome::Duplicate;

fn jobs<S: Support>(ctx: &Ctx<S>, ids: impl IntoIterator<Item = i64>) -> Vec<Job> {
    ids.into_iter()
        .map(|i| ctx.job(&format!("job-{i}"), i, 10 * i))
        .collect()
}

pub(crate) async fn batch_with_duplicates_applies_only_the_fresh_jobs<S: Support>() {
    let ctx = Ctx::<S>::new("bdup", 2).await;
    let batch = jobs(&ctx, 1..=5);
    // Jobs 2 and 4 were delivered on their own before.
    for job in [&batch[1], &batch[3]] {
        assert!(matches!(
            apply(&ctx.store, job, Then::Commit).await,
            Ok(Outcome::Applied(_))
        ));
    }
    let done = apply_batch(&ctx.store, &batch, BatchThen::Commit, None)
        .await
        .expect("the batch commits");
    assert_eq!(done.outcomes(), [A, D, A, D, A]);
    assert_eq!(done.value(), Some(&3), "the body saw the three fresh jobs");
    for id in 1..=5 {
        assert_eq!(ctx.effects(id).await, 1, "job {id}");
    }
    assert_eq!(ctx.effects_from(2, "batch").await, 0);
    assert_eq!(ctx.markers().await, 5);
    // The whole batch again: every job a duplicate, the body not run.
    let again = apply_batch(&ctx.store, &batch, BatchThen::Fail, None)
        .await
        .expect("all duplicates");
    assert_eq!(again.outcomes(), [D; 5]);
    assert_eq!(again.value(), None);
    assert_eq!(ctx.effects_total().await, 5);
    ctx.cleanup().await;
}

pub(crate) async fn batch_with_the_same_key_twice_claims_it_at_its_first_position<S: Support>() {
    let ctx = Ctx::<S>::new("btwice", 2).await;
    let mut batch = jobs(&ctx, [1, 2]);
    batch.insert(0, batch[1].clone());
    // Job 2, job 1, job 2, job 1.
    batch.push(batch[1].clone());
    let done = apply_batch(&ctx.store, &batch, BatchThen::Commit, None)
        .await
        .expect("the batch commits");
    assert_eq!(done.outcomes(), [A, A, D, D]);
    assert_eq!(done.value(), Some(&2));
    assert_eq!((ctx.effects(1).await, ctx.effects(2).await), (1, 1));
    assert_eq!(ctx.markers().await, 2);
    ctx.cleanup().await;
}

pub(crate) async fn failed_batch_keeps_nothing_and_redelivery_applies_each_once<S: Support>() {
    let ctx = Ctx::<S>::new("bfail", 2).await;
    let batch = jobs(&ctx, 1..=20);
    match apply_batch_by_hand(&ctx.store, &batch, BatchThen::Fail, None).await {
        Err(TestError::Refused) => {}
        other => panic!("expected the body's error, got {other:?}"),
    }
    assert_eq!(ctx.effects_total().await, 0, "the effects were rolled back");
    assert_eq!(ctx.markers().await, 0, "the markers were rolled back");
    let done = apply_batch_by_hand(&ctx.store, &batch, BatchThen::Commit, None)
        .await
        .expect("the redelivery commits");
    assert_eq!(done.outcomes(), [A; 20]);
    let again = apply_batch_by_hand(&ctx.store, &batch, BatchThen::Commit, None)
        .await
        .expect("all duplicates");
    assert_eq!(again.outcomes(), [D; 20]);
    for id in 1..=20 {
        assert_eq!(ctx.effects(id).await, 1, "job {id}");
    }
    ctx.cleanup().await;
}

pub(crate) async fn batch_body_that_swallows_a_rollback_is_rolled_back_not_applied<S: Support>() {
    let mut ctx = Ctx::<S>::new("bswallow", 2).await;
    let rows = ctx
        .create_table("r", "(id BIGINT NOT NULL PRIMARY KEY, v BIGINT NOT NULL)")
        .await;
    let values: Vec<String> = (1..=100).map(|i| format!("({i}, 0)")).collect();
    ctx.exec(&format!(
        "INSERT INTO {rows} (id, v) VALUES {}",
        values.join(", ")
    ))
    .await;
    let other = S::connect(&ctx.url, 2).await;
    let batch = jobs(&ctx, 1..=3);
    let call = apply_batch_swallowing::<S>(&ctx.store, &batch, &other, &rows);
    match within(120, "the swallowing batch body", call).await {
        Err(TestError::Idem(idem::Error::NotKept(idem::NotKept::RolledBack { scope, key }))) => {
            assert_eq!((scope.as_str(), key.as_str()), ("apply", "job-1"));
        }
        other => panic!("expected NotKept::RolledBack, got {other:?}"),
    }
    other.close().await;
    assert_eq!(ctx.effects_total().await, 0, "no effect was kept");
    assert_eq!(ctx.markers().await, 0, "no marker was kept");
    let done = apply_batch_by_hand(&ctx.store, &batch, BatchThen::Commit, None)
        .await
        .expect("the redelivery commits");
    assert_eq!(done.outcomes(), [A; 3]);
    assert_eq!(ctx.effects_total().await, 3);
    ctx.cleanup().await;
}

pub(crate) async fn batch_keys_are_checked_before_any_io<S: Support>() {
    let ctx = Ctx::<S>::new("bkeys", 2).await;
    match Key::batch(["a", "b", "", "d"]) {
        Err(KeyError::InBatch { position, error }) => {
            assert_eq!((position, *error), (2, KeyError::Empty));
        }
        other => panic!("expected the key at position 2 refused, got {other:?}"),
    }
    let err = Key::batch(["ok", "x\0y"])
        .expect_err("a NUL byte")
        .to_string();
    assert!(
        err.contains("job 1 of the batch") && err.contains("NUL"),
        "{err}"
    );
    let too_many: Vec<String> = (0..=MAX_BATCH).map(|i| format!("k{i}")).collect();
    assert_eq!(
        Key::batch(&too_many),
        Err(KeyError::BatchTooLarge { len: MAX_BATCH + 1 })
    );
    let keys: Vec<Key> = too_many
        .iter()
        .map(|k| Key::new(k).expect("valid"))
        .collect();
    // The refusal is the kind it names, by hand and through `?` from `Key::batch`.
    match ctx.store.claim_batch("apply", &keys).await {
        Err(e @ idem::Error::Refused(idem::Refusal::Batch { len })) => {
            assert_eq!(len, MAX_BATCH + 1);
            let msg = e.to_string();
            assert!(
                msg.contains("1001 jobs") && msg.contains("split") && !msg.contains("retry"),
                "{msg}"
            );
        }
        other => panic!("expected Refusal::Batch, got {other:?}"),
    }
    let via_question_mark = || -> Result<Vec<Key>, idem::Error> { Ok(Key::batch(&too_many)?) };
    assert!(matches!(
        via_question_mark(),
        Err(idem::Error::Refused(idem::Refusal::Batch { len })) if len == MAX_BATCH + 1
    ));
    let via_sqlx = || -> Result<Key, sqlx::Error> { Ok(Key::new("")?) };
    let carried = via_sqlx().unwrap_err();
    assert!(matches!(
        carried
            .as_database_error()
            .and_then(|e| e.try_downcast_ref::<idem::Error>()),
        Some(idem::Error::Refused(idem::Refusal::Key(KeyError::Empty)))
    ));
    match ctx.store.claim_batch("", &keys[..1]).await {
        Err(idem::Error::Refused(idem::Refusal::Scope { .. })) => {}
        other => panic!("expected Refusal::Scope, got {other:?}"),
    }
    // Through the attribute: the batch is refused whole, and nothing is written.
    let mut bad = jobs(&ctx, 1..=3);
    bad[1].key = "k".repeat(256);
    match apply_batch(&ctx.store, &bad, BatchThen::Commit, None).await {
        Err(TestError::Idem(idem::Error::Refused(idem::Refusal::Key(KeyError::InBatch {
            position,
            error,
        })))) => {
            assert_eq!((position, *error), (1, KeyError::TooLong { len: 256 }));
        }
        other => panic!("expected the key at position 1 refused, got {other:?}"),
    }
    assert_eq!((ctx.markers().await, ctx.effects_total().await), (0, 0));
    let empty = ctx.store.claim_batch("apply", &[]).await.expect("no I/O");
    assert!(empty.is_empty() && !empty.any_fresh());
    let done = empty.finish(Ok::<_, TestError>(())).await.expect("nothing");
    assert_eq!(done.outcomes(), []);
    // The largest batch is claimed whole.
    let done = apply_batch_by_hand(
        &ctx.store,
        &jobs(&ctx, 1..=MAX_BATCH as i64),
        BatchThen::Commit,
        None,
    )
    .await
    .expect("the largest batch commits");
    assert_eq!(done.applied(), MAX_BATCH);
    assert_eq!(ctx.markers().await, MAX_BATCH as i64);
    ctx.cleanup().await;
}

/// Batch 1 (jobs 1 to 10) parks in its body holding its keys; batch 2 (jobs 15 down to 5,
/// in the reverse order) is seen waiting behind it; then batch 1 commits. Batch 2 then gets
/// jobs 5 to 10 as duplicates and applies 11 to 15: no deadlock, every job once.
pub(crate) async fn overlapping_batches_wait_for_each_other_and_apply_each_job_once<S: Support>() {
    let ctx = Ctx::<S>::new("boverlap", 4).await;
    let hold = Arc::new(Hold::default());
    let first = jobs(&ctx, 1..=10);
    let second = jobs(&ctx, (5..=15).rev());
    let one = {
        let (store, hold) = (ctx.store.clone(), hold.clone());
        tokio::spawn(async move { apply_batch(&store, &first, BatchThen::Park, Some(&hold)).await })
    };
    within(120, "the first batch parking in its body", hold.entered()).await;
    let two = {
        let (store, hold) = (ctx.store.clone(), hold.clone());
        tokio::spawn(
            async move { apply_batch(&store, &second, BatchThen::Park, Some(&hold)).await },
        )
    };
    until_all_queued(&ctx, 2).await;
    hold.release();
    let one = within(120, "the first batch", one).await.expect("no panic");
    let two = within(120, "the second batch", two)
        .await
        .expect("no panic");
    assert_eq!(one.expect("the first batch commits").outcomes(), [A; 10]);
    let two = two.expect("the second batch commits");
    // Input order: 15, 14, ..., 5.
    let want: Vec<Outcome<()>> = (5..=15).rev().map(|i| if i > 10 { A } else { D }).collect();
    assert_eq!(two.outcomes(), want);
    assert_eq!(two.value(), Some(&5));
    for id in 1..=15 {
        assert_eq!(ctx.effects(id).await, 1, "job {id}");
    }
    assert_eq!(ctx.effects_total().await, 15);
    ctx.cleanup().await;
}

/// A batch whose `wait` runs out behind another batch holding one of its keys is
/// `InProgress` (naming its first key) and claims none of its jobs, not even the free one.
pub(crate) async fn batch_that_stops_waiting_is_in_progress_and_claims_nothing<S: Support>() {
    let ctx = Ctx::<S>::new("bwait", 4).await;
    let hold = Arc::new(Hold::default());
    let first = {
        let (store, hold, jobs) = (ctx.store.clone(), hold.clone(), jobs(&ctx, 1..=3));
        tokio::spawn(async move { apply_batch(&store, &jobs, BatchThen::Park, Some(&hold)).await })
    };
    within(60, "the first batch parking in its body", hold.entered()).await;
    let second = jobs(&ctx, [3, 4]);
    match within(
        60,
        "the second batch",
        apply_batch_waiting(&ctx.store, &second),
    )
    .await
    {
        Err(TestError::Idem(idem::Error::InProgress { scope, key })) => {
            assert_eq!((scope.as_str(), key.as_str()), ("apply", "job-3"));
        }
        other => panic!("expected InProgress, got {other:?}"),
    }
    assert_eq!((ctx.markers().await, ctx.effects_total().await), (0, 0));
    hold.release();
    let first = within(60, "the first batch", first)
        .await
        .expect("no panic");
    assert_eq!(first.expect("the first batch commits").outcomes(), [A; 3]);
    let again = apply_batch_waiting(&ctx.store, &second)
        .await
        .expect("the redelivery commits");
    assert_eq!(again.outcomes(), [D, A]);
    for id in 1..=4 {
        assert_eq!(ctx.effects(id).await, 1, "job {id}");
    }
    ctx.cleanup().await;
}
