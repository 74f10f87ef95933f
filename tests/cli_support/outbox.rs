//! `idem outbox`: messages committed by real handlers, parked by a relay whose broker refuses
//! them, then listed, shown and requeued through the command line; each change checked in the
//! database, and the requeued message published by the next round.

use std::sync::{Arc, Mutex};

use idem::Message;
use idem::outbox::{OutboxEntry, OutboxState, PublishError, Publisher, Relay};
use serde_json::{Value, json};

use crate::Db;
use crate::cli_support::Fixture;

/// A broker that refuses every message, with an error of two lines.
pub(crate) struct Refusing;

impl Publisher for Refusing {
    async fn publish(&self, _: &Message) -> Result<(), PublishError> {
        Err("broker said no:\nqueue `mail` not found".into())
    }
}

/// A broker that takes every message, keeping their ids.
pub(crate) struct Taking(pub(crate) Arc<Mutex<Vec<String>>>);

impl Publisher for Taking {
    async fn publish(&self, message: &Message) -> Result<(), PublishError> {
        self.0.lock().unwrap().push(message.id.clone());
        Ok(())
    }
}

/// The messages as the store reads them, in `ids`' order.
async fn read<B: Db>(fx: &Fixture<B>, ids: &[&str]) -> Vec<OutboxEntry> {
    let mut out = Vec::new();
    for id in ids {
        out.push(fx.store.outbox_message(id).await.unwrap().expect("written"));
    }
    out
}

/// `doc` shows `m`, read just before the binary ran (its age can only have grown).
fn assert_shows(doc: &Value, m: &OutboxEntry, state: &str) {
    for (name, want) in [
        ("id", json!(m.id)),
        ("destination", json!(m.destination)),
        ("scope", json!(m.scope)),
        ("key", json!(m.key)),
        ("ordering_key", json!(m.key)),
        ("headers", json!({"content-type": "application/json"})),
        ("seq", json!(m.seq)),
        ("state", json!(state)),
        ("attempts", json!(m.attempts)),
        ("last_error", json!(m.last_error)),
        ("created_at", json!(m.created_at)),
    ] {
        assert_eq!(doc[name], want, "{name} of {doc}");
    }
    assert!(doc["age_ms"].as_i64().unwrap() >= m.age_ms, "{doc}");
}

fn ids_of(doc: &Value) -> Vec<String> {
    doc["messages"]
        .as_array()
        .unwrap_or_else(|| panic!("no messages in {doc}"))
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_owned())
        .collect()
}

pub(crate) async fn outbox_lists_and_requeues_parked_messages<B: Db>() {
    let fx = Fixture::<B>::new("outbox").await;
    // Three jobs of one message each: a job's second message would wait behind its first
    // (one ordering key), never tried, while the first is parked.
    let first = B::place(&fx.store, "order-1", 1).await;
    let mut second = B::place(&fx.store, "order-2", 1).await;
    second.extend(B::place(&fx.store, "order-5", 1).await);
    let refused = Relay::new(fx.store.clone(), Refusing)
        .max_attempts(2)
        .backoff(std::time::Duration::ZERO);
    assert_eq!(refused.relay_once().await.unwrap().failed, 3);
    assert_eq!(refused.relay_once().await.unwrap().parked, 3);
    let third = B::place(&fx.store, "order-3", 1).await;
    let parked: Vec<&str> = first.iter().chain(&second).map(String::as_str).collect();
    let before = read(&fx, &[parked.clone(), vec![third[0].as_str()]].concat()).await;
    for m in &before[..3] {
        assert_eq!((m.state, m.attempts), (OutboxState::Parked, 2), "{m:?}");
        assert_eq!(
            m.last_error.as_deref(),
            Some("broker said no:\nqueue `mail` not found")
        );
    }
    assert_eq!(
        (before[3].state, before[3].attempts),
        (OutboxState::Pending, 0)
    );

    // Parked first, then pending; each in the order its job sent it.
    let all = fx.idem(&["--json", "outbox", "list"]).await.ok().json();
    assert_eq!(all["table"], json!(format!("{}_outbox", fx.table())));
    assert_eq!(all["filter"], json!("all"));
    let listed = all["messages"].as_array().unwrap();
    assert_eq!(listed.len(), 4, "{all}");
    for (doc, m) in listed.iter().zip(&before) {
        let state = if m.state == OutboxState::Parked {
            "parked"
        } else {
            "pending"
        };
        assert_shows(doc, m, state);
    }
    let only_parked = fx
        .idem(&["--json", "outbox", "list", "--parked"])
        .await
        .ok();
    assert_eq!(ids_of(&only_parked.json()), parked);
    let only_pending = fx
        .idem(&["--json", "outbox", "list", "--pending"])
        .await
        .ok();
    assert_eq!(ids_of(&only_pending.json()), [third[0].as_str()]);
    let limited = fx
        .idem(&["--json", "outbox", "list", "--limit", "2"])
        .await
        .ok();
    assert_eq!(ids_of(&limited.json()), parked[..2]);

    // The text: a header, one line per message, the error on one line.
    let text = fx.idem(&["outbox", "list"]).await.ok().stdout;
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 5, "{text}");
    let head: Vec<&str> = lines[0].split_whitespace().collect();
    assert_eq!(
        head,
        [
            "ID",
            "DESTINATION",
            "ORDERING_KEY",
            "STATE",
            "ATTEMPTS",
            "AGE",
            "LAST_ERROR"
        ]
    );
    for (line, m) in lines[1..].iter().zip(&before) {
        let cells: Vec<&str> = line.split_whitespace().collect();
        let (state, attempts) = match m.state {
            OutboxState::Parked => ("parked", "2"),
            _ => ("pending", "0"),
        };
        assert_eq!(
            cells[..5],
            [m.id.as_str(), "mail", m.key.as_str(), state, attempts],
            "{line}"
        );
    }
    assert!(
        lines[1].ends_with("broker said no: queue `mail` not found"),
        "{text}"
    );
    assert!(lines[4].ends_with('-'), "{text}");

    // One message shown: where it stands, its ordering key, its headers.
    let shown = fx.idem(&["outbox", "show", parked[0]]).await.ok().stdout;
    for line in [
        format!("message {} in table {}_outbox", parked[0], fx.table()),
        "  ordering key: order-1".to_owned(),
        "  state:        parked (2 failed attempts)".to_owned(),
        "  headers:".to_owned(),
        "    content-type: application/json".to_owned(),
    ] {
        assert!(shown.lines().any(|l| l == line), "{line:?} in {shown}");
    }
    let shown = fx
        .idem(&["--json", "outbox", "show", parked[0]])
        .await
        .ok()
        .json();
    assert_shows(&shown, &before[0], "parked");
    let unknown = fx
        .idem(&["outbox", "show", "14:orders.place|7:order-9"])
        .await;
    assert_eq!(unknown.code, Some(3), "{unknown:?}");
    assert!(
        unknown.stderr.contains("no outbox message with id"),
        "{unknown:?}"
    );

    // Requeued: pending, due, its attempts back to 0; the next round publishes it.
    let done = fx.idem(&["outbox", "requeue", parked[0]]).await.ok().stdout;
    assert!(
        done.starts_with(&format!("requeued message {} to mail", parked[0])),
        "{done}"
    );
    let after = fx.store.outbox_message(parked[0]).await.unwrap().unwrap();
    assert_eq!((after.state, after.attempts), (OutboxState::Pending, 0));
    assert!(after.due_in_ms <= 0, "{after:?}");
    let json = fx
        .idem(&["--json", "outbox", "requeue", parked[1]])
        .await
        .ok()
        .json();
    assert_eq!(
        (&json["requeued"], &json["state"]),
        (&json!(true), &json!("pending"))
    );
    let published = Arc::new(Mutex::new(Vec::new()));
    let taking = Relay::new(fx.store.clone(), Taking(published.clone()));
    assert_eq!(taking.relay_once().await.unwrap().sent, 3);
    let mut published = published.lock().unwrap().clone();
    published.sort();
    let mut want = vec![parked[0].to_owned(), parked[1].to_owned(), third[0].clone()];
    want.sort();
    assert_eq!(published, want);
    let left = fx.idem(&["--json", "outbox", "list"]).await.ok().json();
    assert_eq!(ids_of(&left), [parked[2]]);
    let none = fx.idem(&["outbox", "list", "--pending"]).await.ok().stdout;
    assert!(none.starts_with("no pending message in table"), "{none}");

    // Refused: a sent message (4), a pending one (4), an unknown id (3); nothing changes.
    let sent = fx.idem(&["outbox", "requeue", &third[0]]).await;
    assert_eq!(sent.code, Some(4), "{sent:?}");
    assert!(sent.stderr.contains("is sent, not parked"), "{sent:?}");
    let fourth = B::place(&fx.store, "order-4", 1).await;
    let pending = fx.idem(&["outbox", "requeue", &fourth[0]]).await;
    assert_eq!(pending.code, Some(4), "{pending:?}");
    assert!(
        pending.stderr.contains("is pending, not parked"),
        "{pending:?}"
    );
    let unknown = fx
        .idem(&["outbox", "requeue", "14:orders.place|7:order-9"])
        .await;
    assert_eq!(unknown.code, Some(3), "{unknown:?}");
    assert!(
        unknown.stderr.contains("no outbox message with id"),
        "{unknown:?}"
    );
    let states = read(&fx, &[third[0].as_str(), fourth[0].as_str(), parked[2]]).await;
    let states: Vec<_> = states.iter().map(|m| (m.state, m.attempts)).collect();
    assert_eq!(
        states,
        [
            (OutboxState::Sent, 0),
            (OutboxState::Pending, 0),
            (OutboxState::Parked, 2)
        ]
    );

    // Bad input is refused before the database is reached (exit 2).
    let long = "i".repeat(256);
    for args in [
        &["outbox", "requeue", ""][..],
        &["outbox", "requeue", &long],
        &["outbox", "list", "--parked", "--pending"],
        &["outbox", "list", "--limit", "0"],
        &["outbox", "requeue"],
    ] {
        let mut all = vec!["--database-url", "postgres://nobody@127.0.0.1:1/none"];
        all.extend_from_slice(args);
        let run = crate::cli_support::run(&all, None, &[]).await;
        assert_eq!(run.code, Some(2), "{args:?}: {run:?}");
        assert!(!run.stderr.contains("cannot reach"), "{args:?}: {run:?}");
    }
    let bad = crate::cli_support::run(
        &[
            "--database-url",
            &fx.url,
            "--table",
            fx.table(),
            "outbox",
            "requeue",
            "",
        ],
        None,
        &[],
    )
    .await;
    assert!(bad.stderr.contains("not an outbox message id"), "{bad:?}");
    fx.cleanup().await;
}
