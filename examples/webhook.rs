//! A webhook receiver that a retrying sender cannot fool: replay and fingerprints, on SQLite.
//!
//! Payment providers deliver webhooks at least once: a receiver that answers too slowly gets
//! the same event again. Here the receiver records each payment once and answers a retry with
//! the first answer, byte for byte (`replay`); an event id reused for a different payload is
//! refused with 422 (`fingerprint`); a retry that arrives while the first delivery still runs
//! gets 409 (`wait`). The sender, in the same program over loopback, prints each exchange:
//!
//! 1. it posts `evt_1`; the receiver records the payment but stalls before answering, and the
//!    sender gives up waiting;
//! 2. it retries at once: the first delivery still holds the event, 409;
//! 3. the first delivery finishes; the sender retries: 200 with the first receipt;
//! 4. it posts `evt_1` again with another amount: 422;
//! 5. the receiver's database holds one payment.
//!
//! ```text
//! cargo run --example webhook
//! ```

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idem::{Outcome, Store};
use serde::{Deserialize, Serialize};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{Sqlite, SqlitePool, Transaction};
use tokio::sync::Notify;

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

/// One delivery: the event, and the id to deduplicate on (the provider's delivery id header
/// when it sends one, else the event's own id).
pub struct Delivery {
    pub id: String,
    pub event: PaymentEvent,
}

#[derive(Debug)]
pub enum WebhookError {
    Database(sqlx::Error),
    Idem(idem::Error),
}

impl From<sqlx::Error> for WebhookError {
    fn from(e: sqlx::Error) -> Self {
        WebhookError::Database(e)
    }
}

impl From<idem::Error> for WebhookError {
    fn from(e: idem::Error) -> Self {
        WebhookError::Idem(e)
    }
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

/// Records the payment once per delivery id. The receipt is stored with the marker and
/// replayed to every retry; a reused id with another payload is refused.
#[idem::idempotent(
    key = "delivery.id",
    scope = "webhooks.payment",
    replay,
    fingerprint = "delivery.event",
    wait = "200ms"
)]
pub async fn record_payment(
    tx: &mut Transaction<'_, Sqlite>,
    delivery: &Delivery,
    stall: &Stall,
) -> Result<Receipt, WebhookError> {
    let event = &delivery.event;
    let payment_id: i64 = sqlx::query_scalar(
        "INSERT INTO payments (event_id, amount, currency) VALUES (?1, ?2, ?3) RETURNING id",
    )
    .bind(&event.id)
    .bind(event.amount)
    .bind(&event.currency)
    .fetch_one(&mut **tx)
    .await?;
    stall.here().await;
    Ok(Receipt {
        payment_id,
        event_id: event.id.clone(),
        amount: event.amount,
    })
}

struct Receiver {
    store: Store<Sqlite>,
    stall: Stall,
}

/// `POST /webhooks/payments`. The status codes follow the IETF Idempotency-Key draft: the
/// first answer again for a retry, 409 while the first delivery is in progress, 422 for a key
/// reused with another payload; 500 for anything else (the provider retries).
async fn receive(
    State(receiver): State<Arc<Receiver>>,
    headers: HeaderMap,
    Json(event): Json<PaymentEvent>,
) -> Response {
    let id = headers
        .get("Webhook-Id")
        .and_then(|v| v.to_str().ok())
        .map_or_else(|| event.id.clone(), str::to_owned);
    let delivery = Delivery { id, event };
    // The work runs in its own task: a sender that hangs up must not cancel a delivery
    // halfway, or its retry would find nothing recorded to replay.
    let task =
        tokio::spawn(
            async move { record_payment(&receiver.store, &delivery, &receiver.stall).await },
        );
    match task.await {
        Ok(Ok(Outcome::Applied(receipt))) => (StatusCode::OK, Json(receipt)).into_response(),
        Ok(Ok(Outcome::Replayed(receipt))) => (
            StatusCode::OK,
            [("Idempotent-Replayed", "true")],
            Json(receipt),
        )
            .into_response(),
        // Recorded before receipts were stored: nothing to replay, but nothing to redo.
        Ok(Ok(Outcome::Duplicate)) => StatusCode::OK.into_response(),
        Ok(Err(WebhookError::Idem(idem::Error::KeyReused { key, .. }))) => (
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("{key} was already delivered with another payload; send it under a new id"),
        )
            .into_response(),
        Ok(Err(WebhookError::Idem(idem::Error::InProgress { key, .. }))) => (
            StatusCode::CONFLICT,
            format!("{key} is still being processed; retry later"),
        )
            .into_response(),
        Ok(Err(e)) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e:?}")).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// What the sender saw of one exchange.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exchange {
    /// The sender stopped waiting for an answer.
    GaveUp,
    /// The status and the body.
    Answer(u16, String),
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
        store,
        stall: Stall::default(),
    });
    let app = Router::new()
        .route("/webhooks/payments", post(receive))
        .with_state(receiver.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/webhooks/payments", listener.local_addr()?);
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    let http = reqwest::Client::new();
    let event = PaymentEvent {
        id: "evt_1".into(),
        amount: 4200,
        currency: "EUR".into(),
    };
    let send = |event: &PaymentEvent, patience: Option<Duration>| {
        let mut request = http.post(&url).json(event);
        if let Some(patience) = patience {
            request = request.timeout(patience);
        }
        async move {
            match request.send().await {
                Ok(response) => {
                    let status = response.status().as_u16();
                    Ok(Exchange::Answer(status, response.text().await?))
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
            Exchange::Answer(status, body) => writeln!(out, "{what}: {status} {body}")?,
        }
        exchanges.push(exchange);
        Ok(())
    };

    // 1. The receiver stalls inside its transaction; the sender stops waiting.
    receiver
        .stall
        .armed
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let first = tokio::spawn(send(&event, Some(Duration::from_millis(300))));
    receiver.stall.entered.notified().await;
    show("evt_1, first delivery", first.await??, out)?;
    // 2. A retry while the first delivery still holds the event.
    show("evt_1, retried at once", send(&event, None).await?, out)?;
    // 3. The first delivery commits; the next retry gets its receipt.
    receiver.stall.release.notify_one();
    committed(&pool, "evt_1").await?;
    show("evt_1, retried later", send(&event, None).await?, out)?;
    // 4. The same id for another payload.
    let changed = PaymentEvent {
        amount: 9900,
        ..event.clone()
    };
    show(
        "evt_1 with another amount",
        send(&changed, None).await?,
        out,
    )?;

    let payments: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM payments")
        .fetch_one(&pool)
        .await?;
    writeln!(out, "payments recorded: {payments}")?;
    server.abort();
    pool.close().await;
    Ok((exchanges, payments))
}

/// Waits until the marker of `id` is committed with its receipt: the story's next retry must
/// come after the first delivery, not race it.
async fn committed(pool: &SqlitePool, id: &str) -> Result<(), Box<dyn std::error::Error>> {
    for _ in 0..1_000_000 {
        let n: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM idem_processed WHERE key = ?1 AND result IS NOT NULL",
        )
        .bind(id)
        .fetch_one(pool)
        .await?;
        if n == 1 {
            return Ok(());
        }
        tokio::task::yield_now().await;
    }
    Err(format!("the first delivery of {id} never committed").into())
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
