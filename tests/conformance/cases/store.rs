//! Marker tables: concurrent migrations, names, and the `Store` API's own checks.

use std::sync::Arc;
use std::time::Duration;

use idem::{Outcome, Store};

use crate::conformance::Support;
use crate::conformance::ctx::Ctx;
use crate::conformance::handlers::*;
use crate::conformance::util::{unique_name, within};

pub(crate) async fn concurrent_migrations_of_a_fresh_table_succeed<S: Support>() {
    const TASKS: usize = 8;
    let mut ctx = Ctx::<S>::new("migrate", TASKS as u32).await;
    let fresh = unique_name("m", "fresh");
    let store = Store::new(ctx.pool.clone())
        .with_table(&fresh)
        .expect("identifier");
    let barrier = Arc::new(tokio::sync::Barrier::new(TASKS));
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let (store, barrier) = (store.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                store.migrate().await
            })
        })
        .collect();
    for t in tasks {
        within(120, "a migration", t)
            .await
            .expect("no panic")
            .expect("concurrent migrate");
    }
    ctx.tables.push(fresh.clone());
    store.migrate().await.expect("migrate again");
    let job = ctx.job("job-migrated", 14, 140);
    assert_eq!(applied(apply(&store, &job, Then::Commit).await), 140);
    duplicate(apply(&store, &job, Then::Commit).await);
    assert_eq!(
        ctx.scalar(&format!("SELECT COUNT(*) FROM {fresh}")).await,
        1
    );
    assert_eq!(ctx.effects(14).await, 1);
    ctx.cleanup().await;
}

pub(crate) async fn table_names_that_are_not_identifiers_are_refused<S: Support>() {
    let ctx = Ctx::<S>::new("badtable", 1).await;
    for bad in ["bad; name", "x\"; DROP TABLE y; --", "", "a.b"] {
        match Store::new(ctx.pool.clone()).with_table(bad) {
            Err(::idem::Error::Refused(::idem::Refusal::Table { name })) => assert_eq!(name, bad),
            Err(e) => panic!("{bad:?}: expected Refusal::Table, got {e:?}"),
            Ok(_) => panic!("{bad:?} was accepted as a table name"),
        }
    }
    ctx.cleanup().await;
}

// 14: the longest name `with_table` accepts works end to end.
pub(crate) async fn longest_table_name_works<S: Support>() {
    let mut ctx = Ctx::<S>::new("longtable", 2).await;
    let base = unique_name("m", "long");
    let name = format!("{base}{}", "x".repeat(::idem::MAX_TABLE_LEN - base.len()));
    let store = Store::new(ctx.pool.clone())
        .with_table(&name)
        .expect("MAX_TABLE_LEN characters is allowed");
    store
        .migrate()
        .await
        .unwrap_or_else(|e| panic!("migrate {name}: {e}"));
    ctx.tables.push(name.clone());
    let job = ctx.job("job-long-table", 16, 160);
    assert_eq!(applied(apply(&store, &job, Then::Commit).await), 160);
    duplicate(apply(&store, &job, Then::Commit).await);
    assert_eq!(ctx.scalar(&format!("SELECT COUNT(*) FROM {name}")).await, 1);
    assert_eq!(ctx.effects(16).await, 1);
    ctx.cleanup().await;
}

pub(crate) async fn store_refuses_bad_scopes_and_writes_nothing<S: Support>() {
    let ctx = Ctx::<S>::new("badscope", 2).await;
    let key = idem::Key::new("job-scope").expect("a valid key");
    for bad in [String::new(), "s".repeat(256), "a\0b".to_owned()] {
        match ctx.store.claim(&bad, &key).await {
            Err(idem::Error::Refused(idem::Refusal::Scope { scope })) => assert_eq!(scope, bad),
            Err(e) => panic!("claim in {bad:?}: expected Refusal::Scope, got {e:?}"),
            Ok(_) => panic!("claim in {bad:?} was accepted"),
        }
        match ctx.store.forget(&bad, "job-scope").await {
            Err(idem::Error::Refused(idem::Refusal::Scope { scope })) => assert_eq!(scope, bad),
            other => panic!("forget in {bad:?}: expected Refusal::Scope, got {other:?}"),
        }
    }
    assert_eq!(ctx.markers().await, 0);
    // The longest scope is accepted, and claims.
    let longest = "s".repeat(idem::MAX_KEY_LEN);
    match ctx.store.claim(&longest, &key).await.expect("claim") {
        idem::Claimed::Fresh(guard) => {
            let done = guard.finish(Ok::<(), idem::Error>(())).await;
            assert_eq!(done.expect("commit"), Outcome::Applied(()));
        }
        idem::Claimed::Duplicate | idem::Claimed::Replayed(_) | idem::Claimed::Failed(_) => {
            panic!("a fresh key was a duplicate")
        }
    }
    assert_eq!(ctx.markers().await, 1);
    ctx.cleanup().await;
}

pub(crate) async fn purge_with_the_longest_retention_deletes_nothing<S: Support>() {
    let ctx = Ctx::<S>::new("purgemax", 2).await;
    let job = ctx.job("job-purge-max", 24, 240);
    assert_eq!(applied(apply(&ctx.store, &job, Then::Commit).await), 240);
    // Even a marker aged two hours stays: no retention this long has passed.
    ctx.exec(&format!(
        "UPDATE {} SET completed_at = {}",
        ctx.store.table(),
        S::TWO_HOURS_AGO
    ))
    .await;
    assert_eq!(ctx.store.purge(Duration::MAX).await.expect("purge"), 0);
    assert_eq!(ctx.markers().await, 1);
    duplicate(apply(&ctx.store, &job, Then::Commit).await);
    assert_eq!(ctx.effects(24).await, 1);
    ctx.cleanup().await;
}
