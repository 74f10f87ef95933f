//! The soak's jobs and their `#[idempotent]` handlers, shared by the harness (which publishes
//! and checks) and the workers (which run them).
//!
//! A job's number decides everything about it: its database (even on PostgreSQL, odd on
//! MariaDB), its mode (every third one charges through the payments API in lease mode, every
//! third write an effect row through group commit, the others write one in transaction
//! mode) and its broker (RabbitMQ or JetStream, by pairs). JetStream's transaction-mode jobs
//! are applied in batches, one claim per database for the jobs of a fetch; the group-commit
//! jobs of a fetch, and RabbitMQ's (a prefetch of several in flight), run concurrently and
//! meet in the worker's groups.

use idem::Lease;
use serde::{Deserialize, Serialize};
use sqlx::{MySql, Postgres, Transaction};

/// The scope of every transaction-mode job, shared on purpose by the single, the batch and
/// the group-commit handlers: a job applied one way is a duplicate to the others.
pub const EFFECT_SCOPE: &str = "chaos.effect";
/// The scope of the lease-mode charges.
pub const CHARGE_SCOPE: &str = "chaos.charge";
/// The table of effects: one row per application, without a unique index, so that an effect
/// applied twice shows as two rows.
pub const EFFECTS: &str = "chaos_effects";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Db {
    Pg,
    My,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Mode {
    Tx,
    Lease,
    /// Transaction mode through group commit: an effect row, in scope [`EFFECT_SCOPE`].
    Group,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Broker {
    Rabbit,
    Nats,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Job {
    pub id: String,
    pub n: u64,
    pub db: Db,
    pub mode: Mode,
    pub amount: i64,
}

impl Job {
    pub fn new(n: u64) -> Job {
        Job {
            id: format!("job-{n:06}"),
            n,
            db: if n.is_multiple_of(2) { Db::Pg } else { Db::My },
            mode: match n % 3 {
                0 => Mode::Lease,
                1 => Mode::Group,
                _ => Mode::Tx,
            },
            amount: 100 + (n % 97) as i64,
        }
    }

    pub fn broker(&self) -> Broker {
        if (self.n / 2).is_multiple_of(2) {
            Broker::Rabbit
        } else {
            Broker::Nats
        }
    }
}

/// A handler's error: idem's own, the database's, or the payments API's.
#[derive(Debug)]
pub enum JobError {
    Idem(idem::Error),
    Database(sqlx::Error),
    Http(String),
    /// The worker's own bound on a delivery ran out (a connection left half-open, say).
    Deadline,
}

impl From<idem::Error> for JobError {
    fn from(e: idem::Error) -> Self {
        JobError::Idem(e)
    }
}

impl From<sqlx::Error> for JobError {
    fn from(e: sqlx::Error) -> Self {
        JobError::Database(e)
    }
}

impl From<reqwest::Error> for JobError {
    fn from(e: reqwest::Error) -> Self {
        JobError::Http(e.to_string())
    }
}

impl JobError {
    /// A short name for the table of nacks.
    pub fn kind(&self) -> &'static str {
        match self {
            JobError::Idem(idem::Error::InProgress { .. }) => "in_progress",
            JobError::Idem(idem::Error::Lease(idem::LeaseError::Lost { .. })) => "lease_lost",
            JobError::Idem(idem::Error::Lease(idem::LeaseError::Timeout { .. })) => "timeout",
            JobError::Idem(idem::Error::NotKept(idem::NotKept::RolledBack { .. })) => "rolled_back",
            JobError::Idem(idem::Error::NotKept(idem::NotKept::Group {
                may_be_kept: true,
                ..
            })) => "group_failed_may_be_kept",
            JobError::Idem(idem::Error::NotKept(idem::NotKept::Group { .. })) => "group_failed",
            JobError::Idem(idem::Error::Database(_)) => "database",
            JobError::Idem(_) => "idem_other",
            JobError::Database(_) => "database",
            JobError::Http(_) => "http",
            JobError::Deadline => "deadline",
        }
    }
}

impl std::fmt::Display for JobError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JobError::Idem(e) => write!(f, "{e}"),
            JobError::Database(e) => write!(f, "{e}"),
            JobError::Http(e) => write!(f, "payments API: {e}"),
            JobError::Deadline => write!(f, "the delivery ran out of time"),
        }
    }
}

/// What the lease-mode handlers send to the payments API.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ChargeRequest {
    pub job: String,
    pub amount: i64,
}

#[idem::idempotent(key = "job.id", scope = "chaos.effect", wait = "2s")]
pub async fn effect_pg(
    tx: &mut Transaction<'_, Postgres>,
    job: &Job,
    via: &str,
) -> Result<(), JobError> {
    sqlx::query("INSERT INTO chaos_effects (job, via) VALUES ($1, $2)")
        .bind(&job.id)
        .bind(via)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

#[idem::idempotent(key = "job.id", scope = "chaos.effect", wait = "2s")]
pub async fn effect_my(
    tx: &mut Transaction<'_, MySql>,
    job: &Job,
    via: &str,
) -> Result<(), JobError> {
    sqlx::query("INSERT INTO chaos_effects (job, via) VALUES (?, ?)")
        .bind(&job.id)
        .bind(via)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// [`effect_pg`] through group commit: the caller passes the worker's `idem::Group`.
#[idem::idempotent(key = "job.id", scope = "chaos.effect", group, wait = "2s")]
pub async fn effect_grouped_pg(
    tx: &mut Transaction<'_, Postgres>,
    job: &Job,
    via: &str,
) -> Result<(), JobError> {
    sqlx::query("INSERT INTO chaos_effects (job, via) VALUES ($1, $2)")
        .bind(&job.id)
        .bind(via)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// [`effect_my`] through group commit.
#[idem::idempotent(key = "job.id", scope = "chaos.effect", group, wait = "2s")]
pub async fn effect_grouped_my(
    tx: &mut Transaction<'_, MySql>,
    job: &Job,
    via: &str,
) -> Result<(), JobError> {
    sqlx::query("INSERT INTO chaos_effects (job, via) VALUES (?, ?)")
        .bind(&job.id)
        .bind(via)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

#[idem::idempotent(key = "job.id", scope = "chaos.effect", batch = "jobs", wait = "2s")]
pub async fn effects_pg(tx: &mut Transaction<'_, Postgres>, jobs: &[Job]) -> Result<(), JobError> {
    for job in jobs {
        sqlx::query("INSERT INTO chaos_effects (job, via) VALUES ($1, 'batch')")
            .bind(&job.id)
            .execute(&mut **tx)
            .await?;
    }
    Ok(())
}

#[idem::idempotent(key = "job.id", scope = "chaos.effect", batch = "jobs", wait = "2s")]
pub async fn effects_my(tx: &mut Transaction<'_, MySql>, jobs: &[Job]) -> Result<(), JobError> {
    for job in jobs {
        sqlx::query("INSERT INTO chaos_effects (job, via) VALUES (?, 'batch')")
            .bind(&job.id)
            .execute(&mut **tx)
            .await?;
    }
    Ok(())
}

/// The outside effect: a charge the payments API makes once per `Idempotency-Key`. The lease
/// is short so that a worker killed or stopped in the body is taken over within seconds; the
/// macro makes the handler generic over the store's database.
#[idem::idempotent(key = "job.id", scope = "chaos.charge", lease = "4s", timeout = "2s")]
pub async fn charge(
    lease: &Lease,
    job: &Job,
    http: &reqwest::Client,
    url: &str,
) -> Result<(), JobError> {
    http.post(url)
        .header("Idempotency-Key", lease.idempotency_key())
        .timeout(lease.remaining())
        .json(&ChargeRequest {
            job: job.id.clone(),
            amount: job.amount,
        })
        .send()
        .await?
        .error_for_status()?;
    Ok(())
}
