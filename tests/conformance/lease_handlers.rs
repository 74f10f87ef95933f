//! Lease-mode handlers and the "outside system" they call: a payments provider that
//! deduplicates on the idempotency key. Every handler here shares the scope [`SCOPE`], so they
//! are different behaviours of one job type and see each other's markers.

use std::sync::Mutex;

use idem::{Lease, Outcome};
use sqlx::Pool;

use super::db::{Bind, TestDb};
use super::handlers::{Hold, Job, TestError};

/// The scope of every lease handler (and of the hand-made leases of the cases).
pub(crate) const SCOPE: &str = "billing.charge";

/// What a lease body saw: its fencing token, its attempt and the idempotency key it sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Seen {
    pub(crate) token: i64,
    pub(crate) attempt: u32,
    pub(crate) idempotency_key: String,
}

impl Seen {
    pub(crate) fn of(lease: &Lease) -> Seen {
        Seen {
            token: lease.token(),
            attempt: lease.attempt(),
            idempotency_key: lease.idempotency_key().to_owned(),
        }
    }
}

/// The outside system: every request is recorded with its idempotency key, in memory and, when
/// `table` is set, as a row `(key, n)` of a table written on a pool of its own (never the
/// store's). A provider that deduplicates on the key charges once per distinct key.
pub(crate) struct Provider<DB: TestDb> {
    requests: Mutex<Vec<String>>,
    table: Option<(Pool<DB>, String)>,
}

impl<DB: TestDb> Provider<DB> {
    pub(crate) fn in_memory() -> Self {
        Provider {
            requests: Mutex::new(Vec::new()),
            table: None,
        }
    }

    /// Records requests in `table` `(idempotency_key VARCHAR(255), n BIGINT)` through `pool`.
    pub(crate) fn table(pool: Pool<DB>, table: &str) -> Self {
        Provider {
            requests: Mutex::new(Vec::new()),
            table: Some((pool, table.to_owned())),
        }
    }

    /// One request of the charge `idempotency_key`; `n` is stored with it (the token).
    pub(crate) async fn charge(&self, idempotency_key: &str, n: i64) -> Result<(), TestError> {
        self.requests
            .lock()
            .expect("provider")
            .push(idempotency_key.to_owned());
        if let Some((pool, table)) = &self.table {
            record_charge::<DB>(pool, table, idempotency_key, n).await?;
        }
        Ok(())
    }

    /// Whether this process sent a request with `idempotency_key`: what a step's verify asks.
    pub(crate) fn saw(&self, idempotency_key: &str) -> bool {
        let requests = self.requests.lock().expect("provider");
        requests.iter().any(|k| k == idempotency_key)
    }

    /// Requests this process made.
    pub(crate) fn requests(&self) -> usize {
        self.requests.lock().expect("provider").len()
    }

    /// Charges a deduplicating provider made from this process's requests: distinct keys.
    pub(crate) fn charges(&self) -> usize {
        let mut keys = self.requests.lock().expect("provider").clone();
        keys.sort();
        keys.dedup();
        keys.len()
    }
}

/// The provider's record of one request, on the provider's own pool.
pub(crate) async fn record_charge<DB: TestDb>(
    pool: &Pool<DB>,
    table: &str,
    idempotency_key: &str,
    n: i64,
) -> Result<(), sqlx::Error> {
    let mut conn = pool.acquire().await?;
    let sql = format!("INSERT INTO {table} (idempotency_key, n) VALUES ($1, $2)");
    let binds = [Bind::Str(idempotency_key.to_owned()), Bind::I64(n)];
    DB::execute(&mut conn, &sql, &binds).await?;
    Ok(())
}

/// What [`charge`] does around its request.
pub(crate) enum How<'a> {
    /// Request, `Ok`.
    Pay,
    /// Request, then the handler's own error.
    Fail,
    /// Request, then a panic.
    Panic,
    /// Request, park on `hold` (the first body only), `Ok`.
    Park(&'a Hold),
}

/// The everyday lease handler: 30 s lease, 10 s timeout.
#[idem::idempotent(
    key = "job.key",
    scope = "billing.charge",
    lease = "30s",
    timeout = "10s"
)]
pub(crate) async fn charge<DB: TestDb>(
    lease: &Lease,
    job: &Job,
    provider: &Provider<DB>,
    how: How<'_>,
) -> Result<Seen, TestError> {
    provider
        .charge(lease.idempotency_key(), lease.token())
        .await?;
    match how {
        How::Pay => {}
        How::Fail => return Err(TestError::Refused),
        How::Panic => panic!("lease body panics on purpose (conformance test)"),
        How::Park(hold) => hold.park_first().await,
    }
    Ok(Seen::of(lease))
}

/// A call that stalls: the request goes out and its answer never comes until `answer` is
/// notified (the test does that only after the call returned). 30 s lease, 300 ms timeout.
#[idem::idempotent(
    key = "job.key",
    scope = "billing.charge",
    lease = "30s",
    timeout = "300ms"
)]
pub(crate) async fn charge_stalling<DB: TestDb>(
    lease: &Lease,
    job: &Job,
    provider: &Provider<DB>,
    answer: &tokio::sync::Notify,
) -> Result<Seen, TestError> {
    provider
        .charge(lease.idempotency_key(), lease.token())
        .await?;
    answer.notified().await;
    Ok(Seen::of(lease))
}

/// The worker process of `worker_killed_inside_the_call_...`: the request reaches the
/// provider, the process prints `IN_CALL <idempotency key>` and the answer never comes.
/// 8 s lease (default timeout 6.4 s): long enough for the parent to see it live.
#[idem::idempotent(key = "job.key", scope = "billing.charge", lease = "8s")]
pub(crate) async fn charge_and_hang<DB: TestDb>(
    lease: &Lease,
    job: &Job,
    provider: &Provider<DB>,
) -> Result<Seen, TestError> {
    provider
        .charge(lease.idempotency_key(), lease.token())
        .await?;
    print_line(&format!(
        "IN_CALL {} token={}",
        lease.idempotency_key(),
        lease.token()
    ));
    let never: std::convert::Infallible = std::future::pending().await;
    match never {}
}

/// The worker process of `paused_holder_...`: makes its request, prints `IN_BODY`, then its
/// thread blocks on stdin until the parent writes a line. The body is inside one `poll` the
/// whole time, so the timeout (polled only after the body returns `Pending`) cannot cut it:
/// what ends the body is the parent's line, as when a paused process resumes and its
/// finished call returns. 1 s lease.
#[idem::idempotent(key = "job.key", scope = "billing.charge", lease = "1s")]
pub(crate) async fn charge_then_block<DB: TestDb>(
    lease: &Lease,
    job: &Job,
    provider: &Provider<DB>,
) -> Result<Seen, TestError> {
    provider
        .charge(lease.idempotency_key(), lease.token())
        .await?;
    print_line(&format!("IN_BODY token={}", lease.token()));
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).expect("read stdin");
    assert_eq!(line.trim(), "GO", "unexpected order {line:?}");
    Ok(Seen::of(lease))
}

fn print_line(line: &str) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").expect("stdout");
    out.flush().expect("stdout");
}

pub(crate) fn applied_seen(result: Result<Outcome<Seen>, TestError>) -> Seen {
    match result {
        Ok(Outcome::Applied(seen)) => seen,
        other => panic!("expected Applied, got {other:?}"),
    }
}

pub(crate) fn duplicate_seen(result: Result<Outcome<Seen>, TestError>) {
    match result {
        Ok(Outcome::Duplicate) => {}
        other => panic!("expected Duplicate, got {other:?}"),
    }
}

pub(crate) fn in_progress(result: Result<Outcome<Seen>, TestError>) {
    match result {
        Err(TestError::Idem(idem::Error::InProgress { scope, .. })) => assert_eq!(scope, SCOPE),
        other => panic!("expected InProgress, got {other:?}"),
    }
}
