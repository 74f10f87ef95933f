//! `idem failed`, `idem requeue` and `idem steps`: a lease's job that failed for good after a
//! recorded step, listed, inspected and requeued through the command line; each change checked
//! in the database.

use serde_json::json;

use crate::Db;
use crate::cli_support::Fixture;

/// The error the job fails with: two lines, which the listing shows on one.
const DECLINED: &str = "card declined:\ninsufficient funds";

pub(crate) async fn failed_jobs_are_listed_requeued_and_their_steps_shown<B: Db>() {
    let fx = Fixture::<B>::new("failed").await;
    let lease = fx.lease("billing.charge", "order-9", 30).await;
    let charged: String = lease
        .step("charge", |_| async {
            Ok::<_, idem::Error>("ch_1".to_owned())
        })
        .await
        .unwrap();
    assert_eq!(charged, "ch_1");
    let declined = Err(lease.permanent(idem::Error::Serialize(DECLINED.to_owned())));
    match lease.finish::<(), _>(declined).await {
        Ok(idem::Outcome::Failed(f)) => assert_eq!(f.error(), DECLINED),
        other => panic!("expected Failed, got {other:?}"),
    }
    let error = fx
        .store
        .inspect("billing.charge", "order-9")
        .await
        .unwrap()
        .unwrap()
        .error
        .expect("an error");

    // Listed, newest first, with the error (on one line in the text).
    let listed = fx.idem(&["--json", "failed"]).await.ok().json();
    let markers = listed["markers"].as_array().unwrap();
    assert_eq!(markers.len(), 1, "{listed}");
    assert_eq!(
        (
            &markers[0]["key"],
            &markers[0]["state"],
            &markers[0]["error"]
        ),
        (&json!("order-9"), &json!("failed"), &json!(error))
    );
    let text = fx
        .idem(&["failed", "--scope", "billing.charge"])
        .await
        .ok()
        .stdout;
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert!(lines[0].starts_with("SCOPE"), "{text}");
    assert!(lines[1].starts_with("billing.charge"), "{text}");
    assert!(
        lines[1].ends_with("card declined: insufficient funds"),
        "{text}"
    );
    let other = fx.idem(&["failed", "--scope", "other"]).await.ok().stdout;
    assert!(
        other.starts_with("no job of scope \"other\" failed"),
        "{other}"
    );

    // Inspected: failed, with its error.
    let fields = fx
        .idem(&["inspect", "billing.charge", "order-9"])
        .await
        .ok()
        .fields();
    assert_eq!(fields["state"], "failed");
    assert!(
        fields["error"].ends_with("card declined: insufficient funds"),
        "{fields:?}"
    );

    // Its recorded step.
    let steps = fx
        .idem(&["--json", "steps", "billing.charge", "order-9"])
        .await
        .ok()
        .json();
    assert_eq!(steps["steps"][0]["name"], json!("charge"));
    assert_eq!(steps["steps"][0]["position"], json!(1));
    assert_eq!(steps["steps"][0]["value"], json!("ch_1"));
    let text = fx
        .idem(&["steps", "billing.charge", "order-9"])
        .await
        .ok()
        .stdout;
    let cells: Vec<&str> = text.lines().nth(1).unwrap().split_whitespace().collect();
    assert_eq!(
        (cells[0], cells[1], cells[3]),
        ("1", "charge", "\"ch_1\""),
        "{text}"
    );

    // Requeued: a released lease that keeps its step; then no longer failed.
    let done = fx
        .idem(&["requeue", "billing.charge", "order-9"])
        .await
        .ok()
        .stdout;
    assert!(
        done.starts_with("requeued scope \"billing.charge\", key \"order-9\"")
            && done.contains("after its 1 recorded step"),
        "{done}"
    );
    let marker = fx
        .store
        .inspect("billing.charge", "order-9")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(marker.state, idem::MarkerState::InProgress);
    assert_eq!((marker.error, marker.locked_until), (None, None));
    assert_eq!(
        fx.store
            .steps("billing.charge", "order-9")
            .await
            .unwrap()
            .len(),
        1
    );
    let again = fx.idem(&["requeue", "billing.charge", "order-9"]).await;
    assert_eq!(again.code, Some(4), "{again:?}");
    assert!(
        again.stderr.contains("did not fail (it is in_progress)"),
        "{again:?}"
    );
    let missing = fx.idem(&["requeue", "billing.charge", "order-0"]).await;
    assert_eq!(missing.code, Some(3), "{missing:?}");
    let none = fx.idem(&["failed"]).await.ok().stdout;
    assert!(none.starts_with("no job failed for good"), "{none}");
    fx.cleanup().await;
}
