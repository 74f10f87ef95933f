//! The cases, each written once for every backend.

use std::collections::BTreeMap;

use idem::{Key, Marker, MarkerState};
use serde_json::json;

use crate::Db;
use crate::cli_support::{Fixture, as_fields, run, unique};

/// `fields` (readable or JSON) show `m`, which the store read just before the binary ran:
/// the same text for every field but the lease's time left, which can only have shrunk.
fn assert_shows(fields: &BTreeMap<String, String>, m: &Marker, lease: &str) {
    let dash = |t: &Option<String>| t.clone().unwrap_or_else(|| "-".to_owned());
    let number = |n: Option<i64>| n.map_or_else(|| "-".to_owned(), |n| n.to_string());
    let state = match m.state {
        MarkerState::Completed => "completed",
        _ => "in_progress",
    };
    let expected = [
        ("scope", m.scope.clone()),
        ("key", m.key.clone()),
        ("state", state.to_owned()),
        ("attempts", m.attempts.to_string()),
        ("token", number(m.token)),
        ("created_at", m.created_at.clone()),
        ("completed_at", dash(&m.completed_at)),
        ("locked_until", dash(&m.locked_until)),
        ("error", dash(&m.error)),
    ];
    for (name, want) in expected {
        assert_eq!(fields.get(name), Some(&want), "{name} of {fields:?}");
    }
    let shown = &fields["lease"];
    assert!(
        shown.starts_with(lease),
        "lease {shown:?}, expected {lease:?}"
    );
    match m.lease_ms_left {
        None => assert_eq!(fields["lease_ms_left"], "-"),
        Some(before) => {
            let now: i64 = fields["lease_ms_left"].parse().expect("a number");
            assert!(
                now <= before && (now > 0) == (before > 0),
                "{now} after {before}"
            );
        }
    }
}

pub(crate) async fn inspect_prints_the_stored_marker<B: Db>() {
    let fx = Fixture::<B>::new("inspect").await;
    fx.complete("billing.top_up", &Key::new("order-7").unwrap())
        .await;
    fx.complete("tenant.sync", &Key::new(&("acme", 17)).unwrap())
        .await;
    let _live = fx.lease("billing.charge", "charge-live", 300).await;
    let _old = fx.lease("billing.charge", "charge-old", 300).await;
    fx.expire("billing.charge", "charge-old").await;

    let cases = [
        ("billing.top_up", "order-7", "-"),
        ("tenant.sync", "4:acme|2:17", "-"),
        ("billing.charge", "charge-live", "live"),
        ("billing.charge", "charge-old", "expired"),
    ];
    for (scope, key, lease) in cases {
        let before = fx.store.inspect(scope, key).await.unwrap().expect("marker");
        let doc = fx
            .idem(&["--json", "inspect", scope, key])
            .await
            .ok()
            .json();
        assert_eq!(doc["found"], json!(true));
        let mut fields = as_fields(&doc);
        assert_eq!(fields.remove("found").as_deref(), Some("true"));
        assert_shows(&fields, &before, if lease == "-" { "-" } else { lease });
        assert_eq!(fields.len(), 13, "{fields:?}");
        assert_eq!(
            (&fields["value_bytes"][..], &fields["response_status"][..]),
            ("-", "-")
        );

        let text = fx.idem(&["inspect", scope, key]).await.ok().fields();
        assert_shows(&text, &before, lease);
        assert_eq!(
            text.keys().collect::<Vec<_>>(),
            fields.keys().collect::<Vec<_>>()
        );

        // The key printed is the key to type.
        let again = fx.idem(&["--json", "inspect", scope, &fields["key"]]).await;
        assert_eq!(again.ok().json()["created_at"], doc["created_at"]);
    }

    // What is stored with a marker: a handler's `replay` value (its JSON's length), and a
    // response the HTTP layer stores (its status too; the layer's format is pinned by its
    // own tests).
    match fx
        .store
        .claim("billing.quote", &Key::new("q-1").unwrap())
        .await
    {
        Ok(idem::Claimed::Fresh(guard)) => {
            let value = guard.finish_replay(Ok::<_, idem::Error>([7, 8, 9])).await;
            assert_eq!(value.unwrap(), idem::Outcome::Applied([7, 8, 9]));
        }
        other => panic!("billing.quote was claimed before: {other:?}"),
    }
    fx.complete("invoices.send", &Key::new("2:_|6:inv-42").unwrap())
        .await;
    let response = r#"{"status":201,"headers":[["location","/invoices/42"]],"body":"b2s="}"#;
    fx.exec(&format!(
        "UPDATE {} SET result = '{response}' WHERE scope = 'invoices.send'",
        fx.table()
    ))
    .await;
    for (scope, key, bytes, status) in [
        ("billing.quote", "q-1", "7", "-"),
        ("invoices.send", "2:_|6:inv-42", "68", "201"),
    ] {
        let doc = fx
            .idem(&["--json", "inspect", scope, key])
            .await
            .ok()
            .json();
        let text = fx.idem(&["inspect", scope, key]).await.ok().fields();
        for fields in [as_fields(&doc), text] {
            assert_eq!(fields["value_bytes"], bytes, "{scope}: {fields:?}");
            assert_eq!(fields["response_status"], status, "{scope}: {fields:?}");
        }
    }

    // A tuple key part by part, a key from standard input, the URL from DATABASE_URL.
    let parts = fx
        .idem(&[
            "--json",
            "inspect",
            "tenant.sync",
            "--part",
            "acme",
            "--part",
            "17",
        ])
        .await;
    assert_eq!(parts.ok().json()["key"], json!("4:acme|2:17"));
    let piped = fx
        .idem_stdin(&["--json", "inspect", "billing.top_up", "-"], b"order-7\n")
        .await;
    assert_eq!(piped.ok().json()["key"], json!("order-7"));
    let from_env = run(
        &[
            "--table",
            fx.table(),
            "--json",
            "inspect",
            "billing.top_up",
            "order-7",
        ],
        None,
        &[("DATABASE_URL", &fx.url)],
    )
    .await;
    assert_eq!(from_env.ok().json()["state"], json!("completed"));

    // No marker: exit 3, and the document says so.
    let absent = fx
        .idem(&["--json", "inspect", "billing.top_up", "order-8"])
        .await;
    assert_eq!((absent.code, absent.stderr.as_str()), (Some(3), ""));
    assert_eq!(
        absent.json(),
        json!({"table": fx.table(), "scope": "billing.top_up", "key": "order-8", "found": false})
    );
    let absent = fx.idem(&["inspect", "billing.top_up", "order-8"]).await;
    assert_eq!((absent.code, absent.stderr.as_str()), (Some(3), ""));
    assert_eq!(
        absent.stdout,
        format!(
            "no marker for scope \"billing.top_up\", key \"order-8\": no delivery claimed it, \
             or it was forgotten or purged (looked in table {}; a store given another table \
             with `Store::with_table` keeps its markers there: pass it with --table or \
             IDEM_TABLE)\n",
            fx.table()
        )
    );
    fx.cleanup().await;
}

pub(crate) async fn stuck_lists_leases_in_progress<B: Db>() {
    let fx = Fixture::<B>::new("stuck").await;
    let released = fx.lease("billing.charge", "charge-released", 300).await;
    let failed = released
        .finish::<(), idem::Error>(Err(idem::Error::Serialize("the call failed".into())))
        .await;
    assert!(failed.is_err(), "{failed:?}");
    let _old = fx.lease("billing.charge", "charge-old", 300).await;
    fx.expire("billing.charge", "charge-old").await;
    let _live = fx.lease("billing.charge", "charge-live", 300).await;
    let done = fx.lease("billing.charge", "charge-done", 300).await;
    let outcome = done.finish::<(), idem::Error>(Ok(())).await;
    assert_eq!(outcome.expect("finish"), idem::Outcome::Applied(()));
    let _mail = fx.lease("mail.send", "mail-1", 600).await;
    fx.complete("billing.top_up", &Key::new("order-7").unwrap())
        .await;

    // One scope: released and run-out leases first, each shown as the store reads it.
    let listed = fx
        .store
        .list_in_progress("billing.charge", 10)
        .await
        .unwrap();
    let doc = fx
        .idem(&["--json", "stuck", "--scope", "billing.charge"])
        .await
        .ok()
        .json();
    assert_eq!(
        (&doc["table"], &doc["scope"], &doc["limit"]),
        (&json!(fx.table()), &json!("billing.charge"), &json!(50))
    );
    let markers = doc["markers"].as_array().expect("a list");
    let keys: Vec<_> = markers.iter().map(|m| m["key"].clone()).collect();
    assert_eq!(
        keys,
        [
            json!("charge-released"),
            json!("charge-old"),
            json!("charge-live")
        ]
    );
    for ((shown, before), lease) in markers
        .iter()
        .zip(&listed)
        .zip(["released", "expired", "live"])
    {
        let fields = as_fields(shown);
        assert_shows(&fields, before, lease);
        assert_eq!(fields.len(), 13, "{fields:?}");
    }

    let all = fx.idem(&["--json", "stuck"]).await.ok().json();
    assert_eq!(all["scope"], json!(null));
    let keys: Vec<_> = all["markers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["key"].clone())
        .collect();
    assert_eq!(
        keys,
        [
            json!("charge-released"),
            json!("charge-old"),
            json!("charge-live"),
            json!("mail-1")
        ]
    );

    // Every scope, readable: a header and one aligned row per marker.
    let text = fx.idem(&["stuck"]).await.ok().stdout;
    let rows: Vec<Vec<&str>> = text
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows[0][..5], ["SCOPE", "KEY", "ATTEMPTS", "TOKEN", "LEASE"]);
    let keys: Vec<_> = rows[1..].iter().map(|r| (r[0], r[1], r[4])).collect();
    assert_eq!(
        keys,
        [
            ("billing.charge", "charge-released", "released:"),
            ("billing.charge", "charge-old", "expired"),
            ("billing.charge", "charge-live", "live,"),
            ("mail.send", "mail-1", "live,"),
        ],
        "{text}"
    );
    // Aligned: every key starts under the header's KEY.
    let key_column = text.lines().next().unwrap().find("KEY").unwrap();
    for (line, (_, key, _)) in text.lines().skip(1).zip(&keys) {
        assert!(line[key_column..].starts_with(key), "{text}");
    }

    // A limit, and a scope with nothing in progress.
    let first = fx.idem(&["stuck", "--limit", "1"]).await.ok().stdout;
    assert_eq!(first.lines().count(), 3, "{first}");
    assert!(
        first.lines().nth(1).unwrap().contains("charge-released"),
        "{first}"
    );
    assert!(first.contains("raise --limit"), "{first}");
    let none = fx.idem(&["stuck", "--scope", "billing.top_up"]).await.ok();
    assert_eq!(
        none.stdout,
        format!(
            "no marker of scope \"billing.top_up\" is in progress in table {}\n",
            fx.table()
        )
    );
    let none = fx
        .idem(&["--json", "stuck", "--scope", "billing.top_up"])
        .await
        .ok();
    assert_eq!(none.json()["markers"], json!([]));
    fx.cleanup().await;
}

pub(crate) async fn forget_deletes_one_marker<B: Db>() {
    let fx = Fixture::<B>::new("forget").await;
    let order7 = Key::new("order-7").unwrap();
    fx.complete("billing.top_up", &order7).await;
    fx.complete("billing.top_up", &Key::new("order-8").unwrap())
        .await;
    fx.complete("tenant.sync", &Key::new(&("acme", 17)).unwrap())
        .await;
    assert_eq!(fx.markers().await, 3);

    let out = fx.idem(&["forget", "billing.top_up", "order-7"]).await.ok();
    assert_eq!(
        out.stdout,
        "forgot scope \"billing.top_up\", key \"order-7\": its next delivery runs again\n"
    );
    assert_eq!(
        fx.store.inspect("billing.top_up", &order7).await.unwrap(),
        None
    );
    assert_eq!(fx.markers().await, 2);
    // Gone for the handlers too: the job is claimed afresh.
    fx.complete("billing.top_up", &order7).await;
    assert_eq!(fx.markers().await, 3);

    let out = fx
        .idem(&[
            "--json",
            "forget",
            "tenant.sync",
            "--part",
            "acme",
            "--part",
            "17",
        ])
        .await
        .ok();
    assert_eq!(
        out.json(),
        json!({"table": fx.table(), "scope": "tenant.sync", "key": "4:acme|2:17", "forgotten": true})
    );
    assert_eq!(fx.markers_of("tenant.sync").await, 0);

    // Absent: said so, exit 0, nothing else touched.
    let out = fx
        .idem(&["forget", "tenant.sync", "4:acme|2:17"])
        .await
        .ok();
    assert_eq!(
        out.stdout,
        format!(
            "no marker for scope \"tenant.sync\", key \"4:acme|2:17\": nothing to forget \
             (looked in table {}; a store given another table with `Store::with_table` keeps \
             its markers there: pass it with --table or IDEM_TABLE)\n",
            fx.table()
        )
    );
    let out = fx
        .idem(&["--json", "forget", "billing.top_up", "order-9"])
        .await
        .ok();
    assert_eq!(out.json()["forgotten"], json!(false));
    assert_eq!(fx.markers().await, 2);
    fx.cleanup().await;
}

pub(crate) async fn purge_deletes_what_completed_before_the_age<B: Db>() {
    let fx = Fixture::<B>::new("purge").await;
    for n in 1..=3 {
        fx.complete("aged", &Key::new(&n).unwrap()).await;
    }
    for n in 4..=5 {
        fx.complete("young", &Key::new(&n).unwrap()).await;
    }
    let _held = fx.lease("billing.charge", "charge-1", 300).await;
    let table = fx.table().to_owned();
    fx.exec(&format!(
        "UPDATE {table} SET completed_at = {0}, created_at = {0} WHERE scope = 'aged'",
        B::TWO_HOURS_AGO
    ))
    .await;
    // An old lease is no completed job: purges leave it.
    fx.exec(&format!(
        "UPDATE {table} SET created_at = {} WHERE scope = 'billing.charge'",
        B::TWO_HOURS_AGO
    ))
    .await;
    assert_eq!(fx.markers().await, 6);

    let none = fx
        .idem(&["--json", "purge", "--older-than", "3h"])
        .await
        .ok();
    assert_eq!(none.json()["deleted"], json!(0));
    assert_eq!(fx.markers().await, 6);

    let before = fx.markers().await;
    let doc = fx
        .idem(&["--json", "purge", "--older-than", "1h"])
        .await
        .ok()
        .json();
    let after = fx.markers().await;
    assert_eq!(
        doc,
        json!({"table": table, "older_than": "1h", "older_than_ms": 3_600_000, "deleted": 3})
    );
    assert_eq!(before - after, 3);
    assert_eq!(
        (fx.markers_of("aged").await, fx.markers_of("young").await),
        (0, 2)
    );
    assert_eq!(fx.markers_of("billing.charge").await, 1);

    // Weeks and days: the markers left are two hours old.
    for (age, ms) in [("1w", 604_800_000_u64), ("2d", 172_800_000)] {
        let doc = fx
            .idem(&["--json", "purge", "--older-than", age])
            .await
            .ok()
            .json();
        assert_eq!(
            doc,
            json!({"table": table, "older_than": age, "older_than_ms": ms, "deleted": 0})
        );
    }

    let text = fx.idem(&["purge", "--older-than", "90m"]).await.ok().stdout;
    assert_eq!(
        text,
        format!(
            "deleted 0 markers of jobs completed more than 90m ago (or longer ago than their \
             scope's retention window) from {table}\n"
        )
    );
    fx.cleanup().await;
}

/// Arguments, standard input, and what the error must say.
type BadInput<'a> = (&'a [&'a str], Option<&'a [u8]>, &'a str);

pub(crate) async fn bad_input_exits_2_and_writes_nothing<B: Db>() {
    let fx = Fixture::<B>::new("bad").await;
    let order7 = Key::new("order-7").unwrap();
    fx.complete("billing.top_up", &order7).await;
    // Aged, so that a purge that took a bad age for any age at all would delete it.
    fx.exec(&format!(
        "UPDATE {} SET completed_at = {}",
        fx.table(),
        B::TWO_HOURS_AGO
    ))
    .await;
    let long_key = "k".repeat(256);
    let long_scope = "s".repeat(256);
    let cases: [BadInput<'_>; 14] = [
        (&["purge", "--older-than", "7x"], None, "unknown unit `x`"),
        (&["purge", "--older-than", "7"], None, "no unit"),
        (&["purge", "--older-than", "0s"], None, "retention of zero"),
        (
            &["purge", "--older-than", "1h30m"],
            None,
            "unknown unit `h30m`",
        ),
        (
            &["purge", "--older-than", "99999999999999999d"],
            None,
            "too long",
        ),
        (&["forget", "billing.top_up", ""], None, "the key is empty"),
        (&["forget", "billing.top_up", &long_key], None, "256 bytes"),
        (
            &["forget", "billing.top_up", "-"],
            Some(b"order-7\0"),
            "NUL byte",
        ),
        (
            &["forget", "billing.top_up", "--part", "order", "--part", ""],
            None,
            "empty",
        ),
        (&["forget", "", "order-7"], None, "invalid scope"),
        (&["forget", &long_scope, "order-7"], None, "invalid scope"),
        (&["stuck", "--scope", ""], None, "invalid scope"),
        (&["stuck", "--limit", "0"], None, "--limit"),
        (&["inspect", "billing.top_up"], None, "<KEY>"),
    ];
    for (args, stdin, says) in cases {
        let out = match stdin {
            Some(input) => fx.idem_stdin(args, input).await,
            None => fx.idem(args).await,
        };
        assert_eq!(
            (out.code, out.stdout.as_str()),
            (Some(2), ""),
            "{args:?}: {out:?}"
        );
        assert!(
            out.stderr.contains(says),
            "{args:?} should say {says:?}: {out:?}"
        );
    }

    // The units a retention takes, said in full.
    let out = fx.idem(&["purge", "--older-than", "7x"]).await;
    assert_eq!(
        out.stderr,
        "error: invalid value '7x' for '--older-than <AGE>': unknown unit `x`: write a whole \
         number and one unit, w (weeks), d (days), h (hours), m (minutes) or s (seconds): 2w, \
         7d, 12h, 30m or 90s\n\nFor more information, try '--help'.\n"
    );

    // The table and the URL, given whole.
    let url = fx.url.clone();
    let bad_table = [
        "--database-url",
        &url,
        "--table",
        "jobs; DROP TABLE x",
        "forget",
        "billing.top_up",
        "order-7",
    ];
    let urls: [(&[&str], &str); 4] = [
        (&bad_table, "invalid table name"),
        (
            &[
                "--database-url",
                "redis://u:secret@127.0.0.1/0",
                "purge",
                "--older-than",
                "1h",
            ],
            "unknown database URL scheme `redis`",
        ),
        (
            &[
                "--database-url",
                "postgres://u:secret@127.0.0.1:port/test",
                "purge",
                "--older-than",
                "1h",
            ],
            "cannot read the database URL",
        ),
        (
            &["purge", "--older-than", "1h"],
            "pass --database-url URL or set DATABASE_URL",
        ),
    ];
    for (args, says) in urls {
        let out = run(args, None, &[]).await;
        assert_eq!(
            (out.code, out.stdout.as_str()),
            (Some(2), ""),
            "{args:?}: {out:?}"
        );
        assert!(
            out.stderr.contains(says),
            "{args:?} should say {says:?}: {out:?}"
        );
        assert!(!out.stderr.contains("secret"), "{out:?}");
    }

    // Nothing was written: the aged marker is still there, and still stops its job.
    assert_eq!(fx.markers().await, 1);
    assert!(
        fx.store
            .inspect("billing.top_up", &order7)
            .await
            .unwrap()
            .is_some()
    );
    fx.cleanup().await;
}

pub(crate) async fn unreachable_database_exits_1_naming_the_url<B: Db>() {
    let url = B::unreachable_url();
    let out = run(&["--database-url", &url, "stuck"], None, &[]).await;
    assert_eq!((out.code, out.stdout.as_str()), (Some(1), ""), "{out:?}");
    let shown = url.replace(":hunter2@", ":***@");
    // A server is reached; an SQLite file is opened, and no server runs for it.
    let said = match url.starts_with("sqlite:") {
        true => format!("cannot open the SQLite database at {shown}:"),
        false => format!("cannot reach the database at {shown}:"),
    };
    assert!(out.stderr.contains(&said), "{out:?}");
    assert_eq!(
        out.stderr.contains("server is running"),
        !url.starts_with("sqlite:"),
        "{out:?}"
    );
    assert!(!out.stderr.contains("hunter2"), "{out:?}");
    if let Some(path) = url.strip_prefix("sqlite:") {
        assert!(
            !std::path::Path::new(path).exists(),
            "the tool created {path}"
        );
    }

    // Reached, but no such table: the database's refusal, exit 1.
    let fx = Fixture::<B>::new("unreach").await;
    let absent = format!("{}_absent", fx.table());
    let out = run(
        &["--database-url", &fx.url, "--table", &absent, "stuck"],
        None,
        &[],
    )
    .await;
    assert_eq!((out.code, out.stdout.as_str()), (Some(1), ""), "{out:?}");
    // A mistyped --table: no such table, how to pass the right one, and the marker tables
    // that are there; no advice to migrate.
    assert!(
        out.stderr
            .contains(&format!("no table {absent} in the database"))
            && out.stderr.contains("as --table (or IDEM_TABLE)")
            && out.stderr.contains(fx.table())
            && !out.stderr.contains("migrate"),
        "{out:?}"
    );
    fx.cleanup().await;
}

/// `IDEM_TABLE` names the table when `--table` does not, as `DATABASE_URL` does the URL;
/// `--table` wins over it.
pub(crate) async fn idem_table_names_the_table<B: Db>() {
    let fx = Fixture::<B>::new("env_table").await;
    fx.complete("billing.top_up", &Key::new("order-7").unwrap())
        .await;
    let url = fx.url.clone();
    let args = [
        "--database-url",
        url.as_str(),
        "--json",
        "inspect",
        "billing.top_up",
        "order-7",
    ];

    let found = run(&args, None, &[("IDEM_TABLE", fx.table())]).await;
    assert_eq!(found.ok().json()["state"], json!("completed"));

    // Another table named by it: no marker there, and the message says where it looked.
    let text = [
        "--database-url",
        url.as_str(),
        "inspect",
        "billing.top_up",
        "order-7",
    ];
    let (other, mine) = (unique("cli_other"), fx.table().to_owned());
    let store = idem::Store::new(fx.pool.clone())
        .with_table(&other)
        .unwrap();
    store.migrate().await.unwrap();
    let absent = run(&text, None, &[("IDEM_TABLE", &other)]).await;
    assert_eq!(
        (absent.code, absent.stderr.as_str()),
        (Some(3), ""),
        "{absent:?}"
    );
    assert_eq!(
        absent.stdout,
        format!(
            "no marker for scope \"billing.top_up\", key \"order-7\": no delivery claimed it, \
             or it was forgotten or purged (looked in table {other}; a store given another \
             table with `Store::with_table` keeps its markers there: pass it with --table or \
             IDEM_TABLE)\n"
        )
    );
    let mut flag = vec!["--table", mine.as_str()];
    flag.extend_from_slice(&text);
    let found = run(&flag, None, &[("IDEM_TABLE", &other)]).await;
    assert_eq!(found.ok().fields()["state"], "completed");
    fx.exec(&format!("DROP TABLE {other}")).await;
    fx.cleanup().await;
}
