//! The settings of a claim: how long it waits for a holder of the same key, at which isolation
//! level the body runs, how long a lease lasts; and which kind of call a claim serves.

use std::time::Duration;

use crate::error::{Error, Refusal};
use crate::record::Fingerprint;
use crate::traceparent::TraceParent;

/// The shortest lease: below a second there is no margin left for the completing statement's
/// round trip on a loaded machine, and every slow call would be taken over.
pub const MIN_LEASE: Duration = Duration::from_secs(1);

/// The longest lease: a day. A lease outliving that blocks its job for longer than any broker
/// keeps a delivery invisible (SQS's visibility timeout stops at 12 h, RabbitMQ's consumer
/// timeout defaults to 30 min); work that runs longer renews its lease with
/// [`Lease::renew`](crate::Lease::renew). The bound also keeps the databases' date arithmetic
/// in range (SQLite's overflows to `NULL`, which would read as a released lease).
pub const MAX_LEASE: Duration = Duration::from_secs(24 * 3600);

/// The isolation level of a claim's transaction (`isolation = "..."` on the attribute).
///
/// The default is the database's own (PostgreSQL and SQLite: read committed / serialised
/// writers; MySQL: repeatable read). A claim that loses a race at a stricter level
/// (PostgreSQL `40001`/`40P01`, MySQL `1213`) is retried a few times; a serialization failure
/// of the body's own statements is returned as [`Error::Database`](crate::Error::Database) so
/// that the job is redelivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Isolation {
    /// `REPEATABLE READ`.
    RepeatableRead,
    /// `SERIALIZABLE`.
    Serializable,
}

impl Isolation {
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) fn sql(self) -> &'static str {
        match self {
            Isolation::RepeatableRead => "REPEATABLE READ",
            Isolation::Serializable => "SERIALIZABLE",
        }
    }
}

/// Settings of one claim in a transaction (own, joined or batch): what `wait`, `isolation`,
/// `replay` and `fingerprint` on the attribute set.
///
/// ```
/// # use idem_runtime as idem;
/// use std::time::Duration;
///
/// use idem::{ClaimOptions, Fingerprint, Isolation};
///
/// let opts = ClaimOptions::new()
///     .wait(Duration::from_secs(5))
///     .isolation(Isolation::Serializable)
///     .fingerprint(Fingerprint::of(&("order-7", 1250)).unwrap());
/// # let _ = opts;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ClaimOptions {
    pub(crate) wait: Option<Duration>,
    pub(crate) isolation: Option<Isolation>,
    pub(crate) replay: bool,
    pub(crate) fingerprint: Option<Fingerprint>,
    pub(crate) messaging: Option<Messaging>,
    pub(crate) link: Option<TraceParent>,
}

impl ClaimOptions {
    /// The database's defaults: wait as long as the database does, its default isolation.
    pub const fn new() -> Self {
        ClaimOptions {
            wait: None,
            isolation: None,
            replay: false,
            fingerprint: None,
            messaging: None,
            link: None,
        }
    }

    /// The broker the job came from: the call's span gets OpenTelemetry's messaging
    /// attributes, and the call records `messaging.process.duration` ([`Messaging`]).
    pub const fn messaging(mut self, messaging: Messaging) -> Self {
        self.messaging = Some(messaging);
        self
    }

    /// The producer's span the job was sent from (its message's `traceparent`): the call's
    /// `idem.claim` span links to it, so that the key's producer and consumer spans join in
    /// one trace. An OpenTelemetry span link with the feature `opentelemetry`; without it, the
    /// span's field `traceparent`. `None` links nothing.
    ///
    /// A header from the wire goes through [`TraceParent::from_header`], which ignores a value
    /// that does not parse (with a `debug` event): a producer's bad header must not fail the
    /// job.
    ///
    /// ```
    /// # use idem_runtime as idem;
    /// use idem::{ClaimOptions, TraceParent};
    ///
    /// let header = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    /// let opts = ClaimOptions::new().link(TraceParent::from_header(header));
    /// # let _ = opts;
    /// ```
    pub fn link(mut self, producer: impl Into<Option<TraceParent>>) -> Self {
        self.link = producer.into();
        self
    }

    /// Stores the payload's fingerprint with the marker, and refuses a later delivery of the
    /// key with another one ([`Error::KeyReused`](crate::Error::KeyReused)), whatever the
    /// marker's state.
    pub const fn fingerprint(mut self, fingerprint: Fingerprint) -> Self {
        self.fingerprint = Some(fingerprint);
        self
    }

    /// A delivery that finds the key committed reads the value the first delivery stored
    /// (`replay`), to return it as [`Outcome::Replayed`](crate::Outcome::Replayed).
    pub const fn replay(mut self) -> Self {
        self.replay = true;
        self
    }

    /// How long a delivery waits for another delivery that holds the same key before it
    /// gives up with [`Error::InProgress`](crate::Error::InProgress). It bounds the claim
    /// only: the body's own statements wait as the connection's settings say.
    ///
    /// Without it the database's own limit applies: none on PostgreSQL (`lock_timeout` 0),
    /// `innodb_lock_wait_timeout` on MySQL (50 s by default), the connection's busy timeout
    /// on SQLite (5 s in sqlx). See [`Store`](crate::Store) for how each backend sets it. A
    /// joined claim ([`Store::join`](crate::Store::join)) waits as the caller's transaction
    /// does: its begin is the caller's.
    pub const fn wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }

    /// The isolation level of the claim's transaction.
    pub const fn isolation(mut self, isolation: Isolation) -> Self {
        self.isolation = Some(isolation);
        self
    }

    /// The wait, if one was set.
    pub const fn wait_limit(&self) -> Option<Duration> {
        self.wait
    }

    /// The isolation level, if one was set.
    pub const fn isolation_level(&self) -> Option<Isolation> {
        self.isolation
    }

    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) fn is_default(&self) -> bool {
        self.wait.is_none() && self.isolation.is_none()
    }
}

/// Which kind of call a claim serves: the `mode` of its span, and what the test hooks see.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// A transaction of the call's own.
    Transaction,
    /// A savepoint of the caller's transaction (`store.join(tx)`).
    Joined,
    /// Lease mode.
    Lease,
    /// A batch handler (`batch = ".."`): one claim and one commit for many jobs.
    Batch,
    /// A member of a group ([`Group`](crate::Group)): a savepoint of a transaction shared
    /// with concurrent calls, one commit for all of them.
    Group,
    /// An offset claim: records of a Kafka partition claimed by their offsets, below the
    /// watermark a duplicate.
    Offsets,
}

impl Mode {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Mode::Transaction => "transaction",
            Mode::Joined => "joined",
            Mode::Lease => "lease",
            Mode::Batch => "batch",
            Mode::Group => "group",
            Mode::Offsets => "offsets",
        }
    }
}

/// How long a lease-mode delivery holds its key, how long its body may run, and what its
/// claim stores and waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseOptions {
    pub(crate) lease: Duration,
    pub(crate) timeout: Duration,
    pub(crate) replay: bool,
    pub(crate) wait: Option<Duration>,
    pub(crate) fingerprint: Option<Fingerprint>,
    pub(crate) messaging: Option<Messaging>,
    pub(crate) link: Option<TraceParent>,
}

impl LeaseOptions {
    /// A lease of `lease`, with the body's timeout [`default_timeout`](Self::default_timeout).
    ///
    /// The lease must lie within [`MIN_LEASE`] and [`MAX_LEASE`]: a claim with another one is
    /// refused with [`Refusal::Lease`] before any I/O (the attribute refuses it at compile
    /// time).
    pub const fn new(lease: Duration) -> Self {
        LeaseOptions {
            lease,
            timeout: Self::default_timeout(lease),
            replay: false,
            wait: None,
            fingerprint: None,
            messaging: None,
            link: None,
        }
    }

    /// The broker the job came from, as [`ClaimOptions::messaging`].
    pub const fn messaging(mut self, messaging: Messaging) -> Self {
        self.messaging = Some(messaging);
        self
    }

    /// The producer's span the job was sent from, as [`ClaimOptions::link`].
    pub fn link(mut self, producer: impl Into<Option<TraceParent>>) -> Self {
        self.link = producer.into();
        self
    }

    /// How long the claim may wait behind a delivery in another mode that holds the key in
    /// its transaction (a live lease is [`Error::InProgress`](crate::Error::InProgress) at
    /// once). Without it: no wait on PostgreSQL, a second on MariaDB (it counts lock waits in
    /// whole seconds), the connection's busy timeout on SQLite, whose write lock any writer
    /// holds (answering at once would refuse most claims under load).
    pub const fn wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }

    /// Stores the payload's fingerprint with the marker, and refuses a delivery of the key
    /// with another one ([`Error::KeyReused`](crate::Error::KeyReused)), whether the marker is
    /// completed or still held.
    pub const fn fingerprint(mut self, fingerprint: Fingerprint) -> Self {
        self.fingerprint = Some(fingerprint);
        self
    }

    /// A delivery that finds the key completed gets the first delivery's stored value back
    /// (`replay`).
    pub const fn replay(mut self) -> Self {
        self.replay = true;
        self
    }

    /// The timeout when none is given: the lease minus a safety margin of a fifth of it, at
    /// most 5 s, which leaves the completing statement time to reach the database before any
    /// other delivery may take the key over.
    pub const fn default_timeout(lease: Duration) -> Duration {
        let fifth = lease.as_millis() / 5;
        let margin = if fifth < 5_000 { fifth } else { 5_000 };
        Duration::from_millis((lease.as_millis() - margin) as u64)
    }

    /// The body's timeout. It must be shorter than the lease and longer than zero (the
    /// attribute checks both at compile time; here another one is replaced by the default).
    pub const fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = if timeout.as_nanos() < self.lease.as_nanos() && !timeout.is_zero() {
            timeout
        } else {
            Self::default_timeout(self.lease)
        };
        self
    }

    /// The lease.
    pub const fn lease_len(&self) -> Duration {
        self.lease
    }

    /// The body's timeout.
    pub const fn timeout_len(&self) -> Duration {
        self.timeout
    }

    /// [`Refusal::Lease`] for a lease outside [`MIN_LEASE`]..=[`MAX_LEASE`].
    pub(crate) fn check(&self) -> Result<(), Error> {
        if self.lease < MIN_LEASE || self.lease > MAX_LEASE {
            return Err(Error::Refused(Refusal::Lease { lease: self.lease }));
        }
        Ok(())
    }

    /// The lease in milliseconds, as the statements bind it (checked: at most a day).
    pub(crate) fn lease_ms(&self) -> i64 {
        i64::try_from(self.lease.as_millis()).unwrap_or(i64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_timeout_leaves_a_margin() {
        assert_eq!(
            LeaseOptions::new(Duration::from_secs(30)).timeout_len(),
            Duration::from_secs(25)
        );
        assert_eq!(
            LeaseOptions::new(Duration::from_secs(2)).timeout_len(),
            Duration::from_millis(1600)
        );
        let opts = LeaseOptions::new(Duration::from_secs(30)).timeout(Duration::from_secs(10));
        assert_eq!(opts.timeout_len(), Duration::from_secs(10));
        let zero = LeaseOptions::new(Duration::from_secs(30)).timeout(Duration::ZERO);
        assert_eq!(zero.timeout_len(), Duration::from_secs(25));
    }

    #[test]
    fn leases_are_bounded() {
        for ok in [MIN_LEASE, Duration::from_secs(30), MAX_LEASE] {
            assert!(LeaseOptions::new(ok).check().is_ok(), "{ok:?}");
        }
        for bad in [
            Duration::ZERO,
            Duration::from_millis(999),
            MAX_LEASE + Duration::from_millis(1),
            Duration::from_secs(100_000_000 * 3600),
        ] {
            let err = LeaseOptions::new(bad).check().unwrap_err();
            assert!(
                err.to_string()
                    .contains("a lease must be at least 1s and at most 24h"),
                "{err}"
            );
        }
    }
}

/// The broker a job came from, for OpenTelemetry's messaging attributes: the call's span gets
/// `messaging.system`, `messaging.operation.type = process`, `messaging.destination.name` and
/// `messaging.message.id` (the job's key, shown as [`observe_keys`](crate::observe_keys)
/// says), and its kind is `consumer`; and the call records
/// [`MESSAGING_PROCESS_DURATION`](crate::MESSAGING_PROCESS_DURATION).
///
/// Give it to one claim ([`ClaimOptions::messaging`](crate::ClaimOptions::messaging),
/// [`LeaseOptions::messaging`](crate::LeaseOptions::messaging)), or to every call of a scope,
/// the attribute's handlers included ([`observe_messaging`](crate::observe_messaging)).
///
/// ```
/// # use idem_runtime as idem;
/// let orders = idem::Messaging::new("rabbitmq").destination("orders");
/// idem::observe_messaging("billing.top_up", orders);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Messaging {
    system: &'static str,
    destination: Option<&'static str>,
}

impl Messaging {
    /// Jobs from `system`, as OpenTelemetry names brokers: `rabbitmq`, `kafka`, `aws_sqs`,
    /// `nats`, `gcp_pubsub`, `servicebus`, ...
    pub const fn new(system: &'static str) -> Self {
        Messaging {
            system,
            destination: None,
        }
    }

    /// The queue, topic, subject or stream the jobs are taken from. A name read at run time
    /// becomes `&'static` once per process with `String::leak`.
    pub const fn destination(mut self, name: &'static str) -> Self {
        self.destination = Some(name);
        self
    }

    /// The broker's name.
    pub const fn system(&self) -> &'static str {
        self.system
    }

    /// The destination's name, if given.
    pub const fn destination_name(&self) -> Option<&'static str> {
        self.destination
    }
}
