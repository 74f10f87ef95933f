//! A call given its producer's traceparent, on every path (the attribute, group commit, a
//! hand-written claim, a lease, a batch): without the feature `opentelemetry` its span records it in the field
//! `traceparent` (with it, the link is OpenTelemetry's: `examples/otel/tests/trace_context.rs`).
//! A value that does not parse is a `debug` event, links nothing, and fails nothing.

use idem::{ClaimOptions, GroupOptions, TraceParent};

use super::*;

const SENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

struct Message {
    id: i64,
    traceparent: Option<String>,
}

#[idem::idempotent(key = "msg.id", scope = "obs.lite.link", link = "msg.traceparent")]
async fn lite_linked(tx: &mut Transaction<'_, Sqlite>, msg: &Message) -> Result<i64, sqlx::Error> {
    lite_effect(tx, &Job::new(msg.id, "effects")).await
}

#[idem::idempotent(
    key = "msg.id",
    scope = "obs.lite.link.group",
    link = "msg.traceparent",
    group
)]
async fn lite_grouped(tx: &mut Transaction<'_, Sqlite>, msg: &Message) -> Result<i64, sqlx::Error> {
    lite_effect(tx, &Job::new(msg.id, "effects")).await
}

/// The span field `traceparent` a call given `SENT` has.
fn recorded() -> Option<String> {
    match cfg!(feature = "opentelemetry") {
        true => None,
        false => Some(SENT.to_owned()),
    }
}

#[tokio::test]
async fn a_linked_call_names_its_producer_and_a_bad_header_fails_nothing() {
    metrics();
    let (seen, _guard) = subscribe();
    let (store, pool) = lite().await;

    let messages = [
        (40, Some(SENT.to_owned())),
        (41, Some("00-not-a-traceparent".to_owned())),
        (42, Some(SENT.to_uppercase())),
        (43, None),
    ];
    for (id, traceparent) in messages {
        let msg = Message { id, traceparent };
        assert_eq!(
            lite_linked(&store, &msg).await.unwrap(),
            Outcome::Applied(id)
        );
    }
    // A redelivery is linked too: it is the same message.
    let again = Message {
        id: 40,
        traceparent: Some(SENT.to_owned()),
    };
    assert_eq!(
        lite_linked(&store, &again).await.unwrap(),
        Outcome::Duplicate
    );

    // By hand, in a transaction and under a lease.
    let parent = TraceParent::from_header(SENT);
    let key = Key::new(&44).unwrap();
    match store
        .claim_with("obs.lite.link.hand", &key, ClaimOptions::new().link(parent))
        .await
        .unwrap()
    {
        Claimed::Fresh(guard) => {
            let done = guard.finish(Ok::<(), Error>(())).await.unwrap();
            assert_eq!(done, Outcome::Applied(()));
        }
        other => panic!("44 was claimed before: {other:?}"),
    }
    let key = Key::new(&45).unwrap();
    let lease = LeaseOptions::new(Duration::from_secs(30)).link(parent);
    match store
        .lease("obs.lite.link.lease", &key, lease)
        .await
        .unwrap()
    {
        Claimed::Fresh(lease) => {
            let done = lease.finish(Ok::<(), Error>(())).await.unwrap();
            assert_eq!(done, Outcome::Applied(()));
        }
        other => panic!("45 was claimed before: {other:?}"),
    }
    // A batch: its one span names the batch's producer.
    let keys = [Key::new(&46).unwrap(), Key::new(&47).unwrap()];
    let batch = store
        .claim_batch_with(
            "obs.lite.link.batch",
            &keys,
            ClaimOptions::new().link(parent),
        )
        .await
        .unwrap();
    let done = batch.finish(Ok::<(), Error>(())).await.unwrap();
    assert_eq!(done.applied(), 2);

    // Group commit.
    let group = store.group(GroupOptions::default()).unwrap();
    let msg = Message {
        id: 48,
        traceparent: Some(SENT.to_owned()),
    };
    assert_eq!(
        lite_grouped(&group, &msg).await.unwrap(),
        Outcome::Applied(48)
    );

    for id in (40..=43).chain([48]) {
        assert_eq!(count(&pool, "effects", id).await, 1, "{id}");
    }
    let field = |scope: &str, key: Option<&str>| -> Vec<Option<String>> {
        seen.claims()
            .into_iter()
            .filter(|(_, s)| s.fields["scope"] == scope)
            .filter(|(_, s)| key.is_none() || s.fields.get("key").map(String::as_str) == key)
            .map(|(_, s)| s.fields.get("traceparent").cloned())
            .collect()
    };
    assert_eq!(field("obs.lite.link", Some("40")), [recorded(), recorded()]);
    for id in ["41", "42", "43"] {
        assert_eq!(field("obs.lite.link", Some(id)), [None], "{id}");
    }
    assert_eq!(field("obs.lite.link.hand", None), [recorded()]);
    assert_eq!(field("obs.lite.link.lease", None), [recorded()]);
    assert_eq!(field("obs.lite.link.batch", None), [recorded()]);
    assert_eq!(field("obs.lite.link.group", None), [recorded()]);

    // Each header that did not parse said so, at DEBUG, with the value.
    let ignored: Vec<String> = seen
        .events()
        .into_iter()
        .filter(|e| e.level == Level::DEBUG && e.target == "idem")
        .filter_map(|e| e.fields.get("traceparent").cloned())
        .collect();
    assert_eq!(
        ignored,
        ["00-not-a-traceparent".to_owned(), SENT.to_uppercase()]
    );
}
