//! The outside system of the lease-mode jobs: a payments API on loopback that honours
//! `Idempotency-Key` as providers do (a key charges once; a repeat gets the first answer
//! back), and counts every request, so that the checker sees attempts and charges apart.
//! Like a real provider it takes its time: up to 400 ms per answer, and every 16th new charge
//! is recorded and then answered only after 2.5 s, past the handler's 2 s timeout, so that
//! its delivery fails after the charge was made and the redelivery must get the first answer
//! back instead of a second charge.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

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

    /// A second charge for `job` under a key of its own: the checker's own check plants it.
    pub fn plant_charge(&self, job: &str) {
        let mut ledger = self.ledger.lock().unwrap_or_else(|e| e.into_inner());
        ledger
            .by_key
            .insert(format!("planted:{job}"), job.to_owned());
        *ledger.charges.entry(job.to_owned()).or_default() += 1;
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
    let (answer, delay) = {
        let mut ledger = ledger.lock().unwrap_or_else(|e| e.into_inner());
        ledger.attempts += 1;
        let delay = Duration::from_millis(ledger.attempts * 7919 % 400);
        if let Some(job) = ledger.by_key.get(key) {
            if *job != req.job {
                return Err((StatusCode::UNPROCESSABLE_ENTITY, "key reused".into()));
            }
            ledger.replayed += 1;
            (format!("replayed {key}"), delay)
        } else {
            ledger.by_key.insert(key.to_owned(), req.job.clone());
            *ledger.charges.entry(req.job).or_default() += 1;
            let stall = ledger.by_key.len() % 16 == 0;
            let delay = if stall {
                Duration::from_millis(2500)
            } else {
                delay
            };
            (format!("charged {key}"), delay)
        }
    };
    // The provider's own slowness (not a synchronisation).
    tokio::time::sleep(delay).await;
    Ok(answer)
}
