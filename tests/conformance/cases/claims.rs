//! What the claim core refuses before any I/O, the stores a handler takes, and the verified
//! commit it lends to callers of joined handlers.

use std::sync::Arc;
use std::time::Duration;

use idem::{Error, LeaseOptions, NotKept, Refusal};

use crate::conformance::Support;
use crate::conformance::ctx::Ctx;
use crate::conformance::handlers::*;
use crate::conformance::util::within;

/// A lease outside 1 s ..= 24 h is `Refusal::Lease`, in the words of the attribute's compile
/// error, and nothing is written.
pub(crate) async fn lease_outside_its_bounds_is_refused_before_any_io<S: Support>() {
    let ctx = Ctx::<S>::new("leasebounds", 1).await;
    let key = idem::Key::new("job-1").expect("a valid key");
    for lease in [
        Duration::ZERO,
        Duration::from_millis(999),
        idem::MAX_LEASE + Duration::from_millis(1),
        Duration::from_secs(100_000_000 * 3600),
    ] {
        match ctx
            .store
            .lease("apply", &key, LeaseOptions::new(lease))
            .await
        {
            Err(Error::Refused(Refusal::Lease { lease: refused })) => assert_eq!(refused, lease),
            other => panic!("expected Refusal::Lease for {lease:?}, got {other:?}"),
        }
    }
    assert_eq!(ctx.markers().await, 0);
    ctx.cleanup().await;
}

/// `&store` works for a `Store`, a `&Store` and an `Arc<Store>` (axum state, a spawned
/// worker's), all claiming in the same table.
pub(crate) async fn a_handler_takes_a_store_a_reference_or_an_arc<S: Support>() {
    let ctx = Ctx::<S>::new("targets", 2).await;
    let job = ctx.job("job-arc", 1, 10);
    let shared = Arc::new(ctx.store.clone());
    assert_eq!(applied(apply(&shared, &job, Then::Commit).await), 10);
    let by_ref: &idem::Store<S::Db> = &ctx.store;
    duplicate(apply(&by_ref, &job, Then::Commit).await);
    duplicate(apply(&ctx.store, &job, Then::Commit).await);
    assert_eq!(ctx.effects(1).await, 1);
    ctx.cleanup().await;
}

/// `idem::commit` of a caller's transaction that the database rolled back under a body that
/// swallowed the error is `NotKept::NotCommitted`, never `Ok`: nothing of it was kept. (MySQL 8,
/// which has no `@@in_transaction`, cannot tell; MariaDB can.)
pub(crate) async fn commit_of_a_transaction_the_database_rolled_back_is_not_committed<
    S: Support,
>() {
    let mut ctx = Ctx::<S>::new("vcommit", 2).await;
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
    let job = ctx.job("job-vcommit", 3, 30);
    let mut tx = ctx.pool.begin().await.expect("begin");
    assert_eq!(
        applied(apply(ctx.store.join(&mut tx), &job, Then::Commit).await),
        30
    );
    within(
        120,
        "the swallowed rollback",
        S::swallow_a_rollback(&mut tx, &other, &rows),
    )
    .await;
    match idem::commit(tx).await {
        Err(Error::NotKept(NotKept::NotCommitted)) => {}
        other => panic!("expected NotKept::NotCommitted, got {other:?}"),
    }
    assert_eq!((ctx.markers().await, ctx.effects(3).await), (0, 0));
    // And a transaction that is fine commits.
    let mut tx = ctx.pool.begin().await.expect("begin");
    assert_eq!(
        applied(apply(ctx.store.join(&mut tx), &job, Then::Commit).await),
        30
    );
    idem::commit(tx).await.expect("committed");
    assert_eq!((ctx.markers().await, ctx.effects(3).await), (1, 1));
    ctx.cleanup().await;
}
