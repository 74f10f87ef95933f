//! `Store::doctor`: checks a deployment and says what is wrong and what to do. Each check
//! reads what the database knows (its catalog, its statistics, the markers and messages that
//! wait for an operator) and compares it with what the caller says of the deployment
//! ([`Checkup`]): its retention, its concurrency, the broker's ack timeout.

mod checks;
mod schema;
mod slots;

use std::fmt;
use std::time::Duration;

use crate::backend::Backend;
use crate::error::Error;
use crate::store::Store;

/// What the doctor is told of a deployment, beyond what the database knows. Each check that
/// needs a setting not given is [`Severity::Skipped`], and says which.
///
/// ```
/// # use idem_runtime as idem;
/// use std::time::Duration;
///
/// let checkup = idem::Checkup::new()
///     .retention(Duration::from_secs(7 * 86_400)) // what `purge` is run with
///     .concurrency(8)                             // jobs a worker runs at once
///     .wait(Duration::from_secs(5))               // the handlers' `wait`
///     .ack_timeout(Duration::from_secs(30));      // SQS's visibility timeout, say
/// # let _ = checkup;
/// ```
#[derive(Debug, Clone)]
pub struct Checkup {
    pub(crate) retention: Option<Duration>,
    pub(crate) stuck_after: Duration,
    pub(crate) concurrency: Option<u32>,
    pub(crate) pool_size: Option<u32>,
    pub(crate) wait: Option<Duration>,
    pub(crate) lease: Option<Duration>,
    pub(crate) ack_timeout: Option<Duration>,
    pub(crate) clock_tolerance: Duration,
    pub(crate) relay_lag: Duration,
    pub(crate) slot_lag: i64,
}

impl Default for Checkup {
    fn default() -> Self {
        Checkup::new()
    }
}

impl Checkup {
    /// Nothing told: the checks that need no setting run, the others are skipped. A lease is
    /// stuck an hour after it ran out; the database's clock may be a second off this host's;
    /// an outbox message may wait five minutes past its due time for the relay.
    pub fn new() -> Self {
        Checkup {
            retention: None,
            stuck_after: Duration::from_secs(3600),
            concurrency: None,
            pool_size: None,
            wait: None,
            lease: None,
            ack_timeout: None,
            clock_tolerance: Duration::from_secs(1),
            relay_lag: Duration::from_secs(300),
            slot_lag: 1 << 30,
        }
    }

    /// The age `purge` is run with, for the scopes without a window of their own: markers
    /// older than it (or than their scope's window) mean that purge is not running.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = Some(retention);
        self
    }

    /// How long after its lease ran out (or, released, after its claim) a marker still in
    /// progress counts as stuck: no delivery came back for it.
    pub fn stuck_after(mut self, after: Duration) -> Self {
        self.stuck_after = after;
        self
    }

    /// How many jobs one worker runs at once on this store's pool.
    pub fn concurrency(mut self, jobs: u32) -> Self {
        self.concurrency = Some(jobs);
        self
    }

    /// The workers' pool size, when the store's own pool is not theirs (the `idem` tool's).
    pub fn pool_size(mut self, connections: u32) -> Self {
        self.pool_size = Some(connections);
        self
    }

    /// The handlers' `wait`: how long a delivery waits for another holder of its key.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }

    /// The handlers' lease (lease mode).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// How long the broker waits for an ack before it hands the job out again: SQS's
    /// visibility timeout, RabbitMQ's `consumer_timeout`, JetStream's `ack_wait`, Kafka's
    /// `max.poll.interval.ms`.
    pub fn ack_timeout(mut self, timeout: Duration) -> Self {
        self.ack_timeout = Some(timeout);
        self
    }

    /// How far the database's clock may be from this host's (default 1 s), beyond half the
    /// round trip that read it.
    pub fn clock_tolerance(mut self, tolerance: Duration) -> Self {
        self.clock_tolerance = tolerance;
        self
    }

    /// How many bytes of WAL a WAL relay's slot may be behind (not confirmed) before the
    /// `wal_slots` check warns (1 GiB; PostgreSQL). A slot no relay streams from warns once
    /// it is behind at all, an invalidated one is a problem.
    pub fn slot_lag(mut self, bytes: u64) -> Self {
        self.slot_lag = i64::try_from(bytes).unwrap_or(i64::MAX);
        self
    }
}

/// How bad a finding is. Ordered: the worst of a [`Diagnosis`] decides the `idem doctor`
/// exit code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Severity {
    /// Checked, and fine.
    Ok,
    /// Not checked: the database cannot tell, or the [`Checkup`] did not give what it needs.
    Skipped,
    /// Works today, but costs or will fail: look at it.
    Warning,
    /// Wrong now: jobs may run twice, wait, or be lost until it is fixed.
    Problem,
}

impl Severity {
    /// `ok`, `skipped`, `warning` or `problem`.
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Ok => "ok",
            Severity::Skipped => "skipped",
            Severity::Warning => "warning",
            Severity::Problem => "problem",
        }
    }
}

impl fmt::Display for Severity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One check's verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Finding {
    /// The check: `schema`, `indexes`, `bloat`, `retention`, `leases`, `outbox`, `pool`,
    /// `ack_timeout`, `pooler`, `clock`, `wal_slots`.
    pub check: &'static str,
    /// How bad it is.
    pub severity: Severity,
    /// What was found.
    pub summary: String,
    /// What to do, for a warning or a problem.
    pub fix: Option<String>,
}

impl Finding {
    pub(crate) fn new(check: &'static str, severity: Severity, summary: impl Into<String>) -> Self {
        Finding {
            check,
            severity,
            summary: summary.into(),
            fix: None,
        }
    }

    pub(crate) fn fix(mut self, fix: impl Into<String>) -> Self {
        self.fix = Some(fix.into());
        self
    }
}

/// What [`Store::doctor`] found, one [`Finding`] per check, in the order they ran.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Diagnosis {
    /// The marker table that was checked.
    pub table: String,
    /// Every check's verdict.
    pub findings: Vec<Finding>,
}

impl Diagnosis {
    /// The worst severity found ([`Severity::Ok`] when every check passed or was skipped).
    pub fn worst(&self) -> Severity {
        self.findings
            .iter()
            .map(|f| f.severity)
            .filter(|s| *s != Severity::Skipped)
            .max()
            .unwrap_or(Severity::Ok)
    }

    /// No warning and no problem.
    pub fn is_healthy(&self) -> bool {
        self.worst() == Severity::Ok
    }

    /// The finding of `check`, if it ran.
    pub fn finding(&self, check: &str) -> Option<&Finding> {
        self.findings.iter().find(|f| f.check == check)
    }
}

impl<DB: Backend> Store<DB> {
    /// Checks this store's deployment and says what is wrong and what to do: the schema's
    /// tables and indexes, dead space in the marker table, markers older than their retention
    /// (purge not running), leases stuck in progress, parked or overdue outbox messages, the
    /// pool against the concurrency and the server's connection limit, `wait` and the lease
    /// against the broker's ack timeout, a pooler in front of PostgreSQL, and the database's
    /// clock against this host's. `idem doctor` prints it.
    ///
    /// Read-only. The counts read at most 10 000 rows each; the stuck-lease count reads the
    /// markers in progress, which have no index of their own (as `idem stuck` does): on a
    /// table of many millions of markers, run it off-peak. An `Err` is a database that could
    /// not be reached; everything else is a [`Finding`].
    pub async fn doctor(&self, checkup: &Checkup) -> Result<Diagnosis, Error> {
        checks::run(self, checkup).await
    }

    /// The tables of this database (its current schema) that have the columns of a marker
    /// table: where a store's markers may be, for an operator who does not know the name a
    /// store was given with [`with_table`](Store::with_table).
    pub async fn marker_tables(&self) -> Result<Vec<String>, Error> {
        Ok(self.sql().marker_tables(self.pool()).await?)
    }
}
