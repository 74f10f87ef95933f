//! A payments API on loopback, standing in for the outside system of the lease-mode examples.
//!
//! Like real payment providers it honours `Idempotency-Key`: the first response for a key is
//! stored, and every later request with that key gets the same response back without a second
//! charge. It can be told to stall its next charge *after* recording it, the way a provider
//! that is slow to answer has often already charged the card.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, oneshot};

/// The customer whose card the API always declines (`402 Payment Required`).
pub const DECLINED: &str = "mallory";

/// A charge request, as the API takes it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChargeRequest {
    /// Who pays.
    pub customer: String,
    /// How much, in cents.
    pub amount: i64,
}

/// The API's answer to a charge.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Receipt {
    /// The charge's id at the provider (`ch_1`, `ch_2`, ...).
    pub id: String,
    /// Who paid.
    pub customer: String,
    /// How much, in cents.
    pub amount: i64,
}

/// What the API has charged in all.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Totals {
    /// Charges made (a replayed answer is not a charge).
    pub charges: u64,
    /// Their sum, in cents.
    pub amount: i64,
    /// Requests answered from the idempotency store instead.
    pub replayed: u64,
}

#[derive(Default)]
struct Ledger {
    by_key: HashMap<String, Receipt>,
    totals: Totals,
    stall_next: bool,
}

struct Shared {
    ledger: Mutex<Ledger>,
    /// Signalled when a charge has stalled.
    stalled: Notify,
    /// Lets a stalled charge answer.
    release: Notify,
}

/// The running API; it stops when dropped.
pub struct PaymentsApi {
    addr: SocketAddr,
    shared: Arc<Shared>,
    _stop: oneshot::Sender<()>,
}

impl PaymentsApi {
    /// Starts the API on a free port of 127.0.0.1.
    pub async fn start() -> std::io::Result<PaymentsApi> {
        let shared = Arc::new(Shared {
            ledger: Mutex::new(Ledger::default()),
            stalled: Notify::new(),
            release: Notify::new(),
        });
        let app = Router::new()
            .route("/charges", post(charge))
            .route("/totals", get(totals))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let serve = axum::serve(listener, app).with_graceful_shutdown(async move {
                drop(stopped.await);
            });
            drop(serve.await);
        });
        Ok(PaymentsApi {
            addr,
            shared,
            _stop: stop,
        })
    }

    /// The base URL: charges go to `{url}/charges`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The URL that takes charges.
    pub fn charges_url(&self) -> String {
        format!("http://{}/charges", self.addr)
    }

    /// The next new charge is recorded, then its answer waits for [`release`](Self::release).
    pub fn stall_next_charge(&self) {
        self.ledger().stall_next = true;
    }

    /// Waits until a charge has stalled.
    pub async fn stalled(&self) {
        self.shared.stalled.notified().await;
    }

    /// Lets a stalled charge answer (its client may be long gone).
    pub fn release(&self) {
        self.shared.release.notify_one();
    }

    /// What the API has charged so far.
    pub fn totals(&self) -> Totals {
        self.ledger().totals
    }

    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.shared.ledger.lock().unwrap_or_else(|e| e.into_inner())
    }
}

async fn charge(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Json(req): Json<ChargeRequest>,
) -> Result<Json<Receipt>, (StatusCode, String)> {
    let Some(key) = headers.get("Idempotency-Key").and_then(|v| v.to_str().ok()) else {
        return Err((
            StatusCode::BAD_REQUEST,
            "an Idempotency-Key header is required".to_owned(),
        ));
    };
    // A card that is always declined: a permanent error, which no retry fixes.
    if req.customer == DECLINED {
        return Err((
            StatusCode::PAYMENT_REQUIRED,
            "insufficient funds".to_owned(),
        ));
    }
    let (receipt, stall) = {
        let mut ledger = shared.ledger.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(first) = ledger.by_key.get(key).cloned() {
            ledger.totals.replayed += 1;
            return Ok(Json(first));
        }
        ledger.totals.charges += 1;
        ledger.totals.amount += req.amount;
        let receipt = Receipt {
            id: format!("ch_{}", ledger.totals.charges),
            customer: req.customer,
            amount: req.amount,
        };
        ledger.by_key.insert(key.to_owned(), receipt.clone());
        (receipt, std::mem::take(&mut ledger.stall_next))
    };
    if stall {
        shared.stalled.notify_one();
        shared.release.notified().await;
    }
    Ok(Json(receipt))
}

async fn totals(State(shared): State<Arc<Shared>>) -> Json<Totals> {
    Json(
        shared
            .ledger
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .totals,
    )
}
