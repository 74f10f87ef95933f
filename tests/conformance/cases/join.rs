//! Joining a transaction the caller holds (`store.join(tx)`), and nesting one handler in
//! another: the inner joins the outer's transaction, or is refused before any I/O.

use idem::{Outcome, Store};
use sqlx::Transaction;

use crate::conformance::ctx::Ctx;
use crate::conformance::db::Bind;
use crate::conformance::handlers::*;
use crate::conformance::util::within;
use crate::conformance::{Support, TestDb};

/// How [`outer`] calls the inner handler (`apply`, scope `apply`).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Inner {
    /// `apply(store.join(tx), ..)`: in the outer's transaction.
    Joined,
    /// `apply(store, ..)`: a transaction of its own, which must be refused.
    Store,
    /// `store.claim(..)` by hand, which must be refused as well.
    Claim,
}

/// Writes its own effect, calls `apply` for `inner_job` as `how` says, then ends as `then`
/// says (`Commit` or `Fail`).
#[idem::idempotent(key = "job.key", scope = "conformance.outer")]
pub(crate) async fn outer<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
    store: &Store<DB>,
    inner_job: &Job,
    how: Inner,
    then: Then,
) -> Result<i64, TestError> {
    insert_effect(tx, job, "outer").await?;
    match how {
        Inner::Joined => {
            let inner = apply(store.join(tx), inner_job, Then::Commit).await?;
            assert_eq!(inner, Outcome::Applied(inner_job.amount));
        }
        Inner::Store => drop(apply(store, inner_job, Then::Commit).await?),
        Inner::Claim => {
            let key = idem::Key::new(&inner_job.key).expect("a valid key");
            drop(store.claim("apply", &key).await?);
        }
    }
    match then {
        Then::Commit => Ok(job.amount),
        _ => Err(TestError::Refused),
    }
}

/// A row the caller writes in its own transaction, next to the joined handler's.
async fn caller_row<DB: TestDb>(tx: &mut Transaction<'_, DB>, ctx_effects: &str, id: i64) {
    let sql = format!("INSERT INTO {ctx_effects} (id, amount, origin) VALUES ($1, 0, 'caller')");
    DB::execute(&mut **tx, &sql, &[Bind::I64(id)])
        .await
        .expect("the caller's own statement");
}

pub(crate) async fn joined_claim_is_kept_only_if_the_caller_commits<S: Support>() {
    let ctx = Ctx::<S>::new("join", 3).await;
    let job = ctx.job("job-join", 1, 10);

    // Rolled back by the caller: marker and effect go with it, and the redelivery applies.
    let mut tx = ctx.pool.begin().await.expect("begin");
    caller_row(&mut tx, &ctx.effects, 100).await;
    assert_eq!(
        applied(apply(ctx.store.join(&mut tx), &job, Then::Commit).await),
        10
    );
    tx.rollback().await.expect("rollback");
    assert_eq!(
        ctx.markers().await,
        0,
        "a rolled-back caller kept the marker"
    );
    assert_eq!(ctx.effects_total().await, 0);

    // Committed by the caller: nothing is visible before its commit, everything after.
    let mut tx = ctx.pool.begin().await.expect("begin");
    caller_row(&mut tx, &ctx.effects, 100).await;
    assert_eq!(
        applied(apply(ctx.store.join(&mut tx), &job, Then::Commit).await),
        10
    );
    assert_eq!(
        ctx.markers().await,
        0,
        "the marker is visible before the commit"
    );
    assert_eq!(
        ctx.effects(1).await,
        0,
        "the effect is visible before the commit"
    );
    tx.commit().await.expect("the caller's commit");
    assert_eq!(ctx.markers().await, 1);
    assert_eq!(ctx.effects_from(1, "apply").await, 1);
    assert_eq!(ctx.effects_from(100, "caller").await, 1);

    duplicate(apply(&ctx.store, &job, Then::Commit).await);
    assert_eq!(ctx.effects_total().await, 2);
    ctx.cleanup().await;
}

pub(crate) async fn joined_duplicate_leaves_the_caller_transaction_as_it_was<S: Support>() {
    let ctx = Ctx::<S>::new("joindup", 3).await;
    let job = ctx.job("job-joindup", 2, 20);
    assert_eq!(applied(apply(&ctx.store, &job, Then::Commit).await), 20);

    let mut tx = ctx.pool.begin().await.expect("begin");
    caller_row(&mut tx, &ctx.effects, 200).await;
    duplicate(apply(ctx.store.join(&mut tx), &job, Then::Commit).await);
    // The duplicate's failed insert (PostgreSQL: none, MySQL: error 1062) left the
    // transaction usable.
    caller_row(&mut tx, &ctx.effects, 201).await;
    tx.commit().await.expect("the caller's commit");

    assert_eq!(ctx.effects_from(2, "apply").await, 1);
    assert_eq!(ctx.effects_from(200, "caller").await, 1);
    assert_eq!(ctx.effects_from(201, "caller").await, 1);
    assert_eq!(ctx.markers().await, 1);
    ctx.cleanup().await;
}

pub(crate) async fn joined_body_error_leaves_the_caller_transaction_usable<S: Support>() {
    let mut ctx = Ctx::<S>::new("joinerr", 3).await;
    let unique = ctx
        .create_table("u", "(v BIGINT NOT NULL PRIMARY KEY)")
        .await;
    ctx.exec(&format!("INSERT INTO {unique} (v) VALUES (1)"))
        .await;
    let job = ctx.job("job-joinerr", 3, 30);

    let mut tx = ctx.pool.begin().await.expect("begin");
    caller_row(&mut tx, &ctx.effects, 300).await;
    // The body's own error.
    match apply(ctx.store.join(&mut tx), &job, Then::Fail).await {
        Err(TestError::Refused) => {}
        other => panic!("expected the handler's own error, got {other:?}"),
    }
    // A failing statement in the body (PostgreSQL aborts the transaction up to the
    // savepoint), returned with `?`.
    match apply_and_insert(ctx.store.join(&mut tx), &job, &unique, 1).await {
        Err(TestError::Db(e)) => {
            let kind = e.as_database_error().map(|d| d.kind());
            assert_eq!(kind, Some(sqlx::error::ErrorKind::UniqueViolation), "{e}");
        }
        other => panic!("expected a unique violation, got {other:?}"),
    }
    caller_row(&mut tx, &ctx.effects, 301).await;
    tx.commit()
        .await
        .expect("the caller's commit after the body's errors");

    assert_eq!(
        ctx.markers().await,
        0,
        "a failed joined body left its marker"
    );
    assert_eq!(
        ctx.effects_from(3, "apply").await,
        0,
        "a failed body left its effect"
    );
    assert_eq!(ctx.effects_from(300, "caller").await, 1);
    assert_eq!(ctx.effects_from(301, "caller").await, 1);
    assert_eq!(applied(apply(&ctx.store, &job, Then::Commit).await), 30);
    assert_eq!(ctx.markers().await, 1);
    ctx.cleanup().await;
}

pub(crate) async fn nested_handler_joins_the_outer_transaction<S: Support>() {
    let ctx = Ctx::<S>::new("nest", 3).await;
    let (job, inner) = (ctx.job("job-outer", 4, 40), ctx.job("job-inner", 5, 50));

    // The outer fails after the inner applied: both roll back together.
    let failed = outer(
        &ctx.store,
        &job,
        &ctx.store,
        &inner,
        Inner::Joined,
        Then::Fail,
    );
    match within(60, "a failing outer call", failed).await {
        Err(TestError::Refused) => {}
        other => panic!("expected the outer handler's own error, got {other:?}"),
    }
    assert_eq!(
        ctx.markers().await,
        0,
        "the inner's marker outlived the outer"
    );
    assert_eq!(
        ctx.effects_total().await,
        0,
        "the inner's effect outlived the outer"
    );

    // Both commit together.
    let done = outer(
        &ctx.store,
        &job,
        &ctx.store,
        &inner,
        Inner::Joined,
        Then::Commit,
    );
    assert_eq!(applied(within(60, "the outer call", done).await), 40);
    assert_eq!(ctx.effects_from(4, "outer").await, 1);
    assert_eq!(ctx.effects_from(5, "apply").await, 1);
    assert_eq!(ctx.markers().await, 2);
    duplicate(apply(&ctx.store, &inner, Then::Commit).await);
    ctx.cleanup().await;
}

pub(crate) async fn nested_call_with_a_store_is_refused_and_writes_nothing<S: Support>() {
    let ctx = Ctx::<S>::new("nestno", 3).await;
    let (job, inner) = (ctx.job("job-outer", 6, 60), ctx.job("job-inner", 7, 70));

    // SQLite waited for its own write lock here until the busy timeout; now it is refused at
    // once, and the outer rolls back.
    let call = outer(
        &ctx.store,
        &job,
        &ctx.store,
        &inner,
        Inner::Store,
        Then::Commit,
    );
    match within(30, "a nested call with a store", call).await {
        Err(TestError::Idem(e @ idem::Error::Refused(idem::Refusal::Nested { .. }))) => assert_eq!(
            e.to_string(),
            "`apply` was called with a store inside the body of `outer`, whose transaction is \
             open, and would not run in that transaction (nothing was written): call \
             `apply(store.join(tx), ...)` to join it; a lease-mode handler has no transaction \
             to join: call it before or after `outer`'s body"
        ),
        other => panic!("expected Error::Refused(Refusal::Nested), got {other:?}"),
    }
    let call = outer(
        &ctx.store,
        &job,
        &ctx.store,
        &inner,
        Inner::Claim,
        Then::Commit,
    );
    match within(30, "a nested hand-written claim", call).await {
        Err(TestError::Idem(idem::Error::Refused(idem::Refusal::Nested { inner, outer }))) => {
            assert_eq!((inner.as_str(), outer.as_str()), ("Store::claim", "outer"));
        }
        other => panic!("expected Error::Refused(Refusal::Nested), got {other:?}"),
    }
    assert_eq!(ctx.markers().await, 0);
    assert_eq!(ctx.effects_total().await, 0);

    // Outside any body the same calls run as usual.
    assert_eq!(applied(apply(&ctx.store, &inner, Then::Commit).await), 70);
    ctx.cleanup().await;
}
