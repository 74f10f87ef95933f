//! Retention per scope (schema version 3): each scope's window, kept in the database, decides
//! what `purge` deletes of that scope, whatever age `purge` is given for the others.

use std::time::Duration;

use idem::{Claimed, Error, Key, Outcome, Refusal, Retention};

use crate::conformance::Support;
use crate::conformance::ctx::Ctx;

const HOUR: Duration = Duration::from_secs(3600);

/// A completed marker of `(scope, key)`, claimed and committed by hand.
async fn complete<S: Support>(ctx: &Ctx<S>, scope: &str, key: &str) {
    let key = Key::new(key).expect("a valid key");
    match ctx.store.claim(scope, &key).await.expect("claim") {
        Claimed::Fresh(guard) => {
            let done = guard.finish(Ok::<(), Error>(())).await;
            assert_eq!(done.expect("commit"), Outcome::Applied(()));
        }
        other => panic!("{scope} / {key} was claimed before: {other:?}"),
    }
}

/// Whether a delivery of `(scope, key)` now would run: its marker was purged.
async fn runs_again<S: Support>(ctx: &Ctx<S>, scope: &str, key: &str) -> bool {
    let key = Key::new(key).expect("a valid key");
    match ctx.store.claim(scope, &key).await.expect("claim") {
        Claimed::Fresh(guard) => {
            guard.release().await;
            true
        }
        Claimed::Duplicate | Claimed::Replayed(_) | Claimed::Failed(_) => false,
    }
}

pub(crate) async fn retention_per_scope_decides_what_purge_deletes<S: Support>() {
    let ctx = Ctx::<S>::new("retention", 2).await;
    let store = &ctx.store;
    // A window longer than the purge's age, one shorter, and a scope with none.
    store.set_retention("payments", 3 * HOUR).await.unwrap();
    store.set_retention("webhooks", 2 * HOUR).await.unwrap();
    store.set_retention("webhooks", HOUR).await.unwrap(); // set again: changed
    assert_eq!(
        windows(&ctx).await,
        [
            ("payments".to_owned(), 3 * HOUR),
            ("webhooks".to_owned(), HOUR)
        ]
    );
    for scope in ["payments", "webhooks", "other"] {
        complete(&ctx, scope, "old").await;
        complete(&ctx, scope, "new").await;
    }
    ctx.exec(&format!(
        "UPDATE {} SET completed_at = {} WHERE {} = 'old'",
        store.table(),
        S::TWO_HOURS_AGO,
        S::KEY_TEXT
    ))
    .await;

    // An age of 4 h for the rest: nothing is that old, but the webhooks' hour applies.
    assert_eq!(store.purge(4 * HOUR).await.unwrap(), 1);
    assert!(runs_again(&ctx, "webhooks", "old").await);
    // The windows alone: nothing left past one.
    assert_eq!(store.purge_by_retention().await.unwrap(), 0);
    // 30 min for the rest: `other`'s old marker goes, the payment's stays (3 h window).
    assert_eq!(store.purge(HOUR / 2).await.unwrap(), 1);
    assert!(runs_again(&ctx, "other", "old").await);
    assert!(!runs_again(&ctx, "payments", "old").await);
    // Without its window, the payment's old marker goes by the purge's age.
    assert!(store.clear_retention("payments").await.unwrap());
    assert!(!store.clear_retention("payments").await.unwrap());
    assert_eq!(store.purge(HOUR / 2).await.unwrap(), 1);
    assert!(runs_again(&ctx, "payments", "old").await);
    // Young markers stop their jobs in every scope.
    for scope in ["payments", "webhooks", "other"] {
        assert!(!runs_again(&ctx, scope, "new").await, "{scope}");
    }
    assert_eq!(ctx.markers().await, 3);
    ctx.cleanup().await;
}

pub(crate) async fn retention_refuses_bad_windows_before_any_io<S: Support>() {
    let ctx = Ctx::<S>::new("retention_bad", 2).await;
    let store = &ctx.store;
    for bad in [
        Duration::ZERO,
        Duration::from_millis(999),
        Duration::from_secs(100 * 366 * 24 * 3600),
        Duration::MAX,
    ] {
        match store.set_retention("payments", bad).await {
            Err(e @ Error::Refused(Refusal::Retention { .. })) => {
                assert!(e.to_string().contains("nothing was written"), "{e}");
                assert!(!e.is_transient(), "{e}");
            }
            other => panic!("{bad:?}: {other:?}"),
        }
    }
    assert!(matches!(
        store.set_retention("", HOUR).await,
        Err(Error::Refused(Refusal::Scope { .. }))
    ));
    assert!(matches!(
        store.clear_retention("a\0b").await,
        Err(Error::Refused(Refusal::Scope { .. }))
    ));
    assert_eq!(windows(&ctx).await, []);
    ctx.cleanup().await;
}

async fn windows<S: Support>(ctx: &Ctx<S>) -> Vec<(String, Duration)> {
    let all: Vec<Retention> = ctx.store.retentions().await.expect("retentions");
    all.into_iter().map(|r| (r.scope, r.keep)).collect()
}
