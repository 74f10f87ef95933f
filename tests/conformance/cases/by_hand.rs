//! Claims held by hand (`Guard`, `JoinedGuard`, `BatchGuard`, `Lease`) go through the same
//! finish as the attribute's: their outbox is written exactly when the work is kept. The
//! nesting rule for their bodies is in `by_hand_nested`.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Poll;
use std::time::Duration;

use idem::{
    Claimed, Error, Guard, JoinedGuard, Key, Lease, LeaseError, LeaseOptions, Outbox, Outcome,
    Refusal, Store,
};
use sqlx::Transaction;

use super::lease::{db_now_plus, poll_db};
use crate::conformance::ctx::Ctx;
use crate::conformance::handlers::*;
use crate::conformance::lease_handlers::{How, Provider, charge};
use crate::conformance::util::{backend, within};
use crate::conformance::{Support, TestDb};

/// The scope of every claim made by hand here (and of [`charge_sending`]).
pub(super) const HAND: &str = "orders.hand";

/// What a claim, a call or an end came to, compared exactly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Answer {
    Applied,
    Duplicate,
    /// A claim that holds the key (not finished yet).
    Fresh,
    InProgress,
    LeaseLost,
    LeaseHeld {
        scope: String,
        key: String,
    },
    Nested {
        inner: String,
        outer: String,
    },
    /// The body's own error, returned by the finish.
    Refused,
    Other(String),
}

pub(super) fn idem_answer(e: Error) -> Answer {
    match e {
        Error::InProgress { .. } => Answer::InProgress,
        Error::Lease(LeaseError::Lost { .. }) => Answer::LeaseLost,
        Error::Lease(LeaseError::Held { scope, key }) => Answer::LeaseHeld { scope, key },
        Error::Refused(Refusal::Nested { inner, outer }) => Answer::Nested { inner, outer },
        other => Answer::Other(format!("{other:?}")),
    }
}

/// The answer of a call or a finish.
pub(super) fn answer<T: std::fmt::Debug>(result: Result<Outcome<T>, TestError>) -> Answer {
    match result {
        Ok(Outcome::Applied(_)) => Answer::Applied,
        Ok(Outcome::Duplicate | Outcome::Replayed(_)) => Answer::Duplicate,
        Ok(Outcome::Failed(f)) => Answer::Other(format!("{f:?}")),
        Err(TestError::Idem(e)) => idem_answer(e),
        Err(TestError::Refused) => Answer::Refused,
        Err(TestError::Db(e)) => Answer::Other(format!("{e:?}")),
    }
}

/// The answer of a claim (a fresh one is dropped, which gives the key back).
pub(super) fn claimed<H>(result: Result<Claimed<H>, Error>) -> Answer {
    match result {
        Ok(Claimed::Fresh(_)) => Answer::Fresh,
        Ok(Claimed::Duplicate | Claimed::Replayed(_)) => Answer::Duplicate,
        Ok(Claimed::Failed(f)) => Answer::Other(format!("{f:?}")),
        Err(e) => idem_answer(e),
    }
}

pub(super) fn hand_key(s: &str) -> Key {
    Key::new(s).expect("a valid key")
}

pub(super) fn thirty_seconds() -> LeaseOptions {
    LeaseOptions::new(Duration::from_secs(30))
}

pub(super) async fn fresh_guard<DB: TestDb>(store: &Store<DB>, key: &Key) -> Guard<DB> {
    match store.claim(HAND, key).await {
        Ok(Claimed::Fresh(guard)) => guard,
        other => panic!("expected a fresh claim of {key:?}, got {other:?}"),
    }
}

pub(super) async fn fresh_hand_lease<DB: TestDb>(store: &Store<DB>, key: &Key) -> Lease {
    match store.lease(HAND, key, thirty_seconds()).await {
        Ok(Claimed::Fresh(lease)) => lease,
        other => panic!("expected a fresh lease of {key:?}, got {other:?}"),
    }
}

pub(super) async fn fresh_joined<'a, DB: TestDb>(
    joined: idem::Joined<'a, DB>,
    key: &Key,
) -> JoinedGuard<'a, DB> {
    match joined.claim(HAND, key).await {
        Ok(Claimed::Fresh(guard)) => guard,
        other => panic!("expected a fresh joined claim of {key:?}, got {other:?}"),
    }
}

/// Sends `n` messages to `destination`; returns their ids.
fn send(outbox: &mut Outbox, destination: &str, n: u32) -> Vec<String> {
    (0..n)
        .map(|i| {
            let sent = outbox.send(destination, &(destination, i));
            sent.expect("a valid message").to_owned()
        })
        .collect()
}

/// The id of the `n`-th message of `(HAND, key)`.
fn id_of(key: &str, n: u32) -> String {
    idem::job_id(HAND, &(key, n))
        .expect("a valid id")
        .into_string()
}

/// The rows [`outbox_rows`] reads for `n` messages of `key` to `destination`.
fn expected_rows(key: &str, destination: &str, n: u32) -> Vec<String> {
    let mut rows: Vec<String> = (0..n)
        .map(|i| format!("{} {destination} {i}", id_of(key, i)))
        .collect();
    rows.sort();
    rows
}

/// The outbox rows of `(HAND, key)`, committed, as `id destination seq`, sorted.
async fn outbox_rows<S: Support>(ctx: &Ctx<S>, key: &str) -> Vec<String> {
    let table = format!("{}_outbox", ctx.store.table());
    let row = match backend::<S::Db>() {
        "mysql" => {
            "CONCAT(CONVERT(id USING utf8mb4), ' ', CONVERT(destination USING utf8mb4), ' ', \
             CONVERT(CAST(seq AS CHAR) USING utf8mb4))"
        }
        "postgres" => "id || ' ' || destination || ' ' || CAST(seq AS TEXT)",
        _ => "id || ' ' || destination || ' ' || seq",
    };
    let sql = format!(
        "SELECT {row} FROM {table} WHERE {} = '{HAND}' AND {} = '{key}'",
        scope_text::<S>(),
        S::KEY_TEXT
    );
    let mut conn = ctx.pool.acquire().await.expect("a connection");
    let mut rows = S::Db::fetch_strings(&mut conn, &sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    rows.sort();
    rows
}

/// The `scope` column as text (MySQL stores it as bytes).
fn scope_text<S: Support>() -> &'static str {
    match backend::<S::Db>() {
        "mysql" => "CONVERT(scope USING utf8mb4)",
        _ => "scope",
    }
}

/// How a holder ends without keeping anything.
#[derive(Debug, Clone, Copy)]
enum End {
    /// `finish(Err(..))`.
    Fail,
    /// `release()`.
    Release,
    /// Dropped unfinished (a panic, a cancelled future).
    Drop,
}

const KEEP_NOTHING: [End; 3] = [End::Fail, End::Release, End::Drop];

/// A hand-written guard's messages: none after `finish(Err)`, `release()` or a drop; after
/// `finish(Ok)` exactly its messages, with the ids its scope, key and positions give, committed
/// with its effect and marker (none of them visible before the finish).
pub(crate) async fn outbox_of_a_guard_by_hand_is_written_only_by_finish_ok<S: Support>() {
    let ctx = Ctx::<S>::new("hand_guard", 3).await;
    let job = ctx.job("order-guard", 1, 10);
    let key = hand_key(&job.key);
    let ids: Vec<String> = (0..2).map(|n| id_of(&job.key, n)).collect();
    for end in KEEP_NOTHING {
        let mut guard = fresh_guard(&ctx.store, &key).await;
        insert_effect(guard.tx(), &job, "hand")
            .await
            .expect("the effect");
        assert_eq!(send(guard.outbox(), "receipts", 2), ids, "{end:?}");
        let ended = match end {
            End::Fail => answer(guard.finish::<(), _>(Err(TestError::Refused)).await),
            End::Release => {
                guard.release().await;
                Answer::Refused
            }
            End::Drop => {
                drop(guard);
                Answer::Refused
            }
        };
        assert_eq!(
            (
                ended,
                outbox_rows(&ctx, &job.key).await,
                ctx.markers().await,
                ctx.effects(1).await
            ),
            (Answer::Refused, vec![], 0, 0),
            "{end:?}: (its end, the outbox rows, markers, effects)"
        );
    }
    let mut guard = fresh_guard(&ctx.store, &key).await;
    insert_effect(guard.tx(), &job, "hand")
        .await
        .expect("the effect");
    assert_eq!(send(guard.outbox(), "receipts", 2), ids);
    let before = (outbox_rows(&ctx, &job.key).await, ctx.effects(1).await);
    let done = answer(guard.finish::<(), TestError>(Ok(())).await);
    assert_eq!(
        (
            before,
            done,
            outbox_rows(&ctx, &job.key).await,
            ctx.markers().await,
            ctx.effects(1).await
        ),
        (
            (vec![], 0),
            Answer::Applied,
            expected_rows(&job.key, "receipts", 2),
            1,
            1
        ),
        "((rows, effects) before the finish, the finish, rows, markers, effects after it)"
    );
    // A duplicate sends nothing again.
    assert_eq!(
        claimed(ctx.store.claim(HAND, &key).await),
        Answer::Duplicate
    );
    assert_eq!(
        outbox_rows(&ctx, &job.key).await,
        expected_rows(&job.key, "receipts", 2)
    );
    ctx.cleanup().await;
}

/// A hand-written joined guard's messages are the caller's transaction's: written (in the
/// caller's transaction) by `finish(Ok)` and kept only if the caller commits with
/// `idem::commit`; gone if the caller rolls back; never written by `finish(Err)`, `release()`
/// or a drop, even when the caller commits after them.
pub(crate) async fn outbox_of_a_joined_guard_by_hand_is_kept_only_if_the_caller_commits<
    S: Support,
>() {
    let ctx = Ctx::<S>::new("hand_joined", 3).await;
    let job = ctx.job("order-joined", 2, 20);
    let key = hand_key(&job.key);
    let ids: Vec<String> = (0..2).map(|n| id_of(&job.key, n)).collect();
    let in_outbox = format!("SELECT COUNT(*) FROM {}_outbox", ctx.store.table());

    // Applied in the caller's transaction, which rolls back.
    let mut tx = ctx.pool.begin().await.expect("begin");
    let mut joined = fresh_joined(ctx.store.join(&mut tx), &key).await;
    insert_effect(joined.tx(), &job, "hand")
        .await
        .expect("the effect");
    assert_eq!(send(joined.outbox(), "receipts", 2), ids);
    let done = answer(joined.finish::<(), TestError>(Ok(())).await);
    let seen_by_the_caller = S::Db::fetch_i64(&mut *tx, &in_outbox, &[])
        .await
        .expect("count in the caller's transaction");
    tx.rollback().await.expect("the caller rolls back");
    assert_eq!(
        (
            done,
            seen_by_the_caller,
            outbox_rows(&ctx, &job.key).await,
            ctx.markers().await,
            ctx.effects(2).await
        ),
        (Answer::Applied, 2, vec![], 0, 0),
        "(the finish, rows in the caller's transaction, rows, markers, effects after its rollback)"
    );

    // Ends that keep nothing, the caller committing after each.
    for end in KEEP_NOTHING {
        let mut tx = ctx.pool.begin().await.expect("begin");
        let mut joined = fresh_joined(ctx.store.join(&mut tx), &key).await;
        insert_effect(joined.tx(), &job, "hand")
            .await
            .expect("the effect");
        assert_eq!(send(joined.outbox(), "receipts", 2), ids, "{end:?}");
        let ended = match end {
            End::Fail => answer(joined.finish::<(), _>(Err(TestError::Refused)).await),
            End::Release => {
                joined.release().await;
                Answer::Refused
            }
            End::Drop => {
                drop(joined);
                Answer::Refused
            }
        };
        let committed = idem::commit(tx).await.map_err(idem_answer);
        assert_eq!(
            (
                ended,
                committed,
                outbox_rows(&ctx, &job.key).await,
                ctx.markers().await,
                ctx.effects(2).await
            ),
            (Answer::Refused, Ok(()), vec![], 0, 0),
            "{end:?}: (its end, the caller's commit, rows, markers, effects)"
        );
    }

    // Applied, and the caller commits.
    let mut tx = ctx.pool.begin().await.expect("begin");
    let mut joined = fresh_joined(ctx.store.join(&mut tx), &key).await;
    insert_effect(joined.tx(), &job, "hand")
        .await
        .expect("the effect");
    assert_eq!(send(joined.outbox(), "receipts", 2), ids);
    let done = answer(joined.finish::<(), TestError>(Ok(())).await);
    let before_commit = outbox_rows(&ctx, &job.key).await;
    let committed = idem::commit(tx).await.map_err(idem_answer);
    assert_eq!(
        (
            done,
            before_commit,
            committed,
            outbox_rows(&ctx, &job.key).await,
            ctx.markers().await,
            ctx.effects(2).await
        ),
        (
            Answer::Applied,
            vec![],
            Ok(()),
            expected_rows(&job.key, "receipts", 2),
            1,
            1
        ),
        "(the finish, rows before the caller's commit, the commit, rows, markers, effects)"
    );
    ctx.cleanup().await;
}

/// A hand-written batch guard's messages, each naming its job: after `finish(Ok)` exactly the
/// fresh jobs' messages, with the ids each job gets alone; none after `finish(Err)`,
/// `release()` or a drop; a duplicate job of the batch cannot send.
pub(crate) async fn outbox_of_a_batch_guard_by_hand_is_written_only_by_finish_ok<S: Support>() {
    let ctx = Ctx::<S>::new("hand_batch", 3).await;
    let jobs: Vec<Job> = (1..=3)
        .map(|i| ctx.job(&format!("order-b{i}"), i, 10 * i))
        .collect();
    // The second job was applied alone before: a duplicate in the batch.
    let alone = fresh_guard(&ctx.store, &hand_key(&jobs[1].key)).await;
    assert_eq!(
        answer(alone.finish::<(), TestError>(Ok(())).await),
        Answer::Applied
    );
    let keys = Key::batch(jobs.iter().map(|j| j.key.as_str())).expect("valid keys");
    let rows = async || {
        let mut all = Vec::new();
        for job in &jobs {
            all.push(outbox_rows(&ctx, &job.key).await);
        }
        all
    };
    let expected_ids =
        |at: usize| -> Vec<String> { (0..2).map(|n| id_of(&jobs[at].key, n)).collect() };

    for end in KEEP_NOTHING.into_iter().map(Some).chain([None]) {
        let mut batch = ctx.store.claim_batch(HAND, &keys).await.expect("claim");
        assert_eq!(batch.fresh(), [true, false, true], "{end:?}");
        let tx = batch.tx().expect("fresh jobs");
        for at in [0, 2] {
            insert_effect(tx, &jobs[at], "hand")
                .await
                .expect("the effect");
        }
        for at in [0, 2] {
            let sent: Vec<String> = (0..2_u32)
                .map(|n| {
                    let sent = batch
                        .outbox()
                        .send(&jobs[at].key, "receipts", &("receipts", n));
                    sent.expect("a fresh job's message").to_owned()
                })
                .collect();
            assert_eq!(sent, expected_ids(at), "{end:?}");
        }
        let duplicate = batch
            .outbox()
            .send(&jobs[1].key, "receipts", &0)
            .map(str::to_owned);
        assert!(
            matches!(duplicate, Err(Error::Refused(Refusal::Message { .. }))),
            "a duplicate job's message: {duplicate:?}"
        );
        let before = rows().await;
        let ended = match end {
            Some(End::Fail) => match batch.finish::<(), _>(Err(TestError::Refused)).await {
                Err(TestError::Refused) => Answer::Refused,
                other => Answer::Other(format!("{other:?}")),
            },
            Some(End::Release) => {
                batch.release().await;
                Answer::Refused
            }
            Some(End::Drop) => {
                drop(batch);
                Answer::Refused
            }
            None => match batch.finish::<(), TestError>(Ok(())).await {
                Ok(done)
                    if done.outcomes()
                        == [
                            Outcome::Applied(()),
                            Outcome::Duplicate,
                            Outcome::Applied(()),
                        ] =>
                {
                    Answer::Applied
                }
                other => Answer::Other(format!("{other:?}")),
            },
        };
        let after = rows().await;
        let (markers, effects) = (ctx.markers().await, ctx.effects_total().await);
        let none = vec![Vec::<String>::new(); 3];
        match end {
            Some(end) => assert_eq!(
                (ended, before, after, markers, effects),
                (Answer::Refused, none.clone(), none, 1, 0),
                "{end:?}: (its end, rows per job before and after it, markers, effects)"
            ),
            None => assert_eq!(
                (ended, before, after, markers, effects),
                (
                    Answer::Applied,
                    none,
                    vec![
                        expected_rows(&jobs[0].key, "receipts", 2),
                        vec![],
                        expected_rows(&jobs[2].key, "receipts", 2)
                    ],
                    3,
                    2
                ),
                "finish(Ok): (its end, rows per job before and after it, markers, effects)"
            ),
        }
    }
    ctx.cleanup().await;
}

/// A lease's messages by hand (`lease.outbox().send`): none after `finish(Err)`, `release()`
/// or a drop; written when `finish(Ok)` completes the lease (not before); and none from a holder
/// whose lease was taken over meanwhile, which gets `LeaseError::Lost`, while the new holder's are
/// written.
pub(crate) async fn outbox_of_a_lease_by_hand_is_written_only_when_it_completes<S: Support>() {
    let ctx = Ctx::<S>::new("hand_lease", 3).await;
    let k = "charge-hand";
    let key = hand_key(k);
    let ids: Vec<String> = (0..2).map(|n| id_of(k, n)).collect();
    for end in KEEP_NOTHING {
        let mut lease = fresh_hand_lease(&ctx.store, &key).await;
        assert_eq!(send(lease.outbox(), "receipts", 2), ids, "{end:?}");
        let ended = match end {
            End::Fail => answer(lease.finish::<(), _>(Err(TestError::Refused)).await),
            End::Release => {
                lease.release().await;
                Answer::Refused
            }
            End::Drop => {
                drop(lease);
                // The release runs in the background: wait for the database to show it.
                let c = &ctx;
                poll_db(
                    60,
                    "the background release of a dropped lease",
                    move || async move { c.marker(k).await.unlocked },
                )
                .await;
                Answer::Refused
            }
        };
        let m = ctx.marker(k).await;
        assert_eq!(
            (ended, outbox_rows(&ctx, k).await, m.completed, m.unlocked),
            (Answer::Refused, vec![], false, true),
            "{end:?}: (its end, the outbox rows, completed, released)"
        );
    }
    let mut lease = fresh_hand_lease(&ctx.store, &key).await;
    assert_eq!(send(lease.outbox(), "receipts", 2), ids);
    let token = lease.token();
    let before = outbox_rows(&ctx, k).await;
    let done = answer(lease.finish::<(), TestError>(Ok(())).await);
    let m = ctx.marker(k).await;
    assert_eq!(
        (
            before,
            done,
            outbox_rows(&ctx, k).await,
            m.completed,
            m.token
        ),
        (
            vec![],
            Answer::Applied,
            expected_rows(k, "receipts", 2),
            true,
            token
        ),
        "(rows before the finish, the finish, rows after it, completed, the marker's token)"
    );

    // Taken over meanwhile: the stale holder completes nothing and writes no message.
    let k = "charge-stale";
    let key = hand_key(k);
    let mut stale = fresh_hand_lease(&ctx.store, &key).await;
    assert_eq!(send(stale.outbox(), "stale", 2), [id_of(k, 0), id_of(k, 1)]);
    ctx.set_locked_until(k, &db_now_plus::<S>(-1000)).await;
    let mut taker = fresh_hand_lease(&ctx.store, &key).await;
    assert_eq!(send(taker.outbox(), "taker", 1), [id_of(k, 0)]);
    let tokens = (stale.token(), taker.token());
    let old = answer(stale.finish::<(), TestError>(Ok(())).await);
    let after_old = outbox_rows(&ctx, k).await;
    let new = answer(taker.finish::<(), TestError>(Ok(())).await);
    assert_eq!(
        (old, after_old, new, outbox_rows(&ctx, k).await),
        (
            Answer::LeaseLost,
            vec![],
            Answer::Applied,
            expected_rows(k, "taker", 1)
        ),
        "(the stale holder's finish, rows after it, the taker's finish, rows after it); \
         tokens {tokens:?}"
    );
    ctx.cleanup().await;
}

/// A lease handler with an outbox: two messages, then it parks on `hold` (the first body
/// only), then fails if told to; its value is its fencing token.
#[idem::idempotent(key = "job.key", scope = "orders.hand", lease = "30s", timeout = "20s")]
async fn charge_sending(
    lease: &Lease,
    job: &Job,
    outbox: &mut Outbox,
    hold: Option<&Hold>,
    fail: bool,
) -> Result<i64, TestError> {
    for n in 0..2_u32 {
        outbox.send("receipts", &("receipts", n))?;
    }
    if let Some(hold) = hold {
        hold.park_first().await;
    }
    if fail {
        return Err(TestError::Refused);
    }
    Ok(lease.token())
}

/// A lease handler's `outbox: &mut idem::Outbox`: its messages are written when its lease
/// completes, not when its body fails, not by a duplicate, and not when its lease was taken over
/// while it ran (that call gets `LeaseError::Lost`; the new holder's messages are written).
pub(crate) async fn outbox_of_a_lease_handler_is_written_only_when_its_lease_completes<
    S: Support,
>() {
    let ctx = Ctx::<S>::new("hand_leasehandler", 3).await;
    let job = ctx.job("charge-attr", 1, 10);
    let failed = answer(charge_sending(&ctx.store, &job, None, true).await);
    let after_failure = outbox_rows(&ctx, &job.key).await;
    let done = charge_sending(&ctx.store, &job, None, false).await;
    let token = match &done {
        Ok(Outcome::Applied(token)) => *token,
        _ => 0,
    };
    let after_done = outbox_rows(&ctx, &job.key).await;
    let again = answer(charge_sending(&ctx.store, &job, None, false).await);
    let m = ctx.marker(&job.key).await;
    assert_eq!(
        (
            failed,
            after_failure,
            answer(done),
            after_done,
            again,
            outbox_rows(&ctx, &job.key).await,
            m.completed && m.token == token
        ),
        (
            Answer::Refused,
            vec![],
            Answer::Applied,
            expected_rows(&job.key, "receipts", 2),
            Answer::Duplicate,
            expected_rows(&job.key, "receipts", 2),
            true
        ),
        "(a failed call, rows, a call that completes, rows, a duplicate, rows, completed with \
         its token)"
    );

    // Taken over while the body is parked: the call's messages are not written.
    let job = ctx.job("charge-attr-stale", 2, 20);
    let key = hand_key(&job.key);
    let hold = Hold::default();
    let call = charge_sending(&ctx.store, &job, Some(&hold), false);
    let takeover = async {
        hold.entered().await;
        ctx.set_locked_until(&job.key, &db_now_plus::<S>(-1000))
            .await;
        let mut taker = fresh_hand_lease(&ctx.store, &key).await;
        send(taker.outbox(), "taker", 1);
        hold.release();
        taker
    };
    let (stale, taker) = within(60, "a call taken over while parked", async {
        tokio::join!(call, takeover)
    })
    .await;
    let stale = answer(stale);
    let after_stale = outbox_rows(&ctx, &job.key).await;
    let new = answer(taker.finish::<(), TestError>(Ok(())).await);
    assert_eq!(
        (stale, after_stale, new, outbox_rows(&ctx, &job.key).await),
        (
            Answer::LeaseLost,
            vec![],
            Answer::Applied,
            expected_rows(&job.key, "taker", 1)
        ),
        "(the call taken over, rows after it, the taker's finish, rows after it)"
    );
    ctx.cleanup().await;
}
