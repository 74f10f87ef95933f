//! `idem outbox requeue --all` and `idem forget --stuck-older-than`: many parked messages and
//! many stuck leases, acted on behind a dry run and a confirmation, the action audited; every
//! change counted in the database, and the rows the filter leaves out untouched.

use std::sync::{Arc, Mutex};

use idem::Message;
use idem::outbox::{OutboxState, PublishError, Publisher, Relay};
use serde_json::json;

use crate::Db;
use crate::cli_support::{Fixture, run};

/// A broker that refuses every message.
struct Refusing;

impl Publisher for Refusing {
    async fn publish(&self, _: &Message) -> Result<(), PublishError> {
        Err("broker said no".into())
    }
}

/// A broker that takes every message, keeping their ids in the order it got them.
struct Taking(Arc<Mutex<Vec<String>>>);

impl Publisher for Taking {
    async fn publish(&self, message: &Message) -> Result<(), PublishError> {
        self.0.lock().unwrap().push(message.id.clone());
        Ok(())
    }
}

/// The parked messages written by hand: three per ordering key, parked two hours ago.
const OLD: i64 = 150;
/// Those to another destination: two keys of three.
const SMS: i64 = 6;
const RESET: &str = "connection reset by peer";

pub(crate) async fn outbox_requeue_all_acts_on_the_filter_behind_a_dry_run_and_a_confirmation<
    B: Db,
>() {
    let fx = Fixture::<B>::new("obulk").await;
    // One message parked by a real relay just now, with its own error: the age and the
    // error filters leave it out. Parked, it is due at once (its due time is when it was
    // parked), whatever the backoff.
    let recent = B::place(&fx.store, "order-1", 1).await.remove(0);
    let refusing = Relay::new(fx.store.clone(), Refusing)
        .max_attempts(1)
        .backoff(std::time::Duration::from_secs(60));
    assert_eq!(refusing.relay_once().await.unwrap().parked, 1);
    let m = fx.store.outbox_message(&recent).await.unwrap().unwrap();
    assert_eq!(m.state, OutboxState::Parked);
    assert!(m.due_in_ms <= 0, "{m:?}");
    fx.park_many(&recent, "mail", "k", 0..OLD).await;
    fx.park_many(&recent, "sms", "s", 0..SMS).await;
    let before = fx.parked().await;
    assert_eq!(before, (OLD + 1, SMS));

    // A dry run counts and names them, each key's in its order, and changes nothing.
    let filter = [
        "outbox",
        "requeue",
        "--all",
        "--destination",
        "mail",
        "--error",
        "reset by",
        "--parked-before",
        "1h",
    ];
    let dry = fx.idem(&[&filter[..], &["--dry-run"]].concat()).await.ok();
    assert!(
        dry.stdout
            .starts_with("dry run: would requeue 150 parked messages of table"),
        "{dry:?}"
    );
    let dry = fx
        .idem(&[&["--json"], &filter[..], &["--dry-run"]].concat())
        .await
        .ok()
        .json();
    assert_eq!(
        (&dry["count"], &dry["dry_run"]),
        (&json!(OLD), &json!(true))
    );
    let shown = dry["messages"].as_array().unwrap();
    assert_eq!(shown.len(), 20, "{dry}");
    let first: Vec<_> = shown[..3]
        .iter()
        .map(|m| (m["ordering_key"].clone(), m["seq"].clone()))
        .collect();
    assert_eq!(
        first,
        [
            (json!("k-0"), json!(0)),
            (json!("k-0"), json!(1)),
            (json!("k-0"), json!(2))
        ]
    );
    assert!(
        shown
            .iter()
            .all(|m| m["destination"] == json!("mail") && m["last_error"] == json!(RESET)),
        "{dry}"
    );
    assert_eq!(fx.parked().await, before);

    // More than 100 without --yes: refused, nothing changed.
    let refused = fx.idem(&filter).await;
    assert_eq!(refused.code, Some(8), "{refused:?}");
    assert!(
        refused.stderr.contains("would change 150 parked messages")
            && refused.stderr.contains("nothing was changed")
            && refused.stderr.contains("--yes"),
        "{refused:?}"
    );
    assert_eq!(fx.parked().await, before);

    // Few enough to need no --yes: only that destination's.
    let sms = fx
        .idem(&["outbox", "requeue", "--all", "--destination", "sms"])
        .await
        .ok();
    assert!(
        sms.stdout
            .starts_with("requeued 6 parked messages of table"),
        "{sms:?}"
    );
    assert_eq!(fx.parked().await, (OLD + 1, 0));

    // With --yes: exactly the filter's, pending again with no failed attempts.
    let done = fx
        .idem(&[&["--actor", "alice", "--json"], &filter[..], &["--yes"]].concat())
        .await
        .ok()
        .json();
    assert_eq!(done["requeued"], json!(OLD), "{done}");
    assert_eq!(fx.parked().await, (1, 0));
    let pending = format!(
        "SELECT COUNT(*) FROM {}_outbox WHERE parked = FALSE AND sent_at IS NULL \
         AND attempts = 0 AND id LIKE 'k-%'",
        fx.table()
    );
    assert_eq!(B::count(&fx.pool, &pending).await, OLD);
    let m = fx.store.outbox_message(&recent).await.unwrap().unwrap();
    assert_eq!((m.state, m.attempts), (OutboxState::Parked, 1));

    // The relay publishes each key's messages in their order.
    let published = Arc::new(Mutex::new(Vec::new()));
    let taking = Relay::new(fx.store.clone(), Taking(published.clone()));
    let mut sent = 0;
    for _ in 0..50 {
        match taking.relay_once().await.unwrap().sent {
            0 => break,
            n => sent += n,
        }
    }
    assert_eq!(sent, (OLD + SMS) as usize);
    let published = published.lock().unwrap().clone();
    let at = |id: &str| published.iter().position(|p| p == id).unwrap();
    for key in 0..OLD / 3 {
        let ids: Vec<usize> = (0..3).map(|seq| at(&format!("k-{key}-{seq}"))).collect();
        assert!(
            ids.is_sorted(),
            "key k-{key} published out of order: {ids:?}"
        );
    }

    // Two rows in the audit log, the newest that run: who, what, the filter, how many.
    let log = fx.idem(&["--json", "audit"]).await.ok().json();
    let entries = log["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 2, "{log}");
    let e = &entries[0];
    assert_eq!(
        (&e["actor"], &e["action"], &e["changed"]),
        (&json!("alice"), &json!("outbox requeue --all"), &json!(OLD))
    );
    assert_eq!(
        e["target"],
        json!({ "destination": "mail", "error": "reset by", "parked_before": "1h" })
    );
    assert_eq!(entries[1]["changed"], json!(SMS));
    assert_eq!(entries[1]["target"]["destination"], json!("sms"));
    fx.cleanup().await;
}

/// The stuck leases of [`SCOPE`] written by hand: run out two hours ago, created then.
const GONE: i64 = 120;
/// Live leases of [`SCOPE`] created two hours ago: their holders may still run.
const HELD: i64 = 3;
const SCOPE: &str = "mail.send";

pub(crate) async fn forget_stuck_forces_only_with_force_behind_a_dry_run_and_a_confirmation<
    B: Db,
>() {
    let fx = Fixture::<B>::new("fbulk").await;
    let mut held = Vec::new();
    for n in 0..HELD {
        let key = format!("held-{n}");
        held.push(fx.lease(SCOPE, &key, 600).await);
        fx.exec(&format!(
            "UPDATE {} SET created_at = {} WHERE {} = '{key}'",
            fx.table(),
            B::TWO_HOURS_AGO,
            B::KEY
        ))
        .await;
    }
    // Left out: a live lease taken just now, and one of another scope.
    let _fresh = fx.lease(SCOPE, "fresh", 600).await;
    fx.stuck_many(SCOPE, "gone", 0..GONE).await;
    fx.stuck_many("other.scope", "x", 0..1).await;
    let before = fx.holding().await;
    assert_eq!(before, (GONE + HELD + 1, 1));

    // A dry run counts them, and how many are still held; nothing changes.
    let args = ["forget", "--stuck-older-than", "1h", "--scope", SCOPE];
    let dry = fx
        .idem(&[&["--json"], &args[..], &["--dry-run"]].concat())
        .await
        .ok()
        .json();
    assert_eq!(
        (&dry["count"], &dry["held"], &dry["dry_run"]),
        (&json!(GONE + HELD), &json!(HELD), &json!(true))
    );
    assert_eq!(dry["markers"].as_array().unwrap().len(), 20, "{dry}");
    let text = fx.idem(&[&args[..], &["--dry-run"]].concat()).await.ok();
    assert!(
        text.stdout
            .starts_with("dry run: would forget 123 stuck leases of table"),
        "{text:?}"
    );
    assert_eq!(fx.holding().await, before);

    // Held leases without --force: refused as a single forget is (exit 5).
    let refused = fx.idem(&args).await;
    assert_eq!(refused.code, Some(5), "{refused:?}");
    assert!(
        refused.stderr.contains("3 of the 123 stuck leases")
            && refused.stderr.contains("nothing was changed")
            && refused.stderr.contains("--force"),
        "{refused:?}"
    );
    // More than 100 without --yes: refused (exit 8).
    let unconfirmed = fx.idem(&[&args[..], &["--force"]].concat()).await;
    assert_eq!(unconfirmed.code, Some(8), "{unconfirmed:?}");
    assert_eq!(fx.holding().await, before);

    // None held: no --force needed.
    let other = [
        "forget",
        "--stuck-older-than",
        "1h",
        "--scope",
        "other.scope",
    ];
    let done = fx.idem(&other).await.ok();
    assert!(
        done.stdout.starts_with("forgot 1 stuck lease of table"),
        "{done:?}"
    );
    assert_eq!(fx.holding().await, (GONE + HELD + 1, 0));

    // With --force and --yes: every one of the scope's old ones, let go with its token up;
    // the fresh lease untouched, the old holders fenced out.
    let done = fx
        .idem(
            &[
                &["--actor", "bob", "--json"],
                &args[..],
                &["--force", "--yes"],
            ]
            .concat(),
        )
        .await
        .ok()
        .json();
    assert_eq!(done["forgotten"], json!(GONE + HELD), "{done}");
    assert_eq!(fx.holding().await, (1, 0));
    let released = |more: &str| {
        format!(
            "SELECT COUNT(*) FROM {} WHERE scope = '{SCOPE}' AND state = 'in_progress' \
             AND locked_until IS NULL{more}",
            fx.table()
        )
    };
    assert_eq!(B::count(&fx.pool, &released("")).await, GONE + HELD);
    let gone = released(&format!(" AND token = 2 AND {} LIKE 'gone-%'", B::KEY));
    assert_eq!(B::count(&fx.pool, &gone).await, GONE);
    for lease in &held {
        assert!(lease.renew().await.is_err(), "a forced-out holder renewed");
    }

    let log = fx.idem(&["--json", "audit"]).await.ok().json();
    let entries = log["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 2, "{log}");
    let e = &entries[0];
    assert_eq!(
        (&e["actor"], &e["action"], &e["changed"]),
        (
            &json!("bob"),
            &json!("forget --stuck-older-than"),
            &json!(GONE + HELD)
        )
    );
    assert_eq!(
        e["target"],
        json!({ "scope": SCOPE, "stuck_older_than": "1h", "force": true })
    );
    assert_eq!(entries[1]["changed"], json!(1));
    fx.cleanup().await;
}

pub(crate) async fn bulk_outbox_and_forget_refuse_bad_input_before_connecting<B: Db>() {
    let url = B::unreachable_url();
    let bad = [
        (
            &["outbox", "requeue", "--all", "some-id"][..],
            "cannot be used",
        ),
        (&["outbox", "requeue", "--destination", "mail"][..], "--all"),
        (
            &["outbox", "requeue", "--all", "--error", ""][..],
            "1 to 2000",
        ),
        (
            &["outbox", "requeue", "--all", "--parked-before", "0d"][..],
            "zero",
        ),
        (&["forget", "--scope", SCOPE][..], "--stuck-older-than"),
        (
            &["forget", "--stuck-older-than", "1h", SCOPE, "k"][..],
            "cannot be used",
        ),
        (
            &["forget", SCOPE, "k", "--dry-run"][..],
            "--stuck-older-than",
        ),
        (&["forget", SCOPE, "k", "--yes"][..], "--stuck-older-than"),
        (&["outbox", "requeue", "some-id", "--dry-run"][..], "--all"),
        (&["requeue", SCOPE, "k", "--yes"][..], "--all"),
    ];
    for (args, says) in bad {
        let all = [&["--database-url", url.as_str()][..], args].concat();
        let out = run(&all, None, &[]).await;
        assert_eq!(out.code, Some(2), "{args:?}: {out:?}");
        assert!(out.stderr.contains(says), "{args:?}: {out:?}");
        assert!(out.stdout.is_empty(), "{args:?}: {out:?}");
    }
    B::remove(&url);
}

impl<B: Db> Fixture<B> {
    /// Writes parked messages `{prefix}-{n}-{seq}` to `destination` for `range`, three per
    /// ordering key `{prefix}-{n}`, failed with [`RESET`] and parked two hours ago; their
    /// payload copied from the message `like`. One statement per 30 keys.
    async fn park_many(
        &self,
        like: &str,
        destination: &str,
        prefix: &str,
        range: std::ops::Range<i64>,
    ) {
        let keys: Vec<i64> = range.step_by(3).map(|n| n / 3).collect();
        for chunk in keys.chunks(30) {
            let rows: Vec<String> = chunk
                .iter()
                .flat_map(|k| {
                    (0..3).map(move |seq| {
                        format!(
                            "SELECT '{prefix}-{k}-{seq}' AS id, '{prefix}-{k}' AS k, \
                             {seq} AS seq"
                        )
                    })
                })
                .collect();
            self.exec(&format!(
                "INSERT INTO {t}_outbox (id, destination, payload, scope, {key}, seq, \
                 ordering_key, created_at, next_attempt_at, attempts, last_error, parked) \
                 SELECT c.id, '{destination}', o.payload, o.scope, c.id, c.seq, c.k, {ago}, \
                 {ago}, 5, '{RESET}', TRUE FROM {t}_outbox o CROSS JOIN ({}) c \
                 WHERE o.id = '{like}'",
                rows.join(" UNION ALL "),
                t = self.table(),
                key = B::KEY,
                ago = B::TWO_HOURS_AGO,
            ))
            .await;
        }
    }

    /// `(parked to mail, parked to sms)`.
    async fn parked(&self) -> (i64, i64) {
        let parked = |to: &str| {
            format!(
                "SELECT COUNT(*) FROM {}_outbox WHERE parked = TRUE AND sent_at IS NULL \
                 AND destination = '{to}'",
                self.table()
            )
        };
        (
            B::count(&self.pool, &parked("mail")).await,
            B::count(&self.pool, &parked("sms")).await,
        )
    }

    /// Writes leases `{prefix}-{n}` of `scope` for `range` as a crashed holder leaves them:
    /// in progress, run out two hours ago, created then.
    async fn stuck_many(&self, scope: &str, prefix: &str, range: std::ops::Range<i64>) {
        let rows: Vec<String> = range
            .map(|n| {
                format!(
                    "('{scope}', '{prefix}-{n}', 'in_progress', 1, 1, {ago}, {ago})",
                    ago = B::TWO_HOURS_AGO
                )
            })
            .collect();
        for chunk in rows.chunks(100) {
            self.exec(&format!(
                "INSERT INTO {} (scope, {}, state, token, attempts, locked_until, created_at) \
                 VALUES {}",
                self.table(),
                B::KEY,
                chunk.join(", ")
            ))
            .await;
        }
    }

    /// `(leases not let go of mail.send, of other.scope)`.
    async fn holding(&self) -> (i64, i64) {
        let holding = |scope: &str| {
            format!(
                "SELECT COUNT(*) FROM {} WHERE scope = '{scope}' AND state = 'in_progress' \
                 AND locked_until IS NOT NULL",
                self.table()
            )
        };
        (
            B::count(&self.pool, &holding(SCOPE)).await,
            B::count(&self.pool, &holding("other.scope")).await,
        )
    }
}
