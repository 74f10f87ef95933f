//! Lease mode: the effect lives in another system (here a counter standing for a payments API
//! that deduplicates on the key it is given).

use sqlx::Sqlite;

use super::*;

#[derive(Default)]
struct Payments {
    calls: std::sync::Mutex<Vec<String>>,
    hold: Hold,
}

/// `POST /charges`: "charges" by calling the outside system with the lease's idempotency key.
async fn charge<DB: Db>(
    State(payments): State<Arc<Payments>>,
    lease: idem::http::ClaimedLease<DB>,
    headers: HeaderMap,
) -> Response {
    payments
        .calls
        .lock()
        .unwrap()
        .push(lease.idempotency_key().to_owned());
    if headers.contains_key("x-hold") {
        payments.hold.entered.notify_one();
        payments.hold.release.notified().await;
    }
    if headers.contains_key("x-hang") {
        std::future::pending::<()>().await;
    }
    match headers.get("x-status").map(|v| v.as_bytes()) {
        Some(b"502") => (StatusCode::BAD_GATEWAY, "the payments API failed").into_response(),
        _ => {
            let n = RUN.fetch_add(1, Ordering::Relaxed);
            (
                StatusCode::CREATED,
                format!("charge {n}, attempt {}", lease.attempt()),
            )
                .into_response()
        }
    }
}

/// A transaction-mode extractor behind a lease-mode layer.
async fn wrong(_tx: ClaimedTx<DB0>) -> StatusCode {
    StatusCode::OK
}
type DB0 = Sqlite;

async fn lease_paths<DB: Db>(tables: Tables<DB>) {
    let payments = Arc::new(Payments::default());
    let lease = idem::LeaseOptions::new(Duration::from_secs(5)).timeout(Duration::from_millis(300));
    let layer = IdempotencyLayer::new(tables.store.clone(), "tests.http.lease")
        .principal(|parts| {
            parts
                .headers
                .get("x-api-key")?
                .to_str()
                .ok()
                .map(str::to_owned)
        })
        .lease(lease);
    let app = Router::new()
        .route("/charges", post(charge::<DB>))
        .layer(layer)
        .with_state(payments.clone());
    let server = serve(app).await;
    let url = format!("{}/charges", server.url);
    let alice = Some("alice");

    let first = send(&url, Some("\"c1\""), alice, "{}", &[]).await;
    assert_eq!(
        (first.status, first.replayed()),
        (201, false),
        "{}",
        first.text()
    );
    let again = send(&url, Some("\"c1\""), alice, "{}", &[]).await;
    assert_eq!((again.status, again.replayed()), (201, true));
    assert_eq!(again.body, first.body);
    assert_eq!(
        send(&url, Some("\"c1\""), alice, "{\"x\":1}", &[])
            .await
            .status,
        422
    );
    assert_eq!(payments.calls.lock().unwrap().len(), 1);

    // A request while the lease is held: 409 at once.
    let held = tokio::spawn({
        let url = url.clone();
        async move { send(&url, Some("\"c2\""), alice, "{}", &[("x-hold", "1")]).await }
    });
    payments.hold.entered.notified().await;
    assert_problem(
        &send(&url, Some("\"c2\""), alice, "{}", &[]).await,
        409,
        "still being processed",
    );
    payments.hold.release.notify_one();
    let held = held.await.unwrap();
    assert_eq!(held.status, 201);
    assert_eq!(
        send(&url, Some("\"c2\""), alice, "{}", &[]).await.body,
        held.body
    );

    // A 5xx releases the lease: the retry runs again, with the same idempotency key to pass on.
    assert_eq!(
        send(&url, Some("\"c3\""), alice, "{}", &[("x-status", "502")])
            .await
            .status,
        502
    );
    let retried = send(&url, Some("\"c3\""), alice, "{}", &[]).await;
    assert_eq!((retried.status, retried.replayed()), (201, false));
    // Over the timeout: 504, and the key is free for the retry.
    let hung = send(&url, Some("\"c4\""), alice, "{}", &[("x-hang", "1")]).await;
    assert_problem(&hung, 504, "did not finish within 300 ms");
    assert_eq!(
        send(&url, Some("\"c4\""), alice, "{}", &[]).await.status,
        201
    );
    let calls = payments.calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 6, "{calls:?}");
    assert_eq!(
        calls[2], calls[3],
        "a retry passed on another idempotency key"
    );
    assert_eq!(
        calls[4], calls[5],
        "a retry passed on another idempotency key"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_lease_mode() {
    lease_paths(Tables::new(postgres().await, "pg_lease").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_lease_mode_and_the_wrong_extractor() {
    let tables = Tables::new(sqlite(&temp_db("lease")).await, "lease").await;
    let lease = idem::LeaseOptions::new(Duration::from_secs(5));
    let layer = IdempotencyLayer::new(tables.store.clone(), "tests.http.wrong")
        .single_tenant()
        .lease(lease);
    let server = serve(Router::new().route("/wrong", post(wrong)).layer(layer)).await;
    let r = send(
        &format!("{}/wrong", server.url),
        Some("\"w\""),
        None,
        "",
        &[],
    )
    .await;
    assert_problem(&r, 500, "extract `ClaimedLease`");
    lease_paths(tables).await;
}
