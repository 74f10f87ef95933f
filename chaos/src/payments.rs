//! The outside system of the lease-mode jobs: a payments API on loopback that honours
//! `Idempotency-Key` as providers do (a key charges once; a repeat gets the first answer
//! back), and counts every request, so that the checker sees attempts and charges apart.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::{Json, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;

use crate::jobs::ChargeRequest;

#[derive(Default, Clone)]
pub struct Ledger {
    /// The job each key charged for.
    pub by_key: HashMap<String, String>,
    /// Charges made per job (a replayed answer is not a charge).
    pub charges: HashMap<String, u64>,
    /// Every request that carried a key.
    pub attempts: u64,
    pub replayed: u64,
}

pub struct Payments {
    pub url: String,
    ledger: Arc<Mutex<Ledger>>,
}

impl Payments {
    pub async fn start() -> std::io::Result<Payments> {
        let ledger = Arc::new(Mutex::new(Ledger::default()));
        let app = Router::new()
            .route("/charges", post(charge))
            .with_state(ledger.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr: SocketAddr = listener.local_addr()?;
        tokio::spawn(async move { drop(axum::serve(listener, app).await) });
        Ok(Payments {
            url: format!("http://{addr}/charges"),
            ledger,
        })
    }

    pub fn ledger(&self) -> Ledger {
        self.ledger
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

async fn charge(
    State(ledger): State<Arc<Mutex<Ledger>>>,
    headers: HeaderMap,
    Json(req): Json<ChargeRequest>,
) -> Result<String, (StatusCode, String)> {
    let Some(key) = headers.get("Idempotency-Key").and_then(|v| v.to_str().ok()) else {
        return Err((
            StatusCode::BAD_REQUEST,
            "Idempotency-Key is required".into(),
        ));
    };
    let mut ledger = ledger.lock().unwrap_or_else(|e| e.into_inner());
    ledger.attempts += 1;
    if let Some(job) = ledger.by_key.get(key) {
        if *job != req.job {
            return Err((StatusCode::UNPROCESSABLE_ENTITY, "key reused".into()));
        }
        ledger.replayed += 1;
        return Ok(format!("replayed {key}"));
    }
    ledger.by_key.insert(key.to_owned(), req.job.clone());
    *ledger.charges.entry(req.job).or_default() += 1;
    Ok(format!("charged {key}"))
}
