//! `idem doctor` and `idem retention`: the exit codes a cron job acts on, JSON, and retention
//! windows that the code and the tool share.

use std::time::Duration;

use idem::Key;
use serde_json::json;

use crate::Db;
use crate::cli_support::Fixture;

/// Healthy is 0; a stuck lease makes it 6 (a warning); a parked message 7 (a problem).
pub(crate) async fn doctor_exits_0_healthy_6_warnings_7_problems<B: Db>() {
    let fx = Fixture::<B>::new("doctor").await;
    fx.complete("billing.top_up", &Key::new("order-7").unwrap())
        .await;
    let healthy = fx
        .idem(&["--json", "doctor", "--retention", "7d"])
        .await
        .ok();
    let doc = healthy.json();
    assert_eq!(
        (doc["healthy"].clone(), doc["worst"].clone()),
        (json!(true), json!("ok"))
    );
    let checks: Vec<&str> = doc["findings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["check"].as_str().unwrap())
        .collect();
    assert_eq!(
        checks,
        [
            "schema",
            "indexes",
            "bloat",
            "retention",
            "leases",
            "outbox",
            "pool",
            "ack_timeout",
            "pooler",
            "clock",
            "wal_slots"
        ]
    );

    // A lease that ran out two hours ago: exit 6, and the text says what to do.
    let _lease = fx.lease("billing.charge", "charge-1", 30).await;
    fx.expire("billing.charge", "charge-1").await;
    let warned = fx.idem(&["doctor"]).await;
    assert_eq!(
        (warned.code, warned.stderr.as_str()),
        (Some(6), ""),
        "{warned:?}"
    );
    assert!(
        warned
            .stdout
            .lines()
            .any(|l| l.starts_with("warning  leases"))
            && warned.stdout.contains("fix: `idem stuck` lists them"),
        "{warned:?}"
    );

    // A parked message: exit 7.
    B::place(&fx.store, "order-8", 1).await;
    fx.exec(&format!(
        "UPDATE {}_outbox SET parked = (1 = 1)",
        fx.table()
    ))
    .await;
    let broken = fx
        .idem(&["--json", "doctor", "--ack-timeout", "30s", "--wait", "30s"])
        .await;
    assert_eq!(
        (broken.code, broken.stderr.as_str()),
        (Some(7), ""),
        "{broken:?}"
    );
    let doc = broken.json();
    assert_eq!(doc["worst"], json!("problem"));
    let severity = |check: &str| {
        let findings = doc["findings"].as_array().unwrap();
        let f = findings.iter().find(|f| f["check"] == check).unwrap();
        f["severity"].as_str().unwrap().to_owned()
    };
    assert_eq!(severity("outbox"), "problem");
    assert_eq!(severity("ack_timeout"), "problem");
    assert_eq!(severity("leases"), "warning");
    fx.cleanup().await;
}

/// A window set in code is what the tool lists and purges by, and one set by the tool is
/// what the code reads.
pub(crate) async fn retention_windows_are_shared_by_the_code_and_the_tool<B: Db>() {
    let fx = Fixture::<B>::new("retention").await;
    fx.store
        .set_retention("payments", Duration::from_secs(30 * 86_400))
        .await
        .unwrap();
    let set = fx.idem(&["retention", "set", "webhooks", "1h"]).await.ok();
    assert!(
        set.stdout
            .contains("\"webhooks\" keeps its completed markers for 1h"),
        "{set:?}"
    );
    let windows: Vec<(String, Duration)> = fx
        .store
        .retentions()
        .await
        .unwrap()
        .into_iter()
        .map(|r| (r.scope, r.keep))
        .collect();
    assert_eq!(
        windows,
        [
            ("payments".to_owned(), Duration::from_secs(30 * 86_400)),
            ("webhooks".to_owned(), Duration::from_secs(3600)),
        ]
    );
    let list = fx.idem(&["--json", "retention", "list"]).await.ok().json();
    assert_eq!(
        list["retention"],
        json!([
            {"scope": "payments", "keep_ms": 2_592_000_000_u64},
            {"scope": "webhooks", "keep_ms": 3_600_000},
        ])
    );

    // Two hours old: the webhook's goes by its window, the others stay without --older-than.
    for scope in ["payments", "webhooks", "other"] {
        fx.complete(scope, &Key::new("old").unwrap()).await;
    }
    fx.exec(&format!(
        "UPDATE {} SET completed_at = {}",
        fx.table(),
        B::TWO_HOURS_AGO
    ))
    .await;
    let purged = fx.idem(&["--json", "purge"]).await.ok().json();
    assert_eq!(purged["deleted"], json!(1));
    assert_eq!(fx.markers_of("webhooks").await, 0);
    let purged = fx
        .idem(&["--json", "purge", "--older-than", "1h"])
        .await
        .ok()
        .json();
    assert_eq!(purged["deleted"], json!(1));
    assert_eq!(
        (
            fx.markers_of("other").await,
            fx.markers_of("payments").await
        ),
        (0, 1)
    );

    let cleared = fx.idem(&["--json", "retention", "clear", "payments"]).await;
    assert_eq!(cleared.ok().json()["cleared"], json!(true));
    assert_eq!(fx.store.retentions().await.unwrap().len(), 1);
    // A bad window is refused before the database is touched.
    let zero = fx.idem(&["retention", "set", "payments", "0d"]).await;
    assert_eq!(zero.code, Some(2), "{zero:?}");
    assert_eq!(fx.store.retentions().await.unwrap().len(), 1);
    fx.cleanup().await;
}
