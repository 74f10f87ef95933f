//! What operators read: `Store::inspect` and `Store::list_in_progress`, checked against the
//! markers the two modes write.

use std::time::Duration;

use idem::{Claimed, Error, Key, LeaseOptions, MarkerState, Refusal};

use crate::conformance::Support;
use crate::conformance::ctx::Ctx;
use crate::conformance::handlers::*;

pub(crate) async fn inspect_shows_each_marker_and_the_leases_in_progress<S: Support>() {
    let ctx = Ctx::<S>::new("inspect", 2).await;
    // Transaction mode: completed at the commit, no lease.
    let job = ctx.job("job-inspect", 31, 310);
    assert_eq!(applied(apply(&ctx.store, &job, Then::Commit).await), 310);
    let done = ctx
        .store
        .inspect("apply", &job.key)
        .await
        .expect("inspect")
        .expect("a marker");
    assert_eq!(
        (
            done.scope.as_str(),
            done.key.as_str(),
            done.state,
            done.attempts
        ),
        ("apply", "job-inspect", MarkerState::Completed, 1)
    );
    assert_eq!(
        (done.token, &done.locked_until, done.lease_ms_left),
        (None, &None, None)
    );
    let completed = done.completed_at.expect("completed_at");
    for time in [&done.created_at, &completed] {
        assert!(
            time.len() >= 20 && time.ends_with('Z') && time.contains('T'),
            "{time}"
        );
    }

    // Lease mode, held: in progress with its token and the time left on the database's clock.
    let key = Key::new("order-inspect").expect("a key");
    let options = LeaseOptions::new(Duration::from_secs(30));
    let Claimed::Fresh(lease) = ctx
        .store
        .lease("billing.inspect", &key, options)
        .await
        .expect("lease")
    else {
        panic!("a fresh key was not fresh")
    };
    let held = ctx
        .store
        .inspect("billing.inspect", &key)
        .await
        .expect("inspect")
        .expect("a marker");
    assert_eq!(
        (held.state, held.token, held.attempts),
        (MarkerState::InProgress, Some(lease.token()), 1)
    );
    assert!(
        held.locked_until.is_some() && held.completed_at.is_none(),
        "{held:?}"
    );
    let left = held.lease_ms_left.expect("a live lease has time left");
    assert!(left > 0 && left <= 30_000, "{left} ms left of a 30 s lease");
    let stuck = ctx
        .store
        .list_in_progress("billing.inspect", 10)
        .await
        .expect("list");
    // The same marker (its time left moves on between two reads).
    let [listed] = &stuck[..] else {
        panic!("one lease in progress: {stuck:?}")
    };
    assert_eq!(
        (
            &listed.key,
            listed.token,
            &listed.locked_until,
            &listed.created_at
        ),
        (&held.key, held.token, &held.locked_until, &held.created_at)
    );
    assert!(
        ctx.store
            .list_in_progress("apply", 10)
            .await
            .expect("list")
            .is_empty()
    );
    // Across scopes: the same lease, the completed marker of "apply" left out.
    let all = ctx.store.list_all_in_progress(10).await.expect("list all");
    assert_eq!(
        all.iter()
            .map(|m| (m.scope.as_str(), m.key.as_str(), m.token))
            .collect::<Vec<_>>(),
        [("billing.inspect", held.key.as_str(), held.token)]
    );

    // Completed: no longer in progress.
    let token = lease.token();
    let outcome = lease.finish::<(), Error>(Ok(())).await.expect("finish");
    assert_eq!(outcome, idem::Outcome::Applied(()));
    let finished = ctx
        .store
        .inspect("billing.inspect", &key)
        .await
        .expect("inspect")
        .expect("a marker");
    assert_eq!(
        (finished.state, finished.token),
        (MarkerState::Completed, Some(token))
    );
    assert_eq!(finished.lease_ms_left, None);
    assert!(
        ctx.store
            .list_all_in_progress(10)
            .await
            .expect("list all")
            .is_empty()
    );
    assert!(
        ctx.store
            .list_in_progress("billing.inspect", 10)
            .await
            .expect("list")
            .is_empty()
    );

    // Nothing there, and a scope the store refuses before any I/O.
    assert_eq!(
        ctx.store
            .inspect("apply", "job-unknown")
            .await
            .expect("inspect"),
        None
    );
    assert!(matches!(
        ctx.store.inspect("", "job-inspect").await,
        Err(Error::Refused(Refusal::Scope { .. }))
    ));
    assert!(matches!(
        ctx.store.list_in_progress(&"s".repeat(256), 1).await,
        Err(Error::Refused(Refusal::Scope { .. }))
    ));
    ctx.cleanup().await;
}
