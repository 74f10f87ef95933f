//! The job type, the error type and the handlers the cases deliver jobs to. Every handler is
//! generic over the database and names its scope.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use idem::Outcome;
use sqlx::Transaction;
use tokio::sync::Notify;

use super::db::{Bind, TestDb};

/// The error type of every test handler.
#[derive(Debug)]
pub(crate) enum TestError {
    Idem(idem::Error),
    Db(sqlx::Error),
    Refused,
}

/// The consumer loop's view of the tests' error: the idem error it carries decides; the
/// body's own refusal is not permanent (retried).
impl idem::Classify for TestError {
    fn idem_error(&self) -> Option<&idem::Error> {
        match self {
            TestError::Idem(e) => Some(e),
            TestError::Db(e) => e.idem_error(),
            TestError::Refused => None,
        }
    }
}

impl From<idem::Error> for TestError {
    fn from(e: idem::Error) -> Self {
        TestError::Idem(e)
    }
}

impl From<sqlx::Error> for TestError {
    fn from(e: sqlx::Error) -> Self {
        TestError::Db(e)
    }
}

/// One job: its idempotency key, and the effect row (`id`, `amount`) its handlers insert into
/// the `effects` table.
#[derive(Clone, Debug)]
pub(crate) struct Job {
    pub(crate) key: String,
    pub(crate) id: i64,
    pub(crate) amount: i64,
    pub(crate) effects: String,
}

/// What `apply` does after its effect statement.
#[derive(Debug)]
pub(crate) enum Then {
    Commit,
    Fail,
    Panic,
    /// Prints `IN_BODY` and waits forever (until the process is killed).
    Hang,
}

/// Parks the first body that enters (the one holding the key) until the test releases it, so
/// that the test can watch the other deliveries queue up behind the key.
#[derive(Default)]
pub(crate) struct Hold {
    taken: AtomicBool,
    entered: Notify,
    release: Notify,
}

impl Hold {
    /// In a body: the first caller signals [`entered`](Hold::entered) and waits for
    /// [`release`](Hold::release); later callers pass straight through.
    pub(crate) async fn park_first(&self) {
        if !self.taken.swap(true, Ordering::SeqCst) {
            self.entered.notify_one();
            self.release.notified().await;
        }
    }

    /// Resolves once a body is parked (a stored permit if it parked already).
    pub(crate) async fn entered(&self) {
        self.entered.notified().await;
    }

    /// Lets the parked body go on (a stored permit if it has not started waiting yet).
    pub(crate) fn release(&self) {
        self.release.notify_one();
    }
}

pub(crate) async fn insert_effect<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
    origin: &str,
) -> Result<(), sqlx::Error> {
    let sql = format!(
        "INSERT INTO {} (id, amount, origin) VALUES ($1, $2, $3)",
        job.effects
    );
    let binds = [
        Bind::I64(job.id),
        Bind::I64(job.amount),
        Bind::Str(origin.to_owned()),
    ];
    DB::execute(&mut **tx, &sql, &binds).await?;
    Ok(())
}

#[idem::idempotent(key = "job.key", scope = "apply")]
pub(crate) async fn apply<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
    then: Then,
) -> Result<i64, TestError> {
    insert_effect(tx, job, "apply").await?;
    match then {
        Then::Commit => Ok(job.amount),
        Then::Fail => Err(TestError::Refused),
        Then::Panic => panic!("handler panics on purpose (conformance test)"),
        Then::Hang => match hang_in_body().await {},
    }
}

/// Prints `IN_BODY` and waits forever: a body for the worker process a test kills there.
pub(crate) async fn hang_in_body() -> std::convert::Infallible {
    {
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        writeln!(out, "IN_BODY").expect("stdout");
        out.flush().expect("stdout");
    }
    std::future::pending().await
}

/// `apply`, whose first body parks on `hold`.
#[idem::idempotent(key = "job.key", scope = "apply")]
pub(crate) async fn apply_holding<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
    hold: &Hold,
) -> Result<i64, TestError> {
    insert_effect(tx, job, "apply").await?;
    hold.park_first().await;
    Ok(job.amount)
}

/// Fails (after its effect statement) while `failures` is above zero, counting it down; the
/// first body parks on `hold` before it fails.
#[idem::idempotent(key = "job.key", scope = "apply")]
pub(crate) async fn apply_unless_told_to_fail<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
    failures: &AtomicUsize,
    hold: &Hold,
) -> Result<i64, TestError> {
    use std::sync::atomic::Ordering::SeqCst;
    insert_effect(tx, job, "apply").await?;
    hold.park_first().await;
    if failures
        .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
        .is_ok()
    {
        return Err(TestError::Refused);
    }
    Ok(job.amount)
}

/// Same key, another scope.
#[idem::idempotent(key = "job.key", scope = "conformance.elsewhere")]
pub(crate) async fn apply_elsewhere<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
) -> Result<i64, TestError> {
    insert_effect(tx, job, "elsewhere").await?;
    Ok(job.amount)
}

/// The effect, then a second statement into `table` that may violate a constraint.
#[idem::idempotent(key = "job.key", scope = "apply")]
pub(crate) async fn apply_and_insert<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
    table: &str,
    value: i64,
) -> Result<i64, TestError> {
    insert_effect(tx, job, "apply").await?;
    let sql = format!("INSERT INTO {table} (v) VALUES ($1)");
    DB::execute(&mut **tx, &sql, &[Bind::I64(value)]).await?;
    Ok(job.amount)
}

pub(crate) fn applied(result: Result<Outcome<i64>, TestError>) -> i64 {
    match result {
        Ok(Outcome::Applied(v)) => v,
        other => panic!("expected Applied, got {other:?}"),
    }
}

pub(crate) fn duplicate(result: Result<Outcome<i64>, TestError>) {
    match result {
        Ok(Outcome::Duplicate | Outcome::Replayed(_)) => {}
        other => panic!("expected Duplicate, got {other:?}"),
    }
}

/// The jobs of the multi-process test: `job-<i>` with effect row `(i, amount)`.
pub(crate) fn many_jobs(n: i64, effects: &str) -> Vec<Job> {
    (0..n)
        .map(|i| Job {
            key: format!("job-{i}"),
            id: i,
            amount: 1 + (i * 7919) % 1000,
            effects: effects.to_owned(),
        })
        .collect()
}
