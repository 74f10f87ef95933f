//! The `charge_once` example, run with its own code: what it reports is checked against what
//! the payments API actually charged and against the marker table.

#[allow(dead_code)]
#[path = "../charge_once.rs"]
mod charge_once;

use charge_once::Delivery;

#[tokio::test(flavor = "multi_thread")]
async fn charge_once_charges_each_job_once_through_a_timeout() {
    let dir = std::env::temp_dir().join(format!("idem-test-charge-once-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let db = dir.join("jobs.db");
    let mut out = Vec::new();
    let (deliveries, totals) = charge_once::run(&db, &mut out).await.unwrap();
    let text = String::from_utf8(out).unwrap();

    // The stalled call timed out; its redelivery got the API's first answer for that key.
    let [first, again, stalled, retried] = &deliveries[..] else {
        panic!("four deliveries expected: {deliveries:?}\n{text}")
    };
    let Delivery::Applied(alice) = first else {
        panic!("{text}")
    };
    assert_eq!((alice.id.as_str(), alice.amount), ("ch_1", 4200), "{text}");
    assert_eq!(again, &Delivery::Duplicate, "{text}");
    assert_eq!(stalled, &Delivery::TimedOut, "{text}");
    let Delivery::Applied(bob) = retried else {
        panic!("{text}")
    };
    assert_eq!((bob.id.as_str(), bob.amount), ("ch_2", 5700), "{text}");
    // Two charges, never three: the retry was answered from the API's idempotency store.
    assert_eq!(
        (totals.charges, totals.amount, totals.replayed),
        (2, 9900, 1),
        "{text}"
    );

    // Both jobs are completed markers; the second took two attempts.
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", db.display()))
        .await
        .unwrap();
    // Lease tokens come from the database's clock: positive, where a transaction's are not.
    let rows: Vec<(String, String, i64, bool)> = sqlx::query_as(
        "SELECT key, state, attempts, token > 0 FROM idem_processed \
         WHERE scope = 'billing.charge' ORDER BY key",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    pool.close().await;
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(
        rows,
        [
            ("charge-1".to_owned(), "completed".to_owned(), 1, true),
            ("charge-2".to_owned(), "completed".to_owned(), 2, true),
        ]
    );
}
