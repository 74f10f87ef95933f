//! A mail sink on loopback, standing in for a mail provider of the checkout example.
//!
//! Like many mail APIs it has no `Idempotency-Key`: every request it gets is a mail sent, and
//! it counts them. It keeps each mail's `X-Reference` header, and answers a lookup by
//! reference: what a step's verify asks ("was this mail sent?").

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

/// A mail as the sink takes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mail {
    /// To whom.
    pub to: String,
    /// Its subject.
    pub subject: String,
}

/// A mail the sink sent, with the reference its sender gave.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sent {
    /// The sink's id for it (`m_1`, `m_2`, ...).
    pub id: String,
    /// The `X-Reference` header of its request.
    pub reference: String,
    /// The mail.
    pub mail: Mail,
}

/// A lookup by reference: the mails sent under it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Lookup {
    /// The reference asked about.
    pub reference: String,
}

/// The running sink; it stops when dropped.
pub struct MailSink {
    addr: SocketAddr,
    sent: Arc<Mutex<Vec<Sent>>>,
    _stop: oneshot::Sender<()>,
}

impl MailSink {
    /// Starts the sink on a free port of 127.0.0.1.
    pub async fn start() -> std::io::Result<MailSink> {
        let sent: Arc<Mutex<Vec<Sent>>> = Arc::default();
        let app = Router::new()
            .route("/mail", post(send))
            .route("/mail/lookup", post(lookup))
            .with_state(sent.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let serve = axum::serve(listener, app).with_graceful_shutdown(async move {
                drop(stopped.await);
            });
            drop(serve.await);
        });
        Ok(MailSink {
            addr,
            sent,
            _stop: stop,
        })
    }

    /// The base URL: mails go to `{url}/mail`, lookups to `{url}/mail/lookup`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every mail sent so far, in order.
    pub fn sent(&self) -> Vec<Sent> {
        self.sent.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// How many mails were sent under `reference`.
    pub fn sent_under(&self, reference: &str) -> usize {
        self.sent()
            .iter()
            .filter(|s| s.reference == reference)
            .count()
    }
}

async fn send(
    State(sent): State<Arc<Mutex<Vec<Sent>>>>,
    headers: HeaderMap,
    Json(mail): Json<Mail>,
) -> Result<Json<Sent>, (StatusCode, String)> {
    let reference = headers
        .get("X-Reference")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let mut sent = sent.lock().unwrap_or_else(|e| e.into_inner());
    let one = Sent {
        id: format!("m_{}", sent.len() + 1),
        reference,
        mail,
    };
    sent.push(one.clone());
    Ok(Json(one))
}

async fn lookup(
    State(sent): State<Arc<Mutex<Vec<Sent>>>>,
    Json(lookup): Json<Lookup>,
) -> Json<Option<Sent>> {
    let sent = sent.lock().unwrap_or_else(|e| e.into_inner());
    Json(
        sent.iter()
            .find(|s| s.reference == lookup.reference)
            .cloned(),
    )
}
