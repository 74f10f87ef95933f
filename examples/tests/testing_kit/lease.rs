//! The kit on `charge_once`, lease mode against the payments API on loopback, and on a
//! broken copy whose `Idempotency-Key` changes with each attempt.

use idem::testing::{Got, deliver_concurrently, deliver_twice, expire_lease, fail_before_commit};
use idem_examples::charge::{Api, Charge, ChargeError, charge_once};
use idem_examples::payments::{ChargeRequest, PaymentsApi, Receipt};

use crate::{SqliteFile, panic_of};

// --- charge_once, lease mode with the payments API ------------------------------------------

async fn payments() -> Api {
    Api {
        http: reqwest::Client::new(),
        payments: PaymentsApi::start().await.unwrap(),
    }
}

fn charge() -> Charge {
    Charge {
        id: "charge-1".into(),
        customer: "alice".into(),
        amount: 4200,
    }
}

/// How many charges the API made (a replayed answer is not one).
async fn charges(api: &Api) -> u64 {
    api.payments.totals().charges
}

#[tokio::test]
async fn charge_twice_charges_once() {
    let (db, api, job) = (
        SqliteFile::new("charge-twice").await,
        payments().await,
        charge(),
    );
    let report = deliver_twice(|| charge_once(&db.store, &job, &api), || charges(&api), 1).await;
    assert_eq!(report.got(), [Got::Applied, Got::Duplicate], "{report}");
    assert_eq!(api.payments.totals().replayed, 0);
}

#[tokio::test]
async fn charge_four_at_once_charges_once() {
    let (db, api, job) = (
        SqliteFile::new("charge-race").await,
        payments().await,
        charge(),
    );
    let report = deliver_concurrently(
        4,
        || charge_once(&db.store, &job, &api),
        || charges(&api),
        1,
    )
    .await;
    // The holder completes only after the three others asked: each found its live lease and
    // got InProgress at once; redelivered afterwards, each is a duplicate.
    let got = report.got();
    let (racing, redelivered) = got.split_at(4);
    let mut racing = racing.to_vec();
    racing.sort_by_key(|g| *g != Got::Applied);
    assert_eq!(
        racing,
        [
            Got::Applied,
            Got::InProgress,
            Got::InProgress,
            Got::InProgress
        ],
        "{report}"
    );
    assert_eq!(redelivered, [Got::Duplicate; 3], "{report}");
}

#[tokio::test]
async fn charge_failed_completion_is_released_and_retried_with_the_same_key() {
    let (db, api, job) = (
        SqliteFile::new("charge-commit").await,
        payments().await,
        charge(),
    );
    let report =
        fail_before_commit(|| charge_once(&db.store, &job, &api), || charges(&api), 1).await;
    assert_eq!(
        report.got(),
        [Got::Injected, Got::Applied, Got::Duplicate],
        "{report}"
    );
    let attempts: Vec<_> = report.deliveries().iter().map(|d| d.attempt()).collect();
    assert_eq!(attempts, [Some(1), Some(2), None], "{report}");
    // The retry reached the API with the same key and got the first charge back.
    assert_eq!(api.payments.totals().replayed, 1);
    assert!(
        report.deliveries()[0]
            .idem_error()
            .is_some_and(|e| e.contains("right before its completing statement")),
        "{report}"
    );
}

#[tokio::test]
async fn charge_expired_lease_is_taken_over_and_fenced() {
    let (db, api, job) = (
        SqliteFile::new("charge-expire").await,
        payments().await,
        charge(),
    );
    let report = expire_lease(|| charge_once(&db.store, &job, &api), || charges(&api), 1).await;
    assert_eq!(
        report.got(),
        [Got::LeaseLost, Got::Applied, Got::Duplicate],
        "{report}"
    );
    let attempts: Vec<_> = report.deliveries().iter().map(|d| d.attempt()).collect();
    assert_eq!(attempts, [Some(1), Some(2), None], "{report}");
    // Delivery 1 went on after the takeover and called the API with the same key: answered
    // from the API's idempotency store, not charged again.
    assert_eq!(api.payments.totals().replayed, 1);
    let marker = db
        .store
        .inspect("billing.charge", "charge-1")
        .await
        .unwrap();
    // The token is the takeover's (from the database's clock: positive), on its second attempt.
    let marker = marker.map(|m| (m.token.is_some_and(|t| t > 0), m.attempts));
    assert_eq!(marker, Some((true, 2)));
}

/// Broken on purpose: the `Idempotency-Key` changes with each attempt, so the API cannot tell
/// a retry from a new charge.
#[idem::idempotent(
    key = "job.id",
    scope = "billing.charge_unkeyed",
    lease = "30s",
    timeout = "5s"
)]
async fn charge_per_attempt(
    lease: &idem::Lease,
    job: &Charge,
    api: &Api,
) -> Result<Receipt, ChargeError> {
    let request = ChargeRequest {
        customer: job.customer.clone(),
        amount: job.amount,
    };
    let key = format!("{}#{}", lease.idempotency_key(), lease.attempt());
    Ok(api
        .http
        .post(api.payments.charges_url())
        .header("Idempotency-Key", key)
        .timeout(lease.remaining())
        .json(&request)
        .send()
        .await?
        .error_for_status()?
        .json::<Receipt>()
        .await?)
}

#[tokio::test]
async fn an_outside_call_without_a_stable_key_is_caught() {
    let (db, api, job) = (
        SqliteFile::new("unkeyed-expire").await,
        payments().await,
        charge(),
    );
    let message = panic_of(expire_lease(
        || charge_per_attempt(&db.store, &job, &api),
        || charges(&api),
        1,
    ))
    .await;
    assert!(
        message.starts_with(
            "idem::testing::expire_lease: after delivery 2 took the key over and delivery 1 \
             went on, the check read 2, not 1 (before: 0).\nthe outside effect happened more \
             than once"
        ),
        "{message}"
    );
    assert!(message.contains("LeaseLost"), "{message}");
    assert_eq!(api.payments.totals().charges, 2);

    let (db, api, job) = (
        SqliteFile::new("unkeyed-commit").await,
        payments().await,
        charge(),
    );
    let message = panic_of(fail_before_commit(
        || charge_per_attempt(&db.store, &job, &api),
        || charges(&api),
        1,
    ))
    .await;
    assert!(
        message.starts_with(
            "idem::testing::fail_before_commit: after delivery 1 failed and delivery 2 \
             applied, the check read 2, not 1 (before: 0).\nthe outside effect happened more \
             than once"
        ),
        "{message}"
    );
}
