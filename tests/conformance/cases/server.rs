//! Servers only: connections killed or cut, and a server that is down.

use std::sync::Arc;
use std::time::Duration;

use idem::{Outcome, Store};

use sqlx::{Pool, Transaction};

use crate::conformance::ctx::Ctx;
use crate::conformance::handlers::*;
use crate::conformance::util::within;
use crate::conformance::{Server, Support};

/// Reads its own connection id, has another pool kill that connection, returns `Ok`.
#[::idem::idempotent(key = "job.key", scope = "apply")]
async fn apply_then_kill_own_connection<S: Server>(
    tx: &mut Transaction<'_, S::Db>,
    job: &Job,
    killer: &Pool<S::Db>,
) -> Result<i64, TestError> {
    insert_effect(tx, job, "apply").await?;
    let id = S::connection_id(&mut **tx).await;
    S::kill(killer, id).await;
    Ok(job.amount)
}

pub(crate) async fn connection_killed_before_commit_keeps_nothing<S: Server>() {
    let ctx = Ctx::<S>::new("killconn", 2).await;
    let killer = S::connect(&ctx.url, 1).await;
    let job = ctx.job("job-killconn", 9, 90);
    match apply_then_kill_own_connection::<S>(&ctx.store, &job, &killer).await {
        Err(TestError::Idem(::idem::Error::Database(_))) => {}
        other => panic!("expected the commit to fail, got {other:?}"),
    }
    assert_eq!(
        ctx.markers().await,
        0,
        "a marker survived a killed connection"
    );
    assert_eq!(
        ctx.effects_total().await,
        0,
        "an effect survived a killed connection"
    );
    let next = apply(&ctx.store, &job, Then::Commit);
    let next = within(120, "delivery after a killed connection", next).await;
    assert_eq!(applied(next), 90);
    duplicate(apply(&ctx.store, &job, Then::Commit).await);
    assert_eq!(ctx.effects(9).await, 1);
    assert_eq!(ctx.markers().await, 1);
    killer.close().await;
    ctx.cleanup().await;
}

pub(crate) async fn unreachable_server_fails_the_test_naming_url_and_variable<S: Server>() {
    let url = S::UNREACHABLE_URL;
    let joined = tokio::spawn(async move {
        drop(S::connect(url, 1).await);
    })
    .await;
    let Err(e) = joined else {
        panic!("connecting to {url} succeeded")
    };
    let payload = e.into_panic();
    let msg = payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_default();
    assert!(msg.contains(url), "{msg}");
    assert!(msg.contains(S::URL_VAR), "{msg}");
}
