//! Each of idem's error kinds as its own outcome: in the span, the call's one event and the
//! counter's label.

use super::*;

/// A job with a payload, for the fingerprinted and lease-mode handlers below.
struct Payload {
    id: i64,
    body: String,
}

#[idem::idempotent(
    key = "job.id",
    scope = "obs.lite.key_reused",
    fingerprint = "job.body"
)]
async fn lite_fingerprinted(tx: &mut Transaction<'_, Sqlite>, job: &Payload) -> Result<(), Error> {
    sqlx::query("INSERT INTO effects (id) VALUES (?)")
        .bind(job.id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Never finishes: its timeout ends it.
#[idem::idempotent(
    key = "job.id",
    scope = "obs.lite.timeout",
    lease = "1s",
    timeout = "50ms"
)]
async fn lite_stalls(_lease: &idem::Lease, job: &Payload) -> Result<(), Error> {
    let _ = &job.body;
    std::future::pending().await
}

/// Forgets its own marker, as an operator forcing it might while it runs: its result is not
/// recorded.
#[idem::idempotent(key = "job.id", scope = "obs.lite.lease_lost", lease = "30s")]
async fn lite_forgotten(
    lease: &idem::Lease,
    job: &Payload,
    store: &Store<Sqlite>,
) -> Result<(), Error> {
    let key = Key::new(&job.id)?;
    assert!(store.forget_forced("obs.lite.lease_lost", &key).await?);
    assert_eq!(lease.key(), key.as_str());
    Ok(())
}

/// Returns a value too long to store for `replay`.
#[idem::idempotent(
    key = "job.id",
    scope = "obs.lite.value_not_stored",
    lease = "30s",
    replay
)]
async fn lite_too_long(_lease: &idem::Lease, job: &Payload) -> Result<String, Error> {
    Ok(job.body.repeat(idem::MAX_REPLAY_LEN + 1))
}

/// The span's `outcome`, the counter's label and the call's event for one failed call, which
/// must be the only call of `scope`: the label is the kind's own, the text is idem's, once, at
/// WARN.
fn one_failure(seen: &capture::Seen, scope: &str, mode: &str, key: &Key, label: &str, err: &Error) {
    let [(id, span)] = &seen.claims()[..] else {
        panic!("one span: {:?}", seen.claims())
    };
    let (fields, _) = split(span);
    assert_eq!(fields, expect(scope, key, mode, label, 0));
    let text = err.to_string();
    assert_eq!(
        finished(seen, *id),
        (Level::WARN, ended(label, Some(&text)))
    );
    let warnings = seen
        .idem_events(*id)
        .into_iter()
        .filter(|e| e.level == Level::WARN)
        .count();
    assert_eq!(warnings, 1, "the error's text is logged once");
    let by_label = metrics().counters_with(idem::OUTCOMES_TOTAL, ("scope", scope));
    assert_eq!(
        by_label.into_values().collect::<Vec<_>>(),
        [1],
        "one outcome of {scope}"
    );
    assert_eq!(outcomes(scope, label), 1);
}

#[tokio::test]
async fn key_reused_has_its_own_outcome() {
    const SCOPE: &str = "obs.lite.key_reused";
    metrics();
    let (store, pool) = lite().await;
    let job = Payload {
        id: 41,
        body: "first".into(),
    };
    assert_eq!(
        lite_fingerprinted(&store, &job).await.unwrap(),
        Outcome::Applied(())
    );
    let (seen, _guard) = subscribe();
    let other = Payload {
        id: 41,
        body: "second".into(),
    };

    let err = lite_fingerprinted(&store, &other).await.unwrap_err();
    assert!(matches!(err, Error::KeyReused { .. }), "{err}");
    assert_eq!(count(&pool, "effects", 41).await, 1);
    // The first call was counted before the subscriber: one `applied`, one `key_reused`.
    let [(id, span)] = &seen.claims()[..] else {
        panic!("one span")
    };
    let (fields, _) = split(span);
    assert_eq!(
        fields,
        expect(
            SCOPE,
            &Key::new(&41).unwrap(),
            "transaction",
            "key_reused",
            0
        )
    );
    let text = "the key \"41\" of \"obs.lite.key_reused\" was already used for another payload: \
                nothing ran; this is a different job under a reused id, so give it its own key \
                (do not retry it)";
    assert_eq!(err.to_string(), text);
    assert_eq!(
        finished(&seen, *id),
        (Level::WARN, ended("key_reused", Some(text)))
    );
    assert_eq!(outcomes(SCOPE, "key_reused"), 1);
    assert_eq!(outcomes(SCOPE, "applied"), 1);
    assert_eq!(outcomes(SCOPE, "error"), 0);
}

#[tokio::test]
async fn timeout_has_its_own_outcome() {
    const SCOPE: &str = "obs.lite.timeout";
    metrics();
    let (seen, _guard) = subscribe();
    let (store, _pool) = lite().await;
    let job = Payload {
        id: 42,
        body: String::new(),
    };

    let err = lite_stalls(&store, &job).await.unwrap_err();
    assert!(
        matches!(err, Error::Lease(LeaseError::Timeout { .. })),
        "{err}"
    );
    one_failure(
        &seen,
        SCOPE,
        "lease",
        &Key::new(&42).unwrap(),
        "timeout",
        &err,
    );
}

#[tokio::test]
async fn lease_lost_has_its_own_outcome() {
    const SCOPE: &str = "obs.lite.lease_lost";
    metrics();
    let (seen, _guard) = subscribe();
    let (store, _pool) = lite().await;
    let job = Payload {
        id: 43,
        body: String::new(),
    };

    let err = lite_forgotten(&store, &job, &store).await.unwrap_err();
    assert!(
        matches!(err, Error::Lease(LeaseError::Lost { .. })),
        "{err}"
    );
    one_failure(
        &seen,
        SCOPE,
        "lease",
        &Key::new(&43).unwrap(),
        "lease_lost",
        &err,
    );
}

#[tokio::test]
async fn value_not_stored_has_its_own_outcome() {
    const SCOPE: &str = "obs.lite.value_not_stored";
    metrics();
    let (seen, _guard) = subscribe();
    let (store, _pool) = lite().await;
    let job = Payload {
        id: 44,
        body: "x".into(),
    };

    let err = lite_too_long(&store, &job).await.unwrap_err();
    assert!(matches!(err, Error::ValueNotStored { .. }), "{err}");
    one_failure(
        &seen,
        SCOPE,
        "lease",
        &Key::new(&44).unwrap(),
        "value_not_stored",
        &err,
    );
    // The marker completed without a value: the next delivery is a plain duplicate.
    assert_eq!(
        lite_too_long(&store, &job).await.unwrap(),
        Outcome::Duplicate
    );
}
