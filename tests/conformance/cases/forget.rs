//! `Store::forget` and `Store::forget_forced` against leases, and the fencing tokens that keep
//! an old holder out: a live lease is not forgotten unless forced; a completed marker is
//! deleted, one in progress and not held (or forced) is let go of with its token up; the next
//! holder's token is larger, and the old holder can neither complete, renew nor release the
//! new lease.

use idem::Error;

use super::by_hand::{
    Answer, HAND, answer, claimed, fresh_guard, fresh_hand_lease, hand_key, idem_answer,
    thirty_seconds,
};
use super::lease::db_now_plus;
use crate::conformance::Support;
use crate::conformance::ctx::Ctx;
use crate::conformance::db::Bind;
use crate::conformance::handlers::TestError;

/// What `forget` or `forget_forced` answered.
fn forgot(result: Result<bool, Error>) -> Result<bool, Answer> {
    result.map_err(idem_answer)
}

impl<S: Support> Ctx<S> {
    /// Markers of `(HAND, key)`.
    async fn markers_of(&self, key: &str) -> i64 {
        let sql = format!(
            "SELECT COUNT(*) FROM {} WHERE {} = $1",
            self.store.table(),
            S::KEY_TEXT
        );
        self.scalar_with(&sql, &[Bind::Str(key.to_owned())]).await
    }
}

/// `forget` of a marker whose lease a delivery still holds is `LeaseError::Held` (naming it), and
/// deletes nothing: the marker is as it was, other deliveries are still `InProgress`, and the
/// holder completes. Once completed, the marker is forgotten, and the next lease of the key is
/// fresh again, with a larger token.
pub(crate) async fn forget_refuses_a_live_lease_and_its_holder_still_completes<S: Support>() {
    let ctx = Ctx::<S>::new("forget_live", 3).await;
    let k = "charge-live";
    let key = hand_key(k);
    let holder = fresh_hand_lease(&ctx.store, &key).await;
    let before = ctx.marker(k).await;
    let refused = forgot(ctx.store.forget(HAND, k).await);
    let after = ctx.marker(k).await;
    let meanwhile = claimed(ctx.store.lease(HAND, &key, thirty_seconds()).await);
    let token = holder.token();
    let done = answer(holder.finish::<(), TestError>(Ok(())).await);
    let completed = ctx.marker(k).await;
    assert_eq!(
        (
            refused,
            after == before && after.live,
            meanwhile,
            done,
            completed.completed && completed.token == token
        ),
        (
            Err(Answer::LeaseHeld {
                scope: HAND.to_owned(),
                key: k.to_owned()
            }),
            true,
            Answer::InProgress,
            Answer::Applied,
            true
        ),
        "(forget of the live lease, the marker unchanged and live, another delivery, the \
         holder's finish, completed by the holder); before {before:?}, after {after:?}"
    );
    let gone = forgot(ctx.store.forget(HAND, k).await);
    let count = ctx.markers_of(k).await;
    let again = forgot(ctx.store.forget(HAND, k).await);
    let next = fresh_hand_lease(&ctx.store, &key).await;
    assert_eq!(
        (gone, count, again, next.attempt(), next.token() > token),
        (Ok(true), 0, Ok(false), 1, true),
        "(forget of the completed marker, markers left, forget again, the next lease's attempt, \
         its token above the forgotten holder's {token}: {})",
        next.token()
    );
    next.release().await;
    ctx.cleanup().await;
}

/// `forget` of a marker no delivery holds is `Ok(true)`: a completed one (by a lease, by a
/// transaction) is deleted, and the next delivery runs the job again; one in progress whose
/// lease was let go (the body's error, `release()`) or ran out is let go of instead: still there,
/// unlocked, its token up, so that its old holder is fenced out at once (`LeaseError::Lost`) and
/// the next delivery takes it over as its next attempt, with a larger token still.
pub(crate) async fn forget_deletes_a_completed_marker_and_lets_go_of_a_free_lease<S: Support>() {
    let ctx = Ctx::<S>::new("forget_free", 3).await;

    let lease = fresh_hand_lease(&ctx.store, &hand_key("lease-completed")).await;
    assert_eq!(
        answer(lease.finish::<(), TestError>(Ok(())).await),
        Answer::Applied
    );
    let guard = fresh_guard(&ctx.store, &hand_key("tx-completed")).await;
    assert_eq!(
        answer(guard.finish::<(), TestError>(Ok(())).await),
        Answer::Applied
    );
    let mut tokens = Vec::new();
    let lease = fresh_hand_lease(&ctx.store, &hand_key("lease-failed")).await;
    tokens.push(lease.token());
    assert_eq!(
        answer(lease.finish::<(), TestError>(Err(TestError::Refused)).await),
        Answer::Refused
    );
    let lease = fresh_hand_lease(&ctx.store, &hand_key("lease-released")).await;
    tokens.push(lease.token());
    lease.release().await;
    let expired = fresh_hand_lease(&ctx.store, &hand_key("lease-expired")).await;
    tokens.push(expired.token());
    ctx.set_locked_until("lease-expired", &db_now_plus::<S>(-1000))
        .await;

    // Completed: deleted, and the job runs again.
    let mut answers = Vec::new();
    for k in ["lease-completed", "tx-completed"] {
        let gone = forgot(ctx.store.forget(HAND, k).await);
        let left = ctx.markers_of(k).await;
        let guard = fresh_guard(&ctx.store, &hand_key(k)).await;
        let next = answer(guard.finish::<(), TestError>(Ok(())).await);
        answers.push((k, gone, left, next));
    }
    assert_eq!(
        answers,
        [
            ("lease-completed", Ok(true), 0, Answer::Applied),
            ("tx-completed", Ok(true), 0, Answer::Applied)
        ],
        "(key, forget, markers of the key left, the next delivery)"
    );

    // In progress, not held: let go of, the old holder fenced out, taken over by the next.
    let forgotten = forgot(ctx.store.forget(HAND, "lease-expired").await);
    let old = answer(expired.finish::<(), TestError>(Ok(())).await);
    assert_eq!(
        (forgotten, old),
        (Ok(true), Answer::LeaseLost),
        "(forget of the expired lease, its old holder's finish right after)"
    );
    let mut answers = Vec::new();
    for (k, old) in ["lease-failed", "lease-released", "lease-expired"]
        .into_iter()
        .zip(tokens)
    {
        let gone = match k {
            "lease-expired" => Ok(true),
            _ => forgot(ctx.store.forget(HAND, k).await),
        };
        let m = ctx.marker(k).await;
        let next = fresh_hand_lease(&ctx.store, &hand_key(k)).await;
        let (attempt, token) = (next.attempt(), next.token());
        let done = answer(next.finish::<(), TestError>(Ok(())).await);
        answers.push((
            k,
            gone,
            (m.completed, m.unlocked, m.token > old, m.attempts),
            (attempt, token > m.token),
            done,
        ));
    }
    let want: Vec<_> = ["lease-failed", "lease-released", "lease-expired"]
        .into_iter()
        .map(|k| {
            (
                k,
                Ok(true),
                (false, true, true, 1),
                (2, true),
                Answer::Applied,
            )
        })
        .collect();
    assert_eq!(
        answers, want,
        "(key, forget, the marker after it (completed, unlocked, token above the old holder's, \
         attempts), the next lease (attempt, token above the marker's), its finish)"
    );
    assert_eq!(ctx.markers().await, 5);
    ctx.cleanup().await;
}

/// Rounds of a forced forget under a live holder.
const FORCED_ROUNDS: usize = 6;

/// `forget_forced` of a live lease is `Ok(true)` and lets the lease go (unlocked, token up); the
/// old holder's `renew` and `finish(Ok)` are `LeaseError::Lost` at once, and, once the next
/// delivery has taken the key over (its next attempt, a larger token than the old holder's), the
/// old holder's `finish(Ok)` is `LeaseError::Lost` and its `release` does not free the new lease (a
/// third delivery is still `InProgress`); the next holder completes.
pub(crate) async fn forced_forget_of_a_live_lease_fences_out_the_old_holder<S: Support>() {
    let ctx = Ctx::<S>::new("forget_forced", 3).await;

    // No one takes the key after the forced forget.
    let k = "charge-forced-alone";
    let old = fresh_hand_lease(&ctx.store, &hand_key(k)).await;
    let token = old.token();
    let forced = forgot(ctx.store.forget_forced(HAND, k).await);
    let m = ctx.marker(k).await;
    let renewed = old.renew().await.map_err(idem_answer);
    let finished = answer(old.finish::<(), TestError>(Ok(())).await);
    let after = ctx.marker(k).await;
    assert_eq!(
        (
            forced,
            (m.completed, m.unlocked, m.token > token),
            renewed,
            finished,
            after == m
        ),
        (
            Ok(true),
            (false, true, true),
            Err(Answer::LeaseLost),
            Answer::LeaseLost,
            true
        ),
        "(forced forget, the marker after it (completed, unlocked, token above the holder's), \
         the old holder's renew, its finish, the marker unchanged by them); {m:?}, {after:?}"
    );

    for round in 0..FORCED_ROUNDS {
        let k = format!("charge-forced-{round}");
        let key = hand_key(&k);
        let old = fresh_hand_lease(&ctx.store, &key).await;
        let forced = forgot(ctx.store.forget_forced(HAND, &k).await);
        let new = fresh_hand_lease(&ctx.store, &key).await;
        let (tokens, attempt) = ((old.token(), new.token()), new.attempt());
        let renewed = old.renew().await.map_err(idem_answer);
        // Even rounds: the old holder's work finished; odd rounds: it gives up.
        let (ended, old_end) = if round % 2 == 0 {
            let ended = answer(old.finish::<(), TestError>(Ok(())).await);
            (ended, Answer::LeaseLost)
        } else {
            old.release().await;
            (Answer::Refused, Answer::Refused)
        };
        let m = ctx.marker(&k).await;
        let third = claimed(ctx.store.lease(HAND, &key, thirty_seconds()).await);
        let done = answer(new.finish::<(), TestError>(Ok(())).await);
        let end = ctx.marker(&k).await;
        assert_eq!(
            (
                forced,
                attempt,
                tokens.1 > tokens.0,
                renewed,
                ended,
                (m.completed, m.live, m.token == tokens.1),
                third,
                done,
                (end.completed, end.token == tokens.1)
            ),
            (
                Ok(true),
                2,
                true,
                Err(Answer::LeaseLost),
                old_end,
                (false, true, true),
                Answer::InProgress,
                Answer::Applied,
                (true, true)
            ),
            "round {round}: (forced forget, the next holder's attempt, its token above the old \
             one's, the old holder's renew, its end, the marker after it (completed, live, the \
             next holder's token), a third delivery, the next holder's finish, the marker at \
             the end (completed, the next holder's token)); tokens (old, next) {tokens:?}, the \
             marker after the old holder's end {m:?}"
        );
    }
    ctx.cleanup().await;
}
