//! Claims held by hand (`Guard`, `JoinedGuard`, `BatchGuard`, `Lease`) go through the same
//! finish as the attribute's: their outbox is written exactly when the work is kept, a body
//! run with `Body::run` refuses a claim with a store inside it (and only inside it: claims
//! side by side in one task are not nested), and a lease claim behind a transaction holding
//! the key waits only with `wait`.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Poll;
use std::time::Duration;

use idem::{Claimed, Error, Guard, JoinedGuard, Key, Lease, LeaseOptions, Outbox, Outcome, Store};
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
        Error::LeaseLost { .. } => Answer::LeaseLost,
        Error::LeaseHeld { scope, key } => Answer::LeaseHeld { scope, key },
        Error::Nested { inner, outer } => Answer::Nested { inner, outer },
        other => Answer::Other(format!("{other:?}")),
    }
}

/// The answer of a call or a finish.
pub(super) fn answer<T: std::fmt::Debug>(result: Result<Outcome<T>, TestError>) -> Answer {
    match result {
        Ok(Outcome::Applied(_)) => Answer::Applied,
        Ok(Outcome::Duplicate | Outcome::Replayed(_)) => Answer::Duplicate,
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

async fn fresh_joined<'a, DB: TestDb>(
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
            matches!(duplicate, Err(Error::InvalidMessage { .. })),
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
/// or a drop; written when `finish(Ok)` completes the lease (not before); and none from a
/// holder whose lease was taken over meanwhile, which gets `LeaseLost`, while the new holder's
/// are written.
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
/// completes, not when its body fails, not by a duplicate, and not when its lease was taken
/// over while it ran (that call gets `LeaseLost`; the new holder's messages are written).
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
/// `Error::Nested` naming the caller and the holder, before any I/O: on a store whose pool is
/// closed too (else `PoolClosed`), and on a live one nothing is written; a claim on
/// `store.join(tx)` of the holder's transaction applies with it. Outside the body (the guard
/// still open) a claim is not marked.
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
