//! A lease handler of three steps (a charge and a mail at the provider, a ledger row written in
//! a database step) and what the cases read back of it: the provider's requests per
//! idempotency key, the ledger rows, the recorded steps.

use idem::{Lease, Outcome};
use serde::{Deserialize, Serialize};
use sqlx::Transaction;

use super::Support;
use super::ctx::Ctx;
use super::db::{Bind, TestDb};
use super::handlers::{Job, TestError, insert_effect};
use super::lease_handlers::Provider;

/// The scope of the checkout handlers.
pub(crate) const CHECKOUT: &str = "shop.checkout";

/// The handler's steps, in their order.
pub(crate) const STEPS: [&str; 3] = ["charge", "mail", "ledger"];

/// What a checkout returns: each step's value, which names the attempt that ran it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Checkout {
    pub(crate) charge: String,
    pub(crate) mail: String,
    pub(crate) ledger: u32,
}

/// Where a checkout stops short of the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stop {
    /// It runs to the end.
    Never,
    /// The body fails after its `n`-th step (the key is released).
    FailAfter(u32),
    /// After its `n`-th step it prints `AFTER_STEP <n>` and waits until the process is
    /// killed.
    HangAfter(u32),
}

impl Stop {
    async fn after(self, n: u32) -> Result<(), TestError> {
        match self {
            Stop::FailAfter(at) if at == n => Err(TestError::Refused),
            Stop::HangAfter(at) if at == n => {
                {
                    use std::io::Write as _;
                    let mut out = std::io::stdout().lock();
                    writeln!(out, "AFTER_STEP {n}").expect("stdout");
                    out.flush().expect("stdout");
                }
                let never: std::convert::Infallible = std::future::pending().await;
                match never {}
            }
            _ => Ok(()),
        }
    }
}

/// Charge, mail (each a request to the provider with the step's idempotency key), then the
/// ledger row (the job's effect row, origin `ledger`) in a database step. `replay` and a
/// fingerprint of the amount.
#[idem::idempotent(
    key = "job.key",
    scope = "shop.checkout",
    lease = "30s",
    timeout = "10s",
    replay,
    fingerprint = "job.amount"
)]
pub(crate) async fn checkout<DB: TestDb>(
    lease: &Lease,
    job: &Job,
    provider: &Provider<DB>,
    stop: Stop,
) -> Result<Checkout, TestError> {
    let attempt = lease.attempt();
    let charge = lease
        .step("charge", |step| async move {
            provider
                .charge(step.idempotency_key(), lease.token())
                .await?;
            Ok::<_, TestError>(format!("ch-{}-attempt-{attempt}", job.id))
        })
        .await?;
    stop.after(1).await?;
    let mail = lease
        .step("mail", |step| async move {
            provider
                .charge(step.idempotency_key(), lease.token())
                .await?;
            Ok::<_, TestError>(format!("mail-{}-attempt-{attempt}", job.id))
        })
        .await?;
    stop.after(2).await?;
    let ledger = lease
        .tx_step("ledger", async |tx: &mut Transaction<'_, DB>| {
            insert_effect(tx, job, "ledger").await?;
            Ok::<_, TestError>(attempt)
        })
        .await?;
    stop.after(3).await?;
    Ok(Checkout {
        charge,
        mail,
        ledger,
    })
}

pub(crate) fn applied_checkout(result: Result<Outcome<Checkout>, TestError>) -> Checkout {
    match result {
        Ok(Outcome::Applied(done)) => done,
        other => panic!("expected Applied, got {other:?}"),
    }
}

/// The idempotency key of step `name` of the checkout of `key`.
pub(crate) fn step_key(key: &str, name: &str) -> String {
    format!(
        "{}:{CHECKOUT}|{}:{key}|{}:{name}",
        CHECKOUT.len(),
        key.len(),
        name.len()
    )
}

impl<S: Support> Ctx<S> {
    /// Requests the provider's table `charges` holds under `idempotency_key`.
    pub(crate) async fn requests_for(&self, charges: &str, idempotency_key: &str) -> i64 {
        let sql = format!("SELECT COUNT(*) FROM {charges} WHERE idempotency_key = $1");
        self.scalar_with(&sql, &[Bind::Str(idempotency_key.to_owned())])
            .await
    }

    /// How often each step of the checkout of `job` reached the provider (charge, mail) or
    /// wrote its row (ledger).
    pub(crate) async fn step_effects(&self, charges: &str, job: &Job) -> [i64; 3] {
        [
            self.requests_for(charges, &step_key(&job.key, "charge"))
                .await,
            self.requests_for(charges, &step_key(&job.key, "mail"))
                .await,
            self.effects_from(job.id, "ledger").await,
        ]
    }

    /// The recorded steps of `key` in `scope`, read through `Store::steps`: `(name,
    /// position, token)`, in order.
    pub(crate) async fn recorded_steps(&self, scope: &str, key: &str) -> Vec<(String, u32, i64)> {
        let steps = self.store.steps(scope, key).await.expect("read the steps");
        steps
            .iter()
            .map(|s| (s.name.clone(), s.position, s.token))
            .collect()
    }

    /// Rows of the steps table, all jobs.
    pub(crate) async fn steps_total(&self) -> i64 {
        self.scalar(&format!(
            "SELECT COUNT(*) FROM {}_steps",
            self.store.table()
        ))
        .await
    }
}

impl std::fmt::Display for TestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TestError::Idem(e) => write!(f, "{e}"),
            TestError::Db(e) => write!(f, "{e}"),
            TestError::Refused => f.write_str("refused on purpose (conformance test)"),
        }
    }
}

/// The text a declined checkout's marker records.
pub(crate) const DECLINED: &str = "refused on purpose (conformance test)";

/// Charges (a step), then fails for good if `decline`: the marker completes as failed.
#[idem::idempotent(
    key = "job.key",
    scope = "shop.checkout",
    lease = "30s",
    timeout = "10s"
)]
pub(crate) async fn pay_or_decline<DB: TestDb>(
    lease: &Lease,
    job: &Job,
    provider: &Provider<DB>,
    decline: bool,
) -> Result<u32, TestError> {
    let _ = job;
    let attempt = lease.attempt();
    let charged = lease
        .step("charge", |step| async move {
            provider
                .charge(step.idempotency_key(), lease.token())
                .await?;
            Ok::<_, TestError>(attempt)
        })
        .await?;
    if decline {
        return Err(lease.permanent(TestError::Refused));
    }
    Ok(charged)
}

/// A transaction-mode handler of the checkouts' scope: the effect row, origin `tx`.
#[idem::idempotent(key = "job.key", scope = "shop.checkout")]
pub(crate) async fn checkout_in_tx<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
) -> Result<i64, TestError> {
    insert_effect(tx, job, "tx").await?;
    Ok(job.amount)
}

/// A batch handler of the checkouts' scope: an effect row per fresh job, origin `batch`.
#[idem::idempotent(key = "job.key", scope = "shop.checkout", batch = "jobs")]
pub(crate) async fn checkout_batch<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    jobs: &[Job],
) -> Result<usize, TestError> {
    for job in jobs {
        insert_effect(tx, job, "batch").await?;
    }
    Ok(jobs.len())
}

/// How the step of [`pay_verified`] ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StepEnd {
    /// `Ok`.
    Ok,
    /// Its error, marked unknown (the call may have happened).
    Unknown,
    /// Its error, plain (transient).
    Fails,
}

/// What [`pay_verified`]'s step does, and what its verify answers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Act {
    /// The request reaches the provider.
    pub(crate) send: bool,
    pub(crate) end: StepEnd,
    /// The verify cannot tell (else it answers by what the provider saw).
    pub(crate) verify_unknown: bool,
}

/// One step with a verify that asks the provider whether it saw the step's key; counts the
/// verifies in `verified`.
#[idem::idempotent(
    key = "job.key",
    scope = "shop.checkout",
    lease = "30s",
    timeout = "10s"
)]
pub(crate) async fn pay_verified<DB: TestDb>(
    lease: &Lease,
    job: &Job,
    provider: &Provider<DB>,
    act: Act,
    verified: &std::sync::atomic::AtomicUsize,
) -> Result<String, TestError> {
    let _ = job;
    let attempt = lease.attempt();
    lease
        .step_verified(
            "charge",
            |step| async move {
                if act.send {
                    provider
                        .charge(step.idempotency_key(), lease.token())
                        .await?;
                }
                match act.end {
                    StepEnd::Ok => Ok(format!("ch-attempt-{attempt}")),
                    StepEnd::Unknown => Err(lease.unknown(TestError::Refused)),
                    StepEnd::Fails => Err(TestError::Refused),
                }
            },
            |step| {
                verified.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let answer = match (act.verify_unknown, provider.saw(step.idempotency_key())) {
                    (true, _) => idem::Verified::Unknown,
                    (false, true) => {
                        idem::Verified::Happened(format!("found-by-attempt-{attempt}"))
                    }
                    (false, false) => idem::Verified::NotHappened,
                };
                async move { Ok::<_, TestError>(answer) }
            },
        )
        .await
}
