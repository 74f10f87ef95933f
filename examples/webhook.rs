//! A webhook receiver that a retrying sender cannot fool: `idem::http::IdempotencyLayer` keyed
//! on the Standard Webhooks `webhook-id`, on SQLite.
//!
//! Svix, Clerk, Resend and other senders deliver webhooks at least once, signed by the
//! Standard Webhooks scheme (`webhook-id`, `webhook-timestamp`, `webhook-signature`, HMAC-SHA256
//! over `id.timestamp.body`). A receiver that answers too slowly gets the same event again,
//! with the same id and body and a new timestamp and signature. Here the receiver verifies the
//! signature and refuses a stale timestamp before anything else, then the layer claims the
//! `webhook-id` in the transaction that records the payment and stores the answer with it: a
//! retry gets the first answer byte for byte, a reused id with another body is 422 (the
//! fingerprint covers the body, not the signature headers, which change on every retry), and
//! a retry that arrives while the first delivery still runs is 409. The sender, in the same
//! program over loopback, signs with the same library and prints each exchange:
//!
//! 1. it posts `msg_1`; the receiver records the payment but stalls before answering, and the
//!    sender gives up waiting (the receiver's handler goes on: a hang-up does not cancel it);
//! 2. it retries at once, newly signed: the first delivery still holds the id, 409;
//! 3. the first delivery commits; the sender retries: 200 with the first receipt, replayed;
//! 4. it posts `msg_1` again with another amount: 422;
//! 5. a delivery signed ten minutes ago is refused: 401;
//! 6. the receiver's database holds one payment.
//!
//! ```text
//! cargo run --example webhook
//! ```

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, to_bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderName, StatusCode};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idem::Store;
use idem::http::{ClaimedTx, IdempotencyLayer};
use serde::{Deserialize, Serialize};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{Sqlite, SqlitePool};
use standardwebhooks::Webhook;
use tokio::sync::Notify;

/// The secret the sender and the receiver share (Standard Webhooks' `whsec_` + base64).
pub const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

/// The largest webhook body the receiver reads.
const BODY_LIMIT: usize = 64 << 10;

/// A payment event as the provider sends it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PaymentEvent {
    pub id: String,
    pub amount: i64,
    pub currency: String,
}

/// The receiver's answer: what it recorded. Replayed to a retry exactly as first sent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Receipt {
    pub payment_id: i64,
    pub event_id: String,
    pub amount: i64,
}

/// Lets the example hold the first delivery inside its transaction, as a slow receiver would.
#[derive(Default)]
pub struct Stall {
    armed: std::sync::atomic::AtomicBool,
    entered: Notify,
    release: Notify,
}

impl Stall {
    async fn here(&self) {
        if self.armed.swap(false, std::sync::atomic::Ordering::SeqCst) {
            self.entered.notify_one();
            self.release.notified().await;
        }
    }
}

struct Receiver {
    verifier: Webhook,
    stall: Stall,
}

/// Verifies the signature and the timestamp (five minutes either way, the library's
/// tolerance) over the raw body, before the layer claims anything: an unsigned or replayed-
/// from-afar request never reaches the database.
async fn verify(State(receiver): State<Arc<Receiver>>, request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let Ok(bytes) = to_bytes(body, BODY_LIMIT).await else {
        return (StatusCode::PAYLOAD_TOO_LARGE, "the webhook is too large").into_response();
    };
    if let Err(e) = receiver.verifier.verify(&bytes, &parts.headers) {
        return (StatusCode::UNAUTHORIZED, format!("refused: {e}")).into_response();
    }
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

/// `POST /webhooks/payments`: records the payment on the transaction in which the layer
/// claimed the `webhook-id`; the receipt is stored with the marker in the same commit.
async fn record_payment(
    State(receiver): State<Arc<Receiver>>,
    mut tx: ClaimedTx<Sqlite>,
    Json(event): Json<PaymentEvent>,
) -> Result<Json<Receipt>, (StatusCode, String)> {
    let payment_id: i64 = sqlx::query_scalar(
        "INSERT INTO payments (event_id, amount, currency) VALUES (?1, ?2, ?3) RETURNING id",
    )
    .bind(&event.id)
    .bind(event.amount)
    .bind(&event.currency)
    .fetch_one(tx.conn())
    .await
    // A 5xx: the layer rolls back and stores nothing, the sender's retry runs again.
    .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    receiver.stall.here().await;
    Ok(Json(Receipt {
        payment_id,
        event_id: event.id,
        amount: event.amount,
    }))
}

fn router(store: Store<Sqlite>, receiver: Arc<Receiver>) -> Router {
    let idempotency = IdempotencyLayer::new(store, "webhooks.payment")
        // One sender, whose ids are its own: one key space.
        .single_tenant()
        .key_header(HeaderName::from_static("webhook-id"))
        // The signature headers change on every retry; the body does not.
        .fingerprint_body()
        .wait(Duration::from_millis(200));
    Router::new()
        .route("/webhooks/payments", post(record_payment))
        .layer(idempotency)
        .layer(from_fn_with_state(receiver.clone(), verify))
        .with_state(receiver)
}

/// What the sender saw of one exchange.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exchange {
    /// The sender stopped waiting for an answer.
    GaveUp,
    /// The status, the body, and whether the answer was a replay (`Idempotent-Replayed`).
    Answer(u16, String, bool),
}

fn now() -> i64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970");
    i64::try_from(since.as_secs()).expect("in range")
}

/// Runs the story against a SQLite file at `path`; returns each exchange and the payments the
/// receiver holds.
pub async fn run(
    path: &Path,
    out: &mut impl Write,
) -> Result<(Vec<Exchange>, i64), Box<dyn std::error::Error>> {
    let options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal);
    let pool: SqlitePool = SqlitePoolOptions::new().connect_with(options).await?;
    sqlx::query(
        "CREATE TABLE payments (id INTEGER PRIMARY KEY, event_id TEXT NOT NULL, \
         amount INTEGER NOT NULL, currency TEXT NOT NULL)",
    )
    .execute(&pool)
    .await?;
    let store = Store::new(pool.clone());
    store.migrate().await?;
    let receiver = Arc::new(Receiver {
        verifier: Webhook::new(SECRET)?,
        stall: Stall::default(),
    });
    let app = router(store, receiver.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/webhooks/payments", listener.local_addr()?);
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    // The sender: signs each delivery anew, as Standard Webhooks senders retry.
    let http = reqwest::Client::new();
    let signer = Webhook::new(SECRET)?;
    let send = |id: &str, event: &PaymentEvent, signed_at: i64, patience: Option<Duration>| {
        let body = serde_json::to_vec(event).expect("an event serialises");
        let signature = signer.sign(id, signed_at, &body).expect("a UTF-8 body");
        let mut request = http
            .post(&url)
            .header("content-type", "application/json")
            .header("webhook-id", id)
            .header("webhook-timestamp", signed_at.to_string())
            .header("webhook-signature", signature)
            .body(body);
        if let Some(patience) = patience {
            request = request.timeout(patience);
        }
        async move {
            match request.send().await {
                Ok(response) => {
                    let status = response.status().as_u16();
                    let replayed = response.headers().contains_key("idempotent-replayed");
                    Ok(Exchange::Answer(status, response.text().await?, replayed))
                }
                Err(e) if e.is_timeout() => Ok(Exchange::GaveUp),
                Err(e) => Err(e),
            }
        }
    };
    let mut exchanges = Vec::new();
    let mut show = |what: &str, exchange: Exchange, out: &mut dyn Write| -> std::io::Result<()> {
        match &exchange {
            Exchange::GaveUp => writeln!(out, "{what}: no answer, the sender gave up waiting")?,
            Exchange::Answer(status, body, replayed) => {
                let replayed = if *replayed { " (replayed)" } else { "" };
                writeln!(out, "{what}: {status}{replayed} {body}")?;
            }
        }
        exchanges.push(exchange);
        Ok(())
    };

    let event = PaymentEvent {
        id: "evt_1".into(),
        amount: 4200,
        currency: "EUR".into(),
    };
    // 1. The receiver stalls inside its transaction; the sender stops waiting.
    receiver
        .stall
        .armed
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let first = tokio::spawn(send(
        "msg_1",
        &event,
        now(),
        Some(Duration::from_millis(300)),
    ));
    receiver.stall.entered.notified().await;
    show("msg_1, first delivery", first.await??, out)?;
    // 2. A retry, newly signed, while the first delivery still holds the id.
    let busy = send("msg_1", &event, now(), None).await?;
    show("msg_1, retried at once", busy, out)?;
    // 3. The first delivery commits; the next retry gets its receipt.
    receiver.stall.release.notify_one();
    committed(&pool).await?;
    let replayed = send("msg_1", &event, now(), None).await?;
    show("msg_1, retried later", replayed, out)?;
    // 4. The same id for another body.
    let changed = PaymentEvent {
        amount: 9900,
        ..event.clone()
    };
    let reused = send("msg_1", &changed, now(), None).await?;
    show("msg_1 with another amount", reused, out)?;
    // 5. A delivery signed ten minutes ago.
    let stale = send("msg_2", &event, now() - 600, None).await?;
    show("msg_2 signed ten minutes ago", stale, out)?;

    let payments: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM payments")
        .fetch_one(&pool)
        .await?;
    writeln!(out, "payments recorded: {payments}")?;
    server.abort();
    pool.close().await;
    Ok((exchanges, payments))
}

/// Waits until the first delivery's marker is committed with its answer: the story's next
/// retry must come after it, not race it.
async fn committed(pool: &SqlitePool) -> Result<(), Box<dyn std::error::Error>> {
    for _ in 0..1_000_000 {
        let n: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM idem_processed \
             WHERE scope = 'webhooks.payment' AND result IS NOT NULL",
        )
        .fetch_one(pool)
        .await?;
        if n == 1 {
            return Ok(());
        }
        tokio::task::yield_now().await;
    }
    Err("the first delivery never committed".into())
}

#[allow(dead_code)]
#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("idem-webhook-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let result = run(&dir.join("receiver.db"), &mut std::io::stdout()).await;
    std::fs::remove_dir_all(&dir)?;
    result.map(|_| ())
}
