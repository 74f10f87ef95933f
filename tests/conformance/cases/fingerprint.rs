//! `fingerprint`: a later delivery of a key with another payload is `Error::KeyReused` on
//! every path (completed marker with or without `replay`, a key held by a transaction or a
//! lease), and nothing runs.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use idem::Outcome;

use crate::conformance::Support;
use crate::conformance::cases::replay::*;
use crate::conformance::cases::until_all_queued;
use crate::conformance::ctx::Ctx;
use crate::conformance::handlers::{Hold, TestError};
use crate::conformance::replay_handlers::*;
use crate::conformance::util::within;

fn is_key_reused<T: std::fmt::Debug>(result: Result<Outcome<T>, TestError>, order: &Order) {
    // No delivery of it can succeed: the consumer loop dead-letters it at once.
    let settled = idem::Disposition::of(&result, 1);
    assert!(
        matches!(settled, idem::Disposition::DeadLetter { .. }),
        "{settled:?}"
    );
    match result {
        Err(TestError::Idem(idem::Error::KeyReused { scope, key })) => {
            assert_eq!((scope.as_str(), key.as_str()), (SCOPE, order.key.as_str()));
        }
        other => panic!("expected KeyReused, got {other:?}"),
    }
}

/// The same payload built again, its map filled in another order (so it may iterate in
/// another order): the canonical JSON, and the fingerprint, are the same.
fn rebuilt(order: &Order) -> Order {
    let mut again = order.clone();
    let mut entries: Vec<_> = order.payload.tags.clone().into_iter().collect();
    entries.sort();
    entries.reverse();
    let mut tags = HashMap::with_capacity(64);
    for (k, v) in entries {
        tags.insert(k, v);
    }
    again.payload.tags = tags;
    again
}

/// Payloads that differ from `order`'s in one field each.
fn others(order: &Order) -> Vec<Order> {
    let mut memo = order.clone();
    memo.payload.memo.push('!');
    let mut tag = order.clone();
    tag.payload.tags.insert("a".to_owned(), 100);
    let mut id = order.clone();
    id.payload.id += 1;
    vec![order.with_amount(order.payload.amount + 1), memo, tag, id]
}

/// Same key and payload: `Duplicate` (fingerprint only) or `Replayed` (with `replay`); any
/// other payload: `KeyReused`, its body never runs, no effect; the stored fingerprint is the
/// first payload's.
async fn same_payload_or_other<S: Support>(mode: Mode, tag: &str, id: i64) {
    let ctx = Ctx::<S>::new(tag, 2).await;
    let ran = AtomicUsize::new(0);
    // Fingerprint without replay.
    let order = Order::new(&format!("job-{tag}-checked"), id, 5, &ctx.effects);
    let checked = |order: Order| {
        let (ctx, ran) = (&ctx, &ran);
        async move {
            match mode {
                Mode::Transaction => mint_checked(&ctx.store, &order, ran).await,
                Mode::Lease => mint_leased_checked(&ctx.store, &order, &ctx.pool, ran).await,
            }
        }
    };
    applied_value(checked(order.clone()).await);
    is_duplicate(checked(rebuilt(&order)).await);
    for other in others(&order) {
        is_key_reused(checked(other.clone()).await, &other);
    }
    is_duplicate(checked(order.clone()).await);
    assert_eq!(ran.load(Ordering::SeqCst), 1, "bodies run");
    // With replay, on another key.
    let replayed = Order::new(&format!("job-{tag}-replay"), id + 1000, 6, &ctx.effects);
    let first = applied_value(mint_in(&ctx, mode, &replayed, &ran, None).await);
    assert_eq!(
        replayed_value(mint_in(&ctx, mode, &rebuilt(&replayed), &ran, None).await),
        first
    );
    for other in others(&replayed) {
        is_key_reused(mint_in(&ctx, mode, &other, &ran, None).await, &other);
    }
    assert_eq!(
        replayed_value(mint_in(&ctx, mode, &replayed, &ran, None).await),
        first
    );
    assert_eq!(ran.load(Ordering::SeqCst), 2, "bodies run");
    // One effect each, with the first payloads' amounts.
    assert_eq!(ctx.effects_total().await, 2);
    let amounts = format!(
        "SELECT COUNT(*) FROM {} WHERE (id = {id} AND amount = 5) OR (id = {} AND amount = 6)",
        ctx.effects,
        id + 1000
    );
    assert_eq!(ctx.scalar(&amounts).await, 2);
    assert_eq!((ctx.markers().await, completed(&ctx).await), (2, 2));
    for o in [&order, &replayed] {
        let print = idem::Fingerprint::of(&o.payload).expect("serialises");
        assert_eq!(
            stored_fingerprint(&ctx, &o.key).await,
            (hex(print.as_bytes()), 32)
        );
    }
    ctx.cleanup().await;
}

pub(crate) async fn fingerprint_same_payload_is_duplicate_other_payload_is_key_reused<
    S: Support,
>() {
    same_payload_or_other::<S>(Mode::Transaction, "fp", 81).await;
}

pub(crate) async fn lease_fingerprint_same_payload_is_duplicate_other_payload_is_key_reused<
    S: Support,
>() {
    same_payload_or_other::<S>(Mode::Lease, "leasefp", 82).await;
}

/// Transaction mode: a delivery with another payload queues behind the holder of the key
/// (shown queued, as in `races.rs`), and once the holder commits it is `KeyReused`; its body
/// never runs.
pub(crate) async fn fingerprint_other_payload_behind_a_held_key_is_key_reused<S: Support>() {
    let ctx = Ctx::<S>::new("fpheld", 4).await;
    let order = Order::new("job-fp-held", 83, 8, &ctx.effects);
    let other = order.with_amount(9);
    let ran = Arc::new(AtomicUsize::new(0));
    let hold = Arc::new(Hold::default());
    let spawn = |order: Order| {
        let (store, ran, hold) = (ctx.store.clone(), ran.clone(), hold.clone());
        tokio::spawn(async move { mint(&store, &order, &ran, Some(&hold)).await })
    };
    let holder = spawn(order.clone());
    within(60, "the holder parking in its body", hold.entered()).await;
    let reused = spawn(other.clone());
    until_all_queued(&ctx, 2).await;
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    hold.release();
    let first = applied_value(within(60, "the holder", holder).await.expect("no panic"));
    is_key_reused(
        within(60, "the other payload", reused)
            .await
            .expect("no panic"),
        &other,
    );
    assert_eq!(
        replayed_value(mint(&ctx.store, &order, &ran, None).await),
        first
    );
    assert_eq!(ran.load(Ordering::SeqCst), 1, "bodies run");
    assert_eq!(ctx.effects_total().await, 1);
    assert_eq!(ctx.markers().await, 1);
    ctx.cleanup().await;
}

/// Lease mode: while a live lease is held by one payload, a delivery with another payload is
/// `KeyReused` (not `InProgress`: retrying it later cannot help), one with the same payload is
/// `InProgress`; neither runs. After the holder completes: `KeyReused` and `Replayed`.
pub(crate) async fn lease_held_by_one_payload_refuses_another_with_key_reused<S: Support>() {
    let ctx = Ctx::<S>::new("leasefpheld", 4).await;
    let order = Order::new("job-lease-fp-held", 84, 8, &ctx.effects);
    let other = order.with_amount(9);
    let ran = Arc::new(AtomicUsize::new(0));
    let hold = Arc::new(Hold::default());
    let holder = tokio::spawn({
        let (store, pool, order) = (ctx.store.clone(), ctx.pool.clone(), order.clone());
        let (ran, hold) = (ran.clone(), hold.clone());
        async move { mint_leased(&store, &order, &pool, &ran, Some(&hold)).await }
    });
    within(60, "the holder parking in its body", hold.entered()).await;
    let deliver = |o: &Order| {
        let (ctx, ran, o) = (&ctx, ran.clone(), o.clone());
        async move { mint_leased(&ctx.store, &o, &ctx.pool, &ran, None).await }
    };
    for _ in 0..2 {
        is_key_reused(deliver(&other).await, &other);
        match deliver(&rebuilt(&order)).await {
            Err(TestError::Idem(idem::Error::InProgress { scope, key })) => {
                assert_eq!((scope.as_str(), key.as_str()), (SCOPE, order.key.as_str()));
            }
            other => panic!("expected InProgress for the same payload, got {other:?}"),
        }
    }
    assert_eq!(
        ran.load(Ordering::SeqCst),
        1,
        "bodies run while the lease is held"
    );
    hold.release();
    let first = applied_value(within(60, "the holder", holder).await.expect("no panic"));
    is_key_reused(deliver(&other).await, &other);
    assert_eq!(replayed_value(deliver(&order).await), first);
    assert_eq!(ran.load(Ordering::SeqCst), 1, "bodies run");
    assert_eq!(ctx.effects_total().await, 1);
    assert_eq!((ctx.markers().await, completed(&ctx).await), (1, 1));
    ctx.cleanup().await;
}

/// Transaction mode: a first delivery that fails (here its value cannot be serialised)
/// commits nothing, its fingerprint included, so a delivery with another payload applies.
pub(crate) async fn failed_delivery_leaves_no_fingerprint_in_transaction_mode<S: Support>() {
    let ctx = Ctx::<S>::new("fpfailed", 2).await;
    let order = Order::new("job-fp-failed", 85, 8, &ctx.effects);
    let other = order.with_amount(9);
    let ran = AtomicUsize::new(0);
    match refusing(&ctx.store, &order, &ran).await {
        Err(TestError::Idem(idem::Error::Serialize(_))) => {}
        result => panic!("expected Error::Serialize, got {result:?}"),
    }
    assert_eq!(ctx.markers().await, 0);
    let first = applied_value(mint(&ctx.store, &other, &ran, None).await);
    is_key_reused(mint(&ctx.store, &order, &ran, None).await, &order);
    assert_eq!(
        replayed_value(mint(&ctx.store, &other, &ran, None).await),
        first
    );
    assert_eq!(ran.load(Ordering::SeqCst), 2, "bodies run");
    assert_eq!(ctx.effects_total().await, 1);
    ctx.cleanup().await;
}

/// Lease mode: a failed attempt releases the key but its `in_progress` marker keeps the
/// payload's fingerprint, so another payload is `KeyReused` even after the release (unlike
/// transaction mode, where the failed delivery leaves nothing), and the same payload takes
/// the key over and applies.
pub(crate) async fn lease_released_attempt_keeps_its_fingerprint<S: Support>() {
    let ctx = Ctx::<S>::new("leasefpfailed", 2).await;
    let order = Order::new("job-lease-fp-failed", 86, 8, &ctx.effects);
    let other = order.with_amount(9);
    let ran = AtomicUsize::new(0);
    match failing_leased(&ctx.store, &order, &ctx.pool, &ran).await {
        Err(TestError::Refused) => {}
        result => panic!("expected the body's error, got {result:?}"),
    }
    assert_eq!((ctx.markers().await, completed(&ctx).await), (1, 0));
    is_key_reused(
        mint_leased(&ctx.store, &other, &ctx.pool, &ran, None).await,
        &other,
    );
    assert_eq!(ran.load(Ordering::SeqCst), 1, "bodies run");
    let first = applied_value(mint_leased(&ctx.store, &order, &ctx.pool, &ran, None).await);
    assert_eq!(
        replayed_value(mint_leased(&ctx.store, &order, &ctx.pool, &ran, None).await),
        first
    );
    is_key_reused(
        mint_leased(&ctx.store, &other, &ctx.pool, &ran, None).await,
        &other,
    );
    assert_eq!(ran.load(Ordering::SeqCst), 2, "bodies run");
    // The two outside calls: the failed attempt's and the one that completed.
    assert_eq!(ctx.effects_total().await, 2);
    ctx.cleanup().await;
}
