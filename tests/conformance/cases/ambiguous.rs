//! Servers only: a connection cut by a proxy at the commit (the client never learns whether
//! it landed) or right after the claim. SQLite has no connection to cut: it is a file opened
//! in the process.

use idem::Store;
use sqlx::Pool;

use crate::conformance::ctx::Ctx;
use crate::conformance::db::Bind;
use crate::conformance::handlers::*;
use crate::conformance::proxy::{Cut, CutAt, Proxy};
use crate::conformance::util::{until, within};
use crate::conformance::{Server, Support};

/// A proxy cutting at `at`, a pool of one connection through it and a store on the test's
/// marker table (migrated over the direct pool, so only deliveries pass the proxy).
pub(super) async fn through_proxy<S: Server>(
    ctx: &Ctx<S>,
    at: CutAt,
) -> (Proxy, Pool<S::Db>, Store<S::Db>) {
    let proxy = Proxy::start(S::address(&ctx.url), S::WIRE, at).await;
    let pool = S::connect(&S::with_address(&ctx.url, proxy.addr), 1).await;
    let store = Store::new(pool.clone())
        .with_table(ctx.store.table())
        .expect("the test's table name");
    (proxy, pool, store)
}

/// Blocks until the server has finished with the cut session (committed or rolled back and
/// gone), so that what the marker table shows afterwards is final.
pub(super) async fn until_session_gone<S: Server>(ctx: &Ctx<S>, cut: Cut) {
    let port = i64::from(cut.server_side_port);
    until(60, "the cut session ending on the server", || async move {
        ctx.scalar_with(S::SESSIONS_FROM_PORT, &[Bind::I64(port)])
            .await
            == 0
    })
    .await;
}

/// The commit message reaches the server; its answer never reaches the client. The delivery
/// is an error, never `Applied`. Whether the commit landed is read from the marker table, and
/// the redelivery (direct) agrees: `Duplicate` if it did, `Applied` if not. The effect exists
/// once either way. (On the servers here the commit lands: both execute a message they have
/// read before they notice the closed socket.)
pub(crate) async fn commit_cut_before_its_answer_is_an_error_and_redelivery_settles_it<
    S: Server,
>() {
    cut_commit::<S>("ambig", CutAt::Commit, None).await;
}

/// The same cut with the commit message dropped by the proxy: the client sees the same
/// error, the server never commits, and the redelivery applies (the other branch of the case
/// above, which the servers here never take).
pub(crate) async fn commit_never_delivered_is_an_error_and_redelivery_applies<S: Server>() {
    cut_commit::<S>("nocommit", CutAt::InsteadOfCommit, Some(0)).await;
}

/// `expect`: the number of markers the cut must leave, when it is known.
async fn cut_commit<S: Server>(tag: &str, at: CutAt, expect: Option<i64>) {
    let ctx = Ctx::<S>::new(tag, 2).await;
    let (mut proxy, pool, store) = through_proxy(&ctx, at).await;
    let job = ctx.job("job-ambig", 40, 400);
    let first = apply(&store, &job, Then::Commit);
    match within(60, "the delivery whose commit is cut", first).await {
        Err(TestError::Idem(idem::Error::Database(_))) => {}
        other => panic!("expected a database error from the cut commit, got {other:?}"),
    }
    // The error is the cut at the commit, not some earlier failure.
    let cut = within(60, "the proxy cutting at the commit", proxy.cut()).await;
    until_session_gone(&ctx, cut).await;
    // Read before the redelivery: did the commit land?
    let landed = ctx.markers().await;
    assert!(landed <= 1, "{landed} markers");
    if let Some(want) = expect {
        assert_eq!(landed, want, "markers after the cut");
    }
    assert_eq!(
        ctx.effects(40).await,
        landed,
        "the effect and the marker commit together"
    );
    let again = within(60, "the redelivery", apply(&ctx.store, &job, Then::Commit)).await;
    if landed == 1 {
        duplicate(again);
    } else {
        assert_eq!(applied(again), 400);
    }
    duplicate(apply(&ctx.store, &job, Then::Commit).await);
    assert_eq!(ctx.effects(40).await, 1);
    assert_eq!(ctx.effects_total().await, 1);
    assert_eq!(ctx.markers().await, 1);
    pool.close().await;
    drop(proxy);
    ctx.cleanup().await;
}

/// The connection is cut right after the claim `INSERT` was sent: the transaction never
/// commits. The delivery is an error; the redelivery applies; the effect exists once.
pub(crate) async fn connection_cut_after_the_claim_keeps_nothing_and_redelivery_applies<
    S: Server,
>() {
    let ctx = Ctx::<S>::new("cutclaim", 2).await;
    let at = CutAt::ClaimOf(ctx.store.table().to_owned());
    let (mut proxy, pool, store) = through_proxy(&ctx, at).await;
    let job = ctx.job("job-cutclaim", 41, 410);
    let first = apply(&store, &job, Then::Commit);
    match within(60, "the delivery whose claim is cut", first).await {
        Err(TestError::Idem(idem::Error::Database(_))) => {}
        other => panic!("expected a database error from the cut claim, got {other:?}"),
    }
    let cut = within(60, "the proxy cutting after the claim", proxy.cut()).await;
    until_session_gone(&ctx, cut).await;
    assert_eq!(ctx.markers().await, 0, "a marker survived a cut claim");
    assert_eq!(
        ctx.effects_total().await,
        0,
        "an effect survived a cut claim"
    );
    let again = within(60, "the redelivery", apply(&ctx.store, &job, Then::Commit)).await;
    assert_eq!(applied(again), 410);
    duplicate(apply(&ctx.store, &job, Then::Commit).await);
    assert_eq!(ctx.effects(41).await, 1);
    assert_eq!(ctx.effects_total().await, 1);
    assert_eq!(ctx.markers().await, 1);
    pool.close().await;
    drop(proxy);
    ctx.cleanup().await;
}
