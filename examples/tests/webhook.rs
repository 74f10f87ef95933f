//! The `webhook` example, run with its own code: every exchange is compared exactly, and the
//! replayed answer with what the layer stored with the marker.

#[allow(dead_code)]
#[path = "../webhook.rs"]
mod webhook;

use base64::Engine as _;
use webhook::{Exchange, Receipt};

#[tokio::test(flavor = "multi_thread")]
async fn signed_retries_get_the_first_receipt_a_reused_id_is_422_a_stale_one_401() {
    let dir = std::env::temp_dir().join(format!("idem-test-webhook-{}", std::process::id()));
    drop(std::fs::remove_dir_all(&dir));
    std::fs::create_dir_all(&dir).unwrap();
    let db = dir.join("receiver.db");
    let mut out = Vec::new();
    let (exchanges, payments) = webhook::run(&db, &mut out).await.unwrap();
    let text = String::from_utf8(out).unwrap();

    let [gave_up, busy, replayed, reused, stale] = &exchanges[..] else {
        panic!("five exchanges expected:\n{text}")
    };
    assert_eq!(gave_up, &Exchange::GaveUp, "{text}");
    assert!(matches!(busy, Exchange::Answer(409, _, false)), "{text}");
    let Exchange::Answer(200, body, true) = replayed else {
        panic!("{text}")
    };
    let receipt: Receipt = serde_json::from_str(body).unwrap();
    assert_eq!(
        receipt,
        Receipt {
            payment_id: 1,
            event_id: "evt_1".into(),
            amount: 4200
        }
    );
    assert!(matches!(reused, Exchange::Answer(422, _, false)), "{text}");
    assert!(
        matches!(stale, Exchange::Answer(401, b, false) if b.contains("too old")),
        "{text}"
    );
    assert_eq!(payments, 1, "{text}");

    // The retry got the stored answer byte for byte; the marker holds the body's digest, and
    // the stale delivery left no marker.
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", db.display()))
        .await
        .unwrap();
    let stored: Vec<(String, Vec<u8>)> = sqlx::query_as(
        "SELECT result, fingerprint FROM idem_processed WHERE scope = 'webhooks.payment'",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    pool.close().await;
    std::fs::remove_dir_all(&dir).unwrap();
    let [(stored, digest)] = &stored[..] else {
        panic!("one marker expected: {stored:?}")
    };
    let stored: serde_json::Value = serde_json::from_str(stored).unwrap();
    assert_eq!(stored["status"], 200);
    let sent = base64::engine::general_purpose::STANDARD
        .decode(stored["body"].as_str().unwrap())
        .unwrap();
    assert_eq!(sent, body.as_bytes());
    assert_eq!(digest.len(), 32);
}
