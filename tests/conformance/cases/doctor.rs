//! `Store::doctor` on a healthy deployment, then on one broken on purpose: a missing index, a
//! lease stuck in progress, a parked outbox message, markers older than their retention, a
//! missing table. Each breakage is found by its own check, with what to do.

use std::time::Duration;

use idem::{Checkup, Claimed, Diagnosis, Error, Key, LeaseOptions, Outcome, Severity};

use crate::conformance::Support;
use crate::conformance::ctx::Ctx;

const HOUR: Duration = Duration::from_secs(3600);

/// What every case tells the doctor: a week's purge, one job at a time on the test's pool.
fn checkup() -> Checkup {
    Checkup::new().retention(7 * 24 * HOUR).concurrency(1)
}

fn is_mysql<S: Support>(ctx: &Ctx<S>) -> bool {
    format!("{:?}", ctx.store).contains("\"mysql\"")
}

fn severity(d: &Diagnosis, check: &str) -> Severity {
    d.finding(check)
        .unwrap_or_else(|| panic!("no {check} in {d:#?}"))
        .severity
}

/// A completed marker of `(scope, key)` with one outbox message to `mail`.
async fn complete<S: Support>(ctx: &Ctx<S>, scope: &str, key: &str) {
    let key = Key::new(key).expect("a valid key");
    match ctx.store.claim(scope, &key).await.expect("claim") {
        Claimed::Fresh(mut guard) => {
            guard.outbox().send("mail", &"hello").expect("a message");
            let done = guard.finish(Ok::<(), Error>(())).await;
            assert_eq!(done.expect("commit"), Outcome::Applied(()));
        }
        other => panic!("{scope} / {key} was claimed before: {other:?}"),
    }
}

pub(crate) async fn doctor_finds_a_healthy_deployment_healthy<S: Support>() {
    let ctx = Ctx::<S>::new("doctor_ok", 2).await;
    complete(&ctx, "orders.place", "order-1").await;
    ctx.store
        .set_retention("payments", 30 * 24 * HOUR)
        .await
        .unwrap();
    let diagnosis = ctx.store.doctor(&checkup()).await.expect("doctor");
    assert!(diagnosis.is_healthy(), "{diagnosis:#?}");
    for check in ["schema", "indexes", "bloat", "retention", "leases", "pool"] {
        assert_eq!(severity(&diagnosis, check), Severity::Ok, "{diagnosis:#?}");
    }
    // The message is pending, not parked, and not yet overdue.
    assert_eq!(severity(&diagnosis, "outbox"), Severity::Ok);
    ctx.cleanup().await;
}

pub(crate) async fn doctor_finds_each_breakage_and_says_what_to_do<S: Support>() {
    let ctx = Ctx::<S>::new("doctor_bad", 2).await;
    let table = ctx.store.table().to_owned();
    // Old markers: one of a scope with a 1 h window, one of a scope purged at 1 h.
    complete(&ctx, "payments", "old-1").await;
    complete(&ctx, "orders.place", "old-2").await;
    ctx.store.set_retention("payments", HOUR).await.unwrap();
    ctx.exec(&format!(
        "UPDATE {table} SET completed_at = {}",
        S::TWO_HOURS_AGO
    ))
    .await;
    // A lease that ran out two hours ago and was never taken over.
    let key = Key::new("charge-1").unwrap();
    let options = LeaseOptions::new(Duration::from_secs(30));
    let Claimed::Fresh(lease) = ctx
        .store
        .lease("billing.charge", &key, options)
        .await
        .unwrap()
    else {
        panic!("the lease was taken before")
    };
    ctx.exec(&format!(
        "UPDATE {table} SET locked_until = {} WHERE scope = 'billing.charge'",
        S::TWO_HOURS_AGO
    ))
    .await;
    // A parked message, and a missing index.
    ctx.exec(&format!(
        "UPDATE {table}_outbox SET parked = (1 = 1) WHERE scope = 'payments'"
    ))
    .await;
    let (index, drop_index) = match is_mysql(&ctx) {
        true => (
            "idem_completed_at".to_owned(),
            format!("ALTER TABLE {table} DROP INDEX idem_completed_at"),
        ),
        false => {
            let index = format!("{table}_completed_at");
            (index.clone(), format!("DROP INDEX {index}"))
        }
    };
    ctx.exec(&drop_index).await;

    let diagnosis = ctx
        .store
        .doctor(&checkup().retention(HOUR))
        .await
        .expect("doctor");
    assert_eq!(diagnosis.worst(), Severity::Problem, "{diagnosis:#?}");
    let indexes = diagnosis.finding("indexes").unwrap();
    assert_eq!(indexes.severity, Severity::Problem);
    assert!(indexes.summary.contains(&index), "{indexes:?}");
    let fix = indexes.fix.as_deref().unwrap();
    assert!(fix.contains(&index) && fix.contains(&table), "{fix}");
    let retention = diagnosis.finding("retention").unwrap();
    assert_eq!(retention.severity, Severity::Warning);
    assert!(
        retention.summary.contains("1 of payments (window 1h)")
            && retention
                .summary
                .contains("1 of other scopes (older than 1h)"),
        "{retention:?}"
    );
    let leases = diagnosis.finding("leases").unwrap();
    assert_eq!(leases.severity, Severity::Warning);
    assert!(
        leases.summary.starts_with("1 markers in progress"),
        "{leases:?}"
    );
    assert!(leases.fix.as_deref().unwrap().contains("idem stuck"));
    let outbox = diagnosis.finding("outbox").unwrap();
    assert_eq!(outbox.severity, Severity::Problem);
    assert!(
        outbox.summary.starts_with("1 outbox messages are parked"),
        "{outbox:?}"
    );

    // The fix the doctor gives for the index, run as given, heals that check.
    let statement = fix
        .trim_start_matches("run: ")
        .split("; (PostgreSQL")
        .next()
        .unwrap()
        .to_owned();
    ctx.exec(&statement).await;
    let diagnosis = ctx.store.doctor(&checkup()).await.expect("doctor");
    assert_eq!(
        severity(&diagnosis, "indexes"),
        Severity::Ok,
        "{diagnosis:#?}"
    );
    // A week's retention for the rest: only the payment is old now.
    let retention = diagnosis.finding("retention").unwrap();
    assert!(!retention.summary.contains("other scopes"), "{retention:?}");

    // A missing table of the schema: the retention table of version 3.
    ctx.exec(&format!("DROP TABLE {table}_retention")).await;
    let diagnosis = ctx.store.doctor(&checkup()).await.expect("doctor");
    let schema = diagnosis.finding("schema").unwrap();
    assert_eq!(schema.severity, Severity::Problem, "{diagnosis:#?}");
    assert!(
        schema.summary.contains(&format!("{table}_retention")),
        "{schema:?}"
    );
    assert_eq!(severity(&diagnosis, "retention"), Severity::Skipped);

    // A column a later version added to a table an earlier one made: the marker table's
    // `error` (version 3), missing until `migrate` adds it, as the fix says.
    ctx.store.migrate().await.expect("migrate");
    drop(lease);
    if let Some(drop_index) = S::DROP_FAILED_INDEX {
        ctx.exec(&drop_index.replace("{table}", &table)).await;
    }
    ctx.exec(&format!("ALTER TABLE {table} DROP COLUMN error"))
        .await;
    let diagnosis = ctx.store.doctor(&checkup()).await.expect("doctor");
    let schema = diagnosis.finding("schema").unwrap();
    assert_eq!(schema.severity, Severity::Problem, "{diagnosis:#?}");
    assert!(
        schema
            .summary
            .contains(&format!("missing columns: {table}.error")),
        "{schema:?}"
    );
    assert!(schema.fix.as_deref().unwrap().contains("Store::migrate()"));
    ctx.store.migrate().await.expect("migrate adds the column");
    let diagnosis = ctx.store.doctor(&checkup()).await.expect("doctor");
    assert_eq!(
        severity(&diagnosis, "schema"),
        Severity::Ok,
        "{diagnosis:#?}"
    );
    ctx.cleanup().await;
}
