//! The nesting rule for claims held by hand: a body run with `Body::run` refuses a claim with a
//! store inside it (and only inside it: claims side by side in one task are not nested), and
//! a lease claim behind a transaction holding the key waits only with `wait`.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Poll;
use std::time::Duration;

use idem::{Claimed, Error, Guard, JoinedGuard, Key, Lease, LeaseOptions, Outbox, Outcome, Store};
use sqlx::Transaction;

use super::by_hand::*;
use super::lease::{db_now_plus, poll_db};
use crate::conformance::ctx::Ctx;
use crate::conformance::handlers::*;
use crate::conformance::lease_handlers::{How, Provider, charge};
use crate::conformance::util::{backend, within};
use crate::conformance::{Support, TestDb};

/// Every claim with a store, made inside a holder's body: each must be refused as nested,
/// naming `outer`. `tag` makes the keys unique.
async fn claims_with_a_store<DB: TestDb>(
    stores: [(&str, &Store<DB>); 2],
    tag: &str,
    effects: &str,
    provider: &Provider<DB>,
) -> Vec<(String, Answer)> {
    let mut answers = Vec::new();
    for (which, store) in stores {
        let k = |call: &str| format!("{tag}-{which}-{call}");
        let job = |call: &str| Job {
            key: k(call),
            id: 900,
            amount: 1,
            effects: effects.to_owned(),
        };
        let claim = store.claim(HAND, &hand_key(&k("claim"))).await;
        answers.push((format!("{which} Store::claim"), claimed(claim)));
        let lease = store
            .lease(HAND, &hand_key(&k("lease")), thirty_seconds())
            .await;
        answers.push((format!("{which} Store::lease"), claimed(lease)));
        let keys = [hand_key(&k("batch-1")), hand_key(&k("batch-2"))];
        let batch = match store.claim_batch(HAND, &keys).await {
            Ok(batch) if batch.any_fresh() => Answer::Fresh,
            Ok(_) => Answer::Duplicate,
            Err(e) => idem_answer(e),
        };
        answers.push((format!("{which} Store::claim_batch"), batch));
        let call = apply(store, &job("apply"), Then::Commit).await;
        answers.push((format!("{which} apply"), answer(call)));
        let call = charge(store, &job("charge"), provider, How::Pay).await;
        answers.push((format!("{which} charge"), answer(call)));
    }
    answers
}

/// What [`claims_with_a_store`] must answer inside the body of `outer`.
fn all_nested(outer: &str) -> Vec<(String, Answer)> {
    let mut want = Vec::new();
    for which in ["offline", "live"] {
        for inner in [
            "Store::claim",
            "Store::lease",
            "Store::claim_batch",
            "apply",
            "charge",
        ] {
            let nested = Answer::Nested {
                inner: inner.to_owned(),
                outer: outer.to_owned(),
            };
            want.push((format!("{which} {inner}"), nested));
        }
    }
    want
}

/// A claim joined to the holder's transaction, inside its body: it is not refused, and
/// applies in that transaction.
async fn joined_inside<DB: TestDb>(
    store: &Store<DB>,
    tx: &mut Transaction<'_, DB>,
    job: &Job,
) -> Answer {
    match store.join(tx).claim(HAND, &hand_key(&job.key)).await {
        Ok(Claimed::Fresh(mut joined)) => {
            let effect = insert_effect(joined.tx(), job, "joined").await;
            answer(joined.finish(effect.map_err(TestError::from)).await)
        }
        other => claimed(other),
    }
}

/// Inside the body of a hand-written `Guard`, `JoinedGuard` and `BatchGuard` run with
/// `body().run(..)`, every claim with a store (`Store::claim`, `Store::lease`,
/// `Store::claim_batch`, a transaction-mode and a lease-mode handler) is refused with
/// `Error::Refused(Refusal::Nested)` naming the caller and the holder, before any I/O: on a store
/// whose pool is closed too (else `PoolClosed`), and on a live one nothing is written; a claim on
/// `store.join(tx)` of the holder's transaction applies with it. Outside the body (the guard still
/// open) a claim is not marked.
pub(crate) async fn body_run_refuses_a_nested_claim_of_every_kind_before_any_io<S: Support>() {
    let ctx = Ctx::<S>::new("hand_nested", 4).await;
    let closed = S::connect(&ctx.url, 1).await;
    let offline = Store::new(closed.clone())
        .with_table(ctx.store.table())
        .expect("table name");
    closed.close().await;
    // SQLite: a nested claim that was let through would wait for the holder's write lock, for
    // sqlx's 5 s here rather than the suite's minute.
    let pool = S::connect_default_wait(&ctx.url, 2).await;
    let live = Store::new(pool.clone())
        .with_table(ctx.store.table())
        .expect("table name");
    let stores = [("offline", &offline), ("live", &live)];
    let provider = Provider::<S::Db>::in_memory();
    let effects = ctx.effects.clone();

    // A guard.
    let outer = ctx.job("outer-guard", 1, 1);
    let inner = ctx.job("joined-in-guard", 2, 1);
    let mut guard = fresh_guard(&ctx.store, &hand_key(&outer.key)).await;
    let body = guard.body();
    let inside = body.run(async {
        insert_effect(guard.tx(), &outer, "outer")
            .await
            .expect("the effect");
        let refused = claims_with_a_store(stores, "guard", &effects, &provider).await;
        let joined = joined_inside(&ctx.store, guard.tx(), &inner).await;
        (refused, joined)
    });
    let (refused, joined) = within(120, "the guard's body", inside).await;
    // The guard is still open, but its body is over: a claim made outside `body().run(..)` is
    // not marked, and reaches the (closed) pool.
    let outside = claimed(offline.claim(HAND, &hand_key("outside-the-body")).await);
    let done = answer(guard.finish::<(), TestError>(Ok(())).await);
    assert_eq!(
        (refused, joined, outside, done),
        (
            all_nested("Store::claim"),
            Answer::Applied,
            Answer::Other("Database(PoolClosed)".to_owned()),
            Answer::Applied
        ),
        "a guard's body: (the claims with a store, the joined claim, a claim outside the body \
         while the guard is open, the guard's finish)"
    );

    // A joined guard, in a transaction the test holds.
    let outer = ctx.job("outer-joined", 3, 1);
    let inner = ctx.job("joined-in-joined", 4, 1);
    let mut tx = ctx.pool.begin().await.expect("begin");
    let mut held = fresh_joined(ctx.store.join(&mut tx), &hand_key(&outer.key)).await;
    let body = held.body();
    let inside = body.run(async {
        insert_effect(held.tx(), &outer, "outer")
            .await
            .expect("the effect");
        let refused = claims_with_a_store(stores, "joined", &effects, &provider).await;
        let joined = joined_inside(&ctx.store, held.tx(), &inner).await;
        (refused, joined)
    });
    let (refused, joined) = within(120, "the joined guard's body", inside).await;
    let done = answer(held.finish::<(), TestError>(Ok(())).await);
    let committed = idem::commit(tx).await.map_err(idem_answer);
    assert_eq!(
        (refused, joined, done, committed),
        (
            all_nested("Joined::claim"),
            Answer::Applied,
            Answer::Applied,
            Ok(())
        ),
        "a joined guard's body: (the claims with a store, the joined claim, its finish, the \
         caller's commit)"
    );

    // A batch guard.
    let outer = [
        ctx.job("outer-batch-1", 5, 1),
        ctx.job("outer-batch-2", 6, 1),
    ];
    let inner = ctx.job("joined-in-batch", 7, 1);
    let keys = Key::batch(outer.iter().map(|j| j.key.as_str())).expect("valid keys");
    let mut batch = ctx.store.claim_batch(HAND, &keys).await.expect("claim");
    let body = batch.body().expect("fresh jobs");
    let inside = body.run(async {
        let tx = batch.tx().expect("fresh jobs");
        for job in &outer {
            insert_effect(tx, job, "outer").await.expect("the effect");
        }
        let refused = claims_with_a_store(stores, "batch", &effects, &provider).await;
        let joined = joined_inside(&ctx.store, batch.tx().expect("fresh jobs"), &inner).await;
        (refused, joined)
    });
    let (refused, joined) = within(120, "the batch guard's body", inside).await;
    let done = match batch.finish::<(), TestError>(Ok(())).await {
        Ok(b) if b.outcomes() == [Outcome::Applied(()), Outcome::Applied(())] => Answer::Applied,
        other => Answer::Other(format!("{other:?}")),
    };
    assert_eq!(
        (refused, joined, done),
        (
            all_nested("Store::claim_batch"),
            Answer::Applied,
            Answer::Applied
        ),
        "a batch guard's body: (the claims with a store, the joined claim, the batch's finish)"
    );

    // Sorted, as `stored_keys` reads them.
    let kept = [
        "joined-in-batch",
        "joined-in-guard",
        "joined-in-joined",
        "outer-batch-1",
        "outer-batch-2",
        "outer-guard",
        "outer-joined",
    ];
    assert_eq!(
        (
            ctx.stored_keys().await,
            ctx.effects_total().await,
            ctx.effects(900).await,
            provider.requests()
        ),
        (kept.iter().map(|k| (*k).to_owned()).collect(), 7, 0, 0),
        "(the markers' keys, effects, effects of the refused handlers, outside calls)"
    );
    pool.close().await;
    ctx.cleanup().await;
}

/// Polls `fut` once (a claim makes its nested-call check at its first poll, before its first
/// I/O), runs `then`, and awaits the rest of `fut`.
async fn begun_then<F: Future>(fut: F, then: impl FnOnce()) -> F::Output {
    let mut fut = std::pin::pin!(fut);
    let first = std::future::poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await;
    then();
    match first {
        Poll::Ready(out) => out,
        Poll::Pending => fut.await,
    }
}

/// Two handlers, and two hand-written claims, of different keys, run side by side in one task
/// (`tokio::join!`): the second claims while the first's body is parked, yet neither is inside
/// the other, so neither is refused as nested, and both apply. (A mark on the whole task
/// refuses the second.) On the servers the second delivery runs to its end while the first is
/// parked; on SQLite, whose second writer waits for the first's write lock, the first goes on
/// once the second has begun its claim.
pub(crate) async fn claims_side_by_side_in_one_task_are_not_nested<S: Support>() {
    let ctx = Ctx::<S>::new("hand_beside", 4).await;
    let one_writer = backend::<S::Db>() == "sqlite";

    // Two handlers.
    let (a, b) = (ctx.job("beside-a", 1, 10), ctx.job("beside-b", 2, 20));
    let hold = Hold::default();
    let first = apply_holding(&ctx.store, &a, &hold);
    let second = async {
        hold.entered().await;
        let call = apply(&ctx.store, &b, Then::Commit);
        if one_writer {
            begun_then(call, || hold.release()).await
        } else {
            let done = call.await;
            hold.release();
            done
        }
    };
    let (first, second) = within(60, "two handlers side by side", async {
        tokio::join!(first, second)
    })
    .await;
    assert_eq!(
        (
            answer(first),
            answer(second),
            ctx.effects(1).await,
            ctx.effects(2).await
        ),
        (Answer::Applied, Answer::Applied, 1, 1),
        "(the parked handler, the one beside it, their effects)"
    );

    // Two hand-written claims, each body run with `body().run(..)`.
    let (c, d) = (ctx.job("beside-c", 3, 30), ctx.job("beside-d", 4, 40));
    let hold = &Hold::default();
    let mut held = fresh_guard(&ctx.store, &hand_key(&c.key)).await;
    let first = async {
        let body = held.body();
        let done = body
            .run(async {
                insert_effect(held.tx(), &c, "hand").await?;
                hold.park_first().await;
                Ok::<(), TestError>(())
            })
            .await;
        held.finish(done).await
    };
    let second = async {
        hold.entered().await;
        let run = async {
            let mut guard = match ctx.store.claim(HAND, &hand_key(&d.key)).await {
                Ok(Claimed::Fresh(guard)) => guard,
                other => return Err(claimed(other)),
            };
            let body = guard.body();
            let done = body
                .run(async { insert_effect(guard.tx(), &d, "hand").await })
                .await;
            Ok(answer(guard.finish(done.map_err(TestError::from)).await))
        };
        if one_writer {
            begun_then(run, || hold.release()).await
        } else {
            let done = run.await;
            hold.release();
            done
        }
    };
    let (first, second) = within(60, "two hand-written claims side by side", async {
        tokio::join!(first, second)
    })
    .await;
    assert_eq!(
        (
            answer(first),
            second,
            ctx.effects(3).await,
            ctx.effects(4).await
        ),
        (Answer::Applied, Ok(Answer::Applied), 1, 1),
        "(the parked guard, the claim beside it, their effects)"
    );
    assert_eq!(ctx.markers().await, 4);
    ctx.cleanup().await;
}

/// Until a claim is seen queued on the marker table's row locks, or `answered` is set;
/// returns whether it was seen queued before it answered. `None` where waiters cannot be seen
/// (SQLite).
async fn queued_before_answering<S: Support>(ctx: &Ctx<S>, answered: &AtomicBool) -> Option<bool> {
    ctx.claims_waiting().await?;
    poll_db(
        60,
        "the lease claim queued on the key, or its answer",
        || async {
            answered.load(Ordering::SeqCst) || ctx.claims_waiting().await.unwrap_or(0) >= 1
        },
    )
    .await;
    Some(!answered.load(Ordering::SeqCst))
}

/// A lease claim that took the key: its effect (an autocommit statement, the outside
/// system's), then its finish.
async fn lease_applies<S: Support>(
    ctx: &Ctx<S>,
    job: &Job,
    claim: Result<Claimed<Lease>, Error>,
) -> Answer {
    match claim {
        Ok(Claimed::Fresh(lease)) => {
            ctx.exec(&format!(
                "INSERT INTO {} (id, amount, origin) VALUES ({}, {}, 'lease')",
                ctx.effects, job.id, job.amount
            ))
            .await;
            answer(lease.finish::<(), TestError>(Ok(())).await)
        }
        other => claimed(other),
    }
}

/// A lease claim with `wait` behind a hand-held transaction-mode claim of the same key waits
/// for it (on the servers it is seen queued on the key before it answers) and, once the holder
/// rolls back, takes the key and applies; the holder's effect is gone, the lease's kept once.
pub(crate) async fn lease_with_wait_behind_a_hand_held_transaction_claim_waits_then_applies<
    S: Support,
>() {
    let ctx = Ctx::<S>::new("hand_leasewait", 4).await;
    let job = ctx.job("order-leasewait", 1, 10);
    let key = hand_key(&job.key);
    let mut holder = fresh_guard(&ctx.store, &key).await;
    insert_effect(holder.tx(), &job, "holder")
        .await
        .expect("the holder's effect");
    let answered = &AtomicBool::new(false);
    let options = thirty_seconds().wait(Duration::from_secs(30));
    let claim = async {
        let claim = ctx.store.lease(HAND, &key, options).await;
        answered.store(true, Ordering::SeqCst);
        claim
    };
    let c = &ctx;
    let rollback = async move {
        let queued = queued_before_answering(c, answered).await;
        holder.release().await;
        queued
    };
    let (claim, queued) = within(
        90,
        "a waiting lease claim and the holder's rollback",
        async { tokio::join!(claim, rollback) },
    )
    .await;
    let leased = lease_applies(&ctx, &job, claim).await;
    assert_eq!(
        (queued.unwrap_or(true), leased),
        (true, Answer::Applied),
        "(seen queued on the key before it answered, the lease claim's answer after the \
         holder's rollback)"
    );
    let m = ctx.marker(&job.key).await;
    assert_eq!(
        (
            ctx.effects_from(1, "holder").await,
            ctx.effects_from(1, "lease").await,
            (m.completed, m.attempts)
        ),
        (0, 1, (true, 1)),
        "(the holder's effects, the lease's, the marker (completed, attempts))"
    );
    assert_eq!(
        claimed(ctx.store.claim(HAND, &key).await),
        Answer::Duplicate
    );
    ctx.cleanup().await;
}

/// The same lease claim without `wait` answers `InProgress` at once on the servers while the
/// hand-held claim holds the key, and takes it once the holder rolled back. On SQLite every
/// writer waits for the one write lock, a lease claim without `wait` too (for the connection's
/// busy timeout): there it waits and applies, as with `wait`.
pub(crate) async fn lease_without_wait_behind_a_hand_held_transaction_claim_is_in_progress<
    S: Support,
>() {
    let ctx = Ctx::<S>::new("hand_leasenowait", 4).await;
    let job = ctx.job("order-leasenowait", 1, 10);
    let key = hand_key(&job.key);
    let mut holder = fresh_guard(&ctx.store, &key).await;
    insert_effect(holder.tx(), &job, "holder")
        .await
        .expect("the holder's effect");
    if backend::<S::Db>() == "sqlite" {
        let claim = ctx.store.lease(HAND, &key, thirty_seconds());
        let rollback = holder.release();
        let (claim, ()) = within(90, "a lease claim and the holder's rollback", async {
            tokio::join!(claim, rollback)
        })
        .await;
        assert_eq!(lease_applies(&ctx, &job, claim).await, Answer::Applied);
    } else {
        let claim = ctx.store.lease(HAND, &key, thirty_seconds());
        let during = within(30, "a lease claim behind the held key", claim).await;
        let during = match during {
            Err(Error::InProgress { scope, key }) => {
                assert_eq!((scope.as_str(), key.as_str()), (HAND, job.key.as_str()));
                Answer::InProgress
            }
            other => claimed(other),
        };
        let marker_meanwhile = ctx.markers().await;
        holder.release().await;
        let after = ctx.store.lease(HAND, &key, thirty_seconds()).await;
        let after = lease_applies(&ctx, &job, after).await;
        assert_eq!(
            (during, marker_meanwhile, after),
            (Answer::InProgress, 0, Answer::Applied),
            "(the lease claim while the key is held, markers meanwhile, a lease claim after \
             the rollback)"
        );
    }
    let m = ctx.marker(&job.key).await;
    assert_eq!(
        (
            ctx.effects_from(1, "holder").await,
            ctx.effects_from(1, "lease").await,
            m.completed
        ),
        (0, 1, true),
        "(the holder's effects, the lease's, completed)"
    );
    ctx.cleanup().await;
}
