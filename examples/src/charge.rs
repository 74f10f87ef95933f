//! The `charge_once` example's job and lease-mode handler: a charge through the payments API
//! of [`payments`](crate::payments), once per job.

use crate::payments::{ChargeRequest, PaymentsApi, Receipt};

/// A charge job as the broker hands it over.
pub struct Charge {
    pub id: String,
    pub customer: String,
    pub amount: i64,
}

/// The worker's error: a failed HTTP call, or idem's (timeout, lease lost, in progress).
#[derive(Debug)]
pub enum ChargeError {
    Http(reqwest::Error),
    Idem(idem::Error),
}

impl From<reqwest::Error> for ChargeError {
    fn from(e: reqwest::Error) -> Self {
        ChargeError::Http(e)
    }
}

impl From<idem::Error> for ChargeError {
    fn from(e: idem::Error) -> Self {
        ChargeError::Idem(e)
    }
}

impl std::fmt::Display for ChargeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChargeError::Http(e) => write!(f, "the payments API failed: {e}"),
            ChargeError::Idem(e) => write!(f, "{e}"),
        }
    }
}

/// The outside system and how to reach it.
pub struct Api {
    pub http: reqwest::Client,
    pub payments: PaymentsApi,
}

/// Charges the job's customer once, however often the job is delivered.
///
/// The body has 5 s (`timeout`) and the lease 30 s: a delivery that finds the key held by a
/// live lease gets `InProgress`, and only a lease that ran out can be taken over.
#[idem::idempotent(
    key = "job.id",
    scope = "billing.charge",
    lease = "30s",
    timeout = "5s"
)]
pub async fn charge_once(
    lease: &idem::Lease,
    job: &Charge,
    api: &Api,
) -> Result<Receipt, ChargeError> {
    let request = ChargeRequest {
        customer: job.customer.clone(),
        amount: job.amount,
    };
    // The key and the timeout from the lease; sent as it is rather than through `Lease::send`,
    // which would class a timeout as unknown and keep the lease: this example's story shows
    // the redelivery right after a timeout answered from the API's idempotency store.
    let receipt = lease
        .request(api.http.post(api.payments.charges_url()))
        .json(&request)
        .send()
        .await?
        .error_for_status()?
        .json::<Receipt>()
        .await?;
    Ok(receipt)
}
