//! The checkout of the `charge_once` example: three steps of one lease-mode job, each done
//! once however often the job is delivered and wherever the worker dies.
//!
//! 1. `charge`: the payments API (which honours `Idempotency-Key`, given the step's own key),
//!    through `Lease::send`: the lease kept alive while the call runs, a declined card failing
//!    the job for good;
//! 2. `receipt-mail`: the mail sink, which has no idempotency key: the step's record is what
//!    keeps a redelivery from mailing twice, and its verify asks the sink (by the step's key,
//!    sent as `X-Reference`) whether a worker that died before the record had sent it;
//! 3. `ledger`: a row in the shop's own database, written in a database step: the row and the
//!    step's record commit together.

use idem::{Lease, Step, Verified};
use serde::{Deserialize, Serialize};
use sqlx::Sqlite;

use crate::mail::{Lookup, Mail, Sent};
use crate::payments::{ChargeRequest, Receipt};

/// An order to check out, as the broker hands it over.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Order {
    pub id: String,
    pub customer: String,
    pub email: String,
    pub amount: i64,
}

/// What a checkout did: each step's value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Done {
    pub receipt: Receipt,
    pub mail: String,
    pub ledger_row: i64,
}

/// The checkout's error: an outside call that failed (a declined card among them), the shop's
/// database, or idem's own.
#[derive(Debug)]
pub enum ShopError {
    Http(reqwest::Error),
    Db(sqlx::Error),
    Idem(idem::Error),
}

impl From<reqwest::Error> for ShopError {
    fn from(e: reqwest::Error) -> Self {
        ShopError::Http(e)
    }
}

impl From<sqlx::Error> for ShopError {
    fn from(e: sqlx::Error) -> Self {
        ShopError::Db(e)
    }
}

impl From<idem::Error> for ShopError {
    fn from(e: idem::Error) -> Self {
        ShopError::Idem(e)
    }
}

impl std::fmt::Display for ShopError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ShopError::Http(e) => write!(f, "an outside call failed: {e}"),
            ShopError::Db(e) => write!(f, "the shop's database failed: {e}"),
            ShopError::Idem(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for ShopError {}

/// The outside systems, and where a test wants the worker to stop.
pub struct Shop {
    pub http: reqwest::Client,
    pub payments_url: String,
    pub mail_url: String,
    /// A test's: after this step (or in it, after its request: `in:<step>`) the worker prints
    /// `AT <point>` and waits to be killed.
    pub stop_at: Option<String>,
}

impl Shop {
    /// The point `at` of the checkout: the test's worker stops here if told to.
    async fn reached(&self, at: &str) {
        if self.stop_at.as_deref() == Some(at) {
            use std::io::Write as _;
            let mut out = std::io::stdout().lock();
            writeln!(out, "AT {at}").expect("stdout");
            out.flush().expect("stdout");
            drop(out);
            std::future::pending::<()>().await;
        }
    }
}

/// The shop's ledger table, in its own database (the store's).
pub const LEDGER_DDL: &str = "CREATE TABLE IF NOT EXISTS ledger (order_id TEXT NOT NULL, cents INTEGER NOT NULL, charge TEXT NOT NULL)";

/// Checks an order out once: charge, receipt mail, ledger row.
#[idem::idempotent(
    key = "order.id",
    scope = "shop.checkout",
    lease = "30s",
    timeout = "10s",
    replay
)]
pub async fn checkout(lease: &Lease, order: &Order, shop: &Shop) -> Result<Done, ShopError> {
    let receipt: Receipt = lease
        .step("charge", |step| charge(lease, step, order, shop))
        .await?;
    shop.reached("charge").await;
    let mail: String = lease
        .step_verified(
            "receipt-mail",
            |step| mail_receipt(step, order, &receipt, shop),
            |step| mailed(step, shop),
        )
        .await?;
    shop.reached("receipt-mail").await;
    let ledger_row = lease
        .tx_step("ledger", async |tx: &mut idem::Tx<'_, Sqlite>| {
            let row =
                sqlx::query("INSERT INTO ledger (order_id, cents, charge) VALUES (?1, ?2, ?3)")
                    .bind(&order.id)
                    .bind(order.amount)
                    .bind(&receipt.id)
                    .execute(&mut **tx)
                    .await?;
            Ok::<_, ShopError>(row.last_insert_rowid())
        })
        .await?;
    shop.reached("ledger").await;
    Ok(Done {
        receipt,
        mail,
        ledger_row,
    })
}

/// The charge, under the step's idempotency key and time budget. `Lease::send` keeps the lease
/// alive while it runs and classes a failure: a declined card (402) fails the job for good, a
/// 5xx or a refused connection is retried at once, a timeout keeps the lease until it runs out.
async fn charge(
    lease: &Lease,
    step: Step,
    order: &Order,
    shop: &Shop,
) -> Result<Receipt, ShopError> {
    let request = ChargeRequest {
        customer: order.customer.clone(),
        amount: order.amount,
    };
    let post = shop.http.post(format!("{}/charges", shop.payments_url));
    let response = lease.send(step.request(post).json(&request)).await??;
    Ok(response.json::<Receipt>().await?)
}

/// The receipt mail, under the step's key as its reference.
async fn mail_receipt(
    step: Step,
    order: &Order,
    receipt: &Receipt,
    shop: &Shop,
) -> Result<String, ShopError> {
    let mail = Mail {
        to: order.email.clone(),
        subject: format!("Your receipt {} for {} cents", receipt.id, receipt.amount),
    };
    let sent: Sent = shop
        .http
        .post(format!("{}/mail", shop.mail_url))
        .header("X-Reference", step.idempotency_key())
        .timeout(step.remaining())
        .json(&mail)
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    shop.reached("in:receipt-mail").await;
    Ok(sent.id)
}

/// Whether the sink sent the receipt mail under the step's key.
async fn mailed(step: Step, shop: &Shop) -> Result<Verified<String>, ShopError> {
    let lookup = Lookup {
        reference: step.idempotency_key().to_owned(),
    };
    let found: Option<Sent> = shop
        .http
        .post(format!("{}/mail/lookup", shop.mail_url))
        .timeout(step.remaining())
        .json(&lookup)
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    Ok(match found {
        Some(sent) => Verified::Happened(sent.id),
        None => Verified::NotHappened,
    })
}
