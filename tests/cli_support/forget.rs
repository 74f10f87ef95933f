//! `idem forget` of a marker whose lease a delivery still holds: refused (exit 5, nothing
//! deleted) unless `--force`.

use idem::{Key, Marker, MarkerState};
use serde_json::json;

use crate::Db;
use crate::cli_support::Fixture;

/// What of a marker `forget` must leave as it was (not the lease's time left, which shrinks).
fn held(
    m: &Marker,
) -> (
    String,
    String,
    i64,
    Option<i64>,
    Option<String>,
    Option<String>,
) {
    let state = format!("{:?}", m.state);
    let Marker {
        key,
        attempts,
        token,
        locked_until,
        completed_at,
        ..
    } = m;
    (
        key.clone(),
        state,
        *attempts,
        *token,
        locked_until.clone(),
        completed_at.clone(),
    )
}

pub(crate) async fn forget_of_a_live_lease_exits_5_unless_forced<B: Db>() {
    let fx = Fixture::<B>::new("forgetheld").await;
    let (scope, k) = ("billing.charge", "charge-live");
    let holder = fx.lease(scope, k, 300).await;
    let before = fx.store.inspect(scope, k).await.unwrap().expect("marker");
    let refusal = format!(
        "error: {}; nothing was changed\n",
        idem::Error::Lease(idem::LeaseError::Held {
            scope: scope.to_owned(),
            key: k.to_owned()
        })
    );

    for args in [
        &["forget", scope, k][..],
        &["--json", "forget", scope, k][..],
    ] {
        let out = fx.idem(args).await;
        assert_eq!(
            (out.code, out.stdout.as_str(), out.stderr.as_str()),
            (Some(5), "", refusal.as_str()),
            "{args:?}"
        );
        assert!(out.stderr.contains("idem forget --force"), "{out:?}");
        let after = fx.store.inspect(scope, k).await.unwrap().expect("marker");
        assert_eq!(held(&after), held(&before), "{args:?}: the marker changed");
        assert_eq!(fx.markers().await, 1, "{args:?}");
    }

    let out = fx.idem(&["forget", "--force", scope, k]).await.ok();
    assert_eq!(
        out.stdout,
        "forgot scope \"billing.charge\", key \"charge-live\": its next delivery runs again\n"
    );
    // Let go of, not deleted: unlocked, its token up, so that the old holder is fenced out.
    let forced = fx.store.inspect(scope, k).await.unwrap().expect("marker");
    assert_eq!(
        (
            forced.state,
            forced.locked_until.as_deref(),
            forced.token > before.token
        ),
        (MarkerState::InProgress, None, true),
        "(state, locked_until, token above the holder's) after --force: {forced:?}"
    );
    match holder.finish::<(), idem::Error>(Ok(())).await {
        Err(idem::Error::Lease(idem::LeaseError::Lost { .. })) => {}
        other => panic!("the forgotten holder's finish: expected LeaseError::Lost, got {other:?}"),
    }
    let next = fx.lease(scope, k, 300).await;
    assert_eq!(
        (next.attempt(), Some(next.token()) > forced.token),
        (2, true),
        "the next delivery's (attempt, token above the forgotten marker's)"
    );
    next.release().await;

    // `--force` of an absent marker, and of a live one in JSON.
    let out = fx
        .idem(&["--json", "forget", "--force", scope, "charge-none"])
        .await
        .ok();
    assert_eq!(out.json()["forgotten"], json!(false));
    let _live = fx.lease(scope, "charge-json", 300).await;
    let out = fx
        .idem(&["--json", "forget", "--force", scope, "charge-json"])
        .await
        .ok();
    assert_eq!(
        out.json(),
        json!({"table": fx.table(), "scope": scope, "key": "charge-json", "forgotten": true})
    );

    // A lease that ran out needs no `--force`.
    let _old = fx.lease(scope, "charge-old", 300).await;
    fx.expire(scope, "charge-old").await;
    fx.idem(&["forget", scope, "charge-old"]).await.ok();
    let old = fx
        .store
        .inspect(scope, &Key::new("charge-old").unwrap())
        .await
        .unwrap()
        .expect("marker");
    assert_eq!(
        (old.state, old.locked_until),
        (MarkerState::InProgress, None)
    );
    fx.cleanup().await;
}
