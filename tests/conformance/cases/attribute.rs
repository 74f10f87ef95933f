//! What the attribute itself accepts: inner attributes at the top of the body, and `wait`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use idem::Outcome;
use sqlx::Transaction;

use crate::conformance::ctx::Ctx;
use crate::conformance::handlers::*;
use crate::conformance::util::within;
use crate::conformance::{Support, TestDb};

/// `apply` whose body opens with an inner attribute, which must stay inside the body (before
/// the `fn` it would be an inner attribute of this module).
#[idem::idempotent(key = "job.key", scope = "apply")]
async fn apply_with_inner_attribute<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
) -> Result<i64, TestError> {
    #![allow(unused_variables)]
    let unused = job.amount * 2;
    insert_effect(tx, job, "apply").await?;
    Ok(job.amount)
}

pub(crate) async fn handler_with_inner_attributes_runs<S: Support>() {
    let ctx = Ctx::<S>::new("inner", 2).await;
    let job = ctx.job("job-inner", 31, 310);
    assert_eq!(
        applied(apply_with_inner_attribute(&ctx.store, &job).await),
        310
    );
    duplicate(apply_with_inner_attribute(&ctx.store, &job).await);
    assert_eq!(ctx.effects(31).await, 1);
    assert_eq!(ctx.markers().await, 1);
    ctx.cleanup().await;
}

/// `apply` with `wait` set through the attribute; counts the bodies that ran.
#[idem::idempotent(key = "job.key", scope = "apply", wait = "500ms")]
async fn apply_waiting<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
    ran: &AtomicUsize,
) -> Result<i64, TestError> {
    ran.fetch_add(1, Ordering::SeqCst);
    insert_effect(tx, job, "waiting").await?;
    Ok(job.amount)
}

/// A delivery through a handler declared with `wait = "500ms"` stops waiting behind a held
/// key: `InProgress`, its body never runs. Once the holder commits it is a `Duplicate`.
/// The wait-handler runs on a pool of one connection: where the backend keeps the wait in a
/// session variable (MySQL), that connection's setting is back to the server's afterwards.
pub(crate) async fn attribute_wait_is_in_progress_then_duplicate<S: Support>() {
    let ctx = Ctx::<S>::new("attrwait", 2).await;
    let single = S::connect(&ctx.url, 1).await;
    let waiting = idem::Store::new(single.clone())
        .with_table(ctx.store.table())
        .expect("the test's table name");
    let session = match S::WAIT_RESTORED {
        Some((id, _)) => Some(session_scalar::<S>(&single, id).await),
        None => None,
    };
    let job = ctx.job("job-attrwait", 32, 320);
    let hold = Arc::new(Hold::default());
    let first = tokio::spawn({
        let (store, job, hold) = (ctx.store.clone(), job.clone(), hold.clone());
        async move { apply_holding(&store, &job, &hold).await }
    });
    within(60, "the first delivery parking in its body", hold.entered()).await;
    let ran = AtomicUsize::new(0);
    let second = apply_waiting(&waiting, &job, &ran);
    match within(60, "the second delivery", second).await {
        Err(TestError::Idem(idem::Error::InProgress { scope, key })) => {
            assert_eq!((scope.as_str(), key.as_str()), ("apply", "job-attrwait"));
        }
        other => panic!("expected InProgress, got {other:?}"),
    }
    assert_eq!(ran.load(Ordering::SeqCst), 0, "the waiting body ran");
    assert_eq!(ctx.markers().await, 0);
    assert_eq!(ctx.effects_total().await, 0);
    hold.release();
    let first = within(60, "the first delivery", first)
        .await
        .expect("no panic");
    assert_eq!(applied(first), 320);
    match apply_waiting(&waiting, &job, &ran).await {
        Ok(Outcome::Duplicate) => {}
        other => panic!("expected Duplicate, got {other:?}"),
    }
    assert_eq!(ran.load(Ordering::SeqCst), 0, "the waiting body ran");
    assert_eq!(ctx.effects_from(32, "apply").await, 1);
    assert_eq!(ctx.effects_total().await, 1);
    assert_eq!(ctx.markers().await, 1);
    if let Some((id, restored)) = S::WAIT_RESTORED {
        // The pool's only connection, the one both wait-deliveries ran on: the same session
        // as before them (not a replacement for a connection closed on the way).
        assert_eq!(Some(session_scalar::<S>(&single, id).await), session);
        assert_eq!(
            session_scalar::<S>(&single, restored).await,
            1,
            "the session's lock wait was not set back after the deliveries with `wait`"
        );
    }
    single.close().await;
    ctx.cleanup().await;
}

async fn session_scalar<S: Support>(pool: &sqlx::Pool<S::Db>, sql: &str) -> i64 {
    let mut conn = pool.acquire().await.expect("the pool's connection");
    S::Db::fetch_i64(&mut conn, sql, &[])
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}
