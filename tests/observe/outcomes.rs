//! Each outcome of a transaction-mode, joined and lease-mode call on SQLite: its span, its
//! events and its metrics.

use super::*;

#[tokio::test]
async fn applied_then_duplicate() {
    const SCOPE: &str = "obs.lite.applied";
    metrics();
    let (seen, _guard) = subscribe();
    let (store, pool) = lite().await;
    let job = Job::new(7, "effects");

    assert_eq!(
        lite_applied(&store, &job).await.unwrap(),
        Outcome::Applied(7)
    );
    assert_eq!(
        lite_applied(&store, &job).await.unwrap(),
        Outcome::Duplicate
    );
    assert_eq!(count(&pool, "effects", 7).await, 1);

    let claims = seen.claims();
    assert_eq!(claims.len(), 2, "one span per call, the duplicate's too");
    let key = job.key();
    for ((id, span), (outcome, decision)) in claims
        .iter()
        .zip([("applied", "fresh"), ("duplicate", "duplicate")])
    {
        let (fields, _) = split(span);
        assert_eq!(fields, expect(SCOPE, &key, "transaction", outcome, 0));
        assert_eq!(span.parent, None);
        assert_eq!(decisions(&seen, *id), [decision]);
        // The routine outcomes end at DEBUG: a healthy worker logs nothing per job at INFO.
        assert_eq!(finished(&seen, *id), (Level::DEBUG, ended(outcome, None)));
    }
    assert_eq!(outcomes(SCOPE, "applied"), 1);
    assert_eq!(outcomes(SCOPE, "duplicate"), 1);
    let by_label = metrics().counters_with(idem::OUTCOMES_TOTAL, ("scope", SCOPE));
    assert_eq!(
        by_label.len(),
        2,
        "no other outcome of {SCOPE}: {by_label:?}"
    );
    assert_eq!(claim_samples(SCOPE).len(), 2, "a claim latency per call");
}

#[idem::idempotent(key = "job.id", scope = "obs.lite.unobserved")]
async fn lite_unobserved(tx: &mut Transaction<'_, Sqlite>, job: &Job) -> Result<i64, sqlx::Error> {
    lite_effect(tx, job).await
}

/// Metrics do not depend on a subscriber: with none, the span is disabled and the counts go on.
#[tokio::test]
async fn metrics_without_a_subscriber() {
    const SCOPE: &str = "obs.lite.unobserved";
    metrics();
    let (store, pool) = lite().await;
    let job = Job::new(14, "effects");
    assert!(tracing::Span::current().is_disabled());

    assert_eq!(
        lite_unobserved(&store, &job).await.unwrap(),
        Outcome::Applied(14)
    );
    assert_eq!(
        lite_unobserved(&store, &job).await.unwrap(),
        Outcome::Duplicate
    );
    assert_eq!(count(&pool, "effects", 14).await, 1);
    assert_eq!(outcomes(SCOPE, "applied"), 1);
    assert_eq!(outcomes(SCOPE, "duplicate"), 1);
    assert_eq!(claim_samples(SCOPE).len(), 2);
}

#[tokio::test]
async fn replayed() {
    const SCOPE: &str = "obs.lite.replayed";
    metrics();
    let (seen, _guard) = subscribe();
    let (store, pool) = lite().await;
    let job = Job::new(8, "effects");

    assert_eq!(
        lite_replayed(&store, &job).await.unwrap(),
        Outcome::Applied(8)
    );
    assert_eq!(
        lite_replayed(&store, &job).await.unwrap(),
        Outcome::Replayed(8)
    );
    assert_eq!(count(&pool, "effects", 8).await, 1);

    let (id, span) = seen.claims().pop().unwrap();
    let (fields, _) = split(&span);
    assert_eq!(
        fields,
        expect(SCOPE, &job.key(), "transaction", "replayed", 0)
    );
    assert_eq!(decisions(&seen, id), ["replayed"]);
    assert_eq!(finished(&seen, id), (Level::DEBUG, ended("replayed", None)));
    assert_eq!(outcomes(SCOPE, "applied"), 1);
    assert_eq!(outcomes(SCOPE, "replayed"), 1);
}

#[tokio::test]
async fn body_error() {
    const SCOPE: &str = "obs.lite.error";
    metrics();
    let (seen, _guard) = subscribe();
    let (store, pool) = lite().await;
    let mut job = Job::new(9, "effects");
    job.fail = true;

    let err = lite_error(&store, &job).await.unwrap_err();
    assert!(matches!(err, sqlx::Error::Protocol(_)), "{err}");
    assert_eq!(count(&pool, "effects", 9).await, 0, "rolled back");

    let [(id, span)] = &seen.claims()[..] else {
        panic!("one span")
    };
    let (fields, _) = split(span);
    assert_eq!(fields, expect(SCOPE, &job.key(), "transaction", "error", 0));
    assert_eq!(decisions(&seen, *id), ["fresh"]);
    // The body's own error is the caller's to log: idem says only how the call ended.
    assert_eq!(finished(&seen, *id), (Level::DEBUG, ended("error", None)));
    assert_eq!(outcomes(SCOPE, "error"), 1);
    assert_eq!(claim_samples(SCOPE).len(), 1);
}

#[tokio::test]
async fn swallowed_rollback_is_rolled_back() {
    const SCOPE: &str = "obs.lite.rolled_back";
    metrics();
    let (seen, _guard) = subscribe();
    let (store, pool) = lite().await;
    let job = Job::new(10, "effects");

    let err = lite_rolled_back(&store, &job).await.unwrap_err();
    assert!(
        matches!(err, Error::NotKept(NotKept::RolledBack { .. })),
        "{err}"
    );

    let [(id, span)] = &seen.claims()[..] else {
        panic!("one span")
    };
    let (fields, _) = split(span);
    assert_eq!(
        fields,
        expect(SCOPE, &job.key(), "transaction", "rolled_back", 0)
    );
    let text = "the transaction of \"obs.lite.rolled_back\" / \"10\" was rolled back by the \
                database although the body returned Ok: a statement in the body failed and its \
                error was ignored. Nothing was kept; let the job be redelivered, and return \
                database errors from the body with `?` instead of ignoring or retrying them";
    assert_eq!(err.to_string(), text);
    assert_eq!(
        finished(&seen, *id),
        (Level::WARN, ended("rolled_back", Some(text)))
    );
    assert_eq!(outcomes(SCOPE, "rolled_back"), 1);
    assert_eq!(outcomes(SCOPE, "applied"), 0);
    // The effect went with the rollback, marker and all.
    assert_eq!(count(&pool, "effects", 10).await, 0);
}

#[tokio::test]
async fn in_progress_behind_a_held_claim() {
    const SCOPE: &str = "obs.lite.in_progress";
    metrics();
    let (seen, _guard) = subscribe();
    let (store, pool) = lite().await;
    let job = Job::new(11, "effects");
    // SQLite's one writer: a hand-held claim keeps the write lock until it ends.
    let held = match store.claim(SCOPE, &job.key()).await.unwrap() {
        idem::Claimed::Fresh(guard) => guard,
        other => panic!("{other:?}"),
    };

    let err = lite_waiting(&store, &job).await.unwrap_err();
    assert!(matches!(err, Error::InProgress { .. }), "{err}");
    let held = held.finish(Ok::<(), Error>(())).await.unwrap();
    assert_eq!(held, Outcome::Applied(()));
    assert_eq!(count(&pool, "effects", 11).await, 0);

    // The hand-held claim is a call of its own, with its span and count.
    let [(held_id, held_span), (id, span)] = &seen.claims()[..] else {
        panic!("two spans: {:?}", seen.claims())
    };
    let (fields, _) = split(held_span);
    assert_eq!(
        fields,
        expect(SCOPE, &job.key(), "transaction", "applied", 0)
    );
    assert_eq!(decisions(&seen, *held_id), ["fresh"]);
    let (fields, waited) = split(span);
    assert_eq!(
        fields,
        expect(SCOPE, &job.key(), "transaction", "in_progress", 0)
    );
    // The busy timeout (`wait`) elapsed before SQLite gave up: the wait is in the field.
    assert!(waited >= 100, "waited_ms = {waited}");
    assert_eq!(decisions(&seen, *id), ["in_progress"]);
    // Another delivery holding the key is a nack, not a fault: INFO, with idem's text once.
    let text = "another delivery of \"obs.lite.in_progress\" / \"11\" is still in progress: \
                nothing ran; nack the job so that it is redelivered later (do not ack it: the \
                other delivery may still fail)";
    assert_eq!(err.to_string(), text);
    assert_eq!(
        finished(&seen, *id),
        (Level::INFO, ended("in_progress", Some(text)))
    );
    assert_eq!(outcomes(SCOPE, "in_progress"), 1);
    assert_eq!(outcomes(SCOPE, "applied"), 1);
    let samples = claim_samples(SCOPE);
    assert!(
        samples.len() == 2 && samples.iter().any(|s| *s >= 0.1),
        "{samples:?}"
    );
}

#[tokio::test]
async fn joined_call() {
    const SCOPE: &str = "obs.lite.joined";
    metrics();
    let (seen, _guard) = subscribe();
    let (store, pool) = lite().await;
    let job = Job::new(12, "effects");

    let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.unwrap();
    let outcome = lite_joined(store.join(&mut tx), &job).await.unwrap();
    assert_eq!(outcome, Outcome::Applied(12));
    tx.commit().await.unwrap();
    assert_eq!(count(&pool, "effects", 12).await, 1);

    let [(id, span)] = &seen.claims()[..] else {
        panic!("one span")
    };
    let (fields, _) = split(span);
    assert_eq!(fields, expect(SCOPE, &job.key(), "joined", "applied", 0));
    assert_eq!(decisions(&seen, *id), ["fresh"]);
    assert_eq!(outcomes(SCOPE, "applied"), 1);
}

#[tokio::test]
async fn lease_in_progress_then_takeover() {
    const SCOPE: &str = "obs.lite.lease";
    metrics();
    let (seen, _guard) = subscribe();
    let (store, pool) = lite().await;
    let job = Job::new(13, "effects");
    let options = LeaseOptions::new(Duration::from_secs(30));
    let Claimed::Fresh(held) = store.lease(SCOPE, &job.key(), options).await.unwrap() else {
        panic!("a fresh lease")
    };

    // A live lease: in progress at once.
    let err = lite_lease(&store, &job, &pool).await.unwrap_err();
    assert!(matches!(err, Error::InProgress { .. }), "{err}");
    // The holder fails: its lease is released, and the next delivery takes the key over.
    let failed = held.finish(Err::<(), sqlx::Error>(failed())).await;
    assert!(failed.is_err());
    assert_eq!(
        lite_lease(&store, &job, &pool).await.unwrap(),
        Outcome::Applied(13)
    );
    assert_eq!(
        lite_lease(&store, &job, &pool).await.unwrap(),
        Outcome::Duplicate
    );
    assert_eq!(count(&pool, "effects", 13).await, 1);

    // The hand-held lease is a call of its own: its body's error ends it.
    let claims = seen.claims();
    assert_eq!(claims.len(), 4);
    let key = job.key();
    let expected = [
        ("error", "fresh"),
        ("in_progress", "in_progress"),
        ("applied", "takeover"),
        ("duplicate", "duplicate"),
    ];
    for ((id, span), (outcome, decision)) in claims.iter().zip(expected) {
        let (fields, _) = split(span);
        assert_eq!(fields, expect(SCOPE, &key, "lease", outcome, 0));
        assert_eq!(decisions(&seen, *id), [decision]);
    }
    // Nothing at WARN: a live lease is a nack, a released lease taken over is the recovery
    // working (INFO), and the rest are routine.
    let by_level = |id: u64, level: Level| -> Vec<Fields> {
        seen.idem_events(id)
            .into_iter()
            .filter(|e| e.level == level)
            .map(|e| e.fields)
            .collect()
    };
    for (id, _) in &claims {
        assert_eq!(by_level(*id, Level::WARN), Vec::<Fields>::new());
    }
    let in_progress = format!(
        "another delivery of \"{SCOPE}\" / \"13\" is still in progress: nothing ran; nack \
         the job so that it is redelivered later (do not ack it: the other delivery may still \
         fail)"
    );
    let mut ended_in_progress = ended("in_progress", Some(&in_progress));
    ended_in_progress.insert("message".into(), "idem call finished".into());
    assert_eq!(by_level(claims[1].0, Level::INFO), [ended_in_progress]);
    // The takeover's `attempt` is the lease's (`Lease::attempt`, the marker's `attempts`);
    // the span's `retries` is another count (claims retried after a lost race).
    let token = |id: u64| -> i64 {
        let events = seen.idem_events(id);
        let info = events.iter().find(|e| e.fields.contains_key("token"));
        info.and_then(|e| e.fields["token"].parse().ok())
            .unwrap_or_else(|| panic!("a takeover event with the token: {events:?}"))
    };
    let takeover: Fields = [
        (
            "message",
            "idem lease taken over from an earlier delivery whose lease expired or was released",
        ),
        ("token", &token(claims[2].0).to_string()),
        ("attempt", "2"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    assert!(token(claims[2].0) > 0);
    assert_eq!(by_level(claims[2].0, Level::INFO), [takeover]);
    assert_eq!(by_level(claims[3].0, Level::INFO), Vec::<Fields>::new());
    assert_eq!(
        finished(&seen, claims[0].0),
        (Level::DEBUG, ended("error", None))
    );
    assert_eq!(
        finished(&seen, claims[2].0),
        (Level::DEBUG, ended("applied", None))
    );
    assert_eq!(
        finished(&seen, claims[3].0),
        (Level::DEBUG, ended("duplicate", None))
    );
    assert_eq!(outcomes(SCOPE, "error"), 1);
    assert_eq!(outcomes(SCOPE, "in_progress"), 1);
    assert_eq!(outcomes(SCOPE, "applied"), 1);
    assert_eq!(outcomes(SCOPE, "duplicate"), 1);
    assert_eq!(claim_samples(SCOPE).len(), 4);
}

#[tokio::test]
async fn invalid_key_is_an_error_without_a_claim() {
    metrics();
    let (seen, _guard) = subscribe();
    let (store, _pool) = lite().await;
    let err = lite_by_name(&store, "").await.unwrap_err();
    let text = "invalid idempotency key: the key is empty: every job needs a stable, non-empty \
                id (check that the key expression reads the job's id)";
    assert_eq!(err.to_string(), text);

    let [(id, span)] = &seen.claims()[..] else {
        panic!("one span")
    };
    let expected: Fields = [
        ("scope", "obs.lite.invalid_key"),
        ("mode", "transaction"),
        ("outcome", "invalid"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    // No key to show, and no claim: no attempts, no wait, no latency.
    assert_eq!(span.fields, expected);
    assert_eq!(
        finished(&seen, *id),
        (Level::WARN, ended("invalid", Some(text)))
    );
    assert_eq!(outcomes("obs.lite.invalid_key", "invalid"), 1);
    assert_eq!(outcomes("obs.lite.invalid_key", "error"), 0);
    assert!(claim_samples("obs.lite.invalid_key").is_empty());
}

#[test]
fn metrics_are_described_with_their_units() {
    metrics();
    idem::describe_metrics();
    let described = metrics().described();
    assert_eq!(
        described.get(idem::OUTCOMES_TOTAL),
        Some(&("counter", Some(metrics::Unit::Count)))
    );
    assert_eq!(
        described.get(idem::CLAIM_SECONDS),
        Some(&("histogram", Some(metrics::Unit::Seconds)))
    );
    assert_eq!(idem::OUTCOMES_TOTAL, "idem_outcomes_total");
    assert_eq!(idem::CLAIM_SECONDS, "idem_claim_seconds");
}

#[idem::idempotent(key = "name", scope = "obs.lite.invalid_key")]
async fn lite_by_name(tx: &mut Transaction<'_, Sqlite>, name: &str) -> Result<(), Error> {
    sqlx::query("SELECT 1").execute(&mut **tx).await?;
    Ok(())
}
