//! A "Send invoice" button that a double click, a Back and a resubmit cannot send twice:
//! `idem::http::IdempotencyLayer` in front of an axum form handler, on SQLite.
//!
//! Each render of the form mints a new idempotency key into a hidden field. The POST handler
//! records the invoice and the email to send in the transaction in which the layer claimed the
//! key, and answers with a confirmation page, which the layer stores with the marker in the
//! same commit. A second submission of the same form (the second click of a double click, or
//! the form again after Back, which the browser shows from its history with the same key)
//! gets that confirmation again, byte for byte, and sends nothing.
//!
//! ```text
//! cargo run --example invoice_button    # then open http://127.0.0.1:3000
//! ```

use std::hash::{BuildHasher as _, RandomState};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::body::Body;
use axum::extract::{Form, Request};
use axum::http::{HeaderValue, Method, StatusCode};
use axum::middleware::{Next, from_fn};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Router, body};
use idem::Store;
use idem::http::{ClaimedTx, IdempotencyLayer};
use serde::Deserialize;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{Sqlite, SqlitePool};

/// The form's fields.
#[derive(Debug, Deserialize)]
pub struct InvoiceForm {
    pub idempotency_key: String,
    pub customer: String,
    pub email: String,
    pub amount_cents: i64,
}

/// A fresh key for each render: 128 random bits in hex (a real application may use a UUID v4).
fn mint_key() -> String {
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let n = COUNT.fetch_add(1, Ordering::Relaxed);
    let (a, b) = (
        RandomState::new().hash_one(n),
        RandomState::new().hash_one(n),
    );
    format!("{a:016x}{b:016x}")
}

const STYLE: &str = "body{font-family:sans-serif;max-width:34em;margin:3em auto;color:#222}\
    label{display:block;margin:.6em 0}input{font-size:1em;padding:.3em}\
    button{font-size:1.1em;padding:.5em 1.4em;background:#2b6cb0;color:#fff;border:0;\
    border-radius:4px}.ok{background:#f0fff4;border:1px solid #9ae6b4;padding:1em;\
    border-radius:4px}code{font-size:.85em}";

/// `GET /`: the form, with a key of its own.
async fn form() -> Html<String> {
    let key = mint_key();
    Html(format!(
        "<!doctype html><html><head><meta charset=utf-8><title>Send invoice</title>\
         <style>{STYLE}</style></head><body><h1>Invoice for ACME GmbH</h1>\
         <form id=invoice method=post action=/invoices>\
         <input type=hidden name=idempotency_key value={key}>\
         <label>Customer <input name=customer value=\"ACME GmbH\"></label>\
         <label>Email <input name=email value=\"billing@acme.example\"></label>\
         <label>Amount (cents) <input name=amount_cents value=12000></label>\
         <button id=send type=submit>Send invoice</button></form></body></html>"
    ))
}

/// `POST /invoices`: records the invoice and the email to send on the claimed transaction.
async fn send_invoice(
    mut tx: ClaimedTx<Sqlite>,
    Form(invoice): Form<InvoiceForm>,
) -> Result<Html<String>, (StatusCode, String)> {
    let failed = |e: sqlx::Error| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string());
    let (id, sent_at): (i64, String) = sqlx::query_as(
        "INSERT INTO invoices (customer, amount_cents, sent_at) \
         VALUES (?1, ?2, strftime('%Y-%m-%d %H:%M:%f', 'now')) RETURNING id, sent_at",
    )
    .bind(&invoice.customer)
    .bind(invoice.amount_cents)
    .fetch_one(tx.conn())
    .await
    .map_err(failed)?;
    sqlx::query("INSERT INTO emails_to_send (invoice_id, recipient, subject) VALUES (?1, ?2, ?3)")
        .bind(id)
        .bind(&invoice.email)
        .bind(format!("Invoice #{id}"))
        .execute(tx.conn())
        .await
        .map_err(failed)?;
    let amount = format!(
        "{}.{:02} EUR",
        invoice.amount_cents / 100,
        invoice.amount_cents % 100
    );
    Ok(Html(format!(
        "<!doctype html><html><head><meta charset=utf-8><title>Invoice #{id} sent</title>\
         <style>{STYLE}</style></head><body><div class=ok><h1 id=confirmation>Invoice #{id} \
         sent</h1><p>{amount} to {customer}; the email to {email} is queued.</p>\
         <p>Sent at {sent_at} UTC, key <code>{key}</code>.</p></div>\
         <p><a href=/>New invoice</a></p></body></html>",
        customer = invoice.customer,
        email = invoice.email,
        key = invoice.idempotency_key,
    )))
}

/// HTML forms cannot set headers: the key travels in the hidden field, and this moves it into
/// the `Idempotency-Key` header (an sf-string) before the layer reads it. Only the form's own
/// POST, with a body of at most 16 KiB, is looked into.
async fn key_from_form(request: Request, next: Next) -> Response {
    if request.method() != Method::POST {
        return next.run(request).await;
    }
    let (mut parts, body) = request.into_parts();
    let Ok(bytes) = body::to_bytes(body, 16 << 10).await else {
        return (StatusCode::PAYLOAD_TOO_LARGE, "the form is too large").into_response();
    };
    let key = std::str::from_utf8(&bytes).ok().and_then(|form| {
        form.split('&')
            .find_map(|field| field.strip_prefix("idempotency_key="))
            .filter(|k| !k.is_empty() && k.bytes().all(|b| b.is_ascii_hexdigit()))
    });
    if let Some(key) = key {
        let value = HeaderValue::from_str(&format!("\"{key}\"")).expect("hex digits");
        parts.headers.insert("idempotency-key", value);
    }
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

/// The application: the form, and its POST behind the layer.
pub fn router(store: Store<Sqlite>) -> Router {
    // One user in this example; an application with accounts passes the session's user id
    // with `.principal(|parts| ...)`, so that two users' keys never meet.
    let idempotency = IdempotencyLayer::new(store, "invoices.send").single_tenant();
    Router::new()
        .route("/", get(form))
        .route(
            "/invoices",
            axum::routing::post(send_invoice).layer(idempotency),
        )
        .layer(from_fn(key_from_form))
}

/// Opens (creating) the SQLite database at `path` with the example's tables and the markers.
pub async fn open(path: &Path) -> Result<(SqlitePool, Store<Sqlite>), Box<dyn std::error::Error>> {
    let options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal);
    let pool = SqlitePoolOptions::new().connect_with(options).await?;
    for ddl in [
        "CREATE TABLE IF NOT EXISTS invoices (id INTEGER PRIMARY KEY, customer TEXT NOT NULL, \
         amount_cents INTEGER NOT NULL, sent_at TEXT NOT NULL)",
        "CREATE TABLE IF NOT EXISTS emails_to_send (id INTEGER PRIMARY KEY, \
         invoice_id INTEGER NOT NULL REFERENCES invoices (id), recipient TEXT NOT NULL, \
         subject TEXT NOT NULL)",
    ] {
        sqlx::query(ddl).execute(&pool).await?;
    }
    let store = Store::new(pool.clone());
    store.migrate().await?;
    Ok((pool, store))
}

#[allow(dead_code)]
#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("idem-invoice-button-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let (_pool, store) = open(&dir.join("invoices.db")).await?;
    let addr = std::env::var("IDEM_INVOICE_ADDR").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("open http://{addr} and double-click \"Send invoice\" (Ctrl-C stops)");
    axum::serve(listener, router(store)).await?;
    Ok(())
}
