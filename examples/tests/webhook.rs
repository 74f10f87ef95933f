//! The `webhook` example, run with its own code: every exchange is compared exactly, and the
//! replayed answer with what the receiver stored.

#[allow(dead_code)]
#[path = "../webhook.rs"]
mod webhook;

use webhook::{Exchange, Receipt};

#[tokio::test(flavor = "multi_thread")]
async fn webhook_retries_get_the_first_receipt_and_a_reused_id_is_refused() {
    let dir = std::env::temp_dir().join(format!("idem-test-webhook-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let db = dir.join("receiver.db");
    let mut out = Vec::new();
    let (exchanges, payments) = webhook::run(&db, &mut out).await.unwrap();
    let text = String::from_utf8(out).unwrap();

    let [gave_up, busy, replayed, reused] = &exchanges[..] else {
        panic!("four exchanges expected:\n{text}")
    };
    assert_eq!(gave_up, &Exchange::GaveUp, "{text}");
    assert!(matches!(busy, Exchange::Answer(409, _)), "{text}");
    let Exchange::Answer(200, body) = replayed else {
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
    assert!(matches!(reused, Exchange::Answer(422, _)), "{text}");
    assert_eq!(payments, 1, "{text}");

    // The retry got the stored answer byte for byte; the marker holds the payload's digest.
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", db.display()))
        .await
        .unwrap();
    let (stored, digest): (String, Vec<u8>) = sqlx::query_as(
        "SELECT result, fingerprint FROM idem_processed WHERE scope = 'webhooks.payment'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    pool.close().await;
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(&stored, body);
    assert_eq!(digest.len(), 32);
}
