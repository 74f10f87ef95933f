//! `idem failed --group-by error`, `idem requeue --all` and `idem audit`: 300 failed jobs in
//! two groups of errors (one failed by a real lease, the rest written as its marker was),
//! grouped, requeued by group behind a dry run and a confirmation, and the one action audited;
//! every change counted in the database.

use serde_json::json;

use crate::Db;
use crate::cli_support::{Fixture, run};

pub(crate) const SCOPE: &str = "billing.charge";

/// The jobs of each group.
const DECLINED_JOBS: i64 = 180;
const TIMEOUT_JOBS: i64 = 120;

/// The second group's error.
pub(crate) const TIMEOUT: &str = "gateway timeout after 30s";

pub(crate) async fn bulk_requeue_acts_on_one_group_behind_a_dry_run_and_a_confirmation<B: Db>() {
    let fx = Fixture::<B>::new("bulk").await;
    // One job failed for good by a real lease: its marker is what the others copy.
    let lease = fx.lease(SCOPE, "declined-0", 30).await;
    let declined = Err(lease.permanent(idem::Error::Serialize("card declined".to_owned())));
    match lease.finish::<(), _>(declined).await {
        Ok(idem::Outcome::Failed(_)) => {}
        other => panic!("expected Failed, got {other:?}"),
    }
    let marker = fx
        .store
        .inspect(SCOPE, "declined-0")
        .await
        .unwrap()
        .unwrap();
    let declined = marker.error.expect("the failure's error");
    assert!(!declined.contains(['\'', '\\']), "{declined}");
    fx.fail_many("declined", 1..DECLINED_JOBS, &declined).await;
    fx.fail_many("timeout", 0..TIMEOUT_JOBS, TIMEOUT).await;
    let declined_id = idem::FailureGroup::id_of(SCOPE, &declined);
    let timeout_id = idem::FailureGroup::id_of(SCOPE, TIMEOUT);
    let before = fx.counts(&declined).await;
    assert_eq!(before, (DECLINED_JOBS, TIMEOUT_JOBS, 0));

    // Grouped by the database: two groups, the larger first, with exact counts.
    let listed = fx
        .idem(&["--json", "failed", "--group-by", "error"])
        .await
        .ok()
        .json();
    let groups = listed["groups"].as_array().unwrap();
    assert_eq!(groups.len(), 2, "{listed}");
    let summary: Vec<_> = groups
        .iter()
        .map(|g| (g["id"].clone(), g["scope"].clone(), g["count"].clone()))
        .collect();
    assert_eq!(
        summary,
        [
            (json!(declined_id), json!(SCOPE), json!(DECLINED_JOBS)),
            (json!(timeout_id), json!(SCOPE), json!(TIMEOUT_JOBS)),
        ]
    );
    assert_eq!(groups[1]["error"], json!(TIMEOUT));
    let first = groups[0]["first_failed_at"].as_str().unwrap();
    let last = groups[0]["last_failed_at"].as_str().unwrap();
    assert!(
        first < last,
        "{first} < {last}: the copies failed before the real one"
    );
    let text = fx
        .idem(&["failed", "--group-by", "error"])
        .await
        .ok()
        .stdout;
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(lines[0].starts_with("GROUP"), "{text}");
    let cells: Vec<&str> = lines[2].split_whitespace().collect();
    assert_eq!(&cells[..3], [timeout_id.as_str(), SCOPE, "120"], "{text}");

    // A dry run counts and names them, and changes nothing.
    let group = ["requeue", "--all", "--group", &timeout_id];
    let dry = fx.idem(&[&group[..], &["--dry-run"]].concat()).await.ok();
    assert!(
        dry.stdout
            .starts_with("dry run: would requeue 120 failed jobs of table"),
        "{dry:?}"
    );
    let dry = fx
        .idem(&[&["--json"], &group[..], &["--dry-run"]].concat())
        .await
        .ok()
        .json();
    assert_eq!(
        (&dry["count"], &dry["dry_run"]),
        (&json!(120), &json!(true))
    );
    let shown = dry["markers"].as_array().unwrap();
    assert_eq!(shown.len(), 20, "{dry}");
    assert!(shown.iter().all(|m| m["error"] == json!(TIMEOUT)), "{dry}");
    assert_eq!(fx.counts(&declined).await, before);

    // More than 100 without --yes: refused, nothing changed.
    let refused = fx.idem(&group).await;
    assert_eq!(refused.code, Some(8), "{refused:?}");
    assert!(
        refused.stderr.contains("would requeue 120 jobs")
            && refused.stderr.contains("nothing was changed")
            && refused.stderr.contains("--yes"),
        "{refused:?}"
    );
    assert_eq!(fx.counts(&declined).await, before);

    // With --yes: exactly that group, each a released lease with its token up.
    let done = fx
        .idem(&[&["--actor", "alice"], &group[..], &["--yes"]].concat())
        .await
        .ok();
    assert!(
        done.stdout.starts_with("requeued 120 failed jobs of table"),
        "{done:?}"
    );
    assert_eq!(fx.counts(&declined).await, (DECLINED_JOBS, 0, TIMEOUT_JOBS));
    let released = format!(
        "SELECT COUNT(*) FROM {} WHERE state = 'in_progress' AND locked_until IS NULL \
         AND error IS NULL AND completed_at IS NULL AND token = 2 AND {} LIKE 'timeout-%'",
        fx.table(),
        B::KEY
    );
    assert_eq!(B::count(&fx.pool, &released).await, TIMEOUT_JOBS);

    // One row in the audit log: that action, its count, its actor.
    let audit = format!("SELECT COUNT(*) FROM {}_audit", fx.table());
    assert_eq!(B::count(&fx.pool, &audit).await, 1);
    let log = fx.idem(&["--json", "audit"]).await.ok().json();
    let entries = log["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 1, "{log}");
    assert_eq!(
        (
            &entries[0]["actor"],
            &entries[0]["action"],
            &entries[0]["changed"]
        ),
        (&json!("alice"), &json!("requeue --all"), &json!(120))
    );
    assert_eq!(entries[0]["target"]["group"], json!(timeout_id));
    let text = fx.idem(&["audit"]).await.ok().stdout;
    assert_eq!(text.lines().count(), 2, "{text}");

    // The group is gone: its id now names nothing (exit 3, nothing changed).
    let gone = fx.idem(&[&group[..], &["--yes"]].concat()).await;
    assert_eq!(gone.code, Some(3), "{gone:?}");
    assert!(gone.stderr.contains("no group of failed jobs"), "{gone:?}");
    assert_eq!(fx.counts(&declined).await, (DECLINED_JOBS, 0, TIMEOUT_JOBS));
    assert_eq!(B::count(&fx.pool, &audit).await, 1);
    fx.cleanup().await;
}

pub(crate) async fn bulk_requeue_refuses_bad_input_before_connecting<B: Db>() {
    // A database nobody can reach: a run that connected would exit 1, not 2.
    let url = B::unreachable_url();
    let bad = [
        (
            &["requeue", "--all", "--group", "XYZ"][..],
            "not a group id: a group id is 12 lower-case hex digits",
        ),
        (
            &["requeue", "--all", "--group", "0123456789AB"][..],
            "not a group id",
        ),
        (
            &["requeue", "--all", "--failed-before", "7x"][..],
            "unknown unit `x`",
        ),
        (&["requeue", "--all", "--failed-before", "0d"][..], "zero"),
        (&["requeue", "--scope", SCOPE, "--yes"][..], "--all"),
        (&["failed", "--group-by", "key"][..], "invalid value 'key'"),
        (&["--actor", "", "audit"][..], "an actor is a name"),
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
    /// Writes failed markers of keys `{prefix}-{n}` for `range`, as a lease's permanent
    /// failure leaves them (completed, with the error and the holder's token), failed two
    /// hours ago; one statement per hundred.
    pub(crate) async fn fail_many(&self, prefix: &str, range: std::ops::Range<i64>, error: &str) {
        let rows: Vec<String> = range
            .map(|n| {
                format!(
                    "('{SCOPE}', '{prefix}-{n}', 'completed', 1, 1, {}, '{error}')",
                    B::TWO_HOURS_AGO
                )
            })
            .collect();
        for chunk in rows.chunks(100) {
            self.exec(&format!(
                "INSERT INTO {} (scope, {}, state, token, attempts, completed_at, error) \
                 VALUES {}",
                self.table(),
                B::KEY,
                chunk.join(", ")
            ))
            .await;
        }
    }

    /// `(failed with declined, failed with the timeout, in progress)`.
    pub(crate) async fn counts(&self, declined: &str) -> (i64, i64, i64) {
        let failed = |error: &str| {
            format!(
                "SELECT COUNT(*) FROM {} WHERE state = 'completed' AND error = '{error}'",
                self.table()
            )
        };
        let in_progress = format!(
            "SELECT COUNT(*) FROM {} WHERE state = 'in_progress'",
            self.table()
        );
        (
            B::count(&self.pool, &failed(declined)).await,
            B::count(&self.pool, &failed(TIMEOUT)).await,
            B::count(&self.pool, &in_progress).await,
        )
    }
}
