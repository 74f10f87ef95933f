//! How a claim begins its transaction: how long it waits for a holder of the same key, and at
//! which isolation level the body runs.

use std::time::Duration;

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

/// Settings of one claim: what `wait` and `isolation` on the attribute set.
///
/// ```
/// # use idem_runtime as idem;
/// use std::time::Duration;
///
/// use idem::{ClaimOptions, Isolation};
///
/// let opts = ClaimOptions::new()
///     .wait(Duration::from_secs(5))
///     .isolation(Isolation::Serializable);
/// # let _ = opts;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ClaimOptions {
    pub(crate) wait: Option<Duration>,
    pub(crate) isolation: Option<Isolation>,
    pub(crate) replay: bool,
}

impl ClaimOptions {
    /// The database's defaults: wait as long as the database does, its default isolation.
    pub const fn new() -> Self {
        ClaimOptions {
            wait: None,
            isolation: None,
            replay: false,
        }
    }

    /// A delivery that finds the key committed reads the value the first delivery stored
    /// (`replay`), to return it as [`Outcome::Replayed`](crate::Outcome::Replayed).
    pub const fn replay(mut self) -> Self {
        self.replay = true;
        self
    }

    /// How long a delivery waits for another delivery that holds the same key before it
    /// gives up with [`Error::InProgress`](crate::Error::InProgress).
    ///
    /// Without it the database's own limit applies: none on PostgreSQL (`lock_timeout` 0),
    /// `innodb_lock_wait_timeout` on MySQL (50 s by default), the connection's busy timeout
    /// on SQLite (5 s in sqlx). See [`Store`](crate::Store) for how each backend sets it.
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
